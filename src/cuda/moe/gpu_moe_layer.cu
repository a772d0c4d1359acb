// GpuMoeLayer (lutb/cuda/moe_layer.hpp): one layer's routed experts on the GPU behind a host interface.
// (Beside the forward in src/cuda/moe/; it needs src/moe's RouterConfig.)
#include <cuda_runtime.h>

#include <cstdio>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <filesystem>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "lutb/cuda/moe.hpp"
#include "lutb/cuda/moe_layer.hpp"

namespace lutb::cuda {

std::string gpu_unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error state of the runtime API
    std::string why = cudaGetErrorString(e);
    // The runtime says "CUDA driver version is insufficient for CUDA runtime version" both when the
    // driver is too old and when there is no NVIDIA driver at all (a machine without a GPU): tell the
    // two apart by the kernel module's proc file, which every loaded NVIDIA driver provides.
    if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice) {
      std::error_code ec;
      if (!std::filesystem::exists("/proc/driver/nvidia/version", ec))
        why = "no NVIDIA driver is loaded on this machine: /proc/driver/nvidia/version is missing; CUDA says: " + why;
      else if (e == cudaErrorInsufficientDriver)
        why += ": the loaded NVIDIA driver is older than the CUDA runtime lutb was built with";
    }
    return "no usable CUDA GPU (" + why + ")";
  }
  if (n == 0) return "no usable CUDA GPU (no device)";
  return "";
}

