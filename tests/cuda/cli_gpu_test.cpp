// The GPU from the command line (`--device cuda`), end to end through the lutb binary on the shared
// tiny-qwen3-moe and tiny-deepseek-v3 models: quantise on the GPU = quantise on the CPU, byte for byte
// in every output file, data-free and with --calibration; `lutb moe --device cuda` against
// `--device cpu`; the default job's GPU section; `lutb eval --device cuda` against the CPU, and its
// GPU fit (data-free and calibrated) against the CPU's. Skips without a usable GPU, without the
// model, or when the lutb binary's path was not compiled in (LUTB_CLI_PATH).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "lutb/calibration.hpp"
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

/// The --quant values with a GPU path: lutb and none (the BF16 baseline forward).
std::vector<std::string> gpu_quants() {
  return {"lutb", "none"};
}

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
// (-Wrestrict, a false positive).
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

// lutb moe --device cuda vs --device cpu on captured activations, tiny-qwen3-moe (softmax top-k) and
// tiny-deepseek-v3 (DeepSeek-V3 grouped sigmoid routing and a shared expert; its layer 0 is dense).
// Both backends follow spec section 4 the same way: the routed experts read bf16(x) and their
// weighted sum is rounded to BF16 (an FP32 CPU block against the GPU's BF16 output would differ by
// a relative L2 of about 1.66e-3 from that rounding alone). What is left is FP32 summation order
// inside the fused kernel (~1e-6 relative before rounding), which moves a BF16 output by one unit
// (2^-8..2^-7 of it) only where the FP32 sum lies within that distance of a rounding boundary: a
// fraction ~1e-6 / 2^-8 ~ 3e-4 of the outputs at most, so the relative L2 difference is at most about
// sqrt(3e-4) * 2^-7.5 ~ 1e-4. Measured on an H200: LUT-B 5.0e-7 to 1.1e-5, the BF16
// baseline 6.3e-5 to 1.01e-4 (its h = bf16(silu(g) u) rounds once more inside the pipeline, where a
// reordered g or u can flip it too). Asserted < 3e-4: about 3x the largest measured value, and the
// routing must agree (one flipped choice among the 512 tokens would add ~1e-2).
// And the error against the captured outputs can differ from the CPU's only by that difference
// (triangle inequality): |rel_gpu - rel_cpu| <= vs_cpu * |cpu| / |ref| <= vs_cpu * (1 + rel_cpu).
constexpr double kMoeVsCpuBound = 3e-4;

