// lutb/cuda/fit.hpp: the LUT-B fitters "binned-dp" (the default) and "optimal" (spec section 2.1;
// CPU references src/fit/binned_dp.cpp, src/fit/optimal.cpp) on NVIDIA GPUs, producing THE SAME
// BYTES as the CPU fitters. The Lloyd fitters ("ct-lloyd", "multistart") have no GPU kernel: asking
// for them throws std::invalid_argument (use lutb::quantize on the CPU).
//
// Byte equality with lutb::quantize with the same fitter, forced_scale and column_weights: one warp
// per 8x64 tile, per-warp tables in shared memory (binned-dp ~13.7 KiB, optimal ~26 KiB, 4.3 KiB more
// each when weighted; no local memory), the byte-deciding scalar arithmetic the CPU fitter's own
// (src/fit/fit_scalar.hpp, compiled with -fmad=false here and -ffp-contract=off there); the sort,
// the DP levels, the refinement tables and the encoding are spread over the lanes in ways that
// cannot change a result, and the order-dependent double sums (prefix sums, weight sums, per-tile
// error sums, optimal's saturation bound) stay sequential in the CPU's order (docs/design/cuda-fit.md,
// src/cuda/fit/sm80_lutb_fit_warp.cuh). The weighted (calibrated) fit runs separate kernels: without
// column weights the unweighted kernels run, unchanged.
// Tested in tests/cuda/fit_gpu_test.cpp (random, edge and real tiles, both fitters, unweighted and
// with column weights, against lutb::quantize). Speed: docs/perf/fit-gpu.md. The online method
// built on these kernels (device BF16/FP16 experts in, packed LUT-B out): lutb/cuda/online.hpp.
//
// Layout of the outputs: the LutbTensor layout of lutb/tile.hpp (spec section 2.2):
//   packed [E, Np/8, Kp/64, 192] u8, codebook [E, Np/8, Kp/64, 8] E4M3, scale [E, Np/8, Kp/64] UE8M0,
// tiles in (expert, tile row, tile column) order; tiles that overhang the logical [N, K] matrix are
// zero-filled exactly as gather_tile does (the zeros take part in the fit).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "lutb/dtype.hpp"
#include "lutb/fit.hpp"
#include "lutb/tile.hpp"

typedef struct CUstream_st* cudaStream_t;

