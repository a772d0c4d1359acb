// `lutb` with no subcommand: the main job on a built-in default. Synthesises one Qwen3-30B-A3B MoE
// layer (E 128, H 2048, I 768, top-8; Student-t(5) weights) as a checkpoint in a temporary
// directory, quantises it to a LUT-B checkpoint with `lutb quantize`'s code, loads both back, runs
// the layer on random tokens with the BF16 reference and with the LUT-B emulation (spec 4), and
// prints sizes, bits per weight, SQNR, the output error and the time of each step.
#include <stdlib.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/gpu.hpp"
#include "cli/interrupt.hpp"
#include "cli/usage_hints.hpp"
#include "cli/validators.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/moe.hpp"

namespace lutb::cli {

namespace {

struct DefaultArgs {
  std::int64_t tokens = 64;
  std::int64_t experts = 0;  // 0 = the real 128 (tests use fewer to stay fast)
  std::string fitter;
  std::uint64_t seed = 1;
  std::string work_dir;
  bool keep = false;
  bool json = false;
};

struct Err {
  double rel_l2 = 0, max_abs = 0, cosine = 0;
};

Err compare(const std::vector<float>& out, const std::vector<float>& ref) {
  double num = 0, den = 0, dot = 0, on = 0, mx = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
    on += static_cast<double>(out[i]) * out[i];
    dot += static_cast<double>(out[i]) * ref[i];
    mx = std::isnan(d) ? d : std::max(mx, std::abs(d));  // NaN propagates, never hides
  }
  return {std::sqrt(num / den), mx, dot / std::sqrt(on * den)};
}

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The token buffers grow with --tokens: checked against the free memory up front, rather than
// ending in a bare std::bad_alloc. Per token: the BF16 input, three FP32 outputs, the router logits
// and, per routed expert, the FP32 gate/up and down intermediates.
void check_token_memory(const DefaultArgs& a) {
  SynthOptions probe;
  probe.family = ModelFamily::qwen3_moe;
  probe.num_experts = a.experts;
  const ModelConfig pc = synth_config(probe);  // throws for an invalid --experts before anything is written
  const auto H = static_cast<std::uint64_t>(pc.hidden_size), I = static_cast<std::uint64_t>(pc.moe_intermediate_size),
             E = static_cast<std::uint64_t>(pc.num_experts), k = static_cast<std::uint64_t>(pc.num_experts_per_tok);
  const std::uint64_t per_token = 2 * H + 3 * 4 * H + 4 * E + 8 * k + k * (2 * I + I) * 4;
  const std::uint64_t need = per_token * static_cast<std::uint64_t>(a.tokens);
  std::uint64_t avail = 0;
  {
    std::ifstream mi("/proc/meminfo");
    std::string key;
    std::uint64_t kb = 0;
    std::string unit;
    while (mi >> key >> kb >> unit)
      if (key == "MemAvailable:") {
        avail = kb * 1024;
        break;
      }
  }
  if (avail > 0 && need > avail)
    throw std::invalid_argument(fmt::format(
        "--tokens {}: the token buffers would need about {:.1f} GB ({} bytes per token), but only {:.1f} GB of "
        "memory is available; use fewer tokens (at most about {})",
        a.tokens, need / 1e9, per_token, avail / 1e9, avail / per_token));
}

// Step 1: every option is checked before any work (a bad --fitter must not fail only after the
// synthesis). The ranges of --tokens, --experts and --seed are checked by the parser.
void check_default_args(const DefaultArgs& a) {
  if (a.tokens < 1) throw UsageError(fmt::format("--tokens {}: must be at least 1", a.tokens));
  if (!a.fitter.empty()) check_fitter_value(a.fitter);
  if (!a.work_dir.empty() && fs::exists(a.work_dir) && !fs::is_directory(a.work_dir))
    throw std::invalid_argument(fmt::format("--work-dir {}: exists and is not a directory", a.work_dir));
  check_token_memory(a);
}

// Where the two checkpoints are written.
struct WorkDir {
  fs::path path;
  bool own = false;                    // true when this run created `path` and may remove it whole
  std::vector<fs::path> made_parents;  // ancestors of --work-dir this run created, deepest first
};

// A fresh temporary folder under the folder named by TMPDIR (or TMP, TEMP, TEMPDIR: what
// temp_directory_path reads). When that folder is not usable the message names the variable and the
// folder, not only "temp_directory_path: No such file or directory".
WorkDir temporary_work_dir() {
  std::error_code tec;
  const fs::path tmp_root = fs::temp_directory_path(tec);
  if (tec) {
    std::string var = "TMPDIR", val;
    for (const char* v : {"TMPDIR", "TMP", "TEMP", "TEMPDIR"})
      if (const char* e = std::getenv(v)) {
        var = v;
        val = e;
        break;
      }
    throw std::runtime_error(fmt::format("the temporary folder {}={} is not usable ({}): set {} to an existing "
                                         "folder, or give --work-dir DIR",
                                         var, val, tec.message(), var));
  }
  std::string tmpl = (tmp_root / "lutb-default-XXXXXX").string();
  if (!mkdtemp(tmpl.data()))
    throw std::runtime_error(fmt::format("cannot create a temporary directory under {}: {} (set TMPDIR to another "
                                         "folder, or give --work-dir DIR)",
                                         tmp_root.string(), std::strerror(errno)));
  return {tmpl, true, {}};
}

// --work-dir: its missing ancestors are created (as mkdir -p) and removed again at the end, deepest
// first and only while empty, so the run leaves the filesystem as it found it. Existing ones are
// never touched.
WorkDir user_work_dir(const std::string& dir) {
  WorkDir w;
  w.path = dir;
  std::error_code ec;  // mkdir's reason is kept for the message
  for (fs::path p = fs::absolute(w.path, ec).lexically_normal(); p.has_relative_path() && !fs::exists(fs::symlink_status(p, ec));
       p = p.parent_path()) {
    if (!p.has_filename()) continue;  // "a/b/" -> "a/b"
    w.made_parents.push_back(p);
  }
  w.own = fs::create_directories(w.path, ec);
  if (ec) {
    // The removal below has its own error_code: fs::remove of a directory that was never made
    // clears it, and mkdir's reason (ENOENT for "--work-dir /proc/x") must reach the message.
    const std::string why = ec.message();
    std::error_code rec;
    for (const auto& d : w.made_parents) fs::remove(d, rec);  // an empty directory only
    throw std::runtime_error(fmt::format("--work-dir {}: cannot create it: {}", w.path.string(), why));
  }
  if (!w.made_parents.empty()) w.made_parents.erase(w.made_parents.begin());  // `path` itself: removed whole
  return w;
}

// A user's --work-dir is never removed or overwritten: only the two checkpoints this run writes
// there are, and they must not exist beforehand. Looked up without following a symbolic link, so
// that a dangling link there is refused (and never deleted by the cleanup).
void check_checkpoint_names_free(const fs::path& src_dir, const fs::path& q_dir) {
  for (const fs::path& p : {src_dir, q_dir}) {
    std::error_code sec;
    const fs::file_status st = fs::symlink_status(p, sec);
    if (!fs::exists(st)) continue;
    std::string what;
    if (fs::is_symlink(st)) {
      std::error_code lec, tec;
      const fs::path to = fs::read_symlink(p, lec);
      what = fmt::format(" (a symbolic link to {}{})", lec ? std::string("?") : to.string(),
                         fs::exists(fs::status(p, tec)) ? "" : ", which does not exist");
    }
    throw std::runtime_error(fmt::format("{}: the work directory already holds {}{}, the name this run writes a "
                                         "checkpoint to; choose another --work-dir or remove it; nothing written",
                                         p.string(), p.filename().string(), what));
  }
}

// Only what this run created is removed: each checkpoint is added to the cleanup once written
// (synthesize_checkpoint and quantize_checkpoint remove their own temporaries when they fail), so a
// failure can never remove an entry of the user's.
struct Cleanup {
  std::vector<fs::path> paths, parents;
  bool keep;
  ~Cleanup() {
    std::error_code ec;
    if (keep) return;
    for (const auto& p : paths) fs::remove_all(p, ec);
    for (const auto& d : parents) fs::remove(d, ec);  // removes an empty directory only
  }
};

// Random tokens (standard normal, BF16) routed with the layer's router (softmax top-k).
struct RoutedTokens {
  std::vector<std::uint16_t> x;  // [T][H] BF16
  moe::Routing routing;
};

RoutedTokens route_random_tokens(const DefaultArgs& a, const ModelConfig& cfg, const RouterWeights& router) {
  const std::int64_t T = a.tokens, E = cfg.num_experts, H = cfg.hidden_size;
  RoutedTokens r;
  r.x.resize(static_cast<std::size_t>(T * H));
  std::mt19937_64 rng(a.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : r.x) v = bf16_from_float(nd(rng));
  std::vector<float> logits(static_cast<std::size_t>(T * E));
  const std::vector<std::uint16_t> gate = router.weight.to_bf16();
  moe::router_logits_bf16(r.x.data(), gate.data(), T, H, static_cast<int>(E), true, logits.data());
  moe::RouterConfig rc;
  rc.scoring = moe::ScoringFunc::Softmax;
  rc.num_experts = static_cast<int>(E);
  rc.top_k = static_cast<int>(cfg.num_experts_per_tok);
  rc.norm_topk_prob = cfg.renormalize();
  r.routing = moe::route(rc, logits, T);
  return r;
}

moe::MoeConfig layer_moe_config(const ModelConfig& cfg) {
  moe::MoeConfig mc;
  mc.global_experts = static_cast<int>(cfg.num_experts);
  mc.top_k = static_cast<int>(cfg.num_experts_per_tok);
  mc.hidden_size = cfg.hidden_size;
  mc.intermediate_size_per_partition = cfg.moe_intermediate_size;
  mc.finalize();
  return mc;
}

// The layer's outputs and costs: the BF16 reference, the LUT-B emulation with MXFP8 and with BF16
// activations, and the GPU section when a usable GPU is present.
struct LayerRun {
  std::vector<float> ref, out, out_bf16act;
  std::size_t ref_bytes = 0, lut_bytes = 0;
  double t_ref = 0, t_lut = 0;
  std::string gpu_skip;  // why the GPU section did not run; empty when it ran
  DefaultJobGpu gpu;
};

// Step 4: the layer on the routed tokens.
LayerRun run_layer(const DefaultArgs& a, const moe::MoeConfig& mc, const RoutedTokens& tokens, ExpertsSource& src,
                   ExpertsLutb& lut) {
  const std::int64_t T = a.tokens;
  const moe::TopK topk{tokens.routing.ids.data(), tokens.routing.weights.data(), mc.top_k};
  const moe::HiddenStates hs = moe::HiddenStates::bf16(tokens.x.data(), T);
  LayerRun r;
  r.ref.resize(static_cast<std::size_t>(T * mc.hidden_size));
  r.out.resize(r.ref.size());
  r.out_bf16act.resize(r.ref.size());
  // The GPU section (src/cli/gpu.cpp): run when a usable GPU is present, else one line says why not.
  r.gpu_skip = cuda_unavailable_reason();
  // The reason is worded for --device cuda; the default job has no --device option, so its hint goes.
  if (const auto p = r.gpu_skip.find(", or use --device cpu"); p != std::string::npos) r.gpu_skip.erase(p);
  {
    // Convert one stack at a time and free its source at once: peak = source + one BF16 copy.
    std::vector<std::uint16_t> w13 = src.w13.to_bf16();
    src.w13 = {};
    std::vector<std::uint16_t> w2 = src.w2.to_bf16();
    src.w2 = {};
    moe::DenseExperts dense(mc, std::move(w13), std::move(w2), moe::ActivationFormat::BF16);
    r.ref_bytes = dense.weight_bytes();
    const auto t = Clock::now();
    dense.apply_f32(hs, topk, r.ref.data());
    r.t_ref = since(t);
    if (r.gpu_skip.empty()) default_job_gpu_fit(r.gpu, dense.w13(), dense.w2(), mc, lut.w13, lut.w2, a.fitter);
  }
  check_interrupted("after the BF16 reference");
  {
    auto bf16act = moe::make_lutb_experts(mc, lut.w13, lut.w2, moe::EmulationKernel::Fast, moe::ActivationFormat::BF16);
    bf16act->apply_f32(hs, topk, r.out_bf16act.data());
  }
  auto experts = moe::make_lutb_experts(mc, std::move(lut.w13), std::move(lut.w2), moe::EmulationKernel::Fast,
                                        moe::ActivationFormat::MXFP8);
  r.lut_bytes = experts->weight_bytes();
  const auto t = Clock::now();
  experts->apply_f32(hs, topk, r.out.data());
  r.t_lut = since(t);
  if (r.gpu_skip.empty()) default_job_gpu_forward(r.gpu, *experts, tokens.x.data(), T, topk, r.out.data(), 20);
  fmt::print("4. ran the layer on {} random tokens: BF16 reference {:.3f} s, LUT-B emulation ({}) {:.3f} s\n\n", T,
             r.t_ref, experts->name(), r.t_lut);
  return r;
}

// Timings of steps 1-2, for the JSON summary.
struct StepTimes {
  double synth = 0, quantize = 0;
};

// Step 5: the report, and with --json its summary as the last line.
void print_report(const DefaultArgs& a, const ModelConfig& cfg, const QuantizeSummary& qs, const LayerRun& r,
                  const StepTimes& times) {
  const Err e = compare(r.out, r.ref), ew = compare(r.out_bf16act, r.ref);
  const double sqnr = qs.stats.sqnr_db();
  fmt::print("routed experts          BF16 {:.1f} MB -> LUT-B {:.1f} MB ({:.2f}x smaller)\n", qs.bytes_before / 1e6,
             qs.bytes_after / 1e6, static_cast<double>(qs.bytes_before) / static_cast<double>(qs.bytes_after));
  fmt::print("bits per weight         {:.6f} (BF16: 16)\n", qs.bits_per_weight());
  fmt::print("weight SQNR             {:.2f} dB over {} tiles\n", sqnr, qs.stats.tiles);
  fmt::print("layer output vs BF16    rel L2 {:.4f}, cosine {:.6f}, max abs {:.4g}  (LUT-B weights, MXFP8 activations)\n",
             e.rel_l2, e.cosine, e.max_abs);
  fmt::print("                        rel L2 {:.4f}, cosine {:.6f}  (LUT-B weights, BF16 activations)\n", ew.rel_l2,
             ew.cosine);
  fmt::print("resident expert weights BF16 reference {:.1f} MB, LUT-B emulation {:.1f} MB\n", r.ref_bytes / 1e6,
             r.lut_bytes / 1e6);
  fmt::print("peak RSS                {:.1f} MB\n", peak_rss_bytes() / 1e6);
  if (r.gpu_skip.empty()) {
    fmt::print("GPU                     {}\n", cuda_device_description());
    for (const auto& l : r.gpu.lines) fmt::print("{}\n", l);
  } else {
    fmt::print("GPU section skipped:    {}\n", r.gpu_skip);
  }
  if (!a.json) return;
  nlohmann::json j = {{"model", "Qwen3-30B-A3B layer (synthetic)"},
                      {"experts", cfg.num_experts},
                      {"hidden_size", cfg.hidden_size},
                      {"moe_intermediate_size", cfg.moe_intermediate_size},
                      {"top_k", static_cast<int>(cfg.num_experts_per_tok)},
                      {"tokens", a.tokens},
                      {"fitter", qs.fitter},
                      {"bytes_bf16", qs.bytes_before},
                      {"bytes_lutb", qs.bytes_after},
                      {"bits_per_weight", qs.bits_per_weight()},
                      {"sqnr_db", sqnr},
                      {"rel_l2", e.rel_l2},
                      {"cosine", e.cosine},
                      {"max_abs", e.max_abs},
                      {"rel_l2_bf16_activations", ew.rel_l2},
                      {"seconds_synth", times.synth},
                      {"seconds_quantize", times.quantize},
                      {"seconds_reference", r.t_ref},
                      {"seconds_lutb", r.t_lut},
                      {"peak_rss_bytes", peak_rss_bytes()}};
  if (r.gpu_skip.empty()) {
    j["gpu"] = r.gpu.json;
    j["gpu"]["device"] = cuda_device_description();
  } else {
    j["gpu_skipped"] = r.gpu_skip;
  }
  fmt::print("{}\n", j.dump());
}

void run_default_job(const DefaultArgs& a) {
  check_default_args(a);

  InterruptGuard on_signal;  // Ctrl-C: the Cleanup below removes what this run wrote
  const WorkDir work = a.work_dir.empty() ? temporary_work_dir() : user_work_dir(a.work_dir);
  const fs::path src_dir = work.path / "qwen3-30b-a3b-layer-bf16", q_dir = work.path / "qwen3-30b-a3b-layer-lutb";
  if (!work.own) check_checkpoint_names_free(src_dir, q_dir);
  Cleanup cleanup{work.own ? std::vector<fs::path>{work.path} : std::vector<fs::path>{}, work.made_parents, a.keep};

  SynthOptions so;
  so.family = ModelFamily::qwen3_moe;
  so.layers = 1;
  so.force = work.own;
  so.num_experts = a.experts;
  so.interrupt = interrupt_flag();
  const ModelConfig cfg = synth_config(so);
  fmt::print("lutb: the main job on its built-in default\n");
  fmt::print("  one Qwen3-30B-A3B MoE layer{}: E {} experts, H {}, I {}, top-{}; synthetic Student-t(5) BF16 weights\n",
             a.experts > 0 ? " (fewer experts: --experts)" : "", cfg.num_experts, cfg.hidden_size,
             cfg.moe_intermediate_size, static_cast<int>(cfg.num_experts_per_tok));
  fmt::print("  work directory {}{}\n\n", work.path.string(),
             a.keep ? " (kept)" : (work.own ? " (removed at the end)" : " (its two checkpoints removed at the end)"));

  // Steps 2-3: synthesise and quantise.
  StepTimes times;
  auto t = Clock::now();
  synthesize_checkpoint(src_dir, so);
  if (!work.own) cleanup.paths.push_back(src_dir);
  times.synth = since(t);
  fmt::print("{:<48}{:8.2f} s\n", "1. synthesised the BF16 checkpoint", times.synth);

  QuantizeOptions qo;
  qo.fit.fitter = a.fitter;
  qo.force = work.own;
  qo.interrupt = interrupt_flag();
  t = Clock::now();
  const QuantizeSummary qs = quantize_checkpoint(src_dir, q_dir, qo);
  if (!work.own) cleanup.paths.push_back(q_dir);
  times.quantize = since(t);
  fmt::print("{:<48}{:8.2f} s\n", fmt::format("2. quantised it to LUT-B (fitter {})", qs.fitter), times.quantize);
  for (const auto& w : qs.warnings) fmt::print(stderr, "lutb: warning: {}\n", w);  // e.g. a low SQNR (--fitter)

  check_interrupted("after the quantisation");
  t = Clock::now();
  Checkpoint bf(src_dir), lq(q_dir);
  ExpertsSource src = bf.experts_source(0);
  ExpertsLutb lut = lq.lutb_experts(0);
  const RouterWeights router = lq.router(0);  // copied bit for bit: same as the source router
  fmt::print("{:<48}{:8.2f} s\n", "3. loaded the experts of both checkpoints", since(t));

  check_interrupted("after loading the checkpoints");
  const RoutedTokens tokens = route_random_tokens(a, cfg, router);
  const LayerRun r = run_layer(a, layer_moe_config(cfg), tokens, src, lut);
  print_report(a, cfg, qs, r, times);
}

}  // namespace

