// src/cuda/fit/quantize_gpu.cu: the host entry points of the GPU fitters (lutb/cuda/fit.hpp:
// gpu_fitter, fit_device, fit_binned_dp_device, check_tiles_device, quantize_gpu). The kernels are
// the warp-per-tile fitters of this folder (sm80_lutb_fit_binned_dp_warp.cu,
// sm80_lutb_fit_optimal_warp.cu) and the tile check (sm80_lutb_fit_check_tiles.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/fit/fit_internal.cuh"
#include "lutb/cuda/fit.hpp"
#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"

namespace lutb::cuda {
namespace {

using fit_internal::dtype_code;
using fit_internal::KernelArgs;

constexpr int kMinScale = 3, kMaxScale = 246;

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("quantize_gpu: ") + what + ": " + cudaGetErrorString(e));
}

void check_args(DType src_type, const LutbShape& shape, int forced_scale, const char* who) {
  if (dtype_code(src_type) < 0)
    throw std::invalid_argument(std::string(who) + ": dtype " + std::string(dtype_name(src_type)) +
                                "; LUT-B fitting reads F32, BF16 or F16");
  if (shape.rows < 0 || shape.cols < 0 || shape.experts < 1 || (!shape.stacked && shape.experts != 1))
    throw std::invalid_argument(std::string(who) + ": invalid shape");
  // The padded sizes, the tile count and the source bytes (at most 4 per weight) must fit 64 bits,
  // else shape.tiles() wraps (to 0 for [2^40, 2^40]: an empty tensor without an error); the CPU
  // side refuses the same shapes in check_shape (src/core/tile.cpp).
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  std::int64_t n = 0;
  if (shape.rows > kMax - (kTileRows - 1) || shape.cols > kMax - (kTileCols - 1) ||
      __builtin_mul_overflow(shape.tiles_n(), shape.tiles_k(), &n) || __builtin_mul_overflow(n, shape.experts, &n) ||
      __builtin_mul_overflow(n, static_cast<std::int64_t>(kTileSize) * 4, &n))
    throw std::invalid_argument(std::string(who) + ": shape [" + std::to_string(shape.experts) + ", " +
                                std::to_string(shape.rows) + ", " + std::to_string(shape.cols) +
                                "] is too large: its sizes overflow 64 bits");
  if (forced_scale >= 0 && (forced_scale < kMinScale || forced_scale > kMaxScale))
    throw std::invalid_argument(std::string(who) + ": forced_scale " + std::to_string(forced_scale) +
                                " is outside the scale bytes 3..246 fitters may choose (spec section 2)");
}

// Whether each of the n rows of `cols` column weights holds one value: then every tile of those
// experts is fitted unweighted (fit.cpp's equal-weights rule), and the unweighted kernels run.
bool constant_rows(const float* cw, std::int64_t n, std::int64_t cols) {
  for (std::int64_t e = 0; e < n; ++e)
    for (std::int64_t c = 1; c < cols; ++c)
      if (cw[e * cols + c] != cw[e * cols]) return false;
  return true;
}

float host_load(const void* src, DType t, std::int64_t i) {
  if (t == DType::F32) return static_cast<const float*>(src)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(src)[i];
  return t == DType::BF16 ? bf16_to_float(h) : fp16_to_float(h);
}

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t n) { ok(cudaMalloc(&p, n ? n : 1), "cudaMalloc"); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

}  // namespace

GpuFitter gpu_fitter(std::string_view name) {
  if (name.empty() || name == "binned-dp") return GpuFitter::BinnedDp;
  if (name == "optimal") return GpuFitter::Optimal;
  check_fitter_name(name);  // throws for unknown names
  throw std::invalid_argument("fitter '" + std::string(name) +
                              "' has no GPU kernel (GPU fitters: binned-dp, optimal); lutb::quantize runs it on the CPU");
}

const char* gpu_fitter_name(GpuFitter f) { return f == GpuFitter::Optimal ? "optimal" : "binned-dp"; }

GpuFitError decode_fit_error(unsigned long long word) {
  GpuFitError e;
  if (word == ~0ull) return e;
  e.code = static_cast<int>((word >> 9) & 7u);
  e.pos = static_cast<int>(word & 511u);
  e.tile = static_cast<std::int64_t>(word >> 12);
  return e;
}

void fit_device(const void* d_src, DType src_type, const LutbShape& shape, const DeviceFitOut& out, GpuFitter fitter,
                int forced_scale, unsigned long long* d_error, cudaStream_t stream, const float* d_column_weights) {
  check_args(src_type, shape, forced_scale, "fit_device");
  if (!d_error || !out.packed || !out.codebook || !out.scale)
    throw std::invalid_argument("fit_device: null output pointer");
  if (shape.rows > 0 && shape.cols > 0 && !d_src) throw std::invalid_argument("fit_device: null source");
  ok(cudaMemsetAsync(d_error, 0xff, sizeof(unsigned long long), stream), "cudaMemsetAsync");
  fit_internal::launch_fit(fit_internal::stack_args(d_src, src_type, shape, out, forced_scale, d_error, fitter), stream,
                           d_column_weights);
}

