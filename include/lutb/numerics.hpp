// lutb/numerics.hpp: scalar number formats of LUT-B (spec section 1).
//
// Every conversion here is exact and deterministic, branch-light, and usable on the host and, when
// compiled by nvcc, on the device. These are the reference scalar implementations: every vectorised
// or GPU path in the project is tested against them.
//
//   E4M3   OCP "E4M3FN": 1 sign, 4 exponent (bias 7), 3 mantissa. Finite up to +-448, subnormals
//          m * 2^-9 (m = 1..7), no infinities, S.1111.111 (0x7F, 0xFF) is NaN.
//          Encoding rounds to nearest, ties to even, and saturates finite values (and +-Inf) to
//          +-448 (OCP MX v1.0 "saturating" mode, as vLLM). NaN encodes as 0x7F | sign.
//   UE8M0  unsigned power of two 2^(b-127), b = 0..254; 255 is NaN (OCP MX v1.0 section 5.4).
//   BF16   1, 8, 7; from FP32 by round to nearest even; NaN stays (quiet) NaN.
//   FP16   IEEE binary16; from FP32 by round to nearest even, overflow to +-Inf.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define LUTB_HD __host__ __device__ __forceinline__
#else
#define LUTB_HD inline
#endif

namespace lutb {

// ---------------------------------------------------------------------------
// Bit casts
// ---------------------------------------------------------------------------
LUTB_HD constexpr std::uint32_t f32_bits(float x) { return __builtin_bit_cast(std::uint32_t, x); }
LUTB_HD constexpr float f32_from_bits(std::uint32_t u) { return __builtin_bit_cast(float, u); }

LUTB_HD constexpr bool f32_is_nan(float x) { return (f32_bits(x) & 0x7fffffffu) > 0x7f800000u; }
LUTB_HD constexpr bool f32_is_finite(float x) { return (f32_bits(x) & 0x7f800000u) != 0x7f800000u; }

// ---------------------------------------------------------------------------
// E4M3 (OCP E4M3FN)
// ---------------------------------------------------------------------------
inline constexpr float kE4M3Max = 448.0f;          // largest finite magnitude, byte 0x7E
inline constexpr std::uint8_t kE4M3NaN = 0x7F;     // canonical NaN byte (0xFF is NaN too)
inline constexpr int kE4M3MinNormalExp = -6;       // smallest normal 2^-6, subnormal step 2^-9

/// True for the two NaN bytes 0x7F and 0xFF.
LUTB_HD constexpr bool e4m3_is_nan(std::uint8_t b) { return (b & 0x7f) == 0x7f; }

/// E4M3 byte -> FP32 (exact). NaN bytes give a quiet NaN.
LUTB_HD constexpr float e4m3_to_float(std::uint8_t b) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80) << 24;
  const std::uint32_t exp = (b >> 3) & 0xf;
  const std::uint32_t man = b & 0x7;
  if ((b & 0x7f) == 0x7f) return f32_from_bits(sign | 0x7fc00000u);
  if (exp == 0) {
    // Subnormal: man * 2^-9, exact in FP32.
    const float mag = static_cast<float>(man) * 0.001953125f;
    return sign ? -mag : mag;
  }
  return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

/// FP32 -> E4M3 byte: round to nearest, ties to even, saturating to +-448; +-Inf -> +-448;
/// NaN -> 0x7F | sign. Exact for every FP32 input (no double rounding).
LUTB_HD constexpr std::uint8_t e4m3_from_float(float x) {
  const std::uint32_t u = f32_bits(x);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint8_t>(sign | kE4M3NaN);
  if (a >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7e);  // >= 448 (and Inf): saturate
  if (a >= 0x3c800000u) {
    // Normal E4M3 (|x| >= 2^-6): drop 20 mantissa bits with round-to-nearest-even, rebias 127 -> 7.
    // A carry out of the mantissa bumps the exponent, which is the correctly rounded result; the
    // largest input below 448 rounds to at most 448 (0x7E), never to the NaN pattern.
    const std::uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u) - (120u << 23);
    return static_cast<std::uint8_t>(sign | (r >> 20));
  }
  // Subnormal E4M3: m = rne(|x| * 2^9), m in 0..8 (8 is the smallest normal, byte 0x08).
  const std::uint32_t e = a >> 23;
  if (e < 116u) return sign;  // |x| < 2^-11 (FP32 subnormals included): rounds to zero
  const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u;  // |x| = mant * 2^(e - 150)
  const std::uint32_t shift = 141u - e;                    // 22..25
  const std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  const std::uint32_t m = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  return static_cast<std::uint8_t>(sign | m);
}

