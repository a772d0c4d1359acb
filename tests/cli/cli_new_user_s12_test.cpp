// The lutb command line on what new users reported (sessions 11 and 12), fixed in session 12: each
// test failed on the code before its fix.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/core.h>

#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;

struct CliOut {
  int code = -1;
  std::string out;  // stdout and stderr
};

CliOut run(const std::string& args) {
  const std::string cmd = std::string(LUTB_CLI_PATH) + " " + args + " 2>&1";
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

std::string q(const fs::path& p) { return "'" + p.string() + "'"; }
bool has(const CliOut& r, const std::string& s) { return r.out.find(s) != std::string::npos; }

const std::string kSynth =
    "synth --family qwen3_moe --layers 1 --hidden-size 128 --experts 4 --moe-intermediate-size 64 --no-progress ";

// Finding 7: the arguments are checked before the file system: an invalid --match was reported only
// after "output file exists" (or "no such file").
TEST(CliNewUserS12, InvalidMatchComesFirst) {
  test::TempDir t;
  std::ofstream(t.path / "out.safetensors") << "x";
  for (const std::string input : {"missing.safetensors", "out.safetensors"}) {
    const CliOut r = run("quantize " + q(t.path / input) + " -o " + q(t.path / "out.safetensors") + " --match '('");
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(has(r, "lutb: error: --match \"(\": invalid regular expression")) << r.out;
  }
}

}  // namespace
}  // namespace lutb
