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

void run_default_job(const DefaultArgs& a) {
  namespace fs = std::filesystem;
  using clock = std::chrono::steady_clock;
  // Every option is checked before any work (a bad --fitter failed only after the synthesis). The
  // ranges of --tokens, --experts and --seed are checked by the parser.
  if (a.tokens < 1) throw UsageError(fmt::format("--tokens {}: must be at least 1", a.tokens));
  if (!a.fitter.empty()) check_fitter_value(a.fitter);
  if (!a.work_dir.empty() && fs::exists(a.work_dir) && !fs::is_directory(a.work_dir))
    throw std::invalid_argument(fmt::format("--work-dir {}: exists and is not a directory", a.work_dir));
  {
    SynthOptions probe;
    probe.family = ModelFamily::qwen3_moe;
    probe.num_experts = a.experts;
    const ModelConfig pc = synth_config(probe);  // throws for an invalid --experts before anything is written
    // The token buffers grow with --tokens: check them against the free memory up front ("--tokens
    // 100000000" ended in a bare std::bad_alloc). Per token: the BF16 input, three FP32 outputs,
    // the router logits and, per routed expert, the FP32 gate/up and down intermediates.
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

  InterruptGuard on_signal;  // Ctrl-C: the Cleanup below removes what this run wrote
  fs::path work;
  bool own_work = false;  // true when this run created `work` and may remove it whole
  std::vector<fs::path> made_parents;  // ancestors of --work-dir this run created, deepest first
  if (a.work_dir.empty()) {
    // The folder named by TMPDIR (or TMP, TEMP, TEMPDIR: what temp_directory_path reads): when it did
    // not exist the error read "filesystem error: temp_directory_path: No such file or directory",
    // naming neither the variable nor the folder.
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
    work = tmpl;
    own_work = true;
  } else {
    work = a.work_dir;
    // The missing ancestors of --work-dir are created (as mkdir -p) and removed again at the end,
    // deepest first and only while empty: the run leaves the filesystem as it found it ("--work-dir
    // a/b/c" left a and a/b behind). Existing ones are never touched.
    std::error_code ec;  // mkdir's reason is kept for the message
    for (fs::path p = fs::absolute(work, ec).lexically_normal(); p.has_relative_path() && !fs::exists(fs::symlink_status(p, ec));
         p = p.parent_path()) {
      if (!p.has_filename()) continue;  // "a/b/" -> "a/b"
      made_parents.push_back(p);
    }
    own_work = fs::create_directories(work, ec);
    if (ec) {
      // The removal below has its own error_code: it reused `ec`, and fs::remove of a directory that
      // was never made clears it, so "--work-dir /proc/x" read "cannot create it: Success" (mkdir's
      // ENOENT lost).
      const std::string why = ec.message();
      std::error_code rec;
      for (const auto& d : made_parents) fs::remove(d, rec);  // an empty directory only
      throw std::runtime_error(fmt::format("--work-dir {}: cannot create it: {}", work.string(), why));
    }
    if (!made_parents.empty()) made_parents.erase(made_parents.begin());  // `work` itself: removed whole below
  }
  const fs::path src_dir = work / "qwen3-30b-a3b-layer-bf16", q_dir = work / "qwen3-30b-a3b-layer-lutb";
  // A user's --work-dir is never removed or overwritten: only the two checkpoints this run writes
  // there are, and they must not exist beforehand. Looked up without following a symbolic link: a
  // dangling link there passed fs::exists, synth refused it with the advice of its -o option, and
  // the cleanup then deleted the user's link.
  if (!own_work)
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
  // Only what this run created is removed: each checkpoint is added to the cleanup once written
  // (synthesize_checkpoint and quantize_checkpoint remove their own temporaries when they fail), so
  // a failure can never remove an entry of the user's.
  struct Cleanup {
    std::vector<fs::path> paths, parents;
    bool keep;
    ~Cleanup() {
      std::error_code ec;
      if (keep) return;
      for (const auto& p : paths) fs::remove_all(p, ec);
      for (const auto& d : parents) fs::remove(d, ec);  // removes an empty directory only
    }
  } cleanup{own_work ? std::vector<fs::path>{work} : std::vector<fs::path>{}, made_parents, a.keep};

  SynthOptions so;
  so.family = ModelFamily::qwen3_moe;
  so.layers = 1;
  so.force = own_work;
  so.num_experts = a.experts;
  so.interrupt = interrupt_flag();
  const ModelConfig cfg = synth_config(so);
  const std::int64_t E = cfg.num_experts, H = cfg.hidden_size, I = cfg.moe_intermediate_size;
  const int k = static_cast<int>(cfg.num_experts_per_tok);
  fmt::print("lutb: the main job on its built-in default\n");
  fmt::print("  one Qwen3-30B-A3B MoE layer{}: E {} experts, H {}, I {}, top-{}; synthetic Student-t(5) BF16 weights\n",
             a.experts > 0 ? " (fewer experts: --experts)" : "", E, H, I, k);
  fmt::print("  work directory {}{}\n\n", work.string(), a.keep ? " (kept)" : (own_work ? " (removed at the end)" : " (its two checkpoints removed at the end)"));

  auto t = clock::now();
  synthesize_checkpoint(src_dir, so);
  if (!own_work) cleanup.paths.push_back(src_dir);
  const double t_synth = since(t);
  fmt::print("{:<48}{:8.2f} s\n", "1. synthesised the BF16 checkpoint", t_synth);

  QuantizeOptions qo;
  qo.fit.fitter = a.fitter;
  qo.force = own_work;
  qo.interrupt = interrupt_flag();
  t = clock::now();
  const QuantizeSummary qs = quantize_checkpoint(src_dir, q_dir, qo);
  if (!own_work) cleanup.paths.push_back(q_dir);
  const double t_quant = since(t);
  fmt::print("{:<48}{:8.2f} s\n", fmt::format("2. quantised it to LUT-B (fitter {})", qs.fitter), t_quant);
  for (const auto& w : qs.warnings) fmt::print(stderr, "lutb: warning: {}\n", w);  // e.g. a low SQNR (--fitter)

  check_interrupted("after the quantisation");
  t = clock::now();
  Checkpoint bf(src_dir), lq(q_dir);
  ExpertsSource src = bf.experts_source(0);
  ExpertsLutb lut = lq.lutb_experts(0);
  const RouterWeights router = lq.router(0);  // copied bit for bit: same as the source router
  const double t_load = since(t);
  fmt::print("{:<48}{:8.2f} s\n", "3. loaded the experts of both checkpoints", t_load);

  check_interrupted("after loading the checkpoints");
  // Random tokens (standard normal, BF16) and routing with the layer's router.
  const std::int64_t T = a.tokens;
  std::vector<std::uint16_t> x(static_cast<std::size_t>(T * H));
  std::mt19937_64 rng(a.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : x) v = bf16_from_float(nd(rng));
  std::vector<float> logits(static_cast<std::size_t>(T * E));
  const std::vector<std::uint16_t> gate = router.weight.to_bf16();
  moe::router_logits_bf16(x.data(), gate.data(), T, H, static_cast<int>(E), true, logits.data());
  moe::RouterConfig rc;
  rc.scoring = moe::ScoringFunc::Softmax;
  rc.num_experts = static_cast<int>(E);
  rc.top_k = k;
  rc.norm_topk_prob = cfg.renormalize();
  const moe::Routing routing = moe::route(rc, logits, T);
  const moe::TopK topk{routing.ids.data(), routing.weights.data(), k};
  const moe::HiddenStates hs = moe::HiddenStates::bf16(x.data(), T);

  moe::MoeConfig mc;
  mc.global_experts = static_cast<int>(E);
  mc.top_k = k;
  mc.hidden_size = H;
  mc.intermediate_size_per_partition = I;
  mc.finalize();

  std::vector<float> ref(static_cast<std::size_t>(T * H)), out(ref.size()), out_bf16act(ref.size());
  std::size_t ref_bytes = 0, lut_bytes = 0;
  // The GPU section (src/cli/gpu.cpp): run when a usable GPU is present, else one line says why not.
  std::string gpu_skip = cuda_unavailable_reason();
  // The reason is worded for --device cuda; the default job has no --device option, so its hint goes.
  if (const auto p = gpu_skip.find(", or use --device cpu"); p != std::string::npos) gpu_skip.erase(p);
  DefaultJobGpu gpu;
  double t_ref = 0, t_lut = 0;
  {
    // Convert one stack at a time and free its source at once: peak = source + one BF16 copy.
    std::vector<std::uint16_t> w13 = src.w13.to_bf16();
    src.w13 = {};
    std::vector<std::uint16_t> w2 = src.w2.to_bf16();
    src.w2 = {};
    moe::DenseExperts dense(mc, std::move(w13), std::move(w2), moe::ActivationFormat::BF16);
    ref_bytes = dense.weight_bytes();
    t = clock::now();
    dense.apply_f32(hs, topk, ref.data());
    t_ref = since(t);
    if (gpu_skip.empty()) default_job_gpu_fit(gpu, dense.w13(), dense.w2(), mc, lut.w13, lut.w2, a.fitter);
  }
  check_interrupted("after the BF16 reference");
  {
    auto bf16act = moe::make_lutb_experts(mc, lut.w13, lut.w2, moe::EmulationKernel::Fast, moe::ActivationFormat::BF16);
    bf16act->apply_f32(hs, topk, out_bf16act.data());
  }
  {
    auto experts = moe::make_lutb_experts(mc, std::move(lut.w13), std::move(lut.w2), moe::EmulationKernel::Fast,
                                          moe::ActivationFormat::MXFP8);
    lut_bytes = experts->weight_bytes();
    t = clock::now();
    experts->apply_f32(hs, topk, out.data());
    t_lut = since(t);
    if (gpu_skip.empty()) default_job_gpu_forward(gpu, *experts, x.data(), T, topk, out.data(), 20);
    fmt::print("4. ran the layer on {} random tokens: BF16 reference {:.3f} s, LUT-B emulation ({}) {:.3f} s\n\n", T,
               t_ref, experts->name(), t_lut);
  }
  const Err e = compare(out, ref), ew = compare(out_bf16act, ref);
  const double sqnr = qs.stats.sqnr_db();

  fmt::print("routed experts          BF16 {:.1f} MB -> LUT-B {:.1f} MB ({:.2f}x smaller)\n", qs.bytes_before / 1e6,
             qs.bytes_after / 1e6, static_cast<double>(qs.bytes_before) / static_cast<double>(qs.bytes_after));
  fmt::print("bits per weight         {:.6f} (BF16: 16)\n", qs.bits_per_weight());
  fmt::print("weight SQNR             {:.2f} dB over {} tiles\n", sqnr, qs.stats.tiles);
  fmt::print("layer output vs BF16    rel L2 {:.4f}, cosine {:.6f}, max abs {:.4g}  (LUT-B weights, MXFP8 activations)\n",
             e.rel_l2, e.cosine, e.max_abs);
  fmt::print("                        rel L2 {:.4f}, cosine {:.6f}  (LUT-B weights, BF16 activations)\n", ew.rel_l2,
             ew.cosine);
  fmt::print("resident expert weights BF16 reference {:.1f} MB, LUT-B emulation {:.1f} MB\n", ref_bytes / 1e6, lut_bytes / 1e6);
  fmt::print("peak RSS                {:.1f} MB\n", peak_rss_bytes() / 1e6);
  if (gpu_skip.empty()) {
    fmt::print("GPU                     {}\n", cuda_device_description());
    for (const auto& l : gpu.lines) fmt::print("{}\n", l);
  } else {
    fmt::print("GPU section skipped:    {}\n", gpu_skip);
  }
  if (a.json) {
    nlohmann::json j = {{"model", "Qwen3-30B-A3B layer (synthetic)"},
                        {"experts", E},
                        {"hidden_size", H},
                        {"moe_intermediate_size", I},
                        {"top_k", k},
                        {"tokens", T},
                        {"fitter", qs.fitter},
                        {"bytes_bf16", qs.bytes_before},
                        {"bytes_lutb", qs.bytes_after},
                        {"bits_per_weight", qs.bits_per_weight()},
                        {"sqnr_db", sqnr},
                        {"rel_l2", e.rel_l2},
                        {"cosine", e.cosine},
                        {"max_abs", e.max_abs},
                        {"rel_l2_bf16_activations", ew.rel_l2},
                        {"seconds_synth", t_synth},
                        {"seconds_quantize", t_quant},
                        {"seconds_reference", t_ref},
                        {"seconds_lutb", t_lut},
                        {"peak_rss_bytes", peak_rss_bytes()}};
    if (gpu_skip.empty()) {
      j["gpu"] = gpu.json;
      j["gpu"]["device"] = cuda_device_description();
    } else {
      j["gpu_skipped"] = gpu_skip;
    }
    fmt::print("{}\n", j.dump());
  }
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
