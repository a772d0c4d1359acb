// config.json errors as the commands print them: the file, the key and what to do.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::CliOut;
using test::CliResult;
using test::has;
using test::kSynthSmall;
using test::patched_model;
using test::run;
using test::run_cli;
using test::TempDir;

// Tiny-mixtral copied to `to` (config.json, the weights, the tokens) with config.json's `key` set to `value`.
void copy_with_config(const fs::path& from, const fs::path& to, const std::string& key, const nlohmann::json& value) {
  fs::create_directories(to);
  for (const char* f : {"model.safetensors", "val_tokens.safetensors"}) fs::copy_file(from / f, to / f);
  nlohmann::json c = nlohmann::json::parse(std::ifstream(from / "config.json"));
  c[key] = value;
  std::ofstream(to / "config.json") << c.dump(2);
}

// eval and moe list the supported families when config.json has no model_type (as quantize does), and a LUT-B
// checkpoint that lost its quantization_config is told so, not "lutb would not read it: rename or remove it"
// of its own expert tensors.
TEST(CliConfigMessages, SayWhatToDo) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthSmall + "-o " + test::q(t.path / "in")).code, 0);
  ASSERT_EQ(run("quantize " + test::q(t.path / "in") + " -o " + test::q(t.path / "lutb") + " --no-progress").code, 0);
  const fs::path cfg_path = t.path / "lutb" / "config.json";
  nlohmann::json cfg;
  std::ifstream(cfg_path) >> cfg;
  cfg.erase("quantization_config");
  std::ofstream(cfg_path) << cfg.dump();
  const std::string acts = " --activations " + test::q(t.path / "in" / "model.safetensors");
  const CliOut m = run("moe " + test::q(t.path / "lutb") + " --layer 0 --threads 1" + acts);
  EXPECT_EQ(m.code, 1) << m.out;
  EXPECT_TRUE(has(m, "is a LUT-B tensor of a routed expert, but " + cfg_path.string() +
                         " has no LUT-B quantization_config (the \"quantization_config\" with \"quant_method\": "
                         "\"lut_b\" that says how to read LUT-B weights, spec 2.2; a BF16 checkpoint's experts are "
                         "float tensors): if the checkpoint's experts are LUT-B, restore the config.json written with "
                         "them; otherwise remove the tensor"))
      << m.out;
  const CliOut qz = run("quantize " + test::q(t.path / "lutb") + " -o " + test::q(t.path / "again") + " --no-progress");
  EXPECT_EQ(qz.code, 1) << qz.out;
  EXPECT_TRUE(has(qz, ": the checkpoint is already LUT-B: it holds LUT-B routed-expert tensors")) << qz.out;
  EXPECT_FALSE(fs::exists(t.path / "again"));

  cfg.erase("model_type");
  std::ofstream(cfg_path) << cfg.dump();
  for (const std::string& c : {"eval " + test::q(t.path / "lutb"), "moe " + test::q(t.path / "lutb") + " --layer 0" + acts,
                               "quantize " + test::q(t.path / "lutb") + " -o " + test::q(t.path / "again")}) {
    const CliOut r = run(c);
    EXPECT_EQ(r.code, 1) << c << "\n" << r.out;
    EXPECT_TRUE(has(r, "lutb: error: " + cfg_path.string() +
                           ": key 'model_type': required but missing (supported: qwen3_moe, qwen2_moe, mixtral, "
                           "deepseek_v3, deepseek_v2, olmoe)"))
        << c << "\n" << r.out;
  }
}

