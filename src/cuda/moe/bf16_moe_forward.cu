// src/cuda/moe/bf16_moe_forward.cu: the BF16 baseline forward on the same kernel skeleton as the
// LUT-B one (spec section 4, last paragraph: BF16 weights, no MXFP8 steps): the benchmark's
// baseline, the CLI's --quant none on the GPU and the Python package's act_format="bf16" on CUDA.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/heuristics/moe_heuristics.hpp"
#include "lutb/cuda/moe.hpp"
#include "cuda/moe/sm80_moe_gemm_m16.cuh"
#include "cuda/moe/lutb_moe_launch.hpp"

namespace lutb::cuda {
namespace {

template <int MT>
void launch_gemms_bf16(const DeviceMoeWeightsBf16& w, const std::uint16_t* x, const kern::Routing& r,
                       const detail::Workspace& ws, std::int64_t P, cudaStream_t stream) {
  const std::int64_t H = w.hidden, I = w.intermediate;
  const std::int64_t slots = detail::max_tiles(P, w.experts, 16 * MT);
  const kern::LutbW w13{nullptr, nullptr, nullptr, 2 * I / 8, H / 64, 0};
  const kern::LutbW w2{nullptr, nullptr, nullptr, H / 8, I / 64, 0};
  constexpr int NT = 2;
  constexpr int smem = kern::kWarps * kern::Ring<false, NT>::kWarpBytes;
  const dim3 g1(static_cast<unsigned>(I / kern::gemm1_cols<NT>()), static_cast<unsigned>(slots));
  detail::launch_kernel("sm80_moe_gemm_m16_gemm1 (BF16)", true, kern::sm80_moe_gemm_m16_gemm1<false, false, NT, MT>, g1,
                        dim3(kern::kWarps * 32), smem, stream, w13, w.w13, x, static_cast<const unsigned char*>(nullptr),
                        static_cast<long long>(H), r, static_cast<long long>(I), static_cast<long long>(I), ws.hq,
                        static_cast<unsigned char*>(nullptr));
  const dim3 g2(static_cast<unsigned>(detail::ceil_div(w2.tiles_n, kern::kWarps * NT)), static_cast<unsigned>(slots));
  detail::launch_kernel("sm80_moe_gemm_m16_gemm2 (BF16)", true, kern::sm80_moe_gemm_m16_gemm2<false, false, NT, MT>, g2,
                        dim3(kern::kWarps * 32), smem, stream, w2, w.w2, static_cast<const uint16_t*>(ws.hq),
                        static_cast<const unsigned char*>(nullptr), static_cast<long long>(I), r,
                        static_cast<long long>(H), ws.y);
}

}  // namespace

void moe_forward_bf16(const DeviceMoeWeightsBf16& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                      const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream, const MoeOptions& options, float* out_f32) {
  const std::int64_t E = w.experts, H = w.hidden, I = w.intermediate;
  if (E < 1 || E > 1024) throw std::invalid_argument("moe_forward_bf16: experts must be 1..1024");
  if (H < 64 || H % 64 != 0 || I < 64 || I % 64 != 0)
    throw std::invalid_argument("moe_forward_bf16: H and I must be positive multiples of 64");
  if (top_k < 1 || top_k > 32) throw std::invalid_argument("moe_forward_bf16: top_k must be 1..32");
  if (tokens < 0 || tokens > 65535) throw std::invalid_argument("moe_forward_bf16: tokens must be 0..65535 per call");
  if (!w.w13 || !w.w2) throw std::invalid_argument("moe_forward_bf16: null weight pointer");
  if (reinterpret_cast<std::uintptr_t>(w.w13) % 16 || reinterpret_cast<std::uintptr_t>(w.w2) % 16 ||
      reinterpret_cast<std::uintptr_t>(x) % 16)
    throw std::invalid_argument("moe_forward_bf16: weights and x must be 16-byte aligned");
  if (tokens == 0) return;
  const detail::Workspace ws = detail::carve(workspace, tokens, top_k, E, H, I);
  if (workspace_bytes < ws.bytes)
    throw std::invalid_argument("moe_forward_bf16: workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                                std::to_string(ws.bytes));
  const std::int64_t P = tokens * top_k;
  // 4 m16 token tiles per warp for Prefill, 1 for Decode.
  const MoeStrategy s = options.strategy == MoeStrategy::Auto ? heuristics::choose_strategy(tokens, top_k, E, false)
                                                              : options.strategy;
  const int mt = s == MoeStrategy::Prefill ? 4 : 1;
  detail::launch_group(topk_ids, P, E, 16 * mt, ws, stream);
  const kern::Routing r{topk_ids, topk_weights, ws.sorted, ws.tile_expert, ws.tile_start, ws.tile_count, ws.num_tiles,
                        top_k};
  if (mt == 4) launch_gemms_bf16<4>(w, x, r, ws, P, stream);
  else launch_gemms_bf16<1>(w, x, r, ws, P, stream);
  detail::launch_reduce(topk_ids, topk_weights, ws.y, tokens, top_k, E, H, out, stream, out_f32);
}

}  // namespace lutb::cuda
