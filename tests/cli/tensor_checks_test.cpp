// The tensors of a checkpoint as lutb quantize, eval and moe check them: dense tensors of the wrong
// shape or dtype, experts stored twice or in mixed dtypes, tensors an index leaves out, foreign FP8
// block scales, stray or misspelt names. Each refusal names the file and the tensor.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/config_json.hpp"
#include "io/tensor_names.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/dtype.hpp"
#include "lutb/model.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::CliOut;
using test::copy_model;
using test::edit_header;
using test::has;
using test::kSynthAnyWidth;
using test::kSynthDefaultLayers;
using test::patched_model;
using test::poke;
using test::q;
using test::run;
using test::TempDir;
using test::write_activations_of_layers;

// lutb quantize copied broken non-expert tensors without a look; only lutb eval, after the
// whole quantisation, refused them. Now refused before anything is written, with the loader's wording.
class QuantizeChecksDenseTensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto src = test::model_dir("tiny-qwen3-moe");
    if (!src) GTEST_SKIP() << "model tiny-qwen3-moe absent (../shared/models): skipping";
    m = copy_model(*src, t.path / "m");
    out = t.path / "out";
  }
  test::CliResult quantize() const {
    return test::run_cli("quantize " + test::q(m) + " -o " + test::q(out) + " --no-progress --threads 1");
  }
  void expect_refused(const test::CliResult& r, const std::string& message) const {
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_TRUE(has(r.err, "lutb: error: " + message + "; nothing written")) << r.err;
    EXPECT_FALSE(fs::exists(out));
    for (const auto& e : fs::directory_iterator(t.path))  // no temporary left either
      EXPECT_TRUE(e.path().filename() == "m") << e.path();
  }
  TempDir t;
  fs::path m, out;
};

// Rewrites a safetensors file: tensor `f32_name` (BF16) converted to F32, and `extra` tensors added.
void rewrite(const fs::path& file, const std::string& f32_name, const std::vector<std::pair<std::string, std::vector<std::int64_t>>>& extra) {
  const fs::path tmp = file.string() + ".new";
  {
    const SafetensorsFile in(file);
    SafetensorsWriter w(tmp, in.metadata());
    for (const auto& n : in.names()) {
      const TensorView& v = in.get(n);
      w.declare(n, n == f32_name ? DType::F32 : v.dtype, v.shape);
    }
    for (const auto& [n, shape] : extra) w.declare(n, DType::F32, shape);
    for (const auto& n : in.names()) {
      const TensorView& v = in.get(n);
      if (n != f32_name) {
        w.write(v.data, v.nbytes);
        continue;
      }
      ASSERT_EQ(v.dtype, DType::BF16);
      const std::vector<float> f = v.to_float();  // exact
      w.write(f.data(), f.size() * sizeof(float));
    }
    for (const auto& [n, shape] : extra) {
      std::int64_t k = 1;
      for (auto d : shape) k *= d;
      const std::vector<float> ones(static_cast<std::size_t>(k), 1.0f);
      w.write(ones.data(), ones.size() * sizeof(float));
    }
    w.commit();
  }
  fs::rename(tmp, file);
}

TEST_F(QuantizeChecksDenseTensors, RouterOfTheWrongShape) {
  // Same byte count, so the file stays valid: [16, 256] stored as [32, 128].
  edit_header(m / "model.safetensors",
              [](nlohmann::json& j) { j["model.layers.1.mlp.gate.weight"]["shape"] = {32, 128}; });
  expect_refused(quantize(), (m / "model.safetensors").string() +
                                 ": tensor model.layers.1.mlp.gate.weight has shape [32, 128], expected [16, 256] from "
                                 "the sizes in " +
                                 (m / "config.json").string());
}

TEST_F(QuantizeChecksDenseTensors, MissingEmbedding) {
  edit_header(m / "model.safetensors", [](nlohmann::json& j) {
    j["model.embed_tokens.weighX"] = j["model.embed_tokens.weight"];
    j.erase("model.embed_tokens.weight");
  });
  // "Not found" messages name the files searched.
  expect_refused(quantize(), m.string() + ": missing tensor model.embed_tokens.weight; " +
                                 (m / "model.safetensors").string() + " has no such tensor");
}

