// Helpers of the MoE tests: random LUT-B weights, random inputs, error measures.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "lutb/moe.hpp"
#include "lutb/numerics.hpp"

namespace lutb::moe::test {

/// Random valid LUT-B stack: random indices, 8 random finite E4M3 codebook entries (not sorted, to
/// exercise "readers honour the stored order"), scale bytes in [scale_lo, scale_hi].
inline LutbTensor random_lutb(const LutbShape& shape, std::mt19937& rng, int scale_lo = 118, int scale_hi = 124) {
  LutbTensor t(shape);
  std::uniform_int_distribution<int> byte(0, 255), sc(scale_lo, scale_hi);
  for (auto& b : t.packed) b = static_cast<std::uint8_t>(byte(rng));
  for (auto& b : t.codebook) {
    int v;
    do v = byte(rng); while (e4m3_is_nan(static_cast<std::uint8_t>(v)));
    b = static_cast<std::uint8_t>(v);
  }
  for (auto& s : t.scale) s = static_cast<std::uint8_t>(sc(rng));
  return t;
}

inline std::vector<std::uint16_t> random_bf16(std::size_t n, std::mt19937& rng, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = bf16_from_float(d(rng));
  return v;
}

/// Random top-k routing over `global_experts` (distinct experts per token), weights in (0, 1).
inline void random_topk(std::int64_t T, int k, int global_experts, std::mt19937& rng, std::vector<std::int32_t>& ids,
                        std::vector<float>& w, int only_first = 0) {
  ids.resize(static_cast<std::size_t>(T * k));
  w.resize(ids.size());
  const int range = only_first > 0 ? only_first : global_experts;
  std::uniform_int_distribution<int> pick(0, range - 1);
  std::uniform_real_distribution<float> wd(0.05f, 1.0f);
  for (std::int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      int e;
      bool dup;
      do {
        e = pick(rng);
        dup = false;
        for (int i = 0; i < j; ++i) dup |= ids[t * k + i] == e;
      } while (dup && k <= range);
      ids[t * k + j] = e;
      w[t * k + j] = wd(rng);
    }
}

/// ||a - b|| / ||b|| in double.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

inline std::vector<float> bf16_to_f32(const std::vector<std::uint16_t>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(v[i]);
  return f;
}

inline MoeConfig make_config(int E, int k, std::int64_t H, std::int64_t I, std::int64_t Hu = -1, std::int64_t Iu = -1,
                             int ep_rank = 0, int ep_size = 1) {
  MoeConfig c;
  c.global_experts = E;
  c.top_k = k;
  c.hidden_size = H;
  c.intermediate_size_per_partition = I;
  c.hidden_size_unpadded = Hu;
  c.intermediate_size_per_partition_unpadded = Iu;
  c.expert_map = ExpertMap::linear(E, ep_rank, ep_size);
  return c.finalize();
}

}  // namespace lutb::moe::test
