// `lutb eval MODEL_DIR`: held-out loss of a whole MoE language model (spec section 8), on the CPU or
// with the routed experts on the GPU (--device cuda), with the routed experts in BF16, LUT-B (online
// or stored) or a baseline format.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <unistd.h>
#include <memory>
#include <string>

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/gpu.hpp"
#include "cli/validators.hpp"
#include "cli/model_options.hpp"
#include "lutb/fit.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"

namespace lutb::cli {
namespace {

struct EvalArgs {
  std::string model_dir;
  ModelQuantArgs quant;
  std::string old_activations;  // --activations, the old name of --act-format
  bool old_activations_note = false;
  std::string tokens;
  bool json = false;
  int threads = 0;
  std::int64_t max_windows = 0;
  std::int64_t batch = 8;
  std::string device = "cpu";
};

nlohmann::json number_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

// A checkpoint of `lutb synth` (or the default job's --keep) holds MoE blocks only: say so, rather
// than "tokens file not found" or "missing tensor model.embed_tokens.weight".
void refuse_synthetic(const EvalArgs& a, const model::TransformerConfig& config) {
  if (config.raw.contains("lutb_synthetic"))
    throw model::ModelError(fmt::format(
        "{}: a synthetic checkpoint of lutb synth ({} has 'lutb_synthetic'): it holds MoE blocks only, no "
        "embeddings or attention, so it is not a language model lutb eval can run; run one of its MoE blocks with "
        "lutb moe {} --layer L --activations FILE",
        a.model_dir, (std::filesystem::path(a.model_dir) / "config.json").string(), a.model_dir));
}

// The evaluation tokens: at least one window, every id inside the vocabulary.
std::vector<std::int32_t> load_tokens(const EvalArgs& a, const model::TransformerConfig& config,
                                      const model::EvalOptions& eo) {
  const std::filesystem::path tokens_path =
      a.tokens.empty() ? std::filesystem::path(a.model_dir) / "val_tokens.safetensors" : std::filesystem::path(a.tokens);
  // The default file missing: say which option replaces it.
  if (a.tokens.empty() && !std::filesystem::exists(tokens_path))
    throw model::ModelError(fmt::format("{}: tokens file not found (the default of --tokens); pass --tokens FILE, a "
                                        "safetensors file with input_ids",
                                        tokens_path.string()));
  std::vector<std::int32_t> tokens = model::load_token_ids(tokens_path);
  if (static_cast<std::int64_t>(tokens.size()) < eo.window)
    throw model::ModelError(fmt::format("{}: input_ids holds {} tokens, fewer than one evaluation window of {}",
                                        tokens_path.string(), tokens.size(), eo.window));
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= config.vocab_size)
      throw model::ModelError(fmt::format("{}: input_ids[{}] = {} is outside the vocabulary [0, {}) of {}",
                                          tokens_path.string(), i, tokens[i], config.vocab_size, a.model_dir));
  return tokens;
}

// A NaN or Inf anywhere (e.g. a stored weight_scale of 2^127 or a NaN codebook entry) makes the loss
// meaningless: an error naming the first tensor with non-finite values, not a number to report.
[[noreturn]] void refuse_non_finite_loss(const EvalArgs& a, const model::CheckpointMoe& moe,
                                         const model::EvalResult& r) {
  std::string where;
  for (const auto& s : moe.stats())
    if (const double v = s.sqnr_db(); std::isnan(v) || (std::isinf(v) && v < 0)) {
      where = fmt::format("; the first tensor with non-finite values is {} (layer {})", s.name, s.layer);
      break;
    }
  if (where.empty()) where = first_non_finite_stored(a.model_dir);
  throw model::ModelError(fmt::format(
      "{}: non-finite loss ({}) over {} predicted tokens: a weight, scale or activation overflowed or is NaN{}; "
      "the checkpoint's tensors are likely corrupt",
      a.model_dir, r.val_loss, r.tokens, where));
}

// What the report says besides the loss.
struct EvalReport {
  std::string quant, act, fitter;
  double sqnr = 0, tps = 0, load_s = 0;
  bool fitted = false;
};

void print_eval_json(const EvalArgs& a, const model::TransformerConfig& cfg, const model::CheckpointMoe& moe,
                     const model::EvalResult& r, const EvalReport& rep, const FitPlacement& fit) {
  nlohmann::json j;
  j["model"] = a.model_dir;
  j["family"] = cfg.family;
  j["val_loss"] = r.val_loss;
  j["tokens"] = r.tokens;
  j["windows"] = r.windows;
  j["quant"] = rep.quant;
  j["activations"] = rep.act;
  j["fitter"] = rep.fitter.empty() ? nlohmann::json(nullptr) : nlohmann::json(rep.fitter);
  j["lutb_checkpoint"] = moe.lutb_checkpoint();
  j["sqnr_db"] = number_or_null(rep.sqnr);
  j["bits_per_weight"] = moe.bits_per_weight();
  j["expert_bytes_bf16"] = moe.source_bytes();
  j["expert_bytes"] = moe.held_bytes();
  j["seconds"] = r.seconds;
  j["load_seconds"] = rep.load_s;
  if (rep.fitted) add_fit_json(j, fit);
  j["device"] = a.device;
  j["tokens_per_second"] = rep.tps;
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& s : moe.stats())
    tensors.push_back({{"name", s.name}, {"layer", s.layer}, {"sqnr_db", number_or_null(s.sqnr_db())},
                       {"weights", s.weights}, {"bytes", s.quantized_bytes}});
  j["tensors"] = tensors;
  fmt::print("{}\n", j.dump());
}