std::string gpu_description() {
  if (std::string why = gpu_unavailable_reason(); !why.empty()) throw std::runtime_error(why);
  int dev = 0;
  LUTB_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  LUTB_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  char gib[32];
  std::snprintf(gib, sizeof gib, "%.1f", static_cast<double>(p.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.multiProcessorCount) + " SMs, " + gib + " GiB)";
}

bool gpu_routing_supported(const moe::RouterConfig& rc, std::string* why) {
  auto no = [&](std::string s) {
    if (why) *why = std::move(s);
    return false;
  };
  if (rc.num_experts < 1 || rc.num_experts > 1024)
    return no("the GPU router takes 1..1024 experts, the layer has " + std::to_string(rc.num_experts));
  if (rc.top_k < 1 || rc.top_k > 32) return no("the GPU router takes top_k 1..32, the layer has " + std::to_string(rc.top_k));
  if (rc.scoring == moe::ScoringFunc::Softmax) {
    if (rc.n_group > 1 || rc.topk_group > 1) return no("softmax routing with expert groups has no GPU kernel");
    if (rc.routed_scaling_factor != 1.0f) return no("softmax routing with routed_scaling_factor != 1 has no GPU kernel");
    return true;
  }
  if (rc.n_group < 1 || rc.num_experts % rc.n_group != 0 || rc.num_experts / rc.n_group < 2)
    return no("DeepSeek grouped routing needs n_group dividing the experts with >= 2 experts per group");
  return true;
}

namespace {

using detail::check;

/// A device allocation (bytes), freed on destruction.
struct DevBuf {
  void* p = nullptr;
  std::size_t n = 0;
  DevBuf() = default;
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() { reset(); }
  void reset() {
    if (p) cudaFree(p);
    p = nullptr;
    n = 0;
  }
  /// Ensures at least `bytes` (contents not kept).
  void reserve(std::size_t bytes, const char* what) {
    if (bytes <= n && p) return;
    reset();
    check(cudaMalloc(&p, bytes ? bytes : 1), what);
    n = bytes;
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

void upload(DevBuf& d, const void* src, std::size_t bytes, const char* what, cudaStream_t s) {
  d.reserve(bytes, what);
  if (bytes) check(cudaMemcpyAsync(d.p, src, bytes, cudaMemcpyHostToDevice, s), what);
}

}  // namespace

struct GpuMoeLayer::Impl {
  std::int64_t E = 0, H = 0, I = 0;
  bool packed = true;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  // weights
  DevBuf p13, c13, s13, p2, c2, s2, b13, b2;
  DeviceMoeWeights w{};
  DeviceMoeWeightsBf16 wb{};
  // router
  bool have_router = false;
  moe::RouterConfig rc;
  DevBuf bias;
  // per call
  DevBuf x, logits, ids, tw, out, ws;
  std::int64_t last_T = 0;
  int last_k = 0;

  Impl() {
    if (std::string why = gpu_unavailable_reason(); !why.empty()) throw std::runtime_error("GpuMoeLayer: " + why);
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    check(cudaEventCreate(&ev0), "cudaEventCreate");
    check(cudaEventCreate(&ev1), "cudaEventCreate");
  }
  ~Impl() {
    if (stream) cudaStreamSynchronize(stream);
    if (ev0) cudaEventDestroy(ev0);
    if (ev1) cudaEventDestroy(ev1);
    if (stream) cudaStreamDestroy(stream);
  }

  void run_forward(std::int64_t T, int k) {
    const std::size_t wsb = moe_workspace_bytes(T, k, E, H, I);
    ws.reserve(wsb, "cudaMalloc (moe_forward workspace)");
    if (!packed) {
      moe_forward_bf16(wb, x.as<std::uint16_t>(), T, k, ids.as<std::int32_t>(), tw.as<float>(), out.as<std::uint16_t>(),
                       ws.p, ws.n, stream);
      return;
    }
    moe_forward(w, x.as<std::uint16_t>(), T, k, ids.as<std::int32_t>(), tw.as<float>(), out.as<std::uint16_t>(), ws.p,
                ws.n, stream);
  }

  void finish(std::int64_t T, int k, std::uint16_t* host_out) {
    run_forward(T, k);
    check(cudaMemcpyAsync(host_out, out.p, static_cast<std::size_t>(T * H) * 2, cudaMemcpyDeviceToHost, stream),
          "cudaMemcpy (output)");
    check(cudaStreamSynchronize(stream), "moe_forward");
    last_T = T;
    last_k = k;
  }

  void stage_x(const std::uint16_t* xh, std::int64_t T, int k) {
    if (T < 1) throw std::invalid_argument("GpuMoeLayer: tokens must be at least 1");
    upload(x, xh, static_cast<std::size_t>(T * H) * 2, "cudaMemcpy (x)", stream);
    out.reserve(static_cast<std::size_t>(T * H) * 2, "cudaMalloc (output)");
    ids.reserve(static_cast<std::size_t>(T * k) * 4, "cudaMalloc (top-k ids)");
    tw.reserve(static_cast<std::size_t>(T * k) * 4, "cudaMalloc (top-k weights)");
  }
};

GpuMoeLayer::GpuMoeLayer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuMoeLayer::GpuMoeLayer(GpuMoeLayer&&) noexcept = default;
GpuMoeLayer& GpuMoeLayer::operator=(GpuMoeLayer&&) noexcept = default;
GpuMoeLayer::~GpuMoeLayer() = default;

GpuMoeLayer GpuMoeLayer::lutb(const LutbTensor& w13, const LutbTensor& w2) {
  const std::int64_t E = w13.shape.experts, H = w13.shape.cols, I = w13.shape.rows / 2;
  if (w13.shape.rows % 2 != 0 || I < 1 || H < 1 || E < 1)
    throw std::invalid_argument("GpuMoeLayer: w13 must have shape [E, 2I, H] with I >= 1");
  if (w2.shape.experts != E || w2.shape.rows != H || w2.shape.cols != I)
    throw std::invalid_argument("GpuMoeLayer: w2 has shape [" + std::to_string(w2.shape.experts) + ", " +
                                std::to_string(w2.shape.rows) + ", " + std::to_string(w2.shape.cols) + "], expected [" +
                                std::to_string(E) + ", " + std::to_string(H) + ", " + std::to_string(I) + "] (w13 [E, 2I, H])");
  if (I % 8 != 0)
    throw std::invalid_argument("GpuMoeLayer: moe_intermediate_size " + std::to_string(I) +
                                " is not a multiple of 8 (the fused GPU forward needs the up rows on a tile boundary)");
  for (const LutbTensor* t : {&w13, &w2})
    check_sizes(t->shape, t->packed.size(), t->codebook.size(), t->scale.size(), t == &w13 ? "w13" : "w2");
  auto m = std::make_unique<Impl>();
  m->E = E;
  m->H = H;
  m->I = I;
  m->packed = true;
  upload(m->p13, w13.packed.data(), w13.packed.size(), "cudaMemcpy (w13 packed)", m->stream);
  upload(m->c13, w13.codebook.data(), w13.codebook.size(), "cudaMemcpy (w13 codebook)", m->stream);
  upload(m->s13, w13.scale.data(), w13.scale.size(), "cudaMemcpy (w13 scale)", m->stream);
  upload(m->p2, w2.packed.data(), w2.packed.size(), "cudaMemcpy (w2 packed)", m->stream);
  upload(m->c2, w2.codebook.data(), w2.codebook.size(), "cudaMemcpy (w2 codebook)", m->stream);
  upload(m->s2, w2.scale.data(), w2.scale.size(), "cudaMemcpy (w2 scale)", m->stream);
  m->w.experts = E;
  m->w.hidden = H;
  m->w.intermediate = I;
  m->w.w13 = DeviceLutb{w13.shape, m->p13.as<std::uint8_t>(), m->c13.as<std::uint8_t>(), m->s13.as<std::uint8_t>(), false};
  m->w.w2 = DeviceLutb{w2.shape, m->p2.as<std::uint8_t>(), m->c2.as<std::uint8_t>(), m->s2.as<std::uint8_t>(), false};
  to_lane_major(m->w.w13, m->stream);
  to_lane_major(m->w.w2, m->stream);
  check(cudaStreamSynchronize(m->stream), "upload of the LUT-B experts");
  return GpuMoeLayer(std::move(m));
}

GpuMoeLayer GpuMoeLayer::bf16(const std::vector<std::uint16_t>& w13, const std::vector<std::uint16_t>& w2,
                              std::int64_t E, std::int64_t H, std::int64_t I) {
  if (E < 1 || H < 1 || I < 1) throw std::invalid_argument("GpuMoeLayer: experts, hidden and intermediate must be >= 1");
  if (H % 64 != 0 || I % 64 != 0)
    throw std::invalid_argument("the GPU BF16 baseline (moe_forward_bf16) needs hidden_size and moe_intermediate_size "
                                "multiples of 64; this layer has hidden_size " + std::to_string(H) +
                                " and moe_intermediate_size " + std::to_string(I));
  if (static_cast<std::int64_t>(w13.size()) != E * 2 * I * H || static_cast<std::int64_t>(w2.size()) != E * H * I)
    throw std::invalid_argument("GpuMoeLayer: BF16 w13 / w2 have " + std::to_string(w13.size()) + " / " +
                                std::to_string(w2.size()) + " elements, expected E*2I*H = " + std::to_string(E * 2 * I * H) +
                                " / E*H*I = " + std::to_string(E * H * I));
  auto m = std::make_unique<Impl>();
  m->E = E;
  m->H = H;
  m->I = I;
  m->packed = false;
  upload(m->b13, w13.data(), w13.size() * 2, "cudaMemcpy (w13 BF16)", m->stream);
  upload(m->b2, w2.data(), w2.size() * 2, "cudaMemcpy (w2 BF16)", m->stream);
  m->wb = DeviceMoeWeightsBf16{E, H, I, m->b13.as<std::uint16_t>(), m->b2.as<std::uint16_t>()};
  check(cudaStreamSynchronize(m->stream), "upload of the BF16 experts");
  return GpuMoeLayer(std::move(m));
}

std::int64_t GpuMoeLayer::experts() const { return impl_->E; }
std::int64_t GpuMoeLayer::hidden() const { return impl_->H; }
std::int64_t GpuMoeLayer::intermediate() const { return impl_->I; }
bool GpuMoeLayer::packed() const { return impl_->packed; }

std::size_t GpuMoeLayer::device_bytes() const {
  const Impl& m = *impl_;
  std::size_t b = 0;
  for (const DevBuf* d : {&m.p13, &m.c13, &m.s13, &m.p2, &m.c2, &m.s2, &m.b13, &m.b2, &m.bias, &m.x, &m.logits, &m.ids,
                          &m.tw, &m.out, &m.ws})
    b += d->n;
  return b;
}

void GpuMoeLayer::set_router(const moe::RouterConfig& rc, const float* correction_bias) {
  Impl& m = *impl_;
  rc.validate();
  std::string why;
  if (!gpu_routing_supported(rc, &why)) throw std::invalid_argument("GpuMoeLayer: " + why);
  if (rc.num_experts != m.E)
    throw std::invalid_argument("GpuMoeLayer: the router has " + std::to_string(rc.num_experts) + " experts, the layer " +
                                std::to_string(m.E));
  m.rc = rc;
  m.bias.reset();
  if (rc.scoring == moe::ScoringFunc::Sigmoid && correction_bias)
    upload(m.bias, correction_bias, static_cast<std::size_t>(m.E) * 4, "cudaMemcpy (correction bias)", m.stream);
  m.have_router = true;
}

void GpuMoeLayer::forward(const float* logits, const std::uint16_t* x, std::int64_t T, std::uint16_t* out,
                          std::int32_t* ids_out, float* weights_out) {
  Impl& m = *impl_;
  if (!m.have_router) throw std::logic_error("GpuMoeLayer::forward: set_router was not called");
  const int k = m.rc.top_k;
  m.stage_x(x, T, k);
  upload(m.logits, logits, static_cast<std::size_t>(T * m.E) * 4, "cudaMemcpy (router logits)", m.stream);
  if (m.rc.scoring == moe::ScoringFunc::Softmax)
    route_softmax_topk(m.logits.as<float>(), T, static_cast<int>(m.E), k, m.rc.norm_topk_prob, m.ids.as<std::int32_t>(),
                       m.tw.as<float>(), m.stream);
  else
    route_deepseek(m.logits.as<float>(), m.bias.p ? m.bias.as<float>() : nullptr, T, static_cast<int>(m.E), m.rc.n_group,
                   m.rc.topk_group, k, m.rc.norm_topk_prob, m.rc.routed_scaling_factor, m.ids.as<std::int32_t>(),
                   m.tw.as<float>(), m.stream);
  if (ids_out)
    check(cudaMemcpyAsync(ids_out, m.ids.p, static_cast<std::size_t>(T * k) * 4, cudaMemcpyDeviceToHost, m.stream),
          "cudaMemcpy (top-k ids)");
  if (weights_out)
    check(cudaMemcpyAsync(weights_out, m.tw.p, static_cast<std::size_t>(T * k) * 4, cudaMemcpyDeviceToHost, m.stream),
          "cudaMemcpy (top-k weights)");
  m.finish(T, k, out);
}

void GpuMoeLayer::forward_routed(const std::uint16_t* x, std::int64_t T, int k, const std::int32_t* ids,
                                 const float* weights, std::uint16_t* out) {
  Impl& m = *impl_;
  if (k < 1) throw std::invalid_argument("GpuMoeLayer::forward_routed: top_k must be at least 1");
  m.stage_x(x, T, k);
  upload(m.ids, ids, static_cast<std::size_t>(T * k) * 4, "cudaMemcpy (top-k ids)", m.stream);
  upload(m.tw, weights, static_cast<std::size_t>(T * k) * 4, "cudaMemcpy (top-k weights)", m.stream);
  m.finish(T, k, out);
}

double GpuMoeLayer::time_last_forward_ms(int reps) {
  Impl& m = *impl_;
  if (m.last_T < 1) throw std::logic_error("GpuMoeLayer::time_last_forward_ms: no forward has run yet");
  if (reps < 1) throw std::invalid_argument("GpuMoeLayer::time_last_forward_ms: reps must be at least 1");
  m.run_forward(m.last_T, m.last_k);  // warm-up
  std::vector<float> ms(static_cast<std::size_t>(reps));
  for (int r = 0; r < reps; ++r) {
    check(cudaEventRecord(m.ev0, m.stream), "cudaEventRecord");
    m.run_forward(m.last_T, m.last_k);
    check(cudaEventRecord(m.ev1, m.stream), "cudaEventRecord");
    check(cudaEventSynchronize(m.ev1), "moe_forward (timed)");
    check(cudaEventElapsedTime(&ms[static_cast<std::size_t>(r)], m.ev0, m.ev1), "cudaEventElapsedTime");
  }
  std::nth_element(ms.begin(), ms.begin() + reps / 2, ms.end());
  return ms[static_cast<std::size_t>(reps / 2)];
}

}  // namespace lutb::cuda
