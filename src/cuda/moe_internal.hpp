// src/cuda/moe_internal.hpp: host-side pieces shared by the LUT-B and BF16 forwards: workspace
// layout, argument checks and the launches of the small kernels (MXFP8 of x, grouping, reduction).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "common.cuh"
#include "lutb/cuda/moe.hpp"
#include "moe_kernels.cuh"

namespace lutb::cuda::detail {

/// Carved workspace (all pointers 256-byte aligned).
struct Workspace {
  std::uint16_t* xa = nullptr;     // [T, Hp] FP16 E4M3 values (LUT-B path)
  std::uint8_t* xq8 = nullptr;     // [T, Hp] E4M3 bytes (swap-AB FP8 decoder)
  std::uint8_t* xs = nullptr;      // [T, Hp/32] UE8M0
  float* xsf = nullptr;            // [T, Hp/32] the same scales as FP32 2^(b-127) (swap-AB kernels)
  int* sorted = nullptr;           // [P]
  int* tile_expert = nullptr;      // [max_tiles]
  int* tile_start = nullptr;       // [max_tiles]
  int* tile_count = nullptr;       // [max_tiles]
  int* num_tiles = nullptr;        // [1]
  std::uint16_t* hq = nullptr;     // [P, Ip]
  std::uint8_t* hq8 = nullptr;     // [P, Ip] E4M3 bytes (swap-AB FP8 decoder)
  std::uint8_t* hs = nullptr;      // [P, Ip/32]
  float* hsf = nullptr;            // [P, Ip/32] FP32 block scales of h (swap-AB kernels)
  float* y = nullptr;              // [P, H]
  float* hpart = nullptr;          // [hpart_rows, 2 Ip] GEMM1's sums per pair and split rank (kDecodeActKernel)
  std::int64_t hpart_rows = 0;     // act_rows(P, E) (moe.hpp): the forward takes the kernel iff P x split fits
  std::size_t bytes = 0;
};

/// Upper bound of token tiles of `rows` rows over all experts: min(E, P) + floor(P / rows).
std::int64_t max_tiles(std::int64_t pairs, std::int64_t experts, int rows);

/// Lays out the workspace (base may be null to measure).
Workspace carve(void* base, std::int64_t tokens, int top_k, std::int64_t experts, std::int64_t hidden,
                std::int64_t intermediate);

/// BF16 path: which mma tile to use, 1 (decode) or 4 (prefill) m16 tiles per warp.
int resolve_mt(MoeStrategy s, std::int64_t tokens, int top_k, std::int64_t experts, bool packed);

/// True when the weight decoder of a launch with `mt` m16 tiles per warp uses the sm_89+ E4M3
/// conversion instruction on the current device (set_weight_decoder's policy).
bool use_cvt_decoder(int mt);
/// Weight decoder of the swap-AB kernels on the current device (kern::kDecByte / kDecCvt / kDecFp8):
/// Auto and Cvt -> Cvt on sm_90 devices; Fp8Mma -> FP8 on sm_90; otherwise the byte trick.
int swap_decoder();

/// set_decode_paths' flags (kDecodePathsDefault unless changed) and set_forward_stop_after's stage.
unsigned decode_paths();
/// set_decode_l2_prefetch's budget (bytes, 0 = off), evict_last hint and after_k_loop placement.
std::int64_t l2_prefetch_budget();
bool l2_prefetch_evict_last();
bool l2_prefetch_late();
int forward_stop_after();
/// SMs of the current device (cached per device).
int sm_count();
/// K split of swap-AB GEMM `gemm` (1 or 2): set_decode_split's forced value, else decode_k_split.
DecodeSplit gemm_k_split(int gemm, std::int64_t ctas, std::int64_t tiles_k, int warps);
/// True when the current device runs the sm_90a image (thread-block clusters, distributed shared memory).
bool cluster_launch_ok();

/// True when the forward uses programmatic dependent launch: the device is sm_90+ and neither
/// LUTB_PDL=0 (environment, read once) nor set_dependent_launch(false) turned it off.
bool pdl_enabled();

/// Launches `kernel` (named `name` in errors) on `stream`. `dependent`: a forward kernel after the
/// first, launched with cudaLaunchAttributeProgrammaticStreamSerialization when pdl_enabled(); such a
/// kernel must follow the PDL rules of moe_kernels.cuh (pdl_wait before reading its predecessor's
/// output, pdl_trigger only after pdl_wait). Capture-safe (no host synchronisation).
template <class... Params, class... Args>
void launch_kernel(const char* name, bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block,
                   std::size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent && pdl_enabled() ? 1 : 0;
  check(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), name);
}

/// launch_kernel with a thread-block cluster of `cluster` CTAs (sm_90+; cluster_launch_ok()): the
/// grid's dimensions must be multiples of the cluster's, at most 8 CTAs (the portable size).
template <class... Params, class... Args>
void launch_kernel_cluster(const char* name, bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block,
                           std::size_t smem, dim3 cluster, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2]{};
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster.x;
  attr[0].val.clusterDim.y = cluster.y;
  attr[0].val.clusterDim.z = cluster.z;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent && pdl_enabled() ? 2 : 1;
  check(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...), name);
}

/// x [T, H] BF16 -> MXFP8 (rceil) as FP16 E4M3 values in the decoder's column order (xa), as E4M3
/// bytes in natural order (xq8, when not null), UE8M0 scales (xs) and the same scales as FP32
/// (xsf, when not null). A dependent launch (it runs after launch_group), unless `first`: the
/// forward's first kernel when there is no grouping (the swap-AB decode of one token), a normal
/// launch that waits for all earlier work in the stream (the caller's writes of x included).
/// `q8_wg`: xq8 in the wgmma decoder's order (kern::wg_pos inside each 32-column block) instead.
void launch_quantize_x(const std::uint16_t* x, std::int64_t T, std::int64_t H, std::int64_t Hp, bool swap,
                       std::uint16_t* xa, std::uint8_t* xq8, std::uint8_t* xs, float* xsf, cudaStream_t stream,
                       bool first = false, bool q8_wg = false);
/// Groups the pairs p = t*k + j by expert into token tiles of `tile_rows` rows. The first kernel of
/// every forward (never a dependent launch: it waits for all earlier work in the stream).
void launch_group(const int* ids, std::int64_t pairs, std::int64_t experts, int tile_rows, const Workspace& ws,
                  cudaStream_t stream);
/// out[t, n] = bf16(sum_j w[t, j] * y[t*k + j, n]); NaN rows for tokens with an invalid expert id.
/// With out_f32 non-null the FP32 sums go there instead and out is not written. A dependent launch.
void launch_reduce(const int* ids, const float* weights, const float* y, std::int64_t T, int k, std::int64_t E,
                   std::int64_t H, std::uint16_t* out, cudaStream_t stream, float* out_f32 = nullptr);

}  // namespace lutb::cuda::detail
