# fit16: a per-tile model of the binned DP's work on the compact layout, before any device time:
# warp instructions (static SASS loop sizes of the sm_90a build, nvdisasm) and shared-memory
# wavefronts (an emulation of every lane's LDS/STS addresses with 32 banks x 4 B, identical
# addresses broadcast) for DP mode 0 (divide and conquer level by level), 6 (full ranges, a chunk
# of pairs per lane, fit13) and 9 (fit16: the run-cost table filled once, then 6's layers reading it).
# Tiles: random Gaussian / Student-t(3) BF16 (sigma 0.02), bin edges and the DP as binned_dp.cpp /
# dp.cpp in float64 (run cost = scatter + cnt (mean - nearest E4M3)^2); counts only, not bytes.
# Usage: python3 dp_table_model.py [TILES] [student]
import math, sys, random, struct, bisect
from collections import Counter
random.seed(1)
T = int(sys.argv[1]) if len(sys.argv) > 1 else 40
student = len(sys.argv) > 2 and sys.argv[2] == 'student'
def bf16(v):
    b = struct.unpack('<I', struct.pack('<f', v))[0]
    b = ((b + 0x7fff + ((b >> 16) & 1)) & 0xffff0000)
    return struct.unpack('<f', struct.pack('<I', b))[0]
e4 = []
for e in range(16):
    for mm in range(8):
        if e == 15 and mm == 7: continue
        v = (mm / 8) * 2.0 ** -6 if e == 0 else (1 + mm / 8) * 2.0 ** (e - 7)
        e4 += [v, -v]
e4 = sorted(set(e4))
def nearest(mu):
    k = bisect.bisect_left(e4, mu)
    return min((e4[q] for q in (k - 1, k) if 0 <= q < len(e4)), key=lambda v: abs(v - mu))
