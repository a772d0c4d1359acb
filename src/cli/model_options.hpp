// Options shared by `lutb eval` and `lutb moe`: how the routed experts are held and computed.
#pragma once

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <fmt/ranges.h>

#include "cli/gpu.hpp"
#include "cli/validators.hpp"
#include "io/tensor_names.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/fit.hpp"
#include "lutb/model.hpp"
#include "lutb/moe.hpp"
#include "lutb/safetensors.hpp"

namespace lutb::cli {

/// Runtime settings that only take effect in a fresh process (OpenBLAS and libgomp read them when
/// they are loaded), applied by re-executing this process once:
///  - OPENBLAS_CORETYPE, when OpenBLAS fell back to its generic SSE3 kernels on a CPU it does not
///    know (see model::blas_coretype_override): about 4x faster dense products;
///  - OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning. The forward pass runs
///    many short parallel regions; on a busy machine spinning threads took half the CPU time
///    (measured with perf on the shared 2-core machine: 52% in libgomp).
/// Variables the user already set are left alone; on any failure the process continues as is.
inline void ensure_runtime_env() {
  const bool need_blas = !std::getenv("OPENBLAS_CORETYPE") && !model::blas_coretype_override().empty();
  const bool need_omp = !std::getenv("OMP_WAIT_POLICY");
  if (!need_blas && !need_omp) return;
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (std::size_t p = 0; p < all.size();) {
    const std::size_t e = all.find('\0', p);
    args.push_back(all.substr(p, e == std::string::npos ? std::string::npos : e - p));
    if (e == std::string::npos) break;
    p = e + 1;
  }
  if (args.empty()) return;
  std::vector<char*> argv;
  for (auto& x : args) argv.push_back(x.data());
  argv.push_back(nullptr);
  if (need_blas) ::setenv("OPENBLAS_CORETYPE", model::blas_coretype_override().c_str(), 1);
  if (need_omp) ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
  std::fflush(stdout);
  std::fflush(stderr);
  ::execv("/proc/self/exe", argv.data());
  if (need_blas) ::unsetenv("OPENBLAS_CORETYPE");  // exec failed: carry on as we are
  if (need_omp) ::unsetenv("OMP_WAIT_POLICY");
}

/// Warns on stderr about the tensors of `model_dir` that are not tensors of the model its config.json
/// describes, and refuses a misspelt expert tensor (detail::check_tensor_names, the check `lutb
/// quantize` applies), so that eval never ignores them silently.
inline void check_model_tensor_names(const std::string& model_dir, const lutb::ModelConfig& cfg, const char* command) {
  const SafetensorsCollection st = SafetensorsCollection::open_dir(model_dir);
  for (const auto& w : detail::check_tensor_names(cfg, st, std::filesystem::path(model_dir) / "config.json",
                                                  fmt::format("lutb {} does not read it", command), ""))
    fmt::print(stderr, "lutb: warning: {}\n", w);
}

// After a non-finite loss: the first stored float tensor (in file and name order) holding a NaN or an
// infinity, as "; FILE holds NaN in tensor NAME at [i, j]", or "" when every stored value is finite
// (the overflow happened in the computation). Only tensors whose names start with `prefix` (lutb moe:
// one layer's). It names the tensor behind a "non-finite loss" (eval) or "outputs are NaN or
// infinite" (moe).
inline std::string first_non_finite_stored(const std::string& model_dir, const std::string& prefix = {}) {
  try {
    const SafetensorsCollection c = SafetensorsCollection::open_dir(model_dir);
    for (const auto& f : c.files())
      for (const auto& name : f->names()) {
        if (name.compare(0, prefix.size(), prefix) != 0) continue;
        const TensorView& v = f->get(name);
        if (v.dtype != DType::BF16 && v.dtype != DType::F16 && v.dtype != DType::F32 && v.dtype != DType::F64) continue;
        const std::vector<float> x = v.to_float();
        for (std::size_t i = 0; i < x.size(); ++i) {
          if (std::isfinite(x[i])) continue;
          std::vector<std::int64_t> at(v.shape.size());
          auto r = static_cast<std::int64_t>(i);
          for (std::size_t d = v.shape.size(); d-- > 0;) {
            at[d] = r % v.shape[d];
            r /= v.shape[d];
          }
          return fmt::format("; {} holds {} in tensor {} at [{}]", f->path().string(),
                             std::isnan(x[i]) ? "NaN" : (x[i] > 0 ? "+Inf" : "-Inf"), name, fmt::join(at, ", "));
        }
      }
  } catch (const std::exception&) {
    // the loader read these files already; nothing more to add
  }
  return {};
}

/// Warns on stderr about every routed-expert stack built so far whose quantisation lost at least half
/// of its energy (low_sqnr_warning: ct-lloyd / multistart on weights far from magnitude 1). Nothing
/// for BF16 experts or stored LUT-B weights (no source to compare with).
inline void warn_low_sqnr(const model::CheckpointMoe& moe, const model::MoeOptions& mo) {
  const std::string method = mo.quant == model::Quant::Lutb ? mo.fit.fitter : model::quant_name(mo.quant);
  for (const auto& s : moe.stats())
    if (std::string w = low_sqnr_warning(fmt::format("layer {}: {}", s.layer, s.name), s.sse, s.sum_sq, s.weights,
                                         method);
        !w.empty())
      fmt::print(stderr, "lutb: warning: {}\n", w);
}

inline std::string activation_name(moe::ActivationFormat a) { return a == moe::ActivationFormat::MXFP8 ? "mxfp8" : "bf16"; }

struct ModelQuantArgs {
  std::string quant;        // empty = lutb for a LUT-B checkpoint, none otherwise
  std::string activations;  // empty = mxfp8 with LUT-B weights, bf16 otherwise
  std::string fitter;       // empty = the default fitter
  std::string kernel = "fast";
  std::string calibration;  // --calibration STATS.safetensors (lutb calibrate), empty = data-free fit
  std::string error_feedback = "on";  // --error-feedback on|off (with full second moments in the statistics)
  double damping = 0.01;               // --damping (MoeOptions::damping)
  const CLI::Option* fitter_opt = nullptr;  // to tell `--fitter ""` from no --fitter
  const CLI::Option* kernel_opt = nullptr;  // to tell a given --kernel from the default
  const CLI::Option* calibration_opt = nullptr;     // to tell `--calibration ""` from no --calibration
  const CLI::Option* error_feedback_opt = nullptr;  // to tell a given --error-feedback from the default
  const CLI::Option* damping_opt = nullptr;         // to tell a given --damping from the default

