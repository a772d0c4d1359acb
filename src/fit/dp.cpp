// src/fit/dp.cpp: the exact restricted 1-D k-means dynamic programme (spec section 2.1 "optimal").
//
// Problem. Sorted distinct values u_0 < ... < u_{n-1} with multiplicities, scale s, candidate set
// G_s = {finite E4M3 values} * 2^(s-127). Choose at most 8 entries from G_s and assign every
// value to its nearest entry, minimising the squared error. With nearest assignment each entry's
// cluster is a contiguous run of sorted values, so the optimum is a partition of the sorted values
// into at most 8 runs, each run paying
//     cost(run) = min_{c in G_s} sum (x - c)^2 = V(run) + cnt * (mean - c*)^2,
// where V is the run's scatter about its mean and c* is the candidate nearest to the mean
// (the sum is a parabola in c with its vertex at the mean). Conversely any partition's cost is
// achieved by the codebook of its c*'s, and reassigning to nearest entries can only lower it, so
// the DP minimum over partitions equals the minimum over codebooks.
//
// Candidate pruning: only the candidates nearest to some run mean are ever used. A run mean lies
// in [min, max] of the tile, so a candidate outside [min, max] is used only if it is the nearest
// one beyond an end; all others are dominated. e4m3_nearest() realises exactly this set without
// enumerating it (saturation at +-448 is the "nearest beyond" when the tile exceeds the grid).
//
// Speed-up. cost() satisfies the concave Monge (quadrangle) inequality
//     cost(a,c) + cost(b,d) <= cost(a,d) + cost(b,c)   for a <= b <= c <= d:
// let c1 be optimal for [a,d) and c2 for [b,c). h(x) = (x-c2)^2 - (x-c1)^2 is monotone in x; if
// c2 > c1 it decreases, and sum_{[b,c)} h <= 0 (c2 optimal there) forces h <= 0 on [c,d), so
// giving [a,c) c1 and [b,d) c2 costs no more than the right side; if c2 < c1 symmetrically h <= 0
// on [a,b) and [a,c) takes c2, [b,d) takes c1. Hence the leftmost optimal split of layer k is
// monotone in the end position and each layer is solved by divide and conquer in O(n log n)
// cost evaluations (Grønlund et al., "Fast exact k-means, k-medians and Bregman divergence
// clustering in 1D", 2017, section 2).
//
// Precision: prefix sums in double in scaled units (power-of-two scaling is exact). The DP value
// is accurate to ~1e-14 of the tile's energy; the reported error is recomputed exactly afterwards.
#include "fit/dp.hpp"

#include <limits>

namespace lutb::fit_detail {
namespace {

struct Inv {
  double v[kTileSize + 1];
  Inv() {
    v[0] = 0.0;
    for (int i = 1; i <= kTileSize; ++i) v[i] = 1.0 / i;
  }
};
const Inv kInv;

struct Dp {
  // Prefix arrays at the allowed boundary positions, scaled units.
  int c[kTileSize + 1];
  double s1[kTileSize + 1];
  double s2[kTileSize + 1];
  int m = 0;
  double prev[kTileSize + 1];
  double cur[kTileSize + 1];
  std::int16_t opt[kCodebookSize][kTileSize + 1];

  double cost(int i, int j) const {
    const int cc = c[j] - c[i];
    const double a = s1[j] - s1[i];
    const double b = s2[j] - s2[i];
    const double mean = a * kInv.v[cc];
    const double d = mean - e4m3_nearest(mean);
    return (b - a * mean) + cc * (d * d);
  }

  // cur[j] = min_{i in [ilo, ihi], k-1 <= i < j} prev[i] + cost(i, j) for j in [jlo, jhi].
  void solve(int k, int jlo, int jhi, int ilo, int ihi) {
    while (jlo <= jhi) {
      const int j = (jlo + jhi) >> 1;
      const int lo = std::max(ilo, k - 1);
      const int hi = std::min(ihi, j - 1);
      double best = std::numeric_limits<double>::infinity();
      int bi = lo;
      for (int i = lo; i <= hi; ++i) {
        const double v = prev[i] + cost(i, j);
        if (v < best) {
          best = v;
          bi = i;
        }
      }
      cur[j] = best;
      opt[k - 1][j] = static_cast<std::int16_t>(bi);
      // Left half recursively, right half iteratively (keeps the recursion shallow).
      if (jlo <= j - 1) solve(k, jlo, j - 1, ilo, bi);
      jlo = j + 1;
      ilo = bi;
    }
  }
};

}  // namespace

DpResult dp_fit(const SortedTile& st, const int* pos, int m, int scale) {
  thread_local Dp dp;
  const double inv_scale = pow2(127 - scale);
  const double inv_scale2 = inv_scale * inv_scale;
  dp.m = m;
  for (int i = 0; i <= m; ++i) {
    dp.c[i] = st.cnt[pos[i]];
    dp.s1[i] = st.p1[pos[i]] * inv_scale;
    dp.s2[i] = st.p2[pos[i]] * inv_scale2;
  }
  DpResult res;
  const int K = std::min(m, kCodebookSize);
  int seg_end[kCodebookSize + 1];
  if (K == m) {
    // Every run alone: each value (bin) takes its nearest candidate; optimal by definition.
    double total = 0.0;
    for (int i = 0; i < m; ++i) total += dp.cost(i, i + 1);
    for (int i = 0; i <= m; ++i) seg_end[i] = i;
    res.cost = total;
  } else {
    // Layer 1.
    for (int j = 1; j <= m; ++j) dp.prev[j] = dp.cost(0, j);
    // Layers 2..K-1 over every end position; layer K only at the end.
    for (int k = 2; k < K; ++k) {
      dp.solve(k, k, m, k - 1, m - 1);
      std::swap(dp.prev, dp.cur);
    }
    double best = std::numeric_limits<double>::infinity();
    int bi = K - 1;
    for (int i = K - 1; i < m; ++i) {
      const double v = dp.prev[i] + dp.cost(i, m);
      if (v < best) {
        best = v;
        bi = i;
      }
    }
    res.cost = best;
    seg_end[K] = m;
    seg_end[K - 1] = bi;
    for (int k = K - 1; k >= 2; --k) seg_end[k - 1] = dp.opt[k - 1][seg_end[k]];
    seg_end[0] = 0;
  }
  res.n_entries = K;
  for (int k = 0; k < K; ++k) {
    const int i = seg_end[k], j = seg_end[k + 1];
    const double mean = (dp.s1[j] - dp.s1[i]) * kInv.v[dp.c[j] - dp.c[i]];
    res.entries[k] = e4m3_byte_exact(e4m3_nearest(mean));
  }
  res.cost /= inv_scale2;
  return res;
}

}  // namespace lutb::fit_detail
