// src/cuda/fit/sm80_lutb_fit_check_tiles.cu: the tile check alone (fit_internal.cuh
// launch_check_tiles): one warp per tile, no shared memory, grid-stride, so that a check pass reads
// the source at close to memory speed instead of at the fit kernels' occupancy. The same load_tile,
// tile_weights_warp (with column weights) and check_tile_warp as the fit kernels
// (sm80_lutb_fit_warp.cuh): the same error words.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda/fit/sm80_lutb_fit_warp.cuh"

namespace lutb::cuda::fit_internal {
namespace {

constexpr int kWarps = heuristics::kFitCheckWarpsPerBlock;

// a.cw: the column weights, or null.
__global__ void __launch_bounds__(32 * kWarps) sm80_lutb_fit_check_tiles(WeightedKernelArgs a) {
  const int lane = threadIdx.x & 31;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kWarps;
  for (std::int64_t lt = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); lt < a.tiles;
       lt += stride) {
    float x[kIpt];
    float am;
    load_tile(a, lt, lane, x);
    if (a.cw) {  // the column weights first, as the weighted fit kernels check them
      float w0, w1;
      bool equal;
      if (!tile_weights_warp(a, lt, lane, w0, w1, equal)) continue;
    }
    check_tile_warp(a, lt, lane, x, am);
  }
}

}  // namespace

void launch_check_tiles(const KernelArgs& a, cudaStream_t stream, const float* cw) {
  if (a.tiles == 0) return;
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    sms = 132;
  const std::int64_t blocks = std::min<std::int64_t>((a.tiles + kWarps - 1) / kWarps,
                                                     static_cast<std::int64_t>(sms) * heuristics::kFitCheckBlocksPerSm);
  sm80_lutb_fit_check_tiles<<<static_cast<unsigned>(blocks), 32 * kWarps, 0, stream>>>(WeightedKernelArgs{a, cw});
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("check kernel launch: ") + cudaGetErrorString(e));
}

}  // namespace lutb::cuda::fit_internal
