// src/fit/fit_scalar_fast.hpp: cheaper formulations of the DP's run cost (fit_scalar.hpp run_cost)
// that return the SAME BITS, for the GPU fitter's inner loop (src/cuda/fit/sm80_lutb_fit_warp.cuh). The
// CPU fitter keeps fit_scalar.hpp; these functions are __host__ __device__ so that the CPU tests
// (tests/fit/fit_scalar_fast_test.cpp) run literally the code the kernel runs and compare it with
// fit_scalar.hpp bit for bit.
//
// 1. div_by_count(a, cc, y): a / cc for a run count cc = 1..512 (an integer-valued double) without
//    the IEEE division's software sequence (on the GPU a reciprocal seed, 7 FP64 operations and a
//    slow-path branch), from y = RN(1/cc) out of a table (count_recip_table.inc):
//        q  = RN(a * y)
//        r  = fma(cc, q, -a)     (= cc*q - a exactly)
//        q' = fma(-r, y, q)      (= RN(q - r*y))
//    This is Markstein's correction step (P. Markstein, "Computation of elementary functions on the
//    IBM RISC System/6000 processor", IBM J. Res. Dev. 34(1), 1990; Muller et al., Handbook of
//    Floating-Point Arithmetic, 2nd ed. 2018, the section on Newton-Raphson-based division with an
//    FMA): if y is within 1/2 ulp of 1/b and q within 1 ulp of a/b, and nothing overflows or
//    underflows, then RN(q + r*y) with the exact remainder r = a - b*q is RN(a/b). Here q = RN(a*y)
//    is only known to lie within 1.5 ulp of a/b, so the theorem's premise is not used as stated;
//    instead the following direct proof, which uses that b = cc is an integer <= 512, applies:
//
//    Theorem. Let b in {1..512}, y = RN(1/b), a a double with 2^-1000 <= |a| < 2^1018. Then the
//    sequence above returns RN(a/b) bit for bit.
//    Proof. If b = 2^t, y = 2^-t exactly, q = a/b exactly (|a/b| >= 2^-1009 is normal), r = +0
//    and q' = q + (-0) = q. Otherwise 2^(f-1) < b < 2^f for some f <= 9, 1/b in [2^-f, 2^(1-f)),
//    so |y - 1/b| =: |d| <= ulp(1/b)/2 = 2^(-f-53) < 2^-53 / b. Let x = a/b (exact, normal), 2^e <=
//    |x| < 2^(e+1), u = ulp(x) = 2^(e-52).
//    (i) |a*y - x| = |a||d| < 2^-53 |x| < u; below 2^(e+1) the doubles are u apart, and an a*y in
//    [2^(e+1), x + u) rounds to 2^(e+1), within u of x: in all cases |q - x| < 1.5 u.
//    (ii) |a| = b|x| >= 3 * 2^e, so a is a multiple of 2^(e-51); q (binade e or e-1) is a multiple
//    of 2^(e-53); so cc*q - a is a multiple of 2^(e-53) of magnitude b|q - x| < 1.5 * 2^9 * 2^(e-52)
//    < 2^11 * 2^(e-53): representable (e - 53 >= -1062 > -1074), so the FMA's r is exact.
//    (iii) q - r*y = q - r/b - r*d = x - r*d, with |r*d| < 1.5 b u * 2^-53 / b = 1.5 * 2^-53 u.
//    (iv) Every rounding boundary mu near x (a midpoint between adjacent doubles of binade e or
//    e-1) is a multiple of 2^(e-54), so x - mu = (a - b*mu)/b with a - b*mu a multiple of 2^(e-54),
//    and a != b*mu: mu has 54 significant bits (an odd integer m in (2^53, 2^54) times a power of
//    two), so b*mu's odd part is at least m > 2^53, which no double has. Hence |x - mu| >= 2^(e-54)
//    / b >= 2^-11 u > |r*d|: no boundary lies in the closed interval between x and x - r*d, and
//    the FMA's single rounding of x - r*d gives RN(x). Nothing overflows (|q|, |cc*q| <= ~|a|, and
//    the FMAs round only their exact results).                                                  []
//
//    Outside that range (zeros, subnormal or tiny a whose quotient may be subnormal: there exact
//    ties a/b = odd multiple of 2^-1075 exist for even b, and the error bound of (i) fails; |a| >=
//    2^1017 (hi word >= 0x7f800000, a NaN pattern as float); infinities and NaNs) the function
//    falls back to the IEEE division itself, so div_by_count(a, cc, RN(1/cc)) == a / cc for EVERY
//    double a and cc = 1..512. The DP never takes the fallback except for runs with sum exactly 0:
//    its sums are differences of prefix sums of floats times 2^(127 - scale), multiples of
//    2^-149 * 2^-119 = 2^-268 below 512 * 448 * 2 in magnitude.
//
// 2. e4m3_nearest_fast(mu) == fit_scalar.hpp e4m3_nearest(mu) for every double mu: the normal
//    branch's 64-bit integer rounding written on the high 32-bit word (the low word contributes
//    only its carry, lo != 0), the subnormal branch's RN(a * 512) to an integer and back with two
//    FMAs instead of four FP64 operations (a * 512 is exact for |a| < 2^-6, so fma(a, 512, 2^52) =
//    RN(a * 512 + 2^52) = 2^52 + k, k = RNE(a * 512) in 0..8, as the original's (t + 2^52); and
//    fma(2^52 + k, 2^-9, -2^43) = k * 2^-9 exactly, as the original's ((t + 2^52) - 2^52) * 2^-9).
//
// Both are tested on the CPU against fit_scalar.hpp (tests/fit/fit_scalar_fast_test.cpp): every
// count with millions of a values (all binades, exact quotients and their neighbours, values
// next to rounding midpoints, the DP's own sums of random and edge tiles), e4m3_nearest_fast
// exhaustively over the high words of |mu| in [2^-15, 2^10) and sampled elsewhere.
#pragma once

