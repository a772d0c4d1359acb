// src/fit/fit_scalar.hpp: the scalar arithmetic of the DP fitters that decides bytes, shared by the
// CPU fitters (src/fit, compiled with -ffp-contract=off) and the GPU fitter
// (src/cuda/fit/sm80_lutb_fit_warp.cuh, compiled with -fmad=false), so the two cannot drift apart.
//
// Every operation is a plain IEEE double add, subtract, multiply, divide, compare or bit operation;
// neither build contracts them to FMA, so host and device give identical bits. Callers must keep
// the order in which they combine these results identical too (prefix sums, argmin scans).
#pragma once

#include <cstdint>

#include "lutb/numerics.hpp"

#if defined(__CUDACC__)
#define LUTB_FIT_HD __host__ __device__ __forceinline__
#else
// always_inline: the CPU DP calls these from AVX2/AVX-512 clones of its vectorised row loop.
#define LUTB_FIT_HD __attribute__((always_inline)) inline
#endif

namespace lutb::fit_detail {

/// 2^e as a double for |e| < 1000 (exact).
LUTB_FIT_HD double pow2(int e) {
  return __builtin_bit_cast(double, static_cast<std::uint64_t>(1023 + e) << 52);
}

/// Nearest E4M3 value to `mu` (a value in scaled units), as a double; saturates at +-448.
/// Exact ties may go either way (callers use this only where both neighbours cost the same).
/// Normal range: round the double's mantissa to 3 bits (ties to even), a carry moves to the next
/// binade, which is the correct E4M3 value; subnormal range (|mu| < 2^-6): multiples of 2^-9.
LUTB_FIT_HD double e4m3_nearest(double mu) {
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

/// Cost of one run (dp.cpp): with cc = count, a = sum x, b = sum x^2 of the run in scaled units,
/// min over E4M3 c of sum (x - c)^2 = (b - a * mean) + cc * (mean - c*)^2, c* nearest the mean.
LUTB_FIT_HD double run_cost(double cc, double a, double b) {
  const double mean = a / cc;
  const double d = mean - e4m3_nearest(mean);
  return (b - a * mean) + cc * (d * d);
}

/// E4M3 byte of an exactly representable value in scaled units (|v| <= 448). +0 for zero.
LUTB_FIT_HD std::uint8_t e4m3_byte_exact(double v) {
  if (v == 0.0) return 0x00;
  return e4m3_from_float(static_cast<float>(v));
}

/// Entry (E4M3 byte) of a run with count cc and sum a (scaled units): the E4M3 value nearest its mean.
LUTB_FIT_HD std::uint8_t run_entry(double a, double cc) { return e4m3_byte_exact(e4m3_nearest(a / cc)); }

/// Order-preserving map of a finite float to an unsigned key (negative values reversed).
LUTB_FIT_HD std::uint32_t sort_key(float x) {
  const std::uint32_t u = f32_bits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
LUTB_FIT_HD float from_key(std::uint32_t k) { return f32_from_bits((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

}  // namespace lutb::fit_detail