/// Quantise-dequantise through E4M3 (saturating RNE).
LUTB_HD constexpr float e4m3_round(float x) { return e4m3_to_float(e4m3_from_float(x)); }

// ---------------------------------------------------------------------------
// UE8M0 (OCP MX shared scale)
// ---------------------------------------------------------------------------
inline constexpr std::uint8_t kUE8M0NaN = 255;
inline constexpr std::uint8_t kUE8M0One = 127;  // 2^0

/// UE8M0 byte -> FP32: 2^(b-127) for b in 0..254 (b = 0 is the FP32 subnormal 2^-127); 255 -> NaN.
LUTB_HD constexpr float ue8m0_to_float(std::uint8_t b) {
  if (b == 255) return f32_from_bits(0x7fc00000u);
  if (b == 0) return f32_from_bits(0x00400000u);
  return f32_from_bits(static_cast<std::uint32_t>(b) << 23);
}

/// Exact multiplication by 2^(b-127) for b in 0..254 (the result is what x * ue8m0_to_float(b)
/// gives in FP32, including gradual underflow). b = 255 gives NaN.
LUTB_HD constexpr float ldexp_ue8m0(float x, std::uint8_t b) {
  if (b == 255) return f32_from_bits(0x7fc00000u);
  // Split into two exact power-of-two factors so that neither overflows nor underflows early.
  const int e = static_cast<int>(b) - 127;  // -127..127
  const int e1 = e / 2, e2 = e - e / 2;
  const float p1 = f32_from_bits(static_cast<std::uint32_t>(e1 + 127) << 23);
  const float p2 = f32_from_bits(static_cast<std::uint32_t>(e2 + 127) << 23);
  return (x * p1) * p2;
}

/// floor(log2(|x|)) for finite nonzero FP32 x (subnormals included).
LUTB_HD constexpr int f32_floor_log2(float x) {
  const std::uint32_t a = f32_bits(x) & 0x7fffffffu;
  const int e = static_cast<int>(a >> 23);
  if (e != 0) return e - 127;
  // Subnormal: position of the highest set bit.
  int p = 22;
  while (p > 0 && !((a >> p) & 1u)) --p;
  return p - 149;
}

/// ceil(log2(|x|)) for finite nonzero FP32 x.
LUTB_HD constexpr int f32_ceil_log2(float x) {
  const std::uint32_t a = f32_bits(x) & 0x7fffffffu;
  const int fl = f32_floor_log2(x);
  const bool pow2 = ((a >> 23) != 0) ? ((a & 0x7fffffu) == 0) : ((a & (a - 1)) == 0);
  return pow2 ? fl : fl + 1;
}

/// rceil scale rule (spec sections 2.1 and 3): the smallest b with amax <= 448 * 2^(b-127), i.e.
/// ceil(log2(amax / 448)) + 127, clamped to 0..254. amax = 0 gives 127; NaN/Inf amax gives 255.
/// Computed exactly: amax / 448 = amax / 7 / 64 would round, so instead compare amax against
/// 448 * 2^k directly.
LUTB_HD constexpr std::uint8_t ue8m0_rceil(float amax) {
  const float a = amax < 0 ? -amax : amax;
  if (!f32_is_finite(a)) return 255;
  if (a == 0.0f) return 127;
  // Candidate from the exponent; 448 = 1.75 * 2^8. amax <= 448*2^k  <=>  k >= log2(amax/448).
  int k = f32_floor_log2(a) - 8;  // 2^(fl) <= a < 2^(fl+1); 448*2^(fl-8) = 1.75*2^fl
  // Check whether 448 * 2^k >= a, else k+1 (448*2^(fl-7) = 3.5*2^fl > a always).
  // 448 * 2^k = 1.75 * 2^(k+8): compare the mantissa of a against 1.75.
  const std::uint32_t bits = f32_bits(a);
  float m = 0.0f;  // a / 2^fl in [1, 2)
  if ((bits >> 23) != 0) {
    m = f32_from_bits((bits & 0x7fffffu) | 0x3f800000u);
  } else {
    // Subnormal: normalise by scaling with 2^64 (exact) and recompute.
    const float s = a * 18446744073709551616.0f;
    m = f32_from_bits((f32_bits(s) & 0x7fffffu) | 0x3f800000u);
  }
  if (m > 1.75f) k += 1;
  int b = k + 127;
  if (b < 0) b = 0;
  if (b > 254) b = 254;
  return static_cast<std::uint8_t>(b);
}

