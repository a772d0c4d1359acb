// `lutb moe MODEL_DIR --layer L --activations FILE`: one sparse MoE block on captured inputs
// (layers.L.moe_input) against the captured outputs (layers.L.moe_output).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <system_error>

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/gpu.hpp"
#include "cli/validators.hpp"
#include "cli/model_options.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"

namespace lutb::cli {
namespace {

struct MoeArgs {
  std::string model_dir;
  int layer = -1;
  std::string activations_file;
  ModelQuantArgs quant;
  bool json = false;
  int threads = 0;
  std::string device = "cpu";
  bool compare_cpu = false;
  int reps = 20;
};

// The captured-activations file of the model folders in ../shared/models (beside val_tokens.safetensors).
constexpr const char* kDefaultActivations = "moe_activations.safetensors";

std::vector<float> captured(const SafetensorsFile& f, const std::string& name, std::int64_t H) {
  if (!f.contains(name))
    throw std::runtime_error(fmt::format("{}: no tensor {} (captured MoE activations of that layer)", f.path().string(), name));
  const TensorView& t = f.get(name);
  if (t.shape.size() != 2 || t.shape[1] != H)
    throw std::runtime_error(fmt::format("{}: tensor {} has shape [{}], expected [tokens, {}]", f.path().string(), name,
                                         fmt::join(t.shape, ", "), H));
  // No tokens: the error is undefined ("rel_l2 -nan ... cosine -nan"), so the file is refused.
  if (t.shape[0] == 0)
    throw std::runtime_error(fmt::format("{}: tensor {} has shape [{}]: it holds no tokens to run the block on",
                                         f.path().string(), name, fmt::join(t.shape, ", ")));
  // Another dtype is refused naming the file too, not only the tensor.
  if (t.dtype != DType::BF16 && t.dtype != DType::F16 && t.dtype != DType::F32 && t.dtype != DType::F64 &&
      t.dtype != DType::F8_E4M3)
    throw std::runtime_error(fmt::format("{}: tensor {} has dtype {}; captured activations must be floating point "
                                         "(BF16, F16, F32, F64 or F8_E4M3)",
                                         f.path().string(), name, dtype_name(t.dtype)));
  std::vector<float> v = t.to_float();
  // A NaN / Inf in the captured activations is refused before computing, naming the tensor and the
  // place (after the run it would show only as "rel_l2 nan").
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      throw std::runtime_error(fmt::format("{}: tensor {} holds {} at row {} col {} (token {}, hidden unit {}): the "
                                           "captured activations must be finite",
                                           f.path().string(), name, std::isnan(v[i]) ? "NaN" : (v[i] > 0 ? "+Inf" : "-Inf"),
                                           static_cast<std::int64_t>(i) / H, static_cast<std::int64_t>(i) % H,
                                           static_cast<std::int64_t>(i) / H, static_cast<std::int64_t>(i) % H));
  return v;
}

// The activations file: given (or found in the model folder) and present; eval's --activations
// takes a format, so a format given here is a usage error naming the right option.
void check_activations_file(const MoeArgs& a) {
  if (a.activations_file.empty())
    throw UsageError(fmt::format("--activations not given and {} holds no {} (the captured MoE inputs and "
                                 "outputs); give the file with --activations FILE",
                                 a.model_dir, kDefaultActivations));
  if (!std::filesystem::exists(a.activations_file)) {
    if (a.activations_file == "mxfp8" || a.activations_file == "bf16")  // eval's --activations takes a format
      throw UsageError(fmt::format("--activations {}: --activations takes a file for `moe` (captured MoE "
                                   "inputs, a .safetensors); the format is --act-format {}",
                                   a.activations_file, a.activations_file));
    throw std::runtime_error(fmt::format("{}: activations file not found", a.activations_file));
  }
}

// --layer must be a MoE layer of the model. A dense layer (DeepSeek's first_k_dense_replace, Qwen's
// mlp_only_layers) is a usage error too, as an index beyond the layers is (exit 2, not the
// library's refusal with 1).
void check_layer(const MoeArgs& a, const model::TransformerConfig& cfg) {
  if (a.layer < 0 || a.layer >= cfg.num_layers)
    throw UsageError(fmt::format("--layer {} is out of range: {} has layers 0..{}", a.layer, a.model_dir, cfg.num_layers - 1));
  if (!cfg.moe.is_moe_layer(a.layer)) {
    const auto ml = cfg.moe.moe_layers();
    throw UsageError(fmt::format("--layer {}: layer {} of {} is a dense (non-MoE) layer per {} (its MoE layers: {})",
                                 a.layer, a.layer, a.model_dir,
                                 (std::filesystem::path(a.model_dir) / "config.json").string(),
                                 ml.empty() ? std::string("none") : fmt::format("{}", fmt::join(ml, ", "))));
  }
}

// The captured inputs and outputs of the layer, [T][H] each.
struct Captured {
  std::vector<float> x, ref;
  std::int64_t T = 0;
};

Captured read_captured(const MoeArgs& a, std::int64_t H) {
  const SafetensorsFile acts(a.activations_file);
  Captured c;
  c.x = captured(acts, fmt::format("layers.{}.moe_input", a.layer), H);
  c.ref = captured(acts, fmt::format("layers.{}.moe_output", a.layer), H);
  if (c.x.size() != c.ref.size())
    throw std::runtime_error(fmt::format("{}: layers.{}.moe_input and moe_output have different token counts",
                                         a.activations_file, a.layer));
  c.T = static_cast<std::int64_t>(c.x.size()) / H;
  // The error is relative to the captured outputs: all zero, it is undefined ("rel_l2 inf ... cosine
  // -nan"). A MoE block's output is never exactly zero on real inputs: such a file was captured
  // wrongly, and is refused.
  if (std::all_of(c.ref.begin(), c.ref.end(), [](float v) { return v == 0.0f; }))
    throw std::runtime_error(fmt::format("{}: tensor layers.{}.moe_output is all zero ({} tokens): the error relative "
                                         "to it is undefined; were the outputs captured?",
                                         a.activations_file, a.layer, c.T));
  return c;
}

// The block's output against the captured one.
struct OutputError {
  double rel_l2 = 0, cosine = 0, max_abs = 0;
  std::size_t non_finite = 0;  // outputs that are NaN or infinite
};

OutputError output_error(const std::vector<float>& out, const std::vector<float>& ref) {
  double diff2 = 0, ref2 = 0, out2 = 0, dot = 0, max_abs = 0;
  std::size_t non_finite = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) ++non_finite;
    const double d = static_cast<double>(out[i]) - ref[i];
    diff2 += d * d;
    ref2 += static_cast<double>(ref[i]) * ref[i];
    out2 += static_cast<double>(out[i]) * out[i];
    dot += static_cast<double>(out[i]) * ref[i];
    max_abs = std::isnan(d) ? d : std::max(max_abs, std::fabs(d));  // NaN propagates, never hides
  }
  return {std::sqrt(diff2 / ref2), dot / std::sqrt(out2 * ref2), max_abs, non_finite};
}

