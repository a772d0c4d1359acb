// Defects a fresh new user found in session 12 (helper nu12b), on copies of the tiny real models
// damaged one tensor at a time. Each test failed on the code before its fix.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/dtype.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "model/model_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

// A writable copy of a shared model folder (the files the commands read).
fs::path copy_model(const fs::path& src, const fs::path& dst) {
  fs::create_directories(dst);
  for (const char* f : {"config.json", "model.safetensors", "val_tokens.safetensors", "moe_activations.safetensors"}) {
    if (!fs::exists(src / f)) continue;
    fs::copy_file(src / f, dst / f);
    fs::permissions(dst / f, fs::perms::owner_read | fs::perms::owner_write);
  }
  return dst;
}

// Rewrites the header of a safetensors file in place (its length kept: padded with spaces).
void edit_header(const fs::path& file, const std::function<void(nlohmann::json&)>& edit) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t hn = 0;
  f.read(reinterpret_cast<char*>(&hn), 8);
  std::string header(hn, '\0');
  f.read(header.data(), static_cast<std::streamsize>(hn));
  auto j = nlohmann::json::parse(header);
  edit(j);
  std::string out = j.dump();
  ASSERT_LE(out.size(), hn);
  out.resize(hn, ' ');
  f.seekp(8);
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
}

// Overwrites element `index` (of `bytes` bytes) of tensor `name` with `value`.
void poke(const fs::path& file, const std::string& name, std::int64_t index, const void* value, std::size_t bytes) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t hn = 0;
  f.read(reinterpret_cast<char*>(&hn), 8);
  std::string header(hn, '\0');
  f.read(header.data(), static_cast<std::streamsize>(hn));
  const auto j = nlohmann::json::parse(header);
  const std::uint64_t off = 8 + hn + j.at(name).at("data_offsets")[0].get<std::uint64_t>() + index * bytes;
  f.seekp(static_cast<std::streamoff>(off));
  f.write(static_cast<const char*>(value), static_cast<std::streamsize>(bytes));
}

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

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Item 1: lutb quantize copied broken non-expert tensors without a look; only lutb eval, after the
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
    return test::run_cli("quantize " + test::quote(m) + " -o " + test::quote(out) + " --no-progress --threads 1");
  }
  void expect_refused(const test::CliResult& r, const std::string& message) const {
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_TRUE(contains(r.err, "lutb: error: " + message + "; nothing written")) << r.err;
    EXPECT_FALSE(fs::exists(out));
    for (const auto& e : fs::directory_iterator(t.path))  // no temporary left either
      EXPECT_TRUE(e.path().filename() == "m") << e.path();
  }
  TempDir t;
  fs::path m, out;
};

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
  // Session 19: "not found" messages name the files searched.
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

// A tiny-mixtral copy, writable.
struct Mixtral {
  Mixtral() {
    const auto src = test::model_dir("tiny-mixtral");
    if (src) m = copy_model(*src, t.path / "m");
  }
  TempDir t;
  fs::path m;
  fs::path st() const { return m / "model.safetensors"; }
};
#define MIXTRAL_OR_SKIP(x) \
  Mixtral x;               \
  if (x.m.empty()) GTEST_SKIP() << "model tiny-mixtral absent (../shared/models): skipping"

// Item 2: one BF16-max weight (3.39e38) in an expert: `lutb eval --quant none` failed with
// "non-finite loss ... likely corrupt" naming no tensor. Now refused before the forward pass.
TEST(NewUserNu12b, HugeExpertWeightNamedByEvalNone) {
  MIXTRAL_OR_SKIP(x);
  const std::uint16_t bf16_max = 0x7f7f;
  const std::string w = "model.layers.1.block_sparse_moe.experts.2.w1.weight";
  poke(x.st(), w, 5, &bf16_max, 2);
  const test::CliResult r = test::run_cli("eval " + test::quote(x.m) + " --quant none --max-windows 1 --threads 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(contains(r.err, "lutb: error: " + x.st().string() + ": tensor " + w +
                                  " (layer 1, expert 2), row 0 col 5: magnitude 3.3895314e+38 is 2^64 or more"))
      << r.err;
  EXPECT_FALSE(contains(r.err, "non-finite loss")) << r.err;
}

// Item 2: a NaN in the captured activations: `lutb moe` printed "rel_l2 nan" and an error naming
// neither the activations tensor nor the place.
TEST(NewUserNu12b, NonFiniteActivationNamed) {
  MIXTRAL_OR_SKIP(x);
  const fs::path acts = x.m / "moe_activations.safetensors";
  const std::uint16_t nan = 0x7fc0;
  poke(acts, "layers.1.moe_input", 3 * 192 + 7, &nan, 2);
  const test::CliResult r = test::run_cli("moe " + test::quote(x.m) + " --layer 1 --threads 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(contains(r.err, "lutb: error: " + acts.string() +
                                  ": tensor layers.1.moe_input holds NaN at row 3 col 7 (token 3, hidden unit 7)"))
      << r.err;
  EXPECT_FALSE(contains(r.out, "rel_l2")) << r.out;
}

