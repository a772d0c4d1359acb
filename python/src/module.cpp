// lutb._lutb: the nanobind extension behind the lutb Python package (python/lutb).
//
// Thin entry points over the C++ library. Arrays cross by DLPack (nb::ndarray, zero copy, numpy or
// torch, CPU or CUDA); 16-bit floats arrive as int16 views and FP8 / UE8M0 bytes as uint8 views, so
// only raw pointers and the dtype name are read here. The Python layer (python/lutb/_api.py) checks
// dtypes, shapes, devices and contiguity and names the argument in its errors; the checks below are
// the last line (a wrong size here would read or write out of bounds) and raise ValueError too.
// Outputs are allocated by the caller (torch.empty / numpy.empty) except quantize_cpu's, which
// returns the fitter's own buffers without a copy, and the calibration statistics' arrays (copies
// owned by numpy). CalibrationStats is the C++ class itself (python/lutb/_calibration.py wraps it).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "lutb/calibration.hpp"
#include "lutb/cuda/lane_major.hpp"
#include "lutb/dtype.hpp"
#include "lutb/fit.hpp"
#include "lutb/moe.hpp"
#include "lutb/mxfp8.hpp"
#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"
#include "moe/cpu_kernels.hpp"
#include "moe/moe_internal.hpp"
#include "module.hpp"

namespace nb = nanobind;

