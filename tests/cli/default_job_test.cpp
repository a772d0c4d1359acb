// The default job (`lutb` without a command): its --work-dir and TMPDIR, and what it removes.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
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
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/config_json.hpp"
#include "io/tensor_names.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
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
using test::TempDir;

// The default job with TMPDIR naming a folder that does not exist names the variable and the folder, not the
// library's "filesystem error: temp_directory_path: No such file or directory".
TEST(CliDefaultJob, NamesAnUnusableTmpdir) {
  TempDir t;
  const fs::path absent = t.path / "no-such-tmp";
  const test::CliResult r = test::run_cli("--experts 1 --tokens 1", "TMPDIR=" + test::q(absent));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("lutb: error: the temporary folder TMPDIR=" + absent.string() + " is not usable ("),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("): set TMPDIR to an existing folder, or give --work-dir DIR\n"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(absent));
}

// A --work-dir that cannot be created is refused with the reason of the failing mkdir: the cleanup of the
// parents must not reuse its std::error_code (which would read "cannot create it: Success").
TEST(CliDefaultJob, WorkDirThatCannotBeCreatedSaysWhy) {
  const CliOut r = run("--experts 8 --work-dir /proc/lutb-work-dir/x");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "--work-dir /proc/lutb-work-dir/x: cannot create it: No such file or directory")) << r.out;
  EXPECT_FALSE(has(r, "Success")) << r.out;
}

// An entry of the user where the default job writes its checkpoint, a dangling symbolic link included
// (fs::exists follows links), is refused before synth runs, without advice about an -o option the default job
// does not have, and the cleanup never removes it.
TEST(CliDefaultJob, NeverRemovesTheUsersEntryInWorkDir) {
  test::TempDir t;
  const fs::path wd = t.path / "wd";
  for (const char* name : {"qwen3-30b-a3b-layer-bf16", "qwen3-30b-a3b-layer-lutb"}) {
    fs::remove_all(wd);
    fs::create_directory(wd);
    fs::create_symlink("/nonexistent/target", wd / name);
    const CliOut r = run("--experts 8 --work-dir " + q(wd));
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(has(r, (wd / name).string() + ": the work directory already holds " + name +
                           " (a symbolic link to /nonexistent/target, which does not exist), the name this run writes "
                           "a checkpoint to; choose another --work-dir or remove it; nothing written"))
        << r.out;
    EXPECT_FALSE(has(r, "give the target itself")) << r.out;
    EXPECT_TRUE(fs::is_symlink(fs::symlink_status(wd / name))) << name << ": the user's link was removed";
    EXPECT_EQ(std::distance(fs::directory_iterator(wd), fs::directory_iterator()), 1) << name;
  }
  // A link to an existing folder: refused the same way, the folder untouched.
  fs::remove_all(wd);
  fs::create_directories(t.path / "mine");
  std::ofstream(t.path / "mine" / "notes.txt") << "keep";
  fs::create_directory(wd);
  fs::create_directory_symlink(t.path / "mine", wd / "qwen3-30b-a3b-layer-bf16");
  const CliOut r = run("--experts 8 --work-dir " + q(wd));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "the work directory already holds qwen3-30b-a3b-layer-bf16 (a symbolic link to " +
                         (t.path / "mine").string() + "), the name"))
      << r.out;
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(wd / "qwen3-30b-a3b-layer-bf16")));
  EXPECT_TRUE(fs::exists(t.path / "mine" / "notes.txt"));
}

// The default job creates the missing parents of --work-dir (mkdir -p) and removes them again, after a run or
// a Ctrl-C: "--work-dir T/a/b/c" leaves nothing under T. Existing ancestors and their contents stay; --keep
// keeps everything.
TEST(CliDefaultJob, RemovesTheWorkDirParentsItCreated) {
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
  const pid_t pid = test::spawn({"--experts", "2", "--tokens", "4", "--work-dir", work.string()}, log);
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
