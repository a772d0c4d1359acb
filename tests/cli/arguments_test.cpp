// Parsing of the command lines: empty values, thresholds, options given before a command, arguments
// no option took, deprecated spellings, and the order of the checks (arguments before the file system).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
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
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::CliOut;
using test::has;
using test::kSynthAnyWidth;
using test::kSynthDefaultLayers;
using test::kUsageHint;
using test::q;
using test::run;
using test::TempDir;

int processors() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  return CPU_COUNT(&set);
}

// The activation format is --act-format for eval and moe alike, since moe's --activations names the
// captured-activations file. eval's --activations is the hidden old spelling of the format: a format still
// works (with a note), a file name is refused saying what to use.
TEST(CliArguments, EvalActivationsIsTheOldSpellingOfActFormat) {
  const test::CliResult help = test::run_cli("eval --help");
  ASSERT_EQ(help.status, 0);
  EXPECT_NE(help.out.find("--act-format"), std::string::npos) << help.out;
  EXPECT_EQ(help.out.find("--activations"), std::string::npos) << help.out;

  TempDir t;  // the errors come before the checkpoint is read
  test::CliResult r = test::run_cli("eval " + q(t.path) + " --activations " + q(t.path / "acts.safetensors"));
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_NE(r.err.find("lutb: error: --activations: '" + (t.path / "acts.safetensors").string() +
                       "': lutb eval takes no captured-activations file (that is lutb moe --activations FILE); the "
                       "activation format of the expert GEMMs is --act-format bf16|mxfp8"),
            std::string::npos)
      << r.err;
  r = test::run_cli("eval " + q(t.path) + " --activations mxfp8 --act-format bf16");
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_NE(r.err.find("--activations: mxfp8 contradicts --act-format bf16"), std::string::npos) << r.err;

  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  const test::CliResult a = test::run_cli("eval " + q(dir) + " --act-format mxfp8 --max-windows 1 --json");
  ASSERT_EQ(a.status, 0) << a.err;
  EXPECT_EQ(a.err.find("old spelling"), std::string::npos) << a.err;
  const test::CliResult b = test::run_cli("eval " + q(dir) + " --activations mxfp8 --max-windows 1 --json");
  ASSERT_EQ(b.status, 0) << b.err;
  const std::string note = "lutb: note: `lutb eval --activations mxfp8` is the old spelling of --act-format mxfp8";
  const std::size_t at = b.err.find(note);
  EXPECT_NE(at, std::string::npos) << b.err;
  EXPECT_EQ(b.err.find(note, at + 1), std::string::npos) << "printed twice (once before re-executing): " << b.err;
  EXPECT_EQ(b.json()["activations"], "mxfp8");
  EXPECT_EQ(a.json()["val_loss"], b.json()["val_loss"]);
}

// An option of the default job given before a command's name is a usage error, before anything is written: the
// default job does not run when a command is given, so `lutb --fitter optimal quantize IN -o OUT` would
// otherwise fit with binned-dp and `lutb --json eval DIR` print no JSON.
TEST(CliArguments, DefaultJobOptionBeforeACommandIsRefused) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthDefaultLayers + "--layers 1 -o " + q(t.path / "in")).code, 0);
  const CliOut r = run("--fitter optimal quantize " + q(t.path / "in") + " -o " + q(t.path / "out") + " --no-progress");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: --fitter was given before the command name 'quantize': options before it belong to "
                     "the default job (lutb with no command), which does not run when a command is given"))
      << r.out;
  EXPECT_TRUE(has(r, "give it after the command name: lutb quantize ... --fitter ...")) << r.out;
  EXPECT_TRUE(has(r, kUsageHint)) << r.out;
  EXPECT_FALSE(fs::exists(t.path / "out"));
  // An option the command does not have either.
  const CliOut k = run("--keep moe " + q(t.path / "in") + " --layer 0");
  EXPECT_EQ(k.code, 2) << k.out;
  EXPECT_TRUE(has(k, "--keep was given before the command name 'moe'")) << k.out;
  EXPECT_TRUE(has(k, "lutb moe has no --keep option (lutb moe --help lists its options)")) << k.out;
  const CliOut j = run("--json synth --family mixtral --layers 1 -o " + q(t.path / "s"));
  EXPECT_EQ(j.code, 2) << j.out;
  EXPECT_TRUE(has(j, "--json was given before the command name 'synth'")) << j.out;
  EXPECT_FALSE(fs::exists(t.path / "s"));
  // After the command's name, the command's own options are unaffected.
  const CliOut ok = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "out") + " --fitter optimal --no-progress --json");
  ASSERT_EQ(ok.code, 0) << ok.out;
  EXPECT_TRUE(has(ok, "\"fitter\":\"optimal\"")) << ok.out;
}