void add_default_job(CLI::App& app) {
  auto a = std::make_shared<DefaultArgs>();
  const std::string g = kDefaultJobGroup;
  app.add_option("--tokens", a->tokens, "default job: random tokens run through the layer (default 64)")
      ->group(g)->check(IntRange<std::int64_t>(1, 1 << 20));
  app.add_option("--experts", a->experts,
                 "default job: routed experts (0 or default: 128, Qwen3-30B-A3B's; fewer for a quick run)")
      ->group(g)->check(IntRange<std::int64_t>(0, 4096));
  auto* fitter_opt =
      app.add_option("--fitter", a->fitter, "default job: LUT-B fitter: " + fitter_list())->group(g);
  app.add_option("--seed", a->seed,
                 "default job: seed of the random tokens (default 1; the synthetic weights always use seed 1234)")
      ->group(g)->check(IntRange<std::uint64_t>(0, std::numeric_limits<std::uint64_t>::max()));
  auto* work_opt = app.add_option("--work-dir", a->work_dir, "default job: directory for the two checkpoints (default a temporary one); missing parent directories are "
                 "created and, unless --keep, removed again; Ctrl-C/SIGTERM remove what the run wrote there")
      ->group(g);
  app.add_flag("--keep", a->keep, "default job: keep the checkpoints")->group(g);
  app.add_flag("--json", a->json, "default job: print a JSON summary as the last line")->group(g);
  // An option of the default job before a command's name ("lutb --fitter optimal quantize IN -o OUT",
  // "lutb --json eval DIR") was parsed as the default job's and then ignored, since the default job
  // does not run with a command: quantize fitted with binned-dp and eval printed no JSON, exit status
  // 0. Refused before the command runs (this callback runs before the commands' own).
  app.parse_complete_callback([&app, g] {
    const std::vector<CLI::App*> cmds = app.get_subcommands();
    if (cmds.empty()) return;
    const CLI::App& cmd = *cmds.front();
    for (const CLI::Option* o : app.get_options()) {
      if (o->get_group() != g || o->count() == 0) continue;
      const std::string name = "--" + o->get_lnames().front();
      const bool cmd_has = cmd.get_option_no_throw(name) != nullptr;
      throw UsageError(fmt::format(
          "{} was given before the command name '{}': options before it belong to the default job (lutb with no "
          "command), which does not run when a command is given, so it would be ignored; {}",
          name, cmd.get_name(),
          cmd_has ? fmt::format("give it after the command name: lutb {} ... {} ...", cmd.get_name(), name)
                  : fmt::format("lutb {} has no {} option (lutb {} --help lists its options)", cmd.get_name(), name,
                                cmd.get_name())));
    }
  });
  app.callback([&app, a, fitter_opt, work_opt] {
    if (!app.get_subcommands().empty()) return;
    check_fitter_option(fitter_opt, a->fitter);
    check_not_empty(work_opt, a->work_dir, "directory name");
    run_default_job(*a);
  });
}

}  // namespace lutb::cli
