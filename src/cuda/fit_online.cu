// src/cuda/fit_online.cu: the online LUT-B method on the GPU (lutb/cuda/online.hpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lutb/cuda/lane_major.hpp"
#include "lutb/cuda/online.hpp"
#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"

namespace lutb::cuda {

namespace {

constexpr const char* kWho = "quantize_experts_online";

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(kWho) + ": " + what + ": " + cudaGetErrorString(e));
}

void log_once(const GpuOnlineOptions& opt, const std::string& msg) {
  static std::mutex mu;
  static std::set<std::string> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.insert(msg).second) return;
  }
  if (opt.log) opt.log(msg);
  else std::fprintf(stderr, "[lutb] %s\n", msg.c_str());
}

std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }

LutbShape stack_shape(std::int64_t e, std::int64_t rows, std::int64_t cols) {
  LutbShape s;
  s.experts = e;
  s.rows = rows;
  s.cols = cols;
  s.stacked = true;
  return s;
}

struct Tensor {
  const char* name;
  LutbShape shape;            // whole stack
  const std::vector<const void*>* ptrs;
  std::uint8_t* packed;
  std::uint8_t* codebook;
  std::uint8_t* scale;
  FitStats* stats;
  // Device pointer to experts [e0, e0 + n) when contiguous (stacked source, or n == 1).
  const void* expert_ptr(std::int64_t e, std::size_t esz) const {
    if (ptrs->size() == 1)
      return static_cast<const std::uint8_t*>((*ptrs)[0]) + static_cast<std::size_t>(e * shape.rows * shape.cols) * esz;
    return (*ptrs)[static_cast<std::size_t>(e)];
  }
};

std::string describe_error(const Tensor& t, std::int64_t expert, const GpuFitError& err, DType dtype,
                           std::size_t esz) {
  const LutbShape& s = t.shape;
  const std::int64_t tpe1 = s.tiles_per_expert(), tk_n = s.tiles_k();
  const std::int64_t tl = err.tile % tpe1, tn = tl / tk_n, tk = tl % tk_n;
  std::string where = std::string("tensor ") + t.name + ", expert " + std::to_string(expert) + ", tile (" +
                      std::to_string(tn) + ", " + std::to_string(tk) + ")";
  std::string what;
  if (err.code <= 3) {
    what = std::string(err.code == 1 ? "NaN" : (err.code == 2 ? "+Inf" : "-Inf")) + " at row " +
           std::to_string(tn * kTileRows + err.pos / kTileCols) + " col " +
           std::to_string(tk * kTileCols + err.pos % kTileCols);
  } else {  // the tile's magnitude, read back (as lutb::quantize prints it)
    float amax = 0.0f;
    const auto* base = static_cast<const std::uint8_t*>(t.expert_ptr(expert, esz));
    for (int r = 0; r < kTileRows; ++r) {
      const std::int64_t row = tn * kTileRows + r;
      if (row >= s.rows) break;
      const std::int64_t c0 = tk * kTileCols, nc = std::min<std::int64_t>(kTileCols, s.cols - c0);
      std::vector<std::uint16_t> h(static_cast<std::size_t>(nc));
      ok(cudaMemcpy(h.data(), base + static_cast<std::size_t>(row * s.cols + c0) * esz, h.size() * esz,
                    cudaMemcpyDeviceToHost),
         "cudaMemcpy");
      for (std::uint16_t v : h) amax = std::max(amax, std::fabs(dtype == DType::BF16 ? bf16_to_float(v) : fp16_to_float(v)));
    }
    char buf[32];  // shortest round-trip decimal, as the CPU message (src/fit/fit.cpp check_tile)
    const auto r = std::to_chars(buf, buf + sizeof(buf), amax);
    what = "magnitude " + std::string(buf, r.ptr) + " needs a scale byte above 246 (spec section 2)";
  }
  return std::string(kWho) + ": " + where + ": " + what;
}

}  // namespace

