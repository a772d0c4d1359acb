// `lutb calibrate` and `--calibration` of quantize / eval on a shared model (skipped without
// ../shared): the statistics' names and counts, an expert no calibration token reaches (no NaN, a
// deterministic fit), the refusals (and --device cuda, which takes --calibration), non-finite
// weights and statistics, and the output file's paths and options as quantize and synth treat them.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/calibration.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::has;
using test::kUsageHint;
using test::q;
using test::run;

struct Shared {
  fs::path model, tokens;
};

std::optional<Shared> shared_model(const std::string& name) {
  const auto m = test::model_dir(name);
  const auto s = test::shared_dir();
  if (!m || !s || !fs::exists(*s / "calib/train_tokens.safetensors")) return std::nullopt;
  return Shared{*m, *s / "calib/train_tokens.safetensors"};
}

std::optional<Shared> shared_mixtral() { return shared_model("tiny-mixtral"); }

// The entries of `dir`, sorted (an output's temporaries or created parents show up here).
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

// Layer `l`'s full moments read from `file` into memory (load() only checks them; save() writes the
// moments held in memory).
void read_moments(LayerCalibration& l, const fs::path& file) {
  const SafetensorsFile f(file);
  for (std::int64_t e = 0; e < l.experts; ++e)
    for (const bool gu : {true, false}) {
      const TensorView& v = f.get(l.prefix + "." + std::to_string(e) + (gu ? ".gate_up.xxT" : ".down.hhT"));
      std::vector<float>& m = gu ? l.gate_up_xxT : l.down_hhT;
      const std::size_t at = m.size();
      m.resize(at + v.nbytes / 4);
      std::memcpy(m.data() + at, v.data, v.nbytes);
    }
}

// The last JSON line of a run's output.
nlohmann::json last_json(const test::CliOut& r) {
  const auto p = r.out.rfind("\n{");
  return nlohmann::json::parse(r.out.substr(p == std::string::npos ? 0 : p + 1));
}