// Arguments no option took are explained: CLI11's own message lists them in reverse order ("The
// following arguments were not expected: 0 --threads") and names nothing valid, so the tool says
// which option lacks its value, which command name is misspelt, and what the command takes.
TEST(CliArguments, UnexpectedArgumentsAreExplained) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthDefaultLayers + "--layers 1 -o " + q(t.path / "in")).code, 0);
  const std::string in = q(t.path / "in");
  struct Case {
    std::string args;
    std::vector<std::string> expect;
  } cases[] = {
      {"--threads 0",
       {"lutb: error: --threads is not an option of the default job (lutb with no command); it is an option of lutb "
        "quantize, eval, calibrate and moe: give it after the command name (e.g. lutb quantize ... --threads ...)",
        "the default job's options are --tokens, --experts, --fitter, --seed, --work-dir, --keep and --json"}},
      {"--threads=2", {"--threads is not an option of the default job"}},
      {"-o x", {"-o is not an option of the default job (lutb with no command); it is an option of lutb quantize, "
                "calibrate and synth"}},
      {"--tokns 5", {"unknown option --tokns (did you mean --tokens?)", "the commands are quantize, eval, calibrate, moe and synth"}},
      {"qunatize " + in + " -o " + q(t.path / "out"),
       {"unknown command 'qunatize' (did you mean 'quantize'?); the commands are quantize, eval, calibrate, moe and synth (lutb "
        "with no command runs the built-in example)"}},
      {"evaluate " + in, {"unknown command 'evaluate' (did you mean 'eval'?)"}},
      {"--threads 2 eval " + in,
       {"--threads must follow the command name: arguments before 'eval' are options of the default job (lutb with no "
        "command); write lutb eval ... --threads ..."}},
      {"moe " + in + " --layer 0 --tokens 5",
       {"--tokens is not an option of lutb moe; it is an option of lutb eval, lutb calibrate and the default job (lutb "
        "with no command); lutb moe --help lists the options of lutb moe"}},
      {"eval " + in + " --thread 2", {"lutb eval: unknown option --thread (did you mean --threads?)"}},
      {"eval " + in + " extra",
       {"lutb eval: unexpected argument 'extra': lutb eval takes one positional argument (model_dir)"}},
      {"quantize " + in + " -o " + q(t.path / "out") + " --layer 0",
       {"--layer is not an option of lutb quantize; it is an option of lutb moe"}},
  };
  for (const Case& c : cases) {
    const CliOut r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    for (const auto& e : c.expect) EXPECT_TRUE(has(r, e)) << c.args << "\n" << r.out;
    EXPECT_TRUE(has(r, kUsageHint)) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, "The following argument")) << c.args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(t.path / "out"));
}

// An empty integer value is named as empty, not printed as a blank between two spaces.
TEST(CliArguments, EmptyIntegerValueIsNamed) {
  for (const std::string& args :
       {std::string("quantize in -o out --threads ''"), std::string("synth --family qwen3_moe -o x --layers ''")}) {
    const CliOut r = run(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, ": an empty value was given; expected an integer ")) << args << "\n" << r.out;
    EXPECT_FALSE(has(r, "  is not an integer")) << r.out;
  }
}

// Empty values of --fitter and of path options are refused as usage errors naming the option, never taken as
// "not given"; numbers are echoed as typed and checked against the library's bounds.
TEST(CliArguments, EmptyValuesAreRefused) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthAnyWidth + "--moe-intermediate-size 64 -o " + q(t.path / "in")).code, 0);
  const std::string fitter_msg =
      "--fitter: the fitter name is empty; allowed: binned-dp optimal ct-lloyd multistart (leave --fitter out for the "
      "default, binned-dp)";
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"quantize " + q(t.path / "in") + " -o " + q(t.path / "o") + " --fitter ''", fitter_msg},
      {"eval " + q(t.path / "in") + " --quant lutb --fitter ''", fitter_msg},
      {"moe " + q(t.path / "in") + " --layer 0 --activations x --quant lutb --fitter ''", fitter_msg},
      {"--fitter '' --experts 2 --tokens 4 --work-dir " + q(t.path / "w"), fitter_msg},
      {"quantize " + q(t.path / "in") + " -o " + q(t.path / "o") + " --fitter kmeans",
       "--fitter: unknown fitter 'kmeans'; allowed: binned-dp optimal ct-lloyd multistart"},
      {"eval " + q(t.path / "in") + " --tokens ''", "--tokens: an empty tokens file name was given"},
      {"moe " + q(t.path / "in") + " --layer 0 --activations ''", "--activations: an empty activations file name was given"},
      {"quantize " + q(t.path / "in") + " -o " + q(t.path / "o") + " --calibration ''",
       "--calibration: an empty statistics file name was given"},
      {"eval " + q(t.path / "in") + " --quant lutb --calibration ''", "--calibration: an empty statistics file name was given"},
      {"moe " + q(t.path / "in") + " --layer 0 --activations x --quant lutb --calibration ''",
       "--calibration: an empty statistics file name was given"},
      {"--experts 2 --tokens 4 --work-dir ''", "--work-dir: an empty directory name was given"},
      // Not empty, but the same kind: the value as typed ("--nu inf" was printed for 1e400), and the
      // library's bound (1e7 passed the command line's check and failed in the library).
      {kSynthAnyWidth + "--nu 1e400 -o " + q(t.path / "s"), "--nu 1e400: must be a number in (2, 1e6]"},
      {kSynthAnyWidth + "--nu 1e7 -o " + q(t.path / "s"), "--nu 1e7: must be a number in (2, 1e6]"},
  };
  for (const auto& c : cases) {
    const CliOut r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;  // a usage error (README "Exit status")
    EXPECT_TRUE(has(r, "lutb: error: " + c.expect)) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, "the main job")) << c.args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(t.path / "o"));
  EXPECT_FALSE(fs::exists(t.path / "w"));
  EXPECT_FALSE(fs::exists(t.path / "s"));
}

