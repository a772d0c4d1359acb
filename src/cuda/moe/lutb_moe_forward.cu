// src/cuda/moe/lutb_moe_forward.cu: the fused LUT-B MoE forward (spec section 4; docs/design/cuda-moe.md):
// MXFP8 of x, grouping, GEMM1 with SiLU*up and MXFP8 of h, GEMM2, weighted top-k reduction. It runs
// the plan of src/cuda/heuristics/moe_heuristics.hpp: the swap-AB decode kernels
// (sm80_lutb_moe_swapab.cuh), the prefill tiles (lutb_moe_prefill.cu) or, for expert stacks beyond
// the swap-AB kernels' 32-bit offsets, the m16 token-tile kernels (sm80_moe_gemm_m16.cuh).
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda/common.cuh"
#include "cuda/heuristics/moe_heuristics.hpp"
#include "cuda/moe/lutb_moe_launch.hpp"
#include "cuda/moe/sm80_lutb_moe_swapab.cuh"
#include "cuda/moe/sm80_lutb_moe_swapab_act.cuh"
#include "cuda/moe/sm80_moe_gemm_m16.cuh"
#include "lutb/cuda/moe.hpp"

namespace lutb::cuda {
namespace {

namespace hx = heuristics;

/// CTAs of 1, 2, 4, 8, 16 warps (swap_smem_bytes of each) that one SM holds at once for kernel `k`
/// (cudaOccupancyMaxActiveBlocksPerMultiprocessor; 0 above `most` warps).
template <class K>
void swap_resident(K k, int most, int (&resident)[5], int (*smem)(int)) {
  for (int i = 0; i < 5; ++i) {
    resident[i] = 0;
    if ((1 << i) > most) continue;
    LUTB_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident[i], k, 32 << i, smem(1 << i)));
  }
}

