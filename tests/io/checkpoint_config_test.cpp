// config.json parsing (spec section 7): the three shared models and synthetic configs with every
// key variant; tensor naming. Refused values: tests/model/config_validation_test.cpp.
#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

#include "lutb/checkpoint.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

using nlohmann::json;

json base(const char* type) {
  return json{{"model_type", type}, {"hidden_size", 64}, {"num_hidden_layers", 6}, {"vocab_size", 100},
              {"num_experts_per_tok", 2}, {"intermediate_size", 96}};
}

TEST(ModelConfig, TinyQwen3) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-qwen3-moe");
  const ModelConfig c = load_model_config(dir);
  EXPECT_EQ(c.family, ModelFamily::qwen3_moe);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.moe_intermediate_size, 256);
  EXPECT_EQ(c.intermediate_size, 512);
  EXPECT_EQ(c.num_experts, 16);  // transformers 5 key num_local_experts
  EXPECT_EQ(c.num_experts_per_tok, 4);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_TRUE(c.renormalize());
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.scoring_func, ScoringFunc::softmax);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.vocab_size, 2048);
  EXPECT_EQ(c.moe_layers(), (std::vector<std::int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(c.raw.at("head_dim").get<int>(), 64);
  EXPECT_EQ(expert_weight_name(c, 1, 7, Proj::up), "model.layers.1.mlp.experts.7.up_proj.weight");
  EXPECT_EQ(router_weight_name(c, 0), "model.layers.0.mlp.gate.weight");
  EXPECT_EQ(router_bias_name(c, 0), "");
}

TEST(ModelConfig, TinyMixtral) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  const ModelConfig c = load_model_config(dir / "config.json");
  EXPECT_EQ(c.family, ModelFamily::mixtral);
  EXPECT_EQ(c.hidden_size, 192);
  EXPECT_EQ(c.moe_intermediate_size, 320);  // Mixtral: intermediate_size is the expert width
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_FALSE(c.norm_topk_prob);  // key absent ...
  EXPECT_TRUE(c.renormalize());    // ... but Mixtral always renormalises
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.moe_layers(), (std::vector<std::int64_t>{0, 1, 2}));
  EXPECT_EQ(expert_weight_name(c, 2, 3, Proj::gate), "model.layers.2.block_sparse_moe.experts.3.w1.weight");
  EXPECT_EQ(expert_weight_name(c, 2, 3, Proj::up), "model.layers.2.block_sparse_moe.experts.3.w3.weight");
  EXPECT_EQ(expert_weight_name(c, 2, 3, Proj::down), "model.layers.2.block_sparse_moe.experts.3.w2.weight");
  EXPECT_EQ(router_weight_name(c, 1), "model.layers.1.block_sparse_moe.gate.weight");
}

TEST(ModelConfig, TinyDeepseekV3) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-deepseek-v3");
  const ModelConfig c = load_model_config(dir);
  EXPECT_EQ(c.family, ModelFamily::deepseek_v3);
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.moe_intermediate_size, 128);
  EXPECT_EQ(c.intermediate_size, 512);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.shared_expert_intermediate_size, 128);
  EXPECT_EQ(c.scoring_func, ScoringFunc::sigmoid);  // DeepSeek-V3 default (key absent)
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.moe_layers(), (std::vector<std::int64_t>{1, 2, 3}));
  EXPECT_FALSE(c.is_moe_layer(0));
  EXPECT_EQ(router_bias_name(c, 2), "model.layers.2.mlp.gate.e_score_correction_bias");
}

TEST(ModelConfig, ExpertKeyVariants) {
  for (const char* key : {"num_experts", "num_local_experts", "n_routed_experts"}) {
    json j = base("qwen3_moe");
    j["moe_intermediate_size"] = 32;
    j[key] = 12;
    EXPECT_EQ(parse_model_config(j).num_experts, 12) << key;
  }
}

TEST(ModelConfig, QwenDenseLayers) {
  json j = base("qwen2_moe");
  j["num_experts"] = 8;
  j["moe_intermediate_size"] = 32;
  j["shared_expert_intermediate_size"] = 128;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  const ModelConfig c = parse_model_config(j);
  // (L+1) % 2 == 0 -> 1, 3, 5; minus mlp_only 3.
  EXPECT_EQ(c.moe_layers(), (std::vector<std::int64_t>{1, 5}));
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.shared_expert_intermediate_size, 128);
  EXPECT_FALSE(c.norm_topk_prob);  // Qwen2-MoE default
}