void print_eval_report(const EvalArgs& a, const model::TransformerConfig& cfg, const model::CheckpointMoe& moe,
                       const model::MoeOptions& mo, const model::EvalResult& r, const model::EvalOptions& eo,
                       const EvalReport& rep, const FitPlacement& fit) {
  fmt::print("model        {} ({}, {} layers, hidden {}, {} experts x {})\n", a.model_dir, cfg.family, cfg.num_layers,
             cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size);
  fmt::print("experts      quant {}{}, activations {}{}\n", rep.quant,
             rep.fitter.empty() ? "" : " (fitter " + rep.fitter + ")", rep.act,
             moe.lutb_checkpoint() ? ", stored LUT-B weights" : "");
  for (const auto& s : moe.stats())
    fmt::print("  {:<48} SQNR {:7.3f} dB\n", s.name, s.sqnr_db());
  if (!moe.stats().empty()) fmt::print("  aggregate SQNR {:.3f} dB\n", rep.sqnr);
  fmt::print("size         routed experts {} bytes as BF16, {} bytes held ({:.4f} bits per weight)\n",
             moe.source_bytes(), moe.held_bytes(), moe.bits_per_weight());
  fmt::print("val loss     {:.6f} nats over {} predicted tokens ({} window{} of {})\n", r.val_loss, r.tokens, r.windows,
             r.windows == 1 ? "" : "s", eo.window);
  fmt::print("time         load {:.2f} s, eval {:.2f} s, {:.0f} tokens/s\n", rep.load_s, r.seconds, rep.tps);
  if (rep.fitted) print_fit_line(fit, mo.fit.fitter);
  if (a.device == "cuda")
    fmt::print("device       cuda, {}: routed experts of every MoE block on the GPU\n", cuda_device_description());
  if (a.json) print_eval_json(a, cfg, moe, r, rep, fit);
}

void run_eval(const EvalArgs& a) {
  ensure_runtime_env();
  if (a.old_activations_note)
    fmt::print(stderr, "lutb: note: `lutb eval --activations {}` is the old spelling of --act-format {} (lutb moe's "
                       "--activations names a file); use --act-format\n",
               a.old_activations, a.old_activations);
  const int threads = use_threads(a.threads);
  model::MoeOptions mo = a.quant.resolve(a.model_dir, threads);
  const bool gpu = a.device == "cuda";
  if (gpu) check_cuda_request(a.quant, mo);
  // --quant lutb on a BF16 checkpoint fits at load: with --device cuda on the GPU (the same bytes).
  const FitPlacement fit = place_fit(mo, gpu);
  // The config and the tokens first, so that a bad file fails before the weights load; every
  // message names its file.
  const model::TransformerConfig config = model::TransformerConfig::load(a.model_dir);
  refuse_synthetic(a, config);
  model::EvalOptions eo;
  eo.max_windows = a.max_windows;
  eo.batch = a.batch;
  const std::vector<std::int32_t> tokens = load_tokens(a, config, eo);
  check_model_tensor_names(a.model_dir, config.moe, "eval");
  const auto t0 = std::chrono::steady_clock::now();
  model::CheckpointMoe moe(a.model_dir, mo);
  // --device cuda: each MoE block's routed experts run on the GPU (src/cli/gpu.hpp GpuMoeBlock), the
  // rest of the model on the CPU.
  model::LanguageModel lm =
      model::LanguageModel::load(a.model_dir, gpu ? gpu_factory(moe.factory(), mo) : moe.factory());
  EvalReport rep;
  rep.load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const bool tty = isatty(fileno(stderr));
  if (tty && !a.json)
    eo.progress = [](std::int64_t done, std::int64_t total) {
      fmt::print(stderr, "\r  windows {}/{}", done, total);
      if (done == total) fmt::print(stderr, "\n");
    };
  warn_low_sqnr(moe, mo);
  const model::EvalResult r = model::evaluate(lm, tokens, eo);
  if (!std::isfinite(r.val_loss)) refuse_non_finite_loss(a, moe, r);

  const auto& cfg = lm.config();
  rep.quant = model::quant_name(mo.quant);
  rep.act = activation_name(mo.activations);
  rep.fitter = mo.quant == model::Quant::Lutb ? mo.fit.fitter : "";
  if (moe.lutb_checkpoint()) {  // the fitter that wrote the stored weights
    const auto qc = parse_lutb_quant_config(cfg.raw);
    rep.fitter = qc ? qc->fitter : "";
  }
  rep.sqnr = moe.aggregate_sqnr_db();
  rep.tps = r.seconds > 0 ? static_cast<double>(r.windows * eo.window) / r.seconds : 0.0;
  rep.fitted = fit.fits && !moe.lutb_checkpoint();
  print_eval_report(a, cfg, moe, mo, r, eo, rep, fit);
  std::fflush(stdout);
}

}  // namespace