TEST(CliCalibrate, StatisticsCountTheRoutedTokens) {
  const auto sh = shared_mixtral();
  if (!sh) GTEST_SKIP() << "../shared models or calib tokens absent";
  test::TempDir dir;
  const auto stats = dir.path / "stats.safetensors";
  const auto r = run("calibrate " + q(sh->model) + " --tokens " + q(sh->tokens) + " --max-tokens 600 -o " + q(stats) +
                     " --threads 1 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(last_json(r)["tokens"], 512) << "whole windows of 256 only";
  const CalibrationStats s = CalibrationStats::load(stats);
  ASSERT_EQ(s.layers.size(), 3u);  // tiny-mixtral: 3 MoE layers, 8 experts, top-2, H 192, I 320
  for (const auto& [l, lc] : s.layers) {
    EXPECT_EQ(lc.prefix, "model.layers." + std::to_string(l) + ".block_sparse_moe.experts");
    EXPECT_EQ(lc.experts, 8);
    EXPECT_EQ(lc.hidden, 192);
    EXPECT_EQ(lc.intermediate, 320);
    double n = 0;
    for (float t : lc.tokens) n += t;
    EXPECT_EQ(n, 512.0 * 2) << "every token reaches top-k = 2 experts";
    for (float v : lc.gate_up_x2) EXPECT_TRUE(std::isfinite(v) && v >= 0);
  }
  EXPECT_TRUE(SafetensorsFile(stats).contains("model.layers.0.block_sparse_moe.experts.7.down.x2"));
  // The file exists now: refused without --force, as quantize refuses an existing output (exit status 1).
  const auto again = run("calibrate " + q(sh->model) + " --tokens " + q(sh->tokens) + " -o " + q(stats));
  EXPECT_EQ(again.code, 1) << again.out;
  EXPECT_TRUE(has(again, stats.string() + ": output file exists (use --force to replace it); nothing written"))
      << again.out;
}

TEST(CliCalibrate, AnExpertNoTokenReachesFitsDeterministically) {
  const auto sh = shared_mixtral();
  if (!sh) GTEST_SKIP() << "../shared models or calib tokens absent";
  test::TempDir dir;
  const auto stats = dir.path / "stats.safetensors";
  ASSERT_EQ(run("calibrate " + q(sh->model) + " --tokens " + q(sh->tokens) + " --max-tokens 256 -o " + q(stats) +
                " --threads 1")
                .code,
            0);
  // Expert 5 of layer 1 never reached: zero token count and zero moments.
  CalibrationStats s = CalibrationStats::load(stats);
  LayerCalibration& l = s.layers.at(1);
  l.tokens[5] = 0;
  std::fill(l.gate_up_x2.begin() + 5 * l.hidden, l.gate_up_x2.begin() + 6 * l.hidden, 0.0f);
  std::fill(l.down_x2.begin() + 5 * l.intermediate, l.down_x2.begin() + 6 * l.intermediate, 0.0f);
  const auto rare = dir.path / "rare.safetensors";
  s.save(rare);
  for (const auto& w : {s.column_weights(1, CalibratedInput::kGateUp), s.column_weights(1, CalibratedInput::kDown)})
    for (float v : w) ASSERT_TRUE(std::isfinite(v) && v > 0);
  const auto a = run("quantize " + q(sh->model) + " -o " + q(dir.path / "a") + " --calibration " + q(rare) +
                     " --threads 1 --no-progress --json");
  ASSERT_EQ(a.code, 0) << a.out;
  const auto b = run("quantize " + q(sh->model) + " -o " + q(dir.path / "b") + " --calibration " + q(rare) +
                     " --threads 2 --no-progress");
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_EQ(last_json(a)["tensors_quantized"], 72);
  for (const char* t : {"weight_packed", "weight_codebook", "weight_scale"}) {
    const std::string n = std::string("model.layers.1.block_sparse_moe.experts.5.w1.") + t;
    const SafetensorsFile fa(dir.path / "a/model.safetensors"), fb(dir.path / "b/model.safetensors");
    const TensorView &va = fa.get(n), &vb = fb.get(n);
    ASSERT_EQ(va.nbytes, vb.nbytes);
    EXPECT_EQ(std::memcmp(va.data, vb.data, va.nbytes), 0) << n << " differs between two runs";
  }
  // The calibrated checkpoint evaluates to a finite loss; so does the online fit with the statistics.
  const auto e = run("eval " + q(dir.path / "a") + " --max-windows 1 --threads 1 --json");
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_TRUE(std::isfinite(last_json(e)["val_loss"].get<double>()));
  const auto o = run("eval " + q(sh->model) + " --quant lutb --calibration " + q(rare) + " --max-windows 1 --threads 1 --json");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_TRUE(std::isfinite(last_json(o)["val_loss"].get<double>()));
}

// --full-moments: quantize and eval fit with cross-column error feedback by default, the same bytes
// on any thread count with an expert no token reaches (it takes the layer's moments); --error-feedback
// off gives exactly the bytes of the statistics without full moments; --device cuda is refused (the
// feedback runs on the CPU only) before any GPU is looked for.
TEST(CliCalibrate, FullMomentsFeedBackErrorsDeterministically) {
  const auto sh = shared_mixtral();
  if (!sh) GTEST_SKIP() << "../shared models or calib tokens absent";
  test::TempDir dir;
  const auto full = dir.path / "full.safetensors";
  const auto c = run("calibrate " + q(sh->model) + " --tokens " + q(sh->tokens) + " --max-tokens 256 -o " + q(full) +
                     " --full-moments --threads 1 --json");
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_TRUE(last_json(c)["full_moments"].get<bool>());
  // Expert 5 of layer 1 never reached, in memory: zero count, zero diagonal and full moments.
  CalibrationStats s = CalibrationStats::load(full);
  ASSERT_TRUE(s.has_second_moments());
  for (auto& [layer, l] : s.layers) read_moments(l, full);
  LayerCalibration& l = s.layers.at(1);
  l.tokens[5] = 0;
  std::fill(l.gate_up_x2.begin() + 5 * l.hidden, l.gate_up_x2.begin() + 6 * l.hidden, 0.0f);
  std::fill(l.down_x2.begin() + 5 * l.intermediate, l.down_x2.begin() + 6 * l.intermediate, 0.0f);
  std::fill(l.gate_up_xxT.begin() + 5 * l.hidden * l.hidden, l.gate_up_xxT.begin() + 6 * l.hidden * l.hidden, 0.0f);
  std::fill(l.down_hhT.begin() + 5 * l.intermediate * l.intermediate,
            l.down_hhT.begin() + 6 * l.intermediate * l.intermediate, 0.0f);
  const auto rare = dir.path / "rare-full.safetensors";
  s.save(rare);
  // The same statistics without the full moments.
  CalibrationStats d = s;
  for (auto& [layer, dl] : d.layers) {
    dl.gate_up_xxT.clear();
    dl.down_hhT.clear();
    dl.full_moments = false;
  }
  const auto diag = dir.path / "rare-diag.safetensors";
  d.save(diag);
  const auto quantize = [&](const std::string& out, const fs::path& stats, const std::string& extra) {
    const auto r = run("quantize " + q(sh->model) + " -o " + q(dir.path / out) + " --calibration " + q(stats) +
                       " --no-progress " + extra);
    EXPECT_EQ(r.code, 0) << r.out;
  };
  quantize("a", rare, "--threads 1");
  quantize("b", rare, "--threads 2");
  quantize("off", rare, "--threads 2 --error-feedback off");
  quantize("diag", diag, "--threads 1");
  quantize("d-default", rare, "--threads 1 --damping 0.01");
  quantize("d-large", rare, "--threads 1 --damping 1");
  // Every routed-expert tensor equal (or not) between two checkpoints.
  const auto same = [&](const std::string& x, const std::string& y) {
    const SafetensorsFile fx(dir.path / x / "model.safetensors"), fy(dir.path / y / "model.safetensors");
    int differ = 0;
    for (const auto& n : fx.names()) {
      if (n.find(".experts.") == std::string::npos) continue;
      const TensorView &vx = fx.get(n), &vy = fy.get(n);
      differ += vx.nbytes != vy.nbytes || std::memcmp(vx.data, vy.data, vx.nbytes) != 0;
    }
    return differ == 0;
  };
  EXPECT_TRUE(same("a", "b")) << "the bytes depend on the thread count";
  EXPECT_TRUE(same("off", "diag")) << "--error-feedback off is not the fit with the column weights alone";
  EXPECT_FALSE(same("a", "off")) << "the feedback changed nothing";
  EXPECT_TRUE(same("a", "d-default")) << "--damping 0.01 is not the default";
  EXPECT_FALSE(same("a", "d-large")) << "--damping changed nothing";
  EXPECT_FALSE(same("d-large", "off")) << "--damping 1 turned the feedback off";
  const auto e = run("eval " + q(dir.path / "a") + " --max-windows 1 --threads 1 --json");
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_TRUE(std::isfinite(last_json(e)["val_loss"].get<double>()));
  const auto o = run("eval " + q(sh->model) + " --quant lutb --calibration " + q(rare) +
                     " --max-windows 1 --threads 1 --json");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_DOUBLE_EQ(last_json(o)["val_loss"].get<double>(), last_json(e)["val_loss"].get<double>())
      << "the online fit differs from the checkpoint's";
  const auto g = run("quantize " + q(sh->model) + " -o " + q(dir.path / "g") + " --calibration " + q(rare) +
                     " --device cuda --no-progress");
  EXPECT_EQ(g.code, 2) << g.out;
  EXPECT_TRUE(has(g.out, "the fit with cross-column error feedback runs on the CPU only; use --device cpu, or "
                         "--error-feedback off"))
      << g.out;
}

// Error feedback needs the full moments of every layer (CalibrationStats::has_second_moments), in
// every command: with a file where one layer lacks them, quantize and the online fit of moe and eval
// all fit with the column weights alone, so `eval --calibration` stays the loss of the checkpoint that
// `quantize --calibration` writes.
TEST(CliCalibrate, FeedbackOnlyWhenEveryLayerHasFullMoments) {
  const auto sh = shared_mixtral();
  if (!sh) GTEST_SKIP() << "../shared models or calib tokens absent";
  test::TempDir dir;
  const auto full = dir.path / "full.safetensors";
  ASSERT_EQ(run("calibrate " + q(sh->model) + " --tokens " + q(sh->tokens) + " --max-tokens 256 -o " + q(full) +
                " --full-moments --threads 1")
                .code,
            0);
  // Layer 1's moments read into memory (save() writes the moments held in memory), the others not.
  CalibrationStats mixed = CalibrationStats::load(full);
  ASSERT_TRUE(mixed.has_second_moments());
  for (auto& [layer, l] : mixed.layers) {
    l.full_moments = layer == 1;
    if (layer == 1) read_moments(l, full);
  }
  ASSERT_EQ(mixed.layers.count(1), 1u);
  const auto mixed_file = dir.path / "mixed.safetensors", diag_file = dir.path / "diag.safetensors";
  mixed.save(mixed_file);
  CalibrationStats diag = mixed;
  diag.layers.at(1).gate_up_xxT.clear();
  diag.layers.at(1).down_hhT.clear();
  diag.save(diag_file);
  ASSERT_FALSE(CalibrationStats::load(mixed_file).has_second_moments());
  ASSERT_TRUE(CalibrationStats::load(mixed_file).layers.at(1).full_moments);
  const auto moe = [&](const fs::path& stats) {
    const auto r = run("moe " + q(sh->model) + " --layer 1 --quant lutb --threads 1 --json --calibration " + q(stats));
    EXPECT_EQ(r.code, 0) << r.out;
    return last_json(r)["rel_l2"].get<double>();
  };
  EXPECT_EQ(moe(mixed_file), moe(diag_file)) << "moe fitted layer 1 with feedback; quantize fits no layer with it";
  const auto full_rel = moe(full);
  EXPECT_NE(full_rel, moe(diag_file)) << "the feedback changed nothing";
}

TEST(CliCalibrate, Refusals) {
  const auto sh = shared_mixtral();
  if (!sh) GTEST_SKIP() << "../shared models or calib tokens absent";
  test::TempDir dir;
  auto r = run("calibrate " + q(sh->model) + " --tokens " + q(sh->model / "val_tokens.safetensors") + " -o " +
               q(dir.path / "s.safetensors"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "is the model's held-out evaluation set")) << r.out;
  const auto stats = dir.path / "stats.safetensors";
  ASSERT_EQ(run("calibrate " + q(sh->model) + " --tokens " + q(sh->tokens) + " --max-tokens 256 -o " + q(stats) +
                " --threads 1")
                .code,
            0);
  r = run("quantize " + q(sh->model) + " -o " + q(dir.path / "o") + " --calibration " + q(stats) + " --fitter ct-lloyd");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "--fitter ct-lloyd has no weighted objective")) << r.out;
  // --device cuda takes --calibration (the GPU's weighted fitters, tests/cuda/cli_gpu_test.cpp): here
  // it stops only where there is no usable GPU, as every --device cuda run does.
  r = run("quantize " + q(sh->model) + " -o " + q(dir.path / "o") + " --calibration " + q(stats) + " --device cuda");
  if (r.code != 0) {
    EXPECT_TRUE(has(r, "--device cuda: ")) << r.out;
  }
  r = run("eval " + q(sh->model) + " --quant lutb --calibration " + q(stats) + " --device cuda --max-windows 1");
  if (r.code != 0) {
    EXPECT_TRUE(has(r, "--device cuda: ")) << r.out;
  }
  r = run("eval " + q(sh->model) + " --quant mxfp4 --calibration " + q(stats));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "--calibration")) << r.out;
  // A checkpoint's weights given as the statistics: named as a file of another kind (its metadata
  // "format" is transformers' "pt"), by quantize and by the online fit alike.
  const fs::path weights = sh->model / "model.safetensors";
  for (const std::string& cmd : {"quantize " + q(sh->model) + " -o " + q(dir.path / "o3"),
                                 "eval " + q(sh->model) + " --quant lutb --max-windows 1"}) {
    r = run(cmd + " --calibration " + q(weights));
    EXPECT_EQ(r.code, 1) << cmd << "\n" << r.out;
    EXPECT_TRUE(has(r, "lutb: error: " + weights.string() + ": not a statistics file of lutb calibrate (its metadata "
                       "\"format\" is \"pt\", not \"lutb-calibration\")"))
        << cmd << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(dir.path / "o3"));
  // Statistics of another model: tiny-qwen3-moe's layers are under model.layers.L.mlp.experts, so
  // the statistics' first layer is named before any tensor is fitted.
  if (const auto qwen = test::model_dir("tiny-qwen3-moe")) {
    r = run("quantize " + q(*qwen) + " -o " + q(dir.path / "o2") + " --calibration " + q(stats));
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(has(r, "lutb: error: " + stats.string() + ": layer 0 (model.layers.0.block_sparse_moe.experts) has "
                       "statistics, but " + qwen->string() + " holds no routed experts under that prefix (were they "
                       "collected on this model?); nothing written"))
        << r.out;
  }
  // Statistics of a model with more layers (layer 2's copied as layer 9): the checkpoint has no experts
  // under layer 9's prefix, so they were collected on another model, in every command.
  CalibrationStats more = CalibrationStats::load(stats);
  LayerCalibration l9 = more.layers.at(2);
  l9.prefix = "model.layers.9.block_sparse_moe.experts";
  more.layers[9] = l9;
  const auto more_file = dir.path / "more.safetensors";
  more.save(more_file);
  const std::string extra = more_file.string() + ": layer 9 (model.layers.9.block_sparse_moe.experts) has statistics, "
                                                 "but " + sh->model.string() +
                            " holds no routed experts under that prefix (were they collected on this model?)";
  for (const std::string& cmd : {"quantize " + q(sh->model) + " -o " + q(dir.path / "o4"),
                                 "eval " + q(sh->model) + " --quant lutb --max-windows 1",
                                 "moe " + q(sh->model) + " --layer 1 --quant lutb"}) {
    r = run(cmd + " --calibration " + q(more_file));
    EXPECT_EQ(r.code, 1) << cmd << "\n" << r.out;
    EXPECT_TRUE(has(r, "lutb: error: " + extra)) << cmd << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(dir.path / "o4"));
}

