// `lutb moe`: its JSON summary on captured activations, and its errors: bad options, captured
// activations (the default file, integer dtypes, no tokens, all-zero outputs, non-finite values), the
// model folder checked first, and per-expert LUT-B checkpoints it cannot run.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
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
#include <random>
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
using test::CliResult;
using test::copy_model;
using test::has;
using test::poke;
using test::poke_bf16;
using test::q;
using test::run;
using test::run_cli;
using test::TempDir;
using test::write_activations;

// Writes captured activations for layer 0 of a model of hidden size `H`.
void write_acts(const fs::path& p, DType in_dtype, std::int64_t H, std::uint8_t out_fill) {
  const std::int64_t T = 4;
  OwnedTensor in{in_dtype, {T, H}, std::vector<std::uint8_t>(static_cast<std::size_t>(T * H * dtype_size(in_dtype)), 0)};
  for (std::size_t i = 1; i < in.bytes.size(); i += 2) in.bytes[i] = 0x3F;  // BF16 1.0-ish values, or small integers
  OwnedTensor out{DType::BF16, {T, H}, std::vector<std::uint8_t>(static_cast<std::size_t>(T * H * 2), out_fill)};
  write_safetensors(p, {{"layers.0.moe_input", in}, {"layers.0.moe_output", out}});
}

const std::string kSynth =
    "synth --family qwen3_moe --layers 1 --hidden-size 128 --experts 4 --moe-intermediate-size 64 --no-progress ";

// A NaN in the captured activations is refused naming the activations tensor and the place, never printed as
// "rel_l2 nan".
TEST(CliMoe, NonFiniteActivationNamed) {
  MIXTRAL_OR_SKIP(x);
  const fs::path acts = x.m / "moe_activations.safetensors";
  const std::uint16_t nan = 0x7fc0;
  poke(acts, "layers.1.moe_input", 3 * 192 + 7, &nan, 2);
  const test::CliResult r = test::run_cli("moe " + test::q(x.m) + " --layer 1 --threads 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(has(r.err, "lutb: error: " + acts.string() +
                                  ": tensor layers.1.moe_input holds NaN at row 3 col 7 (token 3, hidden unit 7)"))
      << r.err;
  EXPECT_FALSE(has(r.out, "rel_l2")) << r.out;
}

// Captured activations of an integer dtype are refused naming the file and the tensor.
TEST(CliMoe, IntegerActivationsNameTheFile) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const fs::path acts = t.path / "acts.safetensors";
  write_acts(acts, DType::I16, 256, 0x3C);
  const test::CliResult r =
      test::run_cli("moe " + test::q(src) + " --layer 0 --threads 1 --activations " + test::q(acts));
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_EQ(r.err, "lutb: error: " + acts.string() +
                       ": tensor layers.0.moe_input has dtype I16; captured activations must be floating point (BF16, "
                       "F16, F32, F64 or F8_E4M3)\n");
}

// Captured outputs that are all zero are refused: the relative error against them is undefined (it would print
// "rel_l2 inf ... cosine -nan" and exit 0).
TEST(CliMoe, AllZeroCapturedOutputsRefused) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const fs::path acts = t.path / "acts.safetensors";
  write_acts(acts, DType::BF16, 256, 0x00);
  const test::CliResult r = test::run_cli("moe " + test::q(src) + " --layer 0 --threads 1 --json --activations " +
                                          test::q(acts));
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_EQ(r.err, "lutb: error: " + acts.string() +
                       ": tensor layers.0.moe_output is all zero (4 tokens): the error relative to it is undefined; "
                       "were the outputs captured?\n");
  EXPECT_EQ(r.out.find("inf"), std::string::npos) << r.out;
  // Non-zero outputs still run (the same inputs, outputs of BF16 0x3C3C = 0.0115).
  write_acts(acts, DType::BF16, 256, 0x3C);
  const test::CliResult ok = test::run_cli("moe " + test::q(src) + " --layer 0 --threads 1 --json --activations " +
                                           test::q(acts));
  ASSERT_EQ(ok.status, 0) << ok.out << ok.err;
  EXPECT_EQ(ok.json()["tokens"], 4);
}

