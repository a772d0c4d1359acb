// Defects a fresh new user found in session 13 (helper nu13) with unusual or corrupt config.json
// values and captured activations. Each test failed on the code before its fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "model/model_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;


const nlohmann::json& qwen_base() {
  static const nlohmann::json base = {{"model_type", "qwen3_moe"},
                                      {"hidden_size", 256},
                                      {"num_hidden_layers", 2},
                                      {"vocab_size", 64},
                                      {"num_attention_heads", 4},
                                      {"num_key_value_heads", 2},
                                      {"head_dim", 64},
                                      {"num_experts", 4},
                                      {"num_experts_per_tok", 2},
                                      {"moe_intermediate_size", 64},
                                      {"max_position_embeddings", 512},
                                      {"rms_norm_eps", 1e-6},
                                      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
  return base;
}

std::string config_error(const nlohmann::json& base, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = base;
  edit(j);
  try {
    model::TransformerConfig::from_json(j, "c.json");
  } catch (const model::ModelError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

// partial_rotary_factor 2 made the rotary dimension twice head_dim: the rotation wrote past each head,
// and past the end of the query / key buffer for the last head (lutb eval aborted in free() with
// "munmap_chunk(): invalid pointer"). Refused, naming the key.
TEST(NewUserNu13, PartialRotaryFactorAboveOneRefused) {
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["rope_parameters"]["partial_rotary_factor"] = 2.0; }),
            "c.json: key 'rope_parameters.partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 "
            "dimensions that is rotated), got 2");
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["partial_rotary_factor"] = 1.5; }),
            "c.json: key 'partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 dimensions that "
            "is rotated), got 1.5");
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["partial_rotary_factor"] = -0.5; }),
            "c.json: key 'partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 dimensions that "
            "is rotated), got -0.5");
  // A real partial rotation is still accepted: the first 32 of 64 dimensions.
  nlohmann::json half = qwen_base();
  half["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(model::TransformerConfig::from_json(half, "c.json").rope.dim, 32);
}

// A negative sliding window was read as "no window" without a word.
TEST(NewUserNu13, NegativeSlidingWindowRefused) {
  nlohmann::json mx = qwen_base();
  mx["model_type"] = "mixtral";
  mx.erase("moe_intermediate_size");
  mx["intermediate_size"] = 64;
  mx["num_local_experts"] = 4;
  mx.erase("num_experts");
  EXPECT_EQ(config_error(mx, [](nlohmann::json&) {}), "no exception");
  EXPECT_EQ(config_error(mx, [](nlohmann::json& j) { j["sliding_window"] = -5; }),
            "c.json: key 'sliding_window': must be a positive number of tokens (or 0 / null for none), got -5");
  EXPECT_EQ(config_error(qwen_base(),
                         [](nlohmann::json& j) {
                           j["use_sliding_window"] = true;
                           j["sliding_window"] = -1;
                         }),
            "c.json: key 'sliding_window': must be a positive number of tokens (or 0 / null for none), got -1");
}

// num_hidden_layers 2e9 on a 4-layer checkpoint: lutb eval ran for minutes and grew past 15 GB (per-layer
// state for every declared layer) and lutb moe took 45 s, before any error.
TEST(NewUserNu13, ImplausibleLayerCountRefused) {
  nlohmann::json j = qwen_base();
  j["num_hidden_layers"] = 2000000000;
  try {
    (void)parse_model_config(j, "c.json");
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "c.json: key 'num_hidden_layers': 2000000000 is more than lutb supports (65536; published models "
                 "have about a hundred): a corrupt config.json?");
  }
  j["num_hidden_layers"] = 65536;
  EXPECT_NO_THROW((void)parse_model_config(j, "c.json"));
}

}  // namespace
}  // namespace lutb