// A NaN or an infinity in a routed expert's weight is refused before the model runs, named as lutb eval
// --quant lutb names it (file, tensor, layer, expert, row and column in the stored tensor's own rows),
// and nothing is written: no file, no temporary, no parent directory (statistics with NaN would be
// refused by quantize --calibration and lutb.CalibrationStats only after the run).
TEST(CliCalibrate, ANonFiniteExpertWeightIsRefusedByName) {
  const auto sh = shared_model("tiny-qwen3-moe");
  if (!sh) GTEST_SKIP() << "../shared models or calib tokens absent";
  test::TempDir dir;
  const fs::path m = test::copy_model(sh->model, dir.path / "m");
  const fs::path out = dir.path / "new" / "sub" / "stats.safetensors";
  const std::string args =
      "calibrate " + q(m) + " --tokens " + q(sh->tokens) + " --max-tokens 512 --threads 1 -o " + q(out);
  const std::string down = "model.layers.2.mlp.experts.3.down_proj.weight";  // [H 256, I 256]
  test::poke_bf16(m / "model.safetensors", down, 0, 0x7fc0);               // NaN at row 0 col 0
  auto r = run(args);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(r.out, "lutb: error: " + (m / "model.safetensors").string() + ": tensor " + down +
                       " (layer 2, expert 3), row 0 col 0: NaN; a non-finite weight makes the statistics of the "
                       "tokens it reaches NaN (and cannot be quantised to LUT-B, spec 2.1); nothing written\n")
      << r.out;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(listing(dir.path), std::vector<std::string>{"m"}) << "the created parents are removed again";
  // +Inf in up_proj of layer 0, expert 15, row 5 col 7 ([I 256, H 256]): named in up_proj's own rows.
  test::poke_bf16(m / "model.safetensors", down, 0, 0x3f80);
  const std::string up = "model.layers.0.mlp.experts.15.up_proj.weight";
  test::poke_bf16(m / "model.safetensors", up, 5 * 256 + 7, 0x7f80);
  r = run(args + " --down-input quantized-w13");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, ": tensor " + up + " (layer 0, expert 15), row 5 col 7: +Inf; ")) << r.out;
  EXPECT_EQ(listing(dir.path), std::vector<std::string>{"m"});
}

