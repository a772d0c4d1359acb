// src/fit/binned_dp.cpp: "binned-dp", the fast default fitter.
//
// 1. The exact DP of dp.cpp with the run boundaries restricted to the edges of kBins bins of
//    (nearly) equal count over the sorted distinct values: a DP over kBins weighted runs instead of
//    up to 512 values (~kBins/512 of the cost evaluations per layer).
// 2. Local exact refinement (dp_refine): the exact DP over partitions whose k-th boundary lies
//    within kWindow positions of the binned solution's k-th boundary, re-centred while a boundary
//    ends on a window edge (at most kRounds times). This recovers the optimum whenever every
//    optimal boundary lies within the windows, which is the common case; it is never worse than
//    step 1. (Snapped Lloyd iterations from the binned solution were tried first and stayed
//    0.17-0.3 dB short of optimal on i.i.d. tiles; the local DP is within a few millidecibels.)
// Tiles with at most kBins distinct values get the exact DP directly.
// Weighted (FitOptions::column_weights): the bins stay equal-count (they only restrict where the
// first DP may put boundaries); both DPs minimise the weighted error (dp.cpp).
// Scale: rceil only. Larger scales never help (optimal.cpp). rceil-1 can beat rceil by at most
// 3 * 512 * 2^-20 * 4^(rceil-127) in squared error (optimal.cpp derives the bound): negligible
// against any non-trivial tile's error, so the fast fitter does not spend a second DP on it.
// Sorting, the DP and the final encoding are shared with "optimal"; the gap to it is measured in
// docs/perf/fitting.md.
#include <algorithm>

#include "fit/dp.hpp"
#include "fit/fit_internal.hpp"

namespace lutb::fit_detail {
namespace {

constexpr int kBins = 32;
constexpr int kTail = 8;     // values resolved individually at each end
constexpr int kWindow = 8;   // boundary window half-width of the local exact refinement
constexpr int kRounds = 4;   // re-centred refinements at most

}  // namespace

TileFit fit_binned_dp(const float* x512, int forced_scale, const float* w512) {
  SortedTile st;
  build_sorted(x512, w512, st);
  int pos[kBins + 2 * kTail + 2];
  int m = 0;
  if (st.n <= kBins) {
    for (int i = 0; i <= st.n; ++i) pos[i] = i;
    m = st.n;
  } else {
    // Bin edges: every distinct value among the kTail smallest and largest (the tails, where
    // heavy-tailed tiles put their outer entries on few values), and in between the first distinct
    // index whose prefix count reaches each multiple of 512 / kBins.
    pos[0] = 0;
    int i = 0;
    auto push = [&](int e) {
      if (e > pos[m] && e < st.n) pos[++m] = e;
    };
    while (i < st.n && st.cnt[i] < kTail) push(i++);
    for (int b = 1; b < kBins; ++b) {
      const int target = b * (kTileSize / kBins);
      while (i < st.n && st.cnt[i] < target) ++i;
      push(i);
    }
    while (i < st.n && st.cnt[i] <= kTileSize - kTail) ++i;
    while (i < st.n) push(i++);
    pos[++m] = st.n;
  }
  const bool exact = m == st.n;
  // Same scale search as "optimal" (see optimal.cpp), with this solver.
  auto solve = [&](int s) {
    DpResult r = dp_fit(st, pos, m, s);
    if (!exact) dp_refine(st, s, kWindow, kRounds, r);
    return r;
  };
  if (forced_scale >= 0) {
    const DpResult r = solve(forced_scale);
    return encode_tile(x512, forced_scale, r.entries, r.n_entries, w512);
  }
  if (st.amax == 0.0f) {
    const std::uint8_t zero = 0x00;
    return encode_tile(x512, 127, &zero, 1, w512);
  }
  const int r = std::max(rceil_scale(st.amax), kMinScale);
  const DpResult d = solve(r);
  return encode_tile(x512, r, d.entries, d.n_entries, w512);
}

}  // namespace lutb::fit_detail
