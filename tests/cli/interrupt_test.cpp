// Ctrl-C / SIGTERM during `lutb quantize`: the run stops and removes its temporaries (OUT.tmp.PID),
// an existing output stays as it was, and temporaries left by dead processes are reported. The binary
// is spawned (LUTB_CLI_PATH), the signal sent once its temporary output exists, i.e. while it streams
// tensors.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>
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
using test::read_file;
using test::run;
using test::spawn;

// Names in `dir` starting with `prefix`, sorted.
std::vector<std::string> names_with_prefix(const fs::path& dir, const std::string& prefix) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0) v.push_back(n);
  }
  std::sort(v.begin(), v.end());
  return v;
}

// A BF16 checkpoint whose quantisation takes a second or two on one thread (8 layers x 8 experts of
// 256 x 512: 192 projections), so that a signal sent once the temporary exists lands mid-stream.
void make_input(const fs::path& dir) {
  SynthOptions so;
  so.family = ModelFamily::qwen3_moe;
  so.layers = 8;
  so.hidden_size = 512;
  so.moe_intermediate_size = 256;
  so.num_experts = 8;
  so.progress = false;
  synthesize_checkpoint(dir, so);
}

struct SignalledRun {
  int status = 0;
  std::string log;
};

// Runs quantize IN -o OUT (extra args), waits until OUT.tmp.PID exists, sends `sig`, waits for the end.
SignalledRun quantize_and_signal(const fs::path& in, const fs::path& out, int sig, const std::vector<std::string>& extra,
                                 int times = 1) {
  const fs::path log = out.parent_path() / "log.txt";
  std::vector<std::string> args = {"quantize", in.string(), "-o", out.string(), "--no-progress"};
  args.insert(args.end(), extra.begin(), extra.end());
  if (std::find(extra.begin(), extra.end(), "--threads") == extra.end()) args.insert(args.end(), {"--threads", "1"});
  const pid_t pid = spawn(args, log);
  EXPECT_GT(pid, 0);
  const fs::path tmp = out.parent_path() / (out.filename().string() + ".tmp." + std::to_string(pid));
  SignalledRun r;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool exited = false;
  while (!fs::exists(tmp)) {
    if (::waitpid(pid, &r.status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!exited) {
    for (int i = 0; i < times; ++i) ::kill(pid, sig);  // times > 1: back to back, as `timeout` does
    ::waitpid(pid, &r.status, 0);
  }
  r.log = read_file(log);
  EXPECT_FALSE(exited) << "quantize ended before its temporary appeared:\n" << r.log;
  return r;
}

// A pid that no longer exists: a child that has exited and been reaped.
pid_t dead_pid() {
  const pid_t p = ::fork();
  if (p == 0) ::_exit(0);
  int st = 0;
  ::waitpid(p, &st, 0);
  return p;
}

// A --match with nested repetition takes exponential time on a long tensor name (std::regex backtracks), and
// the signal handler only sets a flag that the matching never reads: the names are matched before the handler
// is installed, so one Ctrl-C stops it.
TEST(CliInterrupt, OneCtrlCStopsACatastrophicMatch) {
  test::TempDir t;
  const fs::path f = t.path / "long.safetensors";
  // (a|aa)*c against 60 a's: about 10^12 backtracking steps, hours.
  write_safetensors(f, {{"model." + std::string(60, 'a'),
                         OwnedTensor{DType::BF16, {8, 64}, std::vector<std::uint8_t>(8 * 64 * 2, 0)}}});
  const fs::path log = t.path / "log.txt";
  const pid_t pid =
      spawn({"quantize", f.string(), "-o", (t.path / "o.safetensors").string(), "--match", "(a|aa)*c", "--no-progress"},
            log);
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

TEST(CliInterrupt, SigintDuringForcedQuantizeKeepsTheOldOutput) {
  test::TempDir t;
  make_input(t.path / "in");
  // An existing destination replaced with --force: it must survive an interrupted run untouched.
  fs::create_directories(t.path / "out");
  // (a file a checkpoint holds: --force refuses to replace a directory holding anything else)
  std::ofstream(t.path / "out" / "keep.json") << "the previous output";
  const SignalledRun r = quantize_and_signal(t.path / "in", t.path / "out", SIGINT, {"--force"});
  ASSERT_TRUE(WIFSIGNALED(r.status)) << "status " << r.status << "\n" << r.log;  // re-raised: shell status 130
  EXPECT_EQ(WTERMSIG(r.status), SIGINT) << r.log;
  EXPECT_NE(r.log.find("interrupted by signal 2"), std::string::npos) << r.log;
  EXPECT_EQ(names_with_prefix(t.path, "out"), std::vector<std::string>{"out"});  // no out.tmp.*, out.old.*
  EXPECT_EQ(names_with_prefix(t.path / "out", ""), std::vector<std::string>{"keep.json"});
  EXPECT_EQ(read_file(t.path / "out" / "keep.json"), "the previous output");
}

// GNU timeout (without --foreground) and `kill -- -PGID` signal the process and then its group: the
// same request twice within microseconds. A signal within a second of the first is the same request:
// with SA_RESETHAND the second copy, landing on another thread while the first handler ran, would kill
// the process at once, with no message and OUT.tmp.PID left behind.
TEST(CliInterrupt, TheSameSignalTwiceAtOnceStillCleansUp) {
  test::TempDir t;
  make_input(t.path / "in");
  for (const int sig : {SIGINT, SIGTERM}) {
    const SignalledRun r = quantize_and_signal(t.path / "in", t.path / "out", sig, {"--threads", "2"}, /*times=*/3);
    ASSERT_TRUE(WIFSIGNALED(r.status)) << "status " << r.status << "\n" << r.log;
    EXPECT_EQ(WTERMSIG(r.status), sig) << r.log;
    EXPECT_NE(r.log.find("interrupted by signal " + std::to_string(sig)), std::string::npos) << r.log;
    EXPECT_EQ(r.log.find("lutb: second signal"), std::string::npos) << r.log;
    EXPECT_TRUE(names_with_prefix(t.path, "out").empty()) << r.log;  // no out, no out.tmp.*
  }
}

TEST(CliInterrupt, SigtermDuringQuantizeLeavesNothing) {
  test::TempDir t;
  make_input(t.path / "in");
  const SignalledRun r = quantize_and_signal(t.path / "in", t.path / "out", SIGTERM, {});
  ASSERT_TRUE(WIFSIGNALED(r.status)) << "status " << r.status << "\n" << r.log;  // shell status 143
  EXPECT_EQ(WTERMSIG(r.status), SIGTERM) << r.log;
  EXPECT_TRUE(names_with_prefix(t.path, "out").empty()) << r.log;
  EXPECT_EQ(Checkpoint(t.path / "in").config().num_hidden_layers, 8);  // the input is untouched
}

// A signal that arrives while a large projection is being fitted stops that fit: the fitter polls the flag
// between tiles and the message says where it stopped. One expert of 2048 x 2048 projections (8192 tiles each)
// with the exact "optimal" fitter on one thread: every projection takes seconds, so the signal, sent once the
// temporary exists and the router (a few KB) is copied, lands inside a fit.
TEST(CliInterrupt, SigintInsideOneTensorsFitStopsThatFit) {
  test::TempDir t;
  SynthOptions so;
  so.family = ModelFamily::qwen3_moe;
  so.layers = 1;
  so.hidden_size = 2048;
  so.moe_intermediate_size = 2048;
  so.num_experts = 1;
  so.progress = false;
  synthesize_checkpoint(t.path / "in", so);
  const fs::path out = t.path / "out", log = t.path / "log.txt";
  const pid_t pid = spawn({"quantize", (t.path / "in").string(), "-o", out.string(), "--threads", "1", "--fitter",
                           "optimal", "--no-progress"},
                          log);
  ASSERT_GT(pid, 0);
  const fs::path tmp = t.path / ("out.tmp." + std::to_string(pid));
  int status = 0;
  bool exited = false;
  while (!fs::exists(tmp)) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_FALSE(exited) << read_file(log);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // past the router copy, into the first fit
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(pid, SIGINT);
  ::waitpid(pid, &status, 0);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string text = read_file(log);
  std::printf("[ info ] the run ended %.3f s after the signal\n", seconds);  // informational, not asserted
  ASSERT_TRUE(WIFSIGNALED(status)) << "status " << status << "\n" << text;
  EXPECT_EQ(WTERMSIG(status), SIGINT) << text;
  // "...: interrupted by signal 2 (Interrupt) while fitting tensor T after K of 8192 tiles; ..."
  const auto at = text.find("while fitting tensor model.layers.0.mlp.experts.0.");
  ASSERT_NE(at, std::string::npos) << text;
  const auto after = text.find(" after ", at);
  ASSERT_NE(after, std::string::npos) << text;
  long long done = -1, total = -1;
  ASSERT_EQ(std::sscanf(text.c_str() + after, " after %lld of %lld tiles", &done, &total), 2) << text;
  EXPECT_EQ(total, 8192) << text;
  EXPECT_GE(done, 0) << text;
  EXPECT_LT(done, total) << text;  // stopped inside the tensor, not after it
  // out never existed: "nothing was created at OUT", not "OUT is as it was".
  EXPECT_NE(text.find("nothing was created at " + out.string()), std::string::npos) << text;
  EXPECT_TRUE(names_with_prefix(t.path, "out").empty()) << text;  // no out, no out.tmp.*
}

// The copy of the other files of a checkpoint polls the flag, so a signal during the copy of a large one (here
// 2 GB, sparse) stops it.
TEST(CliInterrupt, SigintWhileCopyingALargeFileStopsTheCopy) {
  test::TempDir t;
  SynthOptions so;
  so.family = ModelFamily::qwen3_moe;
  so.layers = 1;
  so.hidden_size = 64;
  so.moe_intermediate_size = 64;
  so.num_experts = 2;
  so.progress = false;
  synthesize_checkpoint(t.path / "in", so);
  {
    std::ofstream(t.path / "in" / "training_state.dat") << "x";
    fs::resize_file(t.path / "in" / "training_state.dat", std::uintmax_t{2} << 30);
  }
  const fs::path out = t.path / "out", log = t.path / "log.txt";
  const pid_t pid = spawn({"quantize", (t.path / "in").string(), "-o", out.string(), "--no-progress"}, log);
  ASSERT_GT(pid, 0);
  const fs::path copy = t.path / ("out.tmp." + std::to_string(pid)) / "training_state.dat";
  int status = 0;
  bool exited = false;
  while (!fs::exists(copy)) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_FALSE(exited) << read_file(log);
  ::kill(pid, SIGINT);
  ::waitpid(pid, &status, 0);
  const std::string text = read_file(log);
  ASSERT_TRUE(WIFSIGNALED(status)) << "status " << status << "\n" << text;
  EXPECT_EQ(WTERMSIG(status), SIGINT) << text;
  EXPECT_NE(text.find(out.string() + ": interrupted by signal 2 (Interrupt) while copying " +
                      (t.path / "in" / "training_state.dat").string() + "; the partial output was removed"),
            std::string::npos)
      << text;
  EXPECT_TRUE(names_with_prefix(t.path, "out").empty()) << text;
}

TEST(CliInterrupt, StaleTemporariesAreReportedNotRemoved) {
  test::TempDir t;
  SynthOptions so;
  so.family = ModelFamily::qwen3_moe;
  so.layers = 1;
  so.hidden_size = 64;
  so.moe_intermediate_size = 64;
  so.num_experts = 2;
  so.progress = false;
  synthesize_checkpoint(t.path / "in", so);
  const pid_t dead = dead_pid();
  ASSERT_NE(::kill(dead, 0), 0);
  const fs::path stale = t.path / ("out.tmp." + std::to_string(dead));
  const fs::path stale_old = t.path / ("out.old." + std::to_string(dead));
  const fs::path live = t.path / ("out.tmp." + std::to_string(::getpid()));  // this test process: alive
  const fs::path other = t.path / ("outer.tmp." + std::to_string(dead));    // another target's
  for (const auto& p : {stale, stale_old, live, other}) fs::create_directories(p);

  // The library lists exactly the dead process's temporaries of this target, sorted by name.
  EXPECT_EQ(stale_temporaries(t.path / "out"), (std::vector<fs::path>{stale_old, stale}));
  EXPECT_EQ(stale_temporaries(t.path / "out/"), (std::vector<fs::path>{stale_old, stale}));

  const pid_t pid = spawn({"quantize", (t.path / "in").string(), "-o", (t.path / "out").string(), "--no-progress"},
                          t.path / "log.txt");
  int st = 0;
  ::waitpid(pid, &st, 0);
  const std::string log = read_file(t.path / "log.txt");
  ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << log;
  EXPECT_NE(log.find("warning: " + stale.string() + " was left by an interrupted run"), std::string::npos) << log;
  EXPECT_NE(log.find("warning: " + stale_old.string()), std::string::npos) << log;
  EXPECT_EQ(log.find(live.string()), std::string::npos) << log;
  EXPECT_EQ(log.find(other.string()), std::string::npos) << log;
  for (const auto& p : {stale, stale_old, live, other}) EXPECT_TRUE(fs::exists(p)) << p;  // never removed
  EXPECT_TRUE(Checkpoint(t.path / "out").is_lutb());
}

}  // namespace
}  // namespace lutb