# Static SASS sizes (instructions) of the loops, sm_90a, nvcc 13.0 (fit_compact_kernel<4,20,false,6>,
# fit_compact_kernel<2,16,false,9>):
S_CHUNK6 = 172   # dp_layer_chunk step, 2 pairs evaluated (cost_bin_c twice)
S_CHUNK9 = 53    # dp_layer_chunk step, 2 pairs read from the table
S_FILL = 187     # fill_cost_table step, 2 evaluations + the index normalisation
S_LAYER_OVH = 250  # per layer of dp_layer_chunk: length scan, roff/rb stores, binary search, combination
S_SCAN0 = 89     # dp_layer's scan_min body (one evaluation), mode 0
S_LEVEL0 = 150   # dp_layer's per-level work outside the scan (node load, argmin rounds, ballots, stores)
# Shared-memory layout offsets (bytes) inside a warp's SmemCT (only relative addresses matter for banks).
def wavefronts(addrs):
    """addrs: list of (byte address, width) per active lane of one warp instruction."""
    if not addrs: return 0
    words = set()
    for a, w in addrs:
        for wd in range(a // 4, (a + w - 1) // 4 + 1): words.add(wd)
    banks = Counter(wd % 32 for wd in words)
    return max(max(banks.values()), math.ceil(len(words) * 4 / 128))
OFF_BUF, OFF_CI, OFF_T, OFF_SP = 1000, 0, 4096, 20000  # prev row, counts, table, sp (double2)
def tile():
    x = []
    for _ in range(512):
        g = random.gauss(0, 1)
        if student:
            chi = sum(random.gauss(0, 1) ** 2 for _ in range(3)) / 3
            g /= math.sqrt(chi)
        x.append(bf16(0.02 * g))
    am = max(abs(v) for v in x); s = max(int(math.ceil(math.log2(am / 448))) + 127, 3)
    cc_ = Counter(0.0 if v == 0 else v for v in x); u = sorted(cc_); c = [cc_[v] for v in u]; n = len(u)
    cnt = [0]
    for q in c: cnt.append(cnt[-1] + q)
    inv = 2.0 ** (127 - s)
    p1 = [0.0]; p2 = [0.0]
    for q, v in zip(c, u): p1.append(p1[-1] + q * v * inv); p2.append(p2[-1] + q * (v * inv) ** 2)
    pos = [0]; i = 0
    def push(e):
        if e > pos[-1] and e < n: pos.append(e)
    while i < n and cnt[i] < 8: push(i); i += 1
    for b in range(1, 32):
        while i < n and cnt[i] < b * 16: i += 1
        push(i)
    while i < n and cnt[i] <= 504: i += 1
    while i < n: push(i); i += 1
    pos.append(n)
    return pos, [cnt[q] for q in pos], [p1[q] for q in pos], [p2[q] for q in pos]
tot = Counter()
for t in range(T):
    pos, cd, s1, s2 = tile(); m = len(pos) - 1
    def cost(i, j):
        cc = cd[j] - cd[i]; a = s1[j] - s1[i]; b = s2[j] - s2[i]; mean = a / cc
        d = mean - nearest(mean); return (b - a * mean) + cc * d * d
    K = min(m, 8)
    if K == m: continue
    tot['tiles'] += 1; tot['m'] += m
    # --- mode 9's table fill: flat e over (j, i), 1 <= i < j <= m, two per lane and step
    ent = [(i, j) for j in range(2, m + 1) for i in range(1, j)]
    tot['evals9'] += len(ent)
    for e0 in range(0, len(ent), 64):
        tot['instr9'] += S_FILL
        for half in (0, 32):
            act = [ent[e] for e in range(e0 + half, min(e0 + half + 32, len(ent)))]
            if not act: continue
            tot['wf9'] += wavefronts([(OFF_SP + 16 * i, 16) for i, j in act]) + wavefronts([(OFF_SP + 16 * j, 16) for i, j in act])
            tot['wf9'] += wavefronts([(OFF_CI + 2 * i, 2) for i, j in act]) + wavefronts([(OFF_CI + 2 * j, 2) for i, j in act])
            tot['wf9'] += wavefronts([(OFF_T + 8 * (e0 + half + q), 8) for q in range(len(act))])  # STS
    # --- the layers, full ranges (modes 6 and 9) and the divide and conquer (mode 0)
    prev = [0.0] + [cost(0, j) for j in range(1, m + 1)]
    lower = None
    for k in range(2, K):
        cur = [0.0] * (m + 1); opt = [0] * (m + 1)
        pairs = []
        for j in range(k, m + 1):
            lo = max(k - 1, lower[j] if lower else 0)
            best = None; bi = lo
            for ii in range(lo, j):
                pairs.append((ii, j)); v = prev[ii] + cost(ii, j)
                if best is None or v < best: best = v; bi = ii
            cur[j] = best; opt[j] = bi
        tot['pairs'] += len(pairs)
        C = (len(pairs) + 31) // 32
        steps = (C + 1) // 2
        tot['instr6'] += steps * S_CHUNK6 + S_LAYER_OVH
        tot['instr9'] += steps * S_CHUNK9 + S_LAYER_OVH
        for st in range(steps):
            for sub in (0, 1):
                act = []
                for L in range(32):
                    e = L * C + 2 * st + sub
                    if e < min((L + 1) * C, len(pairs)): act.append(pairs[e])
                if not act: continue
                w_prev = wavefronts([(OFF_BUF + 8 * i, 8) for i, j in act])
                tot['wf6'] += w_prev + wavefronts([(OFF_SP + 16 * i, 16) for i, j in act]) + wavefronts([(OFF_SP + 16 * j, 16) for i, j in act]) \
                    + wavefronts([(OFF_CI + 2 * i, 2) for i, j in act]) + wavefronts([(OFF_CI + 2 * j, 2) for i, j in act])
                tot['wf9'] += w_prev + wavefronts([(OFF_T + 8 * ((j - 1) * (j - 2) // 2 + i - 1), 8) for i, j in act])
        # mode 0: the divide and conquer level by level (fit11's model)
        level = [(k, m, k - 1, m - 1)]
        while level:
            cntn = len(level); lg = 0
            while (1 << lg) < cntn: lg += 1
            gs = 32 >> lg; nxt = []; ranges = []
            for (jlo, jhi, ilo, ihi) in level:
                j = (jlo + jhi) >> 1
                lo = max(ilo, k - 1, lower[j] if lower else 0); hi = min(ihi, j - 1); lo = min(lo, hi)
                ranges.append((lo, hi, j))
                bi = opt[j]
                if jlo <= j - 1: nxt.append((jlo, j - 1, ilo, bi))
                if j + 1 <= jhi: nxt.append((j + 1, jhi, bi, ihi))
            iters = max(math.ceil((hi - lo + 1) / gs) for lo, hi, j in ranges)
            tot['instr0'] += iters * S_SCAN0 + S_LEVEL0
            for it in range(iters):
                act = []
                for g, (lo, hi, j) in enumerate(ranges):
                    for sub in range(gs):
                        i = lo + sub + it * gs
                        if i <= hi: act.append((i, j))
                tot['evals0'] += len(act)
                tot['wf0'] += wavefronts([(OFF_BUF + 8 * i, 8) for i, j in act]) + wavefronts([(OFF_SP + 16 * i, 16) for i, j in act]) \
                    + wavefronts([(OFF_SP + 16 * j, 16) for i, j in act]) + wavefronts([(OFF_CI + 2 * i, 2) for i, j in act]) \
                    + wavefronts([(OFF_CI + 2 * j, 2) for i, j in act])
            level = nxt
        prev = cur; lower = opt
n = tot['tiles']
print(f"{'Student-t(3)' if student else 'Gaussian'} BF16, {n} tiles, bin edges m = {tot['m']/n:.1f}, table entries {tot['evals9']/n:.0f}, "
      f"full-range pairs {tot['pairs']/n:.0f}, divide-and-conquer evaluations {tot['evals0']/n:.0f}")
print("| DP layers 2..7 per tile | mode 0 (D&C) | mode 6 (full ranges) | mode 9 (table + 6's layers) |")
print("|---|---|---|---|")
print(f"| cost evaluations | {tot['evals0']/n:.0f} | {tot['pairs']/n:.0f} | {tot['evals9']/n:.0f} |")
print(f"| warp instructions (static loop sizes x trips) | {tot['instr0']/n:.0f} | {tot['instr6']/n:.0f} | {tot['instr9']/n:.0f} |")
print(f"| shared-memory wavefronts (LDS/STS of the loops) | {tot['wf0']/n:.0f} | {tot['wf6']/n:.0f} | {tot['wf9']/n:.0f} |")