namespace lutb::python {

std::size_t elements(const Array& a) {
  std::size_t n = 1;
  for (std::size_t i = 0; i < a.ndim(); ++i) n *= a.shape(i);
  return n;
}

void require(const Array& a, const char* what, std::size_t bytes, bool cuda) {
  const bool on_cuda = a.device_type() == nb::device::cuda::value;
  if (on_cuda != cuda)
    throw std::invalid_argument(std::string(what) + ": expected a " + (cuda ? "CUDA" : "CPU") + " array");
  if (a.nbytes() != bytes)
    throw std::invalid_argument(std::string(what) + ": has " + std::to_string(a.nbytes()) + " bytes, expected " +
                                std::to_string(bytes));
  if (bytes != 0 && a.data() == nullptr) throw std::invalid_argument(std::string(what) + ": null data");
}

DType source_dtype(const std::string& name) {
  if (name == "F32") return DType::F32;
  if (name == "BF16") return DType::BF16;
  if (name == "F16") return DType::F16;
  throw std::invalid_argument("dtype " + name + " is not F32, BF16 or F16");
}

LutbShape make_shape(std::int64_t experts, std::int64_t rows, std::int64_t cols, bool stacked) {
  if (experts < 1 || rows < 1 || cols < 1)
    throw std::invalid_argument("shape: experts, rows and cols must be >= 1");
  LutbShape s;
  s.experts = experts;
  s.rows = rows;
  s.cols = cols;
  s.stacked = stacked;
  return s;
}

namespace {

template <class T>
nb::ndarray<nb::numpy, std::uint8_t> owned_bytes(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  const std::size_t n = heap->size() * sizeof(T);
  return nb::ndarray<nb::numpy, std::uint8_t>(heap->data(), {n}, owner);
}

// A float32 numpy array [rows, cols] that owns `v` (rows * cols values, row-major).
nb::ndarray<nb::numpy, float> owned_floats(std::vector<float>&& v, std::size_t rows, std::size_t cols) {
  auto* heap = new std::vector<float>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  return nb::ndarray<nb::numpy, float>(heap->data(), {rows, cols}, owner);
}

// A float32 numpy array [n, cols, cols] that owns `v` (n * cols^2 values, row-major): second moments.
nb::ndarray<nb::numpy, float> owned_moments(std::vector<float>&& v, std::size_t n, std::size_t cols) {
  auto* heap = new std::vector<float>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  return nb::ndarray<nb::numpy, float>(heap->data(), {n, cols, cols}, owner);
}

LutbView view_of(const LutbShape& s, const Array& packed, const Array& codebook, const Array& scale,
                 const char* what, bool cuda) {
  const auto tiles = static_cast<std::size_t>(s.tiles());
  require(packed, (std::string(what) + ".packed").c_str(), tiles * kPackedBytes, cuda);
  require(codebook, (std::string(what) + ".codebook").c_str(), tiles * kCodebookSize, cuda);
  require(scale, (std::string(what) + ".scale").c_str(), tiles, cuda);
  return {s, static_cast<const std::uint8_t*>(packed.data()), static_cast<const std::uint8_t*>(codebook.data()),
          static_cast<const std::uint8_t*>(scale.data())};
}

// Fits on the CPU; returns packed, codebook and scale as flat uint8 numpy arrays owning the fitter's
// buffers, and the total squared error and squared weight. column_weights: None (unweighted) or a CPU
// float32 array of experts * cols values (FitOptions::column_weights, row-major [experts][cols]).
nb::tuple quantize_cpu(const Array& src, const std::string& dtype, std::int64_t experts, std::int64_t rows,
                       std::int64_t cols, bool stacked, const std::string& fitter, int forced_scale,
                       const std::optional<Array>& column_weights, const std::optional<Array>& second_moments,
                       double damping, int threads, const std::string& name) {
  const DType t = source_dtype(dtype);
  const LutbShape s = make_shape(experts, rows, cols, stacked);
  require(src, "w", static_cast<std::size_t>(experts * rows * cols) * dtype_size(t), false);
  FitOptions opt;
  opt.fitter = fitter;
  opt.forced_scale = forced_scale;
  opt.threads = threads;
  if (column_weights) {
    if (column_weights->dtype() != nb::dtype<float>())
      throw std::invalid_argument("column_weights: expected float32");
    require(*column_weights, "column_weights", static_cast<std::size_t>(experts * cols) * sizeof(float), false);
    opt.column_weights = static_cast<const float*>(column_weights->data());
  }
  // FitOptions::error_feedback: [experts][cols][cols] float32 on the CPU (the feedback has no GPU fitter).
  if (second_moments) {
    if (second_moments->dtype() != nb::dtype<float>())
      throw std::invalid_argument("second_moments: expected float32");
    require(*second_moments, "second_moments", static_cast<std::size_t>(experts * cols * cols) * sizeof(float),
            false);
    opt.error_feedback.second_moments = static_cast<const float*>(second_moments->data());
    opt.error_feedback.damping = damping;
  }
  LutbTensor out;
  FitStats st;
  {
    nb::gil_scoped_release release;
    st = quantize(src.data(), t, s, out, opt, name);
  }
  return nb::make_tuple(owned_bytes(std::move(out.packed)), owned_bytes(std::move(out.codebook)),
                        owned_bytes(std::move(out.scale)), st.sse, st.sum_sq);
}

void dequantize_cpu(const Array& packed, const Array& codebook, const Array& scale, std::int64_t experts,
                    std::int64_t rows, std::int64_t cols, bool stacked, const Array& out, const std::string& what) {
  const LutbShape s = make_shape(experts, rows, cols, stacked);
  const LutbView v = view_of(s, packed, codebook, scale, what.c_str(), false);
  require(out, "out", static_cast<std::size_t>(experts * rows * cols) * sizeof(float), false);
  nb::gil_scoped_release release;
  validate(v, what);
  dequantize(v, static_cast<float*>(out.data()));
}

void validate_cpu(const Array& packed, const Array& codebook, const Array& scale, std::int64_t experts,
                  std::int64_t rows, std::int64_t cols, bool stacked, const std::string& what) {
  const LutbShape s = make_shape(experts, rows, cols, stacked);
  const LutbView v = view_of(s, packed, codebook, scale, what.c_str(), false);
  nb::gil_scoped_release release;
  validate(v, what);
}

MxScaleRule mx_rule(const std::string& rule) {
  if (rule == "rceil") return MxScaleRule::Rceil;
  if (rule == "floor") return MxScaleRule::Floor;
  throw std::invalid_argument("rule='" + rule + "' is not 'rceil' or 'floor'");
}

void mxfp8_qdq_cpu(const Array& x, const std::string& dtype, std::int64_t rows, std::int64_t cols,
                   const Array& out, const std::string& rule) {
  const MxScaleRule r = mx_rule(rule);
  const DType t = dtype == "BF16" ? DType::BF16 : dtype == "F32" ? DType::F32 : source_dtype(dtype);
  if (t == DType::F16) throw std::invalid_argument("mxfp8_qdq_cpu: F16 is converted by the caller");
  require(x, "x", static_cast<std::size_t>(rows * cols) * dtype_size(t), false);
  require(out, "out", static_cast<std::size_t>(rows * cols) * sizeof(float), false);
  nb::gil_scoped_release release;
  if (t == DType::BF16)
    mxfp8_qdq_rows_bf16(static_cast<const std::uint16_t*>(x.data()), rows, cols, static_cast<float*>(out.data()), r);
  else
    mxfp8_qdq_rows(static_cast<const float*>(x.data()), rows, cols, static_cast<float*>(out.data()), r);
}

void route_cpu(const Array& logits, std::int64_t tokens, int experts, const std::optional<Array>& bias,
               bool sigmoid, int k, bool renormalize, int n_group, int topk_group, float scaling,
               const Array& ids, const Array& weights) {
  moe::RouterConfig cfg;
  cfg.scoring = sigmoid ? moe::ScoringFunc::Sigmoid : moe::ScoringFunc::Softmax;
  cfg.num_experts = experts;
  cfg.top_k = k;
  cfg.norm_topk_prob = renormalize;
  cfg.n_group = n_group;
  cfg.topk_group = topk_group;
  cfg.routed_scaling_factor = scaling;
  cfg.validate();
  require(logits, "logits", static_cast<std::size_t>(tokens * experts) * sizeof(float), false);
  if (bias) require(*bias, "correction_bias", static_cast<std::size_t>(experts) * sizeof(float), false);
  require(ids, "topk_ids", static_cast<std::size_t>(tokens * k) * sizeof(std::int32_t), false);
  require(weights, "topk_weights", static_cast<std::size_t>(tokens * k) * sizeof(float), false);
  nb::gil_scoped_release release;
  moe::route(cfg, static_cast<const float*>(logits.data()), tokens,
             bias ? static_cast<const float*>(bias->data()) : nullptr, static_cast<std::int32_t*>(ids.data()),
             static_cast<float*>(weights.data()));
}

// Spec 4 steps 2-6 on the CPU with the packed kernels of LutbCpuExperts, straight on the caller's
// arrays (no copy of the weights). The layer is configured with E + 1 global experts of which
// 0..E-1 are local, so the expert-parallel marker (any id >= E, mapped to E) contributes nothing.
void moe_experts_cpu(const Array& x, std::int64_t tokens, std::int64_t hidden, const Array& topk_ids, int id_bits,
                     const Array& topk_weights, int k, std::int64_t experts, std::int64_t intermediate,
                     const Array& w13_packed, const Array& w13_codebook, const Array& w13_scale,
                     const Array& w2_packed, const Array& w2_codebook, const Array& w2_scale,
                     const std::string& act_format, const Array& out, bool out_f32) {
  if (act_format != "mxfp8" && act_format != "bf16")
    throw std::invalid_argument("act_format='" + act_format + "' is not 'mxfp8' or 'bf16'");
  if (experts < 1 || experts > (1 << 30) || hidden < 1 || intermediate < 1 || k < 1 || tokens < 0)
    throw std::invalid_argument("moe_experts: invalid sizes");
  const moe::ActivationFormat act =
      act_format == "mxfp8" ? moe::ActivationFormat::MXFP8 : moe::ActivationFormat::BF16;
  const LutbShape s13 = make_shape(experts, 2 * intermediate, hidden, true);
  const LutbShape s2 = make_shape(experts, hidden, intermediate, true);
  const LutbView v13 = view_of(s13, w13_packed, w13_codebook, w13_scale, "w13", false);
  const LutbView v2 = view_of(s2, w2_packed, w2_codebook, w2_scale, "w2", false);
  require(x, "x", static_cast<std::size_t>(tokens * hidden) * 2, false);
  if (id_bits != 32 && id_bits != 64) throw std::invalid_argument("topk_ids: expected int32 or int64");
  require(topk_ids, "topk_ids", static_cast<std::size_t>(tokens * k) * (id_bits / 8), false);
  require(topk_weights, "topk_weights", static_cast<std::size_t>(tokens * k) * sizeof(float), false);
  require(out, "out", static_cast<std::size_t>(tokens * hidden) * (out_f32 ? 4 : 2), false);

  const int E = static_cast<int>(experts);
  moe::MoeConfig cfg;
  cfg.global_experts = E + 1;
  cfg.top_k = k;
  cfg.hidden_size = hidden;
  cfg.intermediate_size_per_partition = intermediate;
  std::vector<std::int32_t> local(static_cast<std::size_t>(E));
  std::iota(local.begin(), local.end(), 0);
  cfg.expert_map = moe::ExpertMap::from_list(E + 1, local);
  cfg.finalize();

  const std::size_t pairs = static_cast<std::size_t>(tokens * k);
  std::vector<std::int32_t> ids(pairs);
  for (std::size_t p = 0; p < pairs; ++p) {
    const std::int64_t id = id_bits == 64 ? static_cast<const std::int64_t*>(topk_ids.data())[p]
                                          : static_cast<const std::int32_t*>(topk_ids.data())[p];
    if (id < 0)
      throw std::invalid_argument("topk_ids: token " + std::to_string(p / k) + " slot " + std::to_string(p % k) +
                                  " holds expert id " + std::to_string(id) + " < 0");
    ids[p] = static_cast<std::int32_t>(id < experts ? id : experts);
  }
  nb::gil_scoped_release release;
  const moe::CpuIsa isa = moe::best_cpu_isa();  // the packed kernel of LutbCpuExperts, on the best ISA
  std::vector<float> acc(static_cast<std::size_t>(tokens * hidden));
  const moe::HiddenStates hs = moe::HiddenStates::bf16(static_cast<const std::uint16_t*>(x.data()), tokens);
  const moe::TopK topk{ids.data(), static_cast<const float*>(topk_weights.data()), k};
  moe::detail::run_grouped(
      cfg, hs, topk, act,
      [&](int which, int e, std::int64_t n0, std::int64_t n1, const float* const* a, int ntok, float* const* c) {
        const LutbView& w = which == 0 ? v13 : v2;
        const std::int64_t t0 = static_cast<std::int64_t>(e) * w.shape.tiles_per_expert();
        moe::detail::lutb_gemm(isa, w.tile_packed(t0), w.tile_codebook(t0), w.scale + t0, w.shape.tiles_k(), w.shape.rows,
                               n0, n1, a, ntok, c);
      },
      /*job_weights=*/std::int64_t{1} << 16, acc.data());
  // out_f32: the FP32 sums of step 6 before its BF16 rounding (expert parallelism rounds once, after
  // adding the ranks' partial sums).
  if (out_f32) {
    std::copy(acc.begin(), acc.end(), static_cast<float*>(out.data()));
    return;
  }
  auto* o = static_cast<std::uint16_t*>(out.data());
  for (std::size_t i = 0; i < acc.size(); ++i) o[i] = bf16_from_float(acc[i]);
}

// The lane-major permutation of the CUDA kernels (lutb/cuda/lane_major.hpp, host code) tile by tile:
// the reference the CUDA copy of LutbWeight.kernel_packed() is tested against.
void lane_major_cpu(const Array& packed, const Array& out) {
  const std::size_t bytes = packed.nbytes();
  if (bytes % kPackedBytes != 0) throw std::invalid_argument("packed: size is not a multiple of 192 bytes");
  require(packed, "packed", bytes, false);
  require(out, "out", bytes, false);
  const auto* in = static_cast<const std::uint8_t*>(packed.data());
  auto* o = static_cast<std::uint8_t*>(out.data());
  if (in == o) throw std::invalid_argument("out: must not be packed itself");
  for (std::size_t t = 0; t < bytes / kPackedBytes; ++t)
    cuda::tile_to_lane_major(in + t * kPackedBytes, o + t * kPackedBytes);
}

// Calibration statistics (lutb/calibration.hpp). The reader and the rule throw std::runtime_error
// naming the file and the tensor; Python sees ValueError with the same message.
template <class F>
auto value_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::runtime_error& e) {
    throw nb::value_error(e.what());
  }
}

