// The lutb command line on what a new user ran in session 11 (each test failed on the code before
// its fix): empty --fitter / path values taken as "not given", --threads far above the machine's
// processors accepted silently (lutb eval ran 100x slower), and the warning of a per-expert
// checkpoint lutb cannot run.
#include <gtest/gtest.h>

#include <sched.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

#include <fmt/core.h>
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

int processors() {
  cpu_set_t set;
  CPU_ZERO(&set);
  EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  return CPU_COUNT(&set);
}

const std::string kSynth = "synth --family qwen3_moe --layers 1 --hidden-size 128 --experts 4 --no-progress ";

TEST(CliNewUserS11, EmptyValuesAreRefused) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "--moe-intermediate-size 64 -o " + q(t.path / "in")).code, 0);
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
      {"--experts 2 --tokens 4 --work-dir ''", "--work-dir: an empty directory name was given"},
      // Not empty, but the same kind: the value as typed ("--nu inf" was printed for 1e400), and the
      // library's bound (1e7 passed the command line's check and failed in the library).
      {kSynth + "--nu 1e400 -o " + q(t.path / "s"), "--nu 1e400: must be a number in (2, 1e6]"},
      {kSynth + "--nu 1e7 -o " + q(t.path / "s"), "--nu 1e7: must be a number in (2, 1e6]"},
  };
  for (const auto& c : cases) {
    const CliOut r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;  // a usage error (README "Exit status", nu18)
    EXPECT_TRUE(has(r, "lutb: error: " + c.expect)) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, "the main job")) << c.args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(t.path / "o"));
  EXPECT_FALSE(fs::exists(t.path / "w"));
  EXPECT_FALSE(fs::exists(t.path / "s"));
}

TEST(CliNewUserS11, ThreadsAboveTheProcessorsAreReducedWithANote) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "--moe-intermediate-size 64 -o " + q(t.path / "in")).code, 0);
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

TEST(CliNewUserS11, QuantizeWarnsAboutAPerExpertCheckpointItCannotRun) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "--moe-intermediate-size 12 -o " + q(t.path / "in")).code, 0);
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

TEST(CliNewUserS11, CheckpointOutputNamedSafetensorsIsRefused) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "--moe-intermediate-size 64 -o " + q(t.path / "in")).code, 0);
  const CliOut r = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "q.safetensors") + " --no-progress");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: " + (t.path / "q.safetensors").string() +
                         ": a checkpoint directory must not be named *.safetensors"))
      << r.out;
  EXPECT_FALSE(fs::exists(t.path / "q.safetensors"));
  const CliOut s = run(kSynth + "--moe-intermediate-size 64 -o " + q(t.path / "s.safetensors"));
  EXPECT_EQ(s.code, 1) << s.out;
  EXPECT_TRUE(has(s, ": a checkpoint directory must not be named *.safetensors")) << s.out;
  EXPECT_FALSE(fs::exists(t.path / "s.safetensors"));
}

}  // namespace
}  // namespace lutb
