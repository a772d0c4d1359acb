// `lutb synth`: writes a synthetic MoE checkpoint at a real model's shapes (see synth_config()).
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>

#include <fmt/core.h>

#include "cli/commands.hpp"
#include "cli/interrupt.hpp"
#include "cli/usage_hints.hpp"
#include "cli/validators.hpp"
#include "lutb/checkpoint.hpp"

namespace lutb::cli {

namespace {
// Bounds of the size options: generous beside the largest published MoE models (DeepSeek-V3 61
// layers, H 7168; Mixtral-8x22B I 16384; 512 experts), small enough that no product overflows.
constexpr std::int64_t kMaxLayers = 1024, kMaxWidth = 65536, kMaxExperts = 4096;

struct SynthArgs {
  std::string family = "qwen3_moe", output;
  SynthOptions opt;
  bool no_progress = false;
};

// Decimal bytes in the unit that keeps three digits: "3.15 MB", "61.35 GB", "26 bytes" (never
// "0.00 GB" for a small checkpoint).
std::string size_text(std::uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e12) return fmt::format("{:.2f} TB", b / 1e12);
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} kB", b / 1e3);
  return fmt::format("{} bytes", bytes);
}
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
  cmd->footer(
      "Checks the destination and the free space first, then prints the bytes it will write. Written under OUT.tmp.PID and "
      "renamed at the end: Ctrl-C, SIGTERM or SIGHUP remove the temporary and leave OUT as it was (exit status of "
      "the signal: 130 / 143 / 129); temporaries of dead processes are reported at the start, never removed.\n\n" +
      std::string(kExitStatusHelp));
  cmd->add_option("--family", args->family, "model family: " + fams)->required();
  cmd->add_option("--layers", args->opt.layers, "number of decoder layers, every one a MoE layer (1..1024)")->required()->check(IntRange<std::int64_t>(1, kMaxLayers));
  auto* out_opt =
      cmd->add_option("-o,--output", args->output, "output directory (must not exist unless --force)")->required();
  cmd->add_option("--seed", args->opt.seed, "random seed (default 1234)")
      ->check(IntRange<std::uint64_t>(0, std::numeric_limits<std::uint64_t>::max()));
  auto* nu_opt = cmd->add_option("--nu", args->opt.student_nu, "Student-t degrees of freedom, a number in (2, 1e6] (default 5)");
  cmd->add_flag("--stacked", args->opt.stacked, "write stacked gate_up_proj [E, 2I, H] / down_proj [E, H, I] tensors");
  // The help gives the default and the reason to use a smaller size.
  cmd->add_option("--hidden-size", args->opt.hidden_size,
                  "hidden size H (default: the family's, e.g. 2048 for qwen3_moe, 4096 for mixtral); smaller sizes "
                  "make a quick checkpoint for tests")
      ->check(IntRange<std::int64_t>(1, kMaxWidth));
  cmd->add_option("--moe-intermediate-size", args->opt.moe_intermediate_size,
                  "expert width I, rows of each expert's gate and up (default: the family's, e.g. 768 for qwen3_moe)")
      ->check(IntRange<std::int64_t>(1, kMaxWidth));
  cmd->add_option("--experts", args->opt.num_experts,
                  "routed experts per layer (default: the family's, e.g. 128 for qwen3_moe); top-k is capped at it")
      ->check(IntRange<std::int64_t>(1, kMaxExperts));
  cmd->add_flag("--force", args->opt.force,
                "replace an existing output directory that looks like a checkpoint (never the current folder or one "
                "above it)");
  cmd->add_flag("--no-progress", args->no_progress, "no progress bar on stderr");
  cmd->callback([args, fams, nu_opt, out_opt] {
    // `-o ""` is a usage error naming the option, as in quantize (the library's refusal, "synth: no
    // output directory given", exits 1).
    check_not_empty(out_opt, args->output, "output name");
    check_directory_output_name(args->output, "a checkpoint is a folder of config.json and *.safetensors files");
    auto f = family_from_name(args->family);
    if (!f) throw UsageError(fmt::format("--family {}: unknown family (supported: {})", args->family, fams));
    // The value as typed ("--nu 1e400", not "--nu inf"), and the library's upper bound, so that the
    // library's own check ("synth: student_nu must be in (2, 1e6]") is never the first to refuse.
    if (!std::isfinite(args->opt.student_nu) || !(args->opt.student_nu > 2.0) || args->opt.student_nu > 1e6)
      throw UsageError(fmt::format(
          "--nu {}: must be a number in (2, 1e6] (the Student-t variance is finite only above 2; above 1e6 the "
          "distribution is numerically Gaussian)",
          nu_opt->results().empty() ? fmt::format("{}", args->opt.student_nu) : nu_opt->results().front()));
    args->opt.family = *f;
    args->opt.progress = !args->no_progress;
    const ModelConfig c = synth_config(args->opt);
    InterruptGuard on_signal;
    args->opt.interrupt = interrupt_flag();
    warn_stale_temporaries(args->output);
    // Announced only once the library has checked everything (destination, free space) and
    // created its temporary: a refusal prints nothing but the error.
    args->opt.on_start = [out = args->output](std::uint64_t planned) {
      // ("8 bytes (8 bytes)" below a kilobyte.)
      fmt::print("lutb synth: will write {} bytes{} of BF16 tensors to {}\n", planned,
                 planned >= 1000 ? " (" + size_text(planned) + ")" : std::string(), out);
      std::fflush(stdout);
    };
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t bytes = synthesize_checkpoint(args->output, args->opt);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    fmt::print("lutb synth: {} ({} layer{}, E {}, H {}, I {}, k {}) -> {}: {} in {:.1f} s\n", c.model_type,
               c.num_hidden_layers, c.num_hidden_layers == 1 ? "" : "s", c.num_experts, c.hidden_size,
               c.moe_intermediate_size, c.num_experts_per_tok, args->output, size_text(bytes), s);
  });
}

}  // namespace lutb::cli