void fit_binned_dp_device(const void* d_src, DType src_type, const LutbShape& shape, const DeviceFitOut& out,
                          int forced_scale, unsigned long long* d_error, cudaStream_t stream,
                          const float* d_column_weights) {
  fit_device(d_src, src_type, shape, out, GpuFitter::BinnedDp, forced_scale, d_error, stream, d_column_weights);
}

void check_tiles_device(const void* d_src, DType src_type, const LutbShape& shape, unsigned long long* d_error,
                        cudaStream_t stream) {
  check_args(src_type, shape, -1, "check_tiles_device");
  if (!d_error) throw std::invalid_argument("check_tiles_device: null error word");
  if (shape.rows > 0 && shape.cols > 0 && !d_src) throw std::invalid_argument("check_tiles_device: null source");
  ok(cudaMemsetAsync(d_error, 0xff, sizeof(unsigned long long), stream), "cudaMemsetAsync");
  fit_internal::launch_check_tiles(
      fit_internal::stack_args(d_src, src_type, shape, DeviceFitOut{}, -1, d_error, GpuFitter::BinnedDp), stream);
}

namespace {

// The fitter named by opt, once the arguments and the column weights are checked and a usable GPU
// is found; every message names the tensor.
GpuFitter checked_fitter(const void* src, DType src_type, const LutbShape& shape, const GpuFitOptions& opt,
                         const std::string& name) {
  GpuFitter fitter;
  try {
    fitter = gpu_fitter(opt.fitter);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("quantize_gpu: tensor " + name + ": " + e.what());
  }
  check_args(src_type, shape, opt.forced_scale, ("quantize_gpu: tensor " + name).c_str());
  if (shape.rows > 0 && shape.cols > 0 && src == nullptr)
    throw std::invalid_argument("quantize_gpu: tensor " + name + ": null source");
  // The column weights before any tile, worded as lutb::quantize words them.
  const float* cw = opt.column_weights;
  if (cw)
    for (std::int64_t e = 0; e < shape.experts; ++e)
      if (const std::string msg = column_weights_error(cw + e * shape.cols, shape.cols); !msg.empty())
        throw std::invalid_argument("quantize_gpu: tensor " + name +
                                    (shape.stacked ? ", expert " + std::to_string(e) : std::string()) + ": " + msg);
  {
    // Without a usable GPU (no device, no or too old a driver) say so plainly instead of CUDA's raw
    // "CUDA driver version is insufficient for CUDA runtime version" at the first allocation.
    int devices = 0;
    const cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess || devices == 0)
      throw std::runtime_error("quantize_gpu: tensor " + name + ": no usable CUDA GPU (" +
                               (e != cudaSuccess ? std::string(cudaGetErrorString(e)) : std::string("no device")) +
                               "); lutb::quantize fits on the CPU");
  }
  return fitter;
}

// Chunk plan: whole experts when one fits, else whole tile rows of one expert. chunk_src: the
// device source buffer's bytes.
struct ChunkPlan {
  std::int64_t experts_per_chunk = 1, tile_rows_per_chunk, chunk_tiles;
  std::size_t chunk_src;
};

ChunkPlan plan_chunks(const LutbShape& shape, std::size_t expert_bytes, std::size_t tile_row_bytes,
                      std::size_t chunk_bytes) {
  ChunkPlan c;
  c.tile_rows_per_chunk = shape.tiles_n();
  if (expert_bytes <= chunk_bytes) {
    c.experts_per_chunk = expert_bytes == 0 ? shape.experts
                                            : std::max<std::int64_t>(1, static_cast<std::int64_t>(chunk_bytes / expert_bytes));
    c.experts_per_chunk = std::min(c.experts_per_chunk, shape.experts);
  } else {
    c.tile_rows_per_chunk = std::max<std::int64_t>(1, static_cast<std::int64_t>(chunk_bytes / tile_row_bytes));
  }
  c.chunk_tiles = c.experts_per_chunk * c.tile_rows_per_chunk * shape.tiles_k();
  c.chunk_src = std::max(static_cast<std::size_t>(c.experts_per_chunk) * expert_bytes,
                         std::min(expert_bytes, static_cast<std::size_t>(c.tile_rows_per_chunk) * tile_row_bytes));
  return c;
}