// ---------------------------------------------------------------------------
// DeviceLutbLayer
// ---------------------------------------------------------------------------
DeviceLutbLayer::~DeviceLutbLayer() { reset(); }
DeviceLutbLayer::DeviceLutbLayer(DeviceLutbLayer&& o) noexcept
    : mem_(std::exchange(o.mem_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), w_(std::exchange(o.w_, {})) {}
DeviceLutbLayer& DeviceLutbLayer::operator=(DeviceLutbLayer&& o) noexcept {
  if (this != &o) {
    reset();
    mem_ = std::exchange(o.mem_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    w_ = std::exchange(o.w_, {});
  }
  return *this;
}
void DeviceLutbLayer::reset() {
  if (mem_) cudaFree(mem_);
  mem_ = nullptr;
  bytes_ = 0;
  w_ = {};
}

struct OnlineAccess {
  static void set(DeviceLutbLayer& l, void* mem, std::size_t bytes, const DeviceMoeWeights& w) {
    l.reset();
    l.mem_ = mem;
    l.bytes_ = bytes;
    l.w_ = w;
  }
};

// ---------------------------------------------------------------------------
// quantize_experts_online
// ---------------------------------------------------------------------------
GpuOnlineReport quantize_experts_online(DeviceExpertSource& src, DeviceLutbLayer& out, const GpuOnlineOptions& opt) {
  GpuOnlineReport rep;
  if (src.already_processed) return rep;  // idempotent
  const std::string who = kWho;
  GpuFitter fitter;
  try {
    fitter = gpu_fitter(opt.fitter);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(who + ": " + e.what());
  }
  if (src.dtype != DType::BF16 && src.dtype != DType::F16)
    throw std::invalid_argument(who + ": weight dtype " + std::string(dtype_name(src.dtype)) + " is not BF16 or F16");
  const std::int64_t E = src.experts, H = src.hidden, I = src.intermediate;
  if (E < 1 || H < 1 || I < 1)
    throw std::invalid_argument(who + ": experts, hidden and intermediate must be >= 1 (got " + std::to_string(E) +
                                ", " + std::to_string(H) + ", " + std::to_string(I) + ")");
  if (I % kTileRows != 0)
    throw std::invalid_argument(who + ": intermediate size " + std::to_string(I) +
                                " is not a multiple of 8 (the up rows of w13 must start on a tile row)");
  for (const auto* v : {&src.w13, &src.w2}) {
    const char* nm = v == &src.w13 ? "w13" : "w2";
    if (v->size() != 1 && v->size() != static_cast<std::size_t>(E))
      throw std::invalid_argument(who + ": " + nm + " has " + std::to_string(v->size()) +
                                  " pointers; expected 1 (stacked) or " + std::to_string(E) + " (one per expert)");
    for (std::size_t i = 0; i < v->size(); ++i)
      if (!(*v)[i]) throw std::invalid_argument(who + ": " + nm + " pointer " + std::to_string(i) + " is null");
  }
  if (opt.forced_scale >= 0 && (opt.forced_scale < 3 || opt.forced_scale > 246))
    throw std::invalid_argument(who + ": forced_scale " + std::to_string(opt.forced_scale) +
                                " is outside the scale bytes 3..246 fitters may choose (spec section 2)");

  const cudaStream_t st = opt.stream;
  const std::size_t esz = 2;
  const LutbShape s13 = stack_shape(E, 2 * I, H), s2 = stack_shape(E, H, I);
  const std::size_t expert_bytes = static_cast<std::size_t>(2 * I * H + H * I) * esz;
  const std::int64_t per_chunk =
      std::clamp<std::int64_t>(static_cast<std::int64_t>(opt.chunk_bytes / expert_bytes), 1, E);
  const std::int64_t tpe13 = s13.tiles_per_expert(), tpe2 = s2.tiles_per_expert();

  // Output: one allocation, six 256-aligned parts.
  const std::size_t t13 = static_cast<std::size_t>(s13.tiles()), t2 = static_cast<std::size_t>(s2.tiles());
  const std::size_t sizes[6] = {t13 * kPackedBytes, t13 * kCodebookSize, t13, t2 * kPackedBytes, t2 * kCodebookSize, t2};
  std::size_t off[6], total = 0;
  for (int i = 0; i < 6; ++i) {
    off[i] = total;
    total += align256(sizes[i]);
  }
  // Temporaries: the error word, and the per-tile sums of one chunk.
  const std::size_t chunk_tiles = static_cast<std::size_t>(per_chunk * std::max(tpe13, tpe2));
  const std::size_t temp = 256 + (opt.stats ? 2 * align256(chunk_tiles * sizeof(double)) : 0);

  void* mem = nullptr;
  void* tmp = nullptr;
  ok(cudaMalloc(&tmp, temp), "cudaMalloc (temporaries)");
  struct FreeTmp {
    void* p;
    ~FreeTmp() { cudaFree(p); }
  } free_tmp{tmp};
  auto* d_err = static_cast<unsigned long long*>(tmp);
  double* d_sse = opt.stats ? reinterpret_cast<double*>(static_cast<std::uint8_t*>(tmp) + 256) : nullptr;
  double* d_ssq = opt.stats ? d_sse + align256(chunk_tiles * sizeof(double)) / sizeof(double) : nullptr;

  FitStats st13, st2;
  st13.tiles = s13.tiles();
  st2.tiles = s2.tiles();
  Tensor tens[2] = {{"w13_weight", s13, &src.w13, nullptr, nullptr, nullptr, &st13},
                    {"w2_weight", s2, &src.w2, nullptr, nullptr, nullptr, &st2}};

  auto fetch_error = [&]() {
    unsigned long long word = ~0ull;
    ok(cudaMemcpyAsync(&word, d_err, sizeof(word), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync");
    ok(cudaStreamSynchronize(st), "check kernel");
    return decode_fit_error(word);
  };
  // Pass 1: check every tile; nothing is released, and the output not allocated, before it passes.
  // The lowest failing tile in (tensor, expert, tile) order: w13 of every expert first, as the
  // CPU method fits w13 before w2.
  for (Tensor& t : tens) {
    const std::int64_t tpe = t.shape.tiles_per_expert();
    auto check = [&](std::int64_t e, std::int64_t ne) {
      const LutbShape v = stack_shape(ne, t.shape.rows, t.shape.cols);
      check_tiles_device(t.expert_ptr(e, esz), src.dtype, v, d_err, st);
      const GpuFitError err = fetch_error();
      if (err.code != 0) {
        GpuFitError local = err;
        const std::int64_t ex = e + err.tile / tpe;
        local.tile = err.tile % tpe;
        throw std::invalid_argument(describe_error(t, ex, local, src.dtype, esz));
      }
    };
    if (t.ptrs->size() == 1) check(0, E);
    else
      for (std::int64_t e = 0; e < E; ++e) check(e, 1);
  }

  ok(cudaMalloc(&mem, total), "cudaMalloc (LUT-B output)");
  auto* base = static_cast<std::uint8_t*>(mem);
  tens[0].packed = base + off[0];
  tens[0].codebook = base + off[1];
  tens[0].scale = base + off[2];
  tens[1].packed = base + off[3];
  tens[1].codebook = base + off[4];
  tens[1].scale = base + off[5];

  try {
    std::vector<double> h_sse(opt.stats ? chunk_tiles : 0), h_ssq(opt.stats ? chunk_tiles : 0);
    for (std::int64_t e0 = 0; e0 < E; e0 += per_chunk) {
      const std::int64_t e1 = std::min(E, e0 + per_chunk);
      for (Tensor& t : tens) {
        const std::int64_t tpe = t.shape.tiles_per_expert();
        const std::int64_t n_tiles = (e1 - e0) * tpe;
        auto fit = [&](std::int64_t e, std::int64_t ne) {
          const LutbShape v = stack_shape(ne, t.shape.rows, t.shape.cols);
          const std::int64_t t0 = e * tpe, lt0 = (e - e0) * tpe;
          DeviceFitOut o{t.packed + t0 * kPackedBytes, t.codebook + t0 * kCodebookSize, t.scale + t0,
                         d_sse ? d_sse + lt0 : nullptr, d_ssq ? d_ssq + lt0 : nullptr};
          fit_device(t.expert_ptr(e, esz), src.dtype, v, o, fitter, opt.forced_scale, d_err, st, GpuFitKernel::Warp);
          const GpuFitError err = fetch_error();  // (checked in pass 1; a CUDA failure shows here)
          if (err.code != 0) throw std::runtime_error(who + ": tile error after the check pass");
        };
        if (t.ptrs->size() == 1) fit(e0, e1 - e0);
        else
          for (std::int64_t e = e0; e < e1; ++e) fit(e, 1);
        if (opt.lane_major) packed_to_lane_major(t.packed + e0 * tpe * kPackedBytes, n_tiles, st);
        if (opt.stats) {  // summed in tile order, as lutb::quantize
          ok(cudaMemcpyAsync(h_sse.data(), d_sse, static_cast<std::size_t>(n_tiles) * 8, cudaMemcpyDeviceToHost, st),
             "cudaMemcpyAsync sse");
          ok(cudaMemcpyAsync(h_ssq.data(), d_ssq, static_cast<std::size_t>(n_tiles) * 8, cudaMemcpyDeviceToHost, st),
             "cudaMemcpyAsync sum_sq");
          ok(cudaStreamSynchronize(st), "fit kernel");
          for (std::int64_t i = 0; i < n_tiles; ++i) {
            t.stats->sse += h_sse[static_cast<std::size_t>(i)];
            t.stats->sum_sq += h_ssq[static_cast<std::size_t>(i)];
          }
        }
      }
      ok(cudaStreamSynchronize(st), "fit kernel");  // the chunk's source is no longer read
      if (src.release) src.release(e0, e1);
      ++rep.chunks;
    }
  } catch (...) {
    cudaFree(mem);
    throw;
  }

  DeviceMoeWeights w;
  w.experts = E;
  w.hidden = H;
  w.intermediate = I;
  w.w13 = DeviceLutb{s13, tens[0].packed, tens[0].codebook, tens[0].scale, opt.lane_major};
  w.w2 = DeviceLutb{s2, tens[1].packed, tens[1].codebook, tens[1].scale, opt.lane_major};
  OnlineAccess::set(out, mem, total, w);

  src.w13.clear();
  src.w13.shrink_to_fit();
  src.w2.clear();
  src.w2.shrink_to_fit();
  src.already_processed = true;

  int dev = 0;
  cudaDeviceProp prop{};
  std::string devname = "a CUDA device";
  if (cudaGetDevice(&dev) == cudaSuccess && cudaGetDeviceProperties(&prop, dev) == cudaSuccess)
    devname = std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")";
  log_once(opt, "LUT-B MoE on " + devname +
                    ": weights quantised on the GPU (" + gpu_fitter_name(fitter) + ") and kept packed for the CUDA LUT-B kernels "
                    "(emulated Rubin numerics; no native sm_107 path: built without sm_107 support)");

  rep.w13 = opt.stats ? st13 : FitStats{};
  rep.w2 = opt.stats ? st2 : FitStats{};
  if (!opt.stats) {
    rep.w13.tiles = st13.tiles;
    rep.w2.tiles = st2.tiles;
  }
  rep.source_bytes = static_cast<std::size_t>(E) * expert_bytes;
  rep.quantized_bytes = total;
  rep.temp_bytes = temp;
  rep.experts_per_chunk = per_chunk;
  return rep;
}

}  // namespace lutb::cuda
