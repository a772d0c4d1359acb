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
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <ostream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::entries;
using test::has;
using test::read_file;
using test::run;
using test::spawn;

// A qwen3_moe checkpoint of `layers` layers of `experts` experts of width `width` at hidden size `hidden`.
void make_checkpoint(const fs::path& dir, std::int64_t layers, std::int64_t hidden, std::int64_t width,
                     std::int64_t experts) {
  synthesize_checkpoint(dir, test::synth_options(hidden, width, experts, layers));
}

// A BF16 checkpoint whose quantisation takes a second or two on one thread (8 layers x 8 experts of
// 256 x 512: 192 projections), so that a signal sent once the temporary exists lands mid-stream.
void make_input(const fs::path& dir) { make_checkpoint(dir, 8, 512, 256, 8); }

// OUT.tmp.PID: the temporary output of the run `pid` writing OUT.
fs::path temporary_of(const fs::path& out, pid_t pid) {
  return out.parent_path() / (out.filename().string() + ".tmp." + std::to_string(pid));
}

struct SignalledRun {
  bool ended_first = false;  // the run ended before `appears` existed: no signal was sent
  int status = 0;            // waitpid's status
  double seconds = 0;        // from the first signal to the end
  std::string log;           // stdout and stderr
};

// Spawns `lutb ARGS`, waits (2 minutes at most) until the path `appears(pid)` exists, waits `settle` more,
// sends `sig` `times` times back to back (as `timeout` does), and waits for the end.
SignalledRun signal_once_it_exists(const std::vector<std::string>& args, const fs::path& log,
                                   const std::function<fs::path(pid_t)>& appears, int sig, int times = 1,
                                   std::chrono::milliseconds settle = std::chrono::milliseconds(0)) {
  SignalledRun r;
  const pid_t pid = spawn(args, log);
  if (pid <= 0) {  // never kill(-1, sig)
    ADD_FAILURE() << "fork failed";
    r.ended_first = true;
    return r;
  }
  const fs::path path = appears(pid);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(path) && std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, &r.status, WNOHANG) == pid) {
      r.ended_first = true;
      r.log = read_file(log);
      return r;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::this_thread::sleep_for(settle);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < times; ++i) ::kill(pid, sig);
  ::waitpid(pid, &r.status, 0);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.log = read_file(log);
  return r;
}