// Second line of defence: statistics that are not finite (here from a NaN outside the routed experts,
// which the model carries into every later layer) are never written; the error names the layer, the
// expert, the projection and the column, and the first stored tensor holding a NaN.
TEST(CliCalibrate, NonFiniteStatisticsAreNeverWritten) {
  const auto sh = shared_model("tiny-qwen3-moe");
  if (!sh) GTEST_SKIP() << "../shared models or calib tokens absent";
  test::TempDir dir;
  const fs::path m = test::copy_model(sh->model, dir.path / "m");
  const std::string o_proj = "model.layers.1.self_attn.o_proj.weight";
  test::poke_bf16(m / "model.safetensors", o_proj, 3, 0x7fc0);  // [256, 256]: row 0 col 3
  const fs::path out = dir.path / "stats.safetensors";
  const auto r = run("calibrate " + q(m) + " --tokens " + q(sh->tokens) + " --max-tokens 256 --threads 1 -o " + q(out));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: " + out.string() + ": the calibration statistics of layer 1 "
                         "(model.layers.1.mlp.experts), expert "))
      << r.out;
  EXPECT_TRUE(has(r, ", gate_up.x2 column 0 is NaN; statistics are finite and >= 0")) << r.out;
  EXPECT_TRUE(has(r, "; " + (m / "model.safetensors").string() + " holds NaN in tensor " + o_proj + " at [0, 3]"))
      << r.out;
  EXPECT_TRUE(has(r, "; nothing written")) << r.out;
  EXPECT_EQ(listing(dir.path), std::vector<std::string>{"m"});
}