// Item 3a: one F32 expert in an otherwise BF16 layer: quantize took it, eval refused it ("F32 but the
// other experts of the stack are BF16"). eval now reads it (exactly: the loss equals the BF16 copy's).
TEST(NewUserNu12b, MixedDtypeExpertsAccepted) {
  MIXTRAL_OR_SKIP(x);
  const test::CliResult before = test::run_cli("eval " + test::quote(x.m) + " --quant none --max-windows 1 --threads 1 --json");
  ASSERT_EQ(before.status, 0) << before.err;
  rewrite(x.st(), "model.layers.1.block_sparse_moe.experts.3.w2.weight", {});
  ASSERT_EQ(SafetensorsFile(x.st()).get("model.layers.1.block_sparse_moe.experts.3.w2.weight").dtype, DType::F32);
  const test::CliResult after = test::run_cli("eval " + test::quote(x.m) + " --quant none --max-windows 1 --threads 1 --json");
  ASSERT_EQ(after.status, 0) << after.err;
  EXPECT_EQ(after.json()["val_loss"].get<double>(), before.json()["val_loss"].get<double>());
  const test::CliResult lutb = test::run_cli("eval " + test::quote(x.m) + " --quant lutb --max-windows 1 --threads 1 --json");
  EXPECT_EQ(lutb.status, 0) << lutb.err;
}

// Item 3b: model.safetensors.index.json leaves out a tensor its shard holds: quantize (which reads the
// shards) quantised it, eval said "tensor ... not found" without naming the index or the shard.
TEST(NewUserNu12b, TensorLeftOutOfTheIndexNamesIndexAndShard) {
  MIXTRAL_OR_SKIP(x);
  const std::string left = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
  nlohmann::json map = nlohmann::json::object();
  {
    const SafetensorsFile f(x.st());
    for (const auto& n : f.names())
      if (n != left) map[n] = "model.safetensors";
  }
  std::ofstream(x.m / "model.safetensors.index.json") << nlohmann::json{{"metadata", nlohmann::json::object()}, {"weight_map", map}}.dump();
  const test::CliResult r = test::run_cli("eval " + test::quote(x.m) + " --quant none --max-windows 1 --threads 1");
  EXPECT_EQ(r.status, 1);
  // Session 19: a missing routed expert is worded as lutb quantize words it (layer, config.json).
  EXPECT_TRUE(contains(r.err, "routed-expert tensor " + left + " is missing; " + x.st().string() + " holds it, but " +
                                  (x.m / "model.safetensors.index.json").string() +
                                  "'s weight_map does not list it (add it there)"))
      << r.err;
}

// Item 3c: a BF16 weight whose tile needs a scale byte above 246: quantize named the tile only, the F64
// case the row and column too.
TEST(NewUserNu12b, ScaleOverflowNamesRowAndColumn) {
  MIXTRAL_OR_SKIP(x);
  const std::uint16_t bf16_max = 0x7f7f;
  const std::string w = "model.layers.0.block_sparse_moe.experts.1.w2.weight";  // [192, 320]
  ASSERT_EQ(SafetensorsFile(x.st()).get(w).shape, (std::vector<std::int64_t>{192, 320}));
  poke(x.st(), w, 9 * 320 + 70, &bf16_max, 2);
  const fs::path out = x.t.path / "q";
  const test::CliResult r =
      test::run_cli("quantize " + test::quote(x.m) + " -o " + test::quote(out) + " --no-progress --threads 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(contains(r.err, "lutb: error: " + x.st().string() + ": tensor " + w +
                                  ", tile (1, 1): magnitude 3.3895314e+38 at row 9 col 70 needs a scale byte above 246 "
                                  "(spec section 2); nothing written"))
      << r.err;
  EXPECT_FALSE(fs::exists(out));
}

// Item 4: an FP8 block scale (*.weight_scale_inv) in a checkpoint without quantization_config: the
// F8_E4M3 weight was read without it. All three commands refuse it, naming the file and the tensor.
TEST(NewUserNu12b, ForeignBlockScalesRefused) {
  MIXTRAL_OR_SKIP(x);
  const std::string s = "model.layers.0.self_attn.q_proj.weight_scale_inv";
  rewrite(x.st(), "", {{s, {2, 2}}});
  const std::string msg = x.st().string() + ": tensor " + s + " is the block scale of a weight quantised by another method";
  const fs::path out = x.t.path / "q";
  for (const std::string& cmd : {"eval " + test::quote(x.m) + " --max-windows 1 --threads 1",
                                "moe " + test::quote(x.m) + " --layer 1 --threads 1",
                                "quantize " + test::quote(x.m) + " -o " + test::quote(out) + " --no-progress"}) {
    const test::CliResult r = test::run_cli(cmd);
    EXPECT_EQ(r.status, 1) << cmd;
    EXPECT_TRUE(contains(r.err, "lutb: error: " + msg)) << cmd << "\n" << r.err;
    EXPECT_TRUE(contains(r.err, "dequantise the checkpoint to BF16 first")) << r.err;
  }
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace lutb
