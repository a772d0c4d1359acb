// The lutb command line on what new users reported (sessions 11 and 12), fixed in session 12: each
// test failed on the code before its fix.
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
    "synth --family qwen3_moe --layers 1 --hidden-size 128 --experts 4 --moe-intermediate-size 64 --no-progress ";

// Finding 7: the arguments are checked before the file system: an invalid --match was reported only
// after "output file exists" (or "no such file").
TEST(CliNewUserS12, InvalidMatchComesFirst) {
  test::TempDir t;
  std::ofstream(t.path / "out.safetensors") << "x";
  for (const std::string input : {"missing.safetensors", "out.safetensors"}) {
    const CliOut r = run("quantize " + q(t.path / input) + " -o " + q(t.path / "out.safetensors") + " --match '('");
    EXPECT_EQ(r.code, 2) << r.out;  // a usage error (nu18)
    EXPECT_TRUE(has(r, "lutb: error: --match \"(\": invalid regular expression")) << r.out;
  }
}

// Finding 4: the model folders ship their captured activations as MODEL_DIR/moe_activations.safetensors,
// but `lutb moe MODEL_DIR --layer 0` failed with "--activations is required".
TEST(CliNewUserS12, MoeDefaultsToTheFoldersActivations) {
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
  EXPECT_EQ(r.code, 2) << r.out;  // a usage error: the option is needed here (nu18)
  EXPECT_TRUE(has(r, "lutb: error: --activations not given and " + (t.path / "s").string() +
                         " holds no moe_activations.safetensors (the captured MoE inputs and outputs); give the file "
                         "with --activations FILE"))
      << r.out;
  EXPECT_TRUE(has(run("moe --help"), "(default MODEL_DIR/moe_activations.safetensors when it exists)"));
}

// A folder of symbolic links to the files of shared model `model`, with config.json patched.
fs::path patched_model(const fs::path& dir, const fs::path& model, const nlohmann::json& patch) {
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(model))
    if (e.path().filename() != "config.json") fs::create_symlink(e.path(), dir / e.path().filename());
  nlohmann::json j;
  std::ifstream(model / "config.json") >> j;
  if (patch.is_object()) j.merge_patch(patch);
  std::ofstream(dir / "config.json") << j.dump(2);
  return dir;
}

// Finding 2: config errors of eval and moe that named neither config.json nor the key: the grouped
// router ("router of deepseek_v3: RouterConfig: top_k=5 ..."), the sliding window ("mixtral:
// sliding-window attention ..."), and a dense layer given to lutb moe.
TEST(CliNewUserS12, ConfigErrorsNameTheFileAndKey) {
  LUTB_MODEL_OR_SKIP(ds, "tiny-deepseek-v3");
  LUTB_MODEL_OR_SKIP(mx, "tiny-mixtral");
  test::TempDir t;
  const fs::path d1 = patched_model(t.path / "ds", ds, {{"topk_group", 1}, {"num_experts_per_tok", 5}});
  for (const std::string& cmd : {"eval " + q(d1) + " --max-windows 1", "moe " + q(d1) + " --layer 1"}) {
    const CliOut r = run(cmd);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(has(r, "lutb: error: " + (d1 / "config.json").string() +
                           ": key 'num_experts_per_tok': 5 exceeds the 4 experts of the groups the router keeps "
                           "(topk_group 1 x 4 experts per group: 16 experts in n_group 4)"))
        << r.out;
  }
  const fs::path d2 = patched_model(t.path / "mx", mx, {{"sliding_window", 128}});
  const CliOut r2 = run("eval " + q(d2) + " --max-windows 1");
  EXPECT_EQ(r2.code, 1) << r2.out;
  EXPECT_TRUE(has(r2, "lutb: error: " + (d2 / "config.json").string() +
                          ": key 'sliding_window': mixtral sets sliding-window attention with a window of 128 tokens, "
                          "which lutb does not implement, and the sequences here are 256 tokens long"))
      << r2.out;
  // A dense layer is a usage error of --layer (nu18: exit status 2, the option named).
  const CliOut r3 = run("moe " + q(ds) + " --layer 0");
  EXPECT_EQ(r3.code, 2) << r3.out;
  EXPECT_TRUE(has(r3, "lutb: error: --layer 0: layer 0 of " + ds.string() + " is a dense (non-MoE) layer per " +
                          (ds / "config.json").string() + " (its MoE layers: 1, 2, 3)"))
      << r3.out;
  // DeepSeek topk_method and routed_scaling_factor (finding 3), through the command line.
  const fs::path d3 = patched_model(t.path / "ds3", ds, {{"routed_scaling_factor", -2.5}});
  const CliOut r4 = run("eval " + q(d3) + " --max-windows 1");
  EXPECT_EQ(r4.code, 1) << r4.out;
  EXPECT_TRUE(has(r4, "lutb: error: " + (d3 / "config.json").string() +
                          ": key 'routed_scaling_factor': must be a finite number > 0, got -2.5"))
      << r4.out;
}