/// The swap-AB GEMMs of one forward with decoder kDec, NB token blocks and kLate (1: the late
/// tile-scale K-loop, Cvt only). `fuse_reduce` (direct forwards on sm_90a, top_k <= 8): GEMM2 in
/// clusters of (1, top_k) CTAs with the weighted top-k reduction fused (kern::swap_cluster_reduce),
/// writing `out`; the caller then launches no reduction.
template <int kDec, int NB, int kLate>
void launch_swapab(const DeviceMoeWeights& w, const kern::Routing& r, const detail::Workspace& ws, std::int64_t P,
                   cudaStream_t stream, bool fuse_reduce, const float* topk_weights, std::uint16_t* out,
                   const hx::MoePlan& plan) {
  constexpr bool kLateW = kLate == 1;
  const std::int64_t H = w.hidden, I = w.intermediate;
  const std::int64_t Hp = w.w13.shape.padded_cols(), Ip = w.w2.shape.padded_cols();
  // Direct (ungrouped) forwards have one slot per pair, even with top_k > experts.
  const std::int64_t slots = r.direct_pairs > 0 ? r.direct_pairs : detail::max_tiles(P, w.experts, 8 * NB);
  const std::int64_t touched = std::min<std::int64_t>(w.experts, P);
  const kern::LutbW w13{w.w13.packed, w.w13.codebook, w.w13.scale, w.w13.shape.tiles_n(), w.w13.shape.tiles_k(),
                         w.w13.shape.tiles()};
  const kern::LutbW w2{w.w2.packed, w.w2.codebook, w.w2.scale, w.w2.shape.tiles_n(), w.w2.shape.tiles_k(),
                        w.w2.shape.tiles()};
  const auto gemm1 = &kern::sm80_lutb_moe_swapab_gemm1<kDec, NB, false, kLateW>;
  const auto gemm1_split = &kern::sm80_lutb_moe_swapab_gemm1<kDec, NB, true, kLateW>;
  const auto gemm2 = &kern::sm80_lutb_moe_swapab_gemm2<kDec, NB, kLateW>;
  // Up to 16 (NB = 1) or 8 warps x 9.6 KiB of ring: above the 48 KiB default (a host-side
  // attribute, capture-safe).
  constexpr int kMostWarps = kern::swap_max_warps(NB);
  const int most = kern::swap_smem_bytes<NB>(kMostWarps);
  LUTB_CUDA_CHECK(cudaFuncSetAttribute(gemm1, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  LUTB_CUDA_CHECK(cudaFuncSetAttribute(gemm1_split, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  LUTB_CUDA_CHECK(cudaFuncSetAttribute(gemm2, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  const std::int64_t groups1 = Ip / 32, groups2 = detail::ceil_div(w2.tiles_n, 8);
  // Resident CTAs per SM of the unsplit kernels for each CTA size (read once per instantiation: the
  // kernels' registers and shared memory do not change).
  static int res1[5], res2[5];
  static const bool res_ready = [&] {
    swap_resident(gemm1, kMostWarps, res1, &kern::swap_smem_bytes<NB>);
    swap_resident(gemm2, kMostWarps, res2, &kern::swap_smem_bytes<NB>);
    return true;
  }();
  (void)res_ready;
  // The one-wave condition for one token block only: with two, Mixtral T = 64's GEMM2 kept 2 warps
  // and ran 1.077x slower than with 4 (docs/perf/moe-gpu.md).
  const bool one_wave = NB == 1;
  const int sms = detail::sm_count();
  int nw1 = hx::decode_swap_warps(touched * groups1, w13.tiles_k, kMostWarps, sms, res1, one_wave);
  const int nw2 = hx::decode_swap_warps(touched * groups2, w2.tiles_k, kMostWarps, sms, res2, one_wave);
  // Split-K of GEMM1 across cluster CTAs (sm_90a only).
  int ks1 = 1;
  if (detail::sm90a_device() && plan.gemm1_ksplit != 1) {
    const hx::DecodeSplit s1 = plan.gemm1_ksplit == 2 ? hx::DecodeSplit{2, std::max(1, nw1 / 2)}
                                                      : hx::decode_k_split(touched * groups1, w13.tiles_k, nw1, sms);
    ks1 = s1.ksplit;
    nw1 = s1.warps;
  }
  const unsigned one_token = plan.one_token_tail ? kern::kOneTokenTail : 0u;
  // The activation kernel (sm80_lutb_moe_swapab_act.cuh): GEMM1 stores its sums per split rank to
  // ws.hpart (passed as its hq); within the workspace's rows and the kernel's 32-bit grid.x.
  const bool act = plan.act_kernel && ks1 <= hx::kActMaxSplit && P * ks1 <= ws.hpart_rows &&
                   detail::ceil_div(P * Ip, kern::kActThreads) <= 0x7fffffff;
  void* const hq1 = act ? static_cast<void*>(ws.hpart) : static_cast<void*>(ws.hq);
  const unsigned one_token1 = one_token | (act ? kern::kGemm1Partials : 0u);
  const dim3 g1(static_cast<unsigned>(groups1 * ks1), static_cast<unsigned>(slots));
  if (ks1 > 1)
    detail::launch_kernel_cluster("sm80_lutb_moe_swapab_gemm1 (split-K)", true, gemm1_split, g1, dim3(32 * nw1),
                                  kern::swap_smem_bytes<NB>(nw1), dim3(ks1, 1, 1), stream, w13,
                                  static_cast<const void*>(ws.xa), static_cast<const float*>(ws.xsf),
                                  static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip),
                                  hq1, ws.hsf, one_token1, ks1);
  else
    detail::launch_kernel("sm80_lutb_moe_swapab_gemm1", true, gemm1, g1, dim3(32 * nw1), kern::swap_smem_bytes<NB>(nw1),
                          stream, w13, static_cast<const void*>(ws.xa), static_cast<const float*>(ws.xsf),
                          static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip), hq1,
                          ws.hsf, one_token1, 1);
  if (act) {
    const std::int64_t threads = P * Ip;  // one per I-column of each pair
    detail::launch_kernel("sm80_lutb_moe_swapab_act", true, &kern::sm80_lutb_moe_swapab_act<kDec>,
                          dim3(static_cast<unsigned>(detail::ceil_div(threads, kern::kActThreads))),
                          dim3(kern::kActThreads), 0, stream, static_cast<const float*>(ws.hpart), ks1, r.ids,
                          static_cast<int>(w.experts), static_cast<long long>(P), static_cast<long long>(I),
                          static_cast<long long>(Ip), static_cast<void*>(ws.hq), ws.hsf);
  }
  const dim3 g2(static_cast<unsigned>(groups2), static_cast<unsigned>(slots));
  if (fuse_reduce)
    detail::launch_kernel_cluster("sm80_lutb_moe_swapab_gemm2 (fused top-k)", true, gemm2, g2, dim3(32 * nw2),
                                  kern::swap_smem_bytes<NB>(nw2), dim3(1, static_cast<unsigned>(r.top_k), 1), stream,
                                  w2, static_cast<const void*>(ws.hq), static_cast<const float*>(ws.hsf),
                                  static_cast<long long>(Ip), r, static_cast<long long>(H), ws.y, one_token,
                                  topk_weights, out);
  else
    detail::launch_kernel("sm80_lutb_moe_swapab_gemm2", true, gemm2, g2, dim3(32 * nw2), kern::swap_smem_bytes<NB>(nw2),
                          stream, w2, static_cast<const void*>(ws.hq), static_cast<const float*>(ws.hsf),
                          static_cast<long long>(Ip), r, static_cast<long long>(H), ws.y, one_token,
                          static_cast<const float*>(nullptr), static_cast<std::uint16_t*>(nullptr));
}

/// The m16 token-tile GEMMs (sm80_moe_gemm_m16.cuh) on LUT-B weights: MT m16 token tiles per warp.
template <bool kCvt, int MT>
void launch_gemms_m16(const DeviceMoeWeights& w, const kern::Routing& r, const detail::Workspace& ws, std::int64_t P,
                  cudaStream_t stream) {
  const std::int64_t H = w.hidden, I = w.intermediate;
  const std::int64_t Hp = w.w13.shape.padded_cols(), Ip = w.w2.shape.padded_cols();
  const std::int64_t slots = detail::max_tiles(P, w.experts, 16 * MT);
  const kern::LutbW w13{w.w13.packed, w.w13.codebook, w.w13.scale, w.w13.shape.tiles_n(), w.w13.shape.tiles_k(),
                         w.w13.shape.tiles()};
  const kern::LutbW w2{w.w2.packed, w.w2.codebook, w.w2.scale, w.w2.shape.tiles_n(), w.w2.shape.tiles_k(),
                        w.w2.shape.tiles()};
  // 4 weight strips per warp (amortises the per-K-tile work over 2048 weights per warp).
  constexpr int NT = 4;
  constexpr int smem = kern::kWarps * kern::Ring<true, NT>::kWarpBytes;
  const dim3 g1(static_cast<unsigned>(Ip / kern::gemm1_cols<NT>()), static_cast<unsigned>(slots));
  detail::launch_kernel("sm80_moe_gemm_m16_gemm1", true, kern::sm80_moe_gemm_m16_gemm1<true, kCvt, NT, MT>, g1,
                        dim3(kern::kWarps * 32), smem, stream, w13, static_cast<const uint16_t*>(nullptr),
                        static_cast<const uint16_t*>(ws.xa), static_cast<const unsigned char*>(ws.xs),
                        static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip), ws.hq,
                        ws.hs);
  const dim3 g2(static_cast<unsigned>(detail::ceil_div(w2.tiles_n, kern::kWarps * NT)), static_cast<unsigned>(slots));
  detail::launch_kernel("sm80_moe_gemm_m16_gemm2", true, kern::sm80_moe_gemm_m16_gemm2<true, kCvt, NT, MT>, g2,
                        dim3(kern::kWarps * 32), smem, stream, w2, static_cast<const uint16_t*>(nullptr),
                        static_cast<const uint16_t*>(ws.hq), static_cast<const unsigned char*>(ws.hs),
                        static_cast<long long>(Ip), r, static_cast<long long>(H), ws.y);
}

void check_shape(const DeviceLutb& d, std::int64_t E, std::int64_t N, std::int64_t K, const char* what) {
  if (d.shape.experts != E || d.shape.rows != N || d.shape.cols != K)
    throw std::invalid_argument(std::string("moe_forward: ") + what + " shape must be [" + std::to_string(E) + ", " +
                                std::to_string(N) + ", " + std::to_string(K) + "], got [" +
                                std::to_string(d.shape.experts) + ", " + std::to_string(d.shape.rows) + ", " +
                                std::to_string(d.shape.cols) + "]");
  if (!d.packed || !d.codebook || !d.scale) throw std::invalid_argument(std::string("moe_forward: ") + what + " has a null pointer");
  if (reinterpret_cast<std::uintptr_t>(d.packed) % 16 || reinterpret_cast<std::uintptr_t>(d.codebook) % 8)
    throw std::invalid_argument(std::string("moe_forward: ") + what + " packed must be 16-byte and codebook 8-byte aligned");
  if (!d.lane_major)
    throw std::invalid_argument(std::string("moe_forward: ") + what +
                                " is in checkpoint index order; convert it once with lutb::cuda::to_lane_major");
  // The swap-AB kernels' K ranges are 32-bit (lutb_moe_swapab_prologue.hpp): 2^30 K-tiles of one row strip
  // (216 GB of one expert's strip) exceed any GPU's memory, so this never fires on a real weight.
  if (d.shape.tiles_k() > kern::kSwapMaxTilesK)
    throw std::invalid_argument(std::string("moe_forward: ") + what + " has more than 2^30 K-tiles per row");
}

/// The argument checks of moe_forward (std::invalid_argument before any launch).
void check_args(const DeviceMoeWeights& w, std::int64_t tokens, int top_k) {
  const std::int64_t E = w.experts, H = w.hidden, I = w.intermediate;
  if (E < 1 || E > 1024) throw std::invalid_argument("moe_forward: experts must be 1..1024");
  if (H < 1 || I < 8 || I % 8 != 0) throw std::invalid_argument("moe_forward: need H >= 1 and I a positive multiple of 8");
  if (top_k < 1 || top_k > 32) throw std::invalid_argument("moe_forward: top_k must be 1..32");
  if (tokens < 0 || tokens > 65535) throw std::invalid_argument("moe_forward: tokens must be 0..65535 per call");
  check_shape(w.w13, E, 2 * I, H, "w13");
  check_shape(w.w2, E, H, I, "w2");
}

/// The swap-AB forward's GEMMs for the plan's decoder, token blocks and K-loop.
void run_swapab(const DeviceMoeWeights& w, const kern::Routing& r, const detail::Workspace& ws, std::int64_t P,
                cudaStream_t stream, bool cvt, bool fuse, const float* topk_weights, std::uint16_t* out,
                const hx::MoePlan& plan) {
  const int nb = plan.token_blocks;
  if (cvt && plan.late_scales) {
    if (nb == 1) launch_swapab<kern::kDecCvt, 1, 1>(w, r, ws, P, stream, fuse, topk_weights, out, plan);
    else launch_swapab<kern::kDecCvt, 2, 1>(w, r, ws, P, stream, false, topk_weights, out, plan);
  } else if (cvt) {
    if (nb == 1) launch_swapab<kern::kDecCvt, 1, 0>(w, r, ws, P, stream, fuse, topk_weights, out, plan);
    else launch_swapab<kern::kDecCvt, 2, 0>(w, r, ws, P, stream, false, topk_weights, out, plan);
  } else {
    if (nb == 1) launch_swapab<kern::kDecByte, 1, 0>(w, r, ws, P, stream, fuse, topk_weights, out, plan);
    else launch_swapab<kern::kDecByte, 2, 0>(w, r, ws, P, stream, false, topk_weights, out, plan);
  }
}

}  // namespace

namespace detail {

void moe_forward_plan(const DeviceMoeWeights& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                      const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream, const hx::MoePlan& plan, float* out_f32) {
  check_args(w, tokens, top_k);
  if (plan.token_blocks != 1 && plan.token_blocks != 2)
    throw std::invalid_argument("moe_forward: the plan's token blocks must be 1 or 2");
  if (tokens == 0) return;
  const std::int64_t E = w.experts, H = w.hidden, I = w.intermediate;
  const Workspace ws = carve(workspace, tokens, top_k, E, H, I);
  if (workspace_bytes < ws.bytes)
    throw std::invalid_argument("moe_forward: workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                                std::to_string(ws.bytes));
  const std::int64_t P = tokens * top_k;
  const std::int64_t Hp = w.w13.shape.padded_cols();
  kern::Routing r{topk_ids, topk_weights, ws.sorted, ws.tile_expert, ws.tile_start, ws.tile_count, ws.num_tiles,
                  top_k};
  // The cvt decoder exists in the sm_90a image only.
  const bool cvt = plan.cvt_decoder && sm90a_device();
  switch (plan.kernel) {
    case hx::MoeKernel::SwapAB: {
      // Direct forward: every pair is its own one-token tile, so the grouping kernel is skipped and
      // the MXFP8 of x is the first kernel (a normal launch).
      const bool direct = plan.direct && plan.token_blocks == 1 && P <= 65535;
      if (direct) {
        r.direct_pairs = static_cast<int>(P);
        r.direct_experts = static_cast<int>(E);
      } else {
        launch_group(topk_ids, P, E, 8 * plan.token_blocks, ws, stream);
      }
      launch_quantize_x(x, tokens, H, Hp, /*swap=*/!cvt, ws.xa, ws.xs, ws.xsf, stream, /*first=*/direct);
      // The top-k reduction inside GEMM2 needs one pair per tile (direct), at most 8 CTAs per cluster
      // and distributed shared memory (sm_90a). It writes BF16 only: an FP32 output takes the
      // separate reduction.
      const bool fuse = plan.fuse_reduce && direct && top_k <= 8 && sm90a_device() && out_f32 == nullptr;
      run_swapab(w, r, ws, P, stream, cvt, fuse, topk_weights, out, plan);
      if (fuse) return;
      break;
    }
    case hx::MoeKernel::Prefill:
      launch_group(topk_ids, P, E, hx::prefill_tile_rows(plan.prefill), ws, stream);
      launch_quantize_x(x, tokens, H, Hp, /*swap=*/false, ws.xa, ws.xs, nullptr, stream);
      launch_lutb_prefill_gemms(w, r, ws, P, plan.prefill, stream);
      break;
    case hx::MoeKernel::TokenM16:
      launch_group(topk_ids, P, E, 16, ws, stream);
      launch_quantize_x(x, tokens, H, Hp, /*swap=*/!cvt, ws.xa, ws.xs, nullptr, stream);
      if (cvt) launch_gemms_m16<true, 1>(w, r, ws, P, stream);
      else launch_gemms_m16<false, 1>(w, r, ws, P, stream);
      break;
  }
  launch_reduce(topk_ids, topk_weights, ws.y, tokens, top_k, E, H, out, stream, out_f32);
}

}  // namespace detail

void moe_forward(const DeviceMoeWeights& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                 const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out, void* workspace,
                 std::size_t workspace_bytes, cudaStream_t stream, const MoeOptions& options, float* out_f32) {
  check_args(w, tokens, top_k);
  if (tokens == 0) return;
  // The swap-AB kernels use 32-bit byte offsets inside one expert's stack.
  const bool small_experts = std::max(w.w13.shape.tiles_per_expert(), w.w2.shape.tiles_per_expert()) * 192 < (1ll << 31);
  const hx::MoePlan plan = hx::plan_moe(tokens, top_k, w.experts, w.hidden, small_experts, options, detail::moe_device());
  detail::moe_forward_plan(w, x, tokens, top_k, topk_ids, topk_weights, out, workspace, workspace_bytes, stream, plan,
                           out_f32);
}

}  // namespace lutb::cuda
