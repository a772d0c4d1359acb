// src/cuda/fit_dp_modes.cu: launch_warp_dp and the instrumented kernel's DP modes (fit13) for the
// binned-dp warp kernel's layout 0 (fit_warp_kernel). The kernels are fit_binned_dp_warp.cu's
// templates, included here (its public functions are left out by LUTB_FIT_DP_MODES_TU) so that the
// many instantiations of fit13's DP modes compile in parallel with it; the compact layout's are
// in fit_dp_modes_c.cu. Compiled with -fmad=false like every src/cuda/fit_*.cu.
#define LUTB_FIT_DP_MODES_TU
#include "fit_binned_dp_warp.cu"

namespace lutb::cuda::fit_internal {

void launch_warp_dp_compact(const KernelArgs& a, int dp_mode, cudaStream_t stream);  // fit_dp_modes_c.cu
void launch_warp_dp_table(const KernelArgs& a, int dp_mode, cudaStream_t stream);    // fit_dp_modes_t.cu

void launch_warp_dp(const KernelArgs& a, int layout, int dp_mode, cudaStream_t stream) {
  if (dp_mode < 0 || dp_mode > 14 || dp_mode == 5)
    throw std::invalid_argument("launch_warp_dp: dp_mode must be 0..4 or 6..14, not " + std::to_string(dp_mode));
  if (dp_mode >= 9 && layout != 1)
    throw std::invalid_argument("launch_warp_dp: the run-cost table modes 9..14 exist for layout 1 only, not layout " +
                                std::to_string(layout));
  if (dp_mode != 0 && layout != 0 && !(layout == 1 && dp_mode != 4))
    throw std::invalid_argument("launch_warp_dp: DP modes 1..4 and 6..8 exist for layout 0, 1..3 and 6..8 for layout 1, "
                                "not mode " + std::to_string(dp_mode) + " on layout " + std::to_string(layout));
  if (a.tiles == 0) return;
  if (dp_mode == 0 || a.optimal || a.check_only) return launch_warp_layout(a, layout, stream);
  if (dp_mode >= 9) return launch_warp_dp_table(a, dp_mode, stream);
  if (layout == 1) return launch_warp_dp_compact(a, dp_mode, stream);
  const char* who = "quantize_gpu: kernel launch: ";
  constexpr int U = kUnroll<false>;
  switch (dp_mode) {
    case 1: return launch_t<false, false, U, kArith, 1>(a, nullptr, stream, who);
    case 2: return launch_t<false, false, U, kArith, 2>(a, nullptr, stream, who);
    case 3: return launch_t<false, false, U, kArith, 3>(a, nullptr, stream, who);
    case 4: return launch_t<false, false, U, kArith, 4>(a, nullptr, stream, who);
    case 6: return launch_t<false, false, U, kArith, 6>(a, nullptr, stream, who);
    case 7: return launch_t<false, false, U, kArith, 7>(a, nullptr, stream, who);
    default: return launch_t<false, false, U, kArith, 8>(a, nullptr, stream, who);
  }
}

void launch_warp_profiled_dp(const KernelArgs& a, unsigned long long* d_prof, int dp_mode, cudaStream_t stream) {
  const char* who = "profile kernel launch: ";
  constexpr int U = kUnroll<false>;
  switch (dp_mode) {
    case 1: return launch_t<true, false, U, kArith, 1>(a, d_prof, stream, who);
    case 2: return launch_t<true, false, U, kArith, 2>(a, d_prof, stream, who);
    case 6: return launch_t<true, false, U, kArith, 6>(a, d_prof, stream, who);
    case 7: return launch_t<true, false, U, kArith, 7>(a, d_prof, stream, who);
    default:
      throw std::invalid_argument("launch_warp_profiled: dp_mode must be 0, 1, 2, 6 or 7, not " + std::to_string(dp_mode));
  }
}

}  // namespace lutb::cuda::fit_internal
