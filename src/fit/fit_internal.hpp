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

#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"

namespace lutb::fit_detail {

inline constexpr int kMinScale = 3;    // spec section 2: fitters choose scale bytes 3..246
inline constexpr int kMaxScale = 246;

/// 2^e as a double for |e| < 1000 (exact).
inline double pow2(int e) {
  return __builtin_bit_cast(double, static_cast<std::uint64_t>(1023 + e) << 52);
}

/// Nearest E4M3 value to `mu` (a value in scaled units), as a double; saturates at +-448.
/// Exact ties may go either way (callers use this only where both neighbours cost the same).
/// Normal range: round the double's mantissa to 3 bits (ties to even), a carry moves to the next
/// binade, which is the correct E4M3 value; subnormal range (|mu| < 2^-6): multiples of 2^-9.
__attribute__((always_inline)) inline double e4m3_nearest(double mu) {
  // Branch-free (the DP calls this in its vectorised inner loop): both roundings are computed and
  // one is selected with bit masks.
  const std::uint64_t mb = __builtin_bit_cast(std::uint64_t, mu);
  const std::uint64_t sign = mb & 0x8000000000000000ull;
  const std::uint64_t ab = mb & 0x7fffffffffffffffull;
  const double a = __builtin_bit_cast(double, ab);
  // Normal: keep 3 mantissa bits, round to nearest even; saturate at 448 (bits 0x407C000000000000).
  std::uint64_t nb = (ab + ((1ull << 48) - 1) + ((ab >> 49) & 1ull)) & ~((1ull << 49) - 1);
  const std::uint64_t k448 = 0x407C000000000000ull;
  nb = nb > k448 ? k448 : nb;  // positive doubles order like their bits
  // Subnormal (a < 2^-6): multiples of 2^-9, RNE via the 2^52 trick.
  const double t = a * 512.0;
  const std::uint64_t sb = __builtin_bit_cast(std::uint64_t, ((t + 4503599627370496.0) - 4503599627370496.0) * 0.001953125);
  const std::uint64_t is_sub = 0ull - static_cast<std::uint64_t>(ab < 0x3F90000000000000ull);  // a < 2^-6
  return __builtin_bit_cast(double, ((sb & is_sub) | (nb & ~is_sub)) | sign);
}

/// E4M3 byte of an exactly representable value in scaled units (|v| <= 448). +0 for zero.
inline std::uint8_t e4m3_byte_exact(double v) {
  if (v == 0.0) return 0x00;
  return e4m3_from_float(static_cast<float>(v));
}

/// Sorted, de-duplicated tile: u[0..n) ascending distinct values with multiplicities, and prefix
/// sums over them (cnt, sum x, sum x^2) in double, unscaled.
struct SortedTile {
  int n = 0;                 // number of distinct values
  float u[kTileSize];        // distinct values, ascending
  int cnt[kTileSize + 1];    // prefix counts: cnt[i] = number of values among u[0..i)
  double p1[kTileSize + 1];  // prefix sum of values
  double p2[kTileSize + 1];  // prefix sum of squared values
  float amax = 0.0f;
};

/// Sorts and de-duplicates 512 finite values (+0 and -0 are merged) and builds prefix sums.
void build_sorted(const float* x512, SortedTile& st);

/// Final encoding shared by every fitter: writes `entries` (n <= 8 E4M3 bytes, any order, no NaN)
/// sorted ascending by value, padded with duplicates of the largest entry to 8 (only happens when
/// fewer than 8 distinct entries are needed), assigns each value to the nearest dequantised entry
/// (ties to the lower index; exact comparisons against midpoints computed exactly in double),
/// packs the indices and computes sse and sum_sq in double in flat order.
TileFit encode_tile(const float* x512, int scale, const std::uint8_t* entries, int n_entries);

/// Exact squared error of `x512` against a sorted codebook of 8 dequantised values (double,
/// flat-order summation), with nearest/ties-to-lower assignment; optionally writes the indices.
double assign_sse(const float* x512, const float* sorted_values8, std::uint8_t* idx512);

/// Fitters (src/fit/*.cpp). Each returns the final TileFit. `forced_scale` is -1 or 3..246.
TileFit fit_optimal(const float* x512, int forced_scale);
TileFit fit_binned_dp(const float* x512, int forced_scale);
TileFit fit_ct_lloyd(const float* x512);
TileFit fit_multistart(const float* x512);

/// Smallest scale byte without saturation (spec 2.1 rceil) for the tile's amax, as an int
/// (127 for an all-zero tile). May be outside 3..246; callers clamp / reject.
inline int rceil_scale(float amax) { return static_cast<int>(ue8m0_rceil(amax)); }

}  // namespace lutb::fit_detail
