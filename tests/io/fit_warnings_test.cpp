// Warnings of the fit: low SQNR, and the unscaled fitters (ct-lloyd, multistart) that lose tiny
// weights.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

// An F32 file of one tensor scaled by `scale` (16 x 64, standard normal before scaling).
void write_scaled(const fs::path& file, float scale) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  OwnedTensor o{DType::F32, {16, 64}, std::vector<std::uint8_t>(16 * 64 * 4)};
  for (int i = 0; i < 16 * 64; ++i) {
    const float v = nd(rng) * scale;
    std::memcpy(o.bytes.data() + 4 * i, &v, 4);
  }
  write_safetensors(file, {{"w", o}});
}

// ct-lloyd / multistart fit no tile scale: weights of magnitude 1e-30 quantise to zero (0 dB), and lutb
// quantize warns, naming the scaled fitters that keep them (binned-dp, optimal).
TEST(FitWarnings, QuantizeWarnsWhenAnUnscaledFitterLosesTheTensor) {
  TempDir t;
  const fs::path in = t.path / "in.safetensors";
  write_scaled(in, 1e-30f);
  test::CliResult r = test::run_cli("quantize " + test::q(in) + " -o " + test::q(t.path / "o.safetensors") +
                                    " --fitter ct-lloyd --no-progress --threads 1");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("lutb: warning: " + in.string() + ": tensor w: SQNR 0.00 dB with ct-lloyd"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("the scaled fitters binned-dp (the default) and optimal fit them"), std::string::npos) << r.err;
  r = test::run_cli("quantize " + test::q(in) + " -o " + test::q(t.path / "b.safetensors") + " --no-progress --threads 1");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
}

// The same warning through `lutb moe --quant lutb --fitter ct-lloyd` (the online fit of a BF16 checkpoint).
TEST(FitWarnings, MoeWarnsWhenAnUnscaledFitterLosesTheExperts) {
  TempDir t;
  const fs::path ck = t.path / "ck";
  synthesize_checkpoint(ck, test::synth_options(64, 64, 4));
  {  // the routed experts scaled by 1e-30 (exact in BF16's FP32 exponent range)
    const fs::path file = ck / "model.safetensors";
    std::vector<std::pair<std::string, OwnedTensor>> out;
    {
      const SafetensorsFile f(file);
      for (const auto& n : f.names()) {
        const TensorView& v = f.get(n);
        OwnedTensor o{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)};
        if (n.find(".experts.") != std::string::npos) {
          ASSERT_EQ(v.dtype, DType::BF16);
          for (std::size_t i = 0; i < o.bytes.size(); i += 2) {
            std::uint16_t h;
            std::memcpy(&h, o.bytes.data() + i, 2);
            h = bf16_from_float(bf16_to_float(h) * 1e-30f);
            std::memcpy(o.bytes.data() + i, &h, 2);
          }
        }
        out.push_back({n, std::move(o)});
      }
    }
    write_safetensors(file, out);
  }
  const fs::path acts = t.path / "acts.safetensors";
  {
    OwnedTensor x{DType::F32, {4, 64}, std::vector<std::uint8_t>(4 * 64 * 4)};
    for (int i = 0; i < 4 * 64; ++i) {
      const float v = static_cast<float>((i * 37) % 11) - 5.0f;
      std::memcpy(x.bytes.data() + 4 * i, &v, 4);
    }
    write_safetensors(acts, {{"layers.0.moe_input", x}, {"layers.0.moe_output", x}});
  }
  const std::string base = "moe " + test::q(ck) + " --layer 0 --activations " + test::q(acts) + " --threads 1 --quant lutb";
  test::CliResult r = test::run_cli(base + " --fitter ct-lloyd");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("lutb: warning: layer 0: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(": SQNR 0.00 dB with ct-lloyd"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("ct-lloyd fits no tile scale"), std::string::npos) << r.err;
  r = test::run_cli(base);  // binned-dp scales each tile: no warning
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
}

// low_sqnr_warning warns when the quantised tensor keeps less than half of the weights' energy (SQNR at most
// 3.01 dB), giving the reason and the way out; no energy, or an exact fit, gives no warning.
TEST(FitWarnings, LowSqnrWarningRule) {
  // 0 dB (an all-zero reconstruction) with an upstream fitter: the reason and the way out.
  const std::string w = low_sqnr_warning("f: tensor t", 4.0, 4.0, 4, "ct-lloyd");
  EXPECT_EQ(w, "f: tensor t: SQNR 0.00 dB with ct-lloyd: the quantised tensor kept less than half of the weights' "
               "energy (typical fits keep 13-15 dB); ct-lloyd fits no tile scale (scale byte 127, spec 2.1), so its "
               "codebook holds only magnitudes 2^-9..448 and weights far outside them are lost (this tensor's RMS "
               "is 1); the scaled fitters binned-dp (the default) and optimal fit them");
  // The boundary: sse = sum_sq / 2 (3.01 dB) warns, just below it does not.
  EXPECT_NE(low_sqnr_warning("t", 0.5, 1.0, 1, "binned-dp").find("SQNR 3.01 dB with binned-dp"), std::string::npos);
  EXPECT_EQ(low_sqnr_warning("t", 0.499, 1.0, 1, "binned-dp"), "");
  // Another method: no fitter-specific clause.
  EXPECT_EQ(low_sqnr_warning("t", 1.0, 1.0, 1, "int3-g128").find("tile scale"), std::string::npos);
  // No energy (an all-zero tensor) or an exact fit: nothing to warn about.
  EXPECT_EQ(low_sqnr_warning("t", 0.0, 0.0, 1, "ct-lloyd"), "");
  EXPECT_EQ(low_sqnr_warning("t", 0.0, 1.0, 1, "ct-lloyd"), "");
}

// ct-lloyd and multistart fit no tile scale: on weights of magnitude 1e-30 every tile quantises to zero (0
// dB), and the summary warns; binned-dp fits the same tensor at about 15 dB.
TEST(FitWarnings, UnscaledFittersWarnOnTinyWeights) {
  TempDir t;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto tensor = [&](float scale) {
    OwnedTensor o{DType::F32, {16, 64}, std::vector<std::uint8_t>(16 * 64 * 4)};
    for (int i = 0; i < 16 * 64; ++i) {
      const float v = nd(rng) * scale;
      std::memcpy(o.bytes.data() + 4 * i, &v, 4);
    }
    return o;
  };
  const fs::path in = t.path / "w.safetensors";
  write_safetensors(in, {{"tiny", tensor(1e-30f)}, {"unit", tensor(0.02f)}});
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  for (const char* fitter : {"ct-lloyd", "multistart"}) {
    SCOPED_TRACE(fitter);
    q.fit.fitter = fitter;
    q.force = true;
    const QuantizeSummary s = quantize_file(in, t.path / "o.safetensors", "", q);
    ASSERT_EQ(s.warnings.size(), 1u);
    EXPECT_EQ(s.warnings[0].rfind(in.string() + ": tensor tiny: SQNR 0.00 dB with " + fitter + ":", 0), 0u)
        << s.warnings[0];
    EXPECT_NE(s.warnings[0].find("fits no tile scale"), std::string::npos) << s.warnings[0];
  }
  q.fit.fitter = "binned-dp";
  const QuantizeSummary s = quantize_file(in, t.path / "o.safetensors", "", q);
  EXPECT_TRUE(s.warnings.empty()) << s.warnings.front();
  EXPECT_GT(s.stats.sqnr_db(), 10.0);
}

}  // namespace
}  // namespace lutb
