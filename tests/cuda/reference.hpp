// tests/cuda/reference.hpp: plain host reference of spec sections 4 and 5, built only on the inline
// scalar formats of lutb/numerics.hpp, lutb/tile.hpp (pack8/unpack8) and lutb/mxfp8.hpp, so the GPU
// tests depend on nothing else. Sequential FP32 sums in the natural order; no FMA contraction
// (the project builds C++ with -std=c++20, where GCC does not contract).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <vector>

#include "lutb/mxfp8.hpp"
#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"

namespace lutb::test {

/// A host LUT-B stack in the checkpoint layout.
struct HostLutb {
  LutbShape shape;
  std::vector<std::uint8_t> packed, codebook, scale;

  explicit HostLutb(LutbShape s = {}) : shape(s) {
    packed.assign(static_cast<std::size_t>(s.tiles()) * kPackedBytes, 0);
    codebook.assign(static_cast<std::size_t>(s.tiles()) * kCodebookSize, 0);
    scale.assign(static_cast<std::size_t>(s.tiles()), 127);
  }
  /// Logical [rows][cols] FP32 of expert e.
  std::vector<float> dequant_expert(std::int64_t e) const {
    std::vector<float> out(static_cast<std::size_t>(shape.rows * shape.cols));
    const std::int64_t tn_n = shape.tiles_n(), tk_n = shape.tiles_k();
    for (std::int64_t tn = 0; tn < tn_n; ++tn)
      for (std::int64_t tk = 0; tk < tk_n; ++tk) {
        const std::int64_t t = (e * tn_n + tn) * tk_n + tk;
        for (int r = 0; r < 8; ++r) {
          const std::int64_t row = tn * 8 + r;
          if (row >= shape.rows) break;
          for (int grp = 0; grp < 8; ++grp) {
            std::uint8_t idx[8];
            unpack8(&packed[t * kPackedBytes + r * 24 + grp * 3], idx);
            for (int j = 0; j < 8; ++j) {
              const std::int64_t col = tk * 64 + grp * 8 + j;
              if (col >= shape.cols) continue;
              out[row * shape.cols + col] = ldexp_ue8m0(e4m3_to_float(codebook[t * 8 + idx[j]]), scale[t]);
            }
          }
        }
      }
    return out;
  }
};

/// Random LUT-B data: random indices, 8 distinct finite E4M3 codebook entries (sorted), scale bytes in
/// [scale_lo, scale_hi].
inline HostLutb random_lutb(LutbShape s, std::mt19937& rng, int scale_lo = 117, int scale_hi = 123) {
  HostLutb w(s);
  std::uniform_int_distribution<int> byte(0, 255), sc(scale_lo, scale_hi);
  for (auto& b : w.packed) b = static_cast<std::uint8_t>(byte(rng));
  for (std::int64_t t = 0; t < s.tiles(); ++t) {
    std::uint8_t cb[8];
    for (int i = 0; i < 8; ++i) {
      std::uint8_t b;
      do b = static_cast<std::uint8_t>(byte(rng)); while (e4m3_is_nan(b));
      cb[i] = b;
    }
    std::sort(cb, cb + 8, [](std::uint8_t a, std::uint8_t b) { return e4m3_to_float(a) < e4m3_to_float(b); });
    std::memcpy(&w.codebook[t * 8], cb, 8);
    w.scale[t] = static_cast<std::uint8_t>(sc(rng));
  }
  return w;
}

/// Test-only quantiser (NOT a project fitter): per tile, scale = rceil(amax) clamped to 3..246, an
/// evenly spaced codebook from min to max snapped to E4M3 and sorted, nearest entry (ties lower).
/// w: [E][rows][cols] FP32 logical.
inline HostLutb quantize_simple(const std::vector<float>& w, LutbShape s) {
  HostLutb q(s);
  const std::int64_t tn_n = s.tiles_n(), tk_n = s.tiles_k();
  for (std::int64_t e = 0; e < s.experts; ++e)
    for (std::int64_t tn = 0; tn < tn_n; ++tn)
      for (std::int64_t tk = 0; tk < tk_n; ++tk) {
        const std::int64_t t = (e * tn_n + tn) * tk_n + tk;
        float v[512];
        float amax = 0, lo = 0, hi = 0;
        for (int f = 0; f < 512; ++f) {
          const std::int64_t row = tn * 8 + f / 64, col = tk * 64 + f % 64;
          v[f] = (row < s.rows && col < s.cols) ? w[(e * s.rows + row) * s.cols + col] : 0.0f;
          amax = std::max(amax, std::fabs(v[f]));
          lo = std::min(lo, v[f]);
          hi = std::max(hi, v[f]);
        }
        int sb = ue8m0_rceil(amax);
        sb = std::clamp(sb, 3, 246);
        const float inv = ldexp_ue8m0(1.0f, static_cast<std::uint8_t>(254 - sb));
        std::uint8_t cb[8];
        for (int i = 0; i < 8; ++i) cb[i] = e4m3_from_float((lo + (hi - lo) * i / 7.0f) * inv);
        std::sort(cb, cb + 8, [](std::uint8_t a, std::uint8_t b) { return e4m3_to_float(a) < e4m3_to_float(b); });
        std::uint8_t idx[512];
        for (int f = 0; f < 512; ++f) {
          const float x = v[f] * inv;
          int best = 0;
          float bd = INFINITY;
          for (int i = 0; i < 8; ++i) {
            const float d = std::fabs(x - e4m3_to_float(cb[i]));
            if (d < bd) { bd = d; best = i; }
          }
          idx[f] = static_cast<std::uint8_t>(best);
        }
        for (int grp = 0; grp < 64; ++grp) pack8(&idx[grp * 8], &q.packed[t * 192 + grp * 3]);
        std::memcpy(&q.codebook[t * 8], cb, 8);
        q.scale[t] = static_cast<std::uint8_t>(sb);
      }
  return q;
}

/// MXFP8 (rceil) quantise-dequantise of one row of n values (ragged tail padded with zeros).
inline void mxfp8_qdq_row(const float* x, std::int64_t n, float* out) {
  for (std::int64_t b0 = 0; b0 < n; b0 += 32) {
    float amax = 0;
    bool bad = false;
    for (std::int64_t i = b0; i < std::min(n, b0 + 32); ++i) {
      if (!f32_is_finite(x[i])) bad = true;
      amax = std::max(amax, std::fabs(x[i]));
    }
    const std::uint8_t b = bad ? 255 : mx_block_scale(amax, MxScaleRule::Rceil);
    for (std::int64_t i = b0; i < std::min(n, b0 + 32); ++i) out[i] = mx_decode(mx_encode(x[i], b), b);
  }
}

inline float silu_mul(float g, float u) { return (g / (1.0f + std::exp(-g))) * u; }

/// Spec section 4 on the host. x: [T][H] BF16 bits; ids/weights [T][k]; returns out [T][H] BF16 bits.
/// When `bf16_weights` is non-null it holds dequantised... (unused) -- the LUT-B stacks are used.
inline std::vector<std::uint16_t> moe_reference(const HostLutb& w13, const HostLutb& w2, std::int64_t H, std::int64_t I,
                                                const std::vector<std::uint16_t>& x, std::int64_t T, int k,
                                                const std::vector<std::int32_t>& ids, const std::vector<float>& wts) {
  std::map<std::int64_t, std::pair<std::vector<float>, std::vector<float>>> cache;
  std::vector<std::uint16_t> out(static_cast<std::size_t>(T * H));
  std::vector<float> xr(H), a(H), h(I), y(H), acc(H);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t c = 0; c < H; ++c) xr[c] = bf16_to_float(x[t * H + c]);
    mxfp8_qdq_row(xr.data(), H, a.data());
    std::fill(acc.begin(), acc.end(), 0.0f);
    bool bad = false;
    for (int j = 0; j < k; ++j) {
      const std::int64_t e = ids[t * k + j];
      if (e < 0 || e >= w13.shape.experts) { bad = true; break; }
      auto it = cache.find(e);
      if (it == cache.end()) it = cache.emplace(e, std::make_pair(w13.dequant_expert(e), w2.dequant_expert(e))).first;
      const auto& W13 = it->second.first;
      const auto& W2 = it->second.second;
      for (std::int64_t i = 0; i < I; ++i) {
        float g = 0, u = 0;
        for (std::int64_t c = 0; c < H; ++c) {
          g += a[c] * W13[i * H + c];
          u += a[c] * W13[(I + i) * H + c];
        }
        h[i] = bf16_round(silu_mul(g, u));
      }
      mxfp8_qdq_row(h.data(), I, h.data());
      for (std::int64_t n = 0; n < H; ++n) {
        float s = 0;
        for (std::int64_t i = 0; i < I; ++i) s += h[i] * W2[n * I + i];
        y[n] = s;
      }
      for (std::int64_t n = 0; n < H; ++n) acc[n] = acc[n] + wts[t * k + j] * y[n];
    }
    for (std::int64_t n = 0; n < H; ++n) out[t * H + n] = bad ? bf16_from_float(NAN) : bf16_from_float(acc[n]);
  }
  return out;
}