namespace lutb::cuda {

/// The fitters with a GPU kernel (lutb/fit.hpp describes them).
enum class GpuFitter : std::uint8_t { BinnedDp, Optimal };

/// The GPU fitter of a lutb::fit fitter name ("" = the default, "binned-dp"). Throws
/// std::invalid_argument for a fitter without a GPU kernel ("fitter 'ct-lloyd' has no GPU kernel
/// (GPU fitters: binned-dp, optimal); lutb::quantize runs it on the CPU") and for unknown names
/// (lutb::check_fitter_name's message).
GpuFitter gpu_fitter(std::string_view name);
/// The lutb::fit name of a GPU fitter ("binned-dp" or "optimal").
const char* gpu_fitter_name(GpuFitter f);

/// Options of the GPU fitter.
struct GpuFitOptions {
  /// A lutb::fit fitter name with a GPU kernel: "" or "binned-dp" (the default), or "optimal"
  /// (see gpu_fitter: other names throw std::invalid_argument).
  std::string fitter;
  /// -1: the fitter's own scale (binned-dp: rceil of the tile's amax, at least 3; optimal: the scale
  /// search of src/fit/optimal.cpp; byte 127 for an all-zero tile), else a scale byte 3..246 for
  /// every tile (as FitOptions::forced_scale).
  int forced_scale = -1;
  /// Column weights of the weighted (calibrated) fit, as FitOptions::column_weights: host memory,
  /// float32 [experts][cols] (one row per expert of the logical shape, row-major), every value
  /// finite and > 0; null: unweighted. quantize_gpu only (fit_device takes device weights). The
  /// bytes are lutb::quantize's with the same weights.
  const float* column_weights = nullptr;
  /// Bound on the source bytes staged on the device at once (quantize_gpu only). Peak extra device
  /// memory is about chunk_bytes + (chunk tiles) * 217 bytes (192 packed + 8 codebook + 1 scale +
  /// 16 for the per-tile sse/sum_sq). A chunk holds whole experts when one expert fits, else whole
  /// tile rows (8 matrix rows) of one expert; at least one tile row is staged whatever the bound.
  std::size_t chunk_bytes = std::size_t{512} << 20;
  /// Device to run on (-1: the current device).
  int device = -1;
};

/// Quantizes a host-resident weight or expert stack to LUT-B on the GPU with opt.fitter.
///   src:   row-major [E, N, K] (or [N, K] when !shape.stacked) of src_type F32, BF16 (bits) or F16
///          (bits), host memory, shape.experts * shape.rows * shape.cols elements.
///   out:   resized to `shape` and filled (packed, codebook, scale; layout above). Identical bytes to
///          lutb::quantize(src, src_type, shape, out, fo, name) with fo's fitter, forced_scale and
///          column_weights those of `opt`.
/// Returns the same FitStats as the CPU (per-tile sse / sum of squares in double, summed in tile
/// order on the host).
/// Errors (std::invalid_argument, `out` reset): a fitter without a GPU kernel or an unknown name,
/// an unsupported dtype, an invalid shape, a null source,
/// forced_scale outside 3..246; a column weight that is not finite and > 0 (checked before any
/// tile, worded as lutb::quantize: "quantize_gpu: tensor NAME, expert e: column weight C is X;
/// column weights must be finite and > 0"); a tile with NaN/Inf or a magnitude needing a scale above 246
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

/// First failing tile reported by fit_device / fit_binned_dp_device: `code` 0 = none, 1 = NaN, 2 = +Inf,
/// 3 = -Inf (at flat position `pos` = r * 64 + c inside the tile), 4 = magnitude needs a scale byte
/// above 246, 5 = a column weight of the tile is not finite and > 0 (`pos` = the first such column
/// of the tile, 0..63: matrix column 64 * tk + pos of the tile's expert).
struct GpuFitError {
  int code = 0;
  std::int64_t tile = -1;
  int pos = 0;
};
/// Decodes the word written by fit_device (all ones = no error).
GpuFitError decode_fit_error(unsigned long long word);

/// The kernel entry for data already on the device: fits all shape.tiles() tiles of the device
/// stack d_src ([E, N, K] row-major, logical shape, src_type F32 / BF16 / F16) with `fitter` into
/// `out` (layout above), asynchronously on `stream`, with no allocation and no host
/// synchronisation. The bytes are lutb::quantize's with that fitter, forced_scale (-1 or 3..246)
/// and column weights: d_column_weights, device memory, float32 [E][shape.cols] (the rule of
/// FitOptions::column_weights), or null for the unweighted fit. d_error (one unsigned long long of
/// device memory) is set to all ones first and receives the smallest failing tile's word
/// (decode_fit_error; a tile whose column weights break the rule fails with code 5, checked before
/// its values); outputs of failing tiles are left unwritten. With sse / sum_sq null the per-tile
/// sums are not computed (binned-dp is then ~10 % faster; optimal computes the tile error anyway
/// for its scale search). Throws std::invalid_argument for bad arguments and std::runtime_error
/// when the launch fails.
void fit_device(const void* d_src, DType src_type, const LutbShape& shape, const DeviceFitOut& out, GpuFitter fitter,
                int forced_scale, unsigned long long* d_error, cudaStream_t stream,
                const float* d_column_weights = nullptr);

/// fit_device with GpuFitter::BinnedDp (the default fitter).
void fit_binned_dp_device(const void* d_src, DType src_type, const LutbShape& shape, const DeviceFitOut& out,
                          int forced_scale, unsigned long long* d_error, cudaStream_t stream,
                          const float* d_column_weights = nullptr);

/// Only the tile check of fit_device (NaN / Inf / magnitude, same error word in d_error,
/// set to all ones first) on a memory-bound check kernel: reads the stack once, writes nothing
/// else. Asynchronous on `stream`.
void check_tiles_device(const void* d_src, DType src_type, const LutbShape& shape, unsigned long long* d_error,
                        cudaStream_t stream);

}  // namespace lutb::cuda
