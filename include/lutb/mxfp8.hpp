// lutb/mxfp8.hpp: MXFP8 activations (OCP Microscaling v1.0; spec section 3).
//
// Element E4M3, block of 32 consecutive values along the last axis (K), one UE8M0 scale per block:
// x ~= e4m3_i * 2^(b-127).
//   rceil (default; NVIDIA hardware, cuBLAS, vLLM): b = smallest with amax <= 448 * 2^(b-127)
//   floor (OCP reference): b = floor(log2(amax)) - 8 + 127, elements saturate
// amax == 0 -> b = 127; a block holding NaN or +-Inf -> b = 255 and decodes to NaN.
// Elements are e4m3(x / 2^(b-127)), round to nearest even, saturating. A ragged K is zero-padded
// to a multiple of 32.
#pragma once

#include <cstdint>

#include "lutb/numerics.hpp"

namespace lutb {

inline constexpr int kMxBlock = 32;

enum class MxScaleRule : std::uint8_t { Rceil, Floor };

/// Scale byte of a block from its amax (NaN/Inf amax -> 255).
LUTB_HD constexpr std::uint8_t mx_block_scale(float amax, MxScaleRule rule) {
  return rule == MxScaleRule::Rceil ? ue8m0_rceil(amax) : ue8m0_floor(amax);
}

/// Element byte of x in a block with scale byte b (b != 255): e4m3(x * 2^(127-b)).
/// The power-of-two scaling is exact for every scale the rules produce.
LUTB_HD constexpr std::uint8_t mx_encode(float x, std::uint8_t b) {
  return e4m3_from_float(ldexp_ue8m0(x, static_cast<std::uint8_t>(254 - b)));
}

/// Decoded value of element byte q in a block with scale byte b (b == 255 -> NaN).
LUTB_HD constexpr float mx_decode(std::uint8_t q, std::uint8_t b) {
  return ldexp_ue8m0(e4m3_to_float(q), b);
}

/// Quantises n values (0 <= n <= 32; the missing 32-n are zero padding and encode 0) to one block:
/// 32 E4M3 bytes and one UE8M0 scale. A block with NaN or +-Inf gets scale 255 and all elements
/// 0x7F (NaN). Throws std::invalid_argument when n is outside 0..32.
void mxfp8_quantize_block(const float* x, int n, std::uint8_t* elems32, std::uint8_t* scale,
                          MxScaleRule rule = MxScaleRule::Rceil);

/// Quantises rows of x[rows][cols] (row-major FP32) along cols. elems: [rows][padded_cols] E4M3
/// bytes with padded_cols = ceil(cols/32)*32 (padding encodes 0); scales: [rows][padded_cols/32]
/// UE8M0. Throws std::invalid_argument for negative dimensions.
void mxfp8_quantize_rows(const float* x, std::int64_t rows, std::int64_t cols, std::uint8_t* elems,
                         std::uint8_t* scales, MxScaleRule rule = MxScaleRule::Rceil);

/// Dequantises [rows][padded_cols] elements and their scales (layout of mxfp8_quantize_rows) to
/// FP32 out[rows][cols], padding dropped; exact (E4M3 x power of two). Scale 255 gives NaN.
void mxfp8_dequantize_rows(const std::uint8_t* elems, const std::uint8_t* scales, std::int64_t rows,
                           std::int64_t cols, float* out);

/// Quantise-dequantise along the last axis: out[rows][cols] = mxfp8_dequantize(mxfp8_quantize(x)),
/// bit-identical to the two-step path (out may equal x; otherwise they must not overlap).
void mxfp8_qdq_rows(const float* x, std::int64_t rows, std::int64_t cols, float* out,
                    MxScaleRule rule = MxScaleRule::Rceil);
/// Same with BF16 input bits x[rows][cols] and FP32 output (the BF16 values are exact in FP32).
void mxfp8_qdq_rows_bf16(const std::uint16_t* x, std::int64_t rows, std::int64_t cols, float* out,
                         MxScaleRule rule = MxScaleRule::Rceil);

}  // namespace lutb
