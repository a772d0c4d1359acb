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

}  // namespace
}  // namespace lutb
