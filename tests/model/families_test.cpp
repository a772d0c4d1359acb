// The families without a shared model (qwen2_moe, olmoe, deepseek_v2) on tiny random checkpoints
// written here: every tensor name and shape the loader expects exists in the family's transformers
// layout, the forward pass runs, and with small random weights the loss is ln(vocab) (uniform
// predictions) to within the perturbation those weights can cause.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>

#include "lutb/model.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

using namespace lutb;
using namespace lutb::model;
using nlohmann::json;

namespace {

struct Writer {
  std::vector<std::pair<std::string, OwnedTensor>> tensors;
  std::mt19937 rng{11};
  void add(const std::string& name, std::vector<std::int64_t> shape, float std = 0.02f, float mean = 0.0f) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    std::normal_distribution<float> g(mean, std);
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(n) * 2);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint16_t b = bf16_from_float(std == 0 ? mean : g(rng));
      bytes[2 * i] = static_cast<std::uint8_t>(b);
      bytes[2 * i + 1] = static_cast<std::uint8_t>(b >> 8);
    }
    tensors.emplace_back(name, OwnedTensor{DType::BF16, shape, std::move(bytes)});
  }
  void mlp(const std::string& p, std::int64_t H, std::int64_t I) {
    add(p + ".gate_proj.weight", {I, H});
    add(p + ".up_proj.weight", {I, H});
    add(p + ".down_proj.weight", {H, I});
  }
  // The token embedding, the final norm (ones) and the LM head.
  void ends();
  // Layer `l`'s two RMSNorm weights (ones); returns the layer's name prefix "model.layers.L.".
  std::string layer(int l);
  // The router and the routed experts under prefix `p` ("model.layers.L.mlp.").
  void routed_experts(const std::string& p);
};

constexpr std::int64_t H = 64, V = 97, E = 4, I = 64, L = 2;

void Writer::ends() {
  add("model.embed_tokens.weight", {V, H}, 1.0f);
  add("model.norm.weight", {H}, 0, 1);
  add("lm_head.weight", {V, H});
}

std::string Writer::layer(int l) {
  const std::string p = "model.layers." + std::to_string(l) + ".";
  add(p + "input_layernorm.weight", {H}, 0, 1);
  add(p + "post_attention_layernorm.weight", {H}, 0, 1);
  return p;
}

void Writer::routed_experts(const std::string& p) {
  add(p + "gate.weight", {E, H});
  for (int e = 0; e < E; ++e) mlp(p + "experts." + std::to_string(e), H, I);
}

void write_model(const std::filesystem::path& dir, const json& cfg, Writer& w) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << cfg.dump(2);
  write_safetensors(dir / "model.safetensors", w.tensors);
}

double loss_of(const std::filesystem::path& dir, Quant q = Quant::None) {
  MoeOptions mo;
  mo.quant = q;
  CheckpointMoe moe(dir, mo);
  LanguageModel lm = LanguageModel::load(dir, moe.factory());
  std::vector<std::int32_t> tokens(64);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 37 + 5) % V);
  return lm.forward(tokens.data(), 2, 32) / (2 * 31);
}

}  // namespace

TEST(ModelFamilies, Qwen2MoeBiasAndGatedSharedExpert) {
  test::TempDir tmp;
  Writer w;
  const std::int64_t nh = 4, nkv = 2, hd = 16;
  w.ends();
  for (int l = 0; l < L; ++l) {
    const std::string p = w.layer(l);
    for (const char* n : {"q", "k", "v"}) {
      const std::int64_t out = std::string(n) == "q" ? nh * hd : nkv * hd;
      w.add(p + "self_attn." + n + "_proj.weight", {out, H});
      w.add(p + "self_attn." + n + "_proj.bias", {out});
    }
    w.add(p + "self_attn.o_proj.weight", {H, nh * hd});
    w.routed_experts(p + "mlp.");
    w.mlp(p + "mlp.shared_expert", H, 96);
    w.add(p + "mlp.shared_expert_gate.weight", {1, H});
  }
  const json cfg = {{"model_type", "qwen2_moe"}, {"hidden_size", H}, {"num_hidden_layers", L}, {"vocab_size", V},
                    {"num_attention_heads", nh}, {"num_key_value_heads", nkv}, {"num_experts", E},
                    {"num_experts_per_tok", 2}, {"moe_intermediate_size", I}, {"shared_expert_intermediate_size", 96},
                    {"intermediate_size", 128}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false}};
  write_model(tmp.path, cfg, w);
  const double loss = loss_of(tmp.path);
  EXPECT_NEAR(loss, std::log(double(V)), 0.05);
  EXPECT_NEAR(loss_of(tmp.path, Quant::Lutb), loss, 0.01);
}