// lutb moe on a layer whose router holds +Inf names the tensor, as lutb eval does, not only "N of M outputs
// are NaN or infinite".
TEST(CliMoe, NamesTheNonFiniteTensor) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const fs::path m = t.path / "m";
  fs::create_directories(m);
  for (const char* f : {"config.json", "model.safetensors", "moe_activations.safetensors"}) {
    fs::copy_file(src / f, m / f);
    fs::permissions(m / f, fs::perms::owner_read | fs::perms::owner_write);
  }
  poke_bf16(m / "model.safetensors", "model.layers.1.mlp.gate.weight", 5, 0x7F80);  // +Inf
  // An input norm of the same layer holding NaN is not the MoE block's: not named.
  poke_bf16(m / "model.safetensors", "model.layers.1.input_layernorm.weight", 0, 0x7FC0);
  const test::CliResult r = test::run_cli("moe " + test::q(m) + " --layer 1 --threads 1");
  EXPECT_EQ(r.status, 1);
  const std::string want = "a weight, scale or input of the layer is NaN or overflowed; " +
                           (m / "model.safetensors").string() +
                           " holds +Inf in tensor model.layers.1.mlp.gate.weight at [0, 5]\n";
  ASSERT_GE(r.err.size(), want.size()) << r.err;
  EXPECT_EQ(r.err.substr(r.err.size() - want.size()), want) << r.err;
}

// lutb moe on a folder that is no model (empty, config.json a FIFO, config.json holding [1,2]) names the model
// folder's problem as lutb eval does (exit 1), before looking for the default activations file.
TEST(CliMoe, ChecksTheModelFolderFirst) {
  TempDir t;
  const fs::path empty = t.path / "empty", fifo = t.path / "fifo", array = t.path / "array";
  fs::create_directories(empty);
  fs::create_directories(fifo);
  ASSERT_EQ(::mkfifo((fifo / "config.json").c_str(), 0644), 0);
  fs::create_directories(array);
  std::ofstream(array / "config.json") << "[1,2]";
  const struct {
    fs::path dir;
    std::string want;
  } cases[] = {
      {empty, (empty / "config.json").string() + ": cannot open: No such file or directory"},
      {fifo, (fifo / "config.json").string() + ": is a named pipe (FIFO); the checkpoint's config.json must be a "
                                               "regular file"},
      {array, (array / "config.json").string() + ": not a JSON object"},
  };
  for (const auto& c : cases) {
    const CliOut r = test::run("moe " + q(c.dir) + " --layer 0");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_EQ(r.out.rfind("lutb: error: " + c.want, 0), 0u) << r.out;
    EXPECT_FALSE(has(r, "--activations not given")) << r.out;
    // eval's message is the same.
    const CliOut e = test::run("eval " + q(c.dir));
    EXPECT_EQ(e.code, 1) << e.out;
    EXPECT_EQ(e.out.rfind("lutb: error: " + c.want, 0), 0u) << e.out;
  }
}

