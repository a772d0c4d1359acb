// Exit statuses (README "Exit status"): 0 success, 1 the work failed, 2 a usage error, decided before
// any work; a lost stdout is a failure.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::CliOut;
using test::has;
using test::kSynthDefaultLayers;
using test::kSynthSmall;
using test::kSynthTo;
using test::kUsageHint;
using test::q;
using test::run;
using test::write_activations_of_layers;

// One convention for every command (README "Exit status"): a usage error, whether CLI11 or the tool's own
// option checks find it, exits 2 with the "lutb: error:" prefix and the --help hint, before any work; a
// failure of the work exits 1, without the hint.
TEST(CliExitStatus, UsageErrorIsTwoFailureIsOne) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthSmall + "-o " + q(t.path / "in")).code, 0);
  const std::string in = q(t.path / "in");
  const std::string out = " -o " + q(t.path / "o");
  struct Case {
    std::string args, expect;
  } usage[] = {
      // The tool's own checks.
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
      // --error-feedback chooses how --calibration statistics are used: without them it would change nothing.
      {"quantize " + in + out + " --error-feedback off",
       "--error-feedback off applies only with --calibration STATS (lutb calibrate); without statistics the fit is "
       "data-free"},
      {"eval " + in + " --quant lutb --error-feedback on", "--error-feedback on applies only with --calibration STATS"},
      {"moe " + in + " --layer 0 --quant none --error-feedback on", "--error-feedback on applies only with --calibration STATS"},
      // --damping damps the error feedback: without statistics, or with the feedback off, it would change nothing.
      {"quantize " + in + out + " --damping 0.1", "--damping 0.1 applies only with --calibration STATS"},
      {"eval " + in + " --quant lutb --damping 0.5", "--damping 0.5 applies only with --calibration STATS"},
      {"quantize " + in + out + " --calibration " + q(t.path / "none.safetensors") + " --error-feedback off --damping 1",
       "--damping 1 damps the error feedback, which --error-feedback off turns off"},
      {"moe " + in + " --layer 0", "--activations not given and "},
      {"moe " + in + " --layer 5 --activations " + q(t.path / "in" / "model.safetensors"),
       "--layer 5 is out of range: " + (t.path / "in").string() + " has layers 0..0"},
      {"synth --family llama --layers 1" + out, "--family llama: unknown family"},
      {"synth --family qwen3_moe --layers 1 --nu 1 " + out, "--nu 1: must be a number in (2, 1e6]"},
      {"synth --family qwen3_moe --layers 1 -o ''", "--output: an empty output name was given"},
      {"--fitter nope --experts 1 --tokens 1", "--fitter: unknown fitter 'nope'"},
      // An output named against what it will be, in every command that writes one.
      {"quantize " + q(t.path / "in" / "model.safetensors") + " -o " + q(t.path / "o.bin"),
       "-o " + (t.path / "o.bin").string() +
           ": the output of one quantised file must be named *.safetensors (to write a checkpoint directory, give "
           "the input checkpoint directory)"},
      {"quantize " + in + " -o " + q(t.path / "o.safetensors"),
       "-o " + (t.path / "o.safetensors").string() +
           ": a checkpoint directory must not be named *.safetensors (readers take that name for one safetensors "
           "file; to quantise the tensors of one file, give that .safetensors file as the input)"},
      {"synth --family qwen3_moe --layers 1 -o " + q(t.path / "o.safetensors"),
       "-o " + (t.path / "o.safetensors").string() +
           ": a checkpoint directory must not be named *.safetensors (readers take that name for one safetensors "
           "file; a checkpoint is a folder of config.json and *.safetensors files)"},
      {"calibrate " + in + " --tokens " + q(t.path / "in" / "model.safetensors") + " -o " + q(t.path / "o.bin"),
       "-o " + (t.path / "o.bin").string() +
           ": the statistics file must be named *.safetensors (the file quantize and eval --calibration read)"},
      // CLI11's own parse errors.
      {"quantize " + in + out + " --threads -1", "--threads: -1 is outside the valid range 0..4096"},
      // CLI11's "The following argument was not expected: --bogus", explained (usage_hints.hpp).
      {"eval " + in + " --bogus", "lutb eval: unknown option --bogus; lutb eval --help lists its options"},
  };
  for (const auto& c : usage) {
    const CliOut r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_EQ(r.out.rfind("lutb: error: " + c.expect, 0), 0u) << c.args << "\n" << r.out;
    EXPECT_TRUE(has(r, kUsageHint)) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, "the main job")) << c.args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(t.path / "o"));
  EXPECT_FALSE(fs::exists(t.path / "o.safetensors"));
  EXPECT_FALSE(fs::exists(t.path / "o.bin"));

  // Failures of the work: exit status 1, without the usage hint.
  std::ofstream(t.path / "file") << "x";
  std::ofstream(t.path / "file.safetensors") << "x";
  fs::create_directory(t.path / "exists");
  fs::create_directory(t.path / "dir.safetensors");
  const std::string calibrate = "calibrate " + in + " --tokens " + q(t.path / "in" / "model.safetensors");
  const Case failures[] = {
      {"quantize " + q(t.path / "nothing") + out, (t.path / "nothing").string() + ": no such checkpoint directory or file"},
      {"quantize " + in + " -o " + q(t.path / "exists"), (t.path / "exists").string() + ": output directory exists"},
      // What is already at the output is the destination's state, the same failure in every command.
      {"quantize " + q(t.path / "in" / "model.safetensors") + " -o " + q(t.path / "file.safetensors"),
       (t.path / "file.safetensors").string() + ": output file exists (use --force to replace it); nothing written"},
      {calibrate + " -o " + q(t.path / "file.safetensors"),
       (t.path / "file.safetensors").string() + ": output file exists (use --force to replace it); nothing written"},
      {"quantize " + q(t.path / "in" / "model.safetensors") + " -o " + q(t.path / "dir.safetensors"),
       (t.path / "dir.safetensors").string() + ": exists and is a directory; refusing to replace it with a file"},
      {calibrate + " -o " + q(t.path / "dir.safetensors"),
       (t.path / "dir.safetensors").string() + ": exists and is a directory; refusing to replace it with a file"},
      {"eval " + q(t.path / "nothing"), (t.path / "nothing").string() + ": no such directory"},
      {"moe " + in + " --layer 0 --activations " + q(t.path / "none.safetensors"),
       (t.path / "none.safetensors").string() + ": activations file not found"},
      {"synth --family qwen3_moe --layers 1 -o " + q(t.path / "file" / "s"), ""},
  };
  for (const auto& c : failures) {
    const CliOut r = run(c.args);
    EXPECT_EQ(r.code, 1) << c.args << "\n" << r.out;
    EXPECT_EQ(r.out.rfind("lutb: error: " + c.expect, 0), 0u) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, kUsageHint)) << c.args << "\n" << r.out;
  }
  // --help says it.
  const CliOut help = run("--help");
  EXPECT_EQ(help.code, 0);
  EXPECT_TRUE(has(help, "Exit status: 0 success; 1 the work failed")) << help.out;
  EXPECT_TRUE(has(help, "2 a usage error")) << help.out;
}

