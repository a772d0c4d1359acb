// src/cuda/fit/sm80_lutb_fit_optimal_warp.cu: the "optimal" fitter (the exact DP with optimal.cpp's
// scale search), one warp per 8x64 tile (the device code: sm80_lutb_fit_warp.cuh; launch choices:
// src/cuda/heuristics/fit.hpp). Runs on sm_80 and later.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/fit/sm80_lutb_fit_warp.cuh"

namespace lutb::cuda::fit_internal {
namespace {

constexpr int kWarps = heuristics::kFitOptimalWarpsPerBlock;

// Warp w of block b fits tiles b * kWarps + w, then every gridDim.x * kWarps-th tile. W: the
// weighted fit (WeightedKernelArgs; 4.3 KiB more per warp), a separate kernel so that the unweighted
// one carries none of it.
template <bool W>
__global__ void __launch_bounds__(32 * kWarps) sm80_lutb_fit_optimal_warp(FitArgs<W> a) {
  __shared__ Smem<true, W> sm[kWarps];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kWarps;
  for (std::int64_t lt = static_cast<std::int64_t>(blockIdx.x) * kWarps + w; lt < a.tiles; lt += stride) {
    fit_one(sm[w], lane, a, lt);
    __syncwarp();
  }
}

}  // namespace

void launch_optimal_warp(const KernelArgs& a, cudaStream_t stream, const float* cw) {
  if (a.tiles == 0) return;
  const std::int64_t blocks = std::min<std::int64_t>((a.tiles + kWarps - 1) / kWarps, heuristics::kFitMaxBlocks);
  if (cw)
    sm80_lutb_fit_optimal_warp<true><<<static_cast<unsigned>(blocks), 32 * kWarps, 0, stream>>>(WeightedKernelArgs{a, cw});
  else sm80_lutb_fit_optimal_warp<false><<<static_cast<unsigned>(blocks), 32 * kWarps, 0, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("quantize_gpu: kernel launch: ") + cudaGetErrorString(e));
}

}  // namespace lutb::cuda::fit_internal