/// Softmax top-k reference (spec 5).
inline void softmax_topk_reference(const float* logits, int E, int k, bool renorm, std::int32_t* ids, float* w) {
  float m = -INFINITY;
  for (int e = 0; e < E; ++e) m = std::max(m, logits[e]);
  std::vector<float> p(E);
  float s = 0;
  for (int e = 0; e < E; ++e) { p[e] = std::exp(logits[e] - m); s += p[e]; }
  for (int e = 0; e < E; ++e) p[e] = p[e] / s;
  float sel = 0;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (p[e] >= 0 && (best < 0 || p[e] > p[best])) best = e;
    ids[j] = best;
    w[j] = p[best];
    sel += p[best];
    p[best] = -1;
  }
  if (renorm)
    for (int j = 0; j < k; ++j) w[j] = w[j] / sel;
}

/// DeepSeek-V3 grouped routing reference (spec 5).
inline void deepseek_reference(const float* logits, const float* bias, int E, int n_group, int topk_group, int k,
                               bool renorm, float scaling, std::int32_t* ids, float* w) {
  std::vector<float> s(E), ch(E);
  for (int e = 0; e < E; ++e) { s[e] = 1.0f / (1.0f + std::exp(-logits[e])); ch[e] = s[e] + (bias ? bias[e] : 0.0f); }
  const int per = E / n_group;
  std::vector<float> gs(n_group);
  for (int g = 0; g < n_group; ++g) {
    std::vector<float> v(ch.begin() + g * per, ch.begin() + (g + 1) * per);
    std::sort(v.begin(), v.end(), std::greater<float>());
    gs[g] = v[0] + v[1];
  }
  std::vector<bool> keep(n_group, false);
  for (int j = 0; j < topk_group; ++j) {
    int best = -1;
    for (int g = 0; g < n_group; ++g)
      if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
    keep[best] = true;
  }
  std::vector<bool> taken(E, false);
  float sum = 0;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (keep[e / per] && !taken[e] && (best < 0 || ch[e] > ch[best])) best = e;
    taken[best] = true;
    ids[j] = best;
    w[j] = s[best];
    sum += s[best];
  }
  for (int j = 0; j < k; ++j) w[j] = (renorm ? w[j] / (sum + 1e-20f) : w[j]) * scaling;
}

}  // namespace lutb::test
