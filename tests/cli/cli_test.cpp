// The lutb command line: quantize, synth and the default job, run as a user runs them (the built
// binary at LUTB_CLI_PATH), checking exit codes, messages and the --json summaries.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;

using test::CliOut;
using test::last_json_line;
using test::q;
using test::run;

TEST(Cli, SynthThenQuantizeJson) {
  test::TempDir t;
  CliOut s = run("synth --family mixtral --layers 2 --hidden-size 128 --moe-intermediate-size 64 --experts 4 -o " +
              q(t.path / "in"));
  ASSERT_EQ(s.code, 0) << s.out;
  EXPECT_NE(s.out.find("mixtral"), std::string::npos) << s.out;
  const ModelConfig c = load_model_config(t.path / "in");
  EXPECT_EQ(c.num_experts, 4);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  CliOut r = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "out") + " --threads 1 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = last_json_line(r.out);
  EXPECT_EQ(j["tensors_quantized"], 2 * 4 * 3);
  EXPECT_EQ(j["tensors_copied"], 2);  // the two routers
  EXPECT_DOUBLE_EQ(j["bits_per_weight"].get<double>(), kBitsPerWeight);
  EXPECT_GT(j["sqnr_db"].get<double>(), 10.0);
  EXPECT_EQ(j["fitter"], default_fitter());
  EXPECT_TRUE(Checkpoint(t.path / "out").is_lutb());
  // Same run again: the output exists.
  CliOut again = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "out"));
  EXPECT_EQ(again.code, 1);
  EXPECT_NE(again.out.find("exists"), std::string::npos) << again.out;
  // A LUT-B checkpoint with another fitter, --force.
  CliOut f = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "out") + " --force --fitter ct-lloyd --json");
  ASSERT_EQ(f.code, 0) << f.out;
  EXPECT_EQ(last_json_line(f.out)["fitter"], "ct-lloyd");
  EXPECT_EQ(Checkpoint(t.path / "out").quant_config()->fitter, "ct-lloyd");
}

TEST(Cli, QuantizeFileMatchAll) {
  test::TempDir t;
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  std::vector<std::uint8_t> w(24 * 100 * 2);
  for (std::size_t i = 0; i < w.size(); i += 2) {
    const std::uint16_t v = bf16_from_float(static_cast<float>((i * 7919) % 101) / 50.0f - 1.0f);
    std::memcpy(&w[i], &v, 2);
  }
  ts.push_back({"x.weight", OwnedTensor{DType::BF16, {24, 100}, w}});
  ts.push_back({"y.weight", OwnedTensor{DType::BF16, {24, 100}, w}});
  write_safetensors(t.path / "in.safetensors", ts);
  CliOut m = run("quantize " + q(t.path / "in.safetensors") + " -o " + q(t.path / "m.safetensors") + " --match '^x' --json");
  ASSERT_EQ(m.code, 0) << m.out;
  EXPECT_EQ(last_json_line(m.out)["tensors_quantized"], 1);
  SafetensorsFile f(t.path / "m.safetensors");
  EXPECT_TRUE(f.contains("x.weight_packed"));
  EXPECT_TRUE(f.contains("y.weight"));
  EXPECT_EQ(f.metadata().at("lutb.logical_shape.x.weight"), "[24, 100]");
  CliOut a = run("quantize " + q(t.path / "in.safetensors") + " -o " + q(t.path / "a.safetensors") + " --all --json");
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_EQ(last_json_line(a.out)["tensors_quantized"], 2);
  CliOut both = run("quantize " + q(t.path / "in.safetensors") + " -o " + q(t.path / "b.safetensors") + " --all --match x");
  EXPECT_NE(both.code, 0);
  EXPECT_NE(both.out.find("excludes"), std::string::npos) << both.out;
  EXPECT_FALSE(fs::exists(t.path / "b.safetensors"));
}

TEST(Cli, ErrorsAreClear) {
  test::TempDir t;
  CliOut fam = run("synth --family llama --layers 1 -o " + q(t.path / "x"));
  EXPECT_EQ(fam.code, 2);  // a usage error
  EXPECT_NE(fam.out.find("llama"), std::string::npos) << fam.out;
  EXPECT_NE(fam.out.find("deepseek_v3"), std::string::npos) << fam.out;
  EXPECT_FALSE(fs::exists(t.path / "x"));
  CliOut missing = run("quantize " + q(t.path / "nothing") + " -o " + q(t.path / "y"));
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.out.find("nothing"), std::string::npos) << missing.out;
  CliOut noout = run("quantize " + q(t.path));
  EXPECT_NE(noout.code, 0);
  EXPECT_NE(noout.out.find("--output"), std::string::npos) << noout.out;
  fs::create_directories(t.path / "c");
  std::ofstream(t.path / "c" / "config.json") << R"({"model_type": "gpt2", "hidden_size": 8})";
  CliOut unk = run("quantize " + q(t.path / "c") + " -o " + q(t.path / "z"));
  EXPECT_EQ(unk.code, 1);
  EXPECT_NE(unk.out.find("unsupported model_type \"gpt2\""), std::string::npos) << unk.out;
  EXPECT_FALSE(fs::exists(t.path / "z"));
}

// The main job, with 4 experts instead of 128 so that it runs in a second or two: the same
// pipeline (synthesise, quantise to a LUT-B checkpoint, load, BF16 reference vs LUT-B emulation).
TEST(Cli, DefaultJobSmall) {
  test::TempDir t;
  // A user's existing --work-dir keeps its other contents: the job removes only what it created.
  fs::create_directories(t.path / "w");
  std::ofstream(t.path / "w" / "precious.txt") << "keep me";
  CliOut r = run("--experts 4 --tokens 16 --json --work-dir " + q(t.path / "w"));
  ASSERT_EQ(r.code, 0) << r.out;
  const nlohmann::json j = last_json_line(r.out);
  EXPECT_EQ(j["experts"], 4);
  EXPECT_EQ(j["hidden_size"], 2048);
  EXPECT_EQ(j["moe_intermediate_size"], 768);
  EXPECT_EQ(j["top_k"], 4);  // k = min(8, E)
  EXPECT_DOUBLE_EQ(j["bits_per_weight"].get<double>(), kBitsPerWeight);
  EXPECT_EQ(j["bytes_bf16"], 4ull * 3 * 768 * 2048 * 2);
  EXPECT_EQ(j["bytes_lutb"], 4ull * 3 * 768 * 2048 / 512 * 201);
  // 3-bit weights on Student-t data: ~13 dB per weight; the layer output error follows from it.
  EXPECT_GT(j["sqnr_db"].get<double>(), 11.0);
  EXPECT_LT(j["sqnr_db"].get<double>(), 16.0);
  EXPECT_GT(j["rel_l2"].get<double>(), 0.1);
  EXPECT_LT(j["rel_l2"].get<double>(), 0.6);
  EXPECT_GT(j["cosine"].get<double>(), 0.8);
  EXPECT_FALSE(fs::exists(t.path / "w" / "qwen3-30b-a3b-layer-bf16"));  // removed without --keep
  EXPECT_FALSE(fs::exists(t.path / "w" / "qwen3-30b-a3b-layer-lutb"));
  EXPECT_TRUE(fs::exists(t.path / "w" / "precious.txt"));
}

}  // namespace
}  // namespace lutb
