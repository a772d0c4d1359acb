// config.json validation by the three readers of a checkpoint's configuration: lutb::parse_model_config
// (lutb quantize), model::TransformerConfig::from_json (lutb eval and moe, which calls parse_model_config
// for the MoE keys) and lutb::parse_lutb_quant_config (the LUT-B quantization_config of a quantised
// checkpoint). Every refused value names the file, the key and the reason, and values transformers
// accepts are accepted. One table holds the refusals: key, value, expected message.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <ostream>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::edited_model;
using test::error_of;
using test::TempDir;

// The file name every table row's message starts with.
constexpr const char* kWhere = "m/config.json";

// Valid configurations of the three attention layouts: grouped-query heads with an explicit head_dim
// (Qwen3-MoE), multi-head latent attention (DeepSeek-V3), and Mixtral's naming of the expert keys.
// Each has 4 experts and top-2 routing.
json qwen_base() {
  return {{"model_type", "qwen3_moe"},
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
}

json deepseek_base() {
  return {{"model_type", "deepseek_v3"}, {"hidden_size", 256},    {"num_hidden_layers", 2},    {"vocab_size", 64},
          {"num_attention_heads", 4},    {"n_routed_experts", 4}, {"num_experts_per_tok", 2},  {"moe_intermediate_size", 64},
          {"kv_lora_rank", 64},          {"q_lora_rank", 96},     {"qk_nope_head_dim", 32},    {"qk_rope_head_dim", 32},
          {"v_head_dim", 32},            {"first_k_dense_replace", 1}, {"intermediate_size", 512}};
}

// qwen_base() as Mixtral states it: intermediate_size and num_local_experts.
json mixtral_base() {
  json mx = qwen_base();
  mx["model_type"] = "mixtral";
  mx.erase("moe_intermediate_size");
  mx["intermediate_size"] = 64;
  mx["num_local_experts"] = 4;
  mx.erase("num_experts");
  return mx;
}

// qwen_base() of a checkpoint lutb quantised: its quantization_config as lutb writes it.
json lutb_base() {
  json j = qwen_base();
  j["quantization_config"] = {{"quant_method", "lut_b"},  {"format", "lut-b"},     {"tile", {8, 64}},
                              {"index_bits", 3},          {"codebook_size", 8},    {"codebook_dtype", "float8_e4m3fn"},
                              {"scale_dtype", "ue8m0"},   {"activation", "mxfp8"}, {"activation_block", 32},
                              {"fitter", "optimal"}};
  return j;
}

// Which reader a row asks.
enum class Reader {
  both,        // TransformerConfig::from_json and parse_model_config, with the same message
  model,       // TransformerConfig::from_json: the model's own keys (attention, rotary, activation)
  lutb_quant,  // parse_lutb_quant_config
};

enum class Base { qwen, deepseek, mixtral, lutb };

// A value that stands for "the key is removed".
const json kAbsent = json(json::value_t::discarded);

// One key, one value, one message: the row sets `key` (a '.' path into config.json; "" for the whole
// file) of the valid config `base` to `value`, after setting the top-level keys of `also`, and
// expects `message` after "m/config.json: " from each reader, or "no exception" where the value is
// valid (the edges of the ranges, what transformers accepts).
struct ConfigCase {
  const char* name;  // the row's name in the test's name
  Reader reader;
  Base base;
  const char* key;
  json value;
  const char* message;
  json also = json::object();
};

json base_config(Base b) {
  switch (b) {
    case Base::qwen: return qwen_base();
    case Base::deepseek: return deepseek_base();
    case Base::mixtral: return mixtral_base();
    case Base::lutb: return lutb_base();
  }
  return {};
}

// `j` with `key` (a '.' path; "" for `j` itself) set to `value`, or removed when `value` is kAbsent.
void set_key(json& j, const std::string& key, const json& value) {
  if (key.empty()) {
    j = value;
    return;
  }
  json* at = &j;
  std::size_t from = 0;
  for (std::size_t dot; (dot = key.find('.', from)) != std::string::npos; from = dot + 1)
    at = &(*at)[key.substr(from, dot - from)];
  if (value.is_discarded()) at->erase(key.substr(from));
  else (*at)[key.substr(from)] = value;
}

// A failing row is printed by its name (the default prints the struct's bytes).
void PrintTo(const ConfigCase& c, std::ostream* os) { *os << c.name; }

class ConfigValue : public ::testing::TestWithParam<ConfigCase> {};

TEST_P(ConfigValue, IsCheckedWhenRead) {
  const ConfigCase& c = GetParam();
  json j = base_config(c.base);
  for (const auto& [k, v] : c.also.items()) j[k] = v;
  set_key(j, c.key, c.value);
  const std::string expected =
      c.message == std::string("no exception") ? c.message : std::string(kWhere) + ": " + c.message;
  const std::string row = std::string(c.key) + " = " + c.value.dump() + " also " + c.also.dump();
  if (c.reader == Reader::both || c.reader == Reader::model) {
    EXPECT_EQ(error_of<model::ModelError>([&] { (void)model::TransformerConfig::from_json(j, kWhere); }), expected)
        << "TransformerConfig::from_json, " << row;
  }
  if (c.reader == Reader::both) {
    EXPECT_EQ(error_of<ConfigError>([&] { (void)parse_model_config(j, kWhere); }), expected)
        << "parse_model_config, " << row;
  }
  if (c.reader == Reader::lutb_quant) {
    EXPECT_EQ(error_of<ConfigError>([&] { (void)parse_lutb_quant_config(j, kWhere); }), expected)
        << "parse_lutb_quant_config, " << row;
  }
}

using R = Reader;
using B = Base;
using J = json;

const ConfigCase kConfigCases[] = {
    // The document itself: a JSON array, number or null is not an object, which says more than a missing
    // model_type.
    {"config_array", R::both, B::qwen, "", J::array(), "not a JSON object"},
    {"config_number", R::both, B::qwen, "", 1, "not a JSON object"},
    {"config_null", R::both, B::qwen, "", nullptr, "not a JSON object"},

    // model_type: required, a string, one of the families; both readers list the supported ones.
    {"model_type_absent", R::both, B::deepseek, "model_type", kAbsent,
     "key 'model_type': required but missing (supported: qwen3_moe, qwen2_moe, mixtral, deepseek_v3, deepseek_v2, "
     "olmoe)"},
    {"model_type_number", R::both, B::deepseek, "model_type", 7, "key 'model_type': must be a string, got 7"},
    {"model_type_llama", R::both, B::deepseek, "model_type", "llama",
     "key 'model_type': unsupported model_type \"llama\" (supported: qwen3_moe, qwen2_moe, mixtral, deepseek_v3, "
     "deepseek_v2, olmoe)"},
    {"model_type_gpt2", R::both, B::qwen, "model_type", "gpt2",
     "key 'model_type': unsupported model_type \"gpt2\" (supported: qwen3_moe, qwen2_moe, mixtral, deepseek_v3, "
     "deepseek_v2, olmoe)"},

    // Sizes: required integers, positive, within 32 bits and within what published models use.
    {"hidden_size_absent", R::both, B::deepseek, "hidden_size", kAbsent, "key 'hidden_size': required but missing"},
    {"hidden_size_string", R::both, B::deepseek, "hidden_size", "64", "key 'hidden_size': must be an integer, got \"64\""},
    {"hidden_size_fraction", R::both, B::deepseek, "hidden_size", 64.5, "key 'hidden_size': must be an integer, got 64.5"},
    {"hidden_size_zero", R::both, B::deepseek, "hidden_size", 0, "key 'hidden_size': must be positive, got 0"},
    {"hidden_size_negative", R::both, B::deepseek, "hidden_size", -1, "key 'hidden_size': must be positive, got -1"},
    {"vocab_size_absent", R::both, B::deepseek, "vocab_size", kAbsent, "key 'vocab_size': required but missing"},
    {"num_hidden_layers_bool", R::both, B::deepseek, "num_hidden_layers", true,
     "key 'num_hidden_layers': must be an integer, got true"},
    {"moe_intermediate_size_absent", R::both, B::qwen, "moe_intermediate_size", kAbsent,
     "key 'moe_intermediate_size': required but missing"},
    // Beyond 32 bits: refused by both readers alike.
    {"num_hidden_layers_1e12", R::both, B::qwen, "num_hidden_layers", 1000000000000LL,
     "key 'num_hidden_layers': 1000000000000 does not fit a 32-bit integer"},
    {"hidden_size_1e12", R::both, B::qwen, "hidden_size", 1000000000000LL,
     "key 'hidden_size': 1000000000000 does not fit a 32-bit integer"},
    {"moe_intermediate_size_1e12", R::both, B::qwen, "moe_intermediate_size", 1000000000000LL,
     "key 'moe_intermediate_size': 1000000000000 does not fit a 32-bit integer"},
    {"num_experts_1e12", R::both, B::qwen, "num_experts", 1000000000000LL,
     "key 'num_experts': 1000000000000 does not fit a 32-bit integer"},
    {"vocab_size_1e12", R::both, B::qwen, "vocab_size", 1000000000000LL,
     "key 'vocab_size': 1000000000000 does not fit a 32-bit integer"},
    // num_hidden_layers beyond 65536 (2e9 on a 4-layer checkpoint) is refused at once: per-layer state for
    // every declared layer would take minutes and many GB before any error.
    {"num_hidden_layers_2e9", R::both, B::qwen, "num_hidden_layers", 2000000000,
     "key 'num_hidden_layers': 2000000000 is more than lutb supports (65536; published models have about a "
     "hundred): a corrupt config.json?"},
    {"num_hidden_layers_65536", R::both, B::qwen, "num_hidden_layers", 65536, "no exception"},

    // Other value types.
    {"rms_norm_eps_string", R::both, B::deepseek, "rms_norm_eps", "1e-6",
     "key 'rms_norm_eps': must be a number, got \"1e-6\""},
    {"rms_norm_eps_word", R::both, B::qwen, "rms_norm_eps", "small", "key 'rms_norm_eps': must be a number, got \"small\""},
    {"tie_word_embeddings_number", R::both, B::deepseek, "tie_word_embeddings", 1,
     "key 'tie_word_embeddings': must be true or false, got 1"},
    {"norm_topk_prob_string", R::both, B::qwen, "norm_topk_prob", "yes",
     "key 'norm_topk_prob': must be true or false, got \"yes\""},
    {"mlp_only_layers_string", R::both, B::qwen, "mlp_only_layers", "none",
     "key 'mlp_only_layers': must be a list of layer indices, got \"none\""},
    {"decoder_sparse_step_zero", R::both, B::qwen, "decoder_sparse_step", 0,
     "key 'decoder_sparse_step': must be positive, got 0"},

    // The experts: one count under any of its three names, never two that disagree; top-k in 1..count,
    // a negative value worded as 0 and 5 are, with the range.
    {"num_experts_absent", R::both, B::qwen, "num_experts", kAbsent,
     "key 'num_experts': required but missing (nor are its variants 'num_local_experts', 'n_routed_experts')"},
    {"num_local_experts_disagrees", R::both, B::qwen, "num_local_experts", 8,
     "key 'num_local_experts': 8 disagrees with key 'num_experts' = 4"},
    // num_local_experts 0 names its own key, not "num_experts_per_tok: must be in 1..0".
    {"num_local_experts_zero", R::both, B::mixtral, "num_local_experts", 0,
     "key 'num_local_experts': the experts count must be >= 1, got 0"},
    {"num_experts_per_tok_string", R::both, B::deepseek, "num_experts_per_tok", "2",
     "key 'num_experts_per_tok': must be an integer, got \"2\""},
    {"num_experts_per_tok_negative", R::both, B::deepseek, "num_experts_per_tok", -1,
     "key 'num_experts_per_tok': must be in 1..4 (the experts count), got -1"},
    {"num_experts_per_tok_zero", R::both, B::deepseek, "num_experts_per_tok", 0,
     "key 'num_experts_per_tok': must be in 1..4 (the experts count), got 0"},
    {"num_experts_per_tok_above_count", R::both, B::qwen, "num_experts_per_tok", 9,
     "key 'num_experts_per_tok': must be in 1..4 (the experts count), got 9"},
    // Mixtral's expert width intermediate_size: null (or absent, with no moe_intermediate_size) is reported
    // as missing, not as the 0 the file never held.
    {"mixtral_intermediate_size_null", R::both, B::mixtral, "intermediate_size", nullptr,
     "key 'intermediate_size': required but missing or null (Mixtral's expert width; nor is 'moe_intermediate_size' "
     "given)"},
    {"mixtral_intermediate_size_absent", R::both, B::mixtral, "intermediate_size", kAbsent,
     "key 'intermediate_size': required but missing or null (Mixtral's expert width; nor is 'moe_intermediate_size' "
     "given)"},
    {"mixtral_intermediate_size_zero", R::both, B::mixtral, "intermediate_size", 0,
     "key 'intermediate_size': the expert width must be positive, got 0"},

    // DeepSeek's routing keys (spec 5). scoring_func is DeepSeek's key: a qwen3_moe router ignores it, as
    // transformers does (DeepSeekRoutingKeysAreIgnoredBySoftmaxFamilies below).
    {"scoring_func_relu", R::both, B::deepseek, "scoring_func", "relu",
     "key 'scoring_func': \"relu\" is not supported (softmax, sigmoid)"},
    // topk_method is checked: a typo is refused, not routed as noaux_tc or greedy.
    {"topk_method_typo", R::both, B::deepseek, "topk_method", "noaux-tc",
     "key 'topk_method': \"noaux-tc\" is not supported (accepted: \"noaux_tc\" with scoring_func \"sigmoid\"; "
     "\"greedy\" or \"group_limited_greedy\" with scoring_func \"softmax\")"},
    {"topk_method_v2_typo", R::both, B::deepseek, "topk_method", "group_limited",
     "key 'topk_method': \"group_limited\" is not supported (accepted: \"noaux_tc\" with scoring_func \"sigmoid\"; "
     "\"greedy\" or \"group_limited_greedy\" with scoring_func \"softmax\")",
     {{"model_type", "deepseek_v2"}}},
    {"topk_method_greedy_with_sigmoid", R::both, B::deepseek, "topk_method", "greedy",
     "key 'topk_method': \"greedy\" with scoring_func \"sigmoid\" is not supported (accepted: \"noaux_tc\" with "
     "sigmoid scores; the scoring_func default is \"sigmoid\" for deepseek_v3)"},
    {"topk_method_noaux_tc_with_softmax", R::both, B::deepseek, "topk_method", "noaux_tc",
     "key 'topk_method': \"noaux_tc\" with scoring_func \"softmax\" is not supported (accepted: \"greedy\" or "
     "\"group_limited_greedy\" with softmax scores; the scoring_func default is \"sigmoid\" for deepseek_v3)",
     {{"scoring_func", "softmax"}}},
    {"topk_method_noaux_tc", R::both, B::deepseek, "topk_method", "noaux_tc", "no exception"},
    {"topk_method_greedy_with_softmax", R::both, B::deepseek, "topk_method", "greedy", "no exception",
     {{"scoring_func", "softmax"}}},
    {"topk_method_v2_group_limited_greedy", R::both, B::deepseek, "topk_method", "group_limited_greedy",
     "no exception", {{"model_type", "deepseek_v2"}, {"scoring_func", nullptr}}},
    // routed_scaling_factor: finite and > 0 (a negative one would flip every expert output's sign).
    {"routed_scaling_factor_negative", R::both, B::deepseek, "routed_scaling_factor", -2.5,
     "key 'routed_scaling_factor': must be a finite number > 0, got -2.5"},
    {"routed_scaling_factor_zero", R::both, B::deepseek, "routed_scaling_factor", 0,
     "key 'routed_scaling_factor': must be a finite number > 0, got 0"},
    {"routed_scaling_factor_inf", R::both, B::deepseek, "routed_scaling_factor",
     std::numeric_limits<double>::infinity(), "key 'routed_scaling_factor': must be a finite number > 0, got inf"},
    // Grouped routing is checked when config.json is read, naming the key, not when a layer is built
    // ("router of deepseek_v3: RouterConfig: top_k=5 exceeds ...").
    {"top_k_beyond_the_kept_groups", R::both, B::deepseek, "num_experts_per_tok", 3,
     "key 'num_experts_per_tok': 3 exceeds the 2 experts of the groups the router keeps (topk_group 1 x 2 experts "
     "per group: 4 experts in n_group 2)",
     {{"n_group", 2}, {"topk_group", 1}}},
    {"top_k_within_the_kept_groups", R::both, B::deepseek, "num_experts_per_tok", 2, "no exception",
     {{"n_group", 2}, {"topk_group", 1}}},
    {"n_group_of_one_expert", R::both, B::deepseek, "n_group", 4,
     "key 'n_group': 4 groups of the 4 experts leave 1 expert per group; sigmoid (noaux_tc) routing scores each "
     "group by the sum of its top 2 experts, so a group needs at least 2",
     {{"topk_group", 1}}},
    // Softmax greedy routing does not use the groups; group_limited_greedy does.
    {"greedy_ignores_the_groups", R::both, B::deepseek, "num_experts_per_tok", 3, "no exception",
     {{"n_group", 4}, {"topk_group", 1}, {"scoring_func", "softmax"}, {"topk_method", "greedy"}}},
    {"group_limited_greedy_top_k_beyond_the_kept_groups", R::both, B::deepseek, "num_experts_per_tok", 3,
     "key 'num_experts_per_tok': 3 exceeds the 2 experts of the groups the router keeps (topk_group 1 x 2 experts "
     "per group: 4 experts in n_group 2)",
     {{"n_group", 2}, {"topk_group", 1}, {"scoring_func", "softmax"}, {"topk_method", "group_limited_greedy"}}},
    // first_k_dense_replace -1 would make layer 0, dense in the checkpoint, a MoE layer whose router is
    // "not found".
    {"first_k_dense_replace_negative", R::both, B::deepseek, "first_k_dense_replace", -1,
     "key 'first_k_dense_replace': must be >= 0 (the number of leading dense layers), got -1"},

    // Attention: heads, head widths. Implausible sizes are refused when config.json is read, before a
    // rotary table of 1e9 FP32 values is built or a tensor is compared with an impossible shape; a
    // non-positive head_dim keeps the rotary dimension's wording.
    {"num_key_value_heads_not_dividing", R::model, B::deepseek, "num_key_value_heads", 2,
     "key 'num_key_value_heads': 2 must divide num_attention_heads (3)", {{"num_attention_heads", 3}}},
    {"head_dim_2e9", R::model, B::qwen, "head_dim", 2000000000,
     "key 'head_dim': 2000000000 is more than lutb supports (65536; published models use 64-256): a corrupt "
     "config.json?"},
    {"head_dim_negative", R::model, B::qwen, "head_dim", -64,
     "key 'head_dim': head_dim -64 x partial_rotary_factor 1 gives a rotary dimension of -64; it must be even and "
     "positive"},
    {"head_dim_zero", R::model, B::qwen, "head_dim", 0,
     "key 'head_dim': head_dim 0 x partial_rotary_factor 1 gives a rotary dimension of 0; it must be even and "
     "positive"},
    {"head_dim_65536", R::model, B::qwen, "head_dim", 65536, "no exception"},
    {"qk_rope_head_dim_2e9", R::model, B::deepseek, "qk_rope_head_dim", 2000000000,
     "key 'qk_rope_head_dim': 2000000000 is more than lutb supports (65536; published models use 64-256): a "
     "corrupt config.json?"},
    {"v_head_dim_negative", R::model, B::deepseek, "v_head_dim", -1, "key 'v_head_dim': must be positive, got -1"},
    {"qk_nope_head_dim_zero", R::model, B::deepseek, "qk_nope_head_dim", 0,
     "key 'qk_nope_head_dim': must be positive, got 0"},
    {"kv_lora_rank_negative", R::model, B::deepseek, "kv_lora_rank", -8, "key 'kv_lora_rank': must be positive, got -8"},
    {"kv_lora_rank_absent", R::model, B::deepseek, "kv_lora_rank", kAbsent, "key 'kv_lora_rank': required but missing"},
    {"q_lora_rank_negative", R::model, B::deepseek, "q_lora_rank", -1,
     "key 'q_lora_rank': must be positive (or 0 / null for no query compression), got -1"},
    {"q_lora_rank_null", R::model, B::deepseek, "q_lora_rank", nullptr, "no exception"},
    // A negative sliding window is refused, not read as "no window".
    {"sliding_window_negative", R::model, B::mixtral, "sliding_window", -5,
     "key 'sliding_window': must be a positive number of tokens (or 0 / null for none), got -5"},
    {"qwen_sliding_window_negative", R::model, B::qwen, "sliding_window", -1,
     "key 'sliding_window': must be a positive number of tokens (or 0 / null for none), got -1",
     {{"use_sliding_window", true}}},
    // rms_norm_eps >= 0: rsqrt(mean_sq + eps) of a negative sum is NaN.
    {"rms_norm_eps_negative", R::model, B::qwen, "rms_norm_eps", -1,
     "key 'rms_norm_eps': must be a finite number >= 0, got -1"},
    // A valid value of a feature lutb's model does not implement (UnsupportedConfigError).
    {"hidden_act_gelu", R::model, B::deepseek, "hidden_act", "gelu", "key 'hidden_act': \"gelu\" is not supported (silu)"},

    // Rotary embedding, with transformers' rules (factor >= 1, beta_fast not below beta_slow, ...): with
    // such values the rotary table would not be finite and the loss NaN. Nested keys are named with
    // their object.
    {"rope_scaling_factor_string", R::model, B::deepseek, "rope_scaling", J{{"type", "yarn"}, {"factor", "40"}},
     "key 'rope_scaling.factor': must be a number, got \"40\""},
    // partial_rotary_factor in (0, 1]: a factor of 2 would rotate past each head and past the end of the
    // query / key buffer.
    {"rope_partial_rotary_factor_2", R::model, B::qwen, "rope_parameters.partial_rotary_factor", 2.0,
     "key 'rope_parameters.partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 dimensions "
     "that is rotated), got 2"},
    {"partial_rotary_factor_1_5", R::model, B::qwen, "partial_rotary_factor", 1.5,
     "key 'partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 dimensions that is rotated), "
     "got 1.5"},
    {"partial_rotary_factor_negative", R::model, B::qwen, "partial_rotary_factor", -0.5,
     "key 'partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 dimensions that is rotated), "
     "got -0.5"},
    {"rope_type_dynamic", R::model, B::qwen, "rope_parameters.rope_type", "dynamic",
     "key 'rope_parameters.rope_type': \"dynamic\" is not supported (default, linear, yarn)"},
    {"rope_theta_negative", R::model, B::qwen, "rope_parameters.rope_theta", -5,
     "key 'rope_parameters.rope_theta': must be a positive finite number, got -5"},
    {"yarn_beta_fast_zero", R::model, B::qwen, "rope_parameters",
     J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 0}, {"rope_theta", 10000.0}},
     "key 'rope_parameters.beta_fast': must be a positive finite number for rope_type \"yarn\" (a number of "
     "rotations; default 32), got 0"},
    {"yarn_rope_theta_1", R::model, B::qwen, "rope_parameters",
     J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_slow", -1}, {"rope_theta", 1}},
     "key 'rope_parameters.rope_theta': must be greater than 1 for rope_type \"yarn\" (its correction range "
     "divides by ln(rope_theta)), got 1"},
    {"yarn_beta_slow_negative", R::model, B::qwen, "rope_parameters",
     J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_slow", -1}, {"rope_theta", 10000.0}},
     "key 'rope_parameters.beta_slow': must be a positive finite number for rope_type \"yarn\" (a number of "
     "rotations; default 1), got -1"},
    {"linear_factor_tiny", R::model, B::qwen, "rope_parameters",
     J{{"rope_type", "linear"}, {"factor", 1e-300}, {"rope_theta", 10000.0}},
     "key 'rope_parameters.factor': must be a finite number >= 1 for rope_type \"linear\" (the factor by which the "
     "context is extended, as transformers requires), got 1e-300"},
    {"linear_factor_zero", R::model, B::qwen, "rope_parameters",
     J{{"rope_type", "linear"}, {"factor", 0}, {"rope_theta", 10000.0}},
     "key 'rope_parameters.factor': must be a finite number >= 1 for rope_type \"linear\" (the factor by which the "
     "context is extended, as transformers requires), got 0"},
    {"yarn_factor_below_1", R::model, B::qwen, "rope_parameters",
     J{{"rope_type", "yarn"}, {"factor", 0.5}, {"rope_theta", 10000.0}},
     "key 'rope_parameters.factor': must be a finite number >= 1 for rope_type \"yarn\" (the factor by which the "
     "context is extended, as transformers requires), got 0.5"},
    {"yarn_beta_fast_below_beta_slow", R::model, B::qwen, "rope_parameters",
     J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 1}, {"beta_slow", 2}, {"rope_theta", 10000.0}},
     "key 'rope_parameters.beta_fast': must not be below beta_slow for rope_type \"yarn\" (transformers' rule), got "
     "beta_fast 1 and beta_slow 2"},
    {"yarn_attention_factor_negative", R::model, B::qwen, "rope_parameters",
     J{{"rope_type", "yarn"}, {"factor", 4}, {"attention_factor", -1}, {"rope_theta", 10000.0}},
     "key 'rope_parameters.attention_factor': must be a positive finite number for rope_type \"yarn\", got -1"},
    {"yarn_without_max_position_embeddings", R::model, B::qwen, "max_position_embeddings", kAbsent,
     "key 'rope_parameters.original_max_position_embeddings': required for rope_type \"yarn\" (or "
     "max_position_embeddings), and positive",
     {{"rope_parameters", {{"rope_type", "yarn"}, {"factor", 4}, {"rope_theta", 10000.0}}}}},
    {"yarn_valid", R::model, B::qwen, "rope_parameters",
     J{{"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 32}, {"beta_slow", 1}, {"rope_theta", 10000.0}},
     "no exception"},
    // The guard behind the checks: the table built from the values must be finite (rope_theta 1e-300 is
    // positive, but 0 in FP32, and its frequencies 1 / 0^x infinite).
    {"rope_theta_below_fp32", R::model, B::qwen, "rope_parameters", J{{"rope_type", "default"}, {"rope_theta", 1e-300}},
     "key 'rope_parameters': rope type \"default\": the rotary frequency 1 of 32 computed from the rope values "
     "(rope_theta 1e-300, factor 1) is inf, not a finite number (its values cannot be used)"},

    // quantization_config: only LUT-B or none loads. A checkpoint quantised by another method stores its
    // weights in that method's format (DeepSeek-V3's release: F8_E4M3 weights with weight_scale_inv block
    // scales), which lutb would read without the scales.
    {"quantization_config_fp8", R::both, B::deepseek, "quantization_config",
     J{{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}},
     "key 'quantization_config.quant_method': \"fp8\" is not supported: lutb reads checkpoints whose weights are "
     "BF16, F16 or F32 (or LUT-B, quant_method \"lut_b\"), and an FP8 checkpoint (such as DeepSeek-V3's release) "
     "stores F8_E4M3 weights whose weight_scale_inv block scales lutb does not apply; dequantise the checkpoint to "
     "BF16 first (if its weights already are BF16, remove quantization_config from m/config.json)"},
    {"quantization_config_gptq", R::both, B::deepseek, "quantization_config", J{{"quant_method", "gptq"}, {"bits", 4}},
     "key 'quantization_config.quant_method': \"gptq\" is not supported: lutb reads checkpoints whose weights are "
     "BF16, F16 or F32 (or LUT-B, quant_method \"lut_b\"); dequantise the checkpoint to BF16 first (if its weights "
     "already are BF16, remove quantization_config from m/config.json)"},
    {"quantization_config_compressed_tensors_packed", R::both, B::deepseek, "quantization_config",
     J{{"quant_method", "compressed-tensors"}, {"format", "pack-quantized"}},
     "key 'quantization_config.quant_method': \"compressed-tensors\" is not supported: lutb reads checkpoints whose "
     "weights are BF16, F16 or F32 (or LUT-B, quant_method \"lut_b\"); dequantise the checkpoint to BF16 first (if "
     "its weights already are BF16, remove quantization_config from m/config.json)"},
    {"quantization_config_lut_b", R::both, B::deepseek, "quantization_config", J{{"quant_method", "lut_b"}},
     "no exception"},
    {"quantization_config_compressed_tensors_lut_b", R::both, B::deepseek, "quantization_config",
     J{{"quant_method", "compressed-tensors"}, {"format", "lut-b"}}, "no exception"},
    {"quantization_config_null", R::both, B::qwen, "quantization_config", nullptr, "no exception"},
    // A quant_method that is not a string is worded, not nlohmann's type_error; a quantization_config
    // without a quant_method, or not an object, is refused as transformers refuses it ("The model's
    // quantization config ... has no `quant_method` attribute"), never ignored.
    {"quant_method_number", R::both, B::qwen, "quantization_config", J{{"quant_method", 5}},
     "key 'quantization_config.quant_method': must be a string, got 5"},
    {"quant_method_list", R::both, B::qwen, "quantization_config", J{{"quant_method", J::array({"lut_b"})}},
     "key 'quantization_config.quant_method': must be a string, got [\"lut_b\"]"},
    {"quant_method_absent", R::both, B::qwen, "quantization_config", J{{"bits", 4}, {"group_size", 128}},
     "key 'quantization_config.quant_method': required but missing: a quantization_config must say which method "
     "stored the weights (LUT-B's is \"lut_b\"); if the weights are BF16, F16 or F32, remove quantization_config "
     "from m/config.json"},
    {"quant_method_empty", R::both, B::qwen, "quantization_config", J{{"quant_method", ""}},
     "key 'quantization_config.quant_method': is empty: a quantization_config must say which method stored the "
     "weights (LUT-B's is \"lut_b\"); if the weights are BF16, F16 or F32, remove quantization_config from "
     "m/config.json"},
    {"quantization_config_string", R::both, B::qwen, "quantization_config", "lut_b",
     "key 'quantization_config': must be an object, got \"lut_b\""},

    // A LUT-B quantization_config claiming another tile, index width, format or activation: the weights
    // would otherwise be read as 3-bit 8x64 anyway.
    {"lutb_quant_method_number", R::lutb_quant, B::qwen, "quantization_config", J{{"quant_method", 5}},
     "key 'quantization_config.quant_method': must be a string, got 5"},
    {"lutb_tile", R::lutb_quant, B::lutb, "quantization_config.tile", J{16, 64},
     "key 'quantization_config.tile': [16,64] is not supported; LUT-B tiles are [8, 64]"},
    {"lutb_index_bits", R::lutb_quant, B::lutb, "quantization_config.index_bits", 4,
     "key 'quantization_config.index_bits': 4 is not supported; LUT-B uses 3"},
    {"lutb_format", R::lutb_quant, B::lutb, "quantization_config.format", "int4",
     "key 'quantization_config.format': \"int4\" is not supported; LUT-B stores \"lut-b\""},
    {"lutb_activation", R::lutb_quant, B::lutb, "quantization_config.activation", "fp4",
     "key 'quantization_config.activation': \"fp4\" is not supported; LUT-B stores \"mxfp8\""},
    {"lutb_codebook_dtype", R::lutb_quant, B::lutb, "quantization_config.codebook_dtype", "float8_e5m2",
     "key 'quantization_config.codebook_dtype': \"float8_e5m2\" is not supported; LUT-B stores \"float8_e4m3fn\""},
    {"lutb_scale_dtype", R::lutb_quant, B::lutb, "quantization_config.scale_dtype", "fp32",
     "key 'quantization_config.scale_dtype': \"fp32\" is not supported; LUT-B stores \"ue8m0\""},
    {"lutb_codebook_size", R::lutb_quant, B::lutb, "quantization_config.codebook_size", 16,
     "key 'quantization_config.codebook_size': 16 is not supported; LUT-B uses 8"},
    {"lutb_index_bits_string", R::lutb_quant, B::lutb, "quantization_config.index_bits", "3",
     "key 'quantization_config.index_bits': must be an integer, got \"3\""},
    {"lutb_logical_shape_string", R::lutb_quant, B::lutb, "quantization_config.logical_shapes", J{{"a.weight", "x"}},
     "key 'quantization_config.logical_shapes.a.weight': must be an array of positive integers, got \"x\""},
};

INSTANTIATE_TEST_SUITE_P(ConfigValidation, ConfigValue, ::testing::ValuesIn(kConfigCases),
                         [](const ::testing::TestParamInfo<ConfigCase>& info) { return std::string(info.param.name); });

// The table's bases are valid for every reader.
TEST(ConfigValidation, TheBasesAreValid) {
  for (const Base b : {Base::qwen, Base::deepseek, Base::mixtral, Base::lutb}) {
    const json j = base_config(b);
    SCOPED_TRACE(j.at("model_type").get<std::string>());
    EXPECT_EQ(error_of([&] { (void)model::TransformerConfig::from_json(j, kWhere); }), "no exception");
    EXPECT_EQ(error_of([&] { (void)parse_model_config(j, kWhere); }), "no exception");
  }
  EXPECT_TRUE(parse_lutb_quant_config(lutb_base(), kWhere));
}

// Values at the edges of the ranges are read as given.
TEST(ConfigValidation, ValuesAtTheEdgesAreRead) {
  json j = qwen_base();
  j["num_hidden_layers"] = 65536;  // the largest accepted
  EXPECT_EQ(parse_model_config(j, kWhere).num_hidden_layers, 65536);
  // A real partial rotation: the first 32 of 64 dimensions.
  j = qwen_base();
  j["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(model::TransformerConfig::from_json(j, kWhere).rope.dim, 32);
  // Mixtral's expert width.
  j = mixtral_base();
  j["intermediate_size"] = 32;
  EXPECT_EQ(parse_model_config(j, kWhere).moe_intermediate_size, 32);
  // DeepSeek: no leading dense layer; a scaled router; grouped routing at its limit; greedy routing
  // that ignores the groups.
  j = deepseek_base();
  j["first_k_dense_replace"] = 0;
  EXPECT_TRUE(parse_model_config(j, kWhere).is_moe_layer(0));
  j = deepseek_base();
  j["routed_scaling_factor"] = 2.5;
  EXPECT_EQ(parse_model_config(j, kWhere).routed_scaling_factor, 2.5);
  j = deepseek_base();
  j["n_group"] = 2;
  j["topk_group"] = 1;
  EXPECT_EQ(parse_model_config(j, kWhere).n_group, 2);
  j["n_group"] = 4;
  j["scoring_func"] = "softmax";
  j["topk_method"] = "greedy";
  j["num_experts_per_tok"] = 3;
  EXPECT_EQ(parse_model_config(j, kWhere).num_experts_per_tok, 3);
  // LUT-B's own quantization_config loads, and is read as LUT-B.
  j = qwen_base();
  j["quantization_config"] = {{"quant_method", "lut_b"}};
  EXPECT_NO_THROW(parse_model_config(j, kWhere));
  EXPECT_TRUE(parse_lutb_quant_config(j, kWhere));
  // The rotary table itself refuses a non-finite frequency.
  model::RopeConfig r;
  r.dim = 4;
  r.theta = 1e-300;
  EXPECT_THROW((void)model::make_rope_table(r), model::ModelError);
}

// A config.json that is missing, not JSON or a directory, and a model path that is a file or missing, are
// named with what is wrong with them, not the stream's "basic_filebuf::underflow error reading the file: Is
// a directory" or "FILE/config.json: cannot open".
TEST(ConfigValidation, UnreadableConfigFileNamesThePathAndTheProblem) {
  TempDir tmp;
  EXPECT_THROW(load_model_config(tmp.path), ConfigError);                 // no config.json
  EXPECT_THROW(model::TransformerConfig::load(tmp.path), model::ModelError);  // no config.json
  std::ofstream(tmp.path / "config.json") << "{not json";
  EXPECT_TRUE(test::has(error_of<ConfigError>([&] { (void)load_model_config(tmp.path); }), "invalid JSON"));
  fs::remove(tmp.path / "config.json");
  fs::create_directory(tmp.path / "config.json");
  EXPECT_EQ(error_of([&] { (void)model::TransformerConfig::load(tmp.path); }),
            (tmp.path / "config.json").string() + ": is a directory; the checkpoint's config.json must be a file");
  EXPECT_EQ(error_of([&] { (void)load_model_config(tmp.path); }),
            (tmp.path / "config.json").string() + ": is a directory; the checkpoint's config.json must be a file");
  std::ofstream(tmp.path / "good.safetensors") << "x";
  EXPECT_EQ(error_of([&] { (void)model::TransformerConfig::load(tmp.path / "good.safetensors"); }),
            (tmp.path / "good.safetensors").string() +
                ": not a directory (a model is a Hugging Face checkpoint directory holding config.json and "
                "*.safetensors)");
  EXPECT_EQ(error_of([&] { (void)model::TransformerConfig::load(tmp.path / "nope"); }),
            (tmp.path / "nope").string() +
                ": no such directory (a model is a Hugging Face checkpoint directory holding config.json and "
                "*.safetensors)");
}

json softmax_family_config(const char* type) {
  return {{"model_type", type},           {"hidden_size", 64},   {"num_hidden_layers", 2},
          {"vocab_size", 100},            {"num_experts", 4},    {"num_experts_per_tok", 2},
          {"moe_intermediate_size", 32},  {"intermediate_size", 32}};
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
    ASSERT_NO_THROW(c = parse_model_config(j, kWhere));
    EXPECT_EQ(c.scoring_func, ScoringFunc::softmax);
    EXPECT_EQ(c.topk_method, "");
    EXPECT_EQ(c.n_group, 1);
    EXPECT_EQ(c.topk_group, 1);
    EXPECT_EQ(c.routed_scaling_factor, 1.0);
    // Values DeepSeek would refuse are not read either.
    j["scoring_func"] = "relu";
    j["routed_scaling_factor"] = -1;
    EXPECT_NO_THROW(parse_model_config(j, kWhere));
  }
  // DeepSeek-V3 still reads them all (control).
  json d = softmax_family_config("deepseek_v3");
  d["num_experts"] = 8;
  d["n_group"] = 4;
  d["topk_group"] = 2;
  d["routed_scaling_factor"] = 2.5;
  const ModelConfig c = parse_model_config(d, kWhere);
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
  const auto tokens = model::load_token_ids(dir / "val_tokens.safetensors");
  model::EvalOptions eo;
  eo.max_windows = 2;
  auto loss = [&](const fs::path& d) {
    model::CheckpointMoe moe(d, model::MoeOptions{});
    model::LanguageModel lm = model::LanguageModel::load(d, moe.factory());
    return model::evaluate(lm, tokens, eo).val_loss;
  };
  const double reference = loss(dir);
  TempDir t;
  for (const auto& [key, value] : {std::pair<const char*, json>{"routed_scaling_factor", 2.5},
                                   std::pair<const char*, json>{"scoring_func", "sigmoid"}}) {
    SCOPED_TRACE(key);
    const fs::path d = test::patched_model(t.path / key, dir, {{key, value}});
    EXPECT_NEAR(loss(d), reference, 1e-6);
  }
}

// lutb eval on a model whose config.json has such values names the key, not the tensors.
TEST(ConfigValidation, EvalNamesTheRopeKeyNotTheTensors) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const fs::path m = edited_model(t.path / "m", src, {});
  nlohmann::json j = test::read_json(m / "config.json");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 0}, {"rope_theta", 10000.0}};
  test::write_json(m / "config.json", j);
  const test::CliResult r = test::run_cli("eval " + test::q(m) + " --max-windows 1");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_EQ(r.err, "lutb: error: " + (m / "config.json").string() +
                       ": key 'rope_parameters.beta_fast': must be a positive finite number for rope_type \"yarn\" (a "
                       "number of rotations; default 32), got 0\n");
}

}  // namespace
}  // namespace lutb
