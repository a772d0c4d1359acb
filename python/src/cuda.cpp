// The CUDA entry points of the extension (built when the library has lutb_cuda).
//
// Every function launches on the stream it is given (an int: torch.cuda.current_stream(dev).cuda_stream,
// passed by python/lutb/_ops.py), on the device of its arrays (set for the call and restored after), and
// neither allocates nor synchronises: outputs and workspaces come from the caller, so the launches
// can be captured in a CUDA graph.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "lutb/cuda/fit.hpp"
#include "lutb/cuda/moe.hpp"
#include "module.hpp"

namespace nb = nanobind;

namespace lutb::python {
namespace {

// Makes the arrays' device current for the scope of a call and restores the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(const Array& a) {
    if (a.device_type() != nb::device::cuda::value) throw std::invalid_argument("expected a CUDA array");
    check(cudaGetDevice(&previous_));
    if (previous_ != a.device_id()) check(cudaSetDevice(a.device_id()));
  }
  ~DeviceScope() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  static void check(cudaError_t e) {
    if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + cudaGetErrorString(e));
  }
  int previous_ = 0;
};

cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

void same_device(const Array& a, const Array& b, const char* what) {
  if (b.device_type() != nb::device::cuda::value || b.device_id() != a.device_id())
    throw std::invalid_argument(std::string(what) + ": not on the same CUDA device as the first argument");
}

// column_weights: None (the unweighted fit) or float32 [experts][cols] on the same device
// (FitOptions::column_weights); a tile whose weights break their rule fails with error code 5.
void quantize_cuda(const Array& src, const std::string& dtype, std::int64_t experts, std::int64_t rows,
                   std::int64_t cols, bool stacked, const std::string& fitter, int forced_scale,
                   const std::optional<Array>& column_weights, const Array& packed, const Array& codebook,
                   const Array& scale, const Array& error_word, std::uintptr_t stream) {
  DeviceScope scope(src);
  const DType t = source_dtype(dtype);
  const LutbShape s = make_shape(experts, rows, cols, stacked);
  const auto tiles = static_cast<std::size_t>(s.tiles());
  require(src, "w", static_cast<std::size_t>(experts * rows * cols) * dtype_size(t), true);
  if (column_weights) {
    if (column_weights->dtype() != nb::dtype<float>())
      throw std::invalid_argument("column_weights: expected float32");
    require(*column_weights, "column_weights", static_cast<std::size_t>(experts * cols) * sizeof(float), true);
    same_device(src, *column_weights, "column_weights");
  }
  require(packed, "packed", tiles * kPackedBytes, true);
  require(codebook, "codebook", tiles * kCodebookSize, true);
  require(scale, "scale", tiles, true);
  require(error_word, "error_word", sizeof(unsigned long long), true);
  for (const Array* a : {&packed, &codebook, &scale, &error_word}) same_device(src, *a, "output");
  cuda::DeviceFitOut out;
  out.packed = static_cast<std::uint8_t*>(packed.data());
  out.codebook = static_cast<std::uint8_t*>(codebook.data());
  out.scale = static_cast<std::uint8_t*>(scale.data());
  cuda::fit_device(src.data(), t, s, out, cuda::gpu_fitter(fitter), forced_scale,
                   static_cast<unsigned long long*>(error_word.data()), as_stream(stream),
                   column_weights ? static_cast<const float*>(column_weights->data()) : nullptr);
}

nb::tuple decode_fit_error(std::uint64_t word) {
  const cuda::GpuFitError e = cuda::decode_fit_error(word);
  return nb::make_tuple(e.code, e.tile, e.pos);
}

void packed_to_lane_major(const Array& packed, std::int64_t tiles, std::uintptr_t stream) {
  DeviceScope scope(packed);
  require(packed, "packed", static_cast<std::size_t>(tiles) * kPackedBytes, true);
  cuda::packed_to_lane_major(static_cast<std::uint8_t*>(packed.data()), tiles, as_stream(stream));
}

void route_softmax_topk_cuda(const Array& logits, std::int64_t tokens, int experts, int k, bool renormalize,
                             const Array& ids, const Array& weights, std::uintptr_t stream) {
  DeviceScope scope(logits);
  require(logits, "logits", static_cast<std::size_t>(tokens * experts) * sizeof(float), true);
  require(ids, "topk_ids", static_cast<std::size_t>(tokens * k) * sizeof(std::int32_t), true);
  require(weights, "topk_weights", static_cast<std::size_t>(tokens * k) * sizeof(float), true);
  same_device(logits, ids, "topk_ids");
  same_device(logits, weights, "topk_weights");
  if (tokens == 0) return;
  cuda::route_softmax_topk(static_cast<const float*>(logits.data()), tokens, experts, k, renormalize,
                           static_cast<std::int32_t*>(ids.data()), static_cast<float*>(weights.data()),
                           as_stream(stream));
}