void add_eval(CLI::App& app) {
  auto args = std::make_shared<EvalArgs>();
  auto* cmd = app.add_subcommand("eval",
                                 "Held-out loss of a MoE language model (spec section 8): on the CPU, or with "
                                 "--device cuda the routed experts on the GPU");
  auto* dir_opt =
      cmd->add_option("model_dir", args->model_dir, "Hugging Face checkpoint directory (BF16 or LUT-B)")->required();
  // The activation format is --act-format, as in `lutb moe`, whose --activations names the
  // captured-activations file; one flag must not mean a format here and a file there. --activations FORMAT
  // is still read, hidden from --help, with a note; a file name given to it is refused with what to
  // use instead.
  args->quant.add_to(cmd, "--act-format");
  auto* old_act = cmd->add_option("--activations", args->old_activations,
                                  "old name of --act-format (lutb moe's --activations is a file)")
                      ->group("");
  auto* tokens_opt =
      cmd->add_option("--tokens", args->tokens, "safetensors file with input_ids (default MODEL_DIR/val_tokens.safetensors)");
  cmd->add_flag("--json", args->json, "print one JSON object as the last line of stdout");
  cmd->add_option("--threads", args->threads,
                  "threads (default: all cores; more than the processors available are reduced to that number, "
                  "with a note)")
      ->check(ThreadCount());
  cmd->add_option("--max-windows", args->max_windows,
                  "evaluate only the first N windows of 256 tokens (default 0 = all; spec section 8)")
      ->check(IntRange<std::int64_t>(0, std::numeric_limits<std::int64_t>::max()));
  cmd->add_option("--batch", args->batch,
                  "windows of 256 tokens per forward pass (default 8; changes only the FP32 summation order: results "
                  "agree to ~1e-5)")->check(IntRange<std::int64_t>(1, 4096));
  add_device_option(cmd, args->device,
                    "the routed experts of every MoE block (cuda: LUT-B with MXFP8 activations, or --quant none's "
                    "BF16 baseline, on the GPU, and --quant lutb of a BF16 checkpoint fitted there; the rest of the "
                    "model on the CPU)");
  cmd->callback([args, tokens_opt, dir_opt, old_act] {
    if (old_act->count() > 0) {
      const std::string& v = args->old_activations;
      if (v != "bf16" && v != "mxfp8")
        throw CLI::ValidationError(
            "--activations",
            fmt::format("'{}': lutb eval takes no captured-activations file (that is lutb moe --activations FILE); "
                        "the activation format of the expert GEMMs is --act-format bf16|mxfp8",
                        v));
      if (!args->quant.activations.empty() && args->quant.activations != v)
        throw CLI::ValidationError("--activations", fmt::format("{} contradicts --act-format {}; give --act-format only",
                                                                v, args->quant.activations));
      args->quant.activations = v;
      args->old_activations_note = true;  // printed by run_eval, once (it may re-execute this process)
    }
    check_not_empty(dir_opt, args->model_dir, "checkpoint directory name");  // not ": no such directory"
    check_not_empty(tokens_opt, args->tokens, "tokens file name");
    run_eval(*args);
  });
}

}  // namespace lutb::cli
