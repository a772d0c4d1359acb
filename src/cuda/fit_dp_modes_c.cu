// src/cuda/fit_dp_modes_c.cu: the compact layout's (launch_warp_layout 1) kernels of fit13's DP
// modes, for launch_warp_dp (fit_dp_modes.cu); fit_binned_dp_warp.cu's templates, included as there.
#define LUTB_FIT_DP_MODES_TU
#include "fit_binned_dp_warp.cu"

namespace lutb::cuda::fit_internal {

void launch_warp_dp_compact(const KernelArgs& a, int dp_mode, cudaStream_t stream) {
  // (modes 4, 5 are not built for this layout: ptxas spills there at its 96-register bound)
  switch (dp_mode) {
    case 1: return launch_compact<4, 20, false, 1>(a, stream);
    case 2: return launch_compact<4, 20, false, 2>(a, stream);
    case 3: return launch_compact<4, 20, false, 3>(a, stream);
    case 6: return launch_compact<4, 20, false, 6>(a, stream);
    case 7: return launch_compact<4, 20, false, 7>(a, stream);
    case 8: return launch_compact<4, 20, false, 8>(a, stream);
    default: throw std::invalid_argument("launch_warp_dp: DP mode " + std::to_string(dp_mode) + " is not built for layout 1");
  }
}

}  // namespace lutb::cuda::fit_internal