TEST(ModelFamilies, OlmoeWholeProjectionQkNormAndClip) {
  test::TempDir tmp;
  Writer w;
  const std::int64_t nh = 4, hd = 16;
  w.ends();
  for (int l = 0; l < L; ++l) {
    const std::string p = w.layer(l);
    for (const char* n : {"q", "k", "v"}) w.add(p + "self_attn." + n + "_proj.weight", {nh * hd, H});
    w.add(p + "self_attn.q_norm.weight", {nh * hd}, 0, 1);
    w.add(p + "self_attn.k_norm.weight", {nh * hd}, 0, 1);
    w.add(p + "self_attn.o_proj.weight", {H, nh * hd});
    w.routed_experts(p + "mlp.");
  }
  json cfg = {{"model_type", "olmoe"}, {"hidden_size", H}, {"num_hidden_layers", L}, {"vocab_size", V},
              {"num_attention_heads", nh}, {"num_experts", E}, {"num_experts_per_tok", 2},
              {"intermediate_size", I}, {"rope_theta", 10000.0}, {"clip_qkv", 8.0}};
  write_model(tmp.path, cfg, w);
  EXPECT_NEAR(loss_of(tmp.path), std::log(double(V)), 0.05);
  EXPECT_EQ(TransformerConfig::load(tmp.path).clip_qkv, 8.0);
}

TEST(ModelFamilies, DeepseekV2MlaWithoutQLoraGroupLimitedGreedy) {
  test::TempDir tmp;
  Writer w;
  const std::int64_t nh = 2, nope = 16, rd = 8, vd = 16, r = 32;
  w.ends();
  for (int l = 0; l < L; ++l) {
    const std::string p = w.layer(l);
    w.add(p + "self_attn.q_proj.weight", {nh * (nope + rd), H});
    w.add(p + "self_attn.kv_a_proj_with_mqa.weight", {r + rd, H});
    w.add(p + "self_attn.kv_a_layernorm.weight", {r}, 0, 1);
    w.add(p + "self_attn.kv_b_proj.weight", {nh * (nope + vd), r});
    w.add(p + "self_attn.o_proj.weight", {H, nh * vd});
    if (l == 0) {
      w.mlp(p + "mlp", H, 128);
      continue;
    }
    w.routed_experts(p + "mlp.");
    w.mlp(p + "mlp.shared_experts", H, 2 * I);
  }
  const json cfg = {{"model_type", "deepseek_v2"}, {"hidden_size", H}, {"num_hidden_layers", L}, {"vocab_size", V},
                    {"num_attention_heads", nh}, {"n_routed_experts", E}, {"num_experts_per_tok", 2},
                    {"moe_intermediate_size", I}, {"intermediate_size", 128}, {"n_shared_experts", 2},
                    {"first_k_dense_replace", 1}, {"q_lora_rank", nullptr}, {"kv_lora_rank", r},
                    {"qk_nope_head_dim", nope}, {"qk_rope_head_dim", rd}, {"v_head_dim", vd},
                    {"topk_method", "group_limited_greedy"}, {"n_group", 2}, {"topk_group", 1},
                    {"routed_scaling_factor", 1.0}, {"rope_theta", 10000.0}};
  write_model(tmp.path, cfg, w);
  const TransformerConfig c = TransformerConfig::load(tmp.path);
  EXPECT_TRUE(c.rope_interleave);
  EXPECT_EQ(c.sparse_layer, (std::vector<bool>{false, true}));
  EXPECT_NEAR(loss_of(tmp.path), std::log(double(V)), 0.05);
}
