// Defects a fresh new user found in session 14 (helper nu14) with unusual files and arguments. Each
// test failed on the code before its fix.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <string>

#include <fcntl.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/config_json.hpp"
#include "io/tensor_names.hpp"
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

const nlohmann::json& deepseek_base() {
  static const nlohmann::json base = {
      {"model_type", "deepseek_v3"}, {"hidden_size", 256},    {"num_hidden_layers", 2},    {"vocab_size", 64},
      {"num_attention_heads", 4},    {"n_routed_experts", 4}, {"num_experts_per_tok", 2},  {"moe_intermediate_size", 64},
      {"kv_lora_rank", 64},          {"q_lora_rank", 96},     {"qk_nope_head_dim", 32},    {"qk_rope_head_dim", 32},
      {"v_head_dim", 32},            {"first_k_dense_replace", 1}, {"intermediate_size", 512}};
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

// head_dim 2e9 (or DeepSeek's qk_rope_head_dim 2e9) in a corrupt config.json: lutb eval built a rotary
// table of 1e9 FP32 values before comparing the attention tensors' shapes with it (71 s, 3.9 GB of
// memory, then "q_proj.weight has shape [256, 256], expected [8000000000, 256]"). A negative MLA width
// was reported as a tensor "expected [124, 64]". Both are refused when config.json is read.
TEST(NewUserNu14, ImplausibleHeadWidthsRefused) {
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json&) {}), "no exception");
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["head_dim"] = 2000000000; }),
            "c.json: key 'head_dim': 2000000000 is more than lutb supports (65536; published models use 64-256): a "
            "corrupt config.json?");
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["head_dim"] = -64; }),
            "c.json: key 'head_dim': must be positive, got -64");
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["head_dim"] = 65536; }), "no exception");

  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json&) {}), "no exception");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["qk_rope_head_dim"] = 2000000000; }),
            "c.json: key 'qk_rope_head_dim': 2000000000 is more than lutb supports (65536; published models use "
            "64-256): a corrupt config.json?");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["v_head_dim"] = -1; }),
            "c.json: key 'v_head_dim': must be positive, got -1");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["qk_nope_head_dim"] = 0; }),
            "c.json: key 'qk_nope_head_dim': must be positive, got 0");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["kv_lora_rank"] = -8; }),
            "c.json: key 'kv_lora_rank': must be positive, got -8");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["q_lora_rank"] = -1; }),
            "c.json: key 'q_lora_rank': must be positive (or 0 / null for no query compression), got -1");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["q_lora_rank"] = nullptr; }), "no exception");
}

}  // namespace
}  // namespace lutb
