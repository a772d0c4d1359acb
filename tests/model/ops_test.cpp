// Building blocks of the forward pass against hand-computed values and a naive double-precision
// attention written from the definition.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "lutb/model.hpp"

using namespace lutb::model;

TEST(ModelOps, RmsNormHandComputed) {
  // x = [3, 4]: mean square 12.5, rms sqrt(12.5) = 3.5355339; w = [1, 2].
  const float x[] = {3, 4, 0, 0};
  const float w[] = {1, 2};
  float y[4];
  rms_norm(x, w, y, 2, 2, 0.0f);
  EXPECT_NEAR(y[0], 3 / std::sqrt(12.5), 1e-6);
  EXPECT_NEAR(y[1], 2 * 4 / std::sqrt(12.5), 1e-6);
  // eps keeps an all-zero row finite: 0 * 1/sqrt(eps) = 0
  rms_norm(x + 2, w, y + 2, 1, 2, 1e-6f);
  EXPECT_EQ(y[2], 0.0f);
  EXPECT_EQ(y[3], 0.0f);
  // eps enters under the root: x = [1, 1], eps = 3 -> 1/sqrt(1 + 3) = 0.5
  const float ones[] = {1, 1};
  const float wone[] = {1, 1};
  rms_norm(ones, wone, y, 1, 2, 3.0f);
  EXPECT_FLOAT_EQ(y[0], 0.5f);
}

TEST(ModelOps, RopeTableDefaultLinearYarn) {
  RopeConfig r;
  r.dim = 4;
  r.theta = 10000;
  RopeTable t = make_rope_table(r);
  ASSERT_EQ(t.inv_freq.size(), 2u);
  EXPECT_FLOAT_EQ(t.inv_freq[0], 1.0f);
  EXPECT_FLOAT_EQ(t.inv_freq[1], 0.01f);  // 10000^(-2/4)
  EXPECT_EQ(t.attention_scaling, 1.0f);
  r.type = "linear";
  r.factor = 4;
  t = make_rope_table(r);
  EXPECT_FLOAT_EQ(t.inv_freq[0], 0.25f);
  EXPECT_FLOAT_EQ(t.inv_freq[1], 0.0025f);
  // yarn attention factor: 0.1 ln(factor) + 1 by default; mscale/mscale_all_dim ratio when both set
  r.type = "yarn";
  r.original_max_position = 4096;
  t = make_rope_table(r);
  EXPECT_NEAR(t.attention_scaling, 0.1 * std::log(4.0) + 1.0, 1e-6);
  r.mscale = 1;
  r.mscale_all_dim = 1;
  t = make_rope_table(r);
  EXPECT_FLOAT_EQ(t.attention_scaling, 1.0f);
  // yarn frequencies lie between the interpolated and the extrapolated ones
  r.dim = 64;
  t = make_rope_table(r);
  for (int i = 0; i < 32; ++i) {
    const double ext = std::pow(10000.0, -2.0 * i / 64), inter = ext / 4;
    EXPECT_LE(t.inv_freq[i], ext * (1 + 1e-6));
    EXPECT_GE(t.inv_freq[i], inter * (1 - 1e-6));
  }
  EXPECT_NEAR(t.inv_freq[0], 1.0, 1e-6);              // highest frequency: extrapolated
  EXPECT_NEAR(t.inv_freq[31], std::pow(10000.0, -62.0 / 64) / 4, 1e-9);  // lowest: interpolated
  r.type = "dynamic";
  EXPECT_THROW(make_rope_table(r), ModelError);
}