void route_deepseek_cuda(const Array& logits, const std::optional<Array>& bias, std::int64_t tokens, int experts,
                         int n_group, int topk_group, int k, bool renormalize, float scaling, const Array& ids,
                         const Array& weights, std::uintptr_t stream) {
  DeviceScope scope(logits);
  require(logits, "logits", static_cast<std::size_t>(tokens * experts) * sizeof(float), true);
  if (bias) {
    require(*bias, "correction_bias", static_cast<std::size_t>(experts) * sizeof(float), true);
    same_device(logits, *bias, "correction_bias");
  }
  require(ids, "topk_ids", static_cast<std::size_t>(tokens * k) * sizeof(std::int32_t), true);
  require(weights, "topk_weights", static_cast<std::size_t>(tokens * k) * sizeof(float), true);
  same_device(logits, ids, "topk_ids");
  same_device(logits, weights, "topk_weights");
  if (tokens == 0) return;
  cuda::route_deepseek(static_cast<const float*>(logits.data()), bias ? static_cast<const float*>(bias->data()) : nullptr,
                       tokens, experts, n_group, topk_group, k, renormalize, scaling,
                       static_cast<std::int32_t*>(ids.data()), static_cast<float*>(weights.data()), as_stream(stream));
}

void moe_experts_cuda(const Array& x, std::int64_t tokens, std::int64_t hidden, const Array& topk_ids,
                      const Array& topk_weights, int k, std::int64_t experts, std::int64_t intermediate,
                      const Array& w13_packed, const Array& w13_codebook, const Array& w13_scale,
                      const Array& w2_packed, const Array& w2_codebook, const Array& w2_scale, const Array& out,
                      bool out_f32, const Array& workspace, std::uintptr_t stream) {
  DeviceScope scope(x);
  if (experts < 1 || hidden < 1 || intermediate < 1 || k < 1 || tokens < 0)
    throw std::invalid_argument("moe_experts: invalid sizes");
  if (intermediate % 8 != 0)
    throw std::invalid_argument("w13: the CUDA kernels need the intermediate size I = " + std::to_string(intermediate) +
                                " to be a multiple of 8 (the up rows start on a tile boundary)");
  cuda::DeviceMoeWeights w;
  w.experts = experts;
  w.hidden = hidden;
  w.intermediate = intermediate;
  auto fill = [&](cuda::DeviceLutb& d, const LutbShape& s, const Array& p, const Array& c, const Array& sc,
                  const char* name) {
    const auto tiles = static_cast<std::size_t>(s.tiles());
    require(p, (std::string(name) + ".packed").c_str(), tiles * kPackedBytes, true);
    require(c, (std::string(name) + ".codebook").c_str(), tiles * kCodebookSize, true);
    require(sc, (std::string(name) + ".scale").c_str(), tiles, true);
    for (const Array* a : {&p, &c, &sc}) same_device(x, *a, name);
    d.shape = s;
    d.packed = static_cast<const std::uint8_t*>(p.data());
    d.codebook = static_cast<const std::uint8_t*>(c.data());
    d.scale = static_cast<const std::uint8_t*>(sc.data());
    d.lane_major = true;
  };
  fill(w.w13, make_shape(experts, 2 * intermediate, hidden, true), w13_packed, w13_codebook, w13_scale, "w13");
  fill(w.w2, make_shape(experts, hidden, intermediate, true), w2_packed, w2_codebook, w2_scale, "w2");
  require(x, "x", static_cast<std::size_t>(tokens * hidden) * 2, true);
  require(topk_ids, "topk_ids", static_cast<std::size_t>(tokens * k) * sizeof(std::int32_t), true);
  require(topk_weights, "topk_weights", static_cast<std::size_t>(tokens * k) * sizeof(float), true);
  require(out, "out", static_cast<std::size_t>(tokens * hidden) * (out_f32 ? 4 : 2), true);
  const std::size_t need = cuda::moe_workspace_bytes(tokens, k, experts, hidden, intermediate);
  if (workspace.nbytes() < need)
    throw std::invalid_argument("workspace: has " + std::to_string(workspace.nbytes()) + " bytes, needs " +
                                std::to_string(need));
  for (const Array* a : {&topk_ids, &topk_weights, &out, &workspace}) same_device(x, *a, "argument");
  if (tokens == 0) return;
  cuda::moe_forward(w, static_cast<const std::uint16_t*>(x.data()), tokens, k,
                    static_cast<const std::int32_t*>(topk_ids.data()), static_cast<const float*>(topk_weights.data()),
                    out_f32 ? nullptr : static_cast<std::uint16_t*>(out.data()), workspace.data(), workspace.nbytes(),
                    as_stream(stream), cuda::MoeOptions{}, out_f32 ? static_cast<float*>(out.data()) : nullptr);
}

