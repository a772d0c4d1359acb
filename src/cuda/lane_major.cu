// src/cuda/lane_major.cu: in-place conversion of a device LUT-B stack's index bytes from checkpoint
// order to the lane-major order the MoE kernels read (lutb/cuda/lane_major.hpp). One warp per
// tile: the 192 bytes go to shared memory, every lane builds its own X and Y words with the same
// host/device functions the CPU tests check, then writes them back over the tile.
#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "common.cuh"
#include "lutb/cuda/lane_major.hpp"
#include "lutb/cuda/moe.hpp"

namespace lutb::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void __launch_bounds__(kWarpsPerBlock * 32) to_lane_major_kernel(std::uint8_t* __restrict__ packed,
                                                                             long long tiles) {
  __shared__ __align__(16) std::uint8_t tile_s[kWarpsPerBlock][kPackedBytes];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (long long tile = static_cast<long long>(blockIdx.x) * kWarpsPerBlock + warp; tile < tiles;
       tile += static_cast<long long>(gridDim.x) * kWarpsPerBlock) {
    std::uint8_t* p = packed + tile * kPackedBytes;
    // 192 bytes = 48 words (tiles are 192-byte records, so word aligned).
    auto* w = reinterpret_cast<std::uint32_t*>(p);
    auto* s = reinterpret_cast<std::uint32_t*>(tile_s[warp]);
    s[lane] = w[lane];
    if (lane < 16) s[32 + lane] = w[32 + lane];
    __syncwarp();
    const int g = lane >> 2, t = lane & 3;
    unsigned v[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = spec_index(tile_s[warp], g * 64 + lane_col(t, j));
    std::uint32_t x = 0, y = 0;
    lane_words(v, x, y);
    __syncwarp();
    w[lane] = x;
    reinterpret_cast<std::uint16_t*>(p + 128)[lane] = static_cast<std::uint16_t>(y);
    __syncwarp();
  }
}

}  // namespace

void packed_to_lane_major(std::uint8_t* d_packed, std::int64_t tiles, cudaStream_t stream) {
  if (tiles <= 0) return;
  if (!d_packed) throw std::invalid_argument("packed_to_lane_major: null packed pointer");
  if (reinterpret_cast<std::uintptr_t>(d_packed) % 4)
    throw std::invalid_argument("packed_to_lane_major: packed must be 4-byte aligned");
  const long long blocks = std::min<long long>(detail::ceil_div(tiles, kWarpsPerBlock), 132LL * 64);
  to_lane_major_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(d_packed, tiles);
  detail::check_launch("to_lane_major_kernel");
}

void to_lane_major(DeviceLutb& w, cudaStream_t stream) {
  if (w.lane_major) throw std::invalid_argument("to_lane_major: the stack is already in lane-major order");
  if (!w.packed) throw std::invalid_argument("to_lane_major: null packed pointer");
  packed_to_lane_major(const_cast<std::uint8_t*>(w.packed), w.shape.tiles(), stream);
  w.lane_major = true;
}

}  // namespace lutb::cuda