TEST(ModelOps, RopeRotateHalfAndInterleaved) {
  RopeConfig r;
  r.dim = 4;
  const RopeTable t = make_rope_table(r);  // inv_freq = [1, 0.01]
  const std::int32_t pos[] = {0, 1};
  // rotate_half: pairs (0, 2) and (1, 3)
  std::vector<float> x = {1, 2, 3, 4, /* t=1 */ 1, 0, 0, 1};
  apply_rope(x.data(), 2, pos, 1, 4, 4, 0, t, false);
  EXPECT_FLOAT_EQ(x[0], 1);  // position 0 is the identity
  EXPECT_FLOAT_EQ(x[3], 4);
  EXPECT_NEAR(x[4], std::cos(1.0), 1e-6);   // x0 c - x2 s
  EXPECT_NEAR(x[6], std::sin(1.0), 1e-6);   // x2 c + x0 s
  EXPECT_NEAR(x[5], -std::sin(0.01), 1e-6); // x1 c - x3 s
  EXPECT_NEAR(x[7], std::cos(0.01), 1e-6);  // x3 c + x1 s
  // interleaved: pairs (0, 1) and (2, 3)
  std::vector<float> y = {1, 0, 0, 1};
  const std::int32_t p1[] = {1};
  apply_rope(y.data(), 1, p1, 1, 4, 4, 0, t, true);
  EXPECT_NEAR(y[0], std::cos(1.0), 1e-6);
  EXPECT_NEAR(y[1], std::sin(1.0), 1e-6);
  EXPECT_NEAR(y[2], -std::sin(0.01), 1e-6);
  EXPECT_NEAR(y[3], std::cos(0.01), 1e-6);
  // offset and several heads: only [offset, offset+dim) of each head moves
  std::vector<float> z = {9, 1, 0, 0, 1, /* head 1 */ 9, 1, 0, 0, 1};
  apply_rope(z.data(), 1, p1, 2, 10, 5, 1, t, false);
  for (int h = 0; h < 2; ++h) {
    EXPECT_EQ(z[h * 5], 9);
    EXPECT_NEAR(z[h * 5 + 1], std::cos(1.0), 1e-6);
    EXPECT_NEAR(z[h * 5 + 3], std::sin(1.0), 1e-6);
  }
  // attention scaling multiplies cos and sin
  RopeTable t2 = t;
  t2.attention_scaling = 2;
  std::vector<float> u = {1, 0, 0, 0};
  const std::int32_t p0[] = {0};
  apply_rope(u.data(), 1, p0, 1, 4, 4, 0, t2, false);
  EXPECT_FLOAT_EQ(u[0], 2);
}

TEST(ModelOps, RopeDotProductDependsOnRelativePosition) {
  // q.k after rope depends only on the position difference, interleaved or not.
  RopeConfig r;
  r.dim = 8;
  const RopeTable t = make_rope_table(r);
  std::mt19937 g(7);
  std::normal_distribution<float> n;
  std::vector<float> q(8), k(8);
  for (auto& v : q) v = n(g);
  for (auto& v : k) v = n(g);
  for (bool inter : {false, true}) {
    auto dot_at = [&](int pq, int pk) {
      std::vector<float> a = q, b = k;
      apply_rope(a.data(), 1, &pq, 1, 8, 8, 0, t, inter);
      apply_rope(b.data(), 1, &pk, 1, 8, 8, 0, t, inter);
      double d = 0;
      for (int i = 0; i < 8; ++i) d += a[i] * b[i];
      return d;
    };
    EXPECT_NEAR(dot_at(5, 2), dot_at(13, 10), 1e-4);
    EXPECT_NEAR(dot_at(3, 3), dot_at(0, 0), 1e-4);
  }
}

