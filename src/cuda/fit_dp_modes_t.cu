// src/cuda/fit_dp_modes_t.cu: fit16's DP modes 9..11 of launch_warp_dp (fit_dp_modes.cu): the compact
// layout (launch_warp_layout 1) with the binned DP's run-cost table (fill_cost_table, dp_fit_c in
// fit_binned_dp_warp.cu, whose templates are included here as in fit_dp_modes.cu). The table (8,280 B
// per warp at m <= 46 bin edges) lives in the DP's member of the shared-memory union (with u[]
// moved into the union: 12,416 B per warp instead of 9,168 B; 2-warp blocks, 16 resident warps per
// SM; mode 12: mode 9 compiled for 18, which spills).
// Compiled with -fmad=false like every src/cuda/fit_*.cu.
#define LUTB_FIT_DP_MODES_TU
#include "fit_binned_dp_warp.cu"

namespace lutb::cuda::fit_internal {
namespace {
// Blocks of the table kernels: kTabWarps warps (static shared memory under 48 KiB), compiled for
// kTabMinWarps resident warps per SM (__launch_bounds__: <= 128 registers, no local memory; the
// shared memory, 12,416 B per warp, would allow 18, where ptxas needs 96 registers and spills
// 32-48 B: DP mode 12).
constexpr int kTabWarps = 2, kTabMinWarps = 16, kTabMaxWarps = 18;
}  // namespace

void launch_warp_dp_table(const KernelArgs& a, int dp_mode, cudaStream_t stream) {
  switch (dp_mode) {
    case 9: return launch_compact<kTabWarps, kTabMinWarps, false, 9>(a, stream);
    case 10: return launch_compact<kTabWarps, kTabMinWarps, false, 10>(a, stream);
    case 11: return launch_compact<kTabWarps, kTabMinWarps, false, 11>(a, stream);
    case 12: return launch_compact<kTabWarps, kTabMaxWarps, false, 9>(a, stream);  // (spills)
    case 13: return launch_compact<kTabWarps, kTabMinWarps, false, 13>(a, stream);
    case 14: return launch_compact<kTabWarps, kTabMinWarps, false, 14>(a, stream);
    default: throw std::invalid_argument("launch_warp_dp: DP mode " + std::to_string(dp_mode) + " is not a table mode");
  }
}

int resident_warps_table(int dp_mode) {
  int blocks = 0;
  // (each mode's own kernel: their register counts differ, 96 for 13 (18 warps), 100..108 for the rest)
  auto* k = dp_mode == 12   ? fit_compact_kernel<kTabWarps, kTabMaxWarps, false, 9>
            : dp_mode == 10 ? fit_compact_kernel<kTabWarps, kTabMinWarps, false, 10>
            : dp_mode == 11 ? fit_compact_kernel<kTabWarps, kTabMinWarps, false, 11>
            : dp_mode == 13 ? fit_compact_kernel<kTabWarps, kTabMinWarps, false, 13>
            : dp_mode == 14 ? fit_compact_kernel<kTabWarps, kTabMinWarps, false, 14>
                            : fit_compact_kernel<kTabWarps, kTabMinWarps, false, 9>;
  const cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, 32 * kTabWarps, 0);
  return e == cudaSuccess ? blocks * kTabWarps : -1;
}

}  // namespace lutb::cuda::fit_internal