// CLI11's parse errors end as every other usage error does: exit status 2 (not CLI11's own codes, 105
// for a bad value, 109 for an unknown option) with the "lutb: error:" prefix; --help and --version
// exit 0.
TEST(CliExitStatus, ParseErrorsExitTwoWithThePrefix) {
  test::TempDir t;
  for (const std::string& args : {std::string("--bogus"), "quantize " + q(t.path) + " -o " + q(t.path / "o") + " --bogus",
                                 "eval " + q(t.path) + " --device gpu", "quantize " + q(t.path),
                                 "moe " + q(t.path) + " --layer 0 --threads -1"}) {
    const CliOut r = run(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_EQ(r.out.rfind("lutb: error: ", 0), 0u) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, "--help")) << args << "\n" << r.out;
  }
  EXPECT_EQ(run("--help").code, 0);
  EXPECT_EQ(run("eval --help").code, 0);
  EXPECT_EQ(run("--version").code, 0);
  EXPECT_FALSE(fs::exists(t.path / "o"));
}

// A dense layer given to lutb moe (DeepSeek-V3's layer 0) is a usage error of --layer, as an index beyond the
// layers is.
TEST(CliExitStatus, MoeOnADenseLayerIsAUsageError) {
  LUTB_MODEL_OR_SKIP(m, "tiny-deepseek-v3");
  const CliOut r = run("moe " + q(m) + " --layer 0 --threads 1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: --layer 0: layer 0 of " + m.string() + " is a dense (non-MoE) layer per " +
                         (m / "config.json").string() + " (its MoE layers: 1, 2, 3)"))
      << r.out;
  EXPECT_FALSE(has(r, "rel_l2")) << r.out;
}

// Settings --device cuda has no path for are usage errors, judged from the options before looking for a GPU:
// on a machine without one the user learns that the options are wrong, not "no usable CUDA GPU".
TEST(CliExitStatus, GpuOptionCombinationsAreUsageErrorsOnAnyMachine) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthSmall + "-o " + q(t.path / "in")).code, 0);
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

// --quant none / int3-g128 / mxfp4 on stored LUT-B weights is a usage error (exit status 2, README "Exit
// status"), as --fitter on the same checkpoint is, not a failure of the library.
TEST(CliExitStatus, AnotherQuantOnStoredLutbWeightsIsAUsageError) {
  test::TempDir t;
  const fs::path in = t.path / "in", lq = t.path / "lq";
  ASSERT_EQ(run(kSynthDefaultLayers + "--layers 1 -o " + q(in)).code, 0);
  ASSERT_EQ(run("quantize " + q(in) + " -o " + q(lq) + " --no-progress").code, 0);
  write_activations_of_layers(t.path / "acts.safetensors", 128, 1);
  for (const char* quant : {"none", "int3-g128", "mxfp4"}) {
    const CliOut r = run("moe " + q(lq) + " --layer 0 --quant " + quant + " --activations " + q(t.path / "acts.safetensors"));
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(has(r, std::string("lutb: error: --quant ") + quant + ": " + lq.string() +
                           " holds stored LUT-B weights (its config.json has a LUT-B quantization_config), not BF16 "
                           "experts; it runs only as --quant lutb"))
        << r.out;
    EXPECT_TRUE(has(r, kUsageHint)) << r.out;
  }
  const CliOut ok = run("moe " + q(lq) + " --layer 0 --quant lutb --activations " + q(t.path / "acts.safetensors"));
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// Results lost on stdout are a failure: `lutb synth ... > /dev/full` (and moe / eval / quantize --json) exit
// 1.
TEST(CliExitStatus, UnwritableStdoutIsAFailure) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  test::TempDir t;
  const test::CliResult r = test::run_cli(kSynthTo + q(t.path / "s") + " >/dev/full");
  ASSERT_GE(r.status, 0) << "did not exit normally";
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find("lutb: error: cannot write the results to standard output: No space left on device; the "
                       "work itself is done"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(fs::exists(t.path / "s" / "config.json"));  // the work was done
}

}  // namespace
}  // namespace lutb
