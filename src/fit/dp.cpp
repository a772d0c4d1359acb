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
// Weighted objective (FitOptions::column_weights): every value x carries a weight w > 0 and the
// error is sum w (x - c)^2. All of the above holds with "count" read as "total weight" and "mean"
// as "weighted mean": cost(run) = V_w(run) + W * (mean_w - c)^2 is still a parabola in c with its
// vertex at the weighted mean, nearest assignment still makes optimal clusters contiguous (each
// value's own weight does not change which entry is nearest to it), and the quadrangle argument
// sums h with positive weights. The prefix arrays carry W, sum w x, sum w x^2 (SortedTile); with
// all weights 1 they are bit for bit the unweighted ones.
//
// Precision: prefix sums in double in scaled units (power-of-two scaling is exact). The DP value
// is accurate to ~1e-14 of the tile's energy; the reported error is recomputed exactly afterwards.
#include "fit/dp.hpp"

#include <limits>

namespace lutb::fit_detail {
namespace {


// v[t] = prev[i0 + t] + cost(i0 + t, j) for t < n: a branch-free loop over contiguous arrays that
// the compiler vectorises. An AVX2 copy is selected at run time where the CPU has it; every
// operation is an IEEE add, subtract, multiply, divide, compare, min or bit operation and
// contraction is off (no FMA), so both copies give identical bits.
#define LUTB_ROW_COSTS_BODY                                            \
  const double cj = cd[j], aj = s1[j], bj = s2[j];                     \
  for (int t = 0; t < n; ++t) {                                        \
    const int i = i0 + t;                                              \
    v[t] = prev[i] + run_cost(cj - cd[i], aj - s1[i], bj - s2[i]);     \
  }

void row_costs_base(const double* __restrict prev, const double* __restrict cd, const double* __restrict s1,
                    const double* __restrict s2, int i0, int n, int j, double* __restrict v) {
  LUTB_ROW_COSTS_BODY
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) void row_costs_avx2(const double* __restrict prev, const double* __restrict cd,
                                                    const double* __restrict s1, const double* __restrict s2, int i0,
                                                    int n, int j, double* __restrict v) {
  LUTB_ROW_COSTS_BODY
}
__attribute__((target("avx512f"))) void row_costs_avx512(const double* __restrict prev, const double* __restrict cd,
                                                         const double* __restrict s1, const double* __restrict s2,
                                                         int i0, int n, int j, double* __restrict v) {
  LUTB_ROW_COSTS_BODY
}
const bool kHaveAvx2 = __builtin_cpu_supports("avx2");
const bool kHaveAvx512 = __builtin_cpu_supports("avx512f");
#else
const bool kHaveAvx2 = false;
const bool kHaveAvx512 = false;
#define row_costs_avx2 row_costs_base
#define row_costs_avx512 row_costs_base
#endif

inline void row_costs(const double* prev, const double* cd, const double* s1, const double* s2, int i0, int n, int j,
                      double* v) {
  if (kHaveAvx512) row_costs_avx512(prev, cd, s1, s2, i0, n, j, v);
  else if (kHaveAvx2) row_costs_avx2(prev, cd, s1, s2, i0, n, j, v);
  else row_costs_base(prev, cd, s1, s2, i0, n, j, v);
}

struct Dp {
  // Prefix arrays at the allowed boundary positions, scaled units.
  double cd[kTileSize + 1];  // prefix counts (exact in double), or prefix weights
  double s1[kTileSize + 1];
  double s2[kTileSize + 1];
  int m = 0;
  double buf[2][kTileSize + 1];
  double* prev = buf[0];
  double* cur = buf[1];
  std::int16_t opt[kCodebookSize][kTileSize + 1];  // opt[k-1][j]: start of the last run, layer k

  // Same arithmetic, operation for operation, as LUTB_ROW_COSTS_BODY (so mixing them is exact).
  double cost(int i, int j) const { return run_cost(cd[j] - cd[i], s1[j] - s1[i], s2[j] - s2[i]); }

