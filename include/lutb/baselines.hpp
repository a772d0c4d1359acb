// lutb/baselines.hpp: quantise-dequantise in other low-bit weight formats, for comparisons with
// LUT-B at similar or higher bit rates (bench/bench_fit.cpp, the model helper's val-loss context).
//
// Every function takes a row-major FP32 matrix w[rows][cols] (K = cols, the reduction axis, along
// which blocks run), writes the dequantised values to out[rows][cols] (may alias w) and returns
// nothing; the bits per weight of each format are given by bits_per_weight(). Blocks at the end of
// a row that is not a multiple of the block size are shorter (equivalent to zero padding).
// Inputs must be finite (non-finite values: std::invalid_argument naming row and column).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lutb::baselines {

enum class Format {
  kInt3G128,  // INT3, asymmetric, per 128-group along K: FP16 scale and FP16 zero (offset)
  kMxfp4,     // OCP MX v1.0 MXFP4: E2M1 elements, 32-blocks along K, UE8M0 scale
  kNvfp4,     // NVIDIA NVFP4: E2M1 elements, 16-blocks along K, E4M3 scale, FP32 per-tensor scale
};

/// All formats, in the order above.
std::vector<Format> all_formats();
/// "int3-g128", "mxfp4", "nvfp4".
std::string format_name(Format f);
/// Storage cost in bits per weight: INT3-g128 3 + 2*16/128 = 3.25; MXFP4 4 + 8/32 = 4.25;
/// NVFP4 4 + 8/16 = 4.5 (plus one FP32 per tensor, ignored). LUT-B is 3.140625.
double bits_per_weight(Format f);

/// INT3-g128. Per group g of up to 128 consecutive values of a row: zero z = fp16(min g),
/// scale d = fp16((max g - z) / 7); q = clamp(round_half_even((x - z) / d), 0, 7) (q = 0 when
/// d = 0); x_hat = q * d + z (FP32). The usual min/max asymmetric recipe (e.g. GPTQ/HQQ-style
/// INT3 with g128 and FP16 metadata), kept simple: no clipping search.
void qdq_int3_g128(const float* w, std::int64_t rows, std::int64_t cols, float* out);

/// MXFP4 (OCP MX v1.0 section 6.3): per block of 32 along K, shared exponent
/// X = 2^(floor(log2(amax)) - 2) (emax of E2M1 = 2), encoded UE8M0 and clamped to 2^-127..2^127;
/// elements e2m1(x / X) with round to nearest, ties to even, saturating to +-6; amax = 0 gives
/// zeros. x_hat = e2m1 * X.
void qdq_mxfp4(const float* w, std::int64_t rows, std::int64_t cols, float* out);

/// NVFP4 (NVIDIA, as TensorRT Model Optimizer / Transformer Engine compute it): per-tensor FP32
/// global scale g = amax(tensor) / (6 * 448); per block of 16 along K, block scale
/// b = e4m3(amax(block) / (6 * g)) (saturating RNE); elements e2m1(x / (b * g)) (RNE, saturating
/// to +-6); x_hat = e2m1 * b * g. A zero tensor or block gives zeros.
void qdq_nvfp4(const float* w, std::int64_t rows, std::int64_t cols, float* out);

/// Dispatch on `f`.
void qdq(Format f, const float* w, std::int64_t rows, std::int64_t cols, float* out);

/// E2M1 (FP4) round to nearest, ties to even code, saturating: the value among
/// {0, 0.5, 1, 1.5, 2, 3, 4, 6} (with sign) nearest |x|. Exposed for tests.
float e2m1_round(float x);

}  // namespace lutb::baselines
