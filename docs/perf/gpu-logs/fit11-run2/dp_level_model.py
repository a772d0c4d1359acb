# fit11: a float64 model of the binned-dp DP levels (run with: python3 dp_level_model.py TILES); prints per (layer, level)
# the nodes, the scan iterations of the group layout, those of an even spread, and the widest range.
# Counts the binned-dp warp kernel's DP scan iterations per tile (one warp, level by level, 32/nodes
# lanes per node) against an even spread of each level's evaluations over 32 lanes, on random
# Gaussian BF16 tiles. A float64 model of dp.cpp (bin edges as binned_dp.cpp, run cost = scatter +
# cnt * (mean - nearest E4M3 * 2^(s-127))^2); counts only, not bytes.
import math, sys, random, struct
random.seed(1)
def bf16(v):
    b = struct.unpack('<I', struct.pack('<f', v))[0]
    b = ((b + 0x7fff + ((b >> 16) & 1)) & 0xffff0000)
    return struct.unpack('<f', struct.pack('<I', b))[0]
e4 = []
for e in range(16):
    for m in range(8):
        if e == 15 and m == 7: continue
        v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        e4 += [v, -v]
e4 = sorted(set(e4))
import bisect
def nearest(mu):
    k = bisect.bisect_left(e4, mu)
    c = [e4[q] for q in (k - 1, k) if 0 <= q < len(e4)]
    return min(c, key=lambda v: abs(v - mu))
from collections import defaultdict
byd = defaultdict(lambda: [0,0,0,0,0]); tot_cur = tot_bal = tot_levels = 0; T = int(sys.argv[1]) if len(sys.argv) > 1 else 200
for t in range(T):
    x = [bf16(random.gauss(0, 0.02)) for _ in range(512)]
    am = max(abs(v) for v in x); s = max(int(math.ceil(math.log2(am / 448))) + 127, 3)
    from collections import Counter
    cc_ = Counter(x); u = sorted(cc_); c = [cc_[v] for v in u]; n = len(u)
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
    pos.append(n); m = len(pos) - 1
    cd = [cnt[q] for q in pos]; s1 = [p1[q] for q in pos]; s2 = [p2[q] for q in pos]
    def cost(i, j):
        cc = cd[j] - cd[i]; a = s1[j] - s1[i]; b = s2[j] - s2[i]; mean = a / cc
        d = mean - nearest(mean); return (b - a * mean) + cc * d * d
    K = min(m, 8)
    if K == m: continue
    prev = [0.0] + [cost(0, j) for j in range(1, m + 1)]
    lower = None
    for k in range(2, K):
        cur = [0.0] * (m + 1); opt = [0] * (m + 1)
        level = [(k, m, k - 1, m - 1)]; depth = 0
        while level:
            cntn = len(level); lg = 0
            while (1 << lg) < cntn: lg += 1
            gs = 32 >> lg
            nxt = []; ranges = []
            for (jlo, jhi, ilo, ihi) in level:
                j = (jlo + jhi) >> 1
                lo = max(ilo, k - 1, lower[j] if lower else 0); hi = min(ihi, j - 1); lo = min(lo, hi)
                best = None; bi = lo
                for ii in range(lo, hi + 1):
                    v = prev[ii] + cost(ii, j)
                    if best is None or v < best: best = v; bi = ii
                cur[j] = best; opt[j] = bi; ranges.append(hi - lo + 1)
                if jlo <= j - 1: nxt.append((jlo, j - 1, ilo, bi))
                if j + 1 <= jhi: nxt.append((j + 1, jhi, bi, ihi))
            tot_cur += max(math.ceil(r / gs) for r in ranges)
            tot_bal += math.ceil(sum(ranges) / 32)
            tot_levels += 1
            dd = byd[(k, depth)]; dd[0] += 1; dd[1] += max(math.ceil(r / gs) for r in ranges); dd[2] += math.ceil(sum(ranges) / 32); dd[3] += max(ranges); dd[4] += len(ranges)
            level = nxt; depth += 1
        prev = cur; lower = opt
print(f'tiles {T}: levels/tile {tot_levels/T:.1f}, scan iterations/tile now {tot_cur/T:.1f}, evenly spread {tot_bal/T:.1f}')

for key in sorted(byd):
    d = byd[key]; print(key, 'nodes %.1f now %.2f even %.2f maxrange %.1f' % (d[4]/d[0], d[1]/d[0], d[2]/d[0], d[3]/d[0]))
