// What a fresh new user found in session 21 (helper nu21) on the lutb command line, fixed by the lead:
// each test failed on the code before its fix. (A signal delivered twice at once:
// cli_interrupt_test.cpp, CliInterrupt.TheSameSignalTwiceAtOnceStillCleansUp.)
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
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

const std::string kSynth =
    "synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 4 --no-progress -o ";

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// DATA LOSS: an input folder whose model.safetensors is a link into the output folder. `quantize inp
// -o victim --force` replaced victim/model.safetensors, the only copy of the BF16 weights, by LUT-B
// tensors and exited 0: the checks compared the folders, not the files read.
TEST(CliNewUserNu21, InputLinkIntoTheOutputIsRefused) {
  test::TempDir t;
  ASSERT_EQ(run(kSynth + q(t.path / "victim")).code, 0);
  const std::string before = slurp(t.path / "victim" / "model.safetensors");
  fs::create_directories(t.path / "inp");
  fs::copy_file(t.path / "victim" / "config.json", t.path / "inp" / "config.json");
  fs::create_symlink("../victim/model.safetensors", t.path / "inp" / "model.safetensors");
  const CliOut r = run("quantize " + q(t.path / "inp") + " -o " + q(t.path / "victim") + " --force --no-progress");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: " + (t.path / "victim").string() + ": the input " + (t.path / "inp").string() +
                         " reads " + (t.path / "inp" / "model.safetensors").string() +
                         " through a link into the output ("))
      << r.out;
  EXPECT_TRUE(has(r, "replacing the output would delete it; choose another output; nothing written")) << r.out;
  EXPECT_EQ(slurp(t.path / "victim" / "model.safetensors"), before);
  // A link to a folder inside the output is the same.
  fs::remove(t.path / "inp" / "model.safetensors");
  fs::copy_file(t.path / "victim" / "model.safetensors", t.path / "inp" / "model.safetensors");
  fs::create_directories(t.path / "victim" / "extra");
  fs::create_directory_symlink("../victim/extra", t.path / "inp" / "extra");
  const CliOut d = run("quantize " + q(t.path / "inp") + " -o " + q(t.path / "victim") + " --force --no-progress");
  EXPECT_EQ(d.code, 1) << d.out;
  EXPECT_TRUE(has(d, "through a link into the output")) << d.out;
  // A link elsewhere is fine.
  fs::remove(t.path / "inp" / "extra");
  const CliOut ok = run("quantize " + q(t.path / "inp") + " -o " + q(t.path / "out") + " --no-progress");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// Results lost on stdout: `lutb synth ... > /dev/full` (and moe / eval / quantize --json) exited 0.
TEST(CliNewUserNu21, UnwritableStdoutIsAFailure) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  test::TempDir t;
  const fs::path err = t.path / "err.txt";
  const std::string cmd = q(LUTB_CLI_PATH) + " " + kSynth + q(t.path / "s") + " >/dev/full 2>" + q(err);
  const int st = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(st)) << st;
  EXPECT_EQ(WEXITSTATUS(st), 1) << slurp(err);
  EXPECT_NE(slurp(err).find("lutb: error: cannot write the results to standard output: No space left on device; the "
                            "work itself is done"),
            std::string::npos)
      << slurp(err);
  EXPECT_TRUE(fs::exists(t.path / "s" / "config.json"));  // the work was done
}

// `-o newq/.` built the whole output under "newq/..tmp.PID", then refused to rename it ("appeared
// while the output was being written ... newq/. is as it was") and threw it away; with an existing
// output and --force: "filesystem error: cannot rename: Device or resource busy".
TEST(CliNewUserNu21, OutputGivenWithTrailingDot) {
  test::TempDir t;
  const CliOut s = run(kSynth + q(t.path / "s") + "/.");
  ASSERT_EQ(s.code, 0) << s.out;
  EXPECT_TRUE(fs::is_regular_file(t.path / "s" / "config.json")) << s.out;
  const CliOut a = run("quantize " + q(t.path / "s") + " -o " + q(t.path / "newq") + "/. --no-progress");
  EXPECT_EQ(a.code, 0) << a.out;
  EXPECT_TRUE(fs::is_regular_file(t.path / "newq" / "config.json")) << a.out;
  const CliOut b = run("quantize " + q(t.path / "s") + " -o " + q(t.path / "newq") + "/./ --force --no-progress");
  EXPECT_EQ(b.code, 0) << b.out;
  const CliOut f = run("quantize " + q(t.path / "s" / "model.safetensors") + " -o " + q(t.path / "f.safetensors") +
                       "/. --no-progress");
  EXPECT_EQ(f.code, 0) << f.out;
  EXPECT_TRUE(fs::is_regular_file(t.path / "f.safetensors")) << f.out;
  for (const auto& e : fs::directory_iterator(t.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  // "-o n6/x/.." ran the whole job, then failed: "n6/x/..: appeared while the output was being
  // written". Refused at once now, for every writer, and nothing is created.
  const std::string dots = q(t.path / "n6") + "/x/..";
  for (const std::string& args : {"quantize " + q(t.path / "s") + " -o " + dots + " --no-progress",
                                  "quantize " + q(t.path / "s" / "model.safetensors") + " -o " + dots + " --no-progress",
                                  kSynth + dots}) {
    const CliOut r = run(args);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, "/n6/x/..: an output path may not end in '..'; give the folder by its own name; nothing "
                       "written"))
        << r.out;
    EXPECT_FALSE(has(r, "will write")) << r.out;
    EXPECT_FALSE(fs::exists(t.path / "n6")) << args;
  }
}

}  // namespace
}  // namespace lutb
