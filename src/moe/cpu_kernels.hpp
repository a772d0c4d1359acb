// GEMM row kernels of the fast CPU experts (internal). Dispatched by the instruction set the caller
// passes (lutb::moe::CpuIsa; it must be one the CPU runs: runnable_isa in moe_internal.hpp).
#pragma once

#include <cstdint>

#include "lutb/moe.hpp"

namespace lutb::moe::detail {

/// 8 FP32 table values of a tile: e4m3(codebook[i]) * 2^(scale - 127) (exact, ldexp_ue8m0).
void lutb_decode_codebook(const std::uint8_t* codebook8, std::uint8_t scale, float* out8);

/// Same as lutb_decode_codebook through the kernels' own (dispatched) table decoding.
void lutb_decode_codebook_dispatch(CpuIsa isa, const std::uint8_t* codebook8, std::uint8_t scale, float* out8);

/// One expert's LUT-B weight with TK tiles along K and N logical rows (packed [N/8, TK, 192],
/// codebook [N/8, TK, 8], scale [N/8, TK]): for rows n in [n0, n1) (n0 % 8 == 0, n < N) and tokens
/// t < ntok, c[t][n] = sum_{k < 64*TK} a[t][k] * W[n][k]. a[t] must hold 64*TK floats (zero padding).
void lutb_gemm(CpuIsa isa, const std::uint8_t* packed, const std::uint8_t* codebook, const std::uint8_t* scale, std::int64_t TK,
               std::int64_t N, std::int64_t n0, std::int64_t n1, const float* const* a, int ntok, float* const* c);

/// Dense BF16 weight w[N][K] (row-major bits): c[t][n] = sum_{k < K} a[t][k] * bf16(w[n][k]) for n in [n0, n1).
void dense_gemm(CpuIsa isa, const std::uint16_t* w, std::int64_t K, std::int64_t n0, std::int64_t n1, const float* const* a,
                int ntok, float* const* c);

}  // namespace lutb::moe::detail
