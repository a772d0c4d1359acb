// Routers (spec section 5): softmax top-k and DeepSeek-V3 sigmoid grouped top-k, FP32 math,
// ties to the lower index.
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "lutb/moe.hpp"
#include "lutb/numerics.hpp"

namespace lutb::moe {

void RouterConfig::validate() const {
  auto bad = [](const char* field, auto v, const char* why) {
    throw std::invalid_argument(fmt::format("RouterConfig: {}={} {}", field, v, why));
  };
  if (num_experts < 1) bad("num_experts", num_experts, "must be >= 1");
  if (top_k < 1 || top_k > num_experts) bad("top_k", top_k, "must be in 1..num_experts");
  if (n_group < 1 || num_experts % n_group != 0) bad("n_group", n_group, "must divide num_experts");
  if (topk_group < 1 || topk_group > n_group) bad("topk_group", topk_group, "must be in 1..n_group");
  if (top_k > topk_group * (num_experts / n_group))
    bad("top_k", top_k, "exceeds the experts of the kept groups (topk_group * experts per group)");
  if (scoring == ScoringFunc::Sigmoid && num_experts / n_group < 2)
    bad("n_group", n_group, "leaves fewer than 2 experts per group (a group's score sums its top 2)");
  if (!std::isfinite(routed_scaling_factor)) bad("routed_scaling_factor", routed_scaling_factor, "must be finite");
}

namespace {

// Selection key: NaN ranks below every number (like -inf, but after it).
inline bool better(float a, int ia, float b, int ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return nb;   // a number beats NaN
  if (!na && a != b) return a > b;
  return ia < ib;            // ties (and NaN vs NaN): lower index
}

// Indices of the k best of key[0..n) among those with allowed[i], best first.
void top_k_indices(const float* key, int n, int k, const std::vector<char>* allowed, int* out) {
  std::vector<char> taken(n, 0);
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int i = 0; i < n; ++i) {
      if (taken[i] || (allowed && !(*allowed)[i])) continue;
      if (best < 0 || better(key[i], i, key[best], best)) best = i;
    }
    if (best < 0) throw std::logic_error("top_k_indices: not enough candidates");
    taken[best] = 1;
    out[j] = best;
  }
}

void route_softmax(const RouterConfig& c, const float* logits, std::int32_t* ids, float* w) {
  const int E = c.num_experts, k = c.top_k;
  std::vector<float> p(E);
  float mx = -std::numeric_limits<float>::infinity();
  for (int e = 0; e < E; ++e)
    if (logits[e] > mx) mx = logits[e];
  float sum = 0.0f;
  for (int e = 0; e < E; ++e) {
    p[e] = std::exp(logits[e] - mx);
    sum += p[e];
  }
  for (int e = 0; e < E; ++e) p[e] /= sum;
  std::vector<int> idx(k);
  top_k_indices(p.data(), E, k, nullptr, idx.data());
  float s = 0.0f;
  for (int j = 0; j < k; ++j) s += p[idx[j]];
  for (int j = 0; j < k; ++j) {
    ids[j] = idx[j];
    float v = p[idx[j]];
    if (c.norm_topk_prob) v /= s;
    w[j] = v * c.routed_scaling_factor;
  }
}

void route_sigmoid(const RouterConfig& c, const float* logits, const float* bias, std::int32_t* ids, float* w) {
  const int E = c.num_experts, k = c.top_k, G = c.n_group, per = E / G;
  std::vector<float> s(E), choice(E);
  for (int e = 0; e < E; ++e) {
    s[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    choice[e] = s[e] + (bias ? bias[e] : 0.0f);
  }
  // Group score = sum of the group's top-2 choice scores.
  std::vector<float> gscore(G);
  for (int g = 0; g < G; ++g) {
    int top2[2];
    top_k_indices(choice.data() + g * per, per, 2, nullptr, top2);
    gscore[g] = choice[g * per + top2[0]] + choice[g * per + top2[1]];
  }
  std::vector<int> kept(c.topk_group);
  top_k_indices(gscore.data(), G, c.topk_group, nullptr, kept.data());
  std::vector<char> allowed(E, 0);
  for (int g : kept)
    for (int i = 0; i < per; ++i) allowed[g * per + i] = 1;
  std::vector<int> idx(k);
  top_k_indices(choice.data(), E, k, &allowed, idx.data());
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += s[idx[j]];
  for (int j = 0; j < k; ++j) {
    ids[j] = idx[j];
    float v = s[idx[j]];
    if (c.norm_topk_prob) v /= sum;
    w[j] = v * c.routed_scaling_factor;
  }
}

}  // namespace

void route(const RouterConfig& cfg, const float* logits, std::int64_t tokens, const float* correction_bias,
           std::int32_t* topk_ids, float* topk_weights) {
  cfg.validate();
  const int E = cfg.num_experts, k = cfg.top_k;
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (cfg.scoring == ScoringFunc::Softmax)
      route_softmax(cfg, logits + t * E, topk_ids + t * k, topk_weights + t * k);
    else
      route_sigmoid(cfg, logits + t * E, correction_bias, topk_ids + t * k, topk_weights + t * k);
  }
}

Routing route(const RouterConfig& cfg, const std::vector<float>& logits, std::int64_t tokens,
              const float* correction_bias) {
  if (static_cast<std::int64_t>(logits.size()) != tokens * cfg.num_experts)
    throw std::invalid_argument(fmt::format("route: logits hold {} values, expected tokens*num_experts = {}",
                                            logits.size(), tokens * cfg.num_experts));
  Routing r;
  r.tokens = tokens;
  r.top_k = cfg.top_k;
  r.ids.resize(static_cast<std::size_t>(tokens * cfg.top_k));
  r.weights.resize(r.ids.size());
  route(cfg, logits.data(), tokens, correction_bias, r.ids.data(), r.weights.data());
  return r;
}

void router_logits_bf16(const std::uint16_t* x, const std::uint16_t* gate_weight, std::int64_t tokens,
                        std::int64_t hidden, int num_experts, bool round_to_bf16, float* out) {
  std::vector<float> wf(static_cast<std::size_t>(num_experts * hidden));
  for (std::size_t i = 0; i < wf.size(); ++i) wf[i] = bf16_to_float(gate_weight[i]);
#pragma omp parallel for schedule(static)
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<float> xf(static_cast<std::size_t>(hidden));
    for (std::int64_t i = 0; i < hidden; ++i) xf[i] = bf16_to_float(x[t * hidden + i]);
    for (int e = 0; e < num_experts; ++e) {
      const float* wr = wf.data() + e * hidden;
      float acc = 0.0f;
      for (std::int64_t i = 0; i < hidden; ++i) acc += xf[i] * wr[i];
      out[t * num_experts + e] = round_to_bf16 ? bf16_round(acc) : acc;
    }
  }
}

}  // namespace lutb::moe