  /// Registers --quant, `act_flag` (--act-format: eval and moe), --fitter, --kernel.
  void add_to(CLI::App* cmd, const std::string& act_flag = "--act-format") {
    cmd->add_option("--quant", quant, "routed experts: none (BF16), lutb, int3-g128, mxfp4 "
                                      "(default: lutb for a LUT-B checkpoint, none otherwise)")
        ->check(CLI::IsMember({"none", "lutb", "int3-g128", "mxfp4"}));
    cmd->add_option(act_flag, activations, "format of the activations entering the routed experts' GEMMs: bf16 "
                                           "or mxfp8 (default mxfp8 with LUT-B weights, bf16 otherwise)")
        ->check(CLI::IsMember({"bf16", "mxfp8"}));
    fitter_opt = cmd->add_option("--fitter", fitter,
                                 "LUT-B fitter of --quant lutb on a BF16 checkpoint (the online method): " + fitter_list());
    // The kernels compute the same values (spec section 4) and differ only in the order of their FP32
    // additions: the loss of --kernel reference differed from the default's in the 6th significant
    // digit, which reads like a bug unless the help says why.
    kernel_opt = cmd->add_option("--kernel", kernel,
                                 "LUT-B emulation kernel: fast (default), reference (the plain loops of spec section "
                                 "4), dequantized. All three compute the same MXFP8 x LUT-B products; only the order "
                                 "of the FP32 additions differs (spec section 4), so results agree to FP32 rounding: "
                                 "losses typically differ in the 5th-6th significant digit (e.g. 3.862777 vs 3.862791)")
                     ->check(CLI::IsMember({"fast", "reference", "dequantized"}));
    calibration_opt = cmd->add_option("--calibration", calibration,
                    "calibration statistics of `lutb calibrate` (STATS.safetensors): --quant lutb of a BF16 checkpoint "
                    "fits each expert projection under its inputs' second moments (fitters binned-dp, optimal; with "
                    "--device cuda on the GPU, the same bytes; default: none, the data-free fit)");
    error_feedback_opt = cmd->add_option("--error-feedback", error_feedback, std::string(kErrorFeedbackHelp))
                             ->check(CLI::IsMember({"on", "off"}));
    damping_opt = cmd->add_option("--damping", damping, std::string(kDampingHelp))->check(NonNegativeFinite());
  }

