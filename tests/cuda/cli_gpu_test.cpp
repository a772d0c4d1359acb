// The GPU from the command line (`--device cuda`), end to end through the lutb binary on the shared
// tiny-qwen3-moe model: quantise on the GPU = quantise on the CPU, byte for byte in every output
// file; `lutb moe --device cuda` against `--device cpu`; the default job's GPU section; `lutb eval
// --device cuda` against the CPU. Skips without a usable GPU, without the model, or when the lutb
// binary's path was not compiled in (LUTB_CLI_PATH).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;

#ifdef LUTB_CLI_PATH
constexpr const char* kCli = LUTB_CLI_PATH;
#else
constexpr const char* kCli = nullptr;
#endif

bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define LUTB_CLI_GPU_OR_SKIP()                                                        \
  if (kCli == nullptr) GTEST_SKIP() << "LUTB_CLI_PATH not compiled in";               \
  if (!gpu_present()) GTEST_SKIP() << "no usable CUDA GPU"

struct CliOut {
  int code = -1;
  std::string out;  // stdout (stderr goes to the test's log)
};

CliOut run(const std::string& args) {
  const std::string cmd = std::string(kCli) + " " + args;
  CliOut r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::fputs(r.out.c_str(), stdout);  // the device run's log keeps what the tool printed
  return r;
}

// Appended to one string: "'" + p.string() + "'" made GCC 12 warn of a possibly overlapping memcpy
// (-Wrestrict, a false positive; see tests/cli/cli_new_user_s11_test.cpp).
std::string q(const fs::path& p) {
  std::string r = "'";
  r += p.string();
  r += '\'';
  return r;
}

nlohmann::json last_json(const CliOut& r) {
  const auto e = r.out.find_last_not_of('\n');
  const auto b = r.out.rfind('\n', e);
  return nlohmann::json::parse(r.out.substr(b == std::string::npos ? 0 : b + 1, e - (b == std::string::npos ? 0 : b + 1) + 1));
}

std::map<std::string, std::string> tree(const fs::path& dir) {
  std::map<std::string, std::string> m;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    m[fs::relative(e.path(), dir).generic_string()] = {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
  }
  return m;
}

// The library guarantees quantize_gpu's bytes = lutb::quantize's; this holds it at the tool's level:
// every output file (the LUT-B shards, the index, config.json, the copied files) identical.
TEST(CliGpu, QuantizeOnCudaWritesTheCpuBytes) {
  LUTB_CLI_GPU_OR_SKIP();
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  test::TempDir t;
  const CliOut c = run("quantize " + q(model) + " -o " + q(t.path / "cpu") + " --device cpu --no-progress --json");
  ASSERT_EQ(c.code, 0);
  const CliOut g = run("quantize " + q(model) + " -o " + q(t.path / "cuda") + " --device cuda --no-progress --json");
  ASSERT_EQ(g.code, 0);
  const nlohmann::json jc = last_json(c), jg = last_json(g);
  EXPECT_EQ(jg["device"], "cuda");
  EXPECT_GT(jg["gpu_fit_weights_per_second"].get<double>(), 0.0);
  EXPECT_EQ(jg["weights"], jc["weights"]);
  EXPECT_GT(jc["weights"].get<std::int64_t>(), 0);
  EXPECT_NE(g.out.find("device               cuda, "), std::string::npos);
  const auto a = tree(t.path / "cpu"), b = tree(t.path / "cuda");
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GE(a.size(), 2u);
  for (const auto& [name, bytes] : a) {
    ASSERT_TRUE(b.count(name)) << name << " missing from the GPU output";
    EXPECT_TRUE(b.at(name) == bytes) << name << " differs (" << bytes.size() << " vs " << b.at(name).size() << " bytes)";
  }
  std::printf("CliGpu.QuantizeOnCudaWritesTheCpuBytes: %zu files identical; GPU fit %.3g weights/s\n", a.size(),
              jg["gpu_fit_weights_per_second"].get<double>());
}

