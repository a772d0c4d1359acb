// Private to src/model: FP32 dense layers shared by the model and the MoE blocks.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <vector>

#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"

namespace lutb::model {

/// Throws ModelError when `st` stores tensors of a layer `c` (parsed from dir/config.json) does not
/// declare: model.layers.L.* with L >= num_hidden_layers (+ DeepSeek-V3's num_nextn_predict_layers).
/// The message names the file, the tensor, config.json and the declared layers. Used by
/// LanguageModel (lutb eval) and CheckpointMoe (lutb eval, lutb moe); lutb quantize has its own.
void check_declared_layers(const TransformerConfig& c, const SafetensorsCollection& st, const std::filesystem::path& dir);

/// A dense projection y = x W^T (+ b): W [out][in] FP32.
struct Linear {
  std::vector<float> w, b;
  std::int64_t out = 0, in = 0;
  bool empty() const { return w.empty(); }
  void apply(const float* x, float* y, std::int64_t T, bool accumulate = false) const {
    linear(x, w.data(), b.empty() ? nullptr : b.data(), y, T, out, in, accumulate);
  }
};

/// A SiLU-gated MLP: down(silu(gate(x)) * up(x)), FP32 (transformers' MLP in FP32 compute).
struct Mlp {
  Linear gate, up, down;
  bool empty() const { return gate.empty(); }
  /// out[T][H] (+)= scale[t] * mlp(x) (scale may be null = 1).
  void apply(const float* x, float* out, std::int64_t T, bool accumulate, const float* scale = nullptr) const {
    const std::int64_t I = gate.out, H = down.out;
    std::vector<float> g(static_cast<std::size_t>(T * I)), u(static_cast<std::size_t>(T * I));
    gate.apply(x, g.data(), T);
    up.apply(x, u.data(), T);
#pragma omp parallel for schedule(static) if (T * I > 65536)
    for (std::int64_t i = 0; i < T * I; ++i) {
      const float a = g[i];
      g[i] = a / (1.0f + std::exp(-a)) * u[i];
    }
    if (!scale) {
      down.apply(g.data(), out, T, accumulate);
      return;
    }
    std::vector<float> d(static_cast<std::size_t>(T * H));
    down.apply(g.data(), d.data(), T);
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < H; ++h) out[t * H + h] = (accumulate ? out[t * H + h] : 0.0f) + scale[t] * d[t * H + h];
  }
};

/// Shared experts of a MoE block: DeepSeek shared_experts (plain), Qwen2-MoE shared_expert scaled by
/// sigmoid(shared_expert_gate . x).
struct SharedExperts {
  Mlp mlp;
  Linear gate;  // [1][H], Qwen2-MoE only
  bool empty() const { return mlp.empty(); }
  /// out[T][H] += shared(x).
  void add(const float* x, float* out, std::int64_t T) const {
    if (mlp.empty()) return;
    if (gate.empty()) {
      mlp.apply(x, out, T, true);
      return;
    }
    std::vector<float> g(static_cast<std::size_t>(T));
    gate.apply(x, g.data(), T);
    for (float& v : g) v = 1.0f / (1.0f + std::exp(-v));
    mlp.apply(x, out, T, true, g.data());
  }
};

}  // namespace lutb::model
