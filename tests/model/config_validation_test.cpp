// config.json validation by both parsers (lutb::parse_model_config for quantize, model::load_config
// for eval and moe): every refused value names the file, the key and the reason, and values
// transformers accepts are accepted.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/checkpoint_internal.hpp"
#include "io/config_json.hpp"
#include "io/tensor_names.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::edited_model;
using test::error_of;
using test::has;
using test::small_synth;
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

// qwen_base() as Mixtral states it: intermediate_size and num_local_experts.
nlohmann::json mixtral_base() {
  nlohmann::json mx = qwen_base();
  mx["model_type"] = "mixtral";
  mx.erase("moe_intermediate_size");
  mx["intermediate_size"] = 64;
  mx["num_local_experts"] = 4;
  mx.erase("num_experts");
  return mx;
}

// The message model::TransformerConfig::from_json throws for `base` edited by `edit`, read as "c.json";
// "no exception" when it loads.
std::string config_error(const nlohmann::json& base, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = base;
  edit(j);
  return error_of<model::ModelError>([&] { model::TransformerConfig::from_json(j, "c.json"); });
}

json tiny_deepseek_config() {
  return {{"model_type", "deepseek_v3"}, {"hidden_size", 256},        {"num_hidden_layers", 4},
          {"vocab_size", 2048},          {"num_experts_per_tok", 4},  {"n_routed_experts", 16},
          {"moe_intermediate_size", 128}, {"intermediate_size", 512}, {"n_shared_experts", 1},
          {"first_k_dense_replace", 1},  {"n_group", 4},              {"topk_group", 2},
          {"norm_topk_prob", true},      {"routed_scaling_factor", 2.5}, {"num_attention_heads", 4},
          {"kv_lora_rank", 64},          {"q_lora_rank", 96},         {"qk_nope_head_dim", 32},
          {"qk_rope_head_dim", 32},      {"v_head_dim", 32}};
}

json tiny_qwen_config() {
  return {{"model_type", "qwen3_moe"},     {"hidden_size", 256},         {"num_hidden_layers", 2},
          {"vocab_size", 64},              {"num_attention_heads", 4},   {"num_key_value_heads", 2},
          {"head_dim", 64},                {"num_experts", 4},           {"num_experts_per_tok", 2},
          {"moe_intermediate_size", 64}};
}

json softmax_family_config(const char* type) {
  return {{"model_type", type},           {"hidden_size", 64},   {"num_hidden_layers", 2},
          {"vocab_size", 100},            {"num_experts", 4},    {"num_experts_per_tok", 2},
          {"moe_intermediate_size", 32},  {"intermediate_size", 32}};
}

// head_dim 2e9 (or DeepSeek's qk_rope_head_dim 2e9) in a corrupt config.json, and a negative MLA width, are
// refused when config.json is read, before a rotary table of 1e9 FP32 values is built or a tensor is compared
// with an impossible shape.
TEST(ConfigValidation, ImplausibleHeadWidthsRefused) {
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json&) {}), "no exception");
  // The widths themselves: the head_dim, qk_rope_head_dim, v_head_dim, qk_nope_head_dim, kv_lora_rank and
  // q_lora_rank rows of ConfigValue below.

  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json&) {}), "no exception");
}

