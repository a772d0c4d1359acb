// --device cuda for the lutb tool (src/cli/gpu.hpp): the only CLI source that includes lutb/cuda.
#include "cli/gpu.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "cli/fit_groups.hpp"
#include "cli/validators.hpp"
#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"

#ifdef LUTB_WITH_CUDA
#include "lutb/cuda/fit.hpp"
#include "lutb/cuda/moe_layer.hpp"
#endif

namespace lutb::cli {

namespace {
constexpr const char* kNoCudaBuild =
    "this lutb was built without CUDA (no nvcc when it was configured, or LUTB_CUDA=OFF / the cpu preset); "
    "rebuild with the release preset on a machine with the CUDA toolkit, or use --device cpu";
}  // namespace

CLI::Option* add_device_option(CLI::App* cmd, std::string& device, const std::string& what) {
  return cmd->add_option("--device", device, "where " + what + " runs: cpu (default) or cuda (an NVIDIA GPU, sm_80+)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
}

bool built_with_cuda() {
#ifdef LUTB_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string cuda_unavailable_reason() {
#ifdef LUTB_WITH_CUDA
  return cuda::gpu_unavailable_reason();
#else
  return kNoCudaBuild;
#endif
}

void require_cuda() {
  if (std::string why = cuda_unavailable_reason(); !why.empty()) throw std::runtime_error("--device cuda: " + why);
}

std::string cuda_device_description() {
#ifdef LUTB_WITH_CUDA
  return cuda::gpu_description();
#else
  throw std::runtime_error(std::string("--device cuda: ") + kNoCudaBuild);
#endif
}

void check_gpu_fitter(const std::string& fitter) {
#ifdef LUTB_WITH_CUDA
  if (!fitter.empty()) check_fitter_value(fitter);  // an unknown name: the message of every --fitter ("" = default)
  try {
    (void)cuda::gpu_fitter(fitter);
  } catch (const std::invalid_argument&) {
    throw UsageError(fmt::format("--fitter {}: fitter '{}' has no GPU kernel (GPU fitters: binned-dp, optimal); with "
                                 "--device cuda give one of those, or use --device cpu",
                                 fitter, fitter));
  }
#else
  (void)fitter;
  throw std::runtime_error(std::string("--device cuda: ") + kNoCudaBuild);
#endif
}

void check_gpu_options(const model::MoeOptions& opt) {
  if (opt.quant == model::Quant::Lutb) {
    if (opt.activations != moe::ActivationFormat::MXFP8)
      throw UsageError("--device cuda runs LUT-B experts with MXFP8 activations (spec section 4) only; drop "
                       "--act-format bf16 or use --device cpu");
  } else if (opt.quant == model::Quant::None) {
    if (opt.activations != moe::ActivationFormat::BF16)
      throw UsageError("--device cuda with --quant none runs the BF16 baseline (BF16 activations, no MXFP8 steps); "
                       "drop --act-format mxfp8 or use --device cpu");
  } else {
    throw UsageError("--device cuda: --quant " + model::quant_name(opt.quant) +
                     " has no GPU path (GPU: lutb, none); use --device cpu");
  }
}

QuantizeOptions::FitFunction gpu_fit_function(std::shared_ptr<GpuFitTally> tally) {
#ifdef LUTB_WITH_CUDA
  return [tally](const void* src, DType dt, const LutbShape& shape, LutbTensor& out, const FitOptions& fit,
                 const std::string& name) -> FitStats {
    cuda::GpuFitOptions go;
    go.fitter = fit.fitter;
    go.forced_scale = fit.forced_scale;
    // Column weights (calibration): every expert's checked before any group is fitted, as
    // lutb::quantize checks them before any tile, with its words.
    if (fit.column_weights)
      for (std::int64_t e = 0; e < shape.experts; ++e)
        if (const std::string msg = column_weights_error(fit.column_weights + e * shape.cols, shape.cols); !msg.empty())
          throw std::invalid_argument("quantize: tensor " + name +
                                      (shape.stacked ? ", expert " + std::to_string(e) : std::string()) + ": " + msg);
    const auto t0 = std::chrono::steady_clock::now();
    // quantize_gpu does not poll an interrupt flag: a stack is fitted in groups of whole experts of
    // at most 2^28 weights (binned-dp ~30 ms, optimal ~0.6 s of GPU time on an H200,
    // docs/perf/fit-gpu.md) with the flag read between groups, so Ctrl-C stops within about one group.
    std::int64_t e0 = 0;  // the group's first expert: the groups come in expert order
    const FitStats st = fit_in_expert_groups(
        src, dt, shape, out, name, fit.interrupt, std::int64_t{1} << 28,
        [&](const void* p, DType d, const LutbShape& ps, LutbTensor& o) {
          go.column_weights = fit.column_weights ? fit.column_weights + e0 * shape.cols : nullptr;
          const FitStats g = cuda::quantize_gpu(p, d, ps, o, go, name);
          e0 += ps.experts;
          return g;
        });
    tally->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tally->weights += shape.experts * shape.rows * shape.cols;
    return st;
  };
#else
  (void)tally;
  throw std::runtime_error(std::string("--device cuda: ") + kNoCudaBuild);
#endif
}

FitPlacement place_fit(model::MoeOptions& opt, bool gpu) {
  FitPlacement f;
  if (opt.quant != model::Quant::Lutb) return f;
  f.fits = true;
  if (gpu) {
#ifdef LUTB_WITH_CUDA
    try {
      (void)cuda::gpu_fitter(opt.fit.fitter);
      f.device = "cuda";
    } catch (const std::invalid_argument&) {
      f.note = fmt::format("fitter {} has no GPU kernel (GPU fitters: binned-dp, optimal)", opt.fit.fitter);
    }
#endif
  }
  if (f.device == "cuda") {
    opt.fit_function = gpu_fit_function(f.tally);
  } else {
    opt.fit_function = [tally = f.tally](const void* src, DType dt, const LutbShape& shape, LutbTensor& out,
                                         const FitOptions& fit, const std::string& name) -> FitStats {
      const auto t0 = std::chrono::steady_clock::now();
      const FitStats st = quantize(src, dt, shape, out, fit, name);
      tally->seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      tally->weights += shape.experts * shape.rows * shape.cols;
      return st;
    };
  }
  return f;
}

void print_fit_line(const FitPlacement& f, const std::string& fitter) {
  const double wps = f.tally->seconds > 0 ? static_cast<double>(f.tally->weights) / f.tally->seconds : 0.0;
  fmt::print("fit          {} ({}): {:.3f} s for {} weights ({:.3g} weights/s{}){}\n", f.device, fitter, f.tally->seconds,
             f.tally->weights, wps, f.device == "cuda" ? ", host-device copies included" : "",
             f.note.empty() ? "" : "; on the CPU: " + f.note);
}

void add_fit_json(nlohmann::json& j, const FitPlacement& f) {
  j["fit_device"] = f.device;
  j["fit_seconds"] = f.tally->seconds;
  j["fit_weights"] = f.tally->weights;
  j["fit_note"] = f.note.empty() ? nlohmann::json(nullptr) : nlohmann::json(f.note);
}

// -------------------------------------------------------------------------------------------------
// GpuMoeBlock
// -------------------------------------------------------------------------------------------------

#ifdef LUTB_WITH_CUDA
struct GpuMoeBlock::Impl {
  std::unique_ptr<model::MoeBlock> cpu;
  const model::MoeBlockParts* parts = nullptr;
  std::unique_ptr<cuda::GpuMoeLayer> layer;
  bool gpu_routing = false;
  std::string note;
};

GpuMoeBlock::GpuMoeBlock(std::unique_ptr<model::MoeBlock> cpu, const model::MoeOptions& opt)
    : impl_(std::make_unique<Impl>()) {
  require_cuda();
  Impl& m = *impl_;
  m.cpu = std::move(cpu);
  m.parts = m.cpu->parts();
  if (!m.parts || !m.parts->experts) throw std::invalid_argument("--device cuda: this MoE block exposes no routed experts");
  const moe::MoeConfig& mc = m.parts->experts->config();
  check_gpu_options(opt);
  if (opt.quant == model::Quant::Lutb) {
    const auto* ex = dynamic_cast<const moe::LutbCpuExperts*>(m.parts->experts);
    if (!ex)
      throw std::invalid_argument("--device cuda: the LUT-B experts are held by the '" + m.parts->experts->name() +
                                  "' emulation kernel; --kernel applies to --device cpu only");
    m.layer = std::make_unique<cuda::GpuMoeLayer>(cuda::GpuMoeLayer::lutb(ex->w13(), ex->w2()));
  } else {
    const auto* ex = dynamic_cast<const moe::DenseExperts*>(m.parts->experts);
    if (!ex) throw std::invalid_argument("--device cuda: the BF16 experts are not held as BF16 weights");
    m.layer = std::make_unique<cuda::GpuMoeLayer>(
        cuda::GpuMoeLayer::bf16(ex->w13(), ex->w2(), mc.global_experts, mc.hidden_size, mc.intermediate_size_per_partition));
  }
  std::string why;
  if (m.parts->group_limited_greedy) {
    m.note = "cpu (DeepSeek-V2 group_limited_greedy has no GPU kernel)";
  } else if (cuda::gpu_routing_supported(m.parts->router, &why)) {
    const float* bias = m.parts->correction_bias && !m.parts->correction_bias->empty() ? m.parts->correction_bias->data()
                                                                                         : nullptr;
    m.layer->set_router(m.parts->router, bias);
    m.gpu_routing = true;
    m.note = m.parts->router.scoring == moe::ScoringFunc::Softmax ? "gpu (softmax top-k)" : "gpu (DeepSeek grouped sigmoid)";
  } else {
    m.note = "cpu (" + why + ")";
  }
}

GpuMoeBlock::~GpuMoeBlock() = default;

void GpuMoeBlock::forward(const float* x, std::int64_t T, float* out) {
  Impl& m = *impl_;
  const std::int64_t H = m.layer->hidden(), E = m.layer->experts();
  const int k = m.parts->router.top_k;
  std::vector<float> logits(static_cast<std::size_t>(T * E));
  m.parts->router_logits(x, T, logits.data());
  // The routed experts read bf16(x) on both backends (spec section 4; model::MoeBlockParts): the
  // kernel's own MXFP8 step of those BF16 values is the CPU emulation's (moe::load_activation_row).
  std::vector<std::uint16_t> xb(static_cast<std::size_t>(T * H)), ob(static_cast<std::size_t>(T * H));
  for (std::size_t i = 0; i < xb.size(); ++i) xb[i] = bf16_from_float(x[i]);
  if (m.gpu_routing) {
    m.layer->forward(logits.data(), xb.data(), T, ob.data());
  } else {
    std::vector<std::int32_t> ids(static_cast<std::size_t>(T * k));
    std::vector<float> w(static_cast<std::size_t>(T * k));
    m.parts->route(logits.data(), T, ids.data(), w.data());
    m.layer->forward_routed(xb.data(), T, k, ids.data(), w.data(), ob.data());
  }
  for (std::size_t i = 0; i < ob.size(); ++i) out[i] = bf16_to_float(ob[i]);
  m.parts->add_shared(x, out, T);
}

const model::MoeBlockParts* GpuMoeBlock::parts() const { return impl_->parts; }
model::MoeBlock& GpuMoeBlock::cpu() { return *impl_->cpu; }
const std::string& GpuMoeBlock::routing_note() const { return impl_->note; }
double GpuMoeBlock::time_routed_ms(int reps) { return impl_->layer->time_last_forward_ms(reps); }
std::size_t GpuMoeBlock::device_bytes() const { return impl_->layer->device_bytes(); }

#else  // no CUDA in this build

struct GpuMoeBlock::Impl {};
GpuMoeBlock::GpuMoeBlock(std::unique_ptr<model::MoeBlock>, const model::MoeOptions&) {
  throw std::runtime_error(std::string("--device cuda: ") + kNoCudaBuild);
}
GpuMoeBlock::~GpuMoeBlock() = default;
void GpuMoeBlock::forward(const float*, std::int64_t, float*) {}
const model::MoeBlockParts* GpuMoeBlock::parts() const { return nullptr; }
model::MoeBlock& GpuMoeBlock::cpu() { throw std::logic_error("GpuMoeBlock without CUDA"); }
const std::string& GpuMoeBlock::routing_note() const { throw std::logic_error("GpuMoeBlock without CUDA"); }
double GpuMoeBlock::time_routed_ms(int) { return 0; }
std::size_t GpuMoeBlock::device_bytes() const { return 0; }

#endif

#ifdef LUTB_WITH_CUDA
void default_job_gpu_fit(DefaultJobGpu& r, const std::vector<std::uint16_t>& w13, const std::vector<std::uint16_t>& w2,
                         const moe::MoeConfig& mc, const LutbTensor& cpu13, const LutbTensor& cpu2,
                         const std::string& fitter) {
  const std::string name = fitter.empty() ? default_fitter() : fitter;
  try {
    (void)cuda::gpu_fitter(fitter);
  } catch (const std::invalid_argument&) {
    r.lines.push_back(fmt::format("  fit                   skipped: fitter {} has no GPU kernel (GPU fitters: binned-dp, "
                                  "optimal)", name));
    r.json["fit_skipped"] = name + " has no GPU kernel";
    return;
  }
  cuda::GpuFitOptions go;
  go.fitter = fitter;
  const std::int64_t E = mc.global_experts, H = mc.hidden_size, I = mc.intermediate_size_per_partition;
  LutbTensor g13, g2;
  const auto t0 = std::chrono::steady_clock::now();
  (void)cuda::quantize_gpu(w13.data(), DType::BF16, LutbShape{E, 2 * I, H, true}, g13, go, "w13");
  (void)cuda::quantize_gpu(w2.data(), DType::BF16, LutbShape{E, H, I, true}, g2, go, "w2");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const bool equal = g13.packed == cpu13.packed && g13.codebook == cpu13.codebook && g13.scale == cpu13.scale &&
                     g2.packed == cpu2.packed && g2.codebook == cpu2.codebook && g2.scale == cpu2.scale;
  const double n = static_cast<double>(w13.size() + w2.size());
  r.lines.push_back(fmt::format("  fit ({})        bytes equal to the CPU fit: {}; {:.3f} s, {:.3g} weights/s "
                                "(host-device copies included; first use of the GPU)",
                                name, equal ? "yes" : "NO", secs, n / secs));
  r.json["fit_fitter"] = name;
  r.json["fit_bytes_equal"] = equal;
  r.json["fit_seconds"] = secs;
  r.json["fit_weights_per_second"] = n / secs;
}

void default_job_gpu_forward(DefaultJobGpu& r, const moe::Experts& cpu, const std::uint16_t* x, std::int64_t tokens,
                             const moe::TopK& topk, const float* cpu_out, int reps) {
  const auto* ex = dynamic_cast<const moe::LutbCpuExperts*>(&cpu);
  if (!ex) {
    r.lines.push_back("  fused forward         skipped: the CPU experts are not the packed LUT-B kernel");
    return;
  }
  cuda::GpuMoeLayer layer = cuda::GpuMoeLayer::lutb(ex->w13(), ex->w2());
  const std::int64_t H = layer.hidden();
  nlohmann::json runs = nlohmann::json::array();
  for (const std::int64_t T : {std::int64_t{1}, tokens}) {
    if (T == 1 && tokens == 1 && !runs.empty()) break;
    std::vector<std::uint16_t> ob(static_cast<std::size_t>(T * H));
    layer.forward_routed(x, T, topk.k, topk.ids, topk.weights, ob.data());
    const double ms = layer.time_last_forward_ms(reps);
    double d2 = 0, c2 = 0;
    for (std::size_t i = 0; i < ob.size(); ++i) {
      const double d = static_cast<double>(bf16_to_float(ob[i])) - cpu_out[i];
      d2 += d * d;
      c2 += static_cast<double>(cpu_out[i]) * cpu_out[i];
    }
    const double rel = std::sqrt(d2 / c2);
    r.lines.push_back(fmt::format("  fused forward T = {:<4} {:.4f} ms (moe_forward, median of {}, CUDA events); rel L2 "
                                  "vs the CPU emulation {:.3g} (BF16 output)",
                                  T, ms, reps, rel));
    runs.push_back({{"tokens", T}, {"ms", ms}, {"rel_l2_vs_cpu", rel}});
    if (tokens == 1) break;
  }
  r.json["forward"] = runs;
}
#else
void default_job_gpu_fit(DefaultJobGpu&, const std::vector<std::uint16_t>&, const std::vector<std::uint16_t>&,
                         const moe::MoeConfig&, const LutbTensor&, const LutbTensor&, const std::string&) {
  throw std::runtime_error(kNoCudaBuild);
}
void default_job_gpu_forward(DefaultJobGpu&, const moe::Experts&, const std::uint16_t*, std::int64_t, const moe::TopK&,
                             const float*, int) {
  throw std::runtime_error(kNoCudaBuild);
}
#endif

model::MoeFactory gpu_factory(model::MoeFactory cpu, const model::MoeOptions& opt) {
  return [cpu = std::move(cpu), opt](int layer) -> std::unique_ptr<model::MoeBlock> {
    return std::make_unique<GpuMoeBlock>(cpu(layer), opt);
  };
}

}  // namespace lutb::cli
