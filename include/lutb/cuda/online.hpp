// lutb/cuda/online.hpp: the online LUT-B method on the GPU (spec section 6): a layer's
// BF16/FP16 routed experts already on the device in, packed LUT-B out on the device (in the
// lane-major bit order the CUDA MoE kernels read, lutb/cuda/lane_major.hpp), the source released
// chunk by chunk, with temporaries bounded by the chunk size rather than the layer size.
//
// The GPU analogue of lutb::moe::LutBOnlineMoEMethod::process_weights_after_loading (src/moe):
//  - the bytes are those of the CPU method for the same weights: lutb::quantize with the chosen
//    fitter ("binned-dp" by default, or "optimal"; the warp kernel of lutb/cuda/fit.hpp reproduces
//    them), then each tile's 192 index bytes permuted by tile_to_lane_major (in place on the device);
//  - idempotent: a source marked already_processed returns at once with an empty report;
//  - the source is released: through the caller's `release` callback, one chunk of experts at a
//    time as soon as the device has finished reading it, then the source's pointers are cleared;
//  - errors name the tensor ("w13_weight" / "w2_weight"), expert, tile and reason like the CPU
//    fitter, and are raised BEFORE anything is released (a first pass checks every tile);
//  - the backend selection reason is logged once per process (the seed's logger.info_once).
//
// Device memory: the output (3.140625 bits per weight, one allocation owned by DeviceLutbLayer) is
// allocated once (while the check pass runs, and freed again if it fails); the only temporaries
// are the per-tile error sums of two chunks (16 bytes per 512 weights of the larger matrix of a
// chunk, double-buffered so that one chunk's sums are copied to the host while the next chunk is
// fitted; only when stats are asked for) and three 8-byte error words. The fit kernels keep their
// tables in shared memory (no local-memory reservation). So the peak device memory during the
// call is (source not yet released) + (output) + (temporaries <= chunk_bytes / 32 + 256).
//
// The steps: the check pass on a memory-bound check kernel (all launches queued; its result read
// once the first fit is queued behind it, before anything is released), then the chunks' fits
// queued back to back while the host copies the previous chunk's per-tile sums on a second stream,
// adds them and releases it (no host synchronisation between two fits; the release follows the
// chunk's completion through an event).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lutb/cuda/fit.hpp"
#include "lutb/cuda/moe.hpp"
#include "lutb/dtype.hpp"
#include "lutb/fit.hpp"

typedef struct CUstream_st* cudaStream_t;

namespace lutb::cuda {

/// One layer's routed experts on the device, as a loader left them (the GPU analogue of
/// lutb::moe::RoutedExpertsLayer). w13 rows 0..I-1 are gate (w1), rows I..2I-1 up (w3).
struct DeviceExpertSource {
  DType dtype = DType::BF16;  // BF16 or F16 (bits)
  std::int64_t experts = 0;       // E
  std::int64_t hidden = 0;        // H
  std::int64_t intermediate = 0;  // I (a multiple of 8, as DeviceMoeWeights requires)
  /// Device pointers: either ONE entry each (stacked w13 [E, 2I, H], w2 [E, H, I]) or E entries
  /// each (expert e: w13 [2I, H], w2 [H, I]), row-major.
  std::vector<const void*> w13, w2;
  /// Called once per chunk, in expert order, as soon as the device has finished reading experts
  /// [e0, e1) of both w13 and w2 (the caller frees them: cudaFree of per-expert buffers, dropping
  /// a tensor reference, or, for a stacked source, freeing the stack when e1 == experts). May be
  /// empty (nothing is released, the caller frees the source afterwards).
  std::function<void(std::int64_t e0, std::int64_t e1)> release;
  /// Set by quantize_experts_online (the seed's _already_called_process_weights_after_loading).
  bool already_processed = false;
};

/// A LUT-B layer owned on the device: one allocation holding w13 and w2 (packed, codebook, scale).
class DeviceLutbLayer {
 public:
  DeviceLutbLayer() = default;
  ~DeviceLutbLayer();
  DeviceLutbLayer(DeviceLutbLayer&& o) noexcept;
  DeviceLutbLayer& operator=(DeviceLutbLayer&& o) noexcept;
  DeviceLutbLayer(const DeviceLutbLayer&) = delete;
  DeviceLutbLayer& operator=(const DeviceLutbLayer&) = delete;

