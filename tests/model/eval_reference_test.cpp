// THE forward-pass test: `lutb eval --quant none` reproduces transformers' held-out loss
// (val_loss_fp32_compute of reference_eval.json) within 0.005 nats for every shared model.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "support/cli_support.hpp"

using namespace lutb::test;

namespace {

void check_reference(const std::string& name) {
  LUTB_MODEL_OR_SKIP(dir, name);
  std::ifstream in(dir / "reference_eval.json");
  if (!in) GTEST_SKIP() << name << ": reference_eval.json absent";
  const nlohmann::json ref = nlohmann::json::parse(in);
  const CliResult r = run_cli("eval " + q(dir) + " --quant none --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = r.json();
  EXPECT_EQ(j["quant"], "none");
  EXPECT_EQ(j["activations"], "bf16");
  EXPECT_EQ(j["windows"].get<std::int64_t>(), ref["windows"].get<std::int64_t>());
  EXPECT_EQ(j["tokens"].get<std::int64_t>(), ref["predicted_tokens"].get<std::int64_t>());
  EXPECT_DOUBLE_EQ(j["bits_per_weight"].get<double>(), 16.0);
  EXPECT_TRUE(j["sqnr_db"].is_null());
  const double want = ref["val_loss_fp32_compute"].get<double>();
  const double got = j["val_loss"].get<double>();
  EXPECT_NEAR(got, want, 0.005) << name << ": lutb " << got << " vs transformers " << want;
  std::printf("[ model ] %s: val_loss %.6f, transformers fp32 %.6f, diff %+.2e\n", name.c_str(), got, want, got - want);
}

}  // namespace

TEST(ModelEvalReference, TinyQwen3Moe) { check_reference("tiny-qwen3-moe"); }
TEST(ModelEvalReference, TinyMixtral) { check_reference("tiny-mixtral"); }
TEST(ModelEvalReference, TinyDeepseekV3) { check_reference("tiny-deepseek-v3"); }
