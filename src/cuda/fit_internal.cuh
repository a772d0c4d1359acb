// src/cuda/fit_internal.cuh: pieces shared by the GPU fitter's translation units (private).
#pragma once

#include <cstdint>

#include "lutb/cuda/fit.hpp"

namespace lutb::cuda::fit_internal {

/// One launch over a view of an expert stack (a whole stack, whole experts, or tile rows of one).
struct KernelArgs {
  const void* src;       // first element of the view
  int dtype;             // 0 F32, 1 BF16, 2 F16
  std::int64_t rows;     // logical rows per expert in the view
  std::int64_t cols;
  std::int64_t tiles_n;  // tile rows per expert in the view
  std::int64_t tiles_k;
  std::int64_t tiles;    // tiles in the view
  std::int64_t t_base;   // global index of the view's first tile (error words)
  DeviceFitOut out;      // pointers at the view's first tile
  int forced_scale;
  unsigned long long* err;
  bool check_only = false;  // only the tile check (NaN/Inf/too large) and the error word (warp kernel)
  bool optimal = false;     // the "optimal" fitter instead of "binned-dp" (warp kernel only)
};

/// How the warp kernel's DP computes a run's cost (src/cuda/fit_binned_dp_warp.cu, all with the bits
/// of src/fit/fit_scalar.hpp run_cost): 0 run_cost itself (IEEE division; the kernel before fit10);
/// 1 the division by the run count via a table of RN(1/count) and an FMA correction
/// (fit_scalar_fast.hpp div_by_count); 2 the same plus fit_scalar_fast.hpp e4m3_nearest_fast; 3 the
/// same with the prefix sums scaled once per scale instead of in every evaluation. The default:
inline constexpr int kWarpArithDefault = 3;

/// The warp-cooperative kernel (src/cuda/fit_binned_dp_warp.cu): one warp per tile, "binned-dp" or
/// (a.optimal) "optimal".
void launch_warp(const KernelArgs& a, cudaStream_t stream);

/// The same kernel with per-phase clock64() accounting (lane 0 of every warp), for the benchmark:
/// d_prof[kProfPhases + 5] zeroed by the caller receives the summed cycles of the phases
///   0 load + check, 1 sort + de-duplication, 2 prefix sums, 3 bin edges, 4 binned DP,
///   5 refinement, 6 encoding (+ per-tile sums),
/// then the number of tiles, the sums of distinct values n, of bin edges m and of refinement rounds,
/// and the DP layers that dp_mode's full-range pass left to the divide and conquer (fit13).
/// With a.optimal: 4 is the DP at the first scale, 5 the rest of the scale search including every
/// candidate's encoding (6 then holds only forced-scale and all-zero tiles), m = n, and the last
/// slot counts the scales evaluated below the first.
/// Bytes written are those of launch_warp.
/// `arith`: the default (kWarpArithDefault) or, for binned-dp, 0 (the cost evaluation with the IEEE
/// division, for the benchmark's same-run comparison).
/// `dp_mode` (binned-dp, default arithmetic): the DP mode of launch_warp_dp (0, 1, 2, 6 or 7), on layout 0.
inline constexpr int kProfPhases = 7;
inline constexpr int kProfSlotsTotal = kProfPhases + 5;
void launch_warp_profiled(const KernelArgs& a, unsigned long long* d_prof, cudaStream_t stream,
                          int arith = kWarpArithDefault, int dp_mode = 0);

/// The warp kernel (a.optimal selects the fitter) with `unroll` (1, 2 or 4) cost evaluations issued
/// together in the DP scans instead of the fitter's default (binned-dp 1, optimal 4), for the
/// benchmark's same-run comparison and the tests; same bytes (the comparisons stay in the CPU's
/// order).
void launch_warp_unrolled(const KernelArgs& a, int unroll, cudaStream_t stream);

/// The warp kernel with `unroll` evaluations at a time and cost arithmetic `arith`: with the default
/// arithmetic any unroll 1, 2, 4; otherwise the fitter's default unroll and arith 0, 2 (both
/// fitters) or 1 (binned-dp). Same bytes as launch_warp (tested); for the benchmark's same-run
/// comparisons.
void launch_warp_variant(const KernelArgs& a, int unroll, int arith, cudaStream_t stream);

/// Tiles per warp of the binned-dp warp kernel: 1 (fit_warp_kernel, the default) or 2
/// (fit_pair_kernel: the DP and, with pair_refine, the refinement of two tiles at once, 16 lanes
/// each). Same bytes and per-tile sums (tested); `launch_warp_tiles` selects either, for the tests
/// and the benchmark's same-run comparison. Optimal accepts 1 only (std::invalid_argument
/// otherwise); check-only launches always run the one-tile kernel.
inline constexpr int kWarpTilesDefault = 1;
void launch_warp_tiles(const KernelArgs& a, int tiles_per_warp, cudaStream_t stream, bool pair_refine = true);

/// The default binned-dp warp kernel with `pad_bytes` of unused dynamic shared memory per block
/// (2 warps), which caps the resident warps per SM (24576: 8 instead of 16, as many as the
/// two-tiles-per-warp kernel gets): the benchmark's measure of what the warps per SM alone are
/// worth. Same bytes as launch_warp.
void launch_warp_padded(const KernelArgs& a, int pad_bytes, cudaStream_t stream);
/// Resident warps per SM by the occupancy calculator (-1 on a CUDA error): `which` 0 the binned-dp
/// one-tile kernel with the fit11 layout (launch_warp_layout 0) and `pad_bytes` (launch_warp_padded),
/// 1 two tiles per warp, 2 two tiles per warp with the refinement on all lanes, 3..6 the compact
/// layouts (launch_warp_layout 1..4).
int resident_warps_per_sm(int which, int pad_bytes = 0);

/// Shared-memory layout of the binned-dp one-tile warp kernel (fit12; src/cuda/fit_binned_dp_warp.cu):
///   0: fit11's (prefix sums p[2][513] in shared memory, ~13.7 KB per warp, 2-warp blocks, 98
///      registers: 16 resident warps per SM on an H200);
///   1..4: compact (prefix sums only at the bin edges, the refinement windows' sums re-derived per
///      round, chunked running and flat-order sums; 9,168 B per warp):
///   1: 4-warp blocks, compiled for 20 resident warps per SM (96 registers, no local memory);
///   2: 4-warp blocks, 24 warps per SM (80 registers; ptxas spills ~124 B per thread to local memory);
///   3: 2-warp blocks, 20 warps per SM (96 registers, no local memory);
///   4: 2-warp blocks, 24 warps per SM, the tile's values read again from global memory for the
///      encoding instead of kept in registers (80 registers; spills ~44 B).
/// Same bytes and per-tile sums (tested). launch_warp takes kWarpLayoutDefault for binned-dp fits
/// that write the per-tile sums (quantize_gpu, the online method) and kWarpLayoutBytesOnly for those
/// that do not (fit_device with null sse and sum_sq): the fastest layout without local memory in
/// each case on the H200 (docs/perf/fit-gpu.md, fit12: with the sums layout 1 was 3-6 % faster than
/// 0 in the static kernels, bytes only 4-6 % slower; since fit17 with the DP mode and block shape of
/// kWarpDpDefault / kWarpBlockDefault below; fit18: in 4-warp blocks of dynamic shared memory layout 0
/// is the faster one with the sums too, so both are 0). Optimal fits and check-only launches ignore
/// the layout.
inline constexpr int kWarpLayoutDefault = 0;  // (fit18; 1 from fit12 to fit17: see kWarpDpDefault)
inline constexpr int kWarpLayoutBytesOnly = 0;
void launch_warp_layout(const KernelArgs& a, int layout, cudaStream_t stream);

/// How the binned DP's layers 2..K-1 are solved (fit13; src/cuda/fit_binned_dp_warp.cu
/// dp_layer_mode, launchers in fit_dp_modes.cu): 0 dp.cpp's divide and conquer level by level
/// (dp_layer; every kernel before fit13); 1 every end position at once over its full start range
/// (dp_layer_full: all (j, i) pairs of the layer, 32 a pass, a segmented argmin per pass), falling
/// back to 0 for a layer whose minima are not monotone in j (then, and only then, could they differ
/// from the divide and conquer's; proof at dp_layer_full); 2 like 1 but layer 2 (no lower bound:
/// the whole triangle) by 0; 3 (tests) like 1 but every layer recomputed by 0 afterwards (the
/// fallback path); 4: 1 with two passes per iteration; 6, 7: 1, 2 with dp_layer_chunk (a contiguous
/// chunk of the layer's pairs per lane, scanned sequentially, one segmented combination per layer);
/// 8 (tests): 6 then always 0. (Mode 5, 2 with two passes per iteration, was measured in fit13 run 1
/// and removed.) fit16, the run-cost table (fit_binned_dp_warp.cu fill_cost_table, dp_fit_c; layout 1
/// only, in its table form: the costs C(i, j) of every pair of bin edges computed once per tile into
/// shared memory by all lanes, 12,416 B per warp, 2-warp blocks, 16 resident warps per SM, <= 128
/// registers): 9 the layers as mode 6 (full ranges, chunk per lane, check + fallback) reading the
/// table, 10 as mode 0 (divide and conquer) reading it, 11 (tests) as mode 8 reading it, 12 = 9
/// compiled for 18 warps per SM (96 registers, spills 32 B); diagnostics of the table layout's
/// costs: 13 the table layout (16 warps) with mode 0's DP evaluating and no table, 14 the same with
/// the table filled but not read. Same bytes in every mode (tested). Measured on the H200
/// (docs/perf/fit-gpu.md, fit16, same runs as the default): 9 1.17-1.19x the default's time with the
/// sums, 10 1.08x, 12 1.23-1.26x, 13 1.14x, 14 1.30x; bytes only 9 / 10 1.23-1.26x / 1.13x of
/// kWarpDpBytesOnly's; so neither default changed.
/// launch_warp_dp(a, layout, 0) == launch_warp_layout(a, layout); modes 1..4, 6..8 exist for layout
/// 0, 1..3, 6..14 for layout 1 (4 spills there); std::invalid_argument otherwise. launch_warp_dp
/// launches the static-shared-memory kernels (the block shapes above); since fit17 launch_warp runs
/// kWarpDpDefault with kWarpLayoutDefault (fits with the per-tile sums) and kWarpDpBytesOnly with
/// kWarpLayoutBytesOnly through launch_warp_shape (below) in kWarpBlockDefault-warp blocks of dynamic
/// shared memory, one tile per warp. Measured on the H200 (docs/perf/fit-gpu.md, fit17 run 1, same
/// run as the static kernels, Gaussian / Student-t(3) w13 stacks and the Gaussian w2 stack, four
/// alternations each): with the sums, mode 10 (the run-cost table + divide and conquer) in 4-warp
/// blocks at 16 warps per SM 0.991-0.992 / 0.983-0.984 of the time of fit12's layout 1 mode 0 (static
/// 4-warp blocks, 20 warps; mode 10 in static 2-warp blocks: 1.08x); bytes only, layout 0 mode 6 in
/// 4-warp blocks 0.944-0.945 / 0.949-0.950 of the same code in static 2-warp blocks (same 16 warps per
/// SM). (Before fit17: fit13 run 2 made layout 0 mode 6 the bytes-only kernel, 0.977 / 0.995 of mode
/// 0's time; layout 1 mode 0 stayed the kernel with the sums.)
/// fit18 (docs/perf/fit-gpu.md, fit18 runs 1 and 2, same process, Gaussian / Student-t(3) w13 stacks,
/// four alternations each, and the Gaussian w2 stack in run 2): with the per-tile sums, layout 0 mode 6
/// in 4-warp blocks (the bytes-only kernel, writing the sums) takes 0.953-0.956 / 0.958-0.960 (w2
/// 0.954-0.955) of the time of layout 1 mode 10 in 4-warp blocks (fit17's default); so since fit18
/// both defaults are layout 0, mode 6, 4-warp blocks.
inline constexpr int kWarpDpDefault = 6;  // (fit18; 10 in fit17, 0 before)
inline constexpr int kWarpDpBytesOnly = 6;
inline constexpr int kWarpBlockDefault = 4;
void launch_warp_dp(const KernelArgs& a, int layout, int dp_mode, cudaStream_t stream);
/// Resident warps per SM (occupancy calculator; -1 on a CUDA error) of the table kernels: DP mode
/// dp_mode's (10..14), else mode 9's (fit_dp_modes_t.cu; each mode's own register count since fit17).
int resident_warps_table(int dp_mode);

/// fit17: the block shape of the binned-dp warp kernels as a launch choice (src/cuda/fit_dp_modes_s.cu,
/// fit_dp_modes_st.cu). The same per-tile device code as launch_warp_dp(a, layout, dp_mode) (fit_one /
/// fit_one_c), with the per-warp shared memory (Smem<false>: layout 0; SmemCT: layout 1, 9,168 B; the
/// table layout of modes 9, 10, 13: 12,416 B) in DYNAMIC shared memory (opted in with
/// cudaFuncAttributeMaxDynamicSharedMemorySize, so that a block may exceed the 48 KiB of static
/// shared memory), `warps` (1, 2 or 4) warps per block, compiled for the resident warps per SM of the
/// static kernel (__launch_bounds__: layout 0 16 (<= 128 registers), layout 1 mode 0 20 (<= 96),
/// the table modes 16 (<= 128); ptxas allocates the static kernel's count, no local memory), and
/// `grid`:
///   kGridPerTile (0): one tile per warp, ceil(tiles / warps) blocks (as every launch before fit17:
///     a block retires when its slowest warp's tile is done);
///   kGridStride (1): persistent: min(ceil(tiles / warps), resident blocks per SM x SMs) blocks, warp g
///     of G takes tiles g, g + G, g + 2G, ...;
///   kGridAtomic (2): persistent as 1, warp g takes tile g first and then the next tile of the shared
///     counter *counter (lane 0: G + atomicAdd(counter, 1), fetched before the current tile's fit);
///     the launcher sets *counter to 0 on `stream` first (cudaMemsetAsync); the counter belongs to the
///     launch until it completes (no other launch may use it meanwhile); counter must be non-null.
/// `max_blocks` > 0 caps the persistent grids' blocks (tests: a few warps looping over many tiles).
/// fit18: `warps` may also be 8 or 16 for (1, 0), (0, 6) and (1, 10) (src/cuda/fit_dp_modes_s8.cu;
/// compiled for 16 resident warps per SM, <= 128 registers: 2 blocks of 8 or 1 block of 16, so (1, 0)
/// runs 16 warps per SM there instead of its 20).
/// Every tile is fitted by one warp exactly once and writes only its own outputs (and atomicMin's
/// the error word), so the bytes, per-tile sums and error word do not depend on the order or the
/// warp (tested against the CPU). Supported (layout, dp_mode): (1, 0) fit12's kernel with the per-tile
/// sums, (0, 6) the bytes-only kernel, (1, 9), (1, 10), (1, 13) fit16's table modes; launch_warp runs
/// (0, 6) in 4-warp blocks, one tile per warp, with and without the sums since fit18 ((1, 10) with the
/// sums in fit17; kWarpDpDefault above: the persistent grids took 1.16-1.26x the time, fit17 run 1;
/// 8-warp blocks were not faster on both data sets, 16-warp blocks 1.07-1.09x, fit18 run 1); optimal
/// and check-only launches go to launch_warp. std::invalid_argument for other combinations, warps not
/// in {1, 2, 4, 8, 16} (8 and 16 with (1, 9) or (1, 13)), grid not in 0..2, grid 2 without a counter;
/// std::runtime_error on a CUDA error.
inline constexpr int kGridPerTile = 0, kGridStride = 1, kGridAtomic = 2;
void launch_warp_shape(const KernelArgs& a, int layout, int dp_mode, int warps, int grid, unsigned long long* counter,
                       cudaStream_t stream, int max_blocks = 0);
/// Resident warps per SM of launch_warp_shape's kernel for (layout, dp_mode, warps) by the occupancy
/// calculator with its dynamic shared memory (-1 on a CUDA error; std::invalid_argument as there).
int resident_warps_shape(int layout, int dp_mode, int warps);
/// launch_warp_profiled's DP modes 1, 2, 6, 7 (src/cuda/fit_dp_modes.cu).
void launch_warp_profiled_dp(const KernelArgs& a, unsigned long long* d_prof, int dp_mode, cudaStream_t stream);

/// The tile check alone (onl14; src/cuda/fit_binned_dp_warp.cu check_kernel): every tile of the view
/// `a` checked as the fit kernels check it (fit.cpp check_tile: NaN / Inf, else a magnitude above
/// scale byte 246), the lowest failing tile's error word (global index a.t_base + tile) atomicMin'ed
/// into *a.err, which the caller sets to all ones first (one word may collect several launches).
/// Nothing else is written. A separate kernel without shared memory (up to 64 warps per SM instead
/// of the fit kernel's 16-20): a memory-bound read of the source. check_tiles_device still runs the
/// check on the fit kernel (launch_warp with check_only).
void launch_check(const KernelArgs& a, cudaStream_t stream);

/// Error word of a failing tile: (tile << 12) | (code << 9) | position (decode_fit_error).
__host__ __device__ inline unsigned long long error_word(std::int64_t tile, int code, int pos) {
  return (static_cast<unsigned long long>(tile) << 12) | (static_cast<unsigned long long>(code) << 9) |
         static_cast<unsigned long long>(pos);
}

}  // namespace lutb::cuda::fit_internal