// The model folders ship their captured activations as MODEL_DIR/moe_activations.safetensors: `lutb moe
// MODEL_DIR --layer L` uses that file when --activations is not given.
TEST(CliMoe, DefaultsToTheFoldersActivations) {
  LUTB_MODEL_OR_SKIP(m, "tiny-qwen3-moe");
  const CliOut def = run("moe " + q(m) + " --layer 1 --json --threads 1");
  ASSERT_EQ(def.code, 0) << def.out;
  const CliOut given = run("moe " + q(m) + " --layer 1 --json --threads 1 --activations " +
                           q(m / "moe_activations.safetensors"));
  ASSERT_EQ(given.code, 0) << given.out;
  const auto last_json = [](const std::string& s) {
    const std::size_t b = s.rfind("\n{");
    return nlohmann::json::parse(s.substr(b + 1));
  };
  const auto jd = last_json(def.out), jg = last_json(given.out);
  EXPECT_EQ(jd["activations_file"], (m / "moe_activations.safetensors").string());
  EXPECT_EQ(jd["tokens"], jg["tokens"]);
  EXPECT_GT(jd["tokens"].get<int>(), 0);
  EXPECT_EQ(jd["rel_l2"], jg["rel_l2"]);
  EXPECT_LT(jd["rel_l2"].get<double>(), 1e-2);  // BF16 experts on their own captured inputs

  // A folder without the file: the option and the default are named.
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "-o " + q(t.path / "s")).code, 0);
  const CliOut r = run("moe " + q(t.path / "s") + " --layer 0");
  EXPECT_EQ(r.code, 2) << r.out;  // a usage error: the option is needed here
  EXPECT_TRUE(has(r, "lutb: error: --activations not given and " + (t.path / "s").string() +
                         " holds no moe_activations.safetensors (the captured MoE inputs and outputs); give the file "
                         "with --activations FILE"))
      << r.out;
  EXPECT_TRUE(has(run("moe --help"), "(default MODEL_DIR/moe_activations.safetensors when it exists)"));
}

// lutb moe on a per-expert LUT-B checkpoint with moe_intermediate_size 100 (not a multiple of 8) names the
// file, the stored tensor and what to do, never a library function; the remedy it names runs.
TEST(CliMoe, PerExpertLutbWithWidthNotAMultipleOf8) {
  test::TempDir t;
  const std::string synth = "synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 100 "
                            "--experts 4 --no-progress -o ";
  ASSERT_EQ(run(synth + q(t.path / "bf16")).code, 0);
  ASSERT_EQ(run("quantize " + q(t.path / "bf16") + " -o " + q(t.path / "lutb") + " --no-progress").code, 0);
  write_activations(t.path / "acts.safetensors", 0, 8, 128);
  const std::string acts = " --layer 0 --threads 1 --activations " + q(t.path / "acts.safetensors");
  const CliOut r = run("moe " + q(t.path / "lutb") + acts);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: " + (t.path / "lutb" / "model.safetensors").string() +
                         ": tensor model.layers.0.mlp.experts.0.gate_proj.weight_packed (layer 0): this checkpoint "
                         "stores each expert's gate and up projections as separate LUT-B tensors"))
      << r.out;
  EXPECT_TRUE(has(r, "moe_intermediate_size 100 of " + (t.path / "lutb" / "config.json").string())) << r.out;
  EXPECT_TRUE(has(r, "or run the BF16 checkpoint with --quant lutb")) << r.out;
  EXPECT_FALSE(has(r, "lutb_projection()")) << r.out;
  // The remedy: the BF16 checkpoint with --quant lutb runs.
  const CliOut ok = run("moe " + q(t.path / "bf16") + acts + " --quant lutb");
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_TRUE(has(ok, "rel_l2 ")) << ok.out;
}

// Captured activations of no tokens ([0, H]) are refused: the errors over no tokens are undefined ("rel_l2
// -nan ... cosine -nan" with exit status 0).
TEST(CliMoe, WithoutTokensRefused) {
  const auto src = test::model_dir("tiny-qwen3-moe");
  if (!src) GTEST_SKIP() << "model tiny-qwen3-moe absent (../shared/models): skipping";
  TempDir t;
  const fs::path acts = t.path / "acts.safetensors";
  write_safetensors(acts, {{"layers.0.moe_input", OwnedTensor{DType::BF16, {0, 256}, {}}},
                           {"layers.0.moe_output", OwnedTensor{DType::BF16, {0, 256}, {}}}});
  const test::CliResult r =
      test::run_cli("moe " + test::q(*src) + " --layer 0 --threads 1 --activations " + test::q(acts));
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("lutb: error: " + acts.string() +
                       ": tensor layers.0.moe_input has shape [0, 256]: it holds no tokens to run the block on"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("nan"), std::string::npos) << r.out;
}

