// src/fit/fit_internal.hpp: shared pieces of the LUT-B fitters (private to src/fit).
//
// Conventions used by every fitter here:
//  - A tile is 512 FP32 values in flat order (f = r*64 + c), all finite (checked by fit_tile).
//  - "scaled units" of scale byte s: x * 2^(127-s), so codebook entries are plain E4M3 values.
//  - All arithmetic that decides anything is in double with a fixed evaluation order, and this
//    directory is compiled with -ffp-contract=off (CMakeLists.txt), so results are bit-identical on
//    every machine and thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"
#include "fit/fit_scalar.hpp"

namespace lutb::fit_detail {

inline constexpr int kMinScale = 3;    // spec section 2: fitters choose scale bytes 3..246
inline constexpr int kMaxScale = 246;

// pow2, e4m3_nearest, run_cost, e4m3_byte_exact, run_entry, sort_key, from_key: fit/fit_scalar.hpp
// (shared with the GPU fitter).

/// Sorted, de-duplicated tile: u[0..n) ascending distinct values with multiplicities, and prefix
/// sums over them (cnt, weight, sum w*x, sum w*x^2) in double, unscaled. Unweighted, every value
/// weighs 1: wc[i] == cnt[i] and the sums are those of the plain squared error.
struct SortedTile {
  int n = 0;                 // number of distinct values
  float u[kTileSize];        // distinct values, ascending
  int cnt[kTileSize + 1];    // prefix counts: cnt[i] = number of values among u[0..i)
  double wc[kTileSize + 1];  // prefix weights (== cnt unweighted); the DP's run "count"
  double p1[kTileSize + 1];  // prefix sum of weight * value
  double p2[kTileSize + 1];  // prefix sum of weight * value^2
  float amax = 0.0f;
};

/// Sorts and de-duplicates 512 finite values (+0 and -0 are merged) and builds prefix sums.
/// `w512`: null (unweighted) or 512 finite positive weights in flat tile order; the weights of
/// equal values are summed in flat order (so the sums are deterministic).
void build_sorted(const float* x512, const float* w512, SortedTile& st);
/// Unweighted.
inline void build_sorted(const float* x512, SortedTile& st) { build_sorted(x512, nullptr, st); }

/// Final encoding shared by every fitter: writes `entries` (n <= 8 E4M3 bytes, any order, no NaN)
/// sorted ascending by value, padded with duplicates of the largest entry to 8 (only happens when
/// fewer than 8 distinct entries are needed), assigns each value to the nearest dequantised entry
/// (ties to the lower index; exact comparisons against midpoints computed exactly in double),
/// packs the indices and computes sse, weighted_sse (with `w512`, else = sse) and sum_sq in double in
/// flat order. Nearest assignment does not depend on the weights (each value has its own weight).
/// Throws std::invalid_argument when n_entries is outside 0..8.
TileFit encode_tile(const float* x512, int scale, const std::uint8_t* entries, int n_entries,
                    const float* w512 = nullptr);

/// Exact squared error of `x512` against a sorted codebook of 8 dequantised values (double,
/// flat-order summation), with nearest/ties-to-lower assignment; optionally writes the indices.
double assign_sse(const float* x512, const float* sorted_values8, std::uint8_t* idx512);

/// Fitters (src/fit/*.cpp). Each returns the final TileFit. `forced_scale` is -1 or 3..246.
/// `w512`: null (minimise sum (x - x_hat)^2) or 512 positive weights (minimise sum w (x - x_hat)^2).
TileFit fit_optimal(const float* x512, int forced_scale, const float* w512 = nullptr);
TileFit fit_binned_dp(const float* x512, int forced_scale, const float* w512 = nullptr);
TileFit fit_ct_lloyd(const float* x512);
TileFit fit_multistart(const float* x512);

// ---------------------------------------------------------------------------------------------
// The pieces of the bulk fit (src/fit/fit.cpp) that the error-feedback fit
// (src/fit/error_feedback.cpp) shares with it.
// ---------------------------------------------------------------------------------------------

/// The fitters, in the order of fitter_names().
enum class Which { kBinnedDp, kOptimal, kCtLloyd, kMultistart };
/// The fitter of a name ("" = the default); throws check_fitter_name's error for another.
Which resolve(std::string_view name);
/// "" when the 512 values of a tile can be fitted, else the reason ("NaN at tile row r col c", or a
/// magnitude beyond scale byte 246).
std::string check_tile(const float* x512);
/// Fits a checked tile with fitter w; `w512` null or the tile's 512 weights (a tile of equal weights
/// is fitted unweighted).
TileFit fit_checked(const float* x512, Which w, int forced_scale, const float* w512 = nullptr);
/// The 512 weights of tile column tk from one expert's column weights cw[cols] (padded columns take
/// the smallest weight of the tile's logical columns).
void gather_weights(const float* cw, std::int64_t cols, std::int64_t tk, float* w512);
/// Tile (tn, tk) of a row-major [rows][cols] matrix of F32, BF16 or F16 as 512 floats, zero-padded.
void gather(const void* src, DType type, std::int64_t rows, std::int64_t cols, std::int64_t tn, std::int64_t tk,
            float* out);
/// Tile t of a tensor of `shape`: its expert and its tile row and column within the expert.
struct TilePos {
  std::int64_t e, tn, tk;
};
/// Stores tile t's fit in `out`.
void store_tile(LutbTensor& out, std::int64_t t, const TileFit& f);
/// "tensor NAME[, expert e], tile (tn, tk): ERR", with "at tile row R col C" in ERR rewritten as the
/// tensor's row and column.
std::string tile_error(const std::string& name, const LutbShape& shape, const TilePos& p, std::string err);

/// The end of a quantize() loop over `tiles` tiles: clears `out` and throws Interrupted (flag
/// `stopped` != 0, `done` tiles fitted) or std::invalid_argument("quantize: " + bad_msg) (bad_msg
/// not empty); otherwise the tensor's FitStats, the per-tile sums sse / ssq added in tile order so
/// that they never depend on the thread count.
FitStats finish_quantize(const std::string& name, int stopped, std::int64_t done, std::int64_t tiles,
                         const std::string& bad_msg, const std::vector<double>& sse,
                         const std::vector<double>& ssq, LutbTensor& out);

/// quantize() with FitOptions::error_feedback.second_moments set (src/fit/error_feedback.cpp); the
/// arguments other than the moments and the damping are checked by the caller.
FitStats quantize_error_feedback(const void* src, DType src_type, const LutbShape& shape, LutbTensor& out,
                                 const FitOptions& opt, Which w, const std::string& name);

/// Smallest scale byte without saturation (spec 2.1 rceil) for the tile's amax, as an int
/// (127 for an all-zero tile). May be outside 3..246; callers clamp / reject.
inline int rceil_scale(float amax) { return static_cast<int>(ue8m0_rceil(amax)); }

}  // namespace lutb::fit_detail