// Finding 1: lutb eval ignored tensors the model does not have without a word, a misspelt expert
// tensor or one beyond the experts count included; lutb quantize copied them silently. The real
// models raise no warning.
TEST(CliNewUserS12, StrayAndMisspeltTensorsAreReported) {
  LUTB_MODEL_OR_SKIP(qw, "tiny-qwen3-moe");
  for (const char* m : {"tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3"}) {
    LUTB_MODEL_OR_SKIP(d, m);
    const CliOut r = run("eval " + q(d) + " --max-windows 1 --threads 1");
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_FALSE(has(r, "warning")) << r.out;
  }
  test::TempDir t;
  // A synthetic checkpoint of the shared model's shapes, with tensors it does not have added by the
  // library's writer (BF16 [2, 2]).
  const fs::path d = patched_model(t.path / "m", qw, nlohmann::json::object());
  fs::remove(d / "model.safetensors");
  {
    // Copy model.safetensors with two stray tensors.
    std::vector<std::pair<std::string, OwnedTensor>> ts;
    SafetensorsFile f(qw / "model.safetensors");
    for (const auto& n : f.names()) {
      const TensorView& v = f.get(n);
      ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
    ts.push_back({"model.extra.weight", OwnedTensor{DType::BF16, {2, 2}, std::vector<std::uint8_t>(8, 0)}});
    write_safetensors(d / "model.safetensors", ts);
    ts.push_back({"model.layers.2.mlp.experts.16.down_proj.weight",
                  OwnedTensor{DType::BF16, {2, 2}, std::vector<std::uint8_t>(8, 0)}});
    fs::create_directories(t.path / "bad");
    for (const auto& e : fs::directory_iterator(d))
      if (e.path().filename() != "model.safetensors") fs::copy(e.path(), t.path / "bad" / e.path().filename());
    write_safetensors(t.path / "bad" / "model.safetensors", ts);
  }
  const std::string warn = "lutb: warning: " + (d / "model.safetensors").string() +
                           ": tensor model.extra.weight is not a tensor of the qwen3_moe model " +
                           (d / "config.json").string() + " describes; ";
  const CliOut e = run("eval " + q(d) + " --max-windows 1 --threads 1");
  EXPECT_EQ(e.code, 0) << e.out;
  EXPECT_TRUE(has(e, warn + "lutb eval does not read it\n")) << e.out;
  EXPECT_TRUE(has(e, "val loss     ")) << e.out;
  const CliOut m = run("moe " + q(d) + " --layer 1 --threads 1");
  EXPECT_EQ(m.code, 0) << m.out;
  EXPECT_TRUE(has(m, warn + "lutb moe does not read it\n")) << m.out;
  const CliOut qz = run("quantize " + q(d) + " -o " + q(t.path / "q") + " --no-progress");
  EXPECT_EQ(qz.code, 0) << qz.out;
  EXPECT_TRUE(has(qz, warn + "copied unquantised\n")) << qz.out;

  const std::string err = "lutb: error: " + (t.path / "bad" / "model.safetensors").string() +
                          ": tensor model.layers.2.mlp.experts.16.down_proj.weight names expert 16, but " +
                          (t.path / "bad" / "config.json").string() +
                          " declares 16 experts (0..15); lutb would not read it: rename or remove it";
  const CliOut be = run("eval " + q(t.path / "bad") + " --max-windows 1 --threads 1");
  EXPECT_EQ(be.code, 1) << be.out;
  EXPECT_TRUE(has(be, err + "\n")) << be.out;
  const CliOut bm = run("moe " + q(t.path / "bad") + " --layer 1 --threads 1");
  EXPECT_EQ(bm.code, 1) << bm.out;
  EXPECT_TRUE(has(bm, err + "\n")) << bm.out;
}

// Finding 8: --kernel reference and the default kernel give losses that differ in the 6th significant
// digit; a new user took it for a bug. The help says why (FP32 summation order, spec section 4), and
// the difference stays at FP32-rounding level.
TEST(CliNewUserS12, KernelsAgreeToFp32RoundingAndTheHelpSaysSo) {
  for (const char* cmd : {"eval", "moe"})
    EXPECT_TRUE(has(run(std::string(cmd) + " --help"),
                    "only the order of the FP32 additions differs (spec section 4), so results agree to FP32 rounding"));
  LUTB_MODEL_OR_SKIP(m, "tiny-qwen3-moe");
  const auto loss = [&](const std::string& kernel) {
    const CliOut r = run("eval " + q(m) + " --quant lutb --max-windows 2 --threads 2 --json --kernel " + kernel);
    EXPECT_EQ(r.code, 0) << r.out;
    return nlohmann::json::parse(r.out.substr(r.out.rfind("\n{") + 1))["val_loss"].get<double>();
  };
  const double fast = loss("fast"), ref = loss("reference");
  EXPECT_GT(fast, 3.0);
  EXPECT_LT(fast, 5.0);
  EXPECT_NEAR(fast, ref, 1e-4 * fast);
}

// Finding 10: a --match with nested repetition takes exponential time on a long tensor name
// (std::regex backtracks), and a first Ctrl-C did not stop it: the handler only set a flag that the
// matching never reads. The names are now matched before the handler is installed.
TEST(CliNewUserS12, OneCtrlCStopsACatastrophicMatch) {
  test::TempDir t;
  const fs::path f = t.path / "long.safetensors";
  // (a|aa)*c against 60 a's: about 10^12 backtracking steps, hours.
  write_safetensors(f, {{"model." + std::string(60, 'a'),
                         OwnedTensor{DType::BF16, {8, 64}, std::vector<std::uint8_t>(8 * 64 * 2, 0)}}});
  const fs::path log = t.path / "log.txt";
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (int s : {SIGINT, SIGTERM, SIGHUP}) ::signal(s, SIG_DFL);  // as from an interactive shell
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execl(LUTB_CLI_PATH, LUTB_CLI_PATH, "quantize", f.c_str(), "-o", (t.path / "o.safetensors").c_str(), "--match",
            "(a|aa)*c", "--no-progress", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(pid, 0);
  std::this_thread::sleep_for(std::chrono::seconds(1));  // well into the matching
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, WNOHANG), 0) << "quantize ended before the signal";
  ::kill(pid, SIGINT);
  // One signal must end it; the bound only keeps a failing run from hanging the suite.
  bool ended = false;
  for (int i = 0; i < 300 && !ended; ++i) {
    ended = ::waitpid(pid, &status, WNOHANG) == pid;
    if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!ended) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  EXPECT_TRUE(ended) << "one SIGINT did not stop quantize within 30 s";
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << "status " << status;
  EXPECT_FALSE(fs::exists(t.path / "o.safetensors"));
  EXPECT_TRUE(has(run("quantize --help"), "a pattern with nested repetition such as (a|aa)*c can take exponential time"));
}

}  // namespace
}  // namespace lutb