// The kernel arguments of the chunk of experts [e0, e0 + ne) and tile rows [tn0, tn0 + ntn) (all of
// them, or of expert e0 only), and where its source lies in host memory (from, bytes).
KernelArgs chunk_args(const std::uint8_t* s8, DType src_type, const LutbShape& shape, std::size_t expert_bytes,
                      std::size_t row_bytes, std::int64_t e0, std::int64_t ne, std::int64_t tn0, std::int64_t ntn,
                      const std::uint8_t*& from, std::size_t& bytes) {
  const std::int64_t tn_n = shape.tiles_n(), tk_n = shape.tiles_k();
  KernelArgs a{};
  a.dtype = dtype_code(src_type);
  a.cols = shape.cols;
  a.tiles_k = tk_n;
  if (ntn == tn_n) {  // whole experts
    from = s8 + static_cast<std::size_t>(e0) * expert_bytes;
    bytes = static_cast<std::size_t>(ne) * expert_bytes;
    a.rows = shape.rows;
    a.tiles_n = tn_n;
  } else {  // tile rows [tn0, tn0 + ntn) of expert e0
    const std::int64_t r0 = tn0 * kTileRows, r1 = std::min(shape.rows, (tn0 + ntn) * kTileRows);
    from = s8 + static_cast<std::size_t>(e0) * expert_bytes + static_cast<std::size_t>(r0) * row_bytes;
    bytes = static_cast<std::size_t>(r1 - r0) * row_bytes;
    a.rows = r1 - r0;
    a.tiles_n = ntn;
  }
  a.tiles = ne * a.tiles_n * tk_n;
  a.t_base = e0 * shape.tiles_per_expert() + tn0 * tk_n;
  return a;
}

// Throws the message of the fits' failing tile `err` (as the CPU words it), after clearing out.
[[noreturn]] void throw_fit_error(const void* src, DType src_type, const LutbShape& shape, const std::string& name,
                                  const GpuFitError& err, LutbTensor& out) {
  const std::int64_t tpe = shape.tiles_per_expert(), tk_n = shape.tiles_k();
  const std::int64_t t = err.tile, e = t / tpe, tn = (t % tpe) / tk_n, tk = t % tk_n;
  std::string where = "tensor " + name + (shape.stacked ? ", expert " + std::to_string(e) : std::string()) +
                      ", tile (" + std::to_string(tn) + ", " + std::to_string(tk) + ")";
  std::string what;
  if (err.code == 5) {  // (not reached: the weights were checked above and copied as they are)
    out = LutbTensor();
    throw std::invalid_argument("quantize_gpu: tensor " + name +
                                (shape.stacked ? ", expert " + std::to_string(e) : std::string()) +
                                ": column weight " + std::to_string(tk * kTileCols + err.pos) +
                                ": column weights must be finite and > 0");
  }
  if (err.code <= 3) {
    what = std::string(err.code == 1 ? "NaN" : (err.code == 2 ? "+Inf" : "-Inf")) + " at row " +
           std::to_string(tn * kTileRows + err.pos / kTileCols) + " col " +
           std::to_string(tk * kTileCols + err.pos % kTileCols);
  } else {
    float amax = 0.0f;
    for (int r = 0; r < kTileRows; ++r) {
      const std::int64_t row = tn * kTileRows + r;
      if (row >= shape.rows) break;
      for (std::int64_t c = tk * kTileCols; c < std::min(shape.cols, (tk + 1) * kTileCols); ++c)
        amax = std::max(amax, std::fabs(host_load(src, src_type, (e * shape.rows + row) * shape.cols + c)));
    }
    char buf[32];  // shortest round-trip decimal, as the CPU message (src/fit/fit.cpp check_tile)
    const auto r = std::to_chars(buf, buf + sizeof(buf), amax);
    what = "magnitude " + std::string(buf, r.ptr) + " needs a scale byte above 246 (spec section 2)";
  }
  out = LutbTensor();
  throw std::invalid_argument("quantize_gpu: " + where + ": " + what);
}

}  // namespace

