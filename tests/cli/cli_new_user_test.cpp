// The lutb command line on what a new user ran in session 9 (each test failed on the code before
// its fix): lutb moe on a per-expert LUT-B checkpoint whose expert width is not a multiple of 8,
// lutb moe on synth's DeepSeek-V3 checkpoints, and the default job's --work-dir parents.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
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

// Captured activations for `lutb moe`: layers.L.moe_input / moe_output, FP32 [T, H] (the outputs
// are random too: these tests check that the block runs, not its error).
void write_activations(const fs::path& file, int layer, std::int64_t T, std::int64_t H) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto make = [&] {
    std::vector<float> v(static_cast<std::size_t>(T * H));
    for (float& x : v) x = nd(rng);
    std::vector<std::uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return OwnedTensor{DType::F32, {T, H}, std::move(b)};
  };
  write_safetensors(file, {{"layers." + std::to_string(layer) + ".moe_input", make()},
                           {"layers." + std::to_string(layer) + ".moe_output", make()}});
}

// Finding 1: "lutb moe" on a per-expert LUT-B checkpoint with moe_intermediate_size 100 printed
// "checkpoint DIR: layer 0: moe_intermediate_size 100 is not a multiple of 8, ...; use
// lutb_projection()". Now the file, the stored tensor and what to do; the remedy it names runs.
TEST(CliNewUser, MoeOnPerExpertLutbWithWidthNotAMultipleOf8) {
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

// Finding 5: synth's DeepSeek-V3 config lacked the attention keys lutb moe parses ("key
// 'qk_nope_head_dim': required but missing"), and --experts 8 gave groups of one expert.
TEST(CliNewUser, MoeRunsOnSynthDeepSeekV3) {
  test::TempDir t;
  const CliOut s = run("synth --family deepseek_v3 --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 8 "
                       "--no-progress -o " + q(t.path / "ds"));
  ASSERT_EQ(s.code, 0) << s.out;
  const ModelConfig c = load_model_config(t.path / "ds");
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  write_activations(t.path / "acts.safetensors", 0, 8, 128);
  const std::string acts = " --layer 0 --threads 1 --json --activations " + q(t.path / "acts.safetensors");
  for (const char* quant : {"none", "lutb"}) {
    const CliOut r = run("moe " + q(t.path / "ds") + acts + " --quant " + quant);
    ASSERT_EQ(r.code, 0) << quant << "\n" << r.out;
    const auto end = r.out.find_last_not_of('\n');
    const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', end) + 1));
    EXPECT_EQ(j["tokens"], 8);
    EXPECT_EQ(j["quant"], quant);
    EXPECT_TRUE(j["rel_l2"].is_number());
  }
  const CliOut one = run("synth --family deepseek_v3 --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 1 "
                         "--no-progress -o " + q(t.path / "one"));
  EXPECT_EQ(one.code, 1) << one.out;
  EXPECT_TRUE(has(one, "--experts 1: deepseek_v3 ranks expert groups by the sum of their 2 best experts")) << one.out;
  EXPECT_FALSE(fs::exists(t.path / "one"));
}

// Finding 6: the default job created the missing parents of --work-dir (mkdir -p) and removed only
// the work directory itself: "--work-dir T/a/b/c" left T/a/b behind, after a run or a Ctrl-C.
TEST(CliNewUser, DefaultJobRemovesTheWorkDirParentsItCreated) {
  test::TempDir t;
  const CliOut r = run("--experts 2 --tokens 4 --work-dir " + q(t.path / "a" / "b" / "c"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::is_empty(t.path)) << "left behind: " << fs::directory_iterator(t.path)->path();
  // An existing ancestor stays (and so does what it holds).
  fs::create_directories(t.path / "x");
  std::ofstream(t.path / "x" / "mine.txt") << "mine";
  ASSERT_EQ(run("--experts 2 --tokens 4 --work-dir " + q(t.path / "x" / "y" / "z")).code, 0);
  EXPECT_TRUE(fs::exists(t.path / "x" / "mine.txt"));
  EXPECT_FALSE(fs::exists(t.path / "x" / "y"));
  // --keep keeps everything.
  ASSERT_EQ(run("--experts 2 --tokens 4 --keep --work-dir " + q(t.path / "k" / "w")).code, 0);
  EXPECT_TRUE(fs::exists(t.path / "k" / "w" / "qwen3-30b-a3b-layer-lutb" / "config.json"));
  fs::remove_all(t.path / "k");
  fs::remove_all(t.path / "x");
  // Interrupted (SIGINT once the work directory exists): nothing is left either.
  const fs::path log = t.path.parent_path() / (t.path.filename().string() + ".log");
  const fs::path work = t.path / "n1" / "n2" / "w";
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (int s : {SIGINT, SIGTERM}) ::signal(s, SIG_DFL);
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    const std::string exe = LUTB_CLI_PATH, w = work.string();
    ::execl(exe.c_str(), exe.c_str(), "--experts", "2", "--tokens", "4", "--work-dir", w.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ASSERT_GT(pid, 0);
  int status = 0;
  bool exited = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(work) && std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!exited) {
    ::kill(pid, SIGINT);
    ::waitpid(pid, &status, 0);
  }
  std::ifstream lf(log);
  const std::string out((std::istreambuf_iterator<char>(lf)), std::istreambuf_iterator<char>());
  fs::remove(log);
  EXPECT_FALSE(exited) << out;
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGINT) << "status " << status << "\n" << out;
  EXPECT_TRUE(fs::is_empty(t.path)) << "left behind: " << fs::directory_iterator(t.path)->path() << "\n" << out;
}

}  // namespace
}  // namespace lutb
