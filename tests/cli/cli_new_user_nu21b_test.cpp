// What a fresh new user found in session 21 (helper nu21b) on the lutb command line: the default
// job's --work-dir errors and its cleanup, and lutb quantize finding an unreadable input file only
// after the whole fit. Each test failed on the code before its fix. (The wording of an error found
// mid-run over an existing output with --force: io/checkpoint_new_user_s11_test.cpp.)
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;

using test::CliOut;
using test::has;
using test::q;
using test::run;

constexpr const char* kNobody = "setpriv --reuid=65534 --regid=65534 --clear-groups ";

// `lutb ARGS` run as uid/gid 65534 (root bypasses permission checks); as run().
CliOut run_as_nobody(const std::string& args) {
  const std::string cmd = std::string(kNobody) + LUTB_CLI_PATH + " " + args + " 2>&1";
  CliOut r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// Whether this test can run the tool as another user: root with setpriv, and the tool reachable by
// uid 65534.
bool can_run_as_nobody() {
  if (::geteuid() != 0) return false;
  const std::string cmd = std::string(kNobody) + LUTB_CLI_PATH + " --version >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

// The reason of a failing mkdir was lost: the cleanup of the parents reused its std::error_code,
// and "--work-dir /proc/x" read "cannot create it: Success".
TEST(CliNewUserNu21b, WorkDirThatCannotBeCreatedSaysWhy) {
  const CliOut r = run("--experts 8 --work-dir /proc/lutb-nu21b/x");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "--work-dir /proc/lutb-nu21b/x: cannot create it: No such file or directory")) << r.out;
  EXPECT_FALSE(has(r, "Success")) << r.out;
}

// A dangling symbolic link where the default job writes its checkpoint passed the "exists in
// --work-dir" check (fs::exists follows links), was refused by synth with the advice of an -o option
// the default job does not have, and the cleanup then deleted the user's link.
TEST(CliNewUserNu21b, DefaultJobNeverRemovesTheUsersEntryInWorkDir) {
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

// A file that quantize copies but cannot read (tokenizer.json at mode 000) was found by the copy
// step after the whole fit, hours on a real model: refused before anything is written, naming the
// input file and the reason.
TEST(CliNewUserNu21b, UnreadableFileToCopyIsRefusedBeforeTheFit) {
  if (!can_run_as_nobody()) GTEST_SKIP() << "needs root, setpriv and a tool uid 65534 can run";
  test::TempDir t;
  fs::permissions(t.path, fs::perms::all);  // uid 65534 writes the output here
  const fs::path in = t.path / "m";
  ASSERT_EQ(run("synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 4 "
                "--no-progress -o " + q(in)).code, 0);
  const fs::path tok = in / "tokenizer.json";
  std::ofstream(tok) << "{}\n";
  ::chmod(tok.c_str(), 0);
  const fs::path out = t.path / "q";
  const CliOut r = run_as_nobody("quantize " + q(in) + " -o " + q(out) + " --no-progress");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, tok.string() + ": cannot open it for reading: Permission denied; lutb quantize copies it into "
                                    "the output"))
      << r.out;
  EXPECT_TRUE(has(r, "; nothing written")) << r.out;
  EXPECT_FALSE(has(r, out.string() + "/tokenizer.json")) << r.out;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(std::distance(fs::directory_iterator(t.path), fs::directory_iterator()), 1);  // no OUT.tmp.PID left

  // A subfolder it cannot list: refused the same way, before the fit.
  ::chmod(tok.c_str(), 0644);
  fs::create_directory(in / "extra");
  std::ofstream(in / "extra" / "a.txt") << "a\n";
  ::chmod((in / "extra").c_str(), 0);
  const CliOut r2 = run_as_nobody("quantize " + q(in) + " -o " + q(out) + " --no-progress");
  ::chmod((in / "extra").c_str(), 0755);
  EXPECT_EQ(r2.code, 1) << r2.out;
  EXPECT_TRUE(has(r2, (in / "extra").string() + ": cannot list the input folder's files under it: Permission denied"))
      << r2.out;
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace lutb
