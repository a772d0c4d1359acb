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

using test::error_of;

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

// small_stats() with full second moments: expert e's gate_up.xxT [4][4] and down.hhT [2][2] hold
// (e + 1) * (i + 1) * (j + 1) / 10 off the diagonal and x2 on it (its diagonal is its x2).
CalibrationStats full_stats() {
  CalibrationStats s = small_stats();
  LayerCalibration& l = s.layers[1];
  l.full_moments = true;
  for (const bool gu : {true, false}) {
    const int K = gu ? 4 : 2;
    std::vector<float>& m = gu ? l.gate_up_xxT : l.down_hhT;
    const std::vector<float>& x2 = gu ? l.gate_up_x2 : l.down_x2;
    for (int e = 0; e < 3; ++e)
      for (int i = 0; i < K; ++i)
        for (int j = 0; j < K; ++j)
          m.push_back(i == j ? x2[static_cast<std::size_t>(e * K + i)] : 0.1f * (e + 1) * (i + 1) * (j + 1));
  }
  return s;
}

// The full moments: written as [K, K] tensors, read back a layer at a time, blended with the layer by
// token count as the diagonal is (an expert no token reaches takes the layer's moments).
TEST(CalibrationStats, FullMomentsRoundTripAndBlend) {
  test::TempDir dir;
  const auto file = dir.path / "full.safetensors";
  const CalibrationStats s = full_stats();
  EXPECT_TRUE(s.has_second_moments());
  EXPECT_FALSE(small_stats().has_second_moments());
  s.save(file);
  const SafetensorsFile f(file);
  EXPECT_EQ(f.get("model.layers.1.mlp.experts.2.gate_up.xxT").shape, (std::vector<std::int64_t>{4, 4}));
  EXPECT_EQ(f.get("model.layers.1.mlp.experts.0.down.hhT").shape, (std::vector<std::int64_t>{2, 2}));
  const CalibrationStats r = CalibrationStats::load(file);
  EXPECT_TRUE(r.has_second_moments());
  EXPECT_TRUE(r.layers.at(1).gate_up_xxT.empty());  // read when a fit asks for them
  for (const CalibrationStats* st : {&s, &r}) {
    const std::vector<float> c = st->second_moments(1, CalibratedInput::kGateUp, 0, 3);
    ASSERT_EQ(c.size(), 48u);
    const std::vector<float>& m = s.layers.at(1).gate_up_xxT;
    for (int i = 0; i < 16; ++i) {
      // M_layer = (1000 M_0 + 16 M_2) / 1016; C_e = (n_e M_e + 32 M_layer) / (n_e + 32).
      const double ml = (1000.0 * m[static_cast<std::size_t>(i)] + 16.0 * m[static_cast<std::size_t>(32 + i)]) / 1016;
      EXPECT_FLOAT_EQ(c[static_cast<std::size_t>(i)],
                      static_cast<float>((1000.0 * m[static_cast<std::size_t>(i)] + kPriorTokens * ml) / 1032));
      EXPECT_FLOAT_EQ(c[static_cast<std::size_t>(16 + i)], static_cast<float>(ml)) << i;  // never reached
      EXPECT_FLOAT_EQ(c[static_cast<std::size_t>(32 + i)],
                      static_cast<float>((16.0 * m[static_cast<std::size_t>(32 + i)] + kPriorTokens * ml) / 48));
    }
    // By tensor name, one expert of a per-expert checkpoint.
    const auto one = st->second_moments_for_tensor("model.layers.1.mlp.experts.1.down_proj.weight", 1, 2, "S");
    ASSERT_TRUE(one.has_value());
    const std::vector<float> all = st->second_moments(1, CalibratedInput::kDown, 0, 3);
    EXPECT_EQ(*one, std::vector<float>(all.begin() + 4, all.begin() + 8));
    // A per-expert checkpoint's tensors with one cache: the same values, the layer mean computed once
    // (a cache that holds another mean for the layer is used as it is, not recomputed).
    SecondMomentsCache cache;
    for (int e = 0; e < 3; ++e) {
      const auto c1 = st->second_moments_for_tensor(
          "model.layers.1.mlp.experts." + std::to_string(e) + ".down_proj.weight", 1, 2, "S", &cache);
      ASSERT_TRUE(c1.has_value());
      EXPECT_EQ(*c1, std::vector<float>(all.begin() + 4 * e, all.begin() + 4 * e + 4)) << e;
      EXPECT_EQ(cache.layer, 1);
      EXPECT_EQ(cache.input, CalibratedInput::kDown);
      EXPECT_DOUBLE_EQ(cache.n_total, 1016.0);
    }
    const std::vector<double> mean = cache.mean;
    for (auto& v : cache.mean) v = 0.0;
    const std::vector<float> no_prior = st->second_moments(1, CalibratedInput::kDown, 0, 1, &cache);
    for (int i = 0; i < 4; ++i)
      EXPECT_FLOAT_EQ(no_prior[static_cast<std::size_t>(i)],
                      static_cast<float>(1000.0 * s.layers.at(1).down_hhT[static_cast<std::size_t>(i)] / 1032));
    // Another input replaces the cached mean.
    EXPECT_EQ(st->second_moments(1, CalibratedInput::kGateUp, 0, 3, &cache), c);
    EXPECT_EQ(cache.input, CalibratedInput::kGateUp);
    EXPECT_EQ(cache.mean.size(), 16u);
    EXPECT_NE(mean.size(), cache.mean.size());
  }
  // A layer no token reached gives zeros (quantize then fits without feedback).
  CalibrationStats z = full_stats();
  z.layers[1].tokens = {0, 0, 0};
  for (const float v : z.second_moments(1, CalibratedInput::kDown, 0, 3)) EXPECT_EQ(v, 0.0f);
  // Statistics without them say so.
  EXPECT_EQ(error_of([] { small_stats().second_moments(1, CalibratedInput::kDown, 0, 3); }),
            "calibration statistics: layer 1 (model.layers.1.mlp.experts) has no full second moments "
            "(PREFIX.e.down.hhT; lutb calibrate --full-moments stores them)");
}

