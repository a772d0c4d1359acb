// What a fresh new user found in session 18 (helper nu18) on the lutb command line. Each test failed on
// the code before its fix.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;

using test::CliOut;
using test::has;
using test::q;
using test::run;

const std::string kSynth =
    "synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 4 --no-progress ";

constexpr const char* kHint = "Run 'lutb --help' (or 'lutb COMMAND --help') for the options.";

// One convention for every command (README "Exit status"): CLI11's parse errors exited 2, the tool's
// own option checks 1 (`--threads -1` and `--fitter nope` ended differently; new-user QA sessions
// 16-18). Every usage error now exits 2 with the prefix and the --help hint, before any work; a
// failure of the work exits 1.
TEST(CliNewUserNu18, UsageErrorsExitTwoFailuresOne) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "-o " + q(t.path / "in")).code, 0);
  const std::string in = q(t.path / "in");
  const std::string out = " -o " + q(t.path / "o");
  struct Case {
    std::string args, expect;
  } usage[] = {
      // The tool's own checks, each exit status 1 before.
      {"quantize " + in + out + " --fitter nope", "--fitter: unknown fitter 'nope'"},
      {"quantize " + in + out + " --fitter ''", "--fitter: the fitter name is empty"},
      {"quantize " + in + " -o ''", "--output: an empty output name was given"},
      {"quantize " + in + out + " --match 'experts'", "--match/--all apply to a single .safetensors file"},
      {"quantize " + q(t.path / "in" / "model.safetensors") + " -o " + q(t.path / "o.safetensors") + " --match '('",
       "--match \"(\": invalid regular expression"},
      {"eval " + in + " --kernel reference", "--kernel reference only applies to LUT-B experts"},
      {"eval " + in + " --quant none --fitter optimal", "--fitter optimal only applies to --quant lutb"},
      {"eval " + in + " --quant lutb --fitter kmeans", "--fitter: unknown fitter 'kmeans'"},
      {"moe " + in + " --layer 0 --reps 3", "--reps applies to --device cuda only"},
      {"moe " + in + " --layer 0", "--activations not given and "},
      {"moe " + in + " --layer 5 --activations " + q(t.path / "in" / "model.safetensors"),
       "--layer 5 is out of range: " + (t.path / "in").string() + " has layers 0..0"},
      {"synth --family llama --layers 1" + out, "--family llama: unknown family"},
      {"synth --family qwen3_moe --layers 1 --nu 1 " + out, "--nu 1: must be a number in (2, 1e6]"},
      {"synth --family qwen3_moe --layers 1 -o ''", "--output: an empty output name was given"},
      {"--fitter nope --experts 1 --tokens 1", "--fitter: unknown fitter 'nope'"},
      // CLI11's own, exit status 2 already: unchanged.
      {"quantize " + in + out + " --threads -1", "--threads: -1 is outside the valid range 0..4096"},
      // Session 19: CLI11's "The following argument was not expected: --bogus" explained (usage_hints.hpp).
      {"eval " + in + " --bogus", "lutb eval: unknown option --bogus; lutb eval --help lists its options"},
  };
  for (const auto& c : usage) {
    const CliOut r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_EQ(r.out.rfind("lutb: error: " + c.expect, 0), 0u) << c.args << "\n" << r.out;
    EXPECT_TRUE(has(r, kHint)) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, "the main job")) << c.args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(t.path / "o"));
  EXPECT_FALSE(fs::exists(t.path / "o.safetensors"));

  // Failures of the work: exit status 1, without the usage hint.
  std::ofstream(t.path / "file") << "x";
  fs::create_directory(t.path / "exists");
  const Case failures[] = {
      {"quantize " + q(t.path / "nothing") + out, (t.path / "nothing").string() + ": no such checkpoint directory or file"},
      {"quantize " + in + " -o " + q(t.path / "exists"), (t.path / "exists").string() + ": output directory exists"},
      {"eval " + q(t.path / "nothing"), (t.path / "nothing").string() + ": no such directory"},
      {"moe " + in + " --layer 0 --activations " + q(t.path / "none.safetensors"),
       (t.path / "none.safetensors").string() + ": activations file not found"},
      {"synth --family qwen3_moe --layers 1 -o " + q(t.path / "file" / "s"), ""},
  };
  for (const auto& c : failures) {
    const CliOut r = run(c.args);
    EXPECT_EQ(r.code, 1) << c.args << "\n" << r.out;
    EXPECT_EQ(r.out.rfind("lutb: error: " + c.expect, 0), 0u) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, kHint)) << c.args << "\n" << r.out;
  }
  // --help says it.
  const CliOut help = run("--help");
  EXPECT_EQ(help.code, 0);
  EXPECT_TRUE(has(help, "Exit status: 0 success; 1 the work failed")) << help.out;
  EXPECT_TRUE(has(help, "2 a usage error")) << help.out;
}

// A dense layer given to lutb moe (DeepSeek-V3's layer 0) is a usage error, as an index beyond the
// layers is; it exited 1 from the library.
TEST(CliNewUserNu18, MoeOnADenseLayerIsAUsageError) {
  LUTB_MODEL_OR_SKIP(m, "tiny-deepseek-v3");
  const CliOut r = run("moe " + q(m) + " --layer 0 --threads 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: --layer 0: layer 0 of " + m.string() + " is a dense (non-MoE) layer per " +
                         (m / "config.json").string() + " (its MoE layers: 1, 2, 3)"))
      << r.out;
  EXPECT_FALSE(has(r, "rel_l2")) << r.out;
}