TEST(ConfigValidation, ForeignQuantizationConfigIsRefused) {
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

// quantization_config.quant_method 5 (or a list) is refused by parse_lutb_quant_config, which lutb quantize /
// eval / moe call on every checkpoint, naming the file and the key, not as nlohmann's type_error. A
// quantization_config without a quant_method, or one that is not an object, is refused as transformers refuses
// it ("The model's quantization config ... has no `quant_method` attribute"), never ignored.
TEST(ConfigValidation, MalformedQuantizationConfigNamesTheKey) {
  json j = tiny_qwen_config();
  ASSERT_NO_THROW(parse_model_config(j, "m/config.json"));

  j["quantization_config"] = {{"quant_method", 5}};
  EXPECT_EQ(error_of<ConfigError>([&] { parse_lutb_quant_config(j, "m/config.json"); }),
            "m/config.json: key 'quantization_config.quant_method': must be a string, got 5");
  EXPECT_EQ(error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'quantization_config.quant_method': must be a string, got 5");
  j["quantization_config"] = {{"quant_method", json::array({"lut_b"})}};
  EXPECT_EQ(error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'quantization_config.quant_method': must be a string, got [\"lut_b\"]");

  j["quantization_config"] = {{"bits", 4}, {"group_size", 128}};
  std::string m = error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); });
  EXPECT_EQ(m.rfind("m/config.json: key 'quantization_config.quant_method': required but missing", 0), 0u) << m;
  EXPECT_NE(m.find("remove quantization_config from m/config.json"), std::string::npos) << m;
  j["quantization_config"] = {{"quant_method", ""}};
  m = error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); });
  EXPECT_EQ(m.rfind("m/config.json: key 'quantization_config.quant_method': is empty", 0), 0u) << m;

  j["quantization_config"] = "lut_b";
  EXPECT_EQ(error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'quantization_config': must be an object, got \"lut_b\"");

  // What loads still loads: no quantization_config, null, and LUT-B's own.
  j["quantization_config"] = nullptr;
  EXPECT_NO_THROW(parse_model_config(j, "m/config.json"));
  j["quantization_config"] = {{"quant_method", "lut_b"}};
  EXPECT_NO_THROW(parse_model_config(j, "m/config.json"));
  EXPECT_TRUE(parse_lutb_quant_config(j, "m/config.json"));
}

// scoring_func, topk_method, n_group, topk_group and routed_scaling_factor are DeepSeek's routing keys (spec
// 5). The softmax top-k routers of Qwen2/3-MoE, Mixtral and OLMoE have no such parameters and transformers
// ignores the keys in their config.json, so lutb does too: "routed_scaling_factor": 2.5 does not scale a
// qwen3_moe expert's output, "scoring_func": "sigmoid" does not switch it to grouped routing, and "n_group": 3
// (which does not divide 4 experts) is not refused.
TEST(ConfigValidation, DeepSeekRoutingKeysAreIgnoredBySoftmaxFamilies) {
  for (const char* type : {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe"}) {
    SCOPED_TRACE(type);
    json j = softmax_family_config(type);
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
    j["routed_scaling_factor"] = 2.5;
    j["n_group"] = 3;
    j["topk_group"] = 2;
    ModelConfig c;
    ASSERT_NO_THROW(c = parse_model_config(j, "m/config.json"));
    EXPECT_EQ(c.scoring_func, ScoringFunc::softmax);
    EXPECT_EQ(c.topk_method, "");
    EXPECT_EQ(c.n_group, 1);
    EXPECT_EQ(c.topk_group, 1);
    EXPECT_EQ(c.routed_scaling_factor, 1.0);
    // Values DeepSeek would refuse are not read either.
    j["scoring_func"] = "relu";
    j["routed_scaling_factor"] = -1;
    EXPECT_NO_THROW(parse_model_config(j, "m/config.json"));
  }
  // DeepSeek-V3 still reads them all (control).
  json d = softmax_family_config("deepseek_v3");
  d["num_experts"] = 8;
  d["n_group"] = 4;
  d["topk_group"] = 2;
  d["routed_scaling_factor"] = 2.5;
  const ModelConfig c = parse_model_config(d, "m/config.json");
  EXPECT_EQ(c.scoring_func, ScoringFunc::sigmoid);
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
}

// The same through the whole model: tiny-qwen3-moe with DeepSeek's keys added to its config.json has
// transformers' loss, the checkpoint's own (3.843 nats over 4 windows; 4.040 with routed_scaling_factor 2.5
// applied, 3.919 with sigmoid scoring).
TEST(ConfigValidation, QwenLossIgnoresDeepSeekRoutingKeys) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-qwen3-moe");
  namespace fs = std::filesystem;
  const auto tokens = model::load_token_ids(dir / "val_tokens.safetensors");
  model::EvalOptions eo;
  eo.max_windows = 2;
  auto loss = [&](const fs::path& d) {
    model::CheckpointMoe moe(d, model::MoeOptions{});
    model::LanguageModel lm = model::LanguageModel::load(d, moe.factory());
    return model::evaluate(lm, tokens, eo).val_loss;
  };
  const double reference = loss(dir);
  test::TempDir t;
  for (const auto& [key, value] : {std::pair<const char*, json>{"routed_scaling_factor", 2.5},
                                   std::pair<const char*, json>{"scoring_func", "sigmoid"}}) {
    SCOPED_TRACE(key);
    const fs::path d = t.path / key;
    fs::create_directories(d);
    for (const char* f : {"model.safetensors", "val_tokens.safetensors"}) fs::create_symlink(dir / f, d / f);
    json cfg;
    std::ifstream(dir / "config.json") >> cfg;
    cfg[key] = value;
    std::ofstream(d / "config.json") << cfg.dump(1);
    EXPECT_NEAR(loss(d), reference, 1e-6);
  }
}