TEST(ModelConfig, DeepseekDenseLayersAndDefaults) {
  json j = base("deepseek_v2");
  j["n_routed_experts"] = 16;
  j["moe_intermediate_size"] = 32;
  j["first_k_dense_replace"] = 2;
  j["moe_layer_freq"] = 2;
  j["n_shared_experts"] = 2;
  j["n_group"] = 4;
  j["topk_group"] = 3;
  j["routed_scaling_factor"] = 16.0;
  const ModelConfig c = parse_model_config(j);
  EXPECT_EQ(c.moe_layers(), (std::vector<std::int64_t>{2, 4}));
  EXPECT_EQ(c.scoring_func, ScoringFunc::softmax);  // V2 default
  EXPECT_EQ(c.topk_method, "greedy");
  EXPECT_EQ(c.shared_expert_intermediate_size, 64);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 16.0);
  EXPECT_EQ(router_bias_name(c, 2), "");  // V2 has no correction bias
}

TEST(ModelConfig, OlmoeAndMixtralWidths) {
  json o = base("olmoe");
  o["num_experts"] = 8;
  const ModelConfig c = parse_model_config(o);  // OLMoE experts use intermediate_size
  EXPECT_EQ(c.moe_intermediate_size, 96);
  EXPECT_EQ(c.moe_layers().size(), 6u);
  json m = base("mixtral");
  m["num_local_experts"] = 4;
  m["norm_topk_prob"] = false;
  const ModelConfig mc = parse_model_config(m);
  EXPECT_EQ(mc.moe_intermediate_size, 96);
  EXPECT_TRUE(mc.renormalize());
}

TEST(ModelConfig, LutbQuantConfig) {
  json j = {{"quantization_config",
             {{"quant_method", "lut_b"}, {"fitter", "optimal"}, {"logical_shapes", {{"a.weight", {3, 70}}}}}}};
  auto q = parse_lutb_quant_config(j);
  ASSERT_TRUE(q);
  EXPECT_EQ(q->fitter, "optimal");
  EXPECT_EQ(q->logical_shapes.at("a.weight"), (std::vector<std::int64_t>{3, 70}));
  EXPECT_FALSE(q->compressed_tensors);
  json ct = {{"quantization_config", {{"quant_method", "compressed-tensors"}, {"config_groups", {{"group_0", {{"format", "lut-b"}}}}}}}};
  auto q2 = parse_lutb_quant_config(ct);
  ASSERT_TRUE(q2);
  EXPECT_TRUE(q2->compressed_tensors);
  EXPECT_FALSE(parse_lutb_quant_config(json{{"quantization_config", {{"quant_method", "fp8"}}}}));
  EXPECT_FALSE(parse_lutb_quant_config(json::object()));
  EXPECT_EQ(lutb_names("a.b.weight").packed, "a.b.weight_packed");
  EXPECT_EQ(lutb_names("a.experts.gate_up_proj").scale, "a.experts.gate_up_proj_scale");
}

TEST(ModelConfig, RoutedExpertPattern) {
  json j = base("qwen3_moe");
  j["num_experts"] = 8;
  j["moe_intermediate_size"] = 32;
  const ModelConfig c = parse_model_config(j);
  const std::regex re(routed_expert_pattern(c));
  EXPECT_TRUE(std::regex_match(expert_weight_name(c, 3, 7, Proj::down), re));
  EXPECT_TRUE(std::regex_match(stacked_gate_up_name(c, 3), re));
  EXPECT_FALSE(std::regex_match(router_weight_name(c, 3), re));
  EXPECT_FALSE(std::regex_match(std::string("model.layers.1.mlp.shared_experts.gate_proj.weight"), re));
  json m = base("mixtral");
  m["num_local_experts"] = 4;
  const ModelConfig mc = parse_model_config(m);
  const std::regex rm(routed_expert_pattern(mc));
  EXPECT_TRUE(std::regex_match(expert_weight_name(mc, 0, 3, Proj::up), rm));
  EXPECT_FALSE(std::regex_match(router_weight_name(mc, 0), rm));
}

}  // namespace
}  // namespace lutb
