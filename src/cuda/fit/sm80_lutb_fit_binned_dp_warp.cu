// src/cuda/fit/sm80_lutb_fit_binned_dp_warp.cu: the "binned-dp" fitter (the default), one warp per
// 8x64 tile (the device code: sm80_lutb_fit_warp.cuh; launch choices: src/cuda/heuristics/fit.hpp).
// Runs on sm_80 and later.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "cuda/fit/sm80_lutb_fit_warp.cuh"

namespace lutb::cuda::fit_internal {
namespace {

constexpr int kWarps = heuristics::kFitBinnedDpWarpsPerBlock;

// The per-warp tables live in dynamic shared memory (the launcher opts in to more than 48 KiB per
// block). Warp w of block b fits tiles b * kWarps + w, then every gridDim.x * kWarps-th tile. W: the
// weighted fit (WeightedKernelArgs; 4.3 KiB more per warp), a separate kernel so that the unweighted
// one carries none of it.
extern __shared__ __align__(16) unsigned char g_binned_dp_smem[];

template <bool W>
__global__ void __launch_bounds__(32 * kWarps, heuristics::kFitBinnedDpMinWarpsPerSm / kWarps)
    sm80_lutb_fit_binned_dp_warp(FitArgs<W> a) {
  Smem<false, W>& s = reinterpret_cast<Smem<false, W>*>(g_binned_dp_smem)[threadIdx.x >> 5];
  const int lane = threadIdx.x & 31;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kWarps;
  for (std::int64_t lt = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); lt < a.tiles;
       lt += stride) {
    fit_one(s, lane, a, lt);
    __syncwarp();
  }
}

template <bool W>
void launch(const FitArgs<W>& a, cudaStream_t stream) {
  const std::size_t smem = sizeof(Smem<false, W>) * kWarps;
  cudaError_t e = cudaFuncSetAttribute(sm80_lutb_fit_binned_dp_warp<W>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e == cudaSuccess) {
    const std::int64_t blocks = std::min<std::int64_t>((a.tiles + kWarps - 1) / kWarps, heuristics::kFitMaxBlocks);
    sm80_lutb_fit_binned_dp_warp<W><<<static_cast<unsigned>(blocks), 32 * kWarps, smem, stream>>>(a);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) throw std::runtime_error(std::string("quantize_gpu: kernel launch: ") + cudaGetErrorString(e));
}

}  // namespace

void launch_binned_dp_warp(const KernelArgs& a, cudaStream_t stream, const float* cw) {
  if (a.tiles == 0) return;
  if (cw) launch<true>(WeightedKernelArgs{a, cw}, stream);
  else launch<false>(a, stream);
}

}  // namespace lutb::cuda::fit_internal