TEST_F(QuantizeChecksDenseTensors, IntegerLayerNorm) {
  edit_header(m / "model.safetensors",
              [](nlohmann::json& j) { j["model.layers.0.input_layernorm.weight"]["dtype"] = "I16"; });
  expect_refused(quantize(), (m / "model.safetensors").string() +
                                 ": tensor 'model.layers.0.input_layernorm.weight': dtype I16 cannot be read as "
                                 "floating point");
}

TEST_F(QuantizeChecksDenseTensors, NaNLayerNormFoundWhileCopying) {
  const std::uint16_t nan = 0x7fc0;
  poke(m / "model.safetensors", "model.layers.1.post_attention_layernorm.weight", 5, &nan, 2);
  expect_refused(quantize(), (m / "model.safetensors").string() +
                                 ": tensor model.layers.1.post_attention_layernorm.weight (BF16) holds NaN at [5]: lutb "
                                 "eval and lutb moe cannot compute with a non-finite weight");
}

TEST_F(QuantizeChecksDenseTensors, UndamagedCopyStillQuantises) {
  const test::CliResult r = quantize();
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

// One BF16-max weight (3.39e38) in an expert: `lutb eval --quant none` refuses it before the forward pass,
// naming the tensor, the row and the column, rather than reporting a non-finite loss.
TEST(CliTensorChecks, HugeExpertWeightNamedByEvalNone) {
  MIXTRAL_OR_SKIP(x);
  const std::uint16_t bf16_max = 0x7f7f;
  const std::string w = "model.layers.1.block_sparse_moe.experts.2.w1.weight";
  poke(x.st(), w, 5, &bf16_max, 2);
  const test::CliResult r = test::run_cli("eval " + test::q(x.m) + " --quant none --max-windows 1 --threads 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(has(r.err, "lutb: error: " + x.st().string() + ": tensor " + w +
                                  " (layer 1, expert 2), row 0 col 5: magnitude 3.3895314e+38 is 2^64 or more"))
      << r.err;
  EXPECT_FALSE(has(r.err, "non-finite loss")) << r.err;
}

// One F32 expert in an otherwise BF16 layer is read by eval as quantize reads it (exactly: the loss equals the
// BF16 copy's).
TEST(CliTensorChecks, MixedDtypeExpertsAccepted) {
  MIXTRAL_OR_SKIP(x);
  const test::CliResult before = test::run_cli("eval " + test::q(x.m) + " --quant none --max-windows 1 --threads 1 --json");
  ASSERT_EQ(before.status, 0) << before.err;
  rewrite(x.st(), "model.layers.1.block_sparse_moe.experts.3.w2.weight", {});
  ASSERT_EQ(SafetensorsFile(x.st()).get("model.layers.1.block_sparse_moe.experts.3.w2.weight").dtype, DType::F32);
  const test::CliResult after = test::run_cli("eval " + test::q(x.m) + " --quant none --max-windows 1 --threads 1 --json");
  ASSERT_EQ(after.status, 0) << after.err;
  EXPECT_EQ(after.json()["val_loss"].get<double>(), before.json()["val_loss"].get<double>());
  const test::CliResult lutb = test::run_cli("eval " + test::q(x.m) + " --quant lutb --max-windows 1 --threads 1 --json");
  EXPECT_EQ(lutb.status, 0) << lutb.err;
}