CalibratedInput calibrated_input(const std::string& projection) {
  if (projection == "gate_up") return CalibratedInput::kGateUp;
  if (projection == "down") return CalibratedInput::kDown;
  throw std::invalid_argument("projection: '" + projection + "' is not 'gate_up' or 'down'");
}

const LayerCalibration& calibrated_layer(const CalibrationStats& s, int layer) {
  const auto it = s.layers.find(layer);
  if (it == s.layers.end())
    throw std::invalid_argument(s.source + ": no statistics for layer " + std::to_string(layer));
  return it->second;
}

// (prefix, experts, hidden, intermediate, tokens [E, 1], gate_up_x2 [E, hidden], down_x2 [E, intermediate],
// full_moments): the statistics of one layer as stored, copied into numpy arrays (the full moments stay
// in the file: calibration_second_moments reads them).
nb::tuple calibration_layer(const CalibrationStats& s, int layer) {
  const LayerCalibration& lc = calibrated_layer(s, layer);
  const auto E = static_cast<std::size_t>(lc.experts);
  return nb::make_tuple(lc.prefix, lc.experts, lc.hidden, lc.intermediate,
                        owned_floats(std::vector<float>(lc.tokens), E, 1),
                        owned_floats(std::vector<float>(lc.gate_up_x2), E, static_cast<std::size_t>(lc.hidden)),
                        owned_floats(std::vector<float>(lc.down_x2), E, static_cast<std::size_t>(lc.intermediate)),
                        lc.full_moments);
}