#include <cmath>
#include <cstdint>

#include "fit/count_recip_table.inc"
#include "fit/fit_scalar.hpp"

namespace lutb::fit_detail {

/// Largest run count the table covers (kTileSize).
inline constexpr int kMaxCount = 512;

/// A table row: the count as a double and y = RN(1/count). Row 0 is unused ({0, 0}).
struct alignas(16) CountRecip {
  double c, y;
};

/// The host's copy of the table (the device keeps its own in global memory, same literals).
inline constexpr CountRecip kCountRecip[kMaxCount + 1] = {
    {0.0, 0.0},
#define X(c, y) {static_cast<double>(c), y},
    LUTB_COUNT_RECIP_LIST
#undef X
};

/// a / cc for an integer-valued cc in 1..512 and y = RN(1/cc): bit-identical to IEEE a / cc for
/// every a (see the proof above). Written with explicit fma(): no contraction is needed or wanted.
LUTB_FIT_HD double div_by_count(double a, double cc, double y) {
  // Fast range 2^-1000 <= |a| < 2^1018: the high word of a, read as a float, has a magnitude >=
  // 2^-1000's high word (0x01700000) and is not a float NaN (> 0x7f800000): one float compare.
  const float h = __builtin_bit_cast(float, static_cast<std::uint32_t>(__builtin_bit_cast(std::uint64_t, a) >> 32));
  if (!(fabsf(h) >= __builtin_bit_cast(float, 0x01700000u))) return a / cc;
  const double q = a * y;
  const double r = fma(cc, q, -a);
  return fma(-r, y, q);
}

/// fit_scalar.hpp e4m3_nearest, the same bits for every double (see 2. above).
LUTB_FIT_HD double e4m3_nearest_fast(double mu) {
  const std::uint64_t mb = __builtin_bit_cast(std::uint64_t, mu);
  const std::uint32_t hi = static_cast<std::uint32_t>(mb >> 32), lo = static_cast<std::uint32_t>(mb);
  const std::uint32_t sign = hi & 0x80000000u, ah = hi & 0x7fffffffu;
  // Normal: ((ab + 2^48 - 1 + bit49) & ~(2^49 - 1)) on the high word: the low word's addition of
  // 2^32 - 1 + bit49 carries exactly when lo != 0 or bit49 (bit 17 of the high word) is set.
  const std::uint32_t carry = static_cast<std::uint32_t>(lo != 0u) | ((ah >> 17) & 1u);
  std::uint32_t nh = (ah + 0xffffu + carry) & 0xfffe0000u;
  nh = nh > 0x407c0000u ? 0x407c0000u : nh;  // saturate at 448 (the low word is 0 on both sides)
  // Subnormal (|mu| < 2^-6): k * 2^-9 with k = RNE(|mu| * 512).
  const double a = __builtin_bit_cast(double, mb & 0x7fffffffffffffffull);
  const double t = fma(a, 512.0, 4503599627370496.0);
  const double sv = fma(t, 0.001953125, -8796093022208.0);
  const std::uint64_t nb = static_cast<std::uint64_t>(nh | sign) << 32;
  const std::uint64_t sb = __builtin_bit_cast(std::uint64_t, sv) | (static_cast<std::uint64_t>(sign) << 32);
  return __builtin_bit_cast(double, ah < 0x3f900000u ? sb : nb);
}

/// fit_scalar.hpp run_cost(cc, a, b), the same bits, with y = RN(1/cc) from the table.
LUTB_FIT_HD double run_cost_div(double cc, double y, double a, double b) {  // fast division only
  const double mean = div_by_count(a, cc, y);
  const double d = mean - e4m3_nearest(mean);
  return (b - a * mean) + cc * (d * d);
}
LUTB_FIT_HD double run_cost_fast(double cc, double y, double a, double b) {  // + e4m3_nearest_fast
  const double mean = div_by_count(a, cc, y);
  const double d = mean - e4m3_nearest_fast(mean);
  return (b - a * mean) + cc * (d * d);
}

}  // namespace lutb::fit_detail
