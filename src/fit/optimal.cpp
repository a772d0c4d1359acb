// src/fit/optimal.cpp: the "optimal" fitter (exact minimum squared error, spec section 2.1) and the
// fast default "binned-dp" fitter.
//
// Scale search for "optimal" (which scale bytes can hold the optimum):
//  * Scales above r = rceil(amax) never help. For s >= r, amax <= 448 * 2^(s-127). The grid of
//    s+1 restricted to [-448, 448] * 2^(s-127) is a subset of the grid of s: binades from
//    2^-5 * 2^(s-127) up to 2^8 * 2^(s-127) hold the same 8 mantissas at both scales (s+1 uses
//    one exponent less); below 2^-5 * 2^(s-127) the grid of s is uniform with step 2^-9 * 2^(s-127)
//    and that of s+1 uniform with twice that step. The only values of s+1 outside that range are
//    larger than 448 * 2^(s-127) >= amax, and every one of them is dominated by 448 * 2^(s-127),
//    which lies between them and every cluster mean. So E(s+1) >= E(s) for all s >= r.
//  * rceil-1 can win, but only by a hair: in units u = 2^(r-127), the grid of r-1 is the grid of r
//    cut at 224, plus points H inside (-2^-6, 2^-6) where it is twice as fine; every point of H is
//    within delta = 2^-10 of a point of the grid of r. Moving each H entry of the optimal r-1
//    codebook to that neighbour changes a cluster's error by at most n_c * delta * (2|mean - c| +
//    delta) <= 3 n_c delta^2 (the entry is the nearest grid point to its cluster mean, so
//    |mean - c| <= delta), hence E(r) <= E(r-1) + 3 * 512 * 2^-20 * u^2. "optimal" still evaluates
//    it to be exact; the fast default does not.
//  * Scales below r saturate the largest values but refine the small ones, so they can win (the
//    golden cases show rceil-1 never did there, but nothing forbids it). They are searched downward
//    by branch and bound: at scale s every value with |x| > top_s = 448 * 2^(s-127) costs at least
//    (|x| - top_s)^2 whatever the codebook, and that bound grows as s falls, so the search stops at
//    the first s whose bound reaches the best error found (or at scale byte 3, spec section 2).
//    In practice rceil-1 is evaluated and rceil-2 is usually cut by the bound.
//  * Scale bytes are limited to 3..246 (spec section 2): tiles with rceil < 3 use 3 (everything
//    above is dominated as shown), tiles with rceil > 246 are rejected by fit_tile.
// Weighted (FitOptions::column_weights): every argument above holds term by term with each value's
// squared error multiplied by its positive weight; scales are compared by the weighted error.
// Ties between scales keep the larger scale (no saturation), then the scale found first.
#include <cmath>
#include <stdexcept>

#include "fit/dp.hpp"
#include "fit/fit_internal.hpp"

namespace lutb::fit_detail {
namespace {

struct Identity {
  int v[kTileSize + 1];
  Identity() {
    for (int i = 0; i <= kTileSize; ++i) v[i] = i;
  }
};
const Identity kIdentity;

// Lower bound on the (weighted) squared error at scale s from saturation alone.
double saturation_bound(const SortedTile& st, int s) {
  const double top = 448.0 * pow2(s - 127);
  double lb = 0.0;
  for (int i = 0; i < st.n && -static_cast<double>(st.u[i]) > top; ++i) {
    const double d = -static_cast<double>(st.u[i]) - top;
    lb += (st.wc[i + 1] - st.wc[i]) * (d * d);
  }
  for (int i = st.n - 1; i >= 0 && static_cast<double>(st.u[i]) > top; --i) {
    const double d = static_cast<double>(st.u[i]) - top;
    lb += (st.wc[i + 1] - st.wc[i]) * (d * d);
  }
  return lb;
}

template <class Solve>
TileFit search_scales(const float* x512, const float* w512, const SortedTile& st, int forced_scale, Solve&& solve) {
  if (forced_scale >= 0) {
    const DpResult r = solve(forced_scale);
    return encode_tile(x512, forced_scale, r.entries, r.n_entries, w512);
  }
  if (st.amax == 0.0f) {
    const std::uint8_t zero = 0x00;
    return encode_tile(x512, 127, &zero, 1, w512);
  }
  const int r = rceil_scale(st.amax);
  if (r > kMaxScale) throw std::invalid_argument("tile magnitude needs a scale byte above 246");
  const int s_hi = std::max(r, kMinScale);
  DpResult d = solve(s_hi);
  TileFit best = encode_tile(x512, s_hi, d.entries, d.n_entries, w512);
  for (int s = s_hi - 1; s >= kMinScale; --s) {
    if (saturation_bound(st, s) >= best.weighted_sse) break;
    d = solve(s);
    if (d.cost > best.weighted_sse * (1.0 + 1e-12)) continue;  // cannot beat the best even after reassigning
    TileFit t = encode_tile(x512, s, d.entries, d.n_entries, w512);
    if (t.weighted_sse < best.weighted_sse) best = t;
  }
  return best;
}

}  // namespace

TileFit fit_optimal(const float* x512, int forced_scale, const float* w512) {
  SortedTile st;
  build_sorted(x512, w512, st);
  return search_scales(x512, w512, st, forced_scale,
                       [&](int s) { return dp_fit(st, kIdentity.v, st.n, s); });
}

}  // namespace lutb::fit_detail