/// floor scale rule (OCP MX reference, spec section 3): b = floor(log2(amax)) - 8 + 127, clamped
/// to 0..254. amax = 0 gives 127; NaN/Inf gives 255.
LUTB_HD constexpr std::uint8_t ue8m0_floor(float amax) {
  const float a = amax < 0 ? -amax : amax;
  if (!f32_is_finite(a)) return 255;
  if (a == 0.0f) return 127;
  int b = f32_floor_log2(a) - 8 + 127;
  if (b < 0) b = 0;
  if (b > 254) b = 254;
  return static_cast<std::uint8_t>(b);
}

// ---------------------------------------------------------------------------
// BF16
// ---------------------------------------------------------------------------
/// FP32 -> BF16 bits, round to nearest even. NaN -> quiet NaN with the same sign.
LUTB_HD constexpr std::uint16_t bf16_from_float(float x) {
  const std::uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/// BF16 bits -> FP32 (exact).
LUTB_HD constexpr float bf16_to_float(std::uint16_t h) {
  return f32_from_bits(static_cast<std::uint32_t>(h) << 16);
}
/// Quantise-dequantise through BF16.
LUTB_HD constexpr float bf16_round(float x) { return bf16_to_float(bf16_from_float(x)); }

// ---------------------------------------------------------------------------
// FP16 (IEEE binary16)
// ---------------------------------------------------------------------------
/// FP16 bits -> FP32 (exact).
LUTB_HD constexpr float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    const float mag = static_cast<float>(man) * 5.9604644775390625e-08f;  // man * 2^-24
    return sign ? -mag : mag;
  }
  return f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

/// FP32 -> FP16 bits, round to nearest even, overflow to +-Inf, gradual underflow. NaN -> quiet NaN.
LUTB_HD constexpr std::uint16_t fp16_from_float(float x) {
  const std::uint32_t u = f32_bits(x);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (a >= 0x38800000u) {                                                   // normal (>= 2^-14)
    const std::uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);
    return static_cast<std::uint16_t>(sign | (r >> 13));
  }
  const std::uint32_t e = a >> 23;
  if (e < 101u) return sign;  // < 2^-26: rounds to zero
  const std::uint32_t mant = (a & 0x7fffffu) | 0x800000u;  // |x| = mant * 2^(e-150); m = |x| * 2^24
  const std::uint32_t shift = 126u - e;                    // 14..25
  const std::uint32_t q = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  return static_cast<std::uint16_t>(sign | (q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u)));
}

// ---------------------------------------------------------------------------
// Bulk conversions (CPU). Vectorised with Highway and dispatched at run time to the best target the
// CPU supports (AVX-512, AVX2, SSE4, ...; the library itself is built for baseline x86-64), see
// src/core/numerics_bulk.cpp. Each is bit-identical to the scalar function it names, for every
// input including NaN payloads (tested on every target). n may be 0; in and out must not overlap;
// no alignment is required.
// ---------------------------------------------------------------------------
/// out[i] = bf16_to_float(in[i]) for i < n.
void bf16_to_float_n(const std::uint16_t* in, float* out, std::size_t n);
/// out[i] = bf16_from_float(in[i]) for i < n.
void bf16_from_float_n(const float* in, std::uint16_t* out, std::size_t n);
/// out[i] = fp16_to_float(in[i]) for i < n.
void fp16_to_float_n(const std::uint16_t* in, float* out, std::size_t n);
/// out[i] = e4m3_to_float(in[i]) for i < n.
void e4m3_to_float_n(const std::uint8_t* in, float* out, std::size_t n);
/// out[i] = e4m3_from_float(in[i]) for i < n.
void e4m3_from_float_n(const float* in, std::uint8_t* out, std::size_t n);

}  // namespace lutb