  // cur[j] = min_{i in [ilo, ihi], k-1 <= i < j} prev[i] + cost(i, j) for j in [jlo, jhi].
  // Besides the monotonicity in j, the leftmost optimal start of the last run does not move left
  // when a run is added (opt_k(j) >= opt_{k-1}(j), the same quadrangle-inequality argument as
  // Knuth-Yao); `lower` (the previous layer's opt row, or null) uses that to cut the search.
  void solve(int k, int jlo, int jhi, int ilo, int ihi, const std::int16_t* lower) {
    while (jlo <= jhi) {
      const int j = (jlo + jhi) >> 1;
      int lo = std::max(std::max(ilo, k - 1), lower ? static_cast<int>(lower[j]) : 0);
      const int hi = std::min(ihi, j - 1);
      lo = std::min(lo, hi);  // (only reachable through rounding-level ties)
      double best;
      int bi = lo;
      if (hi - lo < 8) {  // short ranges (most of the recursion): inline scalar
        best = prev[lo] + cost(lo, j);
        for (int i = lo + 1; i <= hi; ++i) {
          const double v = prev[i] + cost(i, j);
          if (v < best) {
            best = v;
            bi = i;
          }
        }
      } else {
        double v[kTileSize + 1];
        row_costs(prev, cd, s1, s2, lo, hi - lo + 1, j, v);
        best = v[0];
        for (int t = 1; t <= hi - lo; ++t) {
          if (v[t] < best) {
            best = v[t];
            bi = lo + t;
          }
        }
      }
      cur[j] = best;
      opt[k - 1][j] = static_cast<std::int16_t>(bi);
      // Left half recursively, right half iteratively (keeps the recursion shallow).
      if (jlo <= j - 1) solve(k, jlo, j - 1, ilo, bi, lower);
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
    dp.cd[i] = st.wc[pos[i]];
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
      dp.solve(k, k, m, k - 1, m - 1, k > 2 ? dp.opt[k - 2] : nullptr);
      std::swap(dp.prev, dp.cur);
    }
    double best = std::numeric_limits<double>::infinity();
    int bi = K - 1;
    for (int i = K > 2 ? dp.opt[K - 2][m] : K - 1; i < m; ++i) {
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
  for (int k = 0; k <= K; ++k) res.bounds[k] = pos[seg_end[k]];
  for (int k = 0; k < K; ++k) {
    const int i = seg_end[k], j = seg_end[k + 1];
    res.entries[k] = run_entry(dp.s1[j] - dp.s1[i], dp.cd[j] - dp.cd[i]);
  }
  res.cost /= inv_scale2;
  return res;
}

void dp_refine(const SortedTile& st, int scale, int w, int rounds, DpResult& res) {
  constexpr int kSettledWindow = 3;  // later rounds: boundaries that did not hit an edge
  const int K = res.n_entries;
  const int m = st.n;
  if (K < 2 || K >= m) return;
  thread_local Dp dp;
  const double inv_scale = pow2(127 - scale);
  const double inv_scale2 = inv_scale * inv_scale;
  for (int i = 0; i <= m; ++i) {
    dp.cd[i] = st.wc[i];
    dp.s1[i] = st.p1[i] * inv_scale;
    dp.s2[i] = st.p2[i] * inv_scale2;
  }
  int* b = res.bounds;
  // F[k][t]: best cost of the first (window k's t-th position) values in k+1 runs.
  double F[kCodebookSize + 1][2 * kTileSize + 1];
  std::int16_t arg[kCodebookSize + 1][2 * kTileSize + 1];
  double v[2 * kTileSize + 2];
  int wk[kCodebookSize];  // window half-width per boundary: w, then narrower where it settled
  for (int k = 1; k < K; ++k) wk[k] = w;
  for (int round = 0; round < rounds; ++round) {
    int lo[kCodebookSize], hi[kCodebookSize];
    for (int k = 1; k < K; ++k) {
      lo[k] = std::max(b[k] - wk[k], k);
      hi[k] = std::min(b[k] + wk[k], m - (K - k));
    }
    // Runs 0..k-1 end at j in window k (boundary k); windows are processed left to right.
    for (int j = lo[1]; j <= hi[1]; ++j) F[1][j - lo[1]] = dp.cost(0, j);
    for (int k = 2; k <= K; ++k) {
      const int jl = k < K ? lo[k] : m, jh = k < K ? hi[k] : m;
      // prev values on window k-1 as a dense array indexed from lo[k-1].
      double* prev = dp.buf[1];
      for (int i = lo[k - 1]; i <= hi[k - 1]; ++i) prev[i] = F[k - 1][i - lo[k - 1]];
      for (int j = jl; j <= jh; ++j) {
        const int il = lo[k - 1], ih = std::min(hi[k - 1], j - 1);
        double best = std::numeric_limits<double>::infinity();
        int bi = il;
        if (ih >= il) {
          row_costs(prev, dp.cd, dp.s1, dp.s2, il, ih - il + 1, j, v);
          for (int t = 0; t <= ih - il; ++t)
            if (v[t] < best) {
              best = v[t];
              bi = il + t;
            }
        }
        F[k][j - jl] = best;
        arg[k][j - jl] = static_cast<std::int16_t>(bi);
      }
    }
    // Trace back.
    int nb[kCodebookSize + 1];
    nb[K] = m;
    nb[0] = 0;
    for (int k = K; k >= 2; --k) nb[k - 1] = arg[k][nb[k] - (k < K ? lo[k] : m)];
    bool edge = false;
    for (int k = 1; k < K; ++k) {
      const bool e = (nb[k] == lo[k] && lo[k] > k) || (nb[k] == hi[k] && hi[k] < m - (K - k));
      edge = edge || e;
      wk[k] = e ? w : kSettledWindow;
      b[k] = nb[k];
    }
    res.cost = F[K][0] / inv_scale2;
    if (!edge) break;
  }
  for (int k = 0; k < K; ++k) {
    const int i = b[k], j = b[k + 1];
    res.entries[k] = run_entry(dp.s1[j] - dp.s1[i], dp.cd[j] - dp.cd[i]);
  }
}

}  // namespace lutb::fit_detail
