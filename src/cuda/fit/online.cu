// src/cuda/fit/online.cu: the online LUT-B method on the GPU (lutb/cuda/online.hpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/fit/fit_internal.cuh"
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

// "NVIDIA H200 (sm_90)" for the selection message, asked once per device and process:
// cudaGetDeviceProperties takes milliseconds (it fills every field).
std::string device_name() {
  static std::mutex mu;
  static std::vector<std::string> names;  // by device ordinal
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) return "a CUDA device";
  std::lock_guard<std::mutex> lock(mu);
  if (names.size() <= static_cast<std::size_t>(dev)) names.resize(static_cast<std::size_t>(dev) + 1);
  std::string& n = names[static_cast<std::size_t>(dev)];
  if (n.empty()) {
    cudaDeviceProp prop{};
    n = cudaGetDeviceProperties(&prop, dev) == cudaSuccess
            ? std::string(prop.name) + " (sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")"
            : "a CUDA device";
  }
  return n;
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
  const float* cw;  // device column weights [E][cols], or null (unweighted)
  // Device pointer to experts [e0, e0 + n) when contiguous (stacked source, or n == 1).
  const void* expert_ptr(std::int64_t e, std::size_t esz) const {
    if (ptrs->size() == 1)
      return static_cast<const std::uint8_t*>((*ptrs)[0]) + static_cast<std::size_t>(e * shape.rows * shape.cols) * esz;
    return (*ptrs)[static_cast<std::size_t>(e)];
  }
  // The column weights from expert e on (null when unweighted).
  const float* weights_from(std::int64_t e) const { return cw ? cw + e * shape.cols : nullptr; }
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
namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The method's state once the arguments are checked.
struct Job {
  DeviceExpertSource& src;
  const GpuOnlineOptions& opt;
  GpuFitter fitter;
  std::int64_t E, per_chunk;
  std::size_t esz;
  Tensor tens[2];
  std::size_t off[6], total;
  std::size_t chunk_tiles;  // per-tile sums of the larger tensor in one chunk
  GpuOnlineReport& rep;
  void* mem = nullptr;  // the output allocation (owned by the caller's guard once set)
};

void point_outputs(Job& j) {
  auto* base = static_cast<std::uint8_t*>(j.mem);
  j.tens[0].packed = base + j.off[0];
  j.tens[0].codebook = base + j.off[1];
  j.tens[0].scale = base + j.off[2];
  j.tens[1].packed = base + j.off[3];
  j.tens[1].codebook = base + j.off[4];
  j.tens[1].scale = base + j.off[5];
}

void throw_check_error(const Job& j, const Tensor& t, std::int64_t e0, const GpuFitError& err) {
  const std::int64_t tpe = t.shape.tiles_per_expert();
  GpuFitError local = err;
  const std::int64_t ex = e0 + err.tile / tpe;
  local.tile = err.tile % tpe;
  throw std::invalid_argument(describe_error(t, ex, local, j.src.dtype, j.esz));
}

// The temporaries and the second stream of run(), released after the work queued on them (also
// after an exception: the queued fits are then done with the memory first).
struct RunResources {
  void* p = nullptr;
  cudaStream_t cs = nullptr;
  cudaEvent_t ev[2] = {nullptr, nullptr};
  cudaEvent_t evc = nullptr;  // the check pass queued
  cudaStream_t main = nullptr;
  ~RunResources() {
    if (!p) return;  // the temporaries' allocation failed: nothing was queued or created
    cudaStreamSynchronize(main);  // (after an exception: the queued fits are done with the memory)
    if (cs) cudaStreamSynchronize(cs);
    for (cudaEvent_t e : {ev[0], ev[1], evc})
      if (e) cudaEventDestroy(e);
    if (cs) cudaStreamDestroy(cs);
    cudaFree(p);  // (synchronises with work still in flight after an exception)
  }
};