  /// The weights for moe_forward: packed bytes in lane-major order and w13.lane_major /
  /// w2.lane_major set (unless GpuOnlineOptions::lane_major was false).
  const DeviceMoeWeights& weights() const { return w_; }
  /// Bytes of the allocation (packed + codebook + scale of both matrices, 256-byte aligned parts).
  std::size_t bytes() const { return bytes_; }
  bool empty() const { return mem_ == nullptr; }
  /// Frees the device memory.
  void reset();

 private:
  friend struct OnlineAccess;
  void* mem_ = nullptr;
  std::size_t bytes_ = 0;
  DeviceMoeWeights w_;
};

/// Options of quantize_experts_online.
struct GpuOnlineOptions {
  /// Source bytes fitted per step (whole experts; at least one expert whatever the bound). Bounds
  /// the temporaries (see the file comment) and how soon the source is released.
  std::size_t chunk_bytes = std::size_t{256} << 20;
  /// The fitter: "" or "binned-dp" (the default), or "optimal" (exact, ~21-24x slower on an H200:
  /// docs/perf/fit-gpu.md). Fitters without a GPU kernel ("ct-lloyd", "multistart") and unknown
  /// names are std::invalid_argument errors (lutb/cuda/fit.hpp gpu_fitter).
  std::string fitter;
  /// -1: the fitter's own scale per tile, else a scale byte 3..246 for every tile.
  int forced_scale = -1;
  /// Column weights of the weighted (calibrated) fit (lutb::FitOptions::column_weights), device
  /// memory, float32, row-major: w13's [E][H] (the input of gate and up) and w2's [E][I]; each
  /// null: that tensor is fitted unweighted. Read back once and checked before anything else (every
  /// value finite and > 0); the bytes are lutb::quantize's with the same weights. Must stay valid
  /// until the call returns.
  const float* w13_column_weights = nullptr;
  const float* w2_column_weights = nullptr;
  /// Compute FitStats (per-tile error sums, copied to the host and summed in tile order exactly as
  /// lutb::quantize does), a chunk's sums while the next chunk is fitted.
  bool stats = true;
  /// Permute each tile's index bytes to the lane-major order of lutb/cuda/lane_major.hpp (what the
  /// CUDA MoE kernels read). false keeps the checkpoint (spec 2.2) order.
  bool lane_major = true;
  cudaStream_t stream = nullptr;
  /// Receives the once-per-process selection message; empty: stderr as "[lutb] message".
  std::function<void(const std::string&)> log;
};

/// Statistics of quantize_experts_online.
struct GpuOnlineReport {
  FitStats w13, w2;                // equal to lutb::quantize's on the same weights (when stats)
  std::size_t source_bytes = 0;    // BF16/FP16 bytes released
  std::size_t quantized_bytes = 0; // bytes of the output allocation
  std::size_t temp_bytes = 0;      // device temporaries allocated by the call
  std::int64_t experts_per_chunk = 0;
  std::int64_t chunks = 0;
  /// Host wall-clock seconds of the call's parts (diagnostics for the benchmark): check = the check
  /// pass from the first launch to its result; alloc = cudaMalloc of the temporaries and the
  /// output (and the second stream and events); loop = the chunks, from
  /// the first fit's launch to the last chunk's completion; wait = the host blocked on the device
  /// (synchronisations and blocking copies, check pass included); sums = adding the per-tile sums;
  /// release = inside the release callbacks; finish = the selection message after the loop;
  /// total = the whole call.
  struct Seconds {
    double check = 0, alloc = 0, loop = 0, wait = 0, sums = 0, release = 0, finish = 0, total = 0;
  } seconds;
};

/// Quantises `src` into `out` (replacing its contents) on the GPU; see the file comment.
/// Errors: std::invalid_argument ("quantize_experts_online: ..." naming the reason: a fitter without
/// a GPU kernel or an unknown fitter name, dtype not BF16 or F16, bad sizes, I % 8 != 0, wrong number of or null pointers, forced_scale outside 3..246,
/// a column weight that is not finite and > 0 ("tensor w2_weight, expert e: column weight C is X;
/// column weights must be finite and > 0"),
/// or a tile with NaN/Inf or a magnitude needing a scale above 246: "tensor w13_weight, expert e,
/// tile (tn, tk): NaN at row R col C", as lutb::quantize words it); nothing is released and `out`
/// is unchanged. CUDA failures: std::runtime_error with the CUDA error string (chunks already
/// released stay released).
GpuOnlineReport quantize_experts_online(DeviceExpertSource& src, DeviceLutbLayer& out,
                                        const GpuOnlineOptions& opt = {});


}  // namespace lutb::cuda