TEST(CliMoe, JsonOnCapturedActivationsDeepseekV3) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-deepseek-v3");
  const std::string acts = lutb::test::q(dir / "moe_activations.safetensors");
  const CliResult none = run_cli("moe " + lutb::test::q(dir) + " --layer 2 --activations " + acts + " --json");
  ASSERT_EQ(none.status, 0) << none.err;
  const auto a = none.json();
  EXPECT_EQ(a["layer"], 2);
  EXPECT_EQ(a["quant"], "none");
  EXPECT_EQ(a["activations"], "bf16");
  EXPECT_EQ(a["tokens"], 512);
  // FP32 compute against transformers' BF16 capture (routed + shared experts): BF16 rounding of the
  // inputs, weights and outputs, 2^-9 each, bounds the difference to about 1%.
  EXPECT_LT(a["rel_l2"].get<double>(), 0.01);
  EXPECT_GT(a["cosine"].get<double>(), 0.9999);
  EXPECT_GT(a["max_abs"].get<double>(), 0.0);

  const CliResult q = run_cli("moe " + lutb::test::q(dir) + " --layer 2 --activations " + acts + " --quant lutb --json");
  ASSERT_EQ(q.status, 0) << q.err;
  const auto b = q.json();
  EXPECT_EQ(b["quant"], "lutb");
  EXPECT_EQ(b["activations"], "mxfp8");
  const double eps = std::pow(10.0, -b["sqnr_db"].get<double>() / 20);
  // Two quantised products in series (w13 then w2), each with relative weight error eps, plus MXFP8
  // activations: the output error is about sqrt(2) eps; 2 eps bounds it. And it exceeds BF16's.
  EXPECT_GT(b["rel_l2"].get<double>(), a["rel_l2"].get<double>());
  EXPECT_LT(b["rel_l2"].get<double>(), 2 * eps);
  std::printf("[ model ] lutb moe layer 2: rel_l2 none %.3e, lutb %.3e (eps %.3e)\n", a["rel_l2"].get<double>(),
              b["rel_l2"].get<double>(), eps);
}
TEST(CliMoe, BadInputs) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-deepseek-v3");
  const std::string acts = lutb::test::q(dir / "moe_activations.safetensors");
  // --layer beyond the layers or on a dense one, a format given as the file: usage errors, exit status 2
  // (README "Exit status").
  CliResult r = run_cli("moe " + lutb::test::q(dir) + " --layer 9 --activations " + acts);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("out of range"), std::string::npos) << r.err;
  r = run_cli("moe " + lutb::test::q(dir) + " --layer 0 --activations " + acts);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("dense (non-MoE) layer"), std::string::npos) << r.err;
  r = run_cli("moe " + lutb::test::q(dir) + " --layer 1 --activations /nonexistent/acts.safetensors");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("activations file not found"), std::string::npos) << r.err;
  // A format name given to moe's --activations (eval's meaning) is named as a format, not as a
  // missing file ("mxfp8: activations file not found").
  r = run_cli("moe " + lutb::test::q(dir) + " --layer 1 --activations mxfp8");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--activations takes a file for `moe`"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--act-format mxfp8"), std::string::npos) << r.err;
  // a capture file without that layer
  TempDir tmp;
  const auto partial = tmp.path / "acts.safetensors";
  lutb::write_safetensors(partial, {{"input_ids", lutb::OwnedTensor{lutb::DType::I32, {1}, {0, 0, 0, 0}}}});
  r = run_cli("moe " + lutb::test::q(dir) + " --layer 3 --activations " + lutb::test::q(partial));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("no tensor layers.3.moe_input"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace lutb