TEST(CliGpu, MoeOnCudaMatchesTheCpu) {
  LUTB_CLI_GPU_OR_SKIP();
  struct Case {
    const char* model;
    int layers[2];
    const char* routing;
  };
  for (const Case& m : {Case{"tiny-qwen3-moe", {0, 3}, "gpu (softmax top-k)"},
                        Case{"tiny-deepseek-v3", {1, 3}, "gpu (DeepSeek grouped sigmoid)"}}) {
    LUTB_MODEL_OR_SKIP(model, m.model);
    for (const std::string& quant : gpu_quants()) {
      for (const int layer : m.layers) {
        std::string trace = m.model;
        trace += " " + quant + " layer " + std::to_string(layer);
        SCOPED_TRACE(trace);
        const std::string base = "moe " + q(model) + " --layer " + std::to_string(layer) + " --quant " + quant + " --json";
        const CliOut c = run(base + " --device cpu");
        ASSERT_EQ(c.code, 0);
        const CliOut g = run(base + " --device cuda --compare-cpu --reps 10");
        ASSERT_EQ(g.code, 0);
        const nlohmann::json jc = last_json(c), jg = last_json(g);
        const double vs = jg["vs_cpu_rel_l2"].get<double>();
        EXPECT_LT(vs, kMoeVsCpuBound);
        EXPECT_GE(vs, 0.0);
        const double rc = jc["rel_l2"].get<double>(), rg = jg["rel_l2"].get<double>();
        EXPECT_LE(std::fabs(rg - rc), vs * (1 + rc) + 1e-9);
        EXPECT_EQ(jg["routing"], m.routing);
        EXPECT_GT(jg["gpu_routed_ms"].get<double>(), 0.0);
        if (quant == "lutb") {  // fitted at load: on the GPU with --device cuda, the same bytes
          EXPECT_EQ(jg["fit_device"], "cuda");
          EXPECT_EQ(jc["fit_device"], "cpu");
          EXPECT_EQ(jg["sqnr_db"], jc["sqnr_db"]);
        }
        std::printf("CliGpu.MoeOnCudaMatchesTheCpu: %s quant %s layer %d: rel_l2 cpu %.6g gpu %.6g, gpu vs cpu %.3g "
                    "(max_abs %.3g), routed-expert forward %.4f ms\n",
                    m.model, quant.c_str(), layer, rc, rg, vs, jg["vs_cpu_max_abs"].get<double>(),
                    jg["gpu_routed_ms"].get<double>());
      }
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

// eval --device cuda: the routed experts of every block on the GPU inside the CPU model, the LUT-B fit
// of --quant lutb on the GPU too. The two backends differ only by FP32 summation order
// (above): BF16 units flipped in a small fraction of the block outputs, which moves the loss by far
// less than the 1.3e-4..4.5e-4 relative that a BF16-against-FP32 output rounding would make.
// Measured on an H200 (4 windows): LUT-B 8.5e-7 and 1.3e-6 relative, BF16 4.9e-6 and 7.2e-6
// (one window of tiny-qwen3-moe LUT-B: 1.6e-5). Asserted within 5e-5 relative: 7x the largest 4-window value, 3x the 1-window one. The fit: the GPU fitter's bytes and FitStats are the CPU's, so every
// tensor's SQNR is equal, exactly.
TEST(CliGpu, EvalOnCudaMatchesTheCpuLoss) {
  LUTB_CLI_GPU_OR_SKIP();
  for (const char* name : {"tiny-qwen3-moe", "tiny-deepseek-v3"}) {
    LUTB_MODEL_OR_SKIP(model, name);
    for (const std::string& quant : gpu_quants()) {
      const std::string base = "eval " + q(model) + " --quant " + quant + " --max-windows 4 --json";
      const CliOut c = run(base + " --device cpu");
      ASSERT_EQ(c.code, 0);
      const CliOut g = run(base + " --device cuda");
      ASSERT_EQ(g.code, 0);
      const nlohmann::json jc = last_json(c), jg = last_json(g);
      const double lc = jc["val_loss"].get<double>(), lg = jg["val_loss"].get<double>();
      EXPECT_NEAR(lg, lc, 5e-5 * lc) << name << " " << quant;
      if (quant == "lutb") {
        EXPECT_EQ(jc["fit_device"], "cpu");
        EXPECT_EQ(jg["fit_device"], "cuda");
        EXPECT_EQ(jg["fit_weights"], jc["fit_weights"]);
        EXPECT_EQ(jg["sqnr_db"], jc["sqnr_db"]);
        ASSERT_EQ(jg["tensors"].size(), jc["tensors"].size());
        for (std::size_t i = 0; i < jc["tensors"].size(); ++i) EXPECT_EQ(jg["tensors"][i], jc["tensors"][i]);
        std::printf("CliGpu.EvalOnCudaMatchesTheCpuLoss: %s: load %.3f s (fit on cpu %.3f s) vs %.3f s (fit on cuda "
                    "%.3f s)\n",
                    name, jc["load_seconds"].get<double>(), jc["fit_seconds"].get<double>(),
                    jg["load_seconds"].get<double>(), jg["fit_seconds"].get<double>());
      }
      std::printf("CliGpu.EvalOnCudaMatchesTheCpuLoss: %s quant %s: cpu %.8f cuda %.8f (diff %.3g, relative %.3g)\n",
                  name, quant.c_str(), lc, lg, lg - lc, (lg - lc) / lc);
    }
  }
}

// GPU-fitted and CPU-fitted experts in the same GPU forward: eval --device cuda of the BF16 checkpoint
// (--quant lutb: fitted on the GPU at load) and of its LUT-B checkpoint written by quantize --device
// cpu (fitted on the CPU, stored) run the same bytes through the same kernels: equal losses, bit for
// bit.
TEST(CliGpu, EvalGpuFitEqualsStoredCpuFit) {
  LUTB_CLI_GPU_OR_SKIP();
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  test::TempDir t;
  const CliOut qz = run("quantize " + q(model) + " -o " + q(t.path / "q") + " --device cpu --no-progress");
  ASSERT_EQ(qz.code, 0);
  const CliOut online = run("eval " + q(model) + " --quant lutb --device cuda --max-windows 4 --json");
  ASSERT_EQ(online.code, 0);
  const CliOut stored = run("eval " + q(t.path / "q") + " --tokens " + q(model / "val_tokens.safetensors") +
                            " --device cuda --max-windows 4 --json");
  ASSERT_EQ(stored.code, 0);
  const nlohmann::json a = last_json(online), b = last_json(stored);
  EXPECT_EQ(a["fit_device"], "cuda");
  EXPECT_EQ(b["lutb_checkpoint"], true);
  EXPECT_EQ(a["val_loss"].get<double>(), b["val_loss"].get<double>());
  std::printf("CliGpu.EvalGpuFitEqualsStoredCpuFit: GPU-fitted %.10f, CPU-fitted stored %.10f\n",
              a["val_loss"].get<double>(), b["val_loss"].get<double>());
}

// Calibration statistics for every MoE layer of a Qwen3-MoE checkpoint (prefix
// model.layers.L.mlp.experts; sizes from its config.json): log-normal second moments spread over
// about six decades, token counts 0..200 (expert 3 of layer 1 never reached: it takes the layer's
// statistics), saved to `file`. `lutb calibrate` needs calibration tokens, which the GPU machine's
// staged data lacks; the fit sees only the column weights these give (CalibrationStats::column_weights).
void synthetic_calibration(const fs::path& model, const fs::path& file) {
  std::ifstream cf(model / "config.json");
  const nlohmann::json c = nlohmann::json::parse(cf);
  const std::int64_t E = c.contains("num_experts") ? c["num_experts"].get<std::int64_t>()
                                                   : c["num_local_experts"].get<std::int64_t>();
  const std::int64_t H = c["hidden_size"], I = c["moe_intermediate_size"];
  const int layers = c["num_hidden_layers"];
  std::mt19937 g(2025);
  std::normal_distribution<float> nd(0.0f, 1.6f);
  std::uniform_int_distribution<int> tokens(0, 200);
  CalibrationStats st;
  st.metadata["model"] = model.string();
  for (int l = 0; l < layers; ++l) {
    LayerCalibration& lc = st.layers[l];
    lc.prefix = "model.layers." + std::to_string(l) + ".mlp.experts";
    lc.experts = E;
    lc.hidden = H;
    lc.intermediate = I;
    for (std::int64_t e = 0; e < E; ++e) {
      const bool silent = l == 1 && e == 3;
      lc.tokens.push_back(silent ? 0.0f : static_cast<float>(tokens(g)));
      for (std::int64_t h = 0; h < H; ++h) lc.gate_up_x2.push_back(silent ? 0.0f : std::exp(nd(g)));
      for (std::int64_t i = 0; i < I; ++i) lc.down_x2.push_back(silent ? 0.0f : std::exp(nd(g)));
    }
  }
  st.save(file);
}

// --calibration with --device cuda: the GPU's weighted fitters write the CPU's checkpoint byte for
// byte (both fitters), and the calibrated checkpoint differs from the data-free one.
TEST(CliGpu, QuantizeCalibratedOnCudaWritesTheCpuBytes) {
  LUTB_CLI_GPU_OR_SKIP();
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  test::TempDir t;
  const fs::path stats = t.path / "stats.safetensors";
  synthetic_calibration(model, stats);
  for (const std::string fitter : {"binned-dp", "optimal"}) {
    SCOPED_TRACE(fitter);
    const std::string common = " --fitter " + fitter + " --calibration " + q(stats) + " --no-progress --json";
    const CliOut c = run("quantize " + q(model) + " -o " + q(t.path / ("cpu-" + fitter)) + " --device cpu" + common);
    ASSERT_EQ(c.code, 0);
    const CliOut g = run("quantize " + q(model) + " -o " + q(t.path / ("cuda-" + fitter)) + " --device cuda" + common);
    ASSERT_EQ(g.code, 0);
    EXPECT_EQ(last_json(g)["device"], "cuda");
    const auto a = tree(t.path / ("cpu-" + fitter)), b = tree(t.path / ("cuda-" + fitter));
    ASSERT_EQ(a.size(), b.size());
    ASSERT_GE(a.size(), 2u);
    for (const auto& [name, bytes] : a) {
      ASSERT_TRUE(b.count(name)) << name << " missing from the GPU output";
      EXPECT_TRUE(b.at(name) == bytes) << name << " differs (" << bytes.size() << " vs " << b.at(name).size() << " bytes)";
    }
    if (fitter == "binned-dp") {
      const CliOut plain = run("quantize " + q(model) + " -o " + q(t.path / "plain") + " --device cuda --no-progress");
      ASSERT_EQ(plain.code, 0);
      EXPECT_FALSE(tree(t.path / "plain").at("model.safetensors") == a.at("model.safetensors"));
    }
    std::printf("CliGpu.QuantizeCalibratedOnCudaWritesTheCpuBytes (%s): %zu files identical\n", fitter.c_str(), a.size());
  }
}

// lutb eval --quant lutb --calibration --device cuda (the calibrated fit on the GPU at load) and the
// calibrated checkpoint written by quantize --device cpu run the same bytes through the same
// kernels: equal losses, bit for bit.
TEST(CliGpu, EvalCalibratedGpuFitEqualsStoredCpuFit) {
  LUTB_CLI_GPU_OR_SKIP();
  LUTB_MODEL_OR_SKIP(model, "tiny-qwen3-moe");
  test::TempDir t;
  const fs::path stats = t.path / "stats.safetensors";
  synthetic_calibration(model, stats);
  const CliOut qz =
      run("quantize " + q(model) + " -o " + q(t.path / "q") + " --calibration " + q(stats) + " --device cpu --no-progress");
  ASSERT_EQ(qz.code, 0);
  const CliOut online = run("eval " + q(model) + " --quant lutb --calibration " + q(stats) +
                            " --device cuda --max-windows 4 --json");
  ASSERT_EQ(online.code, 0);
  const CliOut stored = run("eval " + q(t.path / "q") + " --tokens " + q(model / "val_tokens.safetensors") +
                            " --device cuda --max-windows 4 --json");
  ASSERT_EQ(stored.code, 0);
  const nlohmann::json a = last_json(online), b = last_json(stored);
  EXPECT_EQ(a["fit_device"], "cuda");
  EXPECT_EQ(a["val_loss"].get<double>(), b["val_loss"].get<double>());
  std::printf("CliGpu.EvalCalibratedGpuFitEqualsStoredCpuFit: GPU-fitted %.10f, CPU-fitted stored %.10f\n",
              a["val_loss"].get<double>(), b["val_loss"].get<double>());
}

}  // namespace
}  // namespace lutb
