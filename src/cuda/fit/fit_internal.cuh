// src/cuda/fit/fit_internal.cuh: what the GPU fitter's translation units share (private): the
// arguments of one launch and the launchers of the kernels in this folder.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "lutb/cuda/fit.hpp"
#include "lutb/dtype.hpp"
#include "lutb/tile.hpp"

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
  bool optimal = false;  // the "optimal" fitter instead of "binned-dp"
};

/// The weighted kernels' arguments: a view and its column weights (FitOptions::column_weights),
/// device float32 [experts of the view][cols] from the view's first expert. A separate type, so that
/// the unweighted kernels' parameters are KernelArgs alone.
struct WeightedKernelArgs : KernelArgs {
  const float* cw = nullptr;
};

/// KernelArgs::dtype of a source dtype (-1: not F32, BF16 or F16).
inline int dtype_code(DType t) {
  if (t == DType::F32) return 0;
  if (t == DType::BF16) return 1;
  if (t == DType::F16) return 2;
  return -1;
}

/// The view of a whole device stack of `shape` (tile indices from 0).
inline KernelArgs stack_args(const void* d_src, DType src_type, const LutbShape& shape, const DeviceFitOut& out,
                             int forced_scale, unsigned long long* d_error, GpuFitter fitter) {
  KernelArgs a{d_src, dtype_code(src_type), shape.rows, shape.cols, shape.tiles_n(), shape.tiles_k(), shape.tiles(),
               0, out, forced_scale, d_error};
  a.optimal = fitter == GpuFitter::Optimal;
  return a;
}

/// sm80_lutb_fit_binned_dp_warp.cu: "binned-dp", one warp per tile (the per-tile sums when
/// a.out.sse / a.out.sum_sq are set), weighted by the device column weights `cw` (WeightedKernelArgs)
/// unless null. Asynchronous on `stream`; std::runtime_error on a CUDA error.
void launch_binned_dp_warp(const KernelArgs& a, cudaStream_t stream, const float* cw = nullptr);
/// sm80_lutb_fit_optimal_warp.cu: "optimal", one warp per tile (weighted by `cw` unless null).
void launch_optimal_warp(const KernelArgs& a, cudaStream_t stream, const float* cw = nullptr);
/// The fit of a.optimal's fitter.
inline void launch_fit(const KernelArgs& a, cudaStream_t stream, const float* cw = nullptr) {
  if (a.optimal) launch_optimal_warp(a, stream, cw);
  else launch_binned_dp_warp(a, stream, cw);
}

/// sm80_lutb_fit_check_tiles.cu: every tile of the view checked as the fit kernels check it (with
/// column weights `cw`, first the tile's weights as fit.cpp check_weights: code 5; then fit.cpp
/// check_tile: NaN / Inf, else a magnitude above scale byte 246), the lowest failing
/// tile's error word (global index a.t_base + tile) atomicMin'ed into *a.err, which the caller sets
/// to all ones first (one word may collect several launches). Nothing else is written; a.out and
/// a.forced_scale are not read. A memory-bound read of the source (no shared memory).
void launch_check_tiles(const KernelArgs& a, cudaStream_t stream, const float* cw = nullptr);

#ifdef LUTB_BENCH_BASELINES
/// sm80_lutb_fit_binned_dp_thread.cu (built with -DLUTB_BENCH_BASELINES=ON): the benchmark's
/// baseline, "binned-dp" with one thread per tile, an operation-for-operation port of the CPU code
/// with ~19 KiB of local memory per thread. The same bytes, per-tile sums and error word as
/// launch_binned_dp_warp, unweighted only. a.optimal must be false.
void launch_binned_dp_thread(const KernelArgs& a, cudaStream_t stream);
#endif

/// Error word of a failing tile: (tile << 12) | (code << 9) | position (decode_fit_error; code 5, a
/// column weight, has the tile column as its position).
__host__ __device__ inline unsigned long long error_word(std::int64_t tile, int code, int pos) {
  return (static_cast<unsigned long long>(tile) << 12) | (static_cast<unsigned long long>(code) << 9) |
         static_cast<unsigned long long>(pos);
}

}  // namespace lutb::cuda::fit_internal
