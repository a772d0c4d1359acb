// Defects a new user found in session 15 (nu15) that stayed open, fixed in session 16 (cli16), and
// where `lutb eval` fits the routed experts. Each defect's test failed on the code before its fix.
// (The third open defect, a LUT-B checkpoint with scale byte 246 on every tile: tests/model/
// cli_model_test.cpp CliEval.StoredScale246IsRefusedNamingTheTensor.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/model_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::CliResult;
using test::quote;
using test::run_cli;
using test::TempDir;

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// tiny-mixtral copied to `to` (config.json, the weights, the tokens) with config.json's `key` set to `value`.
void copy_with_config(const fs::path& from, const fs::path& to, const std::string& key, const nlohmann::json& value) {
  fs::create_directories(to);
  for (const char* f : {"model.safetensors", "val_tokens.safetensors"}) fs::copy_file(from / f, to / f);
  nlohmann::json c = nlohmann::json::parse(std::ifstream(from / "config.json"));
  c[key] = value;
  std::ofstream(to / "config.json") << c.dump(2);
}

// `lutb quantize` checked config.json with the checkpoint module's parser only and ignored whatever
// lutb eval's model validation refused: a checkpoint with rms_norm_eps -1e-5 (a NaN loss in any
// runtime), num_key_value_heads not dividing num_attention_heads, or a negative sliding_window was
// quantised (exit 0), and only eval of the output refused it. One validation now: quantize refuses what
// eval refuses, with eval's message, before writing anything; a missing parent it would have created
// is not left behind.
TEST(CliNu15Open, QuantizeRefusesTheConfigValuesEvalRefuses) {
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
    const CliResult e = run_cli("eval " + quote(in) + " --max-windows 1");
    EXPECT_EQ(e.status, 1);
    EXPECT_TRUE(has(e.err, cfg + ": " + c.why)) << e.err;
    const CliResult q = run_cli("quantize " + quote(in) + " -o " + quote(parent / "q") + " --no-progress");
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
  const CliResult q = run_cli("quantize " + quote(gelu) + " -o " + quote(t.path / "gelu-q") + " --no-progress");
  EXPECT_EQ(q.status, 0) << q.err;
  const CliResult e = run_cli("eval " + quote(t.path / "gelu-q") + " --max-windows 1");
  EXPECT_EQ(e.status, 1);
  EXPECT_TRUE(has(e.err, "key 'hidden_act': \"gelu\" is not supported (silu)")) << e.err;
}

// `lutb quantize -o missing/x` refused "x: parent directory does not exist" while `lutb synth -o
// missing/x` created the parent: both create it now (still writing to a temporary name and renaming),
// in checkpoint and in file mode.
TEST(CliNu15Open, QuantizeCreatesAMissingParentAsSynthDoes) {
  LUTB_MODEL_OR_SKIP(model, "tiny-mixtral");
  TempDir t;
  const fs::path out = t.path / "a" / "b" / "q";
  CliResult r = run_cli("quantize " + quote(model) + " -o " + quote(out) + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(out / "config.json"));
  EXPECT_TRUE(fs::is_regular_file(out / "model.safetensors"));
  for (const auto& e : fs::directory_iterator(t.path / "a" / "b"))  // only q: no temporary left
    EXPECT_EQ(e.path().filename(), "q");
  const fs::path file = t.path / "c" / "d" / "acts.safetensors";
  r = run_cli("quantize " + quote(model / "moe_activations.safetensors") + " -o " + quote(file) + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(file));
  // synth, for comparison: the same behaviour.
  r = run_cli("synth --family mixtral --layers 1 --hidden-size 64 --moe-intermediate-size 64 --experts 2 -o " +
              quote(t.path / "e" / "f" / "s") + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(t.path / "e" / "f" / "s" / "config.json"));
}

// eval --quant lutb on a BF16 checkpoint fits the routed experts at load and says where and how long
// (--device cuda fits on the GPU: tests/cuda/cli_gpu_test.cpp); nothing is fitted for --quant none.
TEST(CliNu15Open, EvalReportsWhereTheFitRan) {
  LUTB_MODEL_OR_SKIP(model, "tiny-mixtral");
  const CliResult r = run_cli("eval " + quote(model) + " --quant lutb --max-windows 1 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = r.json();
  EXPECT_EQ(j["fit_device"], "cpu");
  EXPECT_GT(j["fit_seconds"].get<double>(), 0.0);
  EXPECT_EQ(j["fit_weights"].get<std::int64_t>(), 3 * 8 * 3 * 320 * 192);  // layers x E x (gate, up, down) x I x H
  EXPECT_TRUE(j["fit_note"].is_null());
  EXPECT_TRUE(has(r.out, "fit          cpu (binned-dp): ")) << r.out;
  const CliResult n = run_cli("eval " + quote(model) + " --quant none --max-windows 1 --json");
  ASSERT_EQ(n.status, 0) << n.err;
  EXPECT_FALSE(n.json().contains("fit_device"));
  EXPECT_FALSE(has(n.out, "fit          ")) << n.out;
}

}  // namespace
}  // namespace lutb
