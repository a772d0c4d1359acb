// `lutb quantize`: a Hugging Face MoE checkpoint directory -> LUT-B checkpoint (spec 2.2), or the
// tensors of one safetensors file -> X_packed / X_codebook / X_scale.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <regex>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/gpu.hpp"
#include "cli/interrupt.hpp"
#include "cli/usage_hints.hpp"
#include "cli/validators.hpp"
#include "io/config_json.hpp"
#include "lutb/calibration.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"

namespace lutb::cli {

namespace {
struct QuantizeArgs {
  std::string input, output, fitter, match, calibration;
  std::string error_feedback = "on";
  double damping = 0.01;  // --damping: FitOptions::error_feedback.damping
  std::string device = "cpu";
  int threads = 0;
  bool all = false, force = false, no_progress = false, json = false;
};

// The fit of each tensor with the column weights of the statistics file (lutb/calibration.hpp),
// found by the tensor's name: `base` (the GPU fit of --device cuda) or lutb::quantize called with
// FitOptions::column_weights set, and with `error_feedback` FitOptions::error_feedback with the
// tensor's blended second moments (its experts' read for it, the layer mean once per layer and input)
// and `damping`; a tensor the statistics do not describe is an error (a file of another model would
// otherwise fit some tensors unweighted without a word).
QuantizeOptions::FitFunction calibrated_fit_function(std::shared_ptr<const CalibrationStats> stats,
                                                     const std::string& file, bool error_feedback,
                                                     double damping, QuantizeOptions::FitFunction base) {
  // The layer mean of the moments, kept from one tensor to the next (a per-expert checkpoint's E
  // tensors of one projection then read the layer once); a mutex in case fits run concurrently.
  struct Moments {
    std::mutex m;
    SecondMomentsCache cache;
  };
  auto mc = std::make_shared<Moments>();
  return [stats, file, error_feedback, damping, mc, base = std::move(base)](
             const void* src, DType t, const LutbShape& s, LutbTensor& out, const FitOptions& fit,
             const std::string& name) {
    const std::optional<std::vector<float>> w = stats->weights_for_tensor(name, s.experts, s.cols, file);
    if (!w)
      throw std::runtime_error(fmt::format("{}: no calibration statistics for tensor {} (no layer's experts prefix "
                                           "matches; were they collected on this model?)",
                                           file, name));
    FitOptions f = fit;
    f.column_weights = w->data();
    std::optional<std::vector<float>> moments;
    if (error_feedback) {
      const std::lock_guard<std::mutex> lock(mc->m);
      moments = stats->second_moments_for_tensor(name, s.experts, s.cols, file, &mc->cache);
      f.error_feedback.second_moments = moments->data();
      f.error_feedback.damping = damping;
    }
    return base ? base(src, t, s, out, f, name) : quantize(src, t, s, out, f, name);
  };
}

nlohmann::json summary_json(const QuantizeSummary& s, const std::string& in, const std::string& out) {
  const double sqnr = s.stats.sqnr_db();
  return {{"input", in},
          {"output", out},
          {"fitter", s.fitter},
          {"tensors_quantized", s.tensors_quantized},
          {"tensors_copied", s.tensors_copied},
          {"weights", s.weights},
          {"bytes_before", s.bytes_before},
          {"bytes_after", s.bytes_after},
          {"input_bytes", s.input_bytes},
          {"output_bytes", s.output_bytes},
          {"bits_per_weight", s.bits_per_weight()},
          {"sqnr_db", std::isfinite(sqnr) ? nlohmann::json(sqnr) : nlohmann::json(nullptr)},
          {"seconds", s.seconds},
          {"peak_rss_bytes", s.peak_rss_bytes},
          {"skipped_files", s.skipped_files},
          {"warnings", s.warnings}};
}

// The tensors lutb eval reads besides the routed experts, checked before anything is written (and
// scanned for NaN / Inf while copied), and config.json by lutb eval's own validation
// (model::TransformerConfig): a value lutb eval refuses (rms_norm_eps -1, num_key_value_heads not
// dividing num_attention_heads, partial_rotary_factor 2, a negative sliding_window, ...) is refused
// here, not after the quantisation by eval. Not refused: a feature lutb's model does not
// implement (model::UnsupportedConfigError: hidden_act other than silu, another rope type; the
// output is still a valid LUT-B checkpoint for other runtimes), and a checkpoint of routed experts
// only (lutb synth's, or a partial export: none of the embedding, the final norm and layer 0's
// input norm), which lutb eval cannot run anyway.
std::vector<std::string> check_model_as_eval(const std::filesystem::path& dir) {
  {
    const auto st = SafetensorsCollection::open_dir(dir);
    if (!st.contains("model.embed_tokens.weight") && !st.contains("model.norm.weight") &&
        !st.contains("model.layers.0.input_layernorm.weight"))
      return {};
  }
  try {
    (void)model::TransformerConfig::load(dir);
  } catch (const model::UnsupportedConfigError&) {
    return {};
  } catch (const model::ModelError& e) {
    throw model::ModelError(fmt::format("{} (lutb eval refuses this value; quantize checks config.json as eval does)",
                                        e.what()));
  }
  return model::LanguageModel::check_tensors(dir);
}

// --match, checked and matched once before the interrupt guard is installed.
void check_match(const QuantizeArgs& a) {
  // Every argument is checked before the file system is looked at, so that a bad --match is reported
  // before an existing output, not after the user has fixed the output.
  if (!a.match.empty()) {
    try {
      (void)std::regex(a.match);
    } catch (const std::regex_error& e) {
      throw UsageError(fmt::format("--match \"{}\": invalid regular expression: {}", a.match, e.what()));
    }
  }
  // std::regex backtracks: a pattern with nested repetition such as (a|aa)*c takes exponential time
  // on a long tensor name, and once the guard below is installed a first Ctrl-C only sets a flag
  // the matching never reads, so it would take a second Ctrl-C. The names are matched once before the
  // guard, while a signal still ends the process at once (nothing has been written yet); errors are
  // left to quantize_file, which reports them in its order.
  if (!a.match.empty() && std::filesystem::is_regular_file(a.input)) {
    try {
      const std::regex re(a.match);
      const SafetensorsFile f(a.input);
      for (const auto& n : f.names()) (void)std::regex_search(n, re);
    } catch (const std::exception&) {
    }
  }
}

// The summary on stdout, the warnings on stderr, and with --json the summary as JSON.
void print_quantize_report(const QuantizeArgs& a, const QuantizeSummary& s, const GpuFitTally& tally) {
  const bool gpu = a.device == "cuda";
  fmt::print("lutb quantize: {} -> {}\n{}", a.input, a.output, format_summary(s));
  const double wps = tally.seconds > 0 ? static_cast<double>(tally.weights) / tally.seconds : 0.0;
  if (gpu)
    fmt::print("device               cuda, {}: GPU fit {:.3f} s for {} weights ({:.3g} weights/s, host-device "
               "copies included)\n",
               cuda_device_description(), tally.seconds, tally.weights, wps);
  std::fflush(stdout);
  for (const auto& w : s.warnings) fmt::print(stderr, "lutb: warning: {}\n", w);
  if (a.json) {
    nlohmann::json j = summary_json(s, a.input, a.output);
    j["device"] = a.device;
    if (gpu) {
      j["gpu"] = cuda_device_description();
      j["gpu_fit_seconds"] = tally.seconds;
      j["gpu_fit_weights_per_second"] = wps;
    }
    fmt::print("{}\n", j.dump());
  }
}

// The output's name against the input's kind, before any work: a checkpoint folder for a folder, a
// *.safetensors file for one file.
void check_output_name(const QuantizeArgs& a) {
  namespace fs = std::filesystem;
  if (fs::is_directory(a.input))
    check_directory_output_name(a.output, "to quantise the tensors of one file, give that .safetensors file as the "
                                          "input");
  else if (fs::is_regular_file(a.input))
    check_file_output_name(a.output, "the output of one quantised file",
                           "to write a checkpoint directory, give the input checkpoint directory");
}

void run_quantize(const QuantizeArgs& a) {
  namespace fs = std::filesystem;
  check_match(a);
  check_output_name(a);
  // --device cuda: a fitter without a GPU kernel, a CPU-only build or no usable GPU is refused
  // here, before the file system is touched.
  const bool gpu = a.device == "cuda";
  std::shared_ptr<const CalibrationStats> stats;
  if (!a.calibration.empty()) {
    check_calibrated_fitter(a.fitter);
    stats = std::make_shared<const CalibrationStats>(CalibrationStats::load(a.calibration));
    if (gpu) check_gpu_error_feedback(stats.get(), a.error_feedback == "on");
  }
  if (gpu) {
    check_gpu_fitter(a.fitter);
    require_cuda();
  }
  InterruptGuard on_signal;
  warn_stale_temporaries(a.output);
  QuantizeOptions opt;
  opt.interrupt = interrupt_flag();
  opt.fit.fitter = a.fitter;
  opt.fit.threads = effective_threads(a.threads);
  opt.force = a.force;
  opt.progress = !a.no_progress;
  auto tally = std::make_shared<GpuFitTally>();
  if (gpu) opt.fit_function = gpu_fit_function(tally);
  if (stats)
    opt.fit_function = calibrated_fit_function(stats, a.calibration,
                                               a.error_feedback == "on" && stats->has_second_moments(),
                                               a.damping, opt.fit_function);
  opt.check_model = [stats](const fs::path& dir) {
    if (stats) check_statistics_layers(*stats, dir);
    return check_model_as_eval(dir);
  };
  QuantizeSummary s;
  if (fs::is_directory(a.input)) {
    if (!a.match.empty() || a.all)
      throw UsageError("--match/--all apply to a single .safetensors file, not a checkpoint directory");
    s = quantize_checkpoint(a.input, a.output, opt);
  } else if (fs::is_regular_file(a.input)) {
    s = quantize_file(a.input, a.output, a.match, opt);
  } else if (const std::string kind = lutb::detail::non_regular_kind(a.input); !kind.empty()) {
    // /dev/null or a FIFO: say what it is, not that it does not exist.
    throw std::invalid_argument(fmt::format("{}: is {}, not a checkpoint directory or a regular .safetensors file",
                                            a.input, kind));
  } else {
    throw std::invalid_argument(fmt::format("{}: no such checkpoint directory or file", a.input));
  }
  print_quantize_report(a, s, *tally);
}

}  // namespace

void add_quantize(CLI::App& app) {
  auto args = std::make_shared<QuantizeArgs>();
  auto* cmd = app.add_subcommand(
      "quantize",
      "Quantise routed experts to LUT-B. MODEL_DIR -o OUT_DIR writes a LUT-B checkpoint (spec 2.2); "
      "IN.safetensors -o OUT.safetensors quantises 2-D/3-D float tensors of one file (--match REGEX or --all, "
      "default --all)");
  cmd->footer(
      "Interruption: the output is built under OUT.tmp.PID and renamed at the end. Ctrl-C, SIGTERM or SIGHUP stop "
      "the run, remove that temporary and leave OUT exactly as it was (exit status of the signal: 130 / 143 / 129); "
      "a second signal, a second or more after the first, stops at once and leaves the temporary. Temporaries of "
      "processes that no longer exist (OUT.tmp.PID, OUT.old.PID) are reported on stderr at the start but never "
      "removed: delete them yourself (a process id unknown here may be a live run on another host sharing the "
      "filesystem).\n\n" +
      std::string(kExitStatusHelp));
  auto* in_opt = cmd->add_option("input", args->input, "checkpoint directory or .safetensors file")->required();
  auto* out_opt =
      cmd->add_option("-o,--output", args->output, "output directory (checkpoint) or file (.safetensors)")->required();
  auto* fitter_opt = cmd->add_option("--fitter", args->fitter, "LUT-B fitter: " + fitter_list());
  cmd->add_option("--threads", args->threads,
                  "threads of the fit (default 0 = all cores; more than the processors available are reduced to "
                  "that number, with a note)")
      ->check(ThreadCount());
  auto* m = cmd->add_option("--match", args->match,
                            "file mode: quantise only the tensors whose name matches this regex (default: every "
                            "2-D/3-D float tensor, as --all; ECMAScript, searched anywhere in the name; a pattern with nested repetition such as (a|aa)*c can take exponential time "
                            "on long names: Ctrl-C stops it)");
  auto* a = cmd->add_flag("--all", args->all, "file mode: quantise every 2-D/3-D float tensor (the default)");
  m->excludes(a);
  cmd->add_flag("--force", args->force,
                "replace an existing output that looks like a checkpoint (a .safetensors file, or a folder of "
                "checkpoint files or one lutb wrote; never the current folder or one above it); the new output is "
                "built aside and swapped in at the end");
  cmd->add_flag("--no-progress", args->no_progress, "no progress bar on stderr");
  cmd->add_flag("--json", args->json, "print a JSON summary as the last line of stdout");
  auto* cal_opt = cmd->add_option("--calibration", args->calibration,
                  "calibration statistics of `lutb calibrate` (STATS.safetensors): fit each routed-expert projection "
                  "under its inputs' second moments (fitters binned-dp, optimal; with --device cuda on the GPU, the "
                  "same bytes). The output format is unchanged (default: none, the data-free fit)");
  auto* feedback_opt = cmd->add_option("--error-feedback", args->error_feedback, std::string(kErrorFeedbackHelp))
                           ->check(CLI::IsMember({"on", "off"}));
  auto* damping_opt =
      cmd->add_option("--damping", args->damping, std::string(kDampingHelp))->check(NonNegativeFinite());
  add_device_option(cmd, args->device,
                    "the fit of the routed experts (cuda: the GPU fitters binned-dp and optimal, the same bytes as "
                    "the CPU; the rest of the run stays on the CPU)");
  cmd->callback([args, fitter_opt, in_opt, out_opt, cal_opt, feedback_opt, damping_opt] {
    // Empty names are named as such (the file system would say "cannot make absolute path: Invalid
    // argument []" for `-o ""`, or ": no such checkpoint directory or file").
    check_not_empty(in_opt, args->input, "input name");
    check_not_empty(out_opt, args->output, "output name");
    check_fitter_option(fitter_opt, args->fitter);
    check_not_empty(cal_opt, args->calibration, "statistics file name");
    check_error_feedback_option(feedback_opt, args->error_feedback, args->calibration);
    check_damping_option(damping_opt, args->damping, args->calibration, args->error_feedback);
    run_quantize(*args);
  });
}

}  // namespace lutb::cli
