// `--device cpu|cuda` of lutb quantize / moe / eval and the default job's GPU section, where no GPU can
// be used (CI, this build machine, a CPU-only build): every --device cuda run must fail before it
// writes anything, with a message saying why, and bad --device values are refused by the parser.
// On a machine with a usable GPU these tests skip (tests/cuda/cli_gpu_test.cpp covers that case).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
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
using test::read_file;
using test::run;

/// The reason --device cuda cannot run here, as the tool words it (one of the two).
bool names_no_cuda(const CliOut& r) {
  return has(r, "--device cuda: no usable CUDA GPU (") || has(r, "--device cuda: this lutb was built without CUDA");
}

TEST(CliDevice, BadDeviceValuesAreRefusedByTheParser) {
  test::TempDir t;
  for (const std::string dev : {"gpu", "CUDA", "cuda:0", ""}) {
    const CliOut a = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "out") + " --device '" + dev + "'");
    EXPECT_NE(a.code, 0) << dev;
    EXPECT_TRUE(has(a, "--device")) << a.out;
    EXPECT_TRUE(has(a, "cpu") && has(a, "cuda")) << "the allowed values are named: " << a.out;
    const CliOut b = run("moe " + q(t.path) + " --layer 0 --device '" + dev + "'");
    EXPECT_NE(b.code, 0) << dev;
    EXPECT_TRUE(has(b, "--device")) << b.out;
  }
  EXPECT_FALSE(fs::exists(t.path / "out"));
}

TEST(CliDevice, QuantizeOnCudaWithoutAGpuFailsAndWritesNothing) {
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  test::TempDir t;
  const fs::path out = t.path / "out";
  const CliOut r = run("quantize " + q(model) + " -o " + q(out) + " --device cuda --no-progress");
  if (r.code == 0) GTEST_SKIP() << "a usable GPU is present (tests/cuda/cli_gpu_test.cpp covers it)";
  EXPECT_TRUE(names_no_cuda(r)) << r.out;
  EXPECT_FALSE(fs::exists(out));
  // Nothing at all was created beside it (no OUT.tmp.PID left behind).
  EXPECT_TRUE(fs::is_empty(t.path)) << "something was written under " << t.path;

  // An existing output with --force is left exactly as it was.
  fs::create_directories(out);
  {
    std::ofstream(out / "config.json") << "{\"keep\": 1}";
  }
  const CliOut f = run("quantize " + q(model) + " -o " + q(out) + " --device cuda --force --no-progress");
  EXPECT_NE(f.code, 0);
  EXPECT_TRUE(names_no_cuda(f)) << f.out;
  EXPECT_EQ(read_file(out / "config.json"), "{\"keep\": 1}");
  EXPECT_EQ(std::distance(fs::directory_iterator(t.path), fs::directory_iterator()), 1);
}

TEST(CliDevice, QuantizeOnCudaRefusesLloydFittersBeforeAnything) {
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  test::TempDir t;
  for (const std::string fitter : {"ct-lloyd", "multistart"}) {
    const CliOut r = run("quantize " + q(model) + " -o " + q(t.path / "out") + " --device cuda --fitter " + fitter);
    EXPECT_NE(r.code, 0) << r.out;
    // With CUDA built: the library's message (lutb::cuda::gpu_fitter); without: the build's.
    EXPECT_TRUE((has(r, "fitter '" + fitter + "' has no GPU kernel") && has(r, "binned-dp, optimal")) ||
                has(r, "this lutb was built without CUDA"))
        << r.out;
    EXPECT_FALSE(fs::exists(t.path / "out"));
  }
  EXPECT_TRUE(fs::is_empty(t.path));
}

TEST(CliDevice, MoeOnCudaWithoutAGpuFails) {
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  const CliOut r = run("moe " + q(model) + " --layer 0 --device cuda --quant lutb");
  if (r.code == 0) GTEST_SKIP() << "a usable GPU is present (tests/cuda/cli_gpu_test.cpp covers it)";
  EXPECT_TRUE(names_no_cuda(r)) << r.out;
  EXPECT_FALSE(has(r, "rel_l2")) << "nothing was computed: " << r.out;
}

TEST(CliDevice, GpuOnlyOptionsNeedDeviceCuda) {
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  const CliOut a = run("moe " + q(model) + " --layer 0 --compare-cpu");
  EXPECT_NE(a.code, 0);
  EXPECT_TRUE(has(a, "--compare-cpu applies to --device cuda only")) << a.out;
  const CliOut b = run("moe " + q(model) + " --layer 0 --reps 5 --device cpu");
  EXPECT_NE(b.code, 0);
  EXPECT_TRUE(has(b, "--reps applies to --device cuda only")) << b.out;
  const CliOut c = run("moe " + q(model) + " --layer 0 --device cuda --kernel reference --quant lutb");
  EXPECT_NE(c.code, 0);
  EXPECT_TRUE(has(c, "--kernel reference selects a CPU emulation kernel")) << c.out;
}

TEST(CliDevice, EvalOnCudaWithoutAGpuFails) {
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  const CliOut r = run("eval " + q(model) + " --device cuda --quant lutb --max-windows 1");
  if (r.code == 0) GTEST_SKIP() << "a usable GPU is present";
  EXPECT_TRUE(names_no_cuda(r)) << r.out;
}

TEST(CliDevice, DefaultJobSaysWhyTheGpuSectionIsSkipped) {
  test::TempDir t;
  const CliOut r = run("--experts 1 --tokens 1 --work-dir " + q(t.path / "w"));
  ASSERT_EQ(r.code, 0) << r.out;
  if (has(r, "\nGPU                     ")) GTEST_SKIP() << "a usable GPU is present: the section ran";
  EXPECT_TRUE(has(r, "GPU section skipped:    no usable CUDA GPU (") ||
              has(r, "GPU section skipped:    this lutb was built without CUDA"))
      << r.out;
  // Exactly one line about it, the rest of the report unchanged.
  EXPECT_EQ(r.out.find("GPU section skipped"), r.out.rfind("GPU section skipped"));
  // The default job has no --device option: its skip line must not tell the user to use one.
  const std::size_t at = r.out.find("GPU section skipped");
  const std::string line = r.out.substr(at, r.out.find('\n', at) - at);
  EXPECT_EQ(line.find("--device"), std::string::npos) << line;
  EXPECT_TRUE(has(r, "bits per weight         3.140625")) << r.out;
  EXPECT_FALSE(fs::exists(t.path / "w"));
}

// On a machine with no NVIDIA driver at all, a build with CUDA says that no driver is loaded: the CUDA
// runtime's own words ("CUDA driver version is insufficient for CUDA runtime version") send users
// looking for a driver update. Runs where the driver's proc file is absent (CI, this machine).
TEST(CliDevice, NoDriverIsNamedAsSuch) {
  if (fs::exists("/proc/driver/nvidia/version")) GTEST_SKIP() << "an NVIDIA driver is loaded here";
  test::TempDir t;
  const CliOut r = run("--experts 1 --tokens 1 --work-dir " + q(t.path / "w"));
  ASSERT_EQ(r.code, 0) << r.out;
  if (has(r, "this lutb was built without CUDA")) GTEST_SKIP() << "a build without CUDA";
  EXPECT_TRUE(has(r, "GPU section skipped:    no usable CUDA GPU (no NVIDIA driver is loaded on this machine: "
                     "/proc/driver/nvidia/version is missing; CUDA says: "))
      << r.out;
}

}  // namespace
}  // namespace lutb