// CalibrationStats::second_moments as float32 [n, cols, cols] (read from the file a layer at a time).
nb::ndarray<nb::numpy, float> calibration_second_moments(const CalibrationStats& s, int layer,
                                                         const std::string& projection, std::int64_t e0,
                                                         std::int64_t n) {
  const CalibratedInput in = calibrated_input(projection);
  const LayerCalibration& lc = calibrated_layer(s, layer);
  const auto cols = static_cast<std::size_t>(in == CalibratedInput::kGateUp ? lc.hidden : lc.intermediate);
  // The GIL is released while the file is read; value_errors turns the reader's errors into ValueError
  // after it is held again.
  std::vector<float> m = value_errors([&] {
    nb::gil_scoped_release release;
    return s.second_moments(layer, in, e0, n);
  });
  return owned_moments(std::move(m), static_cast<std::size_t>(n), cols);
}

// CalibrationStats::second_moments_for_tensor as float32 [experts, cols, cols], or None.
std::optional<nb::ndarray<nb::numpy, float>> calibration_second_moments_for_tensor(
    const CalibrationStats& s, const std::string& name, std::int64_t experts, std::int64_t cols,
    const std::string& file_for_errors) {
  if (experts < 1 || cols < 1)
    throw std::invalid_argument("second_moments_for_tensor: experts and cols must be >= 1");
  std::optional<std::vector<float>> m = value_errors([&] {
    nb::gil_scoped_release release;
    return s.second_moments_for_tensor(name, experts, cols, file_for_errors);
  });
  if (!m) return std::nullopt;
  return owned_moments(std::move(*m), static_cast<std::size_t>(experts), static_cast<std::size_t>(cols));
}

