// src/fit/binned_dp.cpp: "binned-dp", the fast default fitter.
//
// The exact DP of dp.cpp with the cluster boundaries restricted to the edges of kBins bins of
// (nearly) equal count over the sorted values (a DP over kBins weighted runs instead of up to 512
// values: ~kBins/512 of the cost evaluations), followed by snapped Lloyd refinement on the full
// sorted data (boundaries at codebook midpoints, each entry moved to the E4M3 candidate nearest its
// cluster mean), which moves the boundaries off the bin edges. Each Lloyd step is O(8 log n) on the
// prefix sums. Tiles with at most kBins distinct values get the exact DP (optimal at the searched
// scales). Scales: rceil and rceil-1 only (optimal.cpp shows larger scales never help; smaller
// ones than rceil-1 saturate by more than a factor 2 and were never better on the tiles measured).
// Its error is measured against "optimal" in docs/perf/fitting.md.
#include <algorithm>

#include "fit/dp.hpp"
#include "fit/fit_internal.hpp"

namespace lutb::fit_detail {
namespace {

constexpr int kBins = 64;
constexpr int kPolishIterations = 8;

// Snapped Lloyd on the sorted distinct values: refines res.entries in place (scale s).
void polish(const SortedTile& st, int s, DpResult& res) {
  const double inv = pow2(127 - s);
  double q[kCodebookSize];
  int m = 0;
  for (int k = 0; k < res.n_entries; ++k) {
    const double v = e4m3_to_float(res.entries[k]);
    if (m == 0 || v != q[m - 1]) q[m++] = v;  // DP entries are ascending
  }
  for (int it = 0; it < kPolishIterations; ++it) {
    // Split index of each boundary: first distinct value strictly above the midpoint (ties stay
    // with the lower entry, as the final assignment does).
    int split[kCodebookSize + 1];
    split[0] = 0;
    split[m] = st.n;
    for (int k = 1; k < m; ++k) {
      const double mid = 0.5 * (q[k - 1] + q[k]);
      int lo = split[k - 1], hi = st.n;  // upper_bound
      while (lo < hi) {
        const int md = (lo + hi) >> 1;
        if (static_cast<double>(st.u[md]) * inv > mid) hi = md; else lo = md + 1;
      }
      split[k] = lo;
    }
    bool changed = false;
    double nq[kCodebookSize];
    for (int k = 0; k < m; ++k) {
      const int c = st.cnt[split[k + 1]] - st.cnt[split[k]];
      nq[k] = q[k];
      if (c == 0) continue;
      const double mean = (st.p1[split[k + 1]] - st.p1[split[k]]) * inv / c;
      nq[k] = e4m3_nearest(mean);
      changed = changed || nq[k] != q[k];
    }
    if (!changed) break;
    // Keep ascending and distinct.
    for (int a = 1; a < m; ++a)  // insertion sort of <= 8 entries
      for (int b = a; b > 0 && nq[b - 1] > nq[b]; --b) std::swap(nq[b - 1], nq[b]);
    int w = 0;
    for (int k = 0; k < m; ++k)
      if (w == 0 || nq[k] != q[w - 1]) q[w++] = nq[k];
    m = w;
  }
  res.n_entries = m;
  for (int k = 0; k < m; ++k) res.entries[k] = e4m3_byte_exact(q[k]);
}

}  // namespace

TileFit fit_binned_dp(const float* x512, int forced_scale) {
  SortedTile st;
  build_sorted(x512, st);
  int pos[kBins + 1];
  int m = 0;
  if (st.n <= kBins) {
    for (int i = 0; i <= st.n; ++i) pos[i] = i;
    m = st.n;
  } else {
    // Bin edges: the first distinct index whose prefix count reaches b * 512 / kBins.
    pos[0] = 0;
    int i = 0;
    for (int b = 1; b < kBins; ++b) {
      const int target = b * (kTileSize / kBins);
      while (i < st.n && st.cnt[i] < target) ++i;
      if (i > pos[m] && i < st.n) pos[++m] = i;
    }
    pos[++m] = st.n;
  }
  const bool exact = m == st.n;
  // Same scale search as "optimal" (see optimal.cpp), with this solver.
  auto solve = [&](int s) {
    DpResult r = dp_fit(st, pos, m, s);
    if (!exact) polish(st, s, r);
    return r;
  };
  if (forced_scale >= 0) {
    const DpResult r = solve(forced_scale);
    return encode_tile(x512, forced_scale, r.entries, r.n_entries);
  }
  if (st.amax == 0.0f) {
    const std::uint8_t zero = 0x00;
    return encode_tile(x512, 127, &zero, 1);
  }
  const int r = std::max(rceil_scale(st.amax), kMinScale);
  DpResult d = solve(r);
  TileFit best = encode_tile(x512, r, d.entries, d.n_entries);
  if (r - 1 >= kMinScale) {
    d = solve(r - 1);
    TileFit t = encode_tile(x512, r - 1, d.entries, d.n_entries);
    if (t.sse < best.sse) best = t;
  }
  return best;
}

}  // namespace lutb::fit_detail
