// `--help` of every command: the defaults, the choices, the device, and the exit statuses.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

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

constexpr const char* kExit = "Exit status: 0 success; 1 the work failed";

// --help names the defaults of the default job's --seed, eval's --batch and quantize's --threads, and eval /
// moe's --fitter names its default and the other fitters.
TEST(CliHelp, NamesDefaultsAndChoices) {
  const CliOut top = run("--help");
  EXPECT_TRUE(has(top, "seed of the random tokens (default 1;")) << top.out;
  EXPECT_TRUE(has(top, "LUT-B fitter: binned-dp, optimal, ct-lloyd, multistart (default binned-dp)")) << top.out;
  const CliOut ev = run("eval --help");
  EXPECT_TRUE(has(ev, "windows of 256 tokens per forward pass (default 8;")) << ev.out;
  EXPECT_TRUE(has(ev, "(the online method): binned-dp, optimal, ct-lloyd, multistart (default binned-dp)")) << ev.out;
  const CliOut qz = run("quantize --help");
  EXPECT_TRUE(has(qz, "threads of the fit (default 0 = all cores;")) << qz.out;
  const CliOut mo = run("moe --help");
  EXPECT_TRUE(has(mo, "decoder layer L (0-based, counting dense layers too)")) << mo.out;
}

// Every option of every command that takes a value and is not required says its default in --help (what
// happens without it), and the usage line names the tool, not the path of the binary.
TEST(CliHelp, StatesEveryDefault) {
  for (const std::string cmd : {"", "quantize", "eval", "calibrate", "moe", "synth"}) {
    const CliOut r = run(cmd + " --help");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(has(r, "Usage: lutb " + (cmd.empty() ? std::string("[OPTIONS] [SUBCOMMAND]") : cmd + " [OPTIONS]")))
        << r.out;
    // Option entries: a line "  -x..." or "  --name ..." and its continuation lines, up to the next
    // entry or a blank line.
    std::vector<std::string> entries;
    std::size_t p = 0;
    while (p < r.out.size()) {
      const std::size_t e = r.out.find('\n', p);
      const std::string line = r.out.substr(p, e == std::string::npos ? std::string::npos : e - p);
      p = e == std::string::npos ? r.out.size() : e + 1;
      if (line.rfind("  -", 0) == 0) entries.push_back(line);
      else if (!entries.empty() && line.rfind("    ", 0) == 0 && line.find_first_not_of(' ') >= 20) entries.back() += line;
      else if (line.empty() && !entries.empty()) entries.push_back("");
    }
    int checked = 0;
    for (const auto& e : entries) {
      if (e.empty() || e.find("REQUIRED") != std::string::npos) continue;
      // The type follows the name: "--threads INT:0..4096", "--fitter TEXT", "--nu FLOAT"; flags have none.
      const std::size_t sp = e.find(' ', e.find_first_not_of(' '));
      const std::string after = e.substr(sp + 1);
      const bool value = after.rfind("TEXT", 0) == 0 || after.rfind("INT", 0) == 0 || after.rfind("UINT", 0) == 0 ||
                         after.rfind("FLOAT", 0) == 0;
      if (!value) continue;
      ++checked;
      EXPECT_NE(e.find("default"), std::string::npos) << "lutb " << cmd << " --help: no default in\n" << e;
    }
    EXPECT_GE(checked, 2) << r.out;
  }
}

// `lutb eval --help` describes the CPU and the GPU paths, as it has a --device cuda option.
TEST(CliHelp, EvalHelpNamesTheGpu) {
  const CliOut r = run("eval --help");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string first = r.out.substr(0, r.out.find('\n'));
  EXPECT_EQ(first, "Held-out loss of a MoE language model (spec section 8): on the CPU, or with --device cuda the routed "
                   "experts on the GPU");
  EXPECT_TRUE(has(run("--help"), "eval                        Held-out loss of a MoE language model (spec section 8): on "
                                 "the CPU, or with --device cuda"));
}

// Every --help ends with the exit statuses: CLI11 shows a command's own footer in place of the app's,
// so each command carries the statuses in its own footer.
TEST(CliHelp, EveryHelpEndsWithTheExitStatuses) {
  for (const char* cmd : {"", "quantize ", "eval ", "calibrate ", "moe ", "synth "}) {
    const CliOut r = run(std::string(cmd) + "--help");
    EXPECT_EQ(r.code, 0) << cmd << r.out;
    const auto at = r.out.rfind(kExit);
    ASSERT_NE(at, std::string::npos) << "lutb " << cmd << "--help:\n" << r.out;
    EXPECT_EQ(r.out.find('\n', at), r.out.size() - 1) << "lutb " << cmd << "--help: the statuses are not last";
  }
  // The commands' own paragraphs are still there.
  EXPECT_TRUE(has(run("synth --help"), "Checks the destination and the free space first"));
  EXPECT_TRUE(has(run("quantize --help"), "Interruption: the output is built under OUT.tmp.PID"));
}

// docs/cli.md promises every command and option: each command has its section ("## `lutb CMD`"), and
// every long option its --help lists is named in that section.
TEST(CliHelp, TheReferenceNamesEveryCommandAndOption) {
  const std::string doc = test::read_file(fs::path(LUTB_SOURCE_DIR) / "docs" / "cli.md");
  ASSERT_FALSE(doc.empty());
  for (const std::string cmd : {"", "quantize", "eval", "calibrate", "moe", "synth"}) {
    const std::string title = cmd.empty() ? "## `lutb` (the default job)" : "## `lutb " + cmd + "`";
    const auto at = doc.find("\n" + title + "\n");
    ASSERT_NE(at, std::string::npos) << "docs/cli.md has no section " << title;
    const auto end = doc.find("\n## ", at + 1);
    const std::string section = doc.substr(at, end == std::string::npos ? std::string::npos : end - at);
    const CliOut r = run(cmd + " --help");
    ASSERT_EQ(r.code, 0) << r.out;
    // Option entries start a line: "  -o,--output TEXT", "  --threads INT"; the long name after the comma.
    int named = 0;
    std::size_t p = 0;
    while (p < r.out.size()) {
      const std::size_t e = r.out.find('\n', p);
      const std::string line = r.out.substr(p, e == std::string::npos ? std::string::npos : e - p);
      p = e == std::string::npos ? r.out.size() : e + 1;
      if (line.rfind("  -", 0) != 0) continue;
      const auto dd = line.find("--");
      if (dd == std::string::npos) continue;
      const std::string opt = line.substr(dd, line.find_first_of(" ,", dd) - dd);
      if (opt == "--help" || opt == "--version") continue;
      ++named;
      // In a table cell: "`--threads N`", or "`-o, --output PATH`".
      EXPECT_TRUE(has(section, "`" + opt) || has(section, ", " + opt)) << title << " of docs/cli.md does not name " << opt;
    }
    EXPECT_GE(named, 2) << r.out;
  }
}

}  // namespace
}  // namespace lutb