// lutb moe --device cuda vs --device cpu on captured activations. Bounds:
//  - LUT-B (MXFP8 activations): both multiply the same MXFP8 activations (gpu.cpp hands the GPU the
//    MXFP8-quantised x) and the same LUT-B weights; the GPU sums in another FP32 order (~1e-6) and
//    writes BF16 (moe_forward's contract, spec 4 step 6). BF16 keeps 8 significant bits: rounding
//    moves each output by at most 2^-8 = 3.9e-3 of itself, so the relative L2 difference is at most
//    2^-8 (plus the FP32 reordering); for mantissas spread log-uniformly its expected value is
//    2^-8 * sqrt(E[1/m^2] / 3) = 2^-8 * sqrt(0.541 / 3) = 1.66e-3 (H200 run cli15-run1: 1.655e-3 to
//    1.663e-3). Asserted < 2.5e-3: the statistical value with margin, well under the hard limit.
//  - BF16 (--quant none): the GPU baseline also rounds x to BF16 (a no-op on these captured inputs,
//    which are BF16; in general a second rounding of at most 2^-8): asserted < 2 * 2^-8 = 7.8e-3.
// And the error against the captured outputs can differ from the CPU's only by that difference
// (triangle inequality): |rel_gpu - rel_cpu| <= vs_cpu * |cpu| / |ref| <= vs_cpu * (1 + rel_cpu).
TEST(CliGpu, MoeOnCudaMatchesTheCpu) {
  LUTB_CLI_GPU_OR_SKIP();
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  for (const std::string quant : {"lutb", "none"}) {
    for (const int layer : {0, 3}) {
      SCOPED_TRACE(quant + " layer " + std::to_string(layer));
      const std::string base = "moe " + q(model) + " --layer " + std::to_string(layer) + " --quant " + quant + " --json";
      const CliOut c = run(base + " --device cpu");
      ASSERT_EQ(c.code, 0);
      const CliOut g = run(base + " --device cuda --compare-cpu --reps 10");
      ASSERT_EQ(g.code, 0);
      const nlohmann::json jc = last_json(c), jg = last_json(g);
      const double vs = jg["vs_cpu_rel_l2"].get<double>();
      const double bound = quant == "lutb" ? 2.5e-3 : 2 * std::ldexp(1.0, -8);
      EXPECT_LT(vs, bound);
      EXPECT_GT(vs, 0.0);  // BF16 output: never bit-equal to the FP32 CPU sum on real data
      const double rc = jc["rel_l2"].get<double>(), rg = jg["rel_l2"].get<double>();
      EXPECT_LE(std::fabs(rg - rc), vs * (1 + rc) + 1e-9);
      EXPECT_EQ(jg["routing"], "gpu (softmax top-k)");
      EXPECT_GT(jg["gpu_routed_ms"].get<double>(), 0.0);
      std::printf("CliGpu.MoeOnCudaMatchesTheCpu: quant %s layer %d: rel_l2 cpu %.6g gpu %.6g, gpu vs cpu %.3g, "
                  "routed-expert forward %.4f ms\n",
                  quant.c_str(), layer, rc, rg, vs, jg["gpu_routed_ms"].get<double>());
    }
  }
}

// The default job with a GPU: its section reports the GPU fit's bytes equal to the CPU fit and the
// fused forward's difference from the CPU emulation (bound as above for LUT-B).
TEST(CliGpu, DefaultJobGpuSection) {
  LUTB_CLI_GPU_OR_SKIP();
  test::TempDir t;
  const CliOut r = run("--experts 8 --tokens 64 --json --work-dir " + q(t.path / "w"));
  ASSERT_EQ(r.code, 0);
  const nlohmann::json j = last_json(r);
  ASSERT_TRUE(j.contains("gpu")) << r.out;
  EXPECT_EQ(j["gpu"]["fit_bytes_equal"], true);
  ASSERT_EQ(j["gpu"]["forward"].size(), 2u);
  for (const auto& f : j["gpu"]["forward"]) {
    EXPECT_LT(f["rel_l2_vs_cpu"].get<double>(), 2.5e-3) << f.dump();
    EXPECT_GT(f["ms"].get<double>(), 0.0);
  }
  EXPECT_NE(r.out.find("bytes equal to the CPU fit: yes"), std::string::npos);
}

// eval --device cuda: the routed experts of every block on the GPU inside the CPU model. The loss
// moves by the blocks' BF16 output rounding (above; 1.66e-3 relative per block output, in all four
// layers) only: measured 1.3e-4 to 4.5e-4 relative (run cli15-run1), asserted within 1e-3 relative.
TEST(CliGpu, EvalOnCudaMatchesTheCpuLoss) {
  LUTB_CLI_GPU_OR_SKIP();
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  for (const std::string quant : {"lutb", "none"}) {
    const std::string base = "eval " + q(model) + " --quant " + quant + " --max-windows 4 --json";
    const CliOut c = run(base + " --device cpu");
    ASSERT_EQ(c.code, 0);
    const CliOut g = run(base + " --device cuda");
    ASSERT_EQ(g.code, 0);
    const double lc = last_json(c)["val_loss"].get<double>(), lg = last_json(g)["val_loss"].get<double>();
    EXPECT_NEAR(lg, lc, 1e-3 * lc) << quant;
    std::printf("CliGpu.EvalOnCudaMatchesTheCpuLoss: quant %s: cpu %.8f cuda %.8f (diff %.3g)\n", quant.c_str(), lc, lg,
                lg - lc);
  }
}

}  // namespace
}  // namespace lutb
