// src/cuda/fit_dp_modes_s8.cu: fit18's 8- and 16-warp blocks of launch_warp_shape (fit_internal.cuh;
// arguments checked by the caller in fit_dp_modes_s.cu) for the pairs (layout 1, DP mode 0),
// (layout 0, mode 6: the bytes-only default's code) and (layout 1, mode 10: the default's code with the
// per-tile sums), in a translation unit of their own so that they compile in parallel with the 1- to
// 4-warp kernels. The kernels are fit17's (fit_shape0_kernel, fit_shapec_kernel), instantiated with
// W = 8 or 16; __launch_bounds__(32 W, MinWarps / W) then asks for 16 resident warps per SM (2 blocks
// of 8, 1 block of 16: <= 128 registers) in every case, so the compact layout's (1, 0) kernel, which
// runs 20 warps per SM in 1- to 4-warp blocks (<= 96 registers), runs 16 here (20 is not a multiple
// of 8; 24 would need <= 80 registers, where ptxas spills). Per block: 8 x / 16 x the per-warp
// shared memory (layout 0: sizeof(Smem<false>); (1, 0): sizeof(SmemC) = 9,168 B; (1, 10):
// sizeof(SmemCT<true>) = 12,416 B), at most 227 KiB (sm_90's per-block limit; the 16-warp layout 0
// block is the largest). fit_binned_dp_warp.cu's templates, included as in fit_dp_modes.cu; compiled
// with -fmad=false like every src/cuda/fit_*.cu.
#define LUTB_FIT_DP_MODES_TU
#include "fit_binned_dp_warp.cu"

namespace lutb::cuda::fit_internal {
namespace {
constexpr int kWideMinWarps = 16;  // resident warps per SM asked of ptxas (<= 128 registers)
// sm_90's largest dynamic shared memory per block (227 KiB): every 16-warp block fits.
static_assert(16 * sizeof(Smem<false>) <= 232448 && 16 * sizeof(SmemCT<true>) <= 232448 && 16 * sizeof(SmemC) <= 232448);
template <int W>
void launch_wide(const KernelArgs& a, int layout, int dp_mode, int grid, unsigned long long* counter, cudaStream_t stream,
                 int max_blocks) {
  constexpr int M = kWideMinWarps;
  if (layout == 0) launch_shape_kernel(fit_shape0_kernel<W, 6>, W, sizeof(Smem<false>), a, grid, counter, stream, max_blocks);
  else if (dp_mode == 0) launch_shape_kernel(fit_shapec_kernel<W, M, 0>, W, sizeof(SmemC), a, grid, counter, stream, max_blocks);
  else launch_shape_kernel(fit_shapec_kernel<W, M, 10>, W, sizeof(SmemCT<true>), a, grid, counter, stream, max_blocks);
}
template <int W>
int resident_wide(int layout, int dp_mode) {
  constexpr int M = kWideMinWarps;
  if (layout == 0) return resident_shape(fit_shape0_kernel<W, 6>, W, sizeof(Smem<false>));
  if (dp_mode == 0) return resident_shape(fit_shapec_kernel<W, M, 0>, W, sizeof(SmemC));
  return resident_shape(fit_shapec_kernel<W, M, 10>, W, sizeof(SmemCT<true>));
}
}  // namespace

// (arguments checked by the caller: (layout, dp_mode) one of (1, 0), (0, 6), (1, 10); warps 8 or 16)
void launch_shape_wide(const KernelArgs& a, int layout, int dp_mode, int warps, int grid, unsigned long long* counter,
                       cudaStream_t stream, int max_blocks) {
  if (warps == 8) launch_wide<8>(a, layout, dp_mode, grid, counter, stream, max_blocks);
  else launch_wide<16>(a, layout, dp_mode, grid, counter, stream, max_blocks);
}

int resident_shape_wide(int layout, int dp_mode, int warps) {
  return warps == 8 ? resident_wide<8>(layout, dp_mode) : resident_wide<16>(layout, dp_mode);
}

}  // namespace lutb::cuda::fit_internal