// CalibrationStats::column_weights as float32 [experts, cols].
nb::ndarray<nb::numpy, float> calibration_column_weights(const CalibrationStats& s, int layer,
                                                         const std::string& projection) {
  const CalibratedInput in = calibrated_input(projection);
  const LayerCalibration& lc = calibrated_layer(s, layer);
  const auto cols = static_cast<std::size_t>(in == CalibratedInput::kGateUp ? lc.hidden : lc.intermediate);
  std::vector<float> w = value_errors([&] { return s.column_weights(layer, in); });
  return owned_floats(std::move(w), static_cast<std::size_t>(lc.experts), cols);
}

// CalibrationStats::weights_for_tensor as float32 [experts, cols], or None.
std::optional<nb::ndarray<nb::numpy, float>> calibration_weights_for_tensor(const CalibrationStats& s,
                                                                            const std::string& name,
                                                                            std::int64_t experts, std::int64_t cols,
                                                                            const std::string& file_for_errors) {
  if (experts < 1 || cols < 1) throw std::invalid_argument("weights_for_tensor: experts and cols must be >= 1");
  std::optional<std::vector<float>> w =
      value_errors([&] { return s.weights_for_tensor(name, experts, cols, file_for_errors); });
  if (!w) return std::nullopt;
  return owned_floats(std::move(*w), static_cast<std::size_t>(experts), static_cast<std::size_t>(cols));
}