// Mixtral's expert width intermediate_size: null (or absent, with no moe_intermediate_size) is reported as
// missing, not as the 0 the file never held.
TEST(ConfigValidation, MixtralNullIntermediateSizeIsMissingNotZero) {
  nlohmann::json j = {{"model_type", "mixtral"}, {"hidden_size", 64},       {"num_hidden_layers", 1},
                      {"vocab_size", 32},        {"num_local_experts", 2},  {"num_experts_per_tok", 1},
                      {"intermediate_size", nullptr}};
  std::string err = error_of([&] { (void)parse_model_config(j, "x/config.json"); });
  EXPECT_TRUE(has(err, "x/config.json: key 'intermediate_size': required but missing or null (Mixtral's expert width; "
                       "nor is 'moe_intermediate_size' given)"))
      << err;
  j.erase("intermediate_size");
  err = error_of([&] { (void)parse_model_config(j, "x/config.json"); });
  EXPECT_TRUE(has(err, "key 'intermediate_size': required but missing or null")) << err;
  j["intermediate_size"] = 0;
  err = error_of([&] { (void)parse_model_config(j, "x/config.json"); });
  EXPECT_TRUE(has(err, "key 'intermediate_size': the expert width must be positive, got 0")) << err;
  j["intermediate_size"] = 32;
  EXPECT_EQ(parse_model_config(j, "x/config.json").moe_intermediate_size, 32);
}

// DeepSeek's topk_method is checked (a typo is refused, not routed as noaux_tc or greedy), and
// routed_scaling_factor must be positive (a negative one would flip every expert output's sign).
TEST(ConfigValidation, DeepseekRoutingKeysAreChecked) {
  SynthOptions o = small_synth();
  o.family = ModelFamily::deepseek_v3;
  const nlohmann::json base = synth_config(o).raw;
  ASSERT_EQ(base.at("topk_method"), "noaux_tc");
  const auto with = [&](const nlohmann::json& patch) {
    nlohmann::json j = base;
    j.merge_patch(patch);
    return error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); });
  };
  const std::string accepted =
      "(accepted: \"noaux_tc\" with scoring_func \"sigmoid\"; \"greedy\" or \"group_limited_greedy\" with scoring_func "
      "\"softmax\")";
  EXPECT_EQ(with({{"topk_method", "noaux-tc"}}), "m/config.json: key 'topk_method': \"noaux-tc\" is not supported " + accepted);
  EXPECT_EQ(with({{"model_type", "deepseek_v2"}, {"topk_method", "group_limited"}}),
            "m/config.json: key 'topk_method': \"group_limited\" is not supported " + accepted);
  EXPECT_EQ(with({{"topk_method", "greedy"}}),
            "m/config.json: key 'topk_method': \"greedy\" with scoring_func \"sigmoid\" is not supported (accepted: "
            "\"noaux_tc\" with sigmoid scores; the scoring_func default is \"sigmoid\" for deepseek_v3)");
  EXPECT_EQ(with({{"topk_method", "noaux_tc"}, {"scoring_func", "softmax"}}),
            "m/config.json: key 'topk_method': \"noaux_tc\" with scoring_func \"softmax\" is not supported (accepted: "
            "\"greedy\" or \"group_limited_greedy\" with softmax scores; the scoring_func default is \"sigmoid\" for "
            "deepseek_v3)");
  // What the routing implements is accepted.
  EXPECT_EQ(with({{"topk_method", "noaux_tc"}}), "no exception");
  EXPECT_EQ(with({{"topk_method", "greedy"}, {"scoring_func", "softmax"}}), "no exception");
  EXPECT_EQ(with({{"model_type", "deepseek_v2"}, {"topk_method", "group_limited_greedy"}, {"scoring_func", nullptr}}),
            "no exception");
  // routed_scaling_factor: finite and > 0.
  EXPECT_EQ(with({{"routed_scaling_factor", -2.5}}),
            "m/config.json: key 'routed_scaling_factor': must be a finite number > 0, got -2.5");
  EXPECT_EQ(with({{"routed_scaling_factor", 0}}),
            "m/config.json: key 'routed_scaling_factor': must be a finite number > 0, got 0");
  EXPECT_EQ(with({{"routed_scaling_factor", std::numeric_limits<double>::infinity()}}),
            "m/config.json: key 'routed_scaling_factor': must be a finite number > 0, got inf");
  nlohmann::json ok = base;
  ok["routed_scaling_factor"] = 2.5;
  EXPECT_EQ(parse_model_config(ok, "m/config.json").routed_scaling_factor, 2.5);
}