// --threads above the processors available to the process is reduced to them with a note: oversubscribed, lutb
// eval runs many times slower.
TEST(CliArguments, ThreadsAboveTheProcessorsAreReducedWithANote) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthAnyWidth + "--moe-intermediate-size 64 -o " + q(t.path / "in")).code, 0);
  const int n = processors();
  const CliOut r = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "o") + " --no-progress --threads 4096");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, fmt::format("lutb: --threads 4096 is more than the {} processor{} available to this process; "
                                 "using {}\n",
                                 n, n == 1 ? "" : "s", n)))
      << r.out;
  // At most the processors: no note.
  const CliOut ok = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "o2") + " --no-progress --threads " +
                        std::to_string(n));
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_FALSE(has(ok, "--threads")) << ok.out;
}

// The arguments are checked before the file system: an invalid --match is reported before "output file exists"
// or "no such file".
TEST(CliArguments, InvalidMatchComesFirst) {
  test::TempDir t;
  std::ofstream(t.path / "out.safetensors") << "x";
  for (const std::string input : {"missing.safetensors", "out.safetensors"}) {
    const CliOut r = run("quantize " + q(t.path / input) + " -o " + q(t.path / "out.safetensors") + " --match '('");
    EXPECT_EQ(r.code, 2) << r.out;  // a usage error
    EXPECT_TRUE(has(r, "lutb: error: --match \"(\": invalid regular expression")) << r.out;
  }
}

// `--kernel reference` with BF16 (or INT3 / MXFP4) experts is a usage error, as --fitter is, never silently
// ignored.
TEST(CliArguments, KernelWithoutLutbExpertsIsAnError) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  test::CliResult r = test::run_cli("eval " + test::q(dir) + " --kernel reference --max-windows 1");
  EXPECT_EQ(r.status, 2);  // a usage error (README "Exit status")
  EXPECT_NE(r.err.find("lutb: error: --kernel reference only applies to LUT-B experts (--quant lutb, or a LUT-B "
                       "checkpoint); the experts here are --quant none"),
            std::string::npos)
      << r.err;
  r = test::run_cli("moe " + test::q(dir) + " --layer 0 --quant mxfp4 --kernel fast --activations " +
                    test::q(dir / "moe_activations.safetensors"));
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--kernel fast only applies to LUT-B experts (--quant lutb, or a LUT-B checkpoint); the "
                       "experts here are --quant mxfp4"),
            std::string::npos)
      << r.err;
  r = test::run_cli("eval " + test::q(dir) + " --quant lutb --kernel reference --max-windows 1");
  EXPECT_EQ(r.status, 0) << r.err;
}

// `lutb eval ... --act-format mxfp8` (the flag `lutb moe` uses for the format) is accepted.
TEST(CliArguments, EvalTakesActFormatLikeMoe) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  const test::CliResult a = test::run_cli("eval " + test::q(dir) + " --act-format mxfp8 --max-windows 1 --json");
  ASSERT_EQ(a.status, 0) << a.err;
  const test::CliResult b = test::run_cli("eval " + test::q(dir) + " --activations mxfp8 --max-windows 1 --json");
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_EQ(a.json()["activations"], "mxfp8");
  EXPECT_EQ(a.json()["val_loss"], b.json()["val_loss"]);
}

}  // namespace
}  // namespace lutb
