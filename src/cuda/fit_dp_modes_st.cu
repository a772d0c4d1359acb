// src/cuda/fit_dp_modes_st.cu: fit17's launch_warp_shape (fit_dp_modes_s.cu) for fit16's table modes
// 9, 10 and the diagnostic 13 (the table layout SmemCT<true>, 12,416 B per warp, in dynamic shared
// memory; compiled for 16 resident warps per SM as fit_dp_modes_t.cu's kernels). fit_binned_dp_warp.cu's
// templates, included as in fit_dp_modes.cu. Compiled with -fmad=false like every src/cuda/fit_*.cu.
#define LUTB_FIT_DP_MODES_TU
#include "fit_binned_dp_warp.cu"

namespace lutb::cuda::fit_internal {
namespace {
constexpr int kShapeTabWarps = 16;  // as fit_dp_modes_t.cu's kTabMinWarps (<= 128 registers)

template <int Dm>
void launch_tab(const KernelArgs& a, int warps, int grid, unsigned long long* counter, cudaStream_t stream, int max_blocks) {
  constexpr std::size_t kt = sizeof(SmemCT<true>);
  constexpr int T = kShapeTabWarps;
  if (warps == 1) launch_shape_kernel(fit_shapec_kernel<1, T, Dm>, 1, kt, a, grid, counter, stream, max_blocks);
  else if (warps == 2) launch_shape_kernel(fit_shapec_kernel<2, T, Dm>, 2, kt, a, grid, counter, stream, max_blocks);
  else launch_shape_kernel(fit_shapec_kernel<4, T, Dm>, 4, kt, a, grid, counter, stream, max_blocks);
}
template <int Dm>
int resident_tab(int warps) {
  constexpr std::size_t kt = sizeof(SmemCT<true>);
  constexpr int T = kShapeTabWarps;
  if (warps == 1) return resident_shape(fit_shapec_kernel<1, T, Dm>, 1, kt);
  if (warps == 2) return resident_shape(fit_shapec_kernel<2, T, Dm>, 2, kt);
  return resident_shape(fit_shapec_kernel<4, T, Dm>, 4, kt);
}
}  // namespace

// (arguments checked by the caller, launch_warp_shape / resident_warps_shape: dp_mode 9, 10 or 13)
void launch_shape_table(const KernelArgs& a, int dp_mode, int warps, int grid, unsigned long long* counter,
                        cudaStream_t stream, int max_blocks) {
  if (dp_mode == 9) launch_tab<9>(a, warps, grid, counter, stream, max_blocks);
  else if (dp_mode == 10) launch_tab<10>(a, warps, grid, counter, stream, max_blocks);
  else launch_tab<13>(a, warps, grid, counter, stream, max_blocks);
}

int resident_shape_table(int dp_mode, int warps) {
  if (dp_mode == 9) return resident_tab<9>(warps);
  if (dp_mode == 10) return resident_tab<10>(warps);
  return resident_tab<13>(warps);
}

}  // namespace lutb::cuda::fit_internal