// model.safetensors.index.json leaving out a tensor its shard holds: the error names the index and the shard.
TEST(CliTensorChecks, TensorLeftOutOfTheIndexNamesIndexAndShard) {
  MIXTRAL_OR_SKIP(x);
  const std::string left = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
  nlohmann::json map = nlohmann::json::object();
  {
    const SafetensorsFile f(x.st());
    for (const auto& n : f.names())
      if (n != left) map[n] = "model.safetensors";
  }
  std::ofstream(x.m / "model.safetensors.index.json") << nlohmann::json{{"metadata", nlohmann::json::object()}, {"weight_map", map}}.dump();
  const test::CliResult r = test::run_cli("eval " + test::q(x.m) + " --quant none --max-windows 1 --threads 1");
  EXPECT_EQ(r.status, 1);
  // A missing routed expert is worded as lutb quantize words it (layer, config.json).
  EXPECT_TRUE(has(r.err, "routed-expert tensor " + left + " is missing; " + x.st().string() + " holds it, but " +
                                  (x.m / "model.safetensors.index.json").string() +
                                  "'s weight_map does not list it (add it there)"))
      << r.err;
}

// A BF16 weight whose tile needs a scale byte above 246 is named with its row and column, as the F64 case is.
TEST(CliTensorChecks, ScaleOverflowNamesRowAndColumn) {
  MIXTRAL_OR_SKIP(x);
  const std::uint16_t bf16_max = 0x7f7f;
  const std::string w = "model.layers.0.block_sparse_moe.experts.1.w2.weight";  // [192, 320]
  ASSERT_EQ(SafetensorsFile(x.st()).get(w).shape, (std::vector<std::int64_t>{192, 320}));
  poke(x.st(), w, 9 * 320 + 70, &bf16_max, 2);
  const fs::path out = x.t.path / "q";
  const test::CliResult r =
      test::run_cli("quantize " + test::q(x.m) + " -o " + test::q(out) + " --no-progress --threads 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(has(r.err, "lutb: error: " + x.st().string() + ": tensor " + w +
                                  ", tile (1, 1): magnitude 3.3895314e+38 at row 9 col 70 needs a scale byte above 246 "
                                  "(spec section 2); nothing written"))
      << r.err;
  EXPECT_FALSE(fs::exists(out));
}

// An FP8 block scale (*.weight_scale_inv) in a checkpoint without quantization_config is refused by all three
// commands, naming the file and the tensor: the F8_E4M3 weight cannot be read without it.
TEST(CliTensorChecks, ForeignBlockScalesRefused) {
  MIXTRAL_OR_SKIP(x);
  const std::string s = "model.layers.0.self_attn.q_proj.weight_scale_inv";
  rewrite(x.st(), "", {{s, {2, 2}}});
  const std::string msg = x.st().string() + ": tensor " + s + " is the block scale of a weight quantised by another method";
  const fs::path out = x.t.path / "q";
  for (const std::string& cmd : {"eval " + test::q(x.m) + " --max-windows 1 --threads 1",
                                "moe " + test::q(x.m) + " --layer 1 --threads 1",
                                "quantize " + test::q(x.m) + " -o " + test::q(out) + " --no-progress"}) {
    const test::CliResult r = test::run_cli(cmd);
    EXPECT_EQ(r.status, 1) << cmd;
    EXPECT_TRUE(has(r.err, "lutb: error: " + msg)) << cmd << "\n" << r.err;
    EXPECT_TRUE(has(r.err, "dequantise the checkpoint to BF16 first")) << r.err;
  }
  EXPECT_FALSE(fs::exists(out));
}