// The output as lutb quantize's file mode and lutb synth treat theirs: missing parents are created;
// a place where nothing can be written is named by the output's path (never by its temporary) before
// the model runs; the name must be *.safetensors; and the option values are usage errors (exit 2)
// before any work.
TEST(CliCalibrate, OutputPathsAndOptionValues) {
  const auto sh = shared_model("tiny-qwen3-moe");
  if (!sh) GTEST_SKIP() << "../shared models or calib tokens absent";
  test::TempDir dir;
  const std::string base = "calibrate " + q(sh->model) + " --tokens " + q(sh->tokens) + " --max-tokens 256 --threads 1";
  const fs::path deep = dir.path / "a" / "b" / "stats.safetensors";
  auto r = run(base + " -o " + q(deep));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(CalibrationStats::load(deep).layers.size(), 4u);
  EXPECT_EQ(listing(deep.parent_path()), std::vector<std::string>{"stats.safetensors"});

  // /proc takes no new file: named by the output, before the model runs.
  const std::string in_proc = "/proc/lutb-calibrate-" + std::to_string(::getpid()) + "/stats.safetensors";
  r = run(base + " -o " + q(in_proc));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(r.out.rfind("lutb: error: " + in_proc + ": nothing can be created in /proc: ", 0), 0u) << r.out;
  EXPECT_TRUE(has(r, "; nothing written")) << r.out;
  EXPECT_FALSE(has(r, ".tmp.")) << r.out;
  EXPECT_FALSE(has(r, "lutb calibrate: ")) << "refused before the run: " << r.out;

  // A folder the user may not write (uid 65534; root writes anywhere).
  if (test::can_run_as_nobody()) {
    fs::permissions(dir.path, fs::perms::all);
    const fs::path ro = dir.path / "ro";
    fs::create_directory(ro);
    fs::permissions(ro, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                            fs::perms::others_read | fs::perms::others_exec);
    r = run(base + " -o " + q(ro / "stats.safetensors"), test::kAsNobody);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_EQ(r.out, "lutb: error: " + (ro / "stats.safetensors").string() +
                         ": cannot create the output: Permission denied; nothing written\n")
        << r.out;
    r = run(base + " -o " + q(ro / "sub" / "stats.safetensors"), test::kAsNobody);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_EQ(r.out, "lutb: error: " + (ro / "sub" / "stats.safetensors").string() + ": cannot create its parent "
                         "directory " + (ro / "sub").string() + ": Permission denied; nothing written\n")
        << r.out;
    EXPECT_TRUE(listing(ro).empty());
  }

  // Usage errors, reported before any work (the model folder need not even exist).
  struct Case {
    std::string args, expect;
  } usage[] = {
      {" -o " + q(dir.path / "s.txt"),
       "-o " + (dir.path / "s.txt").string() + ": the statistics file must be named *.safetensors"},
      {" -o " + q(dir.path / "s.safetensors") + " --max-tokens 100",
       "--max-tokens 100: fewer than one window of 256 tokens; give 0 (all the tokens) or at least 256"},
      {" -o " + q(dir.path / "s.safetensors") + " --max-tokens 255", "--max-tokens 255: fewer than one window"},
  };
  for (const auto& c : usage)
    for (const std::string& model : {q(sh->model), q(dir.path / "no-such-model")}) {
      r = run("calibrate " + model + " --tokens " + q(sh->tokens) + c.args);
      EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
      EXPECT_EQ(r.out.rfind("lutb: error: " + c.expect, 0), 0u) << c.args << "\n" << r.out;
      EXPECT_TRUE(has(r, kUsageHint)) << r.out;
    }
  EXPECT_FALSE(fs::exists(dir.path / "s.txt"));
  EXPECT_FALSE(fs::exists(dir.path / "s.safetensors"));

  // A tokens file shorter than one window is an input that cannot be used: exit 1.
  const fs::path few = dir.path / "few.safetensors";
  std::vector<std::uint8_t> ids(100 * 4, 0);
  write_safetensors(few, {{"input_ids", OwnedTensor{DType::I32, {100}, ids}}});
  r = run("calibrate " + q(sh->model) + " --tokens " + q(few) + " -o " + q(dir.path / "s.safetensors"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "100 calibration tokens are fewer than one window of 256")) << r.out;
  EXPECT_FALSE(fs::exists(dir.path / "s.safetensors"));
}