  model::MoeOptions resolve(const std::string& model_dir, int threads) const {
    if (fitter_opt != nullptr && fitter_opt->count() > 0 && fitter.empty()) check_fitter_option(fitter_opt, fitter);
    check_not_empty(calibration_opt, calibration, "statistics file name");
    check_error_feedback_option(error_feedback_opt, error_feedback, calibration);
    check_damping_option(damping_opt, damping, calibration, error_feedback);
    model::MoeOptions o;
    std::string q = quant;
    bool lutb_ckpt = false;
    try {
      // Only a regular file: a named pipe would block here for ever; anything else is reported by the
      // loader.
      const std::filesystem::path config = std::filesystem::path(model_dir) / "config.json";
      std::ifstream in;
      if (std::filesystem::is_regular_file(config)) in.open(config);
      if (in.is_open() && in) lutb_ckpt = parse_lutb_quant_config(nlohmann::json::parse(in)).has_value();
    } catch (const std::exception&) {
      // a broken config.json is reported by the loader with its file name
    }
    if (q.empty()) q = lutb_ckpt ? "lutb" : "none";
    // A stored LUT-B checkpoint is read as written: a --fitter would have no effect, so it is refused.
    if (lutb_ckpt && !fitter.empty())
      throw UsageError(fmt::format(
          "--fitter {}: {} holds stored LUT-B weights; --fitter applies only when quantising a BF16 checkpoint on "
          "the fly (--quant lutb)",
          fitter, model_dir));
    // Another --quant on stored LUT-B weights cannot apply (there are no BF16 experts to hold or to
    // quantise otherwise): a usage error (exit 2) like --fitter on the same checkpoint, not the library's
    // refusal (exit 1; docs/cli.md "Every command").
    if (lutb_ckpt && q != "lutb")
      throw UsageError(fmt::format(
          "--quant {}: {} holds stored LUT-B weights (its config.json has a LUT-B quantization_config), not BF16 "
          "experts; it runs only as --quant lutb (the default for it); for --quant {} run the BF16 checkpoint it was "
          "quantised from",
          q, model_dir, q));
    o.quant = model::quant_from_name(q);
    const std::string act = activations.empty() ? (o.quant == model::Quant::Lutb ? "mxfp8" : "bf16") : activations;
    o.activations = act == "mxfp8" ? moe::ActivationFormat::MXFP8 : moe::ActivationFormat::BF16;
    if (!fitter.empty() && o.quant != model::Quant::Lutb)
      throw UsageError(fmt::format("--fitter {} only applies to --quant lutb", fitter));
    if (!fitter.empty()) check_fitter_value(fitter);
    // Like --fitter: a LUT-B emulation kernel asked for with BF16 / INT3 / MXFP4 experts would have no
    // effect, so it is refused.
    if (kernel_opt != nullptr && kernel_opt->count() > 0 && o.quant != model::Quant::Lutb)
      throw UsageError(fmt::format("--kernel {} only applies to LUT-B experts (--quant lutb, or a LUT-B "
                                   "checkpoint); the experts here are --quant {}",
                                   kernel, q));
    o.fit.fitter = fitter.empty() ? default_fitter() : fitter;
    o.fit.threads = threads;
    if (!calibration.empty()) {
      if (o.quant != model::Quant::Lutb || lutb_ckpt)
        throw UsageError(fmt::format("--calibration {} applies to --quant lutb of a BF16 checkpoint (the fit); the "
                                     "experts here are {}",
                                     calibration, lutb_ckpt ? "stored LUT-B weights" : "--quant " + q));
      check_calibrated_fitter(o.fit.fitter);
      o.calibration = std::make_shared<const CalibrationStats>(CalibrationStats::load(calibration));
      check_statistics_layers(*o.calibration, model_dir);
    }
    o.error_feedback = error_feedback == "on";
    o.damping = damping;
    o.kernel = kernel == "reference" ? moe::EmulationKernel::Reference
               : kernel == "dequantized" ? moe::EmulationKernel::Dequantized
                                         : moe::EmulationKernel::Fast;
    return o;
  }
};

/// --device cuda for eval and moe: a --kernel (a CPU emulation kernel) does not apply (UsageError);
/// the GPU options and a usable GPU are checked before any work (check_gpu_options, require_cuda).
inline void check_cuda_request(const ModelQuantArgs& q, const model::MoeOptions& mo) {
  if (q.kernel_opt != nullptr && q.kernel_opt->count() > 0)
    throw UsageError(fmt::format("--kernel {} selects a CPU emulation kernel; it does not apply to "
                                 "--device cuda (the GPU runs its fused kernels)",
                                 q.kernel));
  check_gpu_options(mo);
  check_gpu_error_feedback(mo.calibration.get(), mo.error_feedback);
  require_cuda();
}

}  // namespace lutb::cli