// Grouped-routing faults are refused when config.json is read, naming the file and the key, not when a layer
// is built ("router of deepseek_v3: RouterConfig: top_k=5 exceeds ...").
TEST(ConfigValidation, GroupedRoutingKeysNameTheFileAndKey) {
  SynthOptions o = small_synth();
  o.family = ModelFamily::deepseek_v3;
  nlohmann::json j = synth_config(o).raw;  // 4 experts
  j["n_group"] = 2;
  j["topk_group"] = 1;
  j["num_experts_per_tok"] = 3;
  EXPECT_EQ(error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'num_experts_per_tok': 3 exceeds the 2 experts of the groups the router keeps "
            "(topk_group 1 x 2 experts per group: 4 experts in n_group 2)");
  j["num_experts_per_tok"] = 2;
  EXPECT_EQ(parse_model_config(j, "m/config.json").n_group, 2);
  j["n_group"] = 4;
  EXPECT_EQ(error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'n_group': 4 groups of the 4 experts leave 1 expert per group; sigmoid (noaux_tc) "
            "routing scores each group by the sum of its top 2 experts, so a group needs at least 2");
  // Softmax greedy routing does not use the groups: accepted as before.
  j["scoring_func"] = "softmax";
  j["topk_method"] = "greedy";
  j["num_experts_per_tok"] = 3;
  EXPECT_EQ(parse_model_config(j, "m/config.json").num_experts_per_tok, 3);
  j["topk_method"] = "group_limited_greedy";
  j["n_group"] = 2;
  EXPECT_TRUE(has(error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); }),
                  "m/config.json: key 'num_experts_per_tok': 3 exceeds the 2 experts"));
}

