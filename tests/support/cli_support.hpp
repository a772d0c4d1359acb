// Running the `lutb` tool from the CLI tests: the command line through the shell, stdout and stderr
// merged, and the exit status. (tests/model/model_test_util.hpp's run_cli keeps the two streams
// apart, for tests that parse stdout as JSON.) Needs LUTB_CLI_PATH, the built tool, which
// tests/CMakeLists.txt defines for lutb_tests.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

namespace lutb::test {

/// The result of one `lutb ARGS` run.
struct CliOut {
  int code = -1;    // exit status; -1 when the tool did not exit normally (a signal) or could not start
  std::string out;  // stdout and stderr, merged in the order written
};

/// Runs `lutb ARGS` through /bin/sh (ARGS is a shell-quoted argument string; see q()).
inline CliOut run(const std::string& args) {
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

/// `p` in single quotes for the shell (paths of the tests hold no single quote). Built by appending:
/// `"'" + p.string() + "'"` trips GCC 12's -Wrestrict false positive.
inline std::string q(const std::filesystem::path& p) {
  std::string r = "'";
  r += p.string();
  r += '\'';
  return r;
}

/// Whether the run's merged output contains `s`.
inline bool has(const CliOut& r, const std::string& s) { return r.out.find(s) != std::string::npos; }

}  // namespace lutb::test
