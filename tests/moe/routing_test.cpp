// Routers (spec section 5): the DeepSeek-V3 golden cases, softmax top-k against an independent
// double-precision computation, ties, validation errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "lutb/moe.hpp"
#include "support/test_support.hpp"

namespace lutb::moe {
namespace {

TEST(Routing, DeepSeekV3Golden) {
  LUTB_GOLDEN_OR_SKIP(g, "deepseek_routing.json");
  ASSERT_FALSE(g["cases"].empty());
  int n = 0;
  for (const auto& c : g["cases"]) {
    RouterConfig rc;
    rc.scoring = ScoringFunc::Sigmoid;
    rc.num_experts = static_cast<int>(c["logits"].size());
    rc.top_k = c["top_k"];
    rc.n_group = c["n_group"];
    rc.topk_group = c["topk_group"];
    rc.norm_topk_prob = c["norm_topk_prob"];
    rc.routed_scaling_factor = c["routed_scaling_factor"].get<float>();
    std::vector<float> logits, bias;
    for (const auto& v : c["logits"]) logits.push_back(lutb::test::f32_hex(v.get<std::string>()));
    for (const auto& v : c["e_score_correction_bias"]) bias.push_back(lutb::test::f32_hex(v.get<std::string>()));
    const Routing r = route(rc, logits, 1, bias.data());
    for (int j = 0; j < rc.top_k; ++j) {
      EXPECT_EQ(r.ids[j], c["expert_ids"][j].get<int>()) << "case " << n << " slot " << j;
      const double want = std::stod(c["weights"][j].get<std::string>());
      EXPECT_NEAR(r.weights[j], want, 1e-6 * std::abs(want)) << "case " << n << " slot " << j;
    }
    ++n;
  }
}

// Independent softmax top-k in double.
void softmax_topk_double(const std::vector<float>& l, int k, bool norm, std::vector<int>& ids, std::vector<double>& w) {
  const int E = static_cast<int>(l.size());
  const double mx = *std::max_element(l.begin(), l.end());
  std::vector<double> p(E);
  double s = 0;
  for (int e = 0; e < E; ++e) s += (p[e] = std::exp(double(l[e]) - mx));
  for (auto& v : p) v /= s;
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
  ids.assign(order.begin(), order.begin() + k);
  double sk = 0;
  for (int id : ids) sk += p[id];
  w.clear();
  for (int id : ids) w.push_back(norm ? p[id] / sk : p[id]);
}

TEST(Routing, SoftmaxTopKMatchesDouble) {
  std::mt19937 rng(9);
  std::normal_distribution<float> d(0.0f, 2.0f);
  for (bool norm : {true, false})
    for (int trial = 0; trial < 50; ++trial) {
      RouterConfig rc;
      rc.num_experts = 8 + trial % 57;
      rc.top_k = 1 + trial % 8;
      rc.norm_topk_prob = norm;
      std::vector<float> l(rc.num_experts);
      for (auto& v : l) v = d(rng);
      const Routing r = route(rc, l, 1);
      std::vector<int> ids;
      std::vector<double> w;
      softmax_topk_double(l, rc.top_k, norm, ids, w);
      double sum = 0;
      for (int j = 0; j < rc.top_k; ++j) {
        EXPECT_EQ(r.ids[j], ids[j]);
        EXPECT_NEAR(r.weights[j], w[j], 1e-6 * w[j]);
        sum += r.weights[j];
      }
      if (norm) EXPECT_NEAR(sum, 1.0, 1e-6);
      else EXPECT_LT(sum, 1.0 + 1e-6);
    }
}

TEST(Routing, TiesGoToTheLowerExpert) {
  RouterConfig rc;
  rc.num_experts = 6;
  rc.top_k = 3;
  std::vector<float> l = {0.5f, 1.0f, 0.5f, 1.0f, 0.25f, 1.0f};
  const Routing r = route(rc, l, 1);
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{1, 3, 5}));
  for (float w : r.weights) EXPECT_FLOAT_EQ(w, 1.0f / 3.0f);
  rc.top_k = 4;
  EXPECT_EQ(route(rc, l, 1).ids, (std::vector<std::int32_t>{1, 3, 5, 0}));
  // Sigmoid with groups: equal groups -> the lower group; NaN never beats a number.
  RouterConfig ds;
  ds.scoring = ScoringFunc::Sigmoid;
  ds.num_experts = 8;
  ds.n_group = 4;
  ds.topk_group = 1;
  ds.top_k = 2;
  std::vector<float> z(8, 0.0f);
  EXPECT_EQ(route(ds, z, 1).ids, (std::vector<std::int32_t>{0, 1}));
  z[0] = std::nanf("");
  z[6] = 3.0f;
  z[7] = 3.0f;
  EXPECT_EQ(route(ds, z, 1).ids, (std::vector<std::int32_t>{6, 7}));
}

