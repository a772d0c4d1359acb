// lutb/cuda/fit.hpp: the default LUT-B fitter "binned-dp" (spec section 2.1; CPU reference
// src/fit/binned_dp.cpp) on NVIDIA GPUs, producing THE SAME BYTES as the CPU fitter.
//
// Byte equality with lutb::quantize(..., FitOptions{fitter = "binned-dp"}) holds for both kernels
// (GpuFitKernel below):
//  - Warp (default, src/cuda/fit_binned_dp_warp.cu): one warp per 8x64 tile, tables in shared
//    memory (~13.6 KiB per warp, no local memory). The byte-deciding scalar arithmetic is the CPU
//    fitter's own (src/fit/fit_scalar.hpp, compiled with -fmad=false here and -ffp-contract=off
//    there); the sort, the DP levels, the refinement tables and the encoding are spread over the
//    lanes in ways that cannot change a result, and the order-dependent double sums (prefix sums,
//    per-tile error sums) stay sequential in the CPU's order (argued in the .cu file).
//  - Thread (src/cuda/fit_binned_dp.cu): the first port, operation for operation, one thread per
//    tile, every decision-making operation an IEEE round-to-nearest intrinsic (__dadd_rn, ...);
//    about 19 KiB of per-thread local memory, for which the CUDA context reserves local memory for
//    every resident thread (~5 GiB on an H200 at full occupancy, once per context, not bounded by
//    the chunk size). Kept as the benchmark baseline and an independent second port.
// Tested in tests/cuda/fit_gpu_test.cpp (random, edge and real tiles, both kernels, against
// lutb::quantize). Speed on an H200: docs/perf/fit-gpu.md. The online method built on the warp
// kernel (device BF16/FP16 experts in, packed LUT-B out): lutb/cuda/online.hpp.
//
// Layout of the outputs: the LutbTensor layout of lutb/tile.hpp (spec section 2.2):
//   packed [E, Np/8, Kp/64, 192] u8, codebook [E, Np/8, Kp/64, 8] E4M3, scale [E, Np/8, Kp/64] UE8M0,
// tiles in (expert, tile row, tile column) order; tiles that overhang the logical [N, K] matrix are
// zero-filled exactly as gather_tile does (the zeros take part in the fit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "lutb/dtype.hpp"
#include "lutb/fit.hpp"
#include "lutb/tile.hpp"

typedef struct CUstream_st* cudaStream_t;

namespace lutb::cuda {

/// Which kernel fits the tiles. Both give the CPU fitter's bytes.
///   Warp (default): one warp per tile, per-warp tables in shared memory (~13 KiB), the sort, the
///     DP levels, the refinement tables and the encoding spread over the lanes
///     (src/cuda/fit_binned_dp_warp.cu); no local-memory reservation.
///   Thread: the first port, one thread per tile with ~19 KiB of local memory per thread
///     (src/cuda/fit_binned_dp.cu); kept as the benchmark baseline.
enum class GpuFitKernel : std::uint8_t { Warp, Thread };

/// Options of the GPU fitter.
struct GpuFitOptions {
  /// -1: the fitter's own scale (rceil of the tile's amax, at least 3; byte 127 for an all-zero
  /// tile), else a scale byte 3..246 for every tile (as FitOptions::forced_scale).
  int forced_scale = -1;
  /// Bound on the source bytes staged on the device at once (quantize_gpu only). Peak extra device
  /// memory is about chunk_bytes + (chunk tiles) * 217 bytes (192 packed + 8 codebook + 1 scale +
  /// 16 for the per-tile sse/sum_sq), plus, with GpuFitKernel::Thread, the local-memory
  /// reservation described above. A chunk
  /// holds whole experts when one expert fits, else whole tile rows (8 matrix rows) of one expert;
  /// at least one tile row is staged whatever the bound.
  std::size_t chunk_bytes = std::size_t{512} << 20;
  /// Device to run on (-1: the current device).
  int device = -1;
  GpuFitKernel kernel = GpuFitKernel::Warp;
};

/// Quantizes a host-resident weight or expert stack to LUT-B with "binned-dp" on the GPU.
///   src:   row-major [E, N, K] (or [N, K] when !shape.stacked) of src_type F32, BF16 (bits) or F16
///          (bits), host memory, shape.experts * shape.rows * shape.cols elements.
///   out:   resized to `shape` and filled (packed, codebook, scale; layout above). Identical bytes to
///          lutb::quantize(src, src_type, shape, out, FitOptions{"binned-dp", forced_scale}, name).
/// Returns the same FitStats as the CPU (per-tile sse / sum of squares in double, summed in tile
/// order on the host).
/// Errors (std::invalid_argument, `out` reset): an unsupported dtype, an invalid shape, a null
/// source, forced_scale outside 3..246; a tile with NaN/Inf or a magnitude needing a scale above 246
/// (spec section 2), reported for the lowest such tile exactly as lutb::quantize words it but
/// prefixed "quantize_gpu:" ("tensor NAME, expert e, tile (tn, tk): NaN at row R col C").
/// CUDA failures throw std::runtime_error with the CUDA error string.
FitStats quantize_gpu(const void* src, DType src_type, const LutbShape& shape, LutbTensor& out,
                      const GpuFitOptions& opt = {}, const std::string& name = "tensor");

/// Device pointers receiving a LUT-B stack (layout above); sse / sum_sq ([tiles] doubles) may be
/// null.
struct DeviceFitOut {
  std::uint8_t* packed = nullptr;
  std::uint8_t* codebook = nullptr;
  std::uint8_t* scale = nullptr;
  double* sse = nullptr;
  double* sum_sq = nullptr;
};

/// First failing tile reported by fit_binned_dp_device: `code` 0 = none, 1 = NaN, 2 = +Inf,
/// 3 = -Inf (at flat position `pos` = r * 64 + c inside the tile), 4 = magnitude needs a scale byte
/// above 246.
struct GpuFitError {
  int code = 0;
  std::int64_t tile = -1;
  int pos = 0;
};
/// Decodes the word written by fit_binned_dp_device (all ones = no error).
GpuFitError decode_fit_error(unsigned long long word);

/// The kernel entry for data already on the device: fits all shape.tiles() tiles of the device
/// stack d_src ([E, N, K] row-major, src_type F32 / BF16 / F16) into `out`, asynchronously on
/// `stream`, with no allocation and no host synchronisation. d_error (one unsigned long long of
/// device memory) is set to all ones first and receives the smallest failing tile's word
/// (decode_fit_error); outputs of failing tiles are left unwritten. Throws std::invalid_argument
/// for bad arguments and std::runtime_error when the launch fails.
void fit_binned_dp_device(const void* d_src, DType src_type, const LutbShape& shape, const DeviceFitOut& out,
                          int forced_scale, unsigned long long* d_error, cudaStream_t stream,
                          GpuFitKernel kernel = GpuFitKernel::Warp);

/// Only the tile check of fit_binned_dp_device (NaN / Inf / magnitude, same error word in d_error,
/// set to all ones first): reads the stack once, writes nothing else. Asynchronous on `stream`.
void check_tiles_device(const void* d_src, DType src_type, const LutbShape& shape, unsigned long long* d_error,
                        cudaStream_t stream);

}  // namespace lutb::cuda
