// src/cuda/moe/lutb_moe_launch.hpp: host-side pieces shared by the LUT-B and BF16 forwards: workspace
// layout, device queries, kernel launches (programmatic dependent launch on sm_90), the launches of
// the small kernels of lutb_moe_steps.cu (MXFP8 of x, grouping, reduction) and the entry points of
// the GEMM paths. Private.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/heuristics/moe_heuristics.hpp"
#include "cuda/moe/lutb_moe_forward_plan.hpp"
#include "lutb/cuda/moe.hpp"
#include "cuda/moe/lutb_moe_device.cuh"

namespace lutb::cuda::detail {

/// Carved workspace (all pointers 256-byte aligned).
struct Workspace {
  std::uint16_t* xa = nullptr;     // [T, Hp] FP16 E4M3 values (LUT-B path)
  std::uint8_t* xs = nullptr;      // [T, Hp/32] UE8M0
  float* xsf = nullptr;            // [T, Hp/32] the same scales as FP32 2^(b-127) (swap-AB kernels)
  int* sorted = nullptr;           // [P]
  int* tile_expert = nullptr;      // [max_tiles]
  int* tile_start = nullptr;       // [max_tiles]
  int* tile_count = nullptr;       // [max_tiles]
  int* num_tiles = nullptr;        // [1]
  std::uint16_t* hq = nullptr;     // [P, Ip]
  std::uint8_t* hs = nullptr;      // [P, Ip/32]
  float* hsf = nullptr;            // [P, Ip/32] FP32 block scales of h (swap-AB kernels)
  float* y = nullptr;              // [P, H]
  float* hpart = nullptr;          // [hpart_rows, 2 Ip] GEMM1's sums per pair and split rank (activation kernel)
  std::int64_t hpart_rows = 0;     // heuristics::act_rows(P, E): the kernel runs iff P x split fits
  std::size_t bytes = 0;
};

/// Upper bound of token tiles of `rows` rows over all experts: min(E, P) + floor(P / rows).
std::int64_t max_tiles(std::int64_t pairs, std::int64_t experts, int rows);

/// Lays out the workspace (base may be null to measure).
Workspace carve(void* base, std::int64_t tokens, int top_k, std::int64_t experts, std::int64_t hidden,
                std::int64_t intermediate);

/// SMs of the current device (cached per device).
int sm_count();
/// True when the current device runs the sm_90a image (cvt E4M3, thread-block clusters, wgmma).
bool sm90a_device();

/// True when the forward uses programmatic dependent launch: the device is sm_90+.
bool pdl_enabled();

/// Launches `kernel` (named `name` in errors) on `stream`. `dependent`: a forward kernel after the
/// first, launched with cudaLaunchAttributeProgrammaticStreamSerialization when pdl_enabled(); such a
/// kernel must follow the PDL rules of lutb_moe_device.cuh (pdl_wait before reading its predecessor's
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

/// x [T, H] BF16 -> MXFP8 (rceil) as FP16 E4M3 values in the decoder's column order (xa), UE8M0
/// scales (xs) and the same scales as FP32 (xsf, when not null). A dependent launch (it runs after launch_group), unless `first`: the
/// forward's first kernel when there is no grouping (the swap-AB decode of one token), a normal
/// launch that waits for all earlier work in the stream (the caller's writes of x included).
void launch_quantize_x(const std::uint16_t* x, std::int64_t T, std::int64_t H, std::int64_t Hp, bool swap,
                       std::uint16_t* xa, std::uint8_t* xs, float* xsf, cudaStream_t stream, bool first = false);
/// Groups the pairs p = t*k + j by expert into token tiles of `tile_rows` rows. The first kernel of
/// every forward (never a dependent launch: it waits for all earlier work in the stream).
void launch_group(const int* ids, std::int64_t pairs, std::int64_t experts, int tile_rows, const Workspace& ws,
                  cudaStream_t stream);
/// out[t, n] = bf16(sum_j w[t, j] * y[t*k + j, n]); NaN rows for tokens with an invalid expert id.
/// With out_f32 non-null the FP32 sums go there instead and out is not written. A dependent launch.
void launch_reduce(const int* ids, const float* weights, const float* y, std::int64_t T, int k, std::int64_t E,
                   std::int64_t H, std::uint16_t* out, cudaStream_t stream, float* out_f32 = nullptr);

/// The prefill GEMMs (lutb_moe_prefill.cu) on the forward's workspace. Preconditions:
///   - ws.xa/ws.xs: launch_quantize_x(x, T, H, Hp, /*swap=*/false, ...) (natural column order);
///   - ws.sorted/tile_*: launch_group(ids, P, E, heuristics::prefill_tile_rows(kernel), ws, stream);
///   - r: the Routing over that grouping (r.top_k = k), P = T * k.
/// Effects: ws.xa is converted IN PLACE to BF16 a = mxfp8_qdq(x); ws.hq receives
/// h = mxfp8_qdq(bf16(silu(g)*u)) as BF16 [P, Ip]; ws.y receives y [P, H] FP32 for every valid pair.
/// Throws std::runtime_error for an sm_90a kernel on another device.
void launch_lutb_prefill_gemms(const DeviceMoeWeights& w, const kern::Routing& r, const Workspace& ws, std::int64_t P,
                               heuristics::PrefillKernel kernel, cudaStream_t stream);

}  // namespace lutb::cuda::detail
