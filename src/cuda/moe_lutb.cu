// src/cuda/moe_lutb.cu: the fused LUT-B MoE forward (spec section 4): MXFP8 of x, grouping, GEMM1
// with SiLU*up and MXFP8 of h, GEMM2, weighted top-k reduction. Kernel names follow the DeepGEMM
// habit: arch, types, scaling (sm80_lutb_mxfp8_moe_{gemm1,gemm2}_{swapab,decode,prefill}; the same
// code runs on sm_90a with the hardware E4M3 decoder). Strategy choice: choose_strategy and
// decode_token_blocks in moe_common.cu, apart from the kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "lutb/cuda/moe.hpp"
#include "moe_gemm.cuh"
#include "moe_internal.hpp"
#include "moe_prefill.hpp"
#include "moe_act.cuh"
#include "moe_swapab.cuh"
#include "moe_swapab_sm90.cuh"
#include "moe_swapab_ws_sm90.cuh"

namespace lutb::cuda {
namespace {

/// Warps per CTA of the swap-AB kernels (they split K): at least 2 (shorter CTAs balance the last
/// wave), doubled up to 8 while the expected warps (`ctas` = touched experts x strip groups, times
/// the split) stay under 12 per SM and each warp keeps at least 2 K-tiles. Measured on the H200
/// (LUTB_SWAPAB_WARPS sweep, docs/perf/moe-gpu.md): DeepSeek-V3 T=1 best at 4, T=16 at 2;
/// Qwen3-30B T=1 at 4-8, T=16 at 2. 16 warps (`most` = kern::swap_max_warps = 16: one token block)
/// only when every CTA is resident at once (ctas <= 132: a 16-warp CTA fills an SM) and each warp
/// keeps 4 K-tiles: the few-CTA, long-K GEMMs such as Mixtral's GEMM2 at T = 1 (2 experts x 64 row
/// groups, 224 K-tiles), which 8-warp CTAs leave at 7.8 warps per SM.
/// The rule itself is decode_swap_warps (moe.hpp, below; kDecodeOneWave adds its one-wave condition).
int swap_warps(std::int64_t ctas, std::int64_t tiles_k, int most, const int (&resident)[5], bool one_wave) {
  // Benchmarking knobs (read once): LUTB_SWAPAB_WARPS = 1, 2, 4, 8 or 16 (one token block only)
  // forces the split; LUTB_SWAPAB_WARPS16=0 stops the rule at 8.
  static const int forced = [] {
    const char* v = std::getenv("LUTB_SWAPAB_WARPS");
    return v ? std::atoi(v) : 0;
  }();
  static const bool allow16 = [] {
    const char* v = std::getenv("LUTB_SWAPAB_WARPS16");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  if ((forced == 1 || forced == 2 || forced == 4 || forced == 8 || forced == 16) && forced <= most) return forced;
  return decode_swap_warps(ctas, tiles_k, allow16 ? most : std::min(most, 8), detail::sm_count(), resident, one_wave);
}

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

/// The swap-AB kernels of launch_swapab: kLate = 0 the default K-loop, 1 the late tile scales
/// (kDecodeLateScales), 2 the late tile scales at 96 registers (kDecodeLateScales96; one token block).
template <int kDec, int NB, bool kSplit, int kLate>
constexpr auto swap_gemm1_fn() {
  if constexpr (kLate == 2) {
    static_assert(NB == 1, "the 96-register kernels hold one token block");
    return &kern::swapab_gemm1_r96_kernel<kDec, kSplit>;
  } else {
    return &kern::swapab_gemm1_kernel<kDec, NB, kSplit, kLate == 1>;
  }
}
template <int kDec, int NB, bool kSplit, int kLate>
constexpr auto swap_gemm2_fn() {
  if constexpr (kLate == 2) {
    static_assert(NB == 1, "the 96-register kernels hold one token block");
    return &kern::swapab_gemm2_r96_kernel<kDec, kSplit>;
  } else {
    return &kern::swapab_gemm2_kernel<kDec, NB, kSplit, kLate == 1>;
  }
}

/// The swap-AB GEMMs. `fuse_reduce` (direct forwards on sm_90 only, top_k <= 8): GEMM2 in clusters
/// of (1, top_k) CTAs with the weighted top-k reduction fused (kern::swap_cluster_reduce), writing
/// `out`; the caller then launches no reduction. `stop`: forward_stop_after() (benchmark only).
template <int kDec, int NB, int kLate = 0>
void launch_swapab(const DeviceMoeWeights& w, const kern::Routing& r, const detail::Workspace& ws, std::int64_t P,
                   cudaStream_t stream, bool fuse_reduce, const float* topk_weights, std::uint16_t* out, int stop) {
  const std::int64_t H = w.hidden, I = w.intermediate;
  const std::int64_t Hp = w.w13.shape.padded_cols(), Ip = w.w2.shape.padded_cols();
  // Direct (ungrouped, T = 1) forwards have one slot per pair, even with top_k > experts.
  const std::int64_t slots = r.direct_pairs > 0 ? r.direct_pairs : detail::max_tiles(P, w.experts, 8 * NB);
  const std::int64_t touched = std::min<std::int64_t>(w.experts, P);
  const kern::LutbW w13{w.w13.packed, w.w13.codebook, w.w13.scale, w.w13.shape.tiles_n(), w.w13.shape.tiles_k(),
                         w.w13.shape.tiles()};
  const kern::LutbW w2{w.w2.packed, w.w2.codebook, w.w2.scale, w.w2.shape.tiles_n(), w.w2.shape.tiles_k(),
                        w.w2.shape.tiles()};
  // Up to 16 (NB = 1) or 8 warps x 9.6 KiB of ring: above the 48 KiB default (a host-side
  // attribute, capture-safe).
  constexpr int kMostWarps = kern::swap_max_warps(NB);
  const int most = kern::swap_smem_bytes<NB>(kMostWarps);
  for (auto* k : {swap_gemm1_fn<kDec, NB, false, kLate>(), swap_gemm1_fn<kDec, NB, true, kLate>()}) {
    LUTB_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
    // The 96-register kernels: all of the SM's shared memory for the CTAs' rings, so that the
    // registers, not the carveout, bound the resident warps (20 x 9.6 KiB).
    if constexpr (kLate == 2)
      LUTB_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  }
  for (auto* k : {swap_gemm2_fn<kDec, NB, false, kLate>(), swap_gemm2_fn<kDec, NB, true, kLate>()}) {
    LUTB_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
    if constexpr (kLate == 2)
      LUTB_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  }
  // FP8 decoder: E4M3 bytes of x and h; FP16 decoders: FP16 values.
  const void* xa = kDec == kern::kDecFp8 ? static_cast<const void*>(ws.xq8) : static_cast<const void*>(ws.xa);
  void* hq = kDec == kern::kDecFp8 ? static_cast<void*>(ws.hq8) : static_cast<void*>(ws.hq);
  const std::int64_t groups1 = Ip / 32, groups2 = detail::ceil_div(w2.tiles_n, 8);
  // Resident CTAs per SM of the unsplit kernels for each CTA size (kDecodeOneWave; read once per
  // instantiation: the kernels' registers and shared memory do not change).
  static int res1[5], res2[5];
  static const bool res_ready = [] {
    swap_resident(swap_gemm1_fn<kDec, NB, false, kLate>(), kMostWarps, res1, &kern::swap_smem_bytes<NB>);
    swap_resident(swap_gemm2_fn<kDec, NB, false, kLate>(), kMostWarps, res2, &kern::swap_smem_bytes<NB>);
    return true;
  }();
  (void)res_ready;
  const unsigned paths = detail::decode_paths();
  // One token block only (kDecodeOneWave, moe.hpp): with two, Mixtral T = 64's GEMM2 kept 2 warps and
  // ran 1.077x slower than with session 16's 4 (device run k-run1).
  const bool one_wave = (paths & kDecodeOneWave) != 0 && NB == 1;
  int nw1 = swap_warps(touched * groups1, w13.tiles_k, kMostWarps, res1, one_wave);
  int nw2 = swap_warps(touched * groups2, w2.tiles_k, kMostWarps, res2, one_wave);
  // Split-K across cluster CTAs (decode_k_split, moe.hpp; sm_90a only; never for a GEMM2 that
  // fuses the top-k reduction, whose cluster already spans the token's pairs).
  int ks1 = 1, ks2 = 1;
  if (detail::cluster_launch_ok()) {
    const DecodeSplit s1 = detail::gemm_k_split(1, touched * groups1, w13.tiles_k, nw1);
    ks1 = s1.ksplit;
    nw1 = s1.warps;
    if (!fuse_reduce) {
      const DecodeSplit s2 = detail::gemm_k_split(2, touched * groups2, w2.tiles_k, nw2);
      ks2 = s2.ksplit;
      nw2 = s2.warps;
    }
  }
  // Benchmarking knob: LUTB_SWAPAB_ONE=0 runs one-token tiles through the general K-loop (read once).
  static const bool one_token_loop = [] {
    const char* v = std::getenv("LUTB_SWAPAB_ONE");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  // The kernels' one-token bits (moe_swapab.cuh kOneTokenLoop, kOneTokenTail).
  const bool tail = (paths & kDecodeOneTokenTail) ||
                    ((paths & kDecodeOneTokenTailRule) && decode_one_token_tail(P / r.top_k, r.top_k, w.experts));
  const unsigned one_token = (one_token_loop ? kern::kOneTokenLoop : 0u) | (tail ? kern::kOneTokenTail : 0u);
  // L2 prefetch of GEMM2's weights by GEMM1's CTAs (set_decode_l2_prefetch; sm_90a image only, where
  // cp.async.bulk.prefetch exists): the byte rule decode_l2_prefetch_tiles on the w2 bytes of the
  // touched experts, per GEMM2 K range (its warps x its split, swap_k_range).
  kern::L2Prefetch pf{w2.packed, w2.codebook, w2.scale, w2.tiles_n, w2.tiles_k, w2.total_tiles, 0, 0, 0, 0, 0};
  if (detail::cluster_launch_ok() && detail::l2_prefetch_budget() > 0) {
    const std::int64_t ranges = static_cast<std::int64_t>(nw2) * ks2;
    const std::int64_t per = detail::ceil_div(w2.tiles_k, ranges);
    const std::int64_t w2_bytes = touched * w2.tiles_n * w2.tiles_k * 201;  // index + codebook + scale
    pf.ranges = static_cast<int>(ranges);
    pf.per = static_cast<int>(per);
    pf.kpf = decode_l2_prefetch_tiles(w2_bytes, per, detail::l2_prefetch_budget());
    pf.evict_last = detail::l2_prefetch_evict_last() ? 1 : 0;
    pf.late = detail::l2_prefetch_late() ? 1 : 0;
  }
  // kDecodeActKernel (moe.hpp; act18): GEMM1 stores its sums per split rank to ws.hpart (passed as
  // its hq) and the activation kernel (moe_act.cuh) writes hq and hsf from them.
  // The rule (kDecodeActKernelRule, decode_act_kernel) for one and two token blocks (two blocks:
  // Mixtral T = 64, 1.10x in act18-run2; checked bit for bit on the GPU in the final run of session 18)
  // and, since session 19 (act19), above 128 pairs within the workspace's rows.
  const bool act_rule = (paths & kDecodeActKernelRule) && decode_act_kernel(P / r.top_k, r.top_k, w.experts, H);
  // Within the workspace's rows (act_rows, moe.hpp: P x ks1 rows of 2 Ip sums) and the activation
  // kernel's 32-bit grid.x (P Ip / kActThreads CTAs; P <= kActMaxRows, so Ip < 2^28 suffices).
  const bool act = ((paths & kDecodeActKernel) || act_rule) && ks1 <= kActMaxSplit && P * ks1 <= ws.hpart_rows &&
                   detail::ceil_div(P * Ip, kern::kActThreads) <= 0x7fffffff;
  void* const hq1 = act ? static_cast<void*>(ws.hpart) : hq;
  const unsigned one_token1 = one_token | (act ? kern::kGemm1Partials : 0u);
  const dim3 g1(static_cast<unsigned>(groups1 * ks1), static_cast<unsigned>(slots));
  if (ks1 > 1)
    detail::launch_kernel_cluster("sm90_lutb_mxfp8_moe_gemm1_swapab_splitk", true, swap_gemm1_fn<kDec, NB, true, kLate>(),
                                  g1, dim3(32 * nw1), kern::swap_smem_bytes<NB>(nw1), dim3(ks1, 1, 1), stream, w13, xa,
                                  static_cast<const float*>(ws.xsf), static_cast<long long>(Hp), r,
                                  static_cast<long long>(I), static_cast<long long>(Ip), hq1, ws.hsf, one_token1, ks1, pf);
  else
    detail::launch_kernel("sm80_lutb_mxfp8_moe_gemm1_swapab", true, swap_gemm1_fn<kDec, NB, false, kLate>(), g1,
                          dim3(32 * nw1), kern::swap_smem_bytes<NB>(nw1), stream, w13, xa,
                          static_cast<const float*>(ws.xsf), static_cast<long long>(Hp), r, static_cast<long long>(I),
                          static_cast<long long>(Ip), hq1, ws.hsf, one_token1, 1, pf);
  if (act) {
    const std::int64_t threads = P * Ip;  // one per I-column of each pair
    detail::launch_kernel("sm80_lutb_mxfp8_moe_act_swapab", true, &kern::swap_act_kernel<kDec>,
                          dim3(static_cast<unsigned>(detail::ceil_div(threads, kern::kActThreads))),
                          dim3(kern::kActThreads), 0, stream, static_cast<const float*>(ws.hpart), ks1, r.ids,
                          static_cast<int>(w.experts), static_cast<long long>(P), static_cast<long long>(I),
                          static_cast<long long>(Ip), hq, ws.hsf);
  }
  if (stop == 2) return;
  const dim3 g2(static_cast<unsigned>(groups2 * ks2), static_cast<unsigned>(slots));
  if (fuse_reduce) {
    detail::launch_kernel_cluster("sm90_lutb_mxfp8_moe_gemm2_swapab_reduce", true, swap_gemm2_fn<kDec, NB, false, kLate>(),
                                  g2, dim3(32 * nw2), kern::swap_smem_bytes<NB>(nw2),
                                  dim3(1, static_cast<unsigned>(r.top_k), 1), stream, w2, static_cast<const void*>(hq),
                                  static_cast<const float*>(ws.hsf), static_cast<long long>(Ip), r,
                                  static_cast<long long>(H), ws.y, one_token, topk_weights, out, 1);
  } else if (ks2 > 1) {
    detail::launch_kernel_cluster("sm90_lutb_mxfp8_moe_gemm2_swapab_splitk", true, swap_gemm2_fn<kDec, NB, true, kLate>(),
                                  g2, dim3(32 * nw2), kern::swap_smem_bytes<NB>(nw2), dim3(ks2, 1, 1), stream, w2,
                                  static_cast<const void*>(hq), static_cast<const float*>(ws.hsf),
                                  static_cast<long long>(Ip), r, static_cast<long long>(H), ws.y, one_token,
                                  static_cast<const float*>(nullptr), static_cast<std::uint16_t*>(nullptr), ks2);
  } else {
    detail::launch_kernel("sm80_lutb_mxfp8_moe_gemm2_swapab", true, swap_gemm2_fn<kDec, NB, false, kLate>(), g2,
                          dim3(32 * nw2), kern::swap_smem_bytes<NB>(nw2), stream, w2, static_cast<const void*>(hq),
                          static_cast<const float*>(ws.hsf), static_cast<long long>(Ip), r, static_cast<long long>(H),
                          ws.y, one_token, static_cast<const float*>(nullptr),
                          static_cast<std::uint16_t*>(nullptr), 1);
  }
}

/// Warpgroups per CTA of the wgmma kernels (they split K like swap_warps' warps: one warpgroup
/// does the work of one mma.sync warp): doubled from 1 up to kern::kWgMaxGroups while the
/// expected warpgroups (`ctas` x the split) stay under `resident` per SM and each keeps at least 4
/// K-tiles. Benchmarking knob: LUTB_WG_GROUPS = 1, 2 or 4 forces the split (read once).
int wg_groups(std::int64_t ctas, std::int64_t tiles_k, int nb) {
  static const int forced = [] {
    const char* v = std::getenv("LUTB_WG_GROUPS");
    return v ? std::atoi(v) : 0;
  }();
  if (forced == 1 || forced == 2 || forced == 4) return forced;
  // Warpgroups per SM: 8 at the one-block kernels' 64 registers, 4 at the two-block ones' ~100.
  const std::int64_t resident = nb == 1 ? 8 : 4;
  int g = 1;
  while (g < kern::kWgMaxGroups && ctas * g * 2 <= 132 * resident && tiles_k >= 8 * g) g *= 2;
  return g;
}

template <int NB>
void launch_swapab_wg(const DeviceMoeWeights& w, const kern::Routing& r, const detail::Workspace& ws, std::int64_t P,
                      cudaStream_t stream) {
  const std::int64_t H = w.hidden, I = w.intermediate;
  const std::int64_t Hp = w.w13.shape.padded_cols(), Ip = w.w2.shape.padded_cols();
  const std::int64_t slots = r.direct_pairs > 0 ? r.direct_pairs : detail::max_tiles(P, w.experts, 8 * NB);
  const std::int64_t touched = std::min<std::int64_t>(w.experts, P);
  const kern::LutbW w13{w.w13.packed, w.w13.codebook, w.w13.scale, w.w13.shape.tiles_n(), w.w13.shape.tiles_k(),
                         w.w13.shape.tiles()};
  const kern::LutbW w2{w.w2.packed, w.w2.codebook, w.w2.scale, w.w2.shape.tiles_n(), w.w2.shape.tiles_k(),
                        w.w2.shape.tiles()};
  const int most = kern::wg_smem_bytes<NB>(kern::kWgMaxGroups);
  LUTB_CUDA_CHECK(cudaFuncSetAttribute(kern::swapab_wg_gemm1_kernel<NB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       most));
  LUTB_CUDA_CHECK(cudaFuncSetAttribute(kern::swapab_wg_gemm2_kernel<NB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       most));
  const std::int64_t groups1 = Ip / 32, groups2 = detail::ceil_div(w2.tiles_n, 8);
  const int ng1 = wg_groups(touched * groups1, w13.tiles_k, NB);
  const int ng2 = wg_groups(touched * groups2, w2.tiles_k, NB);
  const dim3 g1(static_cast<unsigned>(groups1), static_cast<unsigned>(slots));
  detail::launch_kernel("sm90_lutb_mxfp8_moe_gemm1_swapab_wgmma", true, kern::swapab_wg_gemm1_kernel<NB>, g1,
                        dim3(128 * ng1), kern::wg_smem_bytes<NB>(ng1), stream, w13,
                        static_cast<const unsigned char*>(ws.xq8), static_cast<const float*>(ws.xsf),
                        static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip),
                        static_cast<unsigned char*>(ws.hq8), ws.hsf);
  const dim3 g2(static_cast<unsigned>(groups2), static_cast<unsigned>(slots));
  detail::launch_kernel("sm90_lutb_mxfp8_moe_gemm2_swapab_wgmma", true, kern::swapab_wg_gemm2_kernel<NB>, g2,
                        dim3(128 * ng2), kern::wg_smem_bytes<NB>(ng2), stream, w2,
                        static_cast<const unsigned char*>(ws.hq8), static_cast<const float*>(ws.hsf),
                        static_cast<long long>(Ip), r, static_cast<long long>(H), ws.y);
}

/// The warp-specialised swap-AB kernels (WeightDecoder::CvtWs, moe_swapab_ws_sm90.cuh): the same
/// grid and the same math-warp count as launch_swapab<kDecCvt> (so the same K split: bit-identical
/// results), plus one producer warp per CTA.
template <int NB>
void launch_swapab_ws(const DeviceMoeWeights& w, const kern::Routing& r, const detail::Workspace& ws, std::int64_t P,
                      cudaStream_t stream) {
  const std::int64_t H = w.hidden, I = w.intermediate;
  const std::int64_t Hp = w.w13.shape.padded_cols(), Ip = w.w2.shape.padded_cols();
  const std::int64_t slots = r.direct_pairs > 0 ? r.direct_pairs : detail::max_tiles(P, w.experts, 8 * NB);
  const std::int64_t touched = std::min<std::int64_t>(w.experts, P);
  const kern::LutbW w13{w.w13.packed, w.w13.codebook, w.w13.scale, w.w13.shape.tiles_n(), w.w13.shape.tiles_k(),
                         w.w13.shape.tiles()};
  const kern::LutbW w2{w.w2.packed, w.w2.codebook, w.w2.scale, w.w2.shape.tiles_n(), w.w2.shape.tiles_k(),
                        w.w2.shape.tiles()};
  constexpr int kMostWarps = kern::ws_max_warps(NB);
  const int most = kern::ws_smem_bytes<NB>(kMostWarps);
  LUTB_CUDA_CHECK(cudaFuncSetAttribute(kern::sm90_lutb_mxfp8_moe_gemm1_swapab_ws<NB>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  LUTB_CUDA_CHECK(cudaFuncSetAttribute(kern::sm90_lutb_mxfp8_moe_gemm2_swapab_ws<NB>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  const std::int64_t groups1 = Ip / 32, groups2 = detail::ceil_div(w2.tiles_n, 8);
  // The same warps as launch_swapab<kDecCvt> without kDecodeOneWave (the residency arrays are unused
  // then): bit-identical to the Cvt kernels of that configuration.
  const int none[5] = {0, 0, 0, 0, 0};
  const int nw1 = swap_warps(touched * groups1, w13.tiles_k, kMostWarps, none, false);
  const int nw2 = swap_warps(touched * groups2, w2.tiles_k, kMostWarps, none, false);
  static const bool one_token_loop = [] {
    const char* v = std::getenv("LUTB_SWAPAB_ONE");
    return !(v && std::strcmp(v, "0") == 0);
  }();
  const dim3 g1(static_cast<unsigned>(groups1), static_cast<unsigned>(slots));
  detail::launch_kernel("sm90_lutb_mxfp8_moe_gemm1_swapab_ws", true, kern::sm90_lutb_mxfp8_moe_gemm1_swapab_ws<NB>,
                        g1, dim3(32 * (nw1 + 1)), kern::ws_smem_bytes<NB>(nw1), stream, w13,
                        static_cast<const void*>(ws.xa), static_cast<const float*>(ws.xsf),
                        static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip),
                        static_cast<void*>(ws.hq), ws.hsf, one_token_loop);
  const dim3 g2(static_cast<unsigned>(groups2), static_cast<unsigned>(slots));
  detail::launch_kernel("sm90_lutb_mxfp8_moe_gemm2_swapab_ws", true, kern::sm90_lutb_mxfp8_moe_gemm2_swapab_ws<NB>,
                        g2, dim3(32 * (nw2 + 1)), kern::ws_smem_bytes<NB>(nw2), stream, w2,
                        static_cast<const void*>(ws.hq), static_cast<const float*>(ws.hsf),
                        static_cast<long long>(Ip), r, static_cast<long long>(H), ws.y, one_token_loop);
}

template <bool kCvt, int MT>
void launch_gemms(const DeviceMoeWeights& w, const kern::Routing& r, const detail::Workspace& ws, std::int64_t P,
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
  detail::launch_kernel("sm80_lutb_mxfp8_moe_gemm1", true, kern::moe_gemm1_kernel<true, kCvt, NT, MT>, g1,
                        dim3(kern::kWarps * 32), smem, stream, w13, static_cast<const uint16_t*>(nullptr),
                        static_cast<const uint16_t*>(ws.xa), static_cast<const unsigned char*>(ws.xs),
                        static_cast<long long>(Hp), r, static_cast<long long>(I), static_cast<long long>(Ip), ws.hq,
                        ws.hs);
  const dim3 g2(static_cast<unsigned>(detail::ceil_div(w2.tiles_n, kern::kWarps * NT)), static_cast<unsigned>(slots));
  detail::launch_kernel("sm80_lutb_mxfp8_moe_gemm2", true, kern::moe_gemm2_kernel<true, kCvt, NT, MT>, g2,
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
  // The swap-AB kernels' K ranges are 32-bit (swap_prologue.hpp): 2^30 K-tiles of one row strip
  // (216 GB of one expert's strip) exceed any GPU's memory, so this never fires on a real weight.
  if (d.shape.tiles_k() > kern::kSwapMaxTilesK)
    throw std::invalid_argument(std::string("moe_forward: ") + what + " has more than 2^30 K-tiles per row");
}

}  // namespace

int decode_swap_warps(std::int64_t ctas, std::int64_t tiles_k, int most, int sms, const int (&resident)[5],
                      bool one_wave) {
  if (tiles_k < 4) return 1;
  // resident[i]: CTAs of 2^i warps per SM; a doubling w -> 2w that turns one wave into two is skipped.
  auto lg = [](int w) { return w == 1 ? 0 : w == 2 ? 1 : w == 4 ? 2 : w == 8 ? 3 : 4; };
  auto breaks_wave = [&](int w) {
    if (!one_wave) return false;
    const std::int64_t now = static_cast<std::int64_t>(sms) * resident[lg(w)];
    const std::int64_t next = static_cast<std::int64_t>(sms) * resident[lg(2 * w)];
    return ctas <= now && ctas > next;
  };
  int w = 2;
  while (w < 8 && w < most && ctas * w < 132 * 12 && tiles_k >= 4 * w && !breaks_wave(w)) w *= 2;
  if (w == 8 && most >= 16 && ctas <= 132 && tiles_k >= 64 && !breaks_wave(8)) w = 16;
  return w;
}

bool decode_one_token_tail(std::int64_t tokens, int top_k, std::int64_t experts) {
  if (tokens < 1 || top_k < 1 || experts < 1) return false;
  if (tokens == 1) return true;
  const double p = std::min(1.0, static_cast<double>(top_k) / static_cast<double>(experts));
  const double touched = static_cast<double>(experts) * (1.0 - std::pow(1.0 - p, static_cast<double>(tokens)));
  return touched > 0 && static_cast<double>(tokens) * top_k / touched <= kOneTokenTailMaxPairsPerExpert;
}

bool decode_act_kernel(std::int64_t tokens, int top_k, std::int64_t experts, std::int64_t hidden) {
  if (tokens <= 1 || top_k < 1 || experts < 1 || hidden < 1) return false;
  if ((hidden + 63) / 64 > kActMaxTilesK) return false;  // GEMM1's K-tiles (session 19, act19)
  const double p = std::min(1.0, static_cast<double>(top_k) / static_cast<double>(experts));
  const double touched = static_cast<double>(experts) * (1.0 - std::pow(1.0 - p, static_cast<double>(tokens)));
  return touched > 0 && static_cast<double>(tokens) * top_k / touched > kActMinPairsPerExpert;
}

#ifdef LUTB_SWAPAB_PHASES
void set_swap_phase_buffer(SwapPhaseRecord* buf) {  // benchmark-only build (moe.hpp)
  LUTB_CUDA_CHECK(cudaMemcpyToSymbol(kern::g_swap_phases, &buf, sizeof buf));
}
#endif

void moe_forward(const DeviceMoeWeights& w, const std::uint16_t* x, std::int64_t tokens, int top_k,
                 const std::int32_t* topk_ids, const float* topk_weights, std::uint16_t* out, void* workspace,
                 std::size_t workspace_bytes, cudaStream_t stream, MoeStrategy strategy, float* out_f32) {
  const std::int64_t E = w.experts, H = w.hidden, I = w.intermediate;
  if (E < 1 || E > 1024) throw std::invalid_argument("moe_forward: experts must be 1..1024");
  if (H < 1 || I < 8 || I % 8 != 0) throw std::invalid_argument("moe_forward: need H >= 1 and I a positive multiple of 8");
  if (top_k < 1 || top_k > 32) throw std::invalid_argument("moe_forward: top_k must be 1..32");
  if (tokens < 0 || tokens > 65535) throw std::invalid_argument("moe_forward: tokens must be 0..65535 per call");
  check_shape(w.w13, E, 2 * I, H, "w13");
  check_shape(w.w2, E, H, I, "w2");
  if (tokens == 0) return;
  const detail::Workspace ws = detail::carve(workspace, tokens, top_k, E, H, I);
  if (workspace_bytes < ws.bytes)
    throw std::invalid_argument("moe_forward: workspace of " + std::to_string(workspace_bytes) + " bytes, need " +
                                std::to_string(ws.bytes));
  const std::int64_t P = tokens * top_k;
  const int stop = detail::forward_stop_after();  // benchmark only (set_forward_stop_after)
  MoeStrategy s = strategy;
  if (s == MoeStrategy::Auto) {
    // The crossover depends on the prefill tile this device would run (kPrefillMinTokensPerExpert*).
    const PrefillTile t = prefill_tile(P, E);
    const bool wgmma = t == PrefillTile::WB64 || t == PrefillTile::WB64D || t == PrefillTile::WB64T ||
                       t == PrefillTile::WS64 || t == PrefillTile::W64 || t == PrefillTile::W64D ||
                       t == PrefillTile::WB128 || t == PrefillTile::WB128P;
    s = choose_strategy(tokens, top_k, E, true, wgmma);
  }
  kern::Routing r{topk_ids, topk_weights, ws.sorted, ws.tile_expert, ws.tile_start, ws.tile_count, ws.num_tiles,
                  top_k};
  // The swap-AB kernels use 32-bit byte offsets inside one expert's stack.
  const bool small_experts = std::max(w.w13.shape.tiles_per_expert(), w.w2.shape.tiles_per_expert()) * 192 < (1ll << 31);
  if (s == MoeStrategy::Decode && !small_experts) s = MoeStrategy::DecodeM16;
  if (s == MoeStrategy::Decode) {
    // Benchmarking knob: LUTB_SWAPAB_NB = 1 or 2 forces the token blocks per CTA (read once).
    static const int forced_nb = [] {
      const char* v = std::getenv("LUTB_SWAPAB_NB");
      const int n = v ? std::atoi(v) : 0;
      return n == 1 || n == 2 ? n : 0;
    }();
    const int nb = forced_nb ? forced_nb : decode_token_blocks(tokens, top_k, E);
    const int dec = detail::swap_decoder();
    // Direct forward (decode_direct, moe.hpp): every pair is its own one-token tile, so the grouping
    // kernel is skipped and the MXFP8 of x is the first kernel (a normal launch). Session 10 did it
    // for T = 1 (one launch less on the critical path of the commonest decode step); session 14 for
    // the small batches whose pairs are nearly all on different experts. Benchmarking knobs:
    // LUTB_SWAPAB_DIRECT=0 (read once) or set_decode_paths(kDecodeNoDirect1) keep the grouping at
    // T = 1; set_decode_paths without kDecodeDirect keeps it at T > 1.
    static const bool allow_direct = [] {
      const char* v = std::getenv("LUTB_SWAPAB_DIRECT");
      return !(v && std::strcmp(v, "0") == 0);
    }();
    const unsigned paths = detail::decode_paths();
    const bool direct_rule = tokens == 1 ? !(paths & kDecodeNoDirect1)
                                         : ((paths & kDecodeDirectAlways) ||
                                            ((paths & kDecodeDirect) && decode_direct(tokens, top_k, E)));
    const bool direct = allow_direct && nb == 1 && P <= 65535 && direct_rule;
    if (direct) {
      r.direct_pairs = static_cast<int>(P);
      r.direct_experts = static_cast<int>(E);
    } else {
      detail::launch_group(topk_ids, P, E, 8 * nb, ws, stream);
    }
    const bool q8 = dec == kern::kDecFp8 || dec == kern::kDecWg;  // E4M3 activation bytes
    detail::launch_quantize_x(x, tokens, H, w.w13.shape.padded_cols(), dec == kern::kDecByte, ws.xa,
                              q8 ? ws.xq8 : nullptr, ws.xs, ws.xsf, stream, /*first=*/direct,
                              /*q8_wg=*/dec == kern::kDecWg);
    if (stop == 1) return;
    // The top-k reduction inside GEMM2 (clusters of top_k CTAs, one token each): direct forwards of
    // the mma.sync kernels on sm_90a, small GEMM2 grids (decode_fuse_reduce, moe.hpp).
    const std::int64_t gemm2_ctas = detail::ceil_div(w.w2.shape.tiles_n(), 8) * P;
    // The fused reduction writes BF16 only: an FP32 output takes the separate reduction.
    const bool fuse = out_f32 == nullptr && direct && top_k <= 8 && dec != kern::kDecWg && dec != kern::kDecWs && detail::cluster_launch_ok() &&
                      ((paths & kDecodeClusterReduceAlways) ||
                       ((paths & kDecodeClusterReduce) && decode_fuse_reduce(gemm2_ctas, top_k, detail::sm_count())));
    auto go = [&](auto dec_c) {
      constexpr int kD = decltype(dec_c)::value;
      // kDecodeLateScales / kDecodeLateScales96 / kDecodeLateScalesRule (moe.hpp): the late-tile-scale
      // K-loop, built for the Cvt decoder only; the 96-register kernels for one token block (two
      // blocks: kDecodeLateScales' kernels).
      if constexpr (kD == kern::kDecCvt) {
        if ((paths & kDecodeLateScales96) && nb == 1) {
          launch_swapab<kD, 1, 2>(w, r, ws, P, stream, fuse, topk_weights, out, stop);
          return;
        }
        if ((paths & (kDecodeLateScales | kDecodeLateScales96)) ||
            ((paths & kDecodeLateScalesRule) && decode_late_scales(H, nb))) {
          if (nb == 1) launch_swapab<kD, 1, 1>(w, r, ws, P, stream, fuse, topk_weights, out, stop);
          else launch_swapab<kD, 2, 1>(w, r, ws, P, stream, false, topk_weights, out, stop);
          return;
        }
      }
      if (nb == 1) launch_swapab<kD, 1>(w, r, ws, P, stream, fuse, topk_weights, out, stop);
      else launch_swapab<kD, 2>(w, r, ws, P, stream, false, topk_weights, out, stop);
    };
    if (dec == kern::kDecWg) {
      if (nb == 1) launch_swapab_wg<1>(w, r, ws, P, stream);
      else launch_swapab_wg<2>(w, r, ws, P, stream);
    } else if (dec == kern::kDecWs) {
      if (nb == 1) launch_swapab_ws<1>(w, r, ws, P, stream);
      else launch_swapab_ws<2>(w, r, ws, P, stream);
    } else if (dec == kern::kDecFp8) go(std::integral_constant<int, kern::kDecFp8>{});
    else if (dec == kern::kDecCvt) go(std::integral_constant<int, kern::kDecCvt>{});
    else go(std::integral_constant<int, kern::kDecByte>{});
    if (fuse || stop) return;
  } else if (s == MoeStrategy::Prefill) {
    // CTA-tiled prefill GEMMs (moe_prefill.hpp): 64- or 128-token tiles, weights decoded once per CTA.
    const PrefillTile tile = prefill_tile(P, E);
    detail::launch_group(topk_ids, P, E, prefill_tile_rows(tile), ws, stream);
    detail::launch_quantize_x(x, tokens, H, w.w13.shape.padded_cols(), /*swap=*/false, ws.xa, nullptr, ws.xs, nullptr,
                              stream);
    detail::launch_lutb_prefill_gemms(w, r, ws, P, tile, stream);
  } else {
    // DecodeM16: tokens as the M operand, one m16 token tile per warp.
    const bool cvt = detail::use_cvt_decoder(1);
    detail::launch_group(topk_ids, P, E, 16, ws, stream);
    detail::launch_quantize_x(x, tokens, H, w.w13.shape.padded_cols(), !cvt, ws.xa, nullptr, ws.xs, nullptr, stream);
    if (cvt) launch_gemms<true, 1>(w, r, ws, P, stream);
    else launch_gemms<false, 1>(w, r, ws, P, stream);
  }
  detail::launch_reduce(topk_ids, topk_weights, ws.y, tokens, top_k, E, H, out, stream, out_f32);
}

}  // namespace lutb::cuda