// Config errors of eval and moe name config.json and the key: the grouped router, the sliding window, and a
// dense layer given to lutb moe (then the option).
TEST(CliConfigMessages, NameTheFileAndKey) {
  LUTB_MODEL_OR_SKIP(ds, "tiny-deepseek-v3");
  LUTB_MODEL_OR_SKIP(mx, "tiny-mixtral");
  test::TempDir t;
  const fs::path d1 = patched_model(t.path / "ds", ds, {{"topk_group", 1}, {"num_experts_per_tok", 5}});
  for (const std::string& cmd : {"eval " + test::q(d1) + " --max-windows 1", "moe " + test::q(d1) + " --layer 1"}) {
    const CliOut r = run(cmd);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(has(r, "lutb: error: " + (d1 / "config.json").string() +
                           ": key 'num_experts_per_tok': 5 exceeds the 4 experts of the groups the router keeps "
                           "(topk_group 1 x 4 experts per group: 16 experts in n_group 4)"))
        << r.out;
  }
  const fs::path d2 = patched_model(t.path / "mx", mx, {{"sliding_window", 128}});
  const CliOut r2 = run("eval " + test::q(d2) + " --max-windows 1");
  EXPECT_EQ(r2.code, 1) << r2.out;
  EXPECT_TRUE(has(r2, "lutb: error: " + (d2 / "config.json").string() +
                          ": key 'sliding_window': mixtral sets sliding-window attention with a window of 128 tokens, "
                          "which lutb does not implement, and the sequences here are 256 tokens long"))
      << r2.out;
  // A dense layer is a usage error of --layer (exit status 2, the option named).
  const CliOut r3 = run("moe " + test::q(ds) + " --layer 0");
  EXPECT_EQ(r3.code, 2) << r3.out;
  EXPECT_TRUE(has(r3, "lutb: error: --layer 0: layer 0 of " + ds.string() + " is a dense (non-MoE) layer per " +
                          (ds / "config.json").string() + " (its MoE layers: 1, 2, 3)"))
      << r3.out;
  // DeepSeek topk_method and routed_scaling_factor (finding 3), through the command line.
  const fs::path d3 = patched_model(t.path / "ds3", ds, {{"routed_scaling_factor", -2.5}});
  const CliOut r4 = run("eval " + test::q(d3) + " --max-windows 1");
  EXPECT_EQ(r4.code, 1) << r4.out;
  EXPECT_TRUE(has(r4, "lutb: error: " + (d3 / "config.json").string() +
                          ": key 'routed_scaling_factor': must be a finite number > 0, got -2.5"))
      << r4.out;
}

// One validation of config.json: lutb quantize refuses what lutb eval refuses (rms_norm_eps -1e-5, a NaN loss
// in any runtime; num_key_value_heads not dividing num_attention_heads; a negative sliding_window), with
// eval's message, before writing anything; a missing parent it would have created is not left behind.
TEST(CliConfigMessages, QuantizeRefusesTheConfigValuesEvalRefuses) {
  LUTB_MODEL_OR_SKIP(model, "tiny-mixtral");
  TempDir t;
  const struct {
    const char* key;
    nlohmann::json value;
    const char* why;
  } cases[] = {
      {"rms_norm_eps", -1e-5, "key 'rms_norm_eps': must be a finite number >= 0, got -1e-05"},
      {"num_key_value_heads", 2, "key 'num_key_value_heads': 2 must divide num_attention_heads (3)"},
      {"sliding_window", -4, "key 'sliding_window': must be a positive number of tokens (or 0 / null for none), got -4"},
  };
  int i = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.key);
    const fs::path in = t.path / ("in" + std::to_string(i)), parent = t.path / ("new" + std::to_string(i++));
    copy_with_config(model, in, c.key, c.value);
    const std::string cfg = (in / "config.json").string();
    const CliResult e = run_cli("eval " + test::q(in) + " --max-windows 1");
    EXPECT_EQ(e.status, 1);
    EXPECT_TRUE(has(e.err, cfg + ": " + c.why)) << e.err;
    const CliResult q = run_cli("quantize " + test::q(in) + " -o " + test::q(parent / "q") + " --no-progress");
    EXPECT_EQ(q.status, 1) << q.out;
    EXPECT_TRUE(has(q.err, cfg + ": " + c.why)) << q.err;
    EXPECT_TRUE(has(q.err, "lutb eval refuses this value; quantize checks config.json as eval does")) << q.err;
    EXPECT_TRUE(has(q.err, "nothing written")) << q.err;
    EXPECT_FALSE(fs::exists(parent)) << "a failed run must not leave the parent it would have created";
  }
  // A valid value of a feature lutb's model does not implement stays a valid quantize input (the output
  // serves other runtimes), while eval says it cannot run it.
  const fs::path gelu = t.path / "gelu";
  copy_with_config(model, gelu, "hidden_act", "gelu");
  const CliResult q = run_cli("quantize " + test::q(gelu) + " -o " + test::q(t.path / "gelu-q") + " --no-progress");
  EXPECT_EQ(q.status, 0) << q.err;
  const CliResult e = run_cli("eval " + test::q(t.path / "gelu-q") + " --max-windows 1");
  EXPECT_EQ(e.status, 1);
  EXPECT_TRUE(has(e.err, "key 'hidden_act': \"gelu\" is not supported (silu)")) << e.err;
}

}  // namespace
}  // namespace lutb
