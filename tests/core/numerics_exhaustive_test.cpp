// Exhaustive and reference-checked tests of the scalar number formats (spec section 1). Each
// conversion is compared with an independent reference written differently: double arithmetic and
// brute-force nearest-value search, never the bit tricks of numerics.hpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "lutb/numerics.hpp"

namespace lutb {
namespace {

// ---------------------------------------------------------------------------
// Independent references
// ---------------------------------------------------------------------------
// E4M3 value of a byte from the format definition, in double.
double ref_e4m3_decode(int b) {
  const int s = (b >> 7) & 1, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 7 - 3);
  return s ? -mag : mag;
}

// Brute-force E4M3 encoder: the nearest of the 127 finite non-negative values (ties: even byte,
// which is the even mantissa), saturating (nothing above 448 exists), sign copied, NaN -> NaN.
int ref_e4m3_encode(float x) {
  if (std::isnan(x)) return 0x7f;
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(x));
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int b = 0; b <= 0x7e; ++b) v.push_back(ref_e4m3_decode(b));
    return v;
  }();
  int best = 0;
  double best_d = INFINITY;
  for (int b = 0; b <= 0x7e; ++b) {
    const double d = std::fabs(values[b] - a);
    if (d < best_d || (d == best_d && (b & 1) == 0)) {
      best_d = d;
      best = b;
    }
  }
  return sign | best;
}

// Round-to-nearest-even of x to a binary format with `man_bits` stored mantissa bits and minimum
// normal exponent `emin`, in double (exact for FP32 inputs: every step is a power-of-two scaling or
// an integer rounding of a value with at most 24 significant bits). Returns the rounded value; no
// overflow handling (callers check).
double ref_round_binary(double x, int man_bits, int emin) {
  if (x == 0) return x;
  int e = static_cast<int>(std::floor(std::log2(std::fabs(x))));
  // log2 of a double may be off by one ulp at exact powers: fix e so that 2^e <= |x| < 2^(e+1).
  while (std::ldexp(1.0, e) > std::fabs(x)) --e;
  while (std::ldexp(1.0, e + 1) <= std::fabs(x)) ++e;
  e = std::max(e, emin);
  const double ulp = std::ldexp(1.0, e - man_bits);
  return std::nearbyint(x / ulp) * ulp;  // default rounding mode: to nearest, ties to even
}

// Many FP32 test inputs: all exponents, random mantissas, plus exact ties and their neighbours for
// grids with the given mantissa width and emin.
std::vector<float> sample_floats(std::uint32_t seed, int count) {
  std::mt19937 rng(seed);
  std::vector<float> v;
  for (int i = 0; i < count; ++i) v.push_back(f32_from_bits(static_cast<std::uint32_t>(rng())));
  // Small magnitudes, log-uniform from 2^-20 to 2^20, both signs.
  std::uniform_real_distribution<float> ex(-20.0f, 20.0f);
  for (int i = 0; i < count; ++i) v.push_back((i & 1 ? -1.0f : 1.0f) * std::exp2(ex(rng)));
  for (float s : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 448.0f, 464.0f, 480.0f, 1e30f, 3.4028235e38f,
                  1.17549435e-38f, 1.4e-45f})
    v.push_back(s);
  return v;
}

// ---------------------------------------------------------------------------
// E4M3
// ---------------------------------------------------------------------------
TEST(E4M3Exhaustive, DecodeMatchesDefinitionForAll256Bytes) {
  for (int b = 0; b < 256; ++b) {
    const double want = ref_e4m3_decode(b);
    const float got = e4m3_to_float(static_cast<std::uint8_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
      EXPECT_TRUE(e4m3_is_nan(static_cast<std::uint8_t>(b)));
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << b;
      EXPECT_EQ(std::signbit(got), (b & 0x80) != 0) << b;
    }
  }
  EXPECT_EQ(e4m3_to_float(0x7e), kE4M3Max);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, kE4M3MinNormalExp));
}

TEST(E4M3Exhaustive, AllBytesRoundTrip) {
  for (int b = 0; b < 256; ++b) {
    const auto byte = static_cast<std::uint8_t>(b);
    const std::uint8_t back = e4m3_from_float(e4m3_to_float(byte));
    if (e4m3_is_nan(byte)) {
      EXPECT_TRUE(e4m3_is_nan(back)) << b;
    } else {
      EXPECT_EQ(back, byte) << b;  // including -0 -> 0x80
      EXPECT_EQ(f32_bits(e4m3_round(e4m3_to_float(byte))), f32_bits(e4m3_to_float(byte)));
    }
  }
}