TEST(CalibrationStats, BadFullMomentsAreRefusedByName) {
  test::TempDir dir;
  const auto good = dir.path / "good.safetensors", file = dir.path / "bad.safetensors";
  full_stats().save(good);
  // Rewrites the good file with tensor `name` replaced (or dropped when `t` has no bytes).
  const auto rewrite = [&](const std::string& name, const OwnedTensor& t) {
    const SafetensorsFile g(good);
    std::vector<std::pair<std::string, OwnedTensor>> ts;
    for (const auto& n : g.names()) {
      const TensorView& v = g.get(n);
      if (n == name) {
        if (!t.bytes.empty()) ts.emplace_back(n, t);
        continue;
      }
      ts.emplace_back(n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)});
    }
    write_safetensors(file, ts, g.metadata());
  };
  const std::string name = "model.layers.1.mlp.experts.2.gate_up.xxT";
  rewrite(name, OwnedTensor{DType::F32, {16}, std::vector<std::uint8_t>(64)});
  EXPECT_EQ(error_of([&] { CalibrationStats::load(file); }),
            file.string() + ": tensor " + name + " has shape [16], expected [4, 4] (the 4 columns of the expert's "
                                                 "gate_up.x2)");
  rewrite(name, OwnedTensor{DType::F16, {4, 4}, std::vector<std::uint8_t>(32)});
  EXPECT_EQ(error_of([&] { CalibrationStats::load(file); }),
            file.string() + ": tensor " + name + " has dtype F16; calibration statistics are F32");
  rewrite(name, OwnedTensor{});
  EXPECT_EQ(error_of([&] { CalibrationStats::load(file); }),
            file.string() + ": layer 1 (model.layers.1.mlp.experts) lacks tensor " + name +
                " (the full second moments are stored for every expert of a layer or for none)");
  // A NaN is found when a fit reads the layer, named by file, tensor and position.
  std::vector<float> v(16, 0.5f);
  v[6] = NAN;
  OwnedTensor nan{DType::F32, {4, 4}, std::vector<std::uint8_t>(64)};
  std::memcpy(nan.bytes.data(), v.data(), 64);
  rewrite(name, nan);
  const CalibrationStats r = CalibrationStats::load(file);
  EXPECT_EQ(error_of([&] { r.second_moments(1, CalibratedInput::kGateUp, 0, 1); }),
            file.string() + ": tensor " + name + " holds NaN at [1, 2]; second moments are finite with a diagonal >= 0");
  // save() refuses them too, naming the expert and the position.
  CalibrationStats s = full_stats();
  s.layers[1].down_hhT[4 + 1] = -INFINITY;
  const std::string msg = error_of([&] { s.save(file); });
  EXPECT_NE(msg.find("layer 1 (model.layers.1.mlp.experts), expert 1, down.hhT [0][1] is -Inf"), std::string::npos)
      << msg;
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
                                 "PREFIX.e.gate_up.x2, PREFIX.e.down.x2, PREFIX.e.tokens, PREFIX.e.gate_up.xxT or "
                                 "PREFIX.e.down.hhT, with PREFIX the experts' prefix such as model.layers.L.mlp.experts and e the expert; lutb/calibration.hpp), "
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
