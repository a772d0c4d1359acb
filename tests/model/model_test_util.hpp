// Helpers of the model tests: running the lutb CLI and reading its JSON line.
#pragma once

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <sys/wait.h>

#include <nlohmann/json.hpp>

#include "support/test_support.hpp"

namespace lutb::test {

struct CliResult {
  int status = -1;     // exit code
  std::string out;     // stdout
  std::string err;     // stderr
  /// The last non-empty stdout line parsed as JSON (throws when it is not JSON).
  nlohmann::json json() const {
    std::istringstream in(out);
    std::string line, last;
    while (std::getline(in, line))
      if (!line.empty()) last = line;
    return nlohmann::json::parse(last);
  }
};

/// Runs `lutb ARGS` (a shell-quoted argument string), capturing stdout and stderr.
inline CliResult run_cli(const std::string& args) {
  TempDir tmp;
  const std::string err_file = (tmp.path / "stderr.txt").string();
  const std::string cmd = std::string("'") + LUTB_CLI_PATH + "' " + args + " 2>'" + err_file + "'";
  CliResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = ::pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream e(err_file);
  std::stringstream ss;
  ss << e.rdbuf();
  r.err = ss.str();
  return r;
}

/// `p` in single quotes for the shell. Built by appending to one string: `"'" + p.string() + "'"`
/// made GCC 12 inline an insert at the front of the temporary, which -Wrestrict flagged as a
/// possibly overlapping memcpy.
inline std::string quote(const std::filesystem::path& p) {
  const std::string s = p.string();
  std::string r;
  r.reserve(s.size() + 2);
  r += '\'';
  r += s;
  r += '\'';
  return r;
}

}  // namespace lutb::test