// Ctrl-C stops the run after the current batch of windows, as quantize stops: the signal's own exit
// status, the message, and nothing left behind (no file, no temporary, no created parent directory).
TEST(CliCalibrate, SigintStopsTheRunAndLeavesNothing) {
  const auto sh = shared_model("tiny-qwen3-moe");
  if (!sh) GTEST_SKIP() << "../shared models or calib tokens absent";
  test::TempDir dir;
  const fs::path out = dir.path / "new" / "stats.safetensors";
  // Every training token (1,365 windows) on one thread: well over a minute, so the signal, sent once the
  // missing parent has been created (just before the model loads), lands mid-run.
  const pid_t pid = test::spawn({"calibrate", sh->model.string(), "--tokens", sh->tokens.string(), "--threads", "1",
                                 "-o", out.string()},
                                dir.path / "log.txt");
  ASSERT_GT(pid, 0);
  int status = 0;
  bool ended = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(out.parent_path()) && std::chrono::steady_clock::now() < deadline)
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      ended = true;
      break;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  if (!ended) {
    ::kill(pid, SIGINT);
    ::waitpid(pid, &status, 0);
  }
  const std::string log = test::read_file(dir.path / "log.txt");
  ASSERT_FALSE(ended) << log;
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << "wait status " << status << "\n" << log;
  EXPECT_TRUE(has(log, "lutb: calibration: interrupted by signal 2 (Interrupt) after ")) << log;
  EXPECT_TRUE(has(log, " windows; nothing was created at " + out.string())) << log;
  EXPECT_EQ(listing(dir.path), std::vector<std::string>{"log.txt"});
}

}  // namespace
}  // namespace lutb