// Refused before any result is printed, so that no "rel_l2 nan" line (or --json's "rel_l2": null)
// precedes the error. Names the tensor, as lutb eval does: the first of the layer with a non-finite
// SQNR (stored LUT-B weights), else the first stored tensor of the layer holding NaN / Inf (an
// infinite router weight, say), rather than only "a weight, scale or input of the layer is NaN or
// overflowed".
[[noreturn]] void refuse_non_finite(const MoeArgs& a, const model::CheckpointMoe& moe, std::size_t non_finite,
                                    std::size_t outputs) {
  std::string where;
  for (const auto& s : moe.stats())
    if (const double v = s.sqnr_db(); s.layer == a.layer && (std::isnan(v) || (std::isinf(v) && v < 0))) {
      where = fmt::format("; the first tensor with non-finite values is {}", s.name);
      break;
    }
  if (where.empty()) where = first_non_finite_stored(a.model_dir, moe_prefix(moe.config().moe, a.layer) + ".");
  throw std::runtime_error(fmt::format("{}: layer {}: {} of {} outputs are NaN or infinite (on the inputs of {}): a "
                                       "weight, scale or input of the layer is NaN or overflowed{}",
                                       a.model_dir, a.layer, non_finite, outputs, a.activations_file, where));
}

// --device cuda: the routed experts' GPU time and, with --compare-cpu, the difference from the CPU
// emulation.
struct GpuReport {
  std::string name;
  double ms = 0, cpu_rel = 0, cpu_max = 0;
};