FitStats quantize_gpu(const void* src, DType src_type, const LutbShape& shape, LutbTensor& out,
                      const GpuFitOptions& opt, const std::string& name) {
  const GpuFitter fitter = checked_fitter(src, src_type, shape, opt, name);
  const float* cw = opt.column_weights;
  if (opt.device >= 0) ok(cudaSetDevice(opt.device), "cudaSetDevice");

  const std::int64_t tiles = shape.tiles(), tn_n = shape.tiles_n();
  out.shape = shape;
  out.packed.assign(static_cast<std::size_t>(tiles) * kPackedBytes, 0);
  out.codebook.assign(static_cast<std::size_t>(tiles) * kCodebookSize, 0);
  out.scale.assign(static_cast<std::size_t>(tiles), kUE8M0One);
  std::vector<double> sse(static_cast<std::size_t>(tiles)), ssq(static_cast<std::size_t>(tiles));
  if (tiles == 0) return FitStats{};

  const std::size_t esz = dtype_size(src_type);
  const std::size_t row_bytes = static_cast<std::size_t>(shape.cols) * esz;
  const std::size_t expert_bytes = static_cast<std::size_t>(shape.rows) * row_bytes;
  const ChunkPlan plan = plan_chunks(shape, expert_bytes, row_bytes * kTileRows, opt.chunk_bytes);
  const std::int64_t experts_per_chunk = plan.experts_per_chunk, chunk_tiles = plan.chunk_tiles;
  // The chunk's column weights: its experts' rows (a chunk of tile rows reads its expert's row).
  std::unique_ptr<DevBuf> d_cw;
  if (cw) d_cw = std::make_unique<DevBuf>(static_cast<std::size_t>(experts_per_chunk * shape.cols) * sizeof(float));
  DevBuf d_src(plan.chunk_src), d_packed(static_cast<std::size_t>(chunk_tiles) * kPackedBytes),
      d_cb(static_cast<std::size_t>(chunk_tiles) * kCodebookSize), d_scale(static_cast<std::size_t>(chunk_tiles)),
      d_sse(static_cast<std::size_t>(chunk_tiles) * 8), d_ssq(static_cast<std::size_t>(chunk_tiles) * 8),
      d_err(sizeof(unsigned long long));
  const DeviceFitOut dout{d_packed.as<std::uint8_t>(), d_cb.as<std::uint8_t>(), d_scale.as<std::uint8_t>(),
                          d_sse.as<double>(), d_ssq.as<double>()};
  ok(cudaMemset(d_err.p, 0xff, sizeof(unsigned long long)), "cudaMemset");
  const auto* s8 = static_cast<const std::uint8_t*>(src);

  for (std::int64_t e0 = 0; e0 < shape.experts; e0 += experts_per_chunk) {
    const std::int64_t ne = std::min(experts_per_chunk, shape.experts - e0);
    for (std::int64_t tn0 = 0; tn0 < tn_n; tn0 += plan.tile_rows_per_chunk) {
      const std::int64_t ntn = std::min(plan.tile_rows_per_chunk, tn_n - tn0);
      std::size_t bytes;
      const std::uint8_t* from;
      KernelArgs a = chunk_args(s8, src_type, shape, expert_bytes, row_bytes, e0, ne, tn0, ntn, from, bytes);
      a.src = d_src.p;
      a.out = dout;
      a.forced_scale = opt.forced_scale;
      a.err = d_err.as<unsigned long long>();
      a.optimal = fitter == GpuFitter::Optimal;
      if (bytes) ok(cudaMemcpy(d_src.p, from, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
      const bool weighted = cw && !constant_rows(cw + e0 * shape.cols, ne, shape.cols);
      if (weighted && tn0 == 0)  // (the weights of experts [e0, e0 + ne), kept for the expert's further tile rows)
        ok(cudaMemcpy(d_cw->p, cw + e0 * shape.cols, static_cast<std::size_t>(ne * shape.cols) * sizeof(float),
                      cudaMemcpyHostToDevice),
           "cudaMemcpy (column weights)");
      fit_internal::launch_fit(a, nullptr, weighted ? d_cw->as<float>() : nullptr);
      unsigned long long word = ~0ull;
      ok(cudaMemcpy(&word, d_err.p, sizeof(word), cudaMemcpyDeviceToHost), "fit kernel");
      const GpuFitError err = decode_fit_error(word);
      if (err.code != 0) throw_fit_error(src, src_type, shape, name, err, out);
      const std::size_t t0 = static_cast<std::size_t>(a.t_base), nt = static_cast<std::size_t>(a.tiles);
      ok(cudaMemcpy(out.packed.data() + t0 * kPackedBytes, d_packed.p, nt * kPackedBytes, cudaMemcpyDeviceToHost),
         "cudaMemcpy packed");
      ok(cudaMemcpy(out.codebook.data() + t0 * kCodebookSize, d_cb.p, nt * kCodebookSize, cudaMemcpyDeviceToHost),
         "cudaMemcpy codebook");
      ok(cudaMemcpy(out.scale.data() + t0, d_scale.p, nt, cudaMemcpyDeviceToHost), "cudaMemcpy scale");
      ok(cudaMemcpy(sse.data() + t0, d_sse.p, nt * 8, cudaMemcpyDeviceToHost), "cudaMemcpy sse");
      ok(cudaMemcpy(ssq.data() + t0, d_ssq.p, nt * 8, cudaMemcpyDeviceToHost), "cudaMemcpy sum_sq");
    }
  }
  return FitStats::of_tiles(sse, ssq);
}

}  // namespace lutb::cuda
