# Stall-sample shares of SASS row ranges of the default binned-dp kernel (ncu --page source --csv
# --print-source sass, fit11-run1), and of its instructions by active lanes.
import csv, gzip, sys, io
lines = gzip.open(sys.argv[1], 'rt', errors='replace').read().splitlines()
starts = [i for i, l in enumerate(lines) if l.startswith('"Kernel Name"')]
a, b = starts[0], starts[1]
rows = list(csv.reader(io.StringIO('\n'.join(lines[a + 1:b]))))
hdr = rows[0]; rows = [r for r in rows[1:] if len(r) == len(hdr)]
H = {h: i for i, h in enumerate(hdr)}
f = lambda r, k: float(r[H[k]]) if r[H[k]] not in ('', '-') else 0.0
S = 'Warp Stall Sampling (All Samples)'; I = 'Instructions Executed'; T = 'Thread Instructions Executed'
tot = sum(f(r, S) for r in rows); itot = sum(f(r, I) for r in rows)
def region(lo, hi):
    seg = rows[lo:hi]
    s = sum(f(r, S) for r in seg); i = sum(f(r, I) for r in seg); t = sum(f(r, T) for r in seg)
    return 100 * s / tot, 100 * i / itot, t / max(i, 1)
for name, lo, hi in [('DP layer loop (level by level), rows 3300-3599', 3300, 3600),
                     ('  of it the scan loop body (one cost evaluation), rows 3388-3472', 3388, 3473),
                     ('refinement V table + per-end scans, rows 4500-4899', 4500, 4900)]:
    s, i, t = region(lo, hi)
    print(f'| {name} | {s:.1f} % | {i:.1f} % | {t:.1f} |')
for lo_t, hi_t in [(0, 4.5), (4.5, 16.5), (16.5, 33)]:
    s = sum(f(r, S) for r in rows if f(r, I) > 0 and lo_t <= f(r, T) / f(r, I) < hi_t)
    i = sum(f(r, I) for r in rows if f(r, I) > 0 and lo_t <= f(r, T) / f(r, I) < hi_t)
    print(f'| instructions with {lo_t}-{hi_t} active lanes on average | {100*s/tot:.1f} % | {100*i/itot:.1f} % | |')
body = rows[3388:3473]
print('scan loop body: SASS instructions', len(body), ', executions per tile', f(body[0], I) / 57344)