TEST(ModelOps, CausalAttentionHandComputed) {
  // T = 2, one head, d = 1, scale 1. Token 0 sees only itself: out0 = v0. Token 1: scores
  // [q1 k0, q1 k1] = [0, ln 3] -> softmax [1/4, 3/4] -> out1 = v0/4 + 3 v1/4.
  const float q[] = {1, 1}, k[] = {0, std::log(3.0f)}, v[] = {4, 8};
  float out[2];
  causal_attention(q, k, v, out, 2, 1, 1, 1, 1, 1.0f);
  EXPECT_FLOAT_EQ(out[0], 4);
  EXPECT_NEAR(out[1], 7, 1e-5);
  // GQA: two query heads share the single kv head; the scale multiplies the scores.
  const float q2[] = {1, 0, 1, 0};  // [T=2][2 heads][d=1]: head 1 has q = 0 -> uniform weights
  float o2[4];
  causal_attention(q2, k, v, o2, 2, 2, 1, 1, 1, 1.0f);
  EXPECT_NEAR(o2[2], 7, 1e-5);
  EXPECT_NEAR(o2[3], 6, 1e-5);
  const float kk[] = {0, std::log(3.0f) * 2};
  causal_attention(q, kk, v, out, 2, 1, 1, 1, 1, 0.5f);
  EXPECT_NEAR(out[1], 7, 1e-5);
  EXPECT_THROW(causal_attention(q2, k, v, o2, 2, 3, 2, 1, 1, 1.0f), ModelError);
}

TEST(ModelOps, CausalAttentionMatchesNaiveDouble) {
  const int T = 37, nh = 4, nkv = 2, dq = 12, dv = 8;
  std::mt19937 g(3);
  std::normal_distribution<float> n;
  std::vector<float> q(T * nh * dq), k(T * nkv * dq), v(T * nkv * dv), out(T * nh * dv);
  for (auto& x : q) x = n(g);
  for (auto& x : k) x = n(g);
  for (auto& x : v) x = n(g);
  const float scale = 0.3f;
  causal_attention(q.data(), k.data(), v.data(), out.data(), T, nh, nkv, dq, dv, scale);
  for (int h = 0; h < nh; ++h) {
    const int kh = h / (nh / nkv);
    for (int t = 0; t < T; ++t) {
      std::vector<double> s(t + 1);
      double m = -1e300, z = 0;
      for (int j = 0; j <= t; ++j) {
        double d = 0;
        for (int i = 0; i < dq; ++i) d += double(q[(t * nh + h) * dq + i]) * k[(j * nkv + kh) * dq + i];
        s[j] = d * scale;
        m = std::max(m, s[j]);
      }
      for (int j = 0; j <= t; ++j) z += (s[j] = std::exp(s[j] - m));
      for (int i = 0; i < dv; ++i) {
        double o = 0;
        for (int j = 0; j <= t; ++j) o += s[j] / z * v[(j * nkv + kh) * dv + i];
        EXPECT_NEAR(out[(t * nh + h) * dv + i], o, 1e-5) << "head " << h << " token " << t;
      }
    }
  }
}

TEST(ModelOps, LinearAndNll) {
  const float x[] = {1, 2, 3, -1, 0, 1};   // [2][3]
  const float W[] = {1, 0, 1, 0, 1, 0};    // [2][3]
  const float b[] = {10, 20};
  float y[4];
  linear(x, W, b, y, 2, 2, 3);
  EXPECT_FLOAT_EQ(y[0], 14);
  EXPECT_FLOAT_EQ(y[1], 22);
  EXPECT_FLOAT_EQ(y[2], 10);
  EXPECT_FLOAT_EQ(y[3], 20);
  linear(x, W, nullptr, y, 2, 2, 3, /*accumulate=*/true);
  EXPECT_FLOAT_EQ(y[0], 18);
  EXPECT_FLOAT_EQ(y[3], 20);
  // -log softmax: logits [0, ln 3] -> p = [1/4, 3/4]
  const float l[] = {0, std::log(3.0f)};
  EXPECT_NEAR(nll(l, 2, 1), -std::log(0.75), 1e-6);
  EXPECT_NEAR(nll(l, 2, 0), std::log(4.0), 1e-6);
  // shift invariance with large logits (max subtracted)
  const float big[] = {1000, 1000 + std::log(3.0f)};
  EXPECT_NEAR(nll(big, 2, 1), -std::log(0.75), 1e-4);
}