// A layer storing its routed experts twice, per expert (experts.0.gate_proj.weight, ...) and stacked
// (experts.gate_up_proj, experts.down_proj), is refused by the check all three commands share, naming both
// tensors: reading either copy silently would give the loss of the other weights.
TEST(CliTensorChecks, ExpertsStoredInTwoLayoutsRefused) {
  TempDir t;
  const fs::path bf = t.path / "bf", out = t.path / "lb";
  synthesize_checkpoint(bf, test::small_synth());  // one layer: one file, model.safetensors
  // Layer 0 gains a stacked copy of its experts (zeros).
  {
    std::vector<std::pair<std::string, OwnedTensor>> all;
    {
      const SafetensorsFile f(bf / "model.safetensors");
      for (const auto& n : f.names()) {
        const TensorView& v = f.get(n);
        all.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
      }
    }
    all.push_back({"model.layers.0.mlp.experts.gate_up_proj",
                   OwnedTensor{DType::BF16, {4, 128, 128}, std::vector<std::uint8_t>(4 * 128 * 128 * 2, 0)}});
    all.push_back({"model.layers.0.mlp.experts.down_proj",
                   OwnedTensor{DType::BF16, {4, 128, 64}, std::vector<std::uint8_t>(4 * 128 * 64 * 2, 0)}});
    write_safetensors(bf / "model.safetensors", all);
  }
  const std::string want = (bf / "model.safetensors").string() +
                           ": layer 0 stores its routed experts twice, in two layouts "
                           "(model.layers.0.mlp.experts.0.down_proj.weight and "
                           "model.layers.0.mlp.experts.down_proj); lutb would read one and ignore the other: remove "
                           "the copy that is not the model's";
  const ModelConfig cfg = load_model_config(bf);
  const SafetensorsCollection st = SafetensorsCollection::open_dir(bf);
  try {
    (void)detail::check_tensor_names(cfg, st, bf / "config.json", "not read", "");
    ADD_FAILURE() << "no exception";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()), want);
  }
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  try {
    quantize_checkpoint(bf, out, q);
    ADD_FAILURE() << "no exception";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()), want + "; nothing written");
  }
  EXPECT_FALSE(fs::exists(out));
  // The stacked copy alone is fine.
  {
    std::vector<std::pair<std::string, OwnedTensor>> keep;
    {
      const SafetensorsFile f(bf / "model.safetensors");
      for (const auto& n : f.names()) {
        if (n.rfind("model.layers.0.mlp.experts.", 0) == 0 && n.find("_proj.weight") != std::string::npos) continue;
        const TensorView& v = f.get(n);
        keep.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
      }
    }
    write_safetensors(bf / "model.safetensors", keep);
  }
  const SafetensorsCollection mixed = SafetensorsCollection::open_dir(bf);
  EXPECT_NO_THROW((void)detail::check_tensor_names(cfg, mixed, bf / "config.json", "not read", ""));
}

// lutb moe / lutb eval on a checkpoint that lacks one routed expert name the layer, config.json and the file
// searched, as lutb quantize does.
TEST(CliTensorChecks, MissingRoutedExpertNamesTheFileSearched) {
  test::TempDir t;
  const fs::path in = t.path / "in";
  ASSERT_EQ(run(kSynthDefaultLayers + "--layers 1 -o " + q(in)).code, 0);
  const std::string gone = "model.layers.0.mlp.experts.3.gate_proj.weight";
  test::merge_without(in, gone);
  write_activations_of_layers(t.path / "acts.safetensors", 128, 1);
  const CliOut r = run("moe " + q(in) + " --layer 0 --activations " + q(t.path / "acts.safetensors"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "layer 0 is a MoE layer of " + (in / "config.json").string() + ", which declares 4 routed experts, "
                     "but its routed-expert tensor " + gone + " is missing; " + (in / "model.safetensors").string() +
                     " has no such tensor"))
      << r.out;
}

// lutb quantize warns (and its JSON summary lists) a per-expert checkpoint whose width lutb eval and moe
// cannot run.
TEST(CliTensorChecks, QuantizeWarnsAboutAPerExpertCheckpointItCannotRun) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthAnyWidth + "--moe-intermediate-size 12 -o " + q(t.path / "in")).code, 0);
  const CliOut r = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "o") + " --no-progress --json");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "lutb: warning: " + (t.path / "o").string() + ": the expert width moe_intermediate_size 12 of "))
      << r.out;
  EXPECT_TRUE(has(r, "lutb eval and lutb moe cannot run it")) << r.out;
  // The JSON summary carries it too (the last stdout line; the warning went to stderr after it).
  const auto p = r.out.find("{\"bits_per_weight\"");
  ASSERT_NE(p, std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(p, r.out.find('\n', p) - p));
  ASSERT_EQ(j.at("warnings").size(), 1u);
  EXPECT_NE(j["warnings"][0].get<std::string>().find("is not a multiple of 8"), std::string::npos);
}

