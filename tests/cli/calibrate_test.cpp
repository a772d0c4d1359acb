// `lutb calibrate` and `--calibration` of quantize / eval on a shared model (skipped without
// ../shared): the statistics' names and counts, an expert no calibration token reaches (no NaN, a
// deterministic fit), and the refusals (and --device cuda, which takes --calibration).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "lutb/calibration.hpp"
#include "lutb/safetensors.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

using test::has;
using test::q;
using test::run;

struct Shared {
  std::filesystem::path model, tokens;
};

std::optional<Shared> shared_mixtral() {
  const auto m = test::model_dir("tiny-mixtral");
  const auto s = test::shared_dir();
  if (!m || !s || !std::filesystem::exists(*s / "calib/train_tokens.safetensors")) return std::nullopt;
  return Shared{*m, *s / "calib/train_tokens.safetensors"};
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
  // The file exists now: refused without --force.
  const auto again = run("calibrate " + q(sh->model) + " --tokens " + q(sh->tokens) + " -o " + q(stats));
  EXPECT_EQ(again.code, 2) << again.out;
  EXPECT_TRUE(has(again, "the file exists; give --force")) << again.out;
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
  // Statistics of another model: tiny-qwen3-moe's layers are under model.layers.L.mlp.experts.
  if (const auto qwen = test::model_dir("tiny-qwen3-moe")) {
    r = run("quantize " + q(*qwen) + " -o " + q(dir.path / "o2") + " --calibration " + q(stats));
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(has(r, "no calibration statistics for tensor model.layers.")) << r.out;
  }
}

}  // namespace
}  // namespace lutb
