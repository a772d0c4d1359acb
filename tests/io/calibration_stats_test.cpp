// Calibration statistics (lutb/calibration.hpp): the file's round trip and refusals, the column
// weights with the rule for rarely routed experts, and the tensor-name mapping of lutb quantize.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "lutb/calibration.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

// Layer 1, 3 experts, hidden 4, intermediate 2: expert 0 well calibrated (1000 tokens), expert 1
// never reached, expert 2 rarely (16 tokens); gate_up column 3 silent everywhere.
CalibrationStats small_stats() {
  CalibrationStats s;
  LayerCalibration& l = s.layers[1];
  l.prefix = "model.layers.1.mlp.experts";
  l.experts = 3;
  l.hidden = 4;
  l.intermediate = 2;
  l.gate_up_x2 = {4, 2, 2, 0, /**/ 0, 0, 0, 0, /**/ 1, 1, 6, 0};
  l.down_x2 = {1, 3, /**/ 0, 0, /**/ 2, 2};
  l.tokens = {1000, 0, 16};
  return s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(CalibrationStats, ColumnWeightsBlendRareExpertsWithTheLayer) {
  const CalibrationStats s = small_stats();
  const std::vector<float> w = s.column_weights(1, CalibratedInput::kGateUp);
  ASSERT_EQ(w.size(), 12u);
  // m_layer = (1000 * [4,2,2,0] + 16 * [1,1,6,0]) / 1016.
  const double ml[4] = {(4000.0 + 16) / 1016, (2000.0 + 16) / 1016, (2000.0 + 96) / 1016, 0.0};
  auto expect_expert = [&](int e, const double* d) {
    const double mean = (d[0] + d[1] + d[2] + d[3]) / 4;
    for (int c = 0; c < 4; ++c)
      EXPECT_FLOAT_EQ(w[static_cast<std::size_t>(e * 4 + c)], static_cast<float>(std::max(d[c] / mean, kMinRelativeWeight)))
          << "expert " << e << " column " << c;
  };
  // Expert 0: (1000 m_0 + 32 m_layer) / 1032.
  double d0[4], d1[4], d2[4];
  const double m0[4] = {4, 2, 2, 0}, m2[4] = {1, 1, 6, 0};
  for (int c = 0; c < 4; ++c) {
    d0[c] = (1000 * m0[c] + kPriorTokens * ml[c]) / (1000 + kPriorTokens);
    d1[c] = ml[c];  // never reached: the layer's statistics
    d2[c] = (16 * m2[c] + kPriorTokens * ml[c]) / (16 + kPriorTokens);
  }
  expect_expert(0, d0);
  expect_expert(1, d1);
  expect_expert(2, d2);
  for (float v : w) {
    EXPECT_TRUE(std::isfinite(v));
    EXPECT_GE(v, kMinRelativeWeight * (1 - 1e-6));
  }
  EXPECT_FLOAT_EQ(w[3], static_cast<float>(kMinRelativeWeight)) << "a silent column keeps a small positive weight";
}

TEST(CalibrationStats, ALayerNoTokenReachedFitsUnweighted) {
  CalibrationStats s = small_stats();
  s.layers[1].tokens = {0, 0, 0};
  for (float v : s.column_weights(1, CalibratedInput::kDown)) EXPECT_EQ(v, 1.0f);
  EXPECT_NE(error_of([&] { s.column_weights(2, CalibratedInput::kDown); }).find("no statistics for layer 2"),
            std::string::npos);
}

TEST(CalibrationStats, FileRoundTripAndNames) {
  test::TempDir dir;
  const auto file = dir.path / "stats.safetensors";
  CalibrationStats s = small_stats();
  s.metadata["model"] = "m";
  s.save(file);
  const SafetensorsFile f(file);
  EXPECT_EQ(f.metadata().at("format"), "lutb-calibration");
  for (const char* n : {"model.layers.1.mlp.experts.0.gate_up.x2", "model.layers.1.mlp.experts.2.down.x2",
                        "model.layers.1.mlp.experts.1.tokens"}) {
    ASSERT_TRUE(f.contains(n)) << n;
    EXPECT_EQ(f.get(n).dtype, DType::F32);
  }
  EXPECT_EQ(f.get("model.layers.1.mlp.experts.0.gate_up.x2").shape, std::vector<std::int64_t>{4});
  const CalibrationStats r = CalibrationStats::load(file);
  ASSERT_EQ(r.layers.size(), 1u);
  const LayerCalibration& l = r.layers.at(1);
  EXPECT_EQ(l.prefix, "model.layers.1.mlp.experts");
  EXPECT_EQ(l.gate_up_x2, s.layers[1].gate_up_x2);
  EXPECT_EQ(l.down_x2, s.layers[1].down_x2);
  EXPECT_EQ(l.tokens, s.layers[1].tokens);
  EXPECT_EQ(r.metadata.at("model"), "m");
  EXPECT_EQ(r.source, file.string());
}

TEST(CalibrationStats, BadFilesAreRefusedByName) {
  test::TempDir dir;
  const auto file = dir.path / "bad.safetensors";
  auto f32 = [](std::vector<float> v) {
    OwnedTensor t{DType::F32, {static_cast<std::int64_t>(v.size())}, std::vector<std::uint8_t>(v.size() * 4)};
    std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
    return t;
  };
  write_safetensors(file, {{"model.layers.1.mlp.experts.0.gate_up.x2", f32({1, -2})},
                           {"model.layers.1.mlp.experts.0.down.x2", f32({1})},
                           {"model.layers.1.mlp.experts.0.tokens", f32({3})}});
  std::string msg = error_of([&] { CalibrationStats::load(file); });
  EXPECT_NE(msg.find("tensor model.layers.1.mlp.experts.0.gate_up.x2 holds -2 at [1]"), std::string::npos) << msg;
  write_safetensors(file, {{"model.layers.1.mlp.experts.0.gate_up.x2", f32({1, 2})},
                           {"model.layers.1.mlp.experts.0.tokens", f32({3})}});
  msg = error_of([&] { CalibrationStats::load(file); });
  EXPECT_NE(msg.find("lacks tensor model.layers.1.mlp.experts.0.down.x2"), std::string::npos) << msg;
  write_safetensors(file, {{"lm_head.weight", f32({1})}});
  msg = error_of([&] { CalibrationStats::load(file); });
  EXPECT_NE(msg.find("tensor lm_head.weight is not a calibration statistic"), std::string::npos) << msg;
}

TEST(CalibrationStats, WeightsForCheckpointTensorsByName) {
  const CalibrationStats s = small_stats();
  const std::vector<float> gu = s.column_weights(1, CalibratedInput::kGateUp);
  const std::vector<float> dn = s.column_weights(1, CalibratedInput::kDown);
  auto w = s.weights_for_tensor("model.layers.1.mlp.experts.2.up_proj.weight", 1, 4, "S");
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(*w, std::vector<float>(gu.begin() + 8, gu.end()));
  w = s.weights_for_tensor("model.layers.1.mlp.experts.1.w2.weight", 1, 2, "S");
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(*w, std::vector<float>(dn.begin() + 2, dn.begin() + 4));
  w = s.weights_for_tensor("model.layers.1.mlp.experts.down_proj", 3, 2, "S");  // stacked
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(*w, dn);
  EXPECT_FALSE(s.weights_for_tensor("model.layers.2.mlp.experts.0.up_proj.weight", 1, 4, "S").has_value());
  const std::string msg = error_of([&] { s.weights_for_tensor("model.layers.1.mlp.experts.0.gate_proj.weight", 1, 8, "S"); });
  EXPECT_NE(msg.find("S: tensor model.layers.1.mlp.experts.0.gate_proj.weight is fitted as 1 expert(s) x 8 columns"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace lutb
