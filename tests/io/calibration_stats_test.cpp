// Calibration statistics (lutb/calibration.hpp): the file's round trip and refusals, the column
// weights with the rule for rarely routed experts, and the tensor-name mapping of lutb quantize.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
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
  // A file without the "format" metadata is read by its tensor names; one that matches none is named
  // with the pattern of lutb/calibration.hpp.
  write_safetensors(file, {{"lm_head.weight", f32({1})}});
  msg = error_of([&] { CalibrationStats::load(file); });
  EXPECT_EQ(msg, file.string() + ": tensor lm_head.weight is not a calibration statistic (expected "
                                 "PREFIX.e.gate_up.x2, PREFIX.e.down.x2 or PREFIX.e.tokens, with PREFIX the experts' "
                                 "prefix such as model.layers.L.mlp.experts and e the expert; lutb/calibration.hpp), "
                                 "and its metadata has no \"format\": \"lutb-calibration\": it is not a statistics "
                                 "file of lutb calibrate")
      << msg;
  // A file of another kind ("format" "pt": transformers' weights) is named as such, whatever it holds.
  write_safetensors(file, {{"model.layers.1.mlp.experts.0.gate_up.x2", f32({1, 2})}}, {{"format", "pt"}});
  msg = error_of([&] { CalibrationStats::load(file); });
  EXPECT_EQ(msg, file.string() + ": not a statistics file of lutb calibrate (its metadata \"format\" is \"pt\", not "
                                 "\"lutb-calibration\"); give the file that lutb calibrate -o wrote")
      << msg;
}

// save() writes only finite, non-negative statistics of consistent sizes: the first bad value is named
// by layer, prefix, expert, projection and column, and no file is created (the second line of defence
// behind lutb calibrate's check of the weights: a NaN outside the routed experts reaches the statistics).
TEST(CalibrationStats, NonFiniteStatisticsAreNeverWritten) {
  test::TempDir dir;
  const auto file = dir.path / "stats.safetensors";
  const std::string head = file.string() + ": the calibration statistics of layer 1 (model.layers.1.mlp.experts), ";
  struct Case {
    std::function<void(LayerCalibration&)> edit;
    std::string expect;
  } cases[] = {
      {[](LayerCalibration& l) { l.gate_up_x2[2 * 4 + 1] = std::nanf(""); }, "expert 2, gate_up.x2 column 1 is NaN"},
      {[](LayerCalibration& l) { l.down_x2[1] = INFINITY; }, "expert 0, down.x2 column 1 is +Inf"},
      {[](LayerCalibration& l) { l.down_x2[5] = -INFINITY; }, "expert 2, down.x2 column 1 is -Inf"},
      {[](LayerCalibration& l) { l.tokens[1] = -1; }, "expert 1, tokens is -1"},
  };
  for (const auto& c : cases) {
    CalibrationStats s = small_stats();
    c.edit(s.layers[1]);
    const std::string msg = error_of([&] { s.save(file); });
    EXPECT_EQ(msg, head + c.expect + "; statistics are finite and >= 0; nothing written");
    EXPECT_EQ(error_of([&] { s.check(); }), head.substr(file.string().size() + 2) + c.expect +
                                                "; statistics are finite and >= 0");
    EXPECT_FALSE(std::filesystem::exists(file));
  }
  CalibrationStats s = small_stats();
  s.layers[1].down_x2.pop_back();
  EXPECT_EQ(error_of([&] { s.save(file); }),
            head + "down.x2 holds 5 values, expected experts x intermediate = 3 x 2; nothing written");
  EXPECT_TRUE(std::filesystem::is_empty(dir.path));
}

// A write that fails names the file asked for, not the writer's temporary name.
TEST(CalibrationStats, AFailedWriteNamesTheFile) {
  test::TempDir dir;
  const auto file = dir.path / "missing" / "stats.safetensors";
  const std::string msg = error_of([&] { small_stats().save(file); });
  EXPECT_EQ(msg.rfind(file.string() + ": cannot write the calibration statistics (cannot create: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
  EXPECT_NE(msg.find("; nothing was created at " + file.string()), std::string::npos) << msg;
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
