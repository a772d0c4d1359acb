// TransformerConfig: the attention/rope conventions read from config.json. Refused values:
// tests/model/config_validation_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "lutb/model.hpp"
#include "support/test_support.hpp"

using namespace lutb::model;
using nlohmann::json;

TEST(TransformerConfigTest, SharedModels) {
  LUTB_MODEL_OR_SKIP(q, "tiny-qwen3-moe");
  const TransformerConfig c = TransformerConfig::load(q);
  EXPECT_EQ(c.family, "qwen3_moe");
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FLOAT_EQ(c.attention_scale, 0.125f);
  EXPECT_EQ(c.rope.dim, 64);
  EXPECT_EQ(c.rope.theta, 10000.0);
  EXPECT_EQ(c.sparse_layer, std::vector<bool>(4, true));

  LUTB_MODEL_OR_SKIP(d, "tiny-deepseek-v3");
  const TransformerConfig k = TransformerConfig::load(d);
  EXPECT_TRUE(k.mla);
  EXPECT_EQ(k.q_lora_rank, 96);
  EXPECT_EQ(k.kv_lora_rank, 64);
  EXPECT_EQ(k.rope.dim, 32);  // qk_rope_head_dim
  EXPECT_TRUE(k.rope_interleave);
  EXPECT_FLOAT_EQ(k.attention_scale, 0.125f);  // (32 + 32)^-0.5
  EXPECT_EQ(k.sparse_layer, (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(k.shared_expert_intermediate_size, 128);

  LUTB_MODEL_OR_SKIP(m, "tiny-mixtral");
  const TransformerConfig x = TransformerConfig::load(m);
  EXPECT_EQ(x.rope.theta, 1e6);
  EXPECT_EQ(x.num_kv_heads, 1);
  EXPECT_DOUBLE_EQ(x.rms_norm_eps, 1e-5);
  EXPECT_EQ(x.moe_intermediate_size, 320);
}

namespace {
json deepseek_like() {
  return json{{"model_type", "deepseek_v3"}, {"hidden_size", 64}, {"num_hidden_layers", 2}, {"vocab_size", 10},
              {"num_attention_heads", 2}, {"n_routed_experts", 4}, {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 16}, {"kv_lora_rank", 8}, {"qk_nope_head_dim", 128},
              {"qk_rope_head_dim", 64}, {"v_head_dim", 128}, {"q_lora_rank", nullptr}, {"first_k_dense_replace", 1}};
}
}  // namespace

TEST(TransformerConfigTest, MlaSoftmaxScaleWithYarnMscale) {
  json j = deepseek_like();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 40}, {"mscale", 1.0}, {"mscale_all_dim", 1.0},
                       {"original_max_position_embeddings", 4096}, {"beta_fast", 32}, {"beta_slow", 1}};
  j["rope_theta"] = 10000;
  const TransformerConfig c = TransformerConfig::from_json(j, "test");
  // transformers DeepseekV3Attention: qk_head_dim^-0.5 * mscale^2, mscale = 0.1 * 1 * ln(40) + 1
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(c.attention_scale, m * m / std::sqrt(192.0), 1e-7);
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_FLOAT_EQ(make_rope_table(c.rope).attention_scaling, 1.0f);  // mscale / mscale_all_dim
  // transformers 5 spelling: rope_parameters with rope_theta inside
  json k = deepseek_like();
  k["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5000.0}};
  const TransformerConfig c5 = TransformerConfig::from_json(k, "test");
  EXPECT_EQ(c5.rope.theta, 5000.0);
  EXPECT_NEAR(c5.attention_scale, 1 / std::sqrt(192.0), 1e-8);
}