TEST(E4M3Exhaustive, EncoderMatchesBruteForceOnTiesAndNeighbours) {
  // Every midpoint between adjacent E4M3 values (exact in FP32), one FP32 ulp either side, the
  // values themselves, and the saturation region up to Inf; both signs.
  std::vector<float> in;
  for (int b = 0; b < 0x7e; ++b) {
    const float lo = e4m3_to_float(static_cast<std::uint8_t>(b)), hi = e4m3_to_float(static_cast<std::uint8_t>(b + 1));
    const float mid = static_cast<float>((static_cast<double>(lo) + hi) / 2);
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2);
    for (float x : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY), hi}) {
      in.push_back(x);
      in.push_back(-x);
    }
  }
  // Saturation boundaries: 448, the would-be midpoint 464 to the next (non-existent) value 480,
  // and beyond; FP32 max and Inf.
  for (float x : {448.0f, std::nextafter(448.0f, INFINITY), 463.99997f, 464.0f, 464.00003f, 479.99997f, 480.0f,
                  500.0f, 1e6f, 3.4028235e38f, INFINITY}) {
    in.push_back(x);
    in.push_back(-x);
  }
  // Below the smallest subnormal: 2^-10 is the tie between 0 and 2^-9 (rounds to 0, even).
  for (float x : {std::ldexp(1.0f, -10), std::nextafter(std::ldexp(1.0f, -10), 1.0f),
                  std::nextafter(std::ldexp(1.0f, -10), 0.0f), std::ldexp(1.0f, -11), 1e-30f, 1.4e-45f, 0.0f}) {
    in.push_back(x);
    in.push_back(-x);
  }
  for (float x : in) EXPECT_EQ(int(e4m3_from_float(x)), ref_e4m3_encode(x)) << "x = " << x << " bits " << std::hex << f32_bits(x);
}

TEST(E4M3Exhaustive, EncoderMatchesBruteForceOnManyInputs) {
  // Every FP32 with exponent in the E4M3 subnormal/low-normal range at a fine stride, plus random
  // inputs over all exponents and a dense log-uniform sample.
  std::vector<float> in = sample_floats(1234, 100000);
  for (std::uint32_t e = 110; e <= 137; ++e)
    for (std::uint32_t m = 0; m < (1u << 23); m += 997) in.push_back(f32_from_bits((e << 23) | m));
  for (float x : in) {
    const int want = ref_e4m3_encode(x);
    const int got = e4m3_from_float(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(e4m3_is_nan(static_cast<std::uint8_t>(got)));
      continue;
    }
    ASSERT_EQ(got, want) << "x = " << x << " bits 0x" << std::hex << f32_bits(x);
  }
}

// ---------------------------------------------------------------------------
// BF16
// ---------------------------------------------------------------------------
TEST(BF16Exhaustive, All65536ValuesRoundTrip) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_float(static_cast<std::uint16_t>(h));
    EXPECT_EQ(f32_bits(f), h << 16);
    const std::uint16_t back = bf16_from_float(f);
    if (std::isnan(f)) {
      // NaN stays NaN: quieted, sign and payload high bits kept.
      ASSERT_EQ(back, h | 0x40u) << h;
      ASSERT_TRUE(std::isnan(bf16_to_float(back)));
    } else {
      ASSERT_EQ(back, h) << h;
    }
  }
}

TEST(BF16Exhaustive, RoundingMatchesDoubleReference) {
  for (float x : sample_floats(99, 200000)) {
    const std::uint16_t got = bf16_from_float(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(bf16_to_float(got)));
      continue;
    }
    double want = std::isinf(x) ? x : ref_round_binary(x, 7, -126);
    if (std::fabs(want) > 3.3895313892515355e38) want = std::copysign(INFINITY, x);  // past BF16 max: Inf
    ASSERT_EQ(static_cast<double>(bf16_to_float(got)), want) << "x bits 0x" << std::hex << f32_bits(x);
    ASSERT_EQ(std::signbit(bf16_to_float(got)), std::signbit(x));
  }
}

// ---------------------------------------------------------------------------
// FP16
// ---------------------------------------------------------------------------
TEST(FP16Exhaustive, DecodeMatchesDefinitionForAll65536Values) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const int s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    const float got = fp16_to_float(static_cast<std::uint16_t>(h));
    if (e == 31) {
      if (m == 0)
        ASSERT_TRUE(std::isinf(got) && std::signbit(got) == (s != 0)) << h;
      else
        ASSERT_TRUE(std::isnan(got)) << h;
      continue;
    }
    const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
    ASSERT_EQ(static_cast<double>(got), s ? -mag : mag) << h;
    ASSERT_EQ(std::signbit(got), s != 0) << h;
  }
}

TEST(FP16Exhaustive, All65536ValuesRoundTrip) {
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_float(static_cast<std::uint16_t>(h));
    const std::uint16_t back = fp16_from_float(f);
    if (std::isnan(f))
      ASSERT_EQ(back, h | 0x200u) << h;  // quieted, payload kept
    else
      ASSERT_EQ(back, h) << h;
  }
}

