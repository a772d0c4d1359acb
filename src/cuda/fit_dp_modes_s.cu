// src/cuda/fit_dp_modes_s.cu: fit17's launch_warp_shape and resident_warps_shape (fit_internal.cuh):
// the binned-dp warp kernels' block shape as a launch choice (warps per block through dynamic shared
// memory; one tile per warp or a persistent grid) for layout 1 DP mode 0 (fit12's kernel with the
// per-tile sums) and layout 0 DP mode 6 (the bytes-only default's code, run by launch_warp in 4-warp
// blocks since fit17); the table modes' kernels (mode 10: the default with the sums since fit17) are
// in fit_dp_modes_st.cu. fit_binned_dp_warp.cu's templates, included as in fit_dp_modes.cu. Compiled
// with -fmad=false like every src/cuda/fit_*.cu.
#define LUTB_FIT_DP_MODES_TU
#include "fit_binned_dp_warp.cu"

namespace lutb::cuda::fit_internal {

void launch_shape_table(const KernelArgs& a, int dp_mode, int warps, int grid, unsigned long long* counter,
                        cudaStream_t stream, int max_blocks);  // fit_dp_modes_st.cu
int resident_shape_table(int dp_mode, int warps);             // fit_dp_modes_st.cu
void launch_shape_wide(const KernelArgs& a, int layout, int dp_mode, int warps, int grid, unsigned long long* counter,
                       cudaStream_t stream, int max_blocks);  // fit_dp_modes_s8.cu
int resident_shape_wide(int layout, int dp_mode, int warps);  // fit_dp_modes_s8.cu

namespace {
// The compact layout's resident warps per SM (launch_warp_layout 1: 20, <= 96 registers).
constexpr int kShapeCompactWarps = 20;
// Checks launch_warp_shape's arguments (std::invalid_argument).
inline void check_shape_args(int layout, int dp_mode, int warps, int grid, const unsigned long long* ctr) {
  const bool pair_ok = (layout == 1 && (dp_mode == 0 || dp_mode == 9 || dp_mode == 10 || dp_mode == 13)) ||
                       (layout == 0 && dp_mode == 6);
  if (!pair_ok)
    throw std::invalid_argument("launch_warp_shape: (layout, DP mode) must be (1, 0), (0, 6), (1, 9), (1, 10) or (1, 13), not (" +
                                std::to_string(layout) + ", " + std::to_string(dp_mode) + ")");
  if (warps != 1 && warps != 2 && warps != 4 && warps != 8 && warps != 16)
    throw std::invalid_argument("launch_warp_shape: warps per block must be 1, 2, 4, 8 or 16, not " + std::to_string(warps));
  if (warps > 4 && layout == 1 && dp_mode != 0 && dp_mode != 10)  // (fit18: 8, 16 for the defaults' pairs and (1, 0))
    throw std::invalid_argument("launch_warp_shape: 8- and 16-warp blocks exist for (1, 0), (0, 6) and (1, 10), not (1, " +
                                std::to_string(dp_mode) + ")");
  if (grid < kGridPerTile || grid > kGridAtomic)
    throw std::invalid_argument("launch_warp_shape: grid must be 0 (a tile per warp), 1 (stride) or 2 (counter), not " +
                                std::to_string(grid));
  if (grid == kGridAtomic && ctr == nullptr)
    throw std::invalid_argument("launch_warp_shape: grid 2 (a shared counter) needs a counter");
}
}  // namespace

void launch_warp_shape(const KernelArgs& a, int layout, int dp_mode, int warps, int grid, unsigned long long* counter,
                       cudaStream_t stream, int max_blocks) {
  check_shape_args(layout, dp_mode, warps, grid, counter);
  if (a.tiles == 0) return;
  if (a.optimal || a.check_only) return launch_warp(a, stream);
  if (warps > 4) return launch_shape_wide(a, layout, dp_mode, warps, grid, counter, stream, max_blocks);
  if (dp_mode >= 9) return launch_shape_table(a, dp_mode, warps, grid, counter, stream, max_blocks);
  constexpr std::size_t k0 = sizeof(Smem<false>), kc = sizeof(SmemC);
  constexpr int C = kShapeCompactWarps;
  if (layout == 0) {
    if (warps == 1) launch_shape_kernel(fit_shape0_kernel<1, 6>, 1, k0, a, grid, counter, stream, max_blocks);
    else if (warps == 2) launch_shape_kernel(fit_shape0_kernel<2, 6>, 2, k0, a, grid, counter, stream, max_blocks);
    else launch_shape_kernel(fit_shape0_kernel<4, 6>, 4, k0, a, grid, counter, stream, max_blocks);
  } else {
    if (warps == 1) launch_shape_kernel(fit_shapec_kernel<1, C, 0>, 1, kc, a, grid, counter, stream, max_blocks);
    else if (warps == 2) launch_shape_kernel(fit_shapec_kernel<2, C, 0>, 2, kc, a, grid, counter, stream, max_blocks);
    else launch_shape_kernel(fit_shapec_kernel<4, C, 0>, 4, kc, a, grid, counter, stream, max_blocks);
  }
}

int resident_warps_shape(int layout, int dp_mode, int warps) {
  unsigned long long dummy = 0;
  check_shape_args(layout, dp_mode, warps, kGridPerTile, &dummy);
  if (warps > 4) return resident_shape_wide(layout, dp_mode, warps);
  if (dp_mode >= 9) return resident_shape_table(dp_mode, warps);
  constexpr std::size_t k0 = sizeof(Smem<false>), kc = sizeof(SmemC);
  constexpr int C = kShapeCompactWarps;
  if (layout == 0) {
    if (warps == 1) return resident_shape(fit_shape0_kernel<1, 6>, 1, k0);
    if (warps == 2) return resident_shape(fit_shape0_kernel<2, 6>, 2, k0);
    return resident_shape(fit_shape0_kernel<4, 6>, 4, k0);
  }
  if (warps == 1) return resident_shape(fit_shapec_kernel<1, C, 0>, 1, kc);
  if (warps == 2) return resident_shape(fit_shapec_kernel<2, C, 0>, 2, kc);
  return resident_shape(fit_shapec_kernel<4, C, 0>, 4, kc);
}

}  // namespace lutb::cuda::fit_internal