// partial_rotary_factor must be at most 1: a factor of 2 makes the rotary dimension twice head_dim, and the
// rotation would write past each head and past the end of the query / key buffer. Refused, naming the key.
TEST(ConfigValidation, PartialRotaryFactorAboveOneRefused) {
  // The refused factors: the partial_rotary_factor rows of ConfigValue below.
  // A real partial rotation is still accepted: the first 32 of 64 dimensions.
  nlohmann::json half = qwen_base();
  half["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(model::TransformerConfig::from_json(half, "c.json").rope.dim, 32);
}

// A negative sliding window is refused, not read as "no window".
TEST(ConfigValidation, NegativeSlidingWindowRefused) {
  // Mixtral's own window: the sliding_window row of ConfigValue below.
  EXPECT_EQ(config_error(mixtral_base(), [](nlohmann::json&) {}), "no exception");
  EXPECT_EQ(config_error(qwen_base(),
                         [](nlohmann::json& j) {
                           j["use_sliding_window"] = true;
                           j["sliding_window"] = -1;
                         }),
            "c.json: key 'sliding_window': must be a positive number of tokens (or 0 / null for none), got -1");
}

// num_hidden_layers beyond 65536 (2e9 on a 4-layer checkpoint) is refused at once: per-layer state for every
// declared layer would take minutes and many GB before any error.
TEST(ConfigValidation, ImplausibleLayerCountRefused) {
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

// DeepSeek's first_k_dense_replace -1 is refused naming the key: it would make layer 0, dense in the
// checkpoint, a MoE layer whose router is "not found".
TEST(ConfigValidation, NegativeFirstKDenseReplaceRefused) {
  nlohmann::json j = qwen_base();
  j["model_type"] = "deepseek_v3";
  j.erase("num_experts");
  j["n_routed_experts"] = 4;
  j["first_k_dense_replace"] = -1;
  try {
    (void)parse_model_config(j, "c.json");
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "c.json: key 'first_k_dense_replace': must be >= 0 (the number of leading dense layers), got -1");
  }
  j["first_k_dense_replace"] = 0;
  EXPECT_TRUE(parse_model_config(j, "c.json").is_moe_layer(0));
}

// A config.json that is valid JSON but not an object ([], 1, null) is refused as not a JSON object, not as a
// missing model_type.
TEST(ConfigValidation, ConfigThatIsNotAnObjectSaysSo) {
  for (const nlohmann::json& j : {nlohmann::json::array(), nlohmann::json(1), nlohmann::json()})
    EXPECT_EQ(config_error(j, [](nlohmann::json&) {}), "c.json: not a JSON object") << j.dump();
}

// config.json's rope values are checked at load with transformers' rules (factor >= 1, beta_fast not below
// beta_slow, ...), naming the key: with them the rotary table would not be finite and the loss NaN.
TEST(ConfigValidation, RopeValuesCheckedAtLoad) {
  const nlohmann::json base = {{"model_type", "qwen3_moe"},
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
                               {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
  const auto err = [&](const nlohmann::json& rope) {
    nlohmann::json j = base;
    j["rope_parameters"] = rope;
    try {
      (void)model::TransformerConfig::from_json(j, "c.json");
    } catch (const model::ModelError& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  using J = nlohmann::json;
  // The three configurations of the report.
  EXPECT_EQ(err(J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 0}, {"rope_theta", 10000.0}}),
            "c.json: key 'rope_parameters.beta_fast': must be a positive finite number for rope_type \"yarn\" (a "
            "number of rotations; default 32), got 0");
  EXPECT_EQ(err(J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_slow", -1}, {"rope_theta", 1}}),
            "c.json: key 'rope_parameters.rope_theta': must be greater than 1 for rope_type \"yarn\" (its correction "
            "range divides by ln(rope_theta)), got 1");
  EXPECT_EQ(err(J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_slow", -1}, {"rope_theta", 10000.0}}),
            "c.json: key 'rope_parameters.beta_slow': must be a positive finite number for rope_type \"yarn\" (a "
            "number of rotations; default 1), got -1");
  EXPECT_EQ(err(J{{"rope_type", "linear"}, {"factor", 1e-300}, {"rope_theta", 10000.0}}),
            "c.json: key 'rope_parameters.factor': must be a finite number >= 1 for rope_type \"linear\" (the factor "
            "by which the context is extended, as transformers requires), got 1e-300");
  // transformers' other rules.
  EXPECT_EQ(err(J{{"rope_type", "yarn"}, {"factor", 0.5}, {"rope_theta", 10000.0}}),
            "c.json: key 'rope_parameters.factor': must be a finite number >= 1 for rope_type \"yarn\" (the factor by "
            "which the context is extended, as transformers requires), got 0.5");
  EXPECT_EQ(err(J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 1}, {"beta_slow", 2}, {"rope_theta", 10000.0}}),
            "c.json: key 'rope_parameters.beta_fast': must not be below beta_slow for rope_type \"yarn\" "
            "(transformers' rule), got beta_fast 1 and beta_slow 2");
  EXPECT_EQ(err(J{{"rope_type", "yarn"}, {"factor", 4}, {"attention_factor", -1}, {"rope_theta", 10000.0}}),
            "c.json: key 'rope_parameters.attention_factor': must be a positive finite number for rope_type \"yarn\", "
            "got -1");
  // A valid yarn configuration still loads.
  EXPECT_EQ(err(J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 32}, {"beta_slow", 1}, {"rope_theta", 10000.0}}),
            "no exception");
  // The guard behind the checks: the table built from the values must be finite (rope_theta 1e-300 is
  // positive, but 0 in FP32, and its frequencies 1 / 0^x infinite).
  EXPECT_EQ(err(J{{"rope_type", "default"}, {"rope_theta", 1e-300}}),
            "c.json: key 'rope_parameters': rope type \"default\": the rotary frequency 1 of 32 computed from the rope "
            "values (rope_theta 1e-300, factor 1) is inf, not a finite number (its values cannot be used)");
  model::RopeConfig r;
  r.dim = 4;
  r.theta = 1e-300;
  EXPECT_THROW((void)model::make_rope_table(r), model::ModelError);
}

// lutb eval on a model whose config.json has such values names the key, not the tensors.
TEST(ConfigValidation, EvalNamesTheRopeKeyNotTheTensors) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const fs::path m = edited_model(t.path / "m", src, {});
  nlohmann::json j;
  std::ifstream(m / "config.json") >> j;
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 0}, {"rope_theta", 10000.0}};
  fs::remove(m / "config.json");
  std::ofstream(m / "config.json") << j.dump(2);
  const test::CliResult r = test::run_cli("eval " + test::q(m) + " --max-windows 1");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_EQ(r.err, "lutb: error: " + (m / "config.json").string() +
                       ": key 'rope_parameters.beta_fast': must be a positive finite number for rope_type \"yarn\" (a "
                       "number of rotations; default 32), got 0\n");
}