GpuReport report_gpu(const MoeArgs& a, GpuMoeBlock& gpu_block, const Captured& in, const std::vector<float>& out) {
  GpuReport r;
  r.name = cuda_device_description();
  r.ms = gpu_block.time_routed_ms(a.reps);
  fmt::print("device cuda, {}: routing {}; routed-expert forward {:.4f} ms on the GPU (median of {}, CUDA events)\n",
             r.name, gpu_block.routing_note(), r.ms, a.reps);
  if (!a.compare_cpu) return r;
  std::vector<float> cpu_out(in.x.size());
  gpu_block.cpu().forward(in.x.data(), in.T, cpu_out.data());
  double d2 = 0, c2 = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const double d = static_cast<double>(out[i]) - cpu_out[i];
    d2 += d * d;
    c2 += static_cast<double>(cpu_out[i]) * cpu_out[i];
    r.cpu_max = std::isnan(d) ? d : std::max(r.cpu_max, std::fabs(d));
  }
  r.cpu_rel = std::sqrt(d2 / c2);
  fmt::print("vs --device cpu: rel_l2 {:.6g}  max_abs {:.6g} (both read bf16(x) and round the routed sum to BF16, "
             "spec section 4; the fused kernel sums in another FP32 order)\n",
             r.cpu_rel, r.cpu_max);
  return r;
}

void run_moe(const MoeArgs& a) {
  ensure_runtime_env();
  const int threads = use_threads(a.threads);
  // The model folder first, worded by TransformerConfig::load as lutb eval does: a missing folder is
  // the problem, not the --activations it would hold.
  if (!std::filesystem::is_directory(a.model_dir)) (void)model::TransformerConfig::load(a.model_dir);
  model::MoeOptions mo = a.quant.resolve(a.model_dir, threads);
  const bool gpu = a.device == "cuda";
  if (gpu) check_cuda_request(a.quant, mo);
  // --quant lutb on a BF16 checkpoint fits at load: with --device cuda on the GPU (the same bytes).
  const FitPlacement fit = place_fit(mo, gpu);
  // The model folder's config.json before the activations file, as lutb eval checks it before its
  // tokens: an empty folder, a config.json that is a FIFO or holds [1,2] is reported as such, not as
  // "--activations not given and DIR holds no moe_activations.safetensors".
  (void)model::TransformerConfig::load(a.model_dir);
  check_activations_file(a);
  model::CheckpointMoe moe(a.model_dir, mo);
  const auto& cfg = moe.config();
  check_model_tensor_names(a.model_dir, cfg.moe, "moe");
  check_layer(a, cfg);
  std::unique_ptr<model::MoeBlock> block = moe.build(a.layer);
  warn_low_sqnr(moe, mo);
  GpuMoeBlock* gpu_block = nullptr;
  if (gpu) {  // the routed experts uploaded; router logits and shared experts stay in the CPU block
    auto g = std::make_unique<GpuMoeBlock>(std::move(block), mo);
    gpu_block = g.get();
    block = std::move(g);
  }
  const Captured in = read_captured(a, cfg.hidden_size);

  std::vector<float> out(in.x.size());
  const auto t0 = std::chrono::steady_clock::now();
  block->forward(in.x.data(), in.T, out.data());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const OutputError e = output_error(out, in.ref);
  if (e.non_finite > 0) refuse_non_finite(a, moe, e.non_finite, out.size());
  const std::string quant = model::quant_name(mo.quant);
  const std::string act = activation_name(mo.activations);

  fmt::print("layer {} of {} ({}), {} tokens, quant {}, activations {}\n", a.layer, a.model_dir, cfg.family, in.T, quant,
             act);
  for (const auto& s : moe.stats()) fmt::print("  {:<48} SQNR {:7.3f} dB\n", s.name, s.sqnr_db());
  fmt::print("rel_l2 {:.6g}  max_abs {:.6g}  cosine {:.8f}  ({:.3f} s)\n", e.rel_l2, e.max_abs, e.cosine, secs);
  const bool fitted = fit.fits && !moe.lutb_checkpoint();
  if (fitted) print_fit_line(fit, mo.fit.fitter);
  const GpuReport g = gpu_block ? report_gpu(a, *gpu_block, in, out) : GpuReport{};
  if (a.json) {
    nlohmann::json j;
    j["model"] = a.model_dir;
    j["layer"] = a.layer;
    j["tokens"] = in.T;
    j["quant"] = quant;
    j["activations"] = act;
    j["activations_file"] = a.activations_file;
    j["rel_l2"] = e.rel_l2;
    j["max_abs"] = e.max_abs;
    j["cosine"] = e.cosine;
    const double sq = moe.aggregate_sqnr_db();
    j["sqnr_db"] = std::isfinite(sq) ? nlohmann::json(sq) : nlohmann::json(nullptr);
    j["seconds"] = secs;
    j["device"] = a.device;
    if (fitted) add_fit_json(j, fit);
    if (gpu_block) {
      j["gpu"] = g.name;
      j["routing"] = gpu_block->routing_note();
      j["gpu_routed_ms"] = g.ms;
      j["gpu_reps"] = a.reps;
      if (a.compare_cpu) {
        j["vs_cpu_rel_l2"] = g.cpu_rel;
        j["vs_cpu_max_abs"] = g.cpu_max;
      }
    }
    fmt::print("{}\n", j.dump());
  }
  std::fflush(stdout);
}

}  // namespace

