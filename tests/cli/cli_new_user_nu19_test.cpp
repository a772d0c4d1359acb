// What a fresh new user found in session 19 (helper nu19) on the lutb command line. Each test failed on
// the code before its fix.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/safetensors.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;

using test::CliOut;
using test::has;
using test::q;
using test::run;

constexpr const char* kHint = "Run 'lutb --help' (or 'lutb COMMAND --help') for the options.";

const std::string kSynth =
    "synth --family qwen3_moe --hidden-size 128 --moe-intermediate-size 64 --experts 4 --no-progress ";

// Captured activations for `lutb moe`: layers.L.moe_input / moe_output, F32 [4, H], for L < layers.
void write_activations(const fs::path& file, std::int64_t H, int layers) {
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  std::vector<float> x(static_cast<std::size_t>(4 * H));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 17) / 8.0f - 1.0f;
  std::vector<std::uint8_t> bytes(x.size() * 4);
  std::memcpy(bytes.data(), x.data(), bytes.size());
  for (int l = 0; l < layers; ++l) {
    ts.push_back({"layers." + std::to_string(l) + ".moe_input", OwnedTensor{DType::F32, {4, H}, bytes}});
    ts.push_back({"layers." + std::to_string(l) + ".moe_output", OwnedTensor{DType::F32, {4, H}, bytes}});
  }
  write_safetensors(file, ts);
}

// An option of the default job given before a command's name was parsed as the default job's and then
// ignored (the default job does not run when a command is given): `lutb --fitter optimal quantize IN
// -o OUT` fitted with binned-dp, `lutb --json eval DIR` printed no JSON, both with exit status 0. Now a
// usage error, before anything is written.
TEST(CliNewUserNu19, DefaultJobOptionBeforeACommandIsRefused) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "--layers 1 -o " + q(t.path / "in")).code, 0);
  const CliOut r = run("--fitter optimal quantize " + q(t.path / "in") + " -o " + q(t.path / "out") + " --no-progress");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: --fitter was given before the command name 'quantize': options before it belong to "
                     "the default job (lutb with no command), which does not run when a command is given"))
      << r.out;
  EXPECT_TRUE(has(r, "give it after the command name: lutb quantize ... --fitter ...")) << r.out;
  EXPECT_TRUE(has(r, kHint)) << r.out;
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

// Arguments no option took: CLI11's message listed them in reverse order and said nothing of what
// would be valid: `lutb --threads 0` gave "The following arguments were not expected: 0 --threads", a
// misspelt command "... /tmp/x -o DIR qunatize" (new-user QA sessions 18-19).
TEST(CliNewUserNu19, UnexpectedArgumentsAreExplained) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + "--layers 1 -o " + q(t.path / "in")).code, 0);
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
    EXPECT_TRUE(has(r, kHint)) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, "The following argument")) << c.args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(t.path / "out"));
}

// lutb moe ran a layer of a checkpoint whose config.json declares fewer layers than it stores (lutb
// eval and lutb quantize refuse it), and called the stored layer beyond the config "out of range".
TEST(CliNewUserNu19, MoeRefusesLayersTheConfigDoesNotDeclare) {
  test::TempDir t;
  const fs::path in = t.path / "in";
  ASSERT_EQ(run(kSynth + "--layers 2 -o " + q(in)).code, 0);
  write_activations(t.path / "acts.safetensors", 128, 2);
  const std::string acts = " --activations " + q(t.path / "acts.safetensors");
  ASSERT_EQ(run("moe " + q(in) + " --layer 1" + acts).code, 0);
  nlohmann::json j;
  std::ifstream(in / "config.json") >> j;
  j["num_hidden_layers"] = 1;
  fs::remove(in / "config.json");
  std::ofstream(in / "config.json") << j.dump(2);
  for (const char* layer : {"0", "1"}) {
    const CliOut r = run("moe " + q(in) + " --layer " + layer + acts);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(has(r, "belongs to layer 1, but " + (in / "config.json").string() +
                           " declares num_hidden_layers 1 (layers 0..0): the checkpoint has layers the config does not"))
        << r.out;
  }
}

// lutb moe / lutb eval on a checkpoint that lacks one routed expert said "checkpoint DIR: tensor X not
// found", naming no file; lutb quantize named config.json. Now both name the layer, config.json and
// the file searched.
TEST(CliNewUserNu19, MissingRoutedExpertNamesTheFileSearched) {
  test::TempDir t;
  const fs::path in = t.path / "in";
  ASSERT_EQ(run(kSynth + "--layers 1 -o " + q(in)).code, 0);
  const std::string gone = "model.layers.0.mlp.experts.3.gate_proj.weight";
  {
    std::vector<std::pair<std::string, OwnedTensor>> ts;
    std::vector<fs::path> shards;
    {
      const SafetensorsCollection c = SafetensorsCollection::open_dir(in);
      for (const auto& n : c.names()) {
        if (n == gone) continue;
        const TensorView& v = c.get(n);
        ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
      }
      for (const auto& f : c.files()) shards.push_back(f->path());
    }
    for (const auto& s : shards) fs::remove(s);
    fs::remove(in / "model.safetensors.index.json");
    write_safetensors(in / "model.safetensors", ts);
  }
  write_activations(t.path / "acts.safetensors", 128, 1);
  const CliOut r = run("moe " + q(in) + " --layer 0 --activations " + q(t.path / "acts.safetensors"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "layer 0 is a MoE layer of " + (in / "config.json").string() + ", which declares 4 routed experts, "
                     "but its routed-expert tensor " + gone + " is missing; " + (in / "model.safetensors").string() +
                     " has no such tensor"))
      << r.out;
}