// config.json values that would make `lutb eval` fail later ("rope dimension 0 must be even and positive") or
// compute a NaN loss (a negative rms_norm_eps), and rope types the table does not implement, are refused at
// load naming the file and the key.
TEST(ConfigValidation, ConfigRopeAndNormValuesNameTheKey) {
  EXPECT_NO_THROW(model::TransformerConfig::from_json(qwen_base(), "c.json"));
  // One key at a time: the head_dim, rms_norm_eps, rope_type and rope_theta rows of ConfigValue
  // below; here the values that take two keys to state.
  const auto err = [](const std::function<void(nlohmann::json&)>& edit) { return config_error(qwen_base(), edit); };
  EXPECT_EQ(err([](nlohmann::json& j) {
              j["rope_parameters"]["rope_type"] = "linear";
              j["rope_parameters"]["factor"] = 0;
            }),
            "c.json: key 'rope_parameters.factor': must be a finite number >= 1 for rope_type \"linear\" (the factor "
            "by which the context is extended, as transformers requires), got 0");
  EXPECT_EQ(err([](nlohmann::json& j) {
              j["rope_parameters"]["rope_type"] = "yarn";
              j["rope_parameters"]["factor"] = 4;
              j.erase("max_position_embeddings");
            }),
            "c.json: key 'rope_parameters.original_max_position_embeddings': required for rope_type \"yarn\" (or "
            "max_position_embeddings), and positive");
}

// One key, one value, one message: each row sets `key` (a '.' path into config.json) of a valid config
// of `family` to `value` and expects model::TransformerConfig::from_json's message, "no exception"
// where the value is valid (the edges of the ranges). Every message names the file and the key.
struct ConfigValueCase {
  const char* name;    // the row's name in the test's name
  const char* family;  // qwen3_moe, deepseek_v3 or mixtral: qwen_base(), deepseek_base(), mixtral_base()
  const char* key;
  nlohmann::json value;
  const char* expected;
};

class ConfigValue : public ::testing::TestWithParam<ConfigValueCase> {};

TEST_P(ConfigValue, IsCheckedWhenRead) {
  const ConfigValueCase& c = GetParam();
  const std::string family = c.family;
  const nlohmann::json base = family == "deepseek_v3" ? deepseek_base()
                              : family == "mixtral"   ? mixtral_base()
                                                      : qwen_base();
  const std::string key = c.key;
  const auto set = [&](nlohmann::json& j) {
    nlohmann::json* at = &j;
    std::size_t from = 0;
    for (std::size_t dot; (dot = key.find('.', from)) != std::string::npos; from = dot + 1)
      at = &(*at)[key.substr(from, dot - from)];
    (*at)[key.substr(from)] = c.value;
  };
  EXPECT_EQ(config_error(base, set), c.expected) << c.family << ": " << c.key << " = " << c.value.dump();
}

