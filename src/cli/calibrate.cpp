// `lutb calibrate MODEL_DIR --tokens FILE -o STATS.safetensors`: the second moments of the routed
// experts' projection inputs over calibration tokens (lutb/calibration.hpp), for the weighted fit of
// `lutb quantize/eval --calibration STATS`.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/interrupt.hpp"
#include "cli/model_options.hpp"
#include "cli/usage_hints.hpp"
#include "cli/validators.hpp"
#include "io/checkpoint_internal.hpp"
#include "lutb/calibration.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"

namespace lutb::cli {
namespace {

struct CalibrateArgs {
  std::string model_dir, tokens, output;
  std::string down_input = "bf16";
  std::string token_weight = "uniform";
  std::int64_t max_tokens = 0;
  int threads = 0;
  bool force = false, json = false, full_moments = false;
};

// The options and the output's name, before any work (exit status 2). The name as typed.
void check_usage(const CalibrateArgs& a) {
  namespace fs = std::filesystem;
  const std::int64_t window = model::CalibrateOptions{}.window;
  if (a.max_tokens != 0 && a.max_tokens < window)
    throw UsageError(fmt::format("--max-tokens {}: fewer than one window of {} tokens; give 0 (all the tokens) or at "
                                 "least {}",
                                 a.max_tokens, window, window));
  // The held-out tokens measure the result: statistics taken from them would leak into it.
  const fs::path val = fs::path(a.model_dir) / "val_tokens.safetensors";
  std::error_code ec;
  if (fs::exists(val) && fs::exists(a.tokens) && fs::equivalent(val, a.tokens, ec))
    throw UsageError(fmt::format("--tokens {} is the model's held-out evaluation set (val_tokens); calibrate on "
                                 "training tokens (e.g. ../shared/calib/train_tokens.safetensors)",
                                 a.tokens));
  // As quantize's file mode: the output is named like what it is, the file quantize/eval --calibration
  // read ("s.safetensors/." is "s.safetensors"). What is already there (a folder, a file without
  // --force) is the destination's state, not the command line's: refused in run_calibrate, exit 1.
  check_file_output_name(a.output, "the statistics file", "the file quantize and eval --calibration read");
}

// Bytes of the statistics file: per MoE layer and expert, gate_up.x2 [H], down.x2 [I] and tokens [1]
// as F32, with `full_moments` also gate_up.xxT [H, H] and down.hhT [I, I], a header entry of at most
// 256 bytes per tensor, and 64 KiB of metadata.
std::uint64_t statistics_bytes(const model::TransformerConfig& cfg, bool full_moments) {
  const auto H = static_cast<std::uint64_t>(cfg.hidden_size), I = static_cast<std::uint64_t>(cfg.moe_intermediate_size);
  const std::uint64_t per_expert =
      (H + I + 1) * 4u + 3u * 256u + (full_moments ? (H * H + I * I) * 4u + 2u * 256u : 0u);
  std::uint64_t n = 64u << 10;
  for (int l = 0; l < cfg.num_layers; ++l)
    if (cfg.sparse_layer[static_cast<std::size_t>(l)]) n += static_cast<std::uint64_t>(cfg.num_experts) * per_expert;
  return n;
}

void run_calibrate(const CalibrateArgs& a) {
  namespace fs = std::filesystem;
  check_usage(a);
  ensure_runtime_env();
  const int threads = use_threads(a.threads);
  // The output is checked, its missing parents created and its temporary name tried before the model
  // runs, as lutb quantize's file mode does; errors name the output, never the temporary.
  const fs::path out = lutb::detail::output_path(a.output);
  lutb::detail::check_replaceable(out, /*want_directory=*/false, a.force);
  if (std::error_code ec; fs::exists(fs::symlink_status(out, ec)) && !a.force)
    throw CheckpointError(fmt::format("{}: output file exists (use --force to replace it); nothing written",
                                      out.string()));
  const std::vector<std::int32_t> tokens = model::load_token_ids(a.tokens);
  const model::TransformerConfig cfg = model::TransformerConfig::load(a.model_dir);
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= cfg.vocab_size)
      throw model::ModelError(fmt::format("{}: input_ids[{}] = {} is outside the vocabulary [0, {}) of {}", a.tokens, i,
                                          tokens[i], cfg.vocab_size, a.model_dir));
  lutb::detail::check_free_space(out, statistics_bytes(cfg, a.full_moments), "the statistics file");
  InterruptGuard on_signal;
  warn_stale_temporaries(out);
  lutb::detail::CreatedParents parents;  // removed again if the run fails
  lutb::detail::create_parents(out, parents);
  lutb::detail::probe_temp_file(lutb::detail::temp_sibling(out), out);  // CalibrationStats::save writes OUT.tmp.PID
  model::CalibrateOptions co;
  co.max_tokens = a.max_tokens;
  co.down_input = a.down_input == "quantized-w13" ? model::DownInput::QuantizedW13 : model::DownInput::Bf16Model;
  co.fit.threads = threads;
  co.token_weight = a.token_weight == "routing" ? model::TokenWeight::RoutingWeight : model::TokenWeight::Uniform;
  co.interrupt = interrupt_flag();
  co.full_moments = a.full_moments;
  if (isatty(fileno(stderr)) && !a.json)
    co.progress = [](std::int64_t done, std::int64_t total) {
      fmt::print(stderr, "\r  windows {}/{}", done, total);
      if (done == total) fmt::print(stderr, "\n");
    };
  const auto t0 = std::chrono::steady_clock::now();
  CalibrationStats st;
  try {
    st = model::collect_calibration(a.model_dir, tokens, co);
  } catch (const Interrupted& e) {
    throw Interrupted(e.signal, fmt::format("{}; {}", e.what(), lutb::detail::target_left_clause(out)));
  } catch (const model::ModelError& e) {
    throw model::ModelError(fmt::format("{}; nothing written", e.what()));
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  st.metadata["model"] = a.model_dir;
  st.metadata["tokens_file"] = a.tokens;
  // Non-finite statistics come from a NaN or infinity the routed experts' check does not see (attention,
  // norms, the embedding): named, with the first stored tensor that holds one, and never written.
  try {
    st.check();
  } catch (const std::runtime_error& e) {
    throw model::ModelError(
        fmt::format("{}: {}{}; nothing written", out.string(), e.what(), first_non_finite_stored(a.model_dir)));
  }
  // An output that appeared during the run is replaced only with --force, and only a regular
  // .safetensors file.
  lutb::detail::check_replaceable(out, /*want_directory=*/false, a.force);
  if (!a.force && fs::exists(fs::symlink_status(out)))
    throw CheckpointError(fmt::format("{}: appeared while the statistics were collected (give --force to replace it); "
                                      "nothing written",
                                      out.string()));
  st.save(out);
  parents.armed = false;

  fmt::print("lutb calibrate: {} over {} tokens of {} -> {} ({:.1f} s)\n", a.model_dir, st.metadata["tokens"], a.tokens,
             a.output, secs);
  fmt::print("down input   {}\n", a.down_input == "quantized-w13" ? "h of the model with w13 fitted to LUT-B (MXFP8)"
                                                                    : "h of the BF16 model");
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& [l, lc] : st.layers) {
    const auto [mn, mx] = std::minmax_element(lc.tokens.begin(), lc.tokens.end());
    const auto unreached = std::count(lc.tokens.begin(), lc.tokens.end(), 0.0f);
    fmt::print("  layer {:<3} {} experts, tokens per expert {:.0f}..{:.0f}{}\n", l, lc.experts, *mn, *mx,
               unreached ? fmt::format(", {} never reached (they take the layer's statistics)", unreached) : "");
    layers.push_back({{"layer", l}, {"prefix", lc.prefix}, {"experts", lc.experts}, {"tokens", lc.tokens}});
  }
  if (a.json) {
    nlohmann::json j{{"model", a.model_dir},   {"tokens_file", a.tokens},      {"output", a.output},
                     {"tokens", std::stoll(st.metadata["tokens"])}, {"down_input", a.down_input},
                     {"seconds", secs},        {"layers", layers},
                     {"full_moments", a.full_moments}};
    fmt::print("{}\n", j.dump());
  }
  std::fflush(stdout);
}

}  // namespace

