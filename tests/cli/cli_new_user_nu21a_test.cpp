// Defects a new user found in session 21 (helper nu21a) in the CLI's messages about the model folder
// and the input (each test failed on the code before its fix): an unreadable config.json was "no
// config.json" or "not a Hugging Face checkpoint directory?", a folder without permissions a raw
// std::filesystem error; lutb moe blamed a missing activations file for a folder that is no model;
// lutb quantize said /dev/null did not exist.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lutb/checkpoint.hpp"
#include "model/model_test_util.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::CliOut;
using test::has;
using test::q;
using test::TempDir;

// `lutb ARGS` as an unprivileged user: root reads files whatever their mode, so as root the tool runs
// as nobody (uid 65534) through setpriv. "" when that is not possible (no setpriv, or nobody cannot
// run the tool): the caller skips.
std::string unprivileged_prefix() {
  if (::geteuid() != 0) return " ";
  const std::string p = "setpriv --reuid=65534 --regid=65534 --clear-groups ";
  const std::string probe = p + "'" + std::string(LUTB_CLI_PATH) + "' --version >/dev/null 2>&1";
  return std::system(probe.c_str()) == 0 ? p : std::string();
}

CliOut run_as(const std::string& prefix, const std::string& args) {
  const std::string cmd = prefix + "'" + std::string(LUTB_CLI_PATH) + "' " + args + " 2>&1";
  CliOut r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  std::size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

// A synthetic checkpoint (lutb synth's, as nobody can read it) in a folder nobody can enter.
fs::path open_folder(const TempDir& t) {
  fs::permissions(t.path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                              fs::perms::others_read | fs::perms::others_exec);
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = 1;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 4;
  o.progress = false;
  const fs::path m = t.path / "m";
  synthesize_checkpoint(m, o);
  return m;
}

// config.json that cannot be read (mode 000): quantize said "no config.json in the checkpoint
// directory", moe and eval "cannot open (not a Hugging Face checkpoint directory?)".
TEST(NewUserNu21a, UnreadableConfigJsonSaysWhy) {
  const std::string as = unprivileged_prefix();
  if (as.empty()) GTEST_SKIP() << "running as root without a way to drop privileges (setpriv)";
  TempDir t;
  const fs::path m = open_folder(t);
  const fs::path config = m / "config.json";
  fs::permissions(config, fs::perms::none);
  const std::string want = "lutb: error: " + config.string() + ": cannot open: Permission denied";
  for (const std::string& args : {"quantize " + q(m) + " -o " + q(t.path / "lb") + " --no-progress",
                                  "eval " + q(m) + " --max-windows 1",
                                  "moe " + q(m) + " --layer 0"}) {
    const CliOut r = run_as(as, args);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, want)) << args << "\n" << r.out;
    EXPECT_FALSE(has(r, "no config.json")) << args << "\n" << r.out;
    EXPECT_FALSE(has(r, "not a Hugging Face checkpoint directory")) << args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(t.path / "lb"));
}

// A checkpoint folder of mode 0: "filesystem error: status: Permission denied [qu/config.json]".
TEST(NewUserNu21a, FolderWithoutPermissionsNamed) {
  const std::string as = unprivileged_prefix();
  if (as.empty()) GTEST_SKIP() << "running as root without a way to drop privileges (setpriv)";
  TempDir t;
  const fs::path m = open_folder(t);
  fs::permissions(m, fs::perms::none);
  const std::string want =
      "lutb: error: " + m.string() + ": cannot look inside the checkpoint directory: Permission denied";
  for (const std::string& args : {"quantize " + q(m) + " -o " + q(t.path / "lb") + " --no-progress",
                                  "eval " + q(m) + " --max-windows 1",
                                  "moe " + q(m) + " --layer 0"}) {
    const CliOut r = run_as(as, args);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, want)) << args << "\n" << r.out;
    EXPECT_FALSE(has(r, "filesystem error")) << args << "\n" << r.out;
  }
  fs::permissions(m, fs::perms::owner_all);  // for TempDir's removal as non-root
  EXPECT_FALSE(fs::exists(t.path / "lb"));
}

// lutb moe on a folder that is no model (empty, config.json a FIFO, config.json holding [1,2]) said
// "--activations not given and DIR holds no moe_activations.safetensors" (exit 2); it names the model
// folder's problem now, as lutb eval does (exit 1).
TEST(NewUserNu21a, MoeChecksTheModelFolderFirst) {
  TempDir t;
  const fs::path empty = t.path / "empty", fifo = t.path / "fifo", array = t.path / "array";
  fs::create_directories(empty);
  fs::create_directories(fifo);
  ASSERT_EQ(::mkfifo((fifo / "config.json").c_str(), 0644), 0);
  fs::create_directories(array);
  std::ofstream(array / "config.json") << "[1,2]";
  const struct {
    fs::path dir;
    std::string want;
  } cases[] = {
      {empty, (empty / "config.json").string() + ": cannot open: No such file or directory"},
      {fifo, (fifo / "config.json").string() + ": is a named pipe (FIFO); the checkpoint's config.json must be a "
                                               "regular file"},
      {array, (array / "config.json").string() + ": not a JSON object"},
  };
  for (const auto& c : cases) {
    const CliOut r = test::run("moe " + q(c.dir) + " --layer 0");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_EQ(r.out.rfind("lutb: error: " + c.want, 0), 0u) << r.out;
    EXPECT_FALSE(has(r, "--activations not given")) << r.out;
    // eval's message is the same.
    const CliOut e = test::run("eval " + q(c.dir));
    EXPECT_EQ(e.code, 1) << e.out;
    EXPECT_EQ(e.out.rfind("lutb: error: " + c.want, 0), 0u) << e.out;
  }
}

// `lutb quantize /dev/null -o x.safetensors` (or a FIFO): "/dev/null: no such checkpoint directory
// or file".
TEST(NewUserNu21a, QuantizeNamesWhatTheInputIs) {
  TempDir t;
  const fs::path fifo = t.path / "in.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string out = " -o " + q(t.path / "x.safetensors") + " --no-progress";
  CliOut r = test::run("quantize /dev/null" + out);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(r.out, "lutb: error: /dev/null: is a character device, not a checkpoint directory or a regular "
                   ".safetensors file\n");
  r = test::run("quantize " + q(fifo) + out);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(r.out, "lutb: error: " + fifo.string() +
                       ": is a named pipe (FIFO), not a checkpoint directory or a regular .safetensors file\n");
  EXPECT_FALSE(fs::exists(t.path / "x.safetensors"));
}

}  // namespace
}  // namespace lutb
