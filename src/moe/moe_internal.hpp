// Internal helpers shared by the expert implementations (not public API).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "lutb/moe.hpp"

namespace lutb::moe::detail {

inline std::int64_t round_up(std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; }

/// Checks x and topk against cfg (dtype, k); throws std::invalid_argument.
void check_inputs(const MoeConfig& cfg, const HiddenStates& x, const TopK& topk);
/// Global id -> local id (-1 when not local); throws std::out_of_range naming token and slot.
int local_id(const MoeConfig& cfg, std::int32_t global_id, std::int64_t token, int slot);

/// x row t converted to FP32 into dst[0..width): columns >= hidden_unpadded (and up to width) are 0.
/// With MXFP8 the logical columns are quantise-dequantised along H (spec 4 step 2).
void load_activation_row(const MoeConfig& cfg, const HiddenStates& x, std::int64_t t, ActivationFormat act,
                         std::int64_t width, float* dst);

/// Spec 4 step 4 on one row: h[i] = bf16(silu(g[i]) * u[i]) for i < I_unpadded, zero after (up to
/// width); then MXFP8 qdq along the logical I when act == MXFP8.
void gated_activation_row(const MoeConfig& cfg, const float* g, const float* u, ActivationFormat act,
                          std::int64_t width, float* h);

/// silu(g) * u in FP32, as spec 4 step 4 (before the BF16 rounding): g / (1 + exp(-g)) * u.
inline float silu_mul(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }

/// Tokens grouped by local expert: for local expert e, assignments rows [offset[e], offset[e+1])
/// of the flat assignment list; token[m], slot[m] per assignment; m_of_slot[t*k + j] = m or -1.
struct Grouping {
  std::vector<std::int64_t> offset;
  std::vector<std::int32_t> token;
  std::vector<std::int32_t> slot;
  std::vector<std::int64_t> m_of_slot;
  std::int64_t assignments() const { return static_cast<std::int64_t>(token.size()); }
};
Grouping group_by_expert(const MoeConfig& cfg, const TopK& topk, std::int64_t tokens);

/// GEMM callback of the grouped driver: for local expert e and weight `which` (0 = w13 [2I, H],
/// 1 = w2 [H, I]), compute rows [n_begin, n_end) (multiples of 8 except possibly at the end of N)
/// of C[t][n] = sum_k A[t][k] * W[n][k] for ntok token rows a[t] (FP32, zero-padded to a multiple
/// of 64 columns) into c[t] (rows of N floats).
using GroupedGemm = std::function<void(int which, int e, std::int64_t n_begin, std::int64_t n_end,
                                       const float* const* a, int ntok, float* const* c)>;

/// The grouped pipeline of spec 4 (steps 2..6) around a GEMM callback: activation load (+qdq),
/// GEMM1 over (expert, row block) jobs in parallel (blocks of a multiple of 8 rows holding about
/// job_weights weights), gated activation (+qdq), GEMM2, slot-ordered weighted sum into out [T, H].
void run_grouped(const MoeConfig& cfg, const HiddenStates& x, const TopK& topk, ActivationFormat act,
                 const GroupedGemm& gemm, std::int64_t job_weights, float* out);

/// isa, capped at best_cpu_isa(): what a kernel asked for `isa` runs.
inline CpuIsa runnable_isa(CpuIsa isa) { return isa < best_cpu_isa() ? isa : best_cpu_isa(); }

}  // namespace lutb::moe::detail

namespace lutb::moe::detail {
/// Checks LUT-B w13/w2 against cfg (shapes, buffer sizes, valid scales/codebooks); throws
/// std::invalid_argument (shape) or FormatError (data) naming `who` and the tensor.
void check_lutb_pair(const MoeConfig& cfg, const LutbTensor& w13, const LutbTensor& w2, const char* who);
}  // namespace lutb::moe::detail