const ConfigValueCase kConfigValueCases[] = {
    // Head widths: implausible sizes are refused when config.json is read, before a rotary table of 1e9
    // FP32 values is built; a non-positive head_dim keeps the rotary dimension's wording.
    {"head_dim_2e9", "qwen3_moe", "head_dim", 2000000000,
     "c.json: key 'head_dim': 2000000000 is more than lutb supports (65536; published models use 64-256): a "
     "corrupt config.json?"},
    {"head_dim_negative", "qwen3_moe", "head_dim", -64,
     "c.json: key 'head_dim': head_dim -64 x partial_rotary_factor 1 gives a rotary dimension of -64; it must "
     "be even and positive"},
    {"head_dim_zero", "qwen3_moe", "head_dim", 0,
     "c.json: key 'head_dim': head_dim 0 x partial_rotary_factor 1 gives a rotary dimension of 0; it must be "
     "even and positive"},
    {"head_dim_65536", "qwen3_moe", "head_dim", 65536, "no exception"},
    {"qk_rope_head_dim_2e9", "deepseek_v3", "qk_rope_head_dim", 2000000000,
     "c.json: key 'qk_rope_head_dim': 2000000000 is more than lutb supports (65536; published models use "
     "64-256): a corrupt config.json?"},
    {"v_head_dim_negative", "deepseek_v3", "v_head_dim", -1, "c.json: key 'v_head_dim': must be positive, got -1"},
    {"qk_nope_head_dim_zero", "deepseek_v3", "qk_nope_head_dim", 0,
     "c.json: key 'qk_nope_head_dim': must be positive, got 0"},
    {"kv_lora_rank_negative", "deepseek_v3", "kv_lora_rank", -8, "c.json: key 'kv_lora_rank': must be positive, got -8"},
    {"q_lora_rank_negative", "deepseek_v3", "q_lora_rank", -1,
     "c.json: key 'q_lora_rank': must be positive (or 0 / null for no query compression), got -1"},
    {"q_lora_rank_null", "deepseek_v3", "q_lora_rank", nullptr, "no exception"},
    // partial_rotary_factor in (0, 1]: a factor of 2 would rotate past each head.
    {"rope_partial_rotary_factor_2", "qwen3_moe", "rope_parameters.partial_rotary_factor", 2.0,
     "c.json: key 'rope_parameters.partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 "
     "dimensions that is rotated), got 2"},
    {"partial_rotary_factor_1_5", "qwen3_moe", "partial_rotary_factor", 1.5,
     "c.json: key 'partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 dimensions that "
     "is rotated), got 1.5"},
    {"partial_rotary_factor_negative", "qwen3_moe", "partial_rotary_factor", -0.5,
     "c.json: key 'partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 dimensions that "
     "is rotated), got -0.5"},
    // A negative sliding window is refused, not read as "no window".
    {"sliding_window_negative", "mixtral", "sliding_window", -5,
     "c.json: key 'sliding_window': must be a positive number of tokens (or 0 / null for none), got -5"},
    // rms_norm_eps >= 0: rsqrt(mean_sq + eps) of a negative sum is NaN.
    {"rms_norm_eps_negative", "qwen3_moe", "rms_norm_eps", -1,
     "c.json: key 'rms_norm_eps': must be a finite number >= 0, got -1"},
    // Rope types and values the rotary table implements.
    {"rope_type_dynamic", "qwen3_moe", "rope_parameters.rope_type", "dynamic",
     "c.json: key 'rope_parameters.rope_type': \"dynamic\" is not supported (default, linear, yarn)"},
    {"rope_theta_negative", "qwen3_moe", "rope_parameters.rope_theta", -5,
     "c.json: key 'rope_parameters.rope_theta': must be a positive finite number, got -5"},
};

INSTANTIATE_TEST_SUITE_P(ConfigValidation, ConfigValue, ::testing::ValuesIn(kConfigValueCases),
                         [](const ::testing::TestParamInfo<ConfigValueCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace lutb