void bind_calibration(nb::module_& m) {
  nb::class_<CalibrationStats>(m, "CalibrationStats")
      .def_static("load",
                  [](const std::string& file) {
                    return value_errors([&] { return CalibrationStats::load(std::filesystem::path(file)); });
                  })
      .def_ro("metadata", &CalibrationStats::metadata)
      .def_ro("source", &CalibrationStats::source)
      .def("layer_indices",
           [](const CalibrationStats& s) {
             std::vector<int> v;
             for (const auto& kv : s.layers) v.push_back(kv.first);
             return v;
           })
      .def("layer", &calibration_layer)
      .def("column_weights", &calibration_column_weights)
      .def("weights_for_tensor", &calibration_weights_for_tensor)
      .def("has_second_moments", &CalibrationStats::has_second_moments)
      .def("second_moments", &calibration_second_moments)
      .def("second_moments_for_tensor", &calibration_second_moments_for_tensor);
  m.attr("CALIBRATION_PRIOR_TOKENS") = kPriorTokens;
  m.attr("CALIBRATION_MIN_RELATIVE_WEIGHT") = kMinRelativeWeight;
}

}  // namespace
}  // namespace lutb::python

NB_MODULE(_lutb, m) {
  using namespace lutb::python;
  m.doc() = "lutb C++ entry points (use the lutb package, not this module)";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const lutb::FormatError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.def("fitter_names", &lutb::fitter_names);
  m.def("default_fitter", &lutb::default_fitter);
  m.def("check_fitter_name", [](const std::string& n) { lutb::check_fitter_name(n); });
  m.def("cpu_isa", &lutb::moe::cpu_isa);
  m.def("quantize_cpu", &quantize_cpu, nb::arg("src"), nb::arg("dtype"), nb::arg("experts"), nb::arg("rows"),
        nb::arg("cols"), nb::arg("stacked"), nb::arg("fitter"), nb::arg("forced_scale"),
        nb::arg("column_weights").none(), nb::arg("second_moments").none(), nb::arg("damping"), nb::arg("threads"),
        nb::arg("name"));
  m.def("dequantize_cpu", &dequantize_cpu);
  m.def("validate_cpu", &validate_cpu);
  m.def("mxfp8_qdq_cpu", &mxfp8_qdq_cpu);
  m.def("route_cpu", &route_cpu, nb::arg("logits"), nb::arg("tokens"), nb::arg("experts"),
        nb::arg("bias").none(), nb::arg("sigmoid"), nb::arg("k"), nb::arg("renormalize"), nb::arg("n_group"),
        nb::arg("topk_group"), nb::arg("scaling"), nb::arg("ids"), nb::arg("weights"));
  m.def("moe_experts_cpu", &moe_experts_cpu);
  m.def("lane_major_cpu", &lane_major_cpu);
  bind_calibration(m);
  bind_cuda(m);
}