// --quant none / int3-g128 / mxfp4 on stored LUT-B weights was refused by the library with exit status 1
// ("a LUT-B checkpoint holds no BF16 experts"), where --fitter on the same checkpoint is a usage error
// (exit status 2, README "Exit status").
TEST(CliNewUserNu19, AnotherQuantOnStoredLutbWeightsIsAUsageError) {
  test::TempDir t;
  const fs::path in = t.path / "in", lq = t.path / "lq";
  ASSERT_EQ(run(kSynth + "--layers 1 -o " + q(in)).code, 0);
  ASSERT_EQ(run("quantize " + q(in) + " -o " + q(lq) + " --no-progress").code, 0);
  write_activations(t.path / "acts.safetensors", 128, 1);
  for (const char* quant : {"none", "int3-g128", "mxfp4"}) {
    const CliOut r = run("moe " + q(lq) + " --layer 0 --quant " + quant + " --activations " + q(t.path / "acts.safetensors"));
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(has(r, std::string("lutb: error: --quant ") + quant + ": " + lq.string() +
                           " holds stored LUT-B weights (its config.json has a LUT-B quantization_config), not BF16 "
                           "experts; it runs only as --quant lutb"))
        << r.out;
    EXPECT_TRUE(has(r, kHint)) << r.out;
  }
  const CliOut ok = run("moe " + q(lq) + " --layer 0 --quant lutb --activations " + q(t.path / "acts.safetensors"));
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// Every option of every command that takes a value and is not required says its default in --help
// (synth's --hidden-size, --moe-intermediate-size and --experts said "override ... (tests)", quantize's
// --match nothing of what happens without it), and the usage line names the tool, not the path of the
// binary ("Usage: /work/.../build/release/lutb quantize").
TEST(CliNewUserNu19, HelpStatesEveryDefault) {
  for (const std::string cmd : {"", "quantize", "eval", "moe", "synth"}) {
    const CliOut r = run(cmd + " --help");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(has(r, "Usage: lutb " + (cmd.empty() ? std::string("[OPTIONS] [SUBCOMMAND]") : cmd + " [OPTIONS]")))
        << r.out;
    // Option entries: a line "  -x..." or "  --name ..." and its continuation lines, up to the next
    // entry or a blank line.
    std::vector<std::string> entries;
    std::size_t p = 0;
    while (p < r.out.size()) {
      const std::size_t e = r.out.find('\n', p);
      const std::string line = r.out.substr(p, e == std::string::npos ? std::string::npos : e - p);
      p = e == std::string::npos ? r.out.size() : e + 1;
      if (line.rfind("  -", 0) == 0) entries.push_back(line);
      else if (!entries.empty() && line.rfind("    ", 0) == 0 && line.find_first_not_of(' ') >= 20) entries.back() += line;
      else if (line.empty() && !entries.empty()) entries.push_back("");
    }
    int checked = 0;
    for (const auto& e : entries) {
      if (e.empty() || e.find("REQUIRED") != std::string::npos) continue;
      // The type follows the name: "--threads INT:0..4096", "--fitter TEXT", "--nu FLOAT"; flags have none.
      const std::size_t sp = e.find(' ', e.find_first_not_of(' '));
      const std::string after = e.substr(sp + 1);
      const bool value = after.rfind("TEXT", 0) == 0 || after.rfind("INT", 0) == 0 || after.rfind("UINT", 0) == 0 ||
                         after.rfind("FLOAT", 0) == 0;
      if (!value) continue;
      ++checked;
      EXPECT_NE(e.find("default"), std::string::npos) << "lutb " << cmd << " --help: no default in\n" << e;
    }
    EXPECT_GE(checked, 2) << r.out;
  }
}

// "(1 windows of 256)" in lutb eval's loss line.
TEST(CliNewUserNu19, EvalSaysOneWindow) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  const CliOut r = run("eval " + q(dir) + " --max-windows 1 --threads 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, " nats over 255 predicted tokens (1 window of 256)\n")) << r.out;
}

// `lutb synth --family mixtral --hidden-size 100` wrote head_dim 100 // 32 = 3, and lutb moe refused the
// checkpoint synth had just written ("key 'head_dim': ... gives a rotary dimension of 3").
TEST(CliNewUserNu19, SynthHiddenSizeNotAMultipleOf64RunsInMoe) {
  test::TempDir t;
  const fs::path in = t.path / "in";
  ASSERT_EQ(run("synth --family mixtral --layers 1 --hidden-size 100 --moe-intermediate-size 56 --experts 2 "
                "--no-progress -o " + q(in))
                .code,
            0);
  write_activations(t.path / "acts.safetensors", 100, 1);
  const CliOut r = run("moe " + q(in) + " --layer 0 --quant lutb --activations " + q(t.path / "acts.safetensors"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "layer 0 of " + in.string() + " (mixtral), 4 tokens, quant lutb, activations mxfp8")) << r.out;
}

}  // namespace
}  // namespace lutb