// run()'s state shared by its steps. h_sums is declared after res: it is freed before res waits
// for the streams, as the method's locals were.
struct RunState {
  Job& j;
  RunResources res;
  unsigned long long* d_err = nullptr;                              // [0] w13 check, [1] w2 check, [2] fits
  double* d_sums[2][2] = {{nullptr, nullptr}, {nullptr, nullptr}};  // [buffer][sse, sum_sq]
  std::unique_ptr<double[]> h_sums[2][2];  // allocated once the first fit is queued (run)
};

// The kernel arguments of experts [e, e + ne) of tensor t; t_base: their first tile's index in the stack.
fit_internal::KernelArgs kernel_view(const Job& j, const Tensor& t, std::int64_t e, std::int64_t ne,
                                     std::int64_t t_base) {
  fit_internal::KernelArgs a{};
  a.src = t.expert_ptr(e, j.esz);
  a.dtype = j.src.dtype == DType::BF16 ? 1 : 2;  // fit_internal::KernelArgs::dtype
  a.rows = t.shape.rows;
  a.cols = t.shape.cols;
  a.tiles_n = t.shape.tiles_n();
  a.tiles_k = t.shape.tiles_k();
  a.tiles = ne * t.shape.tiles_per_expert();
  a.t_base = t_base;
  a.forced_scale = j.opt.forced_scale;
  a.optimal = j.fitter == GpuFitter::Optimal;
  return a;
}