TEST(Routing, SigmoidGroupedByHand) {
  // 8 experts, 2 groups of 4, keep 1 group, top-2; the bias moves the choice but not the weights.
  RouterConfig rc;
  rc.scoring = ScoringFunc::Sigmoid;
  rc.num_experts = 8;
  rc.n_group = 2;
  rc.topk_group = 1;
  rc.top_k = 2;
  rc.norm_topk_prob = false;
  rc.routed_scaling_factor = 2.0f;
  std::vector<float> l = {3.0f, -1.0f, -1.0f, -1.0f, 1.0f, 1.0f, 0.0f, 0.0f};
  // Group 0: top-2 = s(3)+s(-1) = 0.9526+0.2689 = 1.2215; group 1: s(1)+s(1) = 1.4621 -> group 1.
  Routing r = route(rc, l, 1);
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{4, 5}));
  const float s1 = 1.0f / (1.0f + std::exp(-1.0f));
  EXPECT_FLOAT_EQ(r.weights[0], 2.0f * s1);
  std::vector<float> bias(8, 0.0f);
  bias[7] = 0.6f;  // s(0) + 0.6 = 1.1 > s(1): expert 7 first; weight stays plain s(0) = 0.5
  r = route(rc, l, 1, bias.data());
  EXPECT_EQ(r.ids, (std::vector<std::int32_t>{7, 4}));
  EXPECT_FLOAT_EQ(r.weights[0], 2.0f * 0.5f);
}

TEST(Routing, ConfigErrors) {
  RouterConfig rc;
  rc.num_experts = 8;
  rc.top_k = 9;
  EXPECT_THROW(rc.validate(), std::invalid_argument);
  rc.top_k = 2;
  rc.n_group = 3;
  EXPECT_THROW(rc.validate(), std::invalid_argument);
  rc.n_group = 4;
  rc.topk_group = 1;
  rc.top_k = 3;  // only 2 experts in the one kept group
  EXPECT_THROW(rc.validate(), std::invalid_argument);
  std::vector<float> l(7);
  rc.top_k = 2;
  EXPECT_THROW(route(rc, l, 1), std::invalid_argument);  // logits size
}

TEST(Routing, RouterLogitsBf16) {
  const std::vector<std::uint16_t> x = {bf16_from_float(1.0f), bf16_from_float(2.0f)};
  const std::vector<std::uint16_t> w = {bf16_from_float(0.5f), bf16_from_float(0.25f),
                                        bf16_from_float(1.0f / 3.0f), bf16_from_float(0.0f)};
  std::vector<float> out(2);
  router_logits_bf16(x.data(), w.data(), 1, 2, 2, false, out.data());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], bf16_to_float(bf16_from_float(1.0f / 3.0f)));
  router_logits_bf16(x.data(), w.data(), 1, 2, 2, true, out.data());
  EXPECT_EQ(out[1], bf16_round(bf16_to_float(bf16_from_float(1.0f / 3.0f))));
}

}  // namespace
}  // namespace lutb::moe
