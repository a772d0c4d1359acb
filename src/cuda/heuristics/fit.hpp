// src/cuda/heuristics/fit.hpp: the launch choices of the GPU fitters (src/cuda/fit/), one line of
// reason each; the measurements are in docs/design/cuda-fit.md ("Launch choices").
#pragma once

#include <cstdint>

namespace lutb::cuda::heuristics {

// binned-dp: 4 warps per block, one tile per warp, per-warp tables (~13.7 KiB) in dynamic shared
// memory: 0.94-0.95x the time of 2-warp blocks at the same 16 warps per SM; 8-warp blocks were not
// faster on both data sets, 16-warp blocks and persistent grids slower (H200).
inline constexpr int kFitBinnedDpWarpsPerBlock = 4;
// binned-dp: compiled for 16 resident warps per SM (__launch_bounds__, <= 128 registers, no local
// memory); 20-24 warps with the compact layouts cost more in re-derived sums or spills than they won.
inline constexpr int kFitBinnedDpMinWarpsPerSm = 16;
// optimal: one warp per block: its ~26 KiB of static shared memory per warp keeps a block under 48 KiB.
inline constexpr int kFitOptimalWarpsPerBlock = 1;
// DP scans issue this many cost evaluations at once: binned-dp's scans are 1-3 evaluations long (2
// was no faster, 4 6 % slower); optimal's are longer (4 was 5 % faster than 2, 10 % than 1).
inline constexpr int kFitBinnedDpDpUnroll = 1;
inline constexpr int kFitOptimalDpUnroll = 4;
// Grid of the fit kernels: one warp per tile up to this many blocks, then a grid-stride loop.
inline constexpr std::int64_t kFitMaxBlocks = std::int64_t{1} << 22;
// Tile check: 8 warps per block, no shared memory, at most 16 blocks per SM (grid-stride): reads
// the source at close to memory speed instead of at the fit kernels' 16 warps per SM.
inline constexpr int kFitCheckWarpsPerBlock = 8;
inline constexpr int kFitCheckBlocksPerSm = 16;

}  // namespace lutb::cuda::heuristics