// Tensors the model does not have are reported: lutb eval and moe warn that they do not read them, quantize
// that it copies them unquantised; a misspelt expert tensor or one beyond the experts count is an error. The
// real models raise no warning.
TEST(CliTensorChecks, StrayAndMisspeltTensorsAreReported) {
  LUTB_MODEL_OR_SKIP(qw, "tiny-qwen3-moe");
  for (const char* m : {"tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3"}) {
    LUTB_MODEL_OR_SKIP(d, m);
    const CliOut r = run("eval " + q(d) + " --max-windows 1 --threads 1");
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_FALSE(has(r, "warning")) << r.out;
  }
  test::TempDir t;
  // A synthetic checkpoint of the shared model's shapes, with tensors it does not have added by the
  // library's writer (BF16 [2, 2]).
  const fs::path d = patched_model(t.path / "m", qw, nlohmann::json::object());
  fs::remove(d / "model.safetensors");
  {
    // Copy model.safetensors with two stray tensors.
    std::vector<std::pair<std::string, OwnedTensor>> ts;
    SafetensorsFile f(qw / "model.safetensors");
    for (const auto& n : f.names()) {
      const TensorView& v = f.get(n);
      ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
    ts.push_back({"model.extra.weight", OwnedTensor{DType::BF16, {2, 2}, std::vector<std::uint8_t>(8, 0)}});
    write_safetensors(d / "model.safetensors", ts);
    ts.push_back({"model.layers.2.mlp.experts.16.down_proj.weight",
                  OwnedTensor{DType::BF16, {2, 2}, std::vector<std::uint8_t>(8, 0)}});
    fs::create_directories(t.path / "bad");
    for (const auto& e : fs::directory_iterator(d))
      if (e.path().filename() != "model.safetensors") fs::copy(e.path(), t.path / "bad" / e.path().filename());
    write_safetensors(t.path / "bad" / "model.safetensors", ts);
  }
  const std::string warn = "lutb: warning: " + (d / "model.safetensors").string() +
                           ": tensor model.extra.weight is not a tensor of the qwen3_moe model " +
                           (d / "config.json").string() + " describes; ";
  const CliOut e = run("eval " + q(d) + " --max-windows 1 --threads 1");
  EXPECT_EQ(e.code, 0) << e.out;
  EXPECT_TRUE(has(e, warn + "lutb eval does not read it\n")) << e.out;
  EXPECT_TRUE(has(e, "val loss     ")) << e.out;
  const CliOut m = run("moe " + q(d) + " --layer 1 --threads 1");
  EXPECT_EQ(m.code, 0) << m.out;
  EXPECT_TRUE(has(m, warn + "lutb moe does not read it\n")) << m.out;
  const CliOut qz = run("quantize " + q(d) + " -o " + q(t.path / "q") + " --no-progress");
  EXPECT_EQ(qz.code, 0) << qz.out;
  EXPECT_TRUE(has(qz, warn + "copied unquantised\n")) << qz.out;

  const std::string err = "lutb: error: " + (t.path / "bad" / "model.safetensors").string() +
                          ": tensor model.layers.2.mlp.experts.16.down_proj.weight names expert 16, but " +
                          (t.path / "bad" / "config.json").string() +
                          " declares 16 experts (0..15); lutb would not read it: rename or remove it";
  const CliOut be = run("eval " + q(t.path / "bad") + " --max-windows 1 --threads 1");
  EXPECT_EQ(be.code, 1) << be.out;
  EXPECT_TRUE(has(be, err + "\n")) << be.out;
  const CliOut bm = run("moe " + q(t.path / "bad") + " --layer 1 --threads 1");
  EXPECT_EQ(bm.code, 1) << bm.out;
  EXPECT_TRUE(has(bm, err + "\n")) << bm.out;
}

}  // namespace
}  // namespace lutb
