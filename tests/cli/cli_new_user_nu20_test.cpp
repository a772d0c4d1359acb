// What a fresh new user found in session 20 (helper nu20) on the lutb command line, and the last of
// session 19's: each test failed on the code before its fix. (The interrupted / failed-write wording
// "nothing was created at OUT" is tested where those runs are: cli_interrupt_test.cpp,
// cli_new_user_nu15_test.cpp, cli_new_user_nu17_test.cpp; `lutb moe` refusing NaN outputs before
// printing a result: model/model_new_user_s11_test.cpp.)
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
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

constexpr const char* kExit = "Exit status: 0 success; 1 the work failed";

// `lutb eval --help` began "Held-out loss of a MoE language model on the CPU" above its own
// --device cuda option.
TEST(CliNewUserNu20, EvalHelpNamesTheGpu) {
  const CliOut r = run("eval --help");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string first = r.out.substr(0, r.out.find('\n'));
  EXPECT_EQ(first, "Held-out loss of a MoE language model (spec section 8): on the CPU, or with --device cuda the routed "
                   "experts on the GPU");
  EXPECT_TRUE(has(run("--help"), "eval                        Held-out loss of a MoE language model (spec section 8): on "
                                 "the CPU, or with --device cuda"));
}

// CLI11 shows a command's own footer in place of the app's: `lutb synth --help` and `lutb quantize
// --help` had no exit statuses while `lutb moe --help` had them.
TEST(CliNewUserNu20, EveryHelpEndsWithTheExitStatuses) {
  for (const char* cmd : {"", "quantize ", "eval ", "moe ", "synth "}) {
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

// A small synth checkpoint was announced as "(0.00 GB)" and written "(1 layers, ...): 0.00 GB".
TEST(CliNewUserNu20, SynthSizesInReadableUnits) {
  test::TempDir t;
  const CliOut r = run("synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 4 "
                       "--no-progress -o " + q(t.path / "s"));
  ASSERT_EQ(r.code, 0) << r.out;
  // 4 experts x 3 x 64 x 128 BF16 = 196608 bytes of experts, plus the router 4 x 128 BF16 = 1024.
  EXPECT_TRUE(has(r, "lutb synth: will write 197632 bytes (197.6 kB) of BF16 tensors to ")) << r.out;
  EXPECT_TRUE(has(r, "lutb synth: qwen3_moe (1 layer, E 4, H 128, I 64, k 4) -> ")) << r.out;
  EXPECT_TRUE(has(r, ": 197.6 kB in ")) << r.out;
  EXPECT_FALSE(has(r, "GB")) << r.out;
  const CliOut two = run("synth --family qwen3_moe --layers 2 --hidden-size 1024 --moe-intermediate-size 512 "
                         "--experts 4 --no-progress -o " + q(t.path / "s2"));
  ASSERT_EQ(two.code, 0) << two.out;
  // 2 x (4 x 3 x 512 x 1024 + 4 x 1024) x 2 bytes = 25182208 bytes.
  EXPECT_TRUE(has(two, "will write 25182208 bytes (25.18 MB)")) << two.out;
  EXPECT_TRUE(has(two, "(2 layers, E 4, H 1024, I 512, k 4)")) << two.out;
}

// `lutb quantize CK -o /proc/x` was refused as "needs 0.04 MB but only 0.00 MB are free on the
// filesystem of /proc": the fix is not more space. /proc and /sys report 0 bytes free and take no
// new entries; the refusal now says that nothing can be created there.
TEST(CliNewUserNu20, PseudoFilesystemIsNotBlamedOnFreeSpace) {
  if (!fs::exists("/proc/self/status")) GTEST_SKIP() << "/proc is not mounted here";
  test::TempDir t;
  const CliOut s = run("synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 4 "
                       "--no-progress -o " + q(t.path / "ck"));
  ASSERT_EQ(s.code, 0) << s.out;
  const std::string dir_out = "/proc/lutb-nu20-" + std::to_string(::getpid());
  const std::string runs[] = {
      "quantize " + q(t.path / "ck") + " -o " + dir_out + " --no-progress",
      "quantize " + q(t.path / "ck" / "model.safetensors") + " -o " + dir_out + ".safetensors --no-progress",
      "synth --family qwen3_moe --layers 1 --no-progress -o " + dir_out};
  for (const std::string& args : runs) {
    const CliOut r = run(args);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, ": nothing can be created in /proc: ")) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, "; nothing written")) << r.out;
    EXPECT_FALSE(has(r, "are free on the filesystem")) << r.out;
  }
}

// An empty integer value read "--threads:  is not an integer (valid range 0..4096)" (session 19).
TEST(CliNewUserNu20, EmptyIntegerValueIsNamed) {
  for (const std::string& args :
       {std::string("quantize in -o out --threads ''"), std::string("synth --family qwen3_moe -o x --layers ''")}) {
    const CliOut r = run(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, ": an empty value was given; expected an integer ")) << args << "\n" << r.out;
    EXPECT_FALSE(has(r, "  is not an integer")) << r.out;
  }
}

}  // namespace
}  // namespace lutb