TEST(FP16Exhaustive, EncoderMatchesDoubleReference) {
  std::vector<float> in = sample_floats(7, 200000);
  for (std::uint32_t e = 100; e <= 145; ++e)  // FP16 subnormal, normal and overflow ranges
    for (std::uint32_t m = 0; m < (1u << 23); m += 4099) in.push_back(f32_from_bits((e << 23) | m));
  // Ties at the overflow threshold: 65504 is max, 65520 the midpoint to 65536 (rounds to Inf).
  for (float x : {65504.0f, 65519.996f, 65520.0f, 65536.0f, std::ldexp(1.0f, -25), std::ldexp(3.0f, -26)}) {
    in.push_back(x);
    in.push_back(-x);
  }
  for (float x : in) {
    const std::uint16_t got = fp16_from_float(x);
    const float gf = fp16_to_float(got);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(gf));
      continue;
    }
    double want = std::isinf(x) ? x : ref_round_binary(x, 10, -14);
    if (std::fabs(want) > 65504.0) want = std::copysign(INFINITY, x);
    ASSERT_EQ(static_cast<double>(gf), want) << "x = " << x << " bits 0x" << std::hex << f32_bits(x);
    ASSERT_EQ(std::signbit(gf), std::signbit(x));
  }
}

// ---------------------------------------------------------------------------
// UE8M0 and the MX scale rules
// ---------------------------------------------------------------------------
TEST(UE8M0, DecodeAndLdexpAreExact) {
  for (int b = 0; b < 255; ++b) {
    EXPECT_EQ(static_cast<double>(ue8m0_to_float(static_cast<std::uint8_t>(b))), std::ldexp(1.0, b - 127)) << b;
    for (float x : {1.0f, -1.75f, 448.0f, std::ldexp(1.0f, -9), 3.0f}) {
      const double want = std::ldexp(static_cast<double>(x), b - 127);
      const float got = ldexp_ue8m0(x, static_cast<std::uint8_t>(b));
      // The FP32 result of the exact product (rounded where it leaves FP32's range).
      EXPECT_EQ(got, static_cast<float>(want)) << x << " b " << b;
    }
  }
  EXPECT_TRUE(std::isnan(ue8m0_to_float(255)));
  EXPECT_TRUE(std::isnan(ldexp_ue8m0(1.0f, 255)));
}

// Smallest b in 0..254 with amax <= 448 * 2^(b-127) (clamped to 254), by search in double.
int ref_rceil(float amax) {
  const double a = std::fabs(static_cast<double>(amax));
  if (!std::isfinite(a)) return 255;
  if (a == 0) return 127;
  for (int b = 0; b <= 254; ++b)
    if (a <= std::ldexp(448.0, b - 127)) return b;
  return 254;
}
// floor(log2(amax)) - 8 + 127 clamped, with floor(log2) by search in double.
int ref_floor(float amax) {
  const double a = std::fabs(static_cast<double>(amax));
  if (!std::isfinite(a)) return 255;
  if (a == 0) return 127;
  int e = -200;
  while (std::ldexp(1.0, e + 1) <= a) ++e;
  return std::clamp(e - 8 + 127, 0, 254);
}

TEST(UE8M0, RceilAndFloorMatchDoubleReference) {
  std::vector<float> in = sample_floats(42, 100000);
  for (int k = -150; k <= 128; ++k) {  // boundaries 448 * 2^k and powers of two, with neighbours
    for (double base : {448.0, 1.0, 1.75, 1.5}) {
      const float x = static_cast<float>(std::ldexp(base, k));
      if (!std::isfinite(x) || x == 0) continue;
      for (float y : {x, std::nextafter(x, 0.0f), std::nextafter(x, INFINITY)}) {
        in.push_back(y);
        in.push_back(-y);
      }
    }
  }
  for (float x : in) {
    ASSERT_EQ(int(ue8m0_rceil(x)), ref_rceil(x)) << "amax " << x << " bits 0x" << std::hex << f32_bits(x);
    ASSERT_EQ(int(ue8m0_floor(x)), ref_floor(x)) << "amax " << x << " bits 0x" << std::hex << f32_bits(x);
  }
}

TEST(UE8M0, FloorLog2AndCeilLog2) {
  for (float x : sample_floats(5, 50000)) {
    if (!std::isfinite(x) || x == 0) continue;
    const double a = std::fabs(static_cast<double>(x));
    int e = -200;
    while (std::ldexp(1.0, e + 1) <= a) ++e;
    ASSERT_EQ(f32_floor_log2(x), e) << x;
    ASSERT_EQ(f32_ceil_log2(x), std::ldexp(1.0, e) == a ? e : e + 1) << x;
  }
}

}  // namespace
}  // namespace lutb