// The BF16 pipeline (spec 4 without the MXFP8 steps) on BF16 weights: w13 [E, 2I, H] and w2 [E, H, I]
// row-major BF16 (the caller dequantises LUT-B weights, exactly, for act_format="bf16").
void moe_experts_bf16_cuda(const Array& x, std::int64_t tokens, std::int64_t hidden, const Array& topk_ids,
                           const Array& topk_weights, int k, std::int64_t experts, std::int64_t intermediate,
                           const Array& w13, const Array& w2, const Array& out, bool out_f32,
                           const Array& workspace, std::uintptr_t stream) {
  DeviceScope scope(x);
  if (experts < 1 || hidden < 1 || intermediate < 1 || k < 1 || tokens < 0)
    throw std::invalid_argument("moe_experts: invalid sizes");
  if (hidden % 64 != 0 || intermediate % 64 != 0)
    throw std::invalid_argument("act_format='bf16': the CUDA BF16 kernels need H and I multiples of 64 (H = " +
                                std::to_string(hidden) + ", I = " + std::to_string(intermediate) + ")");
  require(w13, "w13", static_cast<std::size_t>(experts * 2 * intermediate * hidden) * 2, true);
  require(w2, "w2", static_cast<std::size_t>(experts * hidden * intermediate) * 2, true);
  require(x, "x", static_cast<std::size_t>(tokens * hidden) * 2, true);
  require(topk_ids, "topk_ids", static_cast<std::size_t>(tokens * k) * sizeof(std::int32_t), true);
  require(topk_weights, "topk_weights", static_cast<std::size_t>(tokens * k) * sizeof(float), true);
  require(out, "out", static_cast<std::size_t>(tokens * hidden) * (out_f32 ? 4 : 2), true);
  const std::size_t need = cuda::moe_workspace_bytes(tokens, k, experts, hidden, intermediate);
  if (workspace.nbytes() < need)
    throw std::invalid_argument("workspace: has " + std::to_string(workspace.nbytes()) + " bytes, needs " +
                                std::to_string(need));
  for (const Array* a : {&w13, &w2, &topk_ids, &topk_weights, &out, &workspace}) same_device(x, *a, "argument");
  if (tokens == 0) return;
  cuda::DeviceMoeWeightsBf16 w;
  w.experts = experts;
  w.hidden = hidden;
  w.intermediate = intermediate;
  w.w13 = static_cast<const std::uint16_t*>(w13.data());
  w.w2 = static_cast<const std::uint16_t*>(w2.data());
  cuda::moe_forward_bf16(w, static_cast<const std::uint16_t*>(x.data()), tokens, k,
                         static_cast<const std::int32_t*>(topk_ids.data()), static_cast<const float*>(topk_weights.data()),
                         out_f32 ? nullptr : static_cast<std::uint16_t*>(out.data()), workspace.data(),
                         workspace.nbytes(), as_stream(stream), cuda::MoeOptions{},
                         out_f32 ? static_cast<float*>(out.data()) : nullptr);
}

}  // namespace

void bind_cuda(nb::module_& m) {
  m.def("has_cuda", [] { return true; });
  m.def("quantize_cuda", &quantize_cuda, nb::arg("src"), nb::arg("dtype"), nb::arg("experts"), nb::arg("rows"),
        nb::arg("cols"), nb::arg("stacked"), nb::arg("fitter"), nb::arg("forced_scale"),
        nb::arg("column_weights").none(), nb::arg("packed"), nb::arg("codebook"), nb::arg("scale"),
        nb::arg("error_word"), nb::arg("stream"));
  m.def("decode_fit_error", &decode_fit_error);
  m.def("packed_to_lane_major", &packed_to_lane_major);
  m.def("route_softmax_topk_cuda", &route_softmax_topk_cuda);
  m.def("route_deepseek_cuda", &route_deepseek_cuda, nb::arg("logits"), nb::arg("bias").none(), nb::arg("tokens"),
        nb::arg("experts"), nb::arg("n_group"), nb::arg("topk_group"), nb::arg("k"), nb::arg("renormalize"),
        nb::arg("scaling"), nb::arg("ids"), nb::arg("weights"), nb::arg("stream"));
  m.def("moe_workspace_bytes", [](std::int64_t t, int k, std::int64_t e, std::int64_t h, std::int64_t i) {
    return cuda::moe_workspace_bytes(t, k, e, h, i);
  });
  m.def("moe_experts_cuda", &moe_experts_cuda);
  m.def("moe_experts_bf16_cuda", &moe_experts_bf16_cuda);
}

}  // namespace lutb::python