void add_calibrate(CLI::App& app) {
  auto args = std::make_shared<CalibrateArgs>();
  auto* cmd = app.add_subcommand(
      "calibrate",
      "Run a BF16 MoE checkpoint over calibration tokens and store, per layer, routed expert and projection, the "
      "input channels' second moments and the tokens routed (for quantize/eval --calibration)");
  cmd->footer(
      "Checks the output (its name, free space, that it can be created; missing parent directories are created) and "
      "refuses a NaN or infinite routed-expert weight before the model runs; statistics that are not finite are never "
      "written. Written under OUT.tmp.PID and renamed at the end: Ctrl-C, SIGTERM or SIGHUP stop the run after the "
      "current batch of windows and leave OUT as it was (exit status of the signal: 130 / 143 / 129).\n\n" +
      std::string(kExitStatusHelp));
  auto* dir_opt = cmd->add_option("model_dir", args->model_dir, "Hugging Face checkpoint directory (BF16)")->required();
  auto* tok_opt = cmd->add_option("--tokens", args->tokens,
                                  "safetensors file with input_ids (training tokens; never the held-out val_tokens)")
                      ->required();
  auto* out_opt = cmd->add_option("-o,--output", args->output,
                                  "statistics file to write (*.safetensors; missing parent directories are created)")
                      ->required();
  cmd->add_option("--max-tokens", args->max_tokens,
                  "use only the first N tokens, in whole windows of 256 (default 0 = all; else at least 256)")
      ->check(IntRange<std::int64_t>(0, std::numeric_limits<std::int64_t>::max()));
  cmd->add_option("--down-input", args->down_input,
                  "what the statistics of down (w2) describe: bf16 (h of the BF16 model, default) or quantized-w13 "
                  "(h with w13 already fitted to LUT-B under the gate_up statistics, MXFP8 activations; a second pass)")
      ->check(CLI::IsMember({"bf16", "quantized-w13"}));
  cmd->add_option("--token-weight", args->token_weight,
                  "how a routed token counts in its expert's statistics: uniform (default) or routing (by the square "
                  "of its routing weight, which scales the expert's output error)")
      ->check(CLI::IsMember({"uniform", "routing"}));
  cmd->add_flag("--full-moments", args->full_moments,
                "also store the full second moments E[x x^T] and E[h h^T] of every expert's inputs (PREFIX.e.gate_up.xxT, "
                "PREFIX.e.down.hhT: hidden_size^2 + moe_intermediate_size^2 floats per expert), which quantize/eval "
                "--calibration use for cross-column error feedback (docs/calibration.md)");
  cmd->add_option("--threads", args->threads, "threads (default: all cores)")->check(ThreadCount());
  cmd->add_flag("--force", args->force, "replace an existing statistics file (a regular .safetensors file)");
  cmd->add_flag("--json", args->json, "print one JSON object as the last line of stdout");
  cmd->callback([args, dir_opt, tok_opt, out_opt] {
    check_not_empty(dir_opt, args->model_dir, "checkpoint directory name");
    check_not_empty(tok_opt, args->tokens, "tokens file name");
    check_not_empty(out_opt, args->output, "output name");
    run_calibrate(*args);
  });
}

}  // namespace lutb::cli