// Whether wait status `status` is death by signal `sig` (the handler re-raises it: shell status 128 + sig).
::testing::AssertionResult killed_by(int status, int sig) {
  if (WIFSIGNALED(status) && WTERMSIG(status) == sig) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "wait status " << status << ", not death by signal " << sig;
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

// A signal while quantize streams tensors (once OUT.tmp.PID exists) stops the run: it dies by that signal
// (re-raised), says so, removes its temporaries (no OUT.tmp.*, no OUT.old.*), leaves an existing
// destination it was replacing with --force untouched, and never touches the input.
struct SignalCase {
  const char* name;
  int signal;
  int times;        // sent back to back
  const char* threads;
  bool replacing;   // --force onto an existing output
};

void PrintTo(const SignalCase& c, std::ostream* os) { *os << c.name; }

class SignalDuringQuantize : public ::testing::TestWithParam<SignalCase> {};

TEST_P(SignalDuringQuantize, StopsAndCleansUp) {
  const SignalCase& c = GetParam();
  test::TempDir t;
  make_input(t.path / "in");
  std::vector<std::string> args = {"quantize", (t.path / "in").string(), "-o", (t.path / "out").string(),
                                   "--no-progress", "--threads", c.threads};
  if (c.replacing) {
    // (a file a checkpoint holds: --force refuses to replace a directory holding anything else)
    fs::create_directories(t.path / "out");
    std::ofstream(t.path / "out" / "keep.json") << "the previous output";
    args.push_back("--force");
  }
  const SignalledRun r = signal_once_it_exists(
      args, t.path / "log.txt", [&](pid_t pid) { return temporary_of(t.path / "out", pid); }, c.signal, c.times);
  ASSERT_FALSE(r.ended_first) << "quantize ended before its temporary appeared:\n" << r.log;
  ASSERT_TRUE(killed_by(r.status, c.signal)) << r.log;
  EXPECT_TRUE(has(r.log, "interrupted by signal " + std::to_string(c.signal))) << r.log;
  EXPECT_FALSE(has(r.log, "lutb: second signal")) << r.log;
  if (c.replacing) {
    EXPECT_EQ(entries(t.path, "out"), std::vector<std::string>{"out"});
    EXPECT_EQ(entries(t.path / "out"), std::vector<std::string>{"keep.json"});
    EXPECT_EQ(read_file(t.path / "out" / "keep.json"), "the previous output");
  } else {
    EXPECT_TRUE(entries(t.path, "out").empty()) << r.log;
  }
  EXPECT_EQ(Checkpoint(t.path / "in").config().num_hidden_layers, 8);
}

const SignalCase kSignalCases[] = {
    {"sigint_replacing_an_output_keeps_it", SIGINT, 1, "1", true},
    {"sigterm_leaves_nothing", SIGTERM, 1, "1", false},
    // GNU timeout (without --foreground) and `kill -- -PGID` signal the process and then its group: the
    // same request twice within microseconds. A signal within a second of the first is the same request:
    // with SA_RESETHAND the second copy, landing on another thread while the first handler ran, would kill
    // the process at once, with no message and OUT.tmp.PID left behind.
    {"sigint_three_times_at_once", SIGINT, 3, "2", false},
    {"sigterm_three_times_at_once", SIGTERM, 3, "2", false},
};

INSTANTIATE_TEST_SUITE_P(CliInterrupt, SignalDuringQuantize, ::testing::ValuesIn(kSignalCases),
                         [](const ::testing::TestParamInfo<SignalCase>& info) { return std::string(info.param.name); });

// A signal that arrives while a large projection is being fitted stops that fit: the fitter polls the flag
// between tiles and the message says where it stopped. One expert of 2048 x 2048 projections (8192 tiles each)
// with the exact "optimal" fitter on one thread: every projection takes seconds, so the signal, sent once the
// temporary exists and the router (a few KB) is copied, lands inside a fit.
TEST(CliInterrupt, SigintInsideOneTensorsFitStopsThatFit) {
  test::TempDir t;
  make_checkpoint(t.path / "in", 1, 2048, 2048, 1);
  const fs::path out = t.path / "out";
  // Past the router copy, into the first fit: 100 ms after the temporary appeared.
  const SignalledRun r = signal_once_it_exists(
      {"quantize", (t.path / "in").string(), "-o", out.string(), "--threads", "1", "--fitter", "optimal",
       "--no-progress"},
      t.path / "log.txt", [&](pid_t pid) { return temporary_of(out, pid); }, SIGINT, 1, std::chrono::milliseconds(100));
  ASSERT_FALSE(r.ended_first) << r.log;
  std::printf("[ info ] the run ended %.3f s after the signal\n", r.seconds);  // informational, not asserted
  ASSERT_TRUE(killed_by(r.status, SIGINT)) << r.log;
  const std::string& text = r.log;
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
  EXPECT_TRUE(entries(t.path, "out").empty()) << text;  // no out, no out.tmp.*
}

// The copy of the other files of a checkpoint polls the flag, so a signal during the copy of a large one (here
// 2 GB, sparse) stops it.
TEST(CliInterrupt, SigintWhileCopyingALargeFileStopsTheCopy) {
  test::TempDir t;
  make_checkpoint(t.path / "in", 1, 64, 64, 2);
  {
    std::ofstream(t.path / "in" / "training_state.dat") << "x";
    fs::resize_file(t.path / "in" / "training_state.dat", std::uintmax_t{2} << 30);
  }
  const fs::path out = t.path / "out";
  const SignalledRun r = signal_once_it_exists(
      {"quantize", (t.path / "in").string(), "-o", out.string(), "--no-progress"}, t.path / "log.txt",
      [&](pid_t pid) { return temporary_of(out, pid) / "training_state.dat"; }, SIGINT);
  ASSERT_FALSE(r.ended_first) << r.log;
  ASSERT_TRUE(killed_by(r.status, SIGINT)) << r.log;
  EXPECT_TRUE(has(r.log, out.string() + ": interrupted by signal 2 (Interrupt) while copying " +
                             (t.path / "in" / "training_state.dat").string() + "; the partial output was removed"))
      << r.log;
  EXPECT_TRUE(entries(t.path, "out").empty()) << r.log;
}

TEST(CliInterrupt, StaleTemporariesAreReportedNotRemoved) {
  test::TempDir t;
  make_checkpoint(t.path / "in", 1, 64, 64, 2);
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