// Settings --device cuda has no path for are usage errors, judged from the options before looking for
// a GPU: without a GPU they were reported as "no usable CUDA GPU" (fix the machine, then learn the
// options are wrong), and with one they exited 1.
TEST(CliNewUserNu18, GpuOptionCombinationsAreUsageErrorsOnAnyMachine) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "-o " + q(t.path / "in")).code, 0);
  const std::string in = q(t.path / "in");
  const std::string acts = " --activations " + q(t.path / "in" / "model.safetensors");
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"eval " + in + " --device cuda --quant int3-g128", "--device cuda: --quant int3-g128 has no GPU path"},
      {"eval " + in + " --device cuda --quant lutb --act-format bf16",
       "--device cuda runs LUT-B experts with MXFP8 activations (spec section 4) only"},
      {"moe " + in + " --layer 0 --device cuda --quant none --act-format mxfp8" + acts,
       "--device cuda with --quant none runs the BF16 baseline"},
      {"moe " + in + " --layer 0 --device cuda --quant mxfp4" + acts, "--device cuda: --quant mxfp4 has no GPU path"},
  };
  for (const auto& c : cases) {
    const CliOut r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_EQ(r.out.rfind("lutb: error: " + c.expect, 0), 0u) << c.args << "\n" << r.out;
  }
}

// eval and moe listed no supported family when config.json has no model_type (quantize did), and a
// LUT-B checkpoint that lost its quantization_config was told "lutb would not read it: rename or
// remove it" of its own expert tensors.
TEST(CliNewUserNu18, ConfigMessagesSayWhatToDo) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "-o " + q(t.path / "in")).code, 0);
  ASSERT_EQ(run("quantize " + q(t.path / "in") + " -o " + q(t.path / "lutb") + " --no-progress").code, 0);
  const fs::path cfg_path = t.path / "lutb" / "config.json";
  nlohmann::json cfg;
  std::ifstream(cfg_path) >> cfg;
  cfg.erase("quantization_config");
  std::ofstream(cfg_path) << cfg.dump();
  const std::string acts = " --activations " + q(t.path / "in" / "model.safetensors");
  const CliOut m = run("moe " + q(t.path / "lutb") + " --layer 0 --threads 1" + acts);
  EXPECT_EQ(m.code, 1) << m.out;
  EXPECT_TRUE(has(m, "is a LUT-B tensor of a routed expert, but " + cfg_path.string() +
                         " has no LUT-B quantization_config (the \"quantization_config\" with \"quant_method\": "
                         "\"lut_b\" that says how to read LUT-B weights, spec 2.2; a BF16 checkpoint's experts are "
                         "float tensors): if the checkpoint's experts are LUT-B, restore the config.json written with "
                         "them; otherwise remove the tensor"))
      << m.out;
  const CliOut qz = run("quantize " + q(t.path / "lutb") + " -o " + q(t.path / "again") + " --no-progress");
  EXPECT_EQ(qz.code, 1) << qz.out;
  EXPECT_TRUE(has(qz, ": the checkpoint is already LUT-B: it holds LUT-B routed-expert tensors")) << qz.out;
  EXPECT_FALSE(fs::exists(t.path / "again"));

  cfg.erase("model_type");
  std::ofstream(cfg_path) << cfg.dump();
  for (const std::string& c : {"eval " + q(t.path / "lutb"), "moe " + q(t.path / "lutb") + " --layer 0" + acts,
                               "quantize " + q(t.path / "lutb") + " -o " + q(t.path / "again")}) {
    const CliOut r = run(c);
    EXPECT_EQ(r.code, 1) << c << "\n" << r.out;
    EXPECT_TRUE(has(r, "lutb: error: " + cfg_path.string() +
                           ": key 'model_type': required but missing (supported: qwen3_moe, qwen2_moe, mixtral, "
                           "deepseek_v3, deepseek_v2, olmoe)"))
        << c << "\n" << r.out;
  }
}

// --help named no default for the default job's --seed, eval's --batch and quantize's --threads, and
// eval / moe's --fitter said "default: the default fitter" without naming it or the others.
TEST(CliNewUserNu18, HelpNamesDefaultsAndChoices) {
  const CliOut top = run("--help");
  EXPECT_TRUE(has(top, "seed of the random tokens (default 1;")) << top.out;
  EXPECT_TRUE(has(top, "LUT-B fitter: binned-dp, optimal, ct-lloyd, multistart (default binned-dp)")) << top.out;
  const CliOut ev = run("eval --help");
  EXPECT_TRUE(has(ev, "windows of 256 tokens per forward pass (default 8;")) << ev.out;
  EXPECT_TRUE(has(ev, "(the online method): binned-dp, optimal, ct-lloyd, multistart (default binned-dp)")) << ev.out;
  const CliOut qz = run("quantize --help");
  EXPECT_TRUE(has(qz, "threads of the fit (default 0 = all cores;")) << qz.out;
  const CliOut mo = run("moe --help");
  EXPECT_TRUE(has(mo, "decoder layer L (0-based, counting dense layers too)")) << mo.out;
}

}  // namespace
}  // namespace lutb
