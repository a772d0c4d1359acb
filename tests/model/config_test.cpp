// TransformerConfig: the attention/rope conventions read from config.json.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "lutb/checkpoint.hpp"
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

TEST(TransformerConfigTest, Errors) {
  json j = deepseek_like();
  j["model_type"] = "llama";
  try {
    TransformerConfig::from_json(j, "x/config.json");
    FAIL();
  } catch (const ModelError& e) {
    EXPECT_NE(std::string(e.what()).find("llama"), std::string::npos) << e.what();
  }
  j = deepseek_like();
  j.erase("kv_lora_rank");
  try {
    TransformerConfig::from_json(j, "x/config.json");
    FAIL();
  } catch (const ModelError& e) {
    EXPECT_NE(std::string(e.what()).find("kv_lora_rank"), std::string::npos) << e.what();
  }
  j = deepseek_like();
  j["hidden_act"] = "gelu";
  EXPECT_THROW(TransformerConfig::from_json(j, "x"), ModelError);
  lutb::test::TempDir tmp;
  EXPECT_THROW(TransformerConfig::load(tmp.path), ModelError);  // no config.json
}

// A config.json that is a directory, and a model path that is a file, are named with what is wrong
// with them, not the stream's "basic_filebuf::underflow error reading the file: Is a directory" or
// "FILE/config.json: cannot open".
TEST(TransformerConfigTest, PathErrorsNameThePathAndTheProblem) {
  lutb::test::TempDir tmp;
  std::filesystem::create_directory(tmp.path / "config.json");
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([&] { (void)TransformerConfig::load(tmp.path); }),
            (tmp.path / "config.json").string() + ": is a directory; the checkpoint's config.json must be a file");
  EXPECT_EQ(message([&] { (void)lutb::load_model_config(tmp.path); }),
            (tmp.path / "config.json").string() + ": is a directory; the checkpoint's config.json must be a file");
  std::ofstream(tmp.path / "good.safetensors") << "x";
  EXPECT_EQ(message([&] { (void)TransformerConfig::load(tmp.path / "good.safetensors"); }),
            (tmp.path / "good.safetensors").string() +
                ": not a directory (a model is a Hugging Face checkpoint directory holding config.json and "
                "*.safetensors)");
  EXPECT_EQ(message([&] { (void)TransformerConfig::load(tmp.path / "nope"); }),
            (tmp.path / "nope").string() +
                ": no such directory (a model is a Hugging Face checkpoint directory holding config.json and "
                "*.safetensors)");
}

// The quantize path (lutb::parse_model_config) and the eval path (TransformerConfig::from_json) word
// the same fault the same way, "FILE: key 'K': reason", from one helper.
TEST(TransformerConfigTest, ErrorsWordedAsTheCheckpointParser) {
  const std::string where = "m/config.json";
  struct Case {
    const char* key;
    json value;  // null: erase the key
    std::string expect;
  } cases[] = {
      {"hidden_size", nullptr, "m/config.json: key 'hidden_size': required but missing"},
      {"hidden_size", "64", "m/config.json: key 'hidden_size': must be an integer, got \"64\""},
      {"hidden_size", 64.5, "m/config.json: key 'hidden_size': must be an integer, got 64.5"},
      {"vocab_size", nullptr, "m/config.json: key 'vocab_size': required but missing"},
      {"num_hidden_layers", true, "m/config.json: key 'num_hidden_layers': must be an integer, got true"},
      {"hidden_size", 0, "m/config.json: key 'hidden_size': must be positive, got 0"},
      // The supported families are listed by both parsers.
      {"model_type", nullptr,
       "m/config.json: key 'model_type': required but missing (supported: qwen3_moe, qwen2_moe, mixtral, "
       "deepseek_v3, deepseek_v2, olmoe)"},
      {"model_type", 7, "m/config.json: key 'model_type': must be a string, got 7"},
      {"rms_norm_eps", "1e-6", "m/config.json: key 'rms_norm_eps': must be a number, got \"1e-6\""},
      {"tie_word_embeddings", 1, "m/config.json: key 'tie_word_embeddings': must be true or false, got 1"},
      {"num_experts_per_tok", "2", "m/config.json: key 'num_experts_per_tok': must be an integer, got \"2\""},
      // A negative value is worded as 0 and 5 are, with the range.
      {"num_experts_per_tok", -1,
       "m/config.json: key 'num_experts_per_tok': must be in 1..4 (the experts count), got -1"},
      {"num_experts_per_tok", 0, "m/config.json: key 'num_experts_per_tok': must be in 1..4 (the experts count), got 0"},
      {"hidden_size", -1, "m/config.json: key 'hidden_size': must be positive, got -1"},
  };
  for (const auto& c : cases) {
    json j = deepseek_like();
    if (c.value.is_null()) j.erase(c.key);
    else j[c.key] = c.value;
    std::string model_msg = "no exception", ckpt_msg = "no exception";
    try {
      TransformerConfig::from_json(j, where);
    } catch (const ModelError& e) {
      model_msg = e.what();
    }
    try {
      lutb::parse_model_config(j, where);
    } catch (const lutb::ConfigError& e) {
      ckpt_msg = e.what();
    }
    // The same text from both.
    EXPECT_EQ(model_msg, c.expect) << c.key;
    EXPECT_EQ(ckpt_msg, c.expect) << c.key;
  }
  // Nested rope keys are named with their object.
  json j = deepseek_like();
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", "40"}};
  try {
    TransformerConfig::from_json(j, where);
    ADD_FAILURE() << "no exception";
  } catch (const ModelError& e) {
    EXPECT_STREQ(e.what(), "m/config.json: key 'rope_scaling.factor': must be a number, got \"40\"");
  }
  j = deepseek_like();
  j["num_attention_heads"] = 3;
  j["num_key_value_heads"] = 2;
  try {
    TransformerConfig::from_json(j, where);
    ADD_FAILURE() << "no exception";
  } catch (const ModelError& e) {
    EXPECT_STREQ(e.what(), "m/config.json: key 'num_key_value_heads': 2 must divide num_attention_heads (3)");
  }
}