void add_moe(CLI::App& app) {
  auto args = std::make_shared<MoeArgs>();
  auto* cmd = app.add_subcommand("moe", "Run one MoE block on captured inputs and compare with the captured outputs");
  auto* dir_opt =
      cmd->add_option("model_dir", args->model_dir, "Hugging Face checkpoint directory (BF16 or LUT-B)")->required();
  cmd->add_option("--layer", args->layer,
                  "decoder layer L (0-based, counting dense layers too) whose MoE block runs; it must be a MoE layer")->required()->check(IntRange<int>(0, std::numeric_limits<int>::max()));
  // Not required: the model folders ship their captured activations as MODEL_DIR/moe_activations.safetensors,
  // so `lutb moe MODEL_DIR --layer 0` runs on them.
  auto* acts_opt = cmd->add_option("--activations", args->activations_file,
                                   fmt::format("safetensors file with layers.L.moe_input and layers.L.moe_output "
                                               "[tokens, hidden] (default MODEL_DIR/{} when it exists)",
                                               kDefaultActivations));
  args->quant.add_to(cmd, "--act-format");
  cmd->add_flag("--json", args->json, "print one JSON object as the last line of stdout");
  cmd->add_option("--threads", args->threads,
                  "threads (default: all cores; more than the processors available are reduced to that number, "
                  "with a note)")
      ->check(ThreadCount());
  add_device_option(cmd, args->device,
                    "the routed experts (cuda: fitted on the GPU for --quant lutb of a BF16 checkpoint, uploaded "
                    "packed, top-k and the fused forward on the GPU; router logits and shared experts on the CPU)");
  auto* cmp = cmd->add_flag("--compare-cpu", args->compare_cpu,
                            "with --device cuda: also run the CPU emulation and print the difference");
  auto* reps = cmd->add_option("--reps", args->reps,
                               "with --device cuda: timed runs of the routed-expert forward (median; default 20)")
                   ->check(IntRange<int>(1, 100000));
  cmd->callback([args, acts_opt, dir_opt, cmp, reps] {
    if (args->device != "cuda" && (cmp->count() > 0 || reps->count() > 0))
      throw UsageError(fmt::format("{} applies to --device cuda only", cmp->count() > 0 ? "--compare-cpu" : "--reps"));
    check_not_empty(dir_opt, args->model_dir, "checkpoint directory name");
    check_not_empty(acts_opt, args->activations_file, "activations file name");
    if (acts_opt->count() == 0) {
      const std::filesystem::path d = std::filesystem::path(args->model_dir) / kDefaultActivations;
      // Without throwing: a folder without search permission made this "filesystem error: status:
      // Permission denied [...]" before the model folder's own check could word it.
      std::error_code ec;
      if (std::filesystem::is_regular_file(d, ec)) args->activations_file = d.string();
    }
    run_moe(*args);
  });
}

}  // namespace lutb::cli
