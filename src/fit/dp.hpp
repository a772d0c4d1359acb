// src/fit/dp.hpp: exact 1-D k-means with centres restricted to the E4M3 grid of one scale
// (private to src/fit). Used by the "optimal" fitter (every split position) and by the
// "binned-dp" fitter (split positions restricted to bin edges).
#pragma once

#include <cstdint>

#include "fit/fit_internal.hpp"

namespace lutb::fit_detail {

/// Result of one restricted DP: at most 8 E4M3 entries (bytes, in scaled units of `scale`) and
/// the DP's own value of the squared error in unscaled units (the final error is recomputed
/// exactly by encode_tile).
struct DpResult {
  int n_entries = 0;
  std::uint8_t entries[kCodebookSize];
  double cost = 0.0;
  int bounds[kCodebookSize + 1];  // run k covers st.u[bounds[k] .. bounds[k+1]), k < n_entries
};

/// Minimum over codebooks of at most 8 entries from E4M3 * 2^(scale-127) of the squared error of
/// the values in `st`, where clusters are contiguous runs of the sorted distinct values whose
/// boundaries lie at the positions `pos[0..m]` (indices into st.u, pos[0] = 0, pos[m] = st.n,
/// strictly increasing). With pos = 0..st.n this is the exact optimum (nearest assignment makes
/// every optimal clustering contiguous in sorted order).
DpResult dp_fit(const SortedTile& st, const int* pos, int m, int scale);

/// Local exact refinement of a partition (res.bounds, res.n_entries runs) at scale `scale`: the
/// exact DP over partitions whose k-th boundary lies within `w` positions of the current k-th
/// boundary, repeated (re-centred) while a boundary ends on a window edge, at most `rounds`
/// times; in the repeats, boundaries that did not end on an edge get +-3 windows. Never increases
/// the DP cost. Updates res in place.
void dp_refine(const SortedTile& st, int scale, int w, int rounds, DpResult& res);

}  // namespace lutb::fit_detail