// Temporaries: 3 error words (check pass w13, w2; the fits), then 2 x (sse, sum_sq) of one chunk;
// the second stream and the events.
void allocate_temporaries(RunState& s) {
  const GpuOnlineOptions& opt = s.j.opt;
  const auto t0 = Clock::now();
  const std::size_t sums_bytes = align256(s.j.chunk_tiles * sizeof(double));
  const std::size_t temp = 256 + (opt.stats ? 4 * sums_bytes : 0);
  void* tmp = nullptr;
  ok(cudaMalloc(&tmp, temp), "cudaMalloc (temporaries)");
  s.res.p = tmp;
  s.res.main = opt.stream;
  // Non-blocking: no implicit ordering with the legacy default stream, which opt.stream may be.
  ok(cudaStreamCreateWithFlags(&s.res.cs, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  for (cudaEvent_t* e : {&s.res.ev[0], &s.res.ev[1], &s.res.evc})
    ok(cudaEventCreateWithFlags(e, cudaEventDisableTiming), "cudaEventCreate");
  s.j.rep.temp_bytes = temp;
  s.j.rep.seconds.alloc += since(t0);
  s.d_err = static_cast<unsigned long long*>(tmp);
  if (opt.stats)
    for (int b = 0; b < 2; ++b)
      for (int q = 0; q < 2; ++q)
        s.d_sums[b][q] = reinterpret_cast<double*>(static_cast<std::uint8_t*>(tmp) + 256 + (2 * b + q) * sums_bytes);
}

// Pass 1 queued: every tile of both tensors checked by the memory-bound check kernel, all launches
// at once, then the event evc. Then the output allocated (timed as allocation, not as the check).
void queue_check_pass(RunState& s) {
  Job& j = s.j;
  const cudaStream_t st = j.opt.stream;
  const std::int64_t E = j.E;
  ok(cudaMemsetAsync(s.d_err, 0xff, 3 * sizeof(unsigned long long), st), "cudaMemsetAsync");
  for (int ti = 0; ti < 2; ++ti) {
    const Tensor& t = j.tens[ti];
    const std::int64_t tpe = t.shape.tiles_per_expert();
    const std::int64_t parts = t.ptrs->size() == 1 ? 1 : E, per = t.ptrs->size() == 1 ? E : 1;
    for (std::int64_t p = 0; p < parts; ++p) {
      fit_internal::KernelArgs a = kernel_view(j, t, p * per, per, p * per * tpe);  // t_base: tile index in the stack
      a.err = s.d_err + ti;
      fit_internal::launch_check_tiles(a, st);  // (the column weights are checked on the host)
    }
  }
  ok(cudaEventRecord(s.res.evc, st), "cudaEventRecord");
  {
    const auto a0 = Clock::now();
    ok(cudaMalloc(&j.mem, j.total), "cudaMalloc (LUT-B output)");
    const double da = since(a0);
    j.rep.seconds.alloc += da;
    j.rep.seconds.check -= da;
  }
  point_outputs(j);
}

// Experts [e0, e1) of work item i (chunk i / 2).
void item_range(const Job& j, std::int64_t i, std::int64_t& e0, std::int64_t& e1) {
  e0 = (i / 2) * j.per_chunk;
  e1 = std::min(j.E, e0 + j.per_chunk);
}

// Item i queued on the main stream: its fits (into the output and the sums buffer i % 2), the
// event ev[i % 2], then its lane-major permutation.
void enqueue_item(RunState& s, std::int64_t i) {
  const Job& j = s.j;
  const GpuOnlineOptions& opt = j.opt;
  const cudaStream_t st = opt.stream;
  std::int64_t e0, e1;
  item_range(j, i, e0, e1);
  const Tensor& t = j.tens[i % 2];
  const int b = static_cast<int>(i % 2);
  const std::int64_t tpe = t.shape.tiles_per_expert();
  auto fit = [&](std::int64_t e, std::int64_t ne) {
    fit_internal::KernelArgs a = kernel_view(j, t, e, ne, e * tpe);
    const std::int64_t t0i = e * tpe, lt0 = (e - e0) * tpe;
    a.out = DeviceFitOut{t.packed + t0i * kPackedBytes, t.codebook + t0i * kCodebookSize, t.scale + t0i,
                         opt.stats ? s.d_sums[b][0] + lt0 : nullptr, opt.stats ? s.d_sums[b][1] + lt0 : nullptr};
    a.err = s.d_err + 2;
    fit_internal::launch_fit(a, st, t.weights_from(e));
  };
  if (t.ptrs->size() == 1) fit(e0, e1 - e0);
  else
    for (std::int64_t e = e0; e < e1; ++e) fit(e, 1);
  ok(cudaEventRecord(s.res.ev[b], st), "cudaEventRecord");  // the item's source is read, its sums written
  if (opt.lane_major) packed_to_lane_major(t.packed + e0 * tpe * kPackedBytes, (e1 - e0) * tpe, st);
}

// The check pass's error words read on the second stream (after evc); throws on a failing tile
// (the lowest of w13, else of w2: the CPU method fits w13 first).
void read_check_words(RunState& s) {
  unsigned long long words[2] = {~0ull, ~0ull};
  ok(cudaStreamWaitEvent(s.res.cs, s.res.evc, 0), "cudaStreamWaitEvent");
  const auto w0 = Clock::now();
  ok(cudaMemcpyAsync(words, s.d_err, sizeof(words), cudaMemcpyDeviceToHost, s.res.cs), "cudaMemcpyAsync");
  ok(cudaStreamSynchronize(s.res.cs), "check kernel");
  s.j.rep.seconds.wait += since(w0);
  for (int ti = 0; ti < 2; ++ti) {
    const GpuFitError err = decode_fit_error(words[ti]);
    if (err.code != 0) throw_check_error(s.j, s.j.tens[ti], 0, err);
  }
}

// Item i finished on the second stream (after ev[i % 2]): its per-tile sums and the fits' error
// word copied back (blocking), the sums added in tile order, and after a chunk's w2 item the
// chunk's source released.
void finish_item(RunState& s, std::int64_t i) {
  Job& j = s.j;
  const GpuOnlineOptions& opt = j.opt;
  GpuOnlineReport::Seconds& sec = j.rep.seconds;
  std::int64_t e0, e1;
  item_range(j, i, e0, e1);
  Tensor& t = j.tens[i % 2];
  const int b = static_cast<int>(i % 2);
  const std::size_t n_tiles = static_cast<std::size_t>((e1 - e0) * t.shape.tiles_per_expert());
  ok(cudaStreamWaitEvent(s.res.cs, s.res.ev[b], 0), "cudaStreamWaitEvent");
  unsigned long long word = ~0ull;
  const auto w0 = Clock::now();
  if (opt.stats)
    for (int q = 0; q < 2; ++q)
      ok(cudaMemcpyAsync(s.h_sums[b][q].get(), s.d_sums[b][q], n_tiles * 8, cudaMemcpyDeviceToHost, s.res.cs),
         "cudaMemcpyAsync (per-tile sums)");
  ok(cudaMemcpyAsync(&word, s.d_err + 2, sizeof(word), cudaMemcpyDeviceToHost, s.res.cs), "cudaMemcpyAsync");
  ok(cudaStreamSynchronize(s.res.cs), "fit kernel");
  sec.wait += since(w0);
  if (decode_fit_error(word).code != 0) throw std::runtime_error(std::string(kWho) + ": tile error after the check pass");
  if (opt.stats) {  // summed in tile order, as lutb::quantize
    const auto s0 = Clock::now();
    const double* hs = s.h_sums[b][0].get();
    const double* hq = s.h_sums[b][1].get();
    double sse = t.stats->sse, ssq = t.stats->sum_sq;
    for (std::size_t k = 0; k < n_tiles; ++k) {
      sse += hs[k];
      ssq += hq[k];
    }
    t.stats->sse = sse;
    t.stats->sum_sq = ssq;
    sec.sums += since(s0);
  }
  if (i % 2 == 1) {  // both tensors of the chunk fitted: its source is no longer read
    const auto r0 = Clock::now();
    if (j.src.release) j.src.release(e0, e1);
    sec.release += since(r0);
    ++j.rep.chunks;
  }
}

// The method. The check pass on the check kernel (below). Work items i = 2 * chunk + tensor (w13,
// then w2).
// Main stream (opt.stream): the fits of item i (warp kernel, straight into the output and into the
// per-tile sums buffer i % 2), an event, then the lane-major permutation of item i. The host:
// enqueue item i + 1, then finish item i on a second stream that waits for item i's event: copy its
// per-tile sums (and the fits' error word) to the host -- a blocking copy, so the host waits here
// while item i + 1 already runs on the device -- add them in tile order, and after a chunk's w2 item
// call release(e0, e1). Item i + 2, which reuses buffer i % 2, is enqueued only after that copy has
// completed. So the device is kept busy with the next fit while the host adds and releases, there is
// no host synchronisation between two fits, and the temporaries are two buffers of one chunk's sums.
void run(Job& j) {
  const GpuOnlineOptions& opt = j.opt;
  GpuOnlineReport::Seconds& sec = j.rep.seconds;
  RunState s{j};
  allocate_temporaries(s);

  // Pass 1: the lowest failing tile of w13, else of w2. While the device checks, the host allocates
  // the output and queues the first item's fit behind the check (same stream), then reads the
  // check's words on the second stream, so that the device does not wait for the host between the
  // check and the first fit. On a failing tile nothing has been released, `out` is untouched, and
  // the output is freed again (the first fit, if it ran, wrote only there and into the temporaries).
  auto t0 = Clock::now();
  queue_check_pass(s);
  const std::int64_t chunks = (j.E + j.per_chunk - 1) / j.per_chunk, items = 2 * chunks;
  const auto loop0 = Clock::now();
  enqueue_item(s, 0);
  // The host buffers of the per-tile sums, uninitialised (the copies write them), allocated while
  // the device checks and fits: allocated and zeroed before the first fit is queued, they would
  // leave the device idle meanwhile.
  if (opt.stats)
    for (auto& b : s.h_sums)
      for (auto& v : b) v.reset(new double[j.chunk_tiles]);
  read_check_words(s);
  sec.check += since(t0);
  t0 = loop0;
  for (std::int64_t i = 0; i < items; ++i) {
    if (i + 1 < items) enqueue_item(s, i + 1);
    finish_item(s, i);
  }
  const auto w0 = Clock::now();
  ok(cudaStreamSynchronize(opt.stream), "lane-major kernel");  // the last item's permutation
  sec.wait += since(w0);
  sec.loop += since(t0);
}

}  // namespace

GpuOnlineReport quantize_experts_online(DeviceExpertSource& src, DeviceLutbLayer& out, const GpuOnlineOptions& opt) {
  GpuOnlineReport rep;
  if (src.already_processed) return rep;  // idempotent
  const auto call0 = Clock::now();
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
  // The column weights, read back once and checked as lutb::quantize checks them, before the tiles
  // (its words: "tensor w13_weight, expert e: column weight C is X; ...").
  for (int ti = 0; ti < 2; ++ti) {
    const float* cw = ti == 0 ? opt.w13_column_weights : opt.w2_column_weights;
    if (!cw) continue;
    const std::int64_t cols = ti == 0 ? H : I;
    std::vector<float> h(static_cast<std::size_t>(E * cols));
    ok(cudaMemcpyAsync(h.data(), cw, h.size() * sizeof(float), cudaMemcpyDeviceToHost, opt.stream),
       "cudaMemcpyAsync (column weights)");
    ok(cudaStreamSynchronize(opt.stream), "cudaStreamSynchronize (column weights)");
    for (std::int64_t e = 0; e < E; ++e)
      if (const std::string msg = column_weights_error(h.data() + e * cols, cols); !msg.empty())
        throw std::invalid_argument(who + ": tensor " + (ti == 0 ? "w13_weight" : "w2_weight") + ", expert " +
                                    std::to_string(e) + ": " + msg);
  }

  const std::size_t esz = 2;
  const LutbShape s13 = stack_shape(E, 2 * I, H), s2 = stack_shape(E, H, I);
  const std::size_t expert_bytes = static_cast<std::size_t>(2 * I * H + H * I) * esz;
  const std::int64_t per_chunk =
      std::clamp<std::int64_t>(static_cast<std::int64_t>(opt.chunk_bytes / expert_bytes), 1, E);
  const std::int64_t tpe13 = s13.tiles_per_expert(), tpe2 = s2.tiles_per_expert();

  FitStats st13, st2;
  st13.tiles = s13.tiles();
  st2.tiles = s2.tiles();
  Job j{src, opt, fitter, E, per_chunk, esz,
        {{"w13_weight", s13, &src.w13, nullptr, nullptr, nullptr, &st13, opt.w13_column_weights},
         {"w2_weight", s2, &src.w2, nullptr, nullptr, nullptr, &st2, opt.w2_column_weights}},
        {}, 0, static_cast<std::size_t>(per_chunk * std::max(tpe13, tpe2)), rep};
  // Output: one allocation, six 256-aligned parts.
  const std::size_t t13 = static_cast<std::size_t>(s13.tiles()), t2 = static_cast<std::size_t>(s2.tiles());
  const std::size_t sizes[6] = {t13 * kPackedBytes, t13 * kCodebookSize, t13, t2 * kPackedBytes, t2 * kCodebookSize, t2};
  for (int i = 0; i < 6; ++i) {
    j.off[i] = j.total;
    j.total += align256(sizes[i]);
  }

  try {
    run(j);
  } catch (...) {
    if (j.mem) cudaFree(j.mem);
    throw;
  }

  DeviceMoeWeights w;
  w.experts = E;
  w.hidden = H;
  w.intermediate = I;
  w.w13 = DeviceLutb{s13, j.tens[0].packed, j.tens[0].codebook, j.tens[0].scale, opt.lane_major};
  w.w2 = DeviceLutb{s2, j.tens[1].packed, j.tens[1].codebook, j.tens[1].scale, opt.lane_major};
  OnlineAccess::set(out, j.mem, j.total, w);

  src.w13.clear();
  src.w13.shrink_to_fit();
  src.w2.clear();
  src.w2.shrink_to_fit();
  src.already_processed = true;

  const auto f0 = Clock::now();
  const std::string devname = device_name();
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
  rep.quantized_bytes = j.total;
  rep.experts_per_chunk = per_chunk;
  rep.seconds.finish = since(f0);
  rep.seconds.total = since(call0);
  return rep;
}

}  // namespace lutb::cuda
