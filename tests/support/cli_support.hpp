// Running the `lutb` tool from the tests: one runner, through /bin/sh, with stdout and stderr either
// merged (run) or apart (run_cli, for tests that parse stdout as JSON). Needs LUTB_CLI_PATH, the built
// tool, which tests/CMakeLists.txt defines for lutb_tests and lutb_cuda_tests.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/test_support.hpp"

namespace lutb::test {

/// `p` in single quotes for the shell (paths of the tests hold no single quote). Built by appending:
/// `"'" + p.string() + "'"` trips GCC 12's -Wrestrict false positive.
inline std::string q(const std::filesystem::path& p) {
  std::string r = "'";
  r += p.string();
  r += '\'';
  return r;
}

/// The last non-empty line of `text` parsed as JSON (throws when it is not JSON): the `--json` summary
/// the commands print last.
inline nlohmann::json last_json_line(const std::string& text) {
  const auto end = text.find_last_not_of('\n');
  if (end == std::string::npos) return nlohmann::json::parse(std::string());
  const auto newline = text.rfind('\n', end);
  const auto begin = newline == std::string::npos ? 0 : newline + 1;
  return nlohmann::json::parse(text.substr(begin, end + 1 - begin));
}

namespace detail {
/// `PREFIX lutb ARGS` as one shell line.
inline std::string command_line(const std::string& args, const std::string& prefix) {
  return (prefix.empty() ? std::string() : prefix + " ") + q(LUTB_CLI_PATH) + " " + args;
}

/// Runs `cmd` through /bin/sh, appending its stdout to `out`; the exit status, -1 when the command
/// did not exit normally (a signal) or could not start.
inline int run_shell(const std::string& cmd, std::string& out) {
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return -1;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
}  // namespace detail

/// The result of one run with stdout and stderr merged.
struct CliOut {
  int code = -1;    // exit status; -1 when the tool did not exit normally (a signal) or could not start
  std::string out;  // stdout and stderr, merged in the order written
};

/// The result of one run with stdout and stderr apart.
struct CliResult {
  int status = -1;  // exit status, as CliOut::code
  std::string out;  // stdout
  std::string err;  // stderr
  /// The last non-empty stdout line parsed as JSON (throws when it is not JSON).
  nlohmann::json json() const { return last_json_line(out); }
};

/// Runs `PREFIX lutb ARGS` through /bin/sh, stdout and stderr merged. ARGS is a shell-quoted argument
/// string (see q()); PREFIX, when given, stands before the tool on the same line ("TMPDIR=...",
/// kAsNobody, "ulimit -f 16; exec").
inline CliOut run(const std::string& args, const std::string& prefix = "") {
  CliOut r;
  r.code = detail::run_shell(detail::command_line(args, prefix) + " 2>&1", r.out);
  return r;
}

/// As run(), with stdout and stderr apart.
inline CliResult run_cli(const std::string& args, const std::string& prefix = "") {
  TempDir tmp;
  const std::filesystem::path err_file = tmp.path / "stderr.txt";
  CliResult r;
  r.status = detail::run_shell(detail::command_line(args, prefix) + " 2>" + q(err_file), r.out);
  std::ifstream e(err_file);
  r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  return r;
}

/// Starts `lutb ARGS...` without a shell, for tests that signal it, with stdout and stderr to `log` and
/// the default action for SIGINT, SIGTERM and SIGHUP, as from an interactive shell (a test run from a
/// non-interactive background shell inherits SIGINT ignored). Returns the child's pid; reap it with
/// waitpid.
inline pid_t spawn(const std::vector<std::string>& args, const std::filesystem::path& log) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  for (int s : {SIGINT, SIGTERM, SIGHUP}) ::signal(s, SIG_DFL);
  const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
  }
  std::vector<char*> argv;
  std::string exe = LUTB_CLI_PATH;
  argv.push_back(exe.data());
  std::vector<std::string> copy = args;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execv(exe.c_str(), argv.data());
  ::_exit(127);
}

/// The hint every usage error ends with (exit status 2).
inline constexpr const char* kUsageHint = "Run 'lutb --help' (or 'lutb COMMAND --help') for the options.";

/// `lutb synth` arguments of a small qwen3_moe checkpoint (hidden 128, 4 experts), without -o. kSynthSmall
/// has one layer of width 64; kSynthDefaultLayers leaves the layer count and kSynthAnyWidth the expert
/// width to the caller; kSynthTo ends with "-o ", for the output's path.
inline const std::string kSynthSmall =
    "synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 4 --no-progress ";
inline const std::string kSynthDefaultLayers =
    "synth --family qwen3_moe --hidden-size 128 --moe-intermediate-size 64 --experts 4 --no-progress ";
inline const std::string kSynthAnyWidth = "synth --family qwen3_moe --layers 1 --hidden-size 128 --experts 4 --no-progress ";
inline const std::string kSynthTo = kSynthSmall + "-o ";

/// Whether the run's merged output contains `s`.
inline bool has(const CliOut& r, const std::string& s) { return has(r.out, s); }

/// The prefix that runs the tool as uid/gid 65534: permission checks apply to it, as they do not to root.
inline constexpr const char* kAsNobody = "setpriv --reuid=65534 --regid=65534 --clear-groups ";

/// Whether kAsNobody works here: root with setpriv, and the tool reachable by uid 65534.
inline bool can_run_as_nobody() {
  if (::geteuid() != 0) return false;
  const std::string cmd = std::string(kAsNobody) + q(LUTB_CLI_PATH) + " --version >/dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

}  // namespace lutb::test
