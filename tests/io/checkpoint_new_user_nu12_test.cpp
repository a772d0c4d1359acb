// Defect a new user found (session 12, helper nu12): a checkpoint quantised by another method was
// read as if its weights were plain floats. DeepSeek-V3's official release is FP8 (F8_E4M3 weights
// with weight_scale_inv block scales, quantization_config quant_method "fp8"): lutb eval read such
// an F8_E4M3 attention weight without its scale (a loss of 7.84 nats instead of 3.89, with only a
// warning that the *_scale_inv tensor was not read), lutb quantize wrote a "lut_b" checkpoint over
// the FP8 config, and an FP8 expert was refused as "a misspelt name?". config.json now refuses a
// quantization_config that is neither LUT-B nor absent, naming the file, the key and what to do.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"

namespace lutb {
namespace {

using nlohmann::json;

json tiny_deepseek_config() {
  return {{"model_type", "deepseek_v3"}, {"hidden_size", 256},        {"num_hidden_layers", 4},
          {"vocab_size", 2048},          {"num_experts_per_tok", 4},  {"n_routed_experts", 16},
          {"moe_intermediate_size", 128}, {"intermediate_size", 512}, {"n_shared_experts", 1},
          {"first_k_dense_replace", 1},  {"n_group", 4},              {"topk_group", 2},
          {"norm_topk_prob", true},      {"routed_scaling_factor", 2.5}, {"num_attention_heads", 4},
          {"kv_lora_rank", 64},          {"q_lora_rank", 96},         {"qk_nope_head_dim", 32},
          {"qk_rope_head_dim", 32},      {"v_head_dim", 32}};
}

TEST(ModelConfigNewUserNu12, ForeignQuantizationConfigIsRefused) {
  json j = tiny_deepseek_config();
  ASSERT_NO_THROW(parse_model_config(j, "m/config.json"));
  j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}};
  try {
    parse_model_config(j, "m/config.json");
    FAIL() << "an FP8 checkpoint's config was accepted";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("m/config.json: key 'quantization_config.quant_method': \"fp8\" is not supported"),
              std::string::npos) << m;
    EXPECT_NE(m.find("weight_scale_inv"), std::string::npos) << m;
    EXPECT_NE(m.find("dequantise"), std::string::npos) << m;
  }
  j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}};
  EXPECT_THROW(parse_model_config(j, "m/config.json"), ConfigError);
  j["quantization_config"] = {{"quant_method", "compressed-tensors"}, {"format", "pack-quantized"}};
  EXPECT_THROW(parse_model_config(j, "m/config.json"), ConfigError);
  // LUT-B checkpoints (lutb's own and compressed-tensors "lut-b") still load.
  j["quantization_config"] = {{"quant_method", "lut_b"}};
  EXPECT_NO_THROW(parse_model_config(j, "m/config.json"));
  j["quantization_config"] = {{"quant_method", "compressed-tensors"}, {"format", "lut-b"}};
  EXPECT_NO_THROW(parse_model_config(j, "m/config.json"));
}

}  // namespace
}  // namespace lutb
