// `lutb synth`: writes a synthetic MoE checkpoint at a real model's shapes (see synth_config()).
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include <fmt/core.h>

#include "cli/commands.hpp"
#include "lutb/checkpoint.hpp"

namespace lutb::cli {

namespace {
struct SynthArgs {
  std::string family = "qwen3_moe", output;
  SynthOptions opt;
  bool no_progress = false;
};
}  // namespace

void add_synth(CLI::App& app) {
  auto args = std::make_shared<SynthArgs>();
  std::string fams;
  for (const auto& n : family_names()) fams += (fams.empty() ? "" : ", ") + n;
  auto* cmd = app.add_subcommand(
      "synth",
      "Synthesise a MoE checkpoint at the real shapes of a large model of the family (Qwen3-30B-A3B, "
      "Qwen1.5-MoE-A2.7B, Mixtral-8x7B, DeepSeek-V3, DeepSeek-V2-Lite, OLMoE-1B-7B): MoE blocks only, "
      "heavy-tailed (Student-t) BF16 weights, deterministic");
  cmd->add_option("--family", args->family, "model family: " + fams)->required();
  cmd->add_option("--layers", args->opt.layers, "number of MoE layers")->required()->check(CLI::PositiveNumber);
  cmd->add_option("-o,--output", args->output, "output directory (must not exist unless --force)")->required();
  cmd->add_option("--seed", args->opt.seed, "random seed (default 1234)");
  cmd->add_option("--nu", args->opt.student_nu, "Student-t degrees of freedom (default 5)");
  cmd->add_flag("--stacked", args->opt.stacked, "write stacked gate_up_proj [E, 2I, H] / down_proj [E, H, I] tensors");
  cmd->add_option("--hidden-size", args->opt.hidden_size, "override hidden_size (tests)");
  cmd->add_option("--moe-intermediate-size", args->opt.moe_intermediate_size, "override the expert width (tests)");
  cmd->add_option("--experts", args->opt.num_experts, "override the number of routed experts (tests)");
  cmd->add_flag("--force", args->opt.force, "replace an existing output directory");
  cmd->add_flag("--no-progress", args->no_progress, "no progress bar on stderr");
  cmd->callback([args, fams] {
    auto f = family_from_name(args->family);
    if (!f) throw std::invalid_argument(fmt::format("--family {}: unknown family (supported: {})", args->family, fams));
    args->opt.family = *f;
    args->opt.progress = !args->no_progress;
    const ModelConfig c = synth_config(args->opt);
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t bytes = synthesize_checkpoint(args->output, args->opt);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("lutb synth: {} ({} layers, E {}, H {}, I {}, k {}) -> {}: {:.2f} GB in {:.1f} s\n", c.model_type,
               c.num_hidden_layers, c.num_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok,
               args->output, static_cast<double>(bytes) / 1e9, s);
  });
}

}  // namespace lutb::cli
