// Defects a fresh new user found in session 15 (helper nu15) with unusual config.json files. Each
// test failed on the code before its fix.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"

namespace lutb {
namespace {

using nlohmann::json;

json tiny_qwen_config() {
  return {{"model_type", "qwen3_moe"},     {"hidden_size", 256},         {"num_hidden_layers", 2},
          {"vocab_size", 64},              {"num_attention_heads", 4},   {"num_key_value_heads", 2},
          {"head_dim", 64},                {"num_experts", 4},           {"num_experts_per_tok", 2},
          {"moe_intermediate_size", 64}};
}

// The message of the ConfigError `f` throws; "wrong exception type: ..." for any other exception.
template <class F>
std::string config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

// quantization_config.quant_method 5 (or a list) escaped from parse_lutb_quant_config, which lutb
// quantize / eval / moe call on every checkpoint, as "[json.exception.type_error.302] type must be
// string, but is number": no file, no key. A quantization_config without a quant_method, or one
// that is not an object, was ignored and the weights read as plain floats (transformers refuses
// both: "The model's quantization config ... has no `quant_method` attribute").
TEST(ModelConfigNewUserNu15, MalformedQuantizationConfigNamesTheKey) {
  json j = tiny_qwen_config();
  ASSERT_NO_THROW(parse_model_config(j, "m/config.json"));

  j["quantization_config"] = {{"quant_method", 5}};
  EXPECT_EQ(config_error([&] { parse_lutb_quant_config(j, "m/config.json"); }),
            "m/config.json: key 'quantization_config.quant_method': must be a string, got 5");
  EXPECT_EQ(config_error([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'quantization_config.quant_method': must be a string, got 5");
  j["quantization_config"] = {{"quant_method", json::array({"lut_b"})}};
  EXPECT_EQ(config_error([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'quantization_config.quant_method': must be a string, got [\"lut_b\"]");

  j["quantization_config"] = {{"bits", 4}, {"group_size", 128}};
  std::string m = config_error([&] { parse_model_config(j, "m/config.json"); });
  EXPECT_EQ(m.rfind("m/config.json: key 'quantization_config.quant_method': required but missing", 0), 0u) << m;
  EXPECT_NE(m.find("remove quantization_config from m/config.json"), std::string::npos) << m;
  j["quantization_config"] = {{"quant_method", ""}};
  m = config_error([&] { parse_model_config(j, "m/config.json"); });
  EXPECT_EQ(m.rfind("m/config.json: key 'quantization_config.quant_method': is empty", 0), 0u) << m;

  j["quantization_config"] = "lut_b";
  EXPECT_EQ(config_error([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'quantization_config': must be an object, got \"lut_b\"");

  // What loads still loads: no quantization_config, null, and LUT-B's own.
  j["quantization_config"] = nullptr;
  EXPECT_NO_THROW(parse_model_config(j, "m/config.json"));
  j["quantization_config"] = {{"quant_method", "lut_b"}};
  EXPECT_NO_THROW(parse_model_config(j, "m/config.json"));
  EXPECT_TRUE(parse_lutb_quant_config(j, "m/config.json"));
}

}  // namespace
}  // namespace lutb
