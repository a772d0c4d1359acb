// config.json parsing, tensor naming and quantization_config parsing (spec sections 2.2 and 7).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <limits>
#include <fstream>
#include <sstream>

#include <fmt/core.h>
#include <fmt/format.h>

#include "io/config_json.hpp"
#include "lutb/checkpoint.hpp"

namespace lutb {

namespace {

constexpr ModelFamily kFamilies[] = {ModelFamily::qwen3_moe, ModelFamily::qwen2_moe, ModelFamily::mixtral,
                                     ModelFamily::deepseek_v3, ModelFamily::deepseek_v2, ModelFamily::olmoe};

bool is_deepseek(ModelFamily f) { return f == ModelFamily::deepseek_v3 || f == ModelFamily::deepseek_v2; }
bool is_qwen(ModelFamily f) { return f == ModelFamily::qwen3_moe || f == ModelFamily::qwen2_moe; }

// The typed readers of io/config_json.hpp: errors read "WHERE: key 'K': reason" (the same wording as
// the model's TransformerConfig parser).
std::optional<std::int64_t> opt_int(const nlohmann::json& j, const char* key, const std::string& where) {
  return detail::config_int(j, key, where);
}
// Sizes and counts are bounded by what the model parser (src/model/config.cpp) accepts, a 32-bit
// int: a larger value is a corrupt config (num_hidden_layers 10^12 must be refused by lutb quantize,
// which iterates over the layers, as by lutb eval). Upper bound of num_hidden_layers
// (see parse_model_config).
constexpr std::int64_t kMaxLayers = 65536;
std::optional<std::int64_t> opt_size(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto v = opt_int(j, key, where);
  if (v && *v > std::numeric_limits<std::int32_t>::max())
    detail::throw_config_key(where, key, fmt::format("{} does not fit a 32-bit integer", *v));
  return v;
}
std::int64_t req_int(const nlohmann::json& j, const char* key, const std::string& where) {
  const std::int64_t v = detail::config_required(opt_size(j, key, where), key, where);
  if (v < 0) detail::throw_config_key(where, key, fmt::format("must be non-negative, got {}", v));
  return v;
}
// A required size whose range is checked later with its own words (hidden_size "must be positive",
// num_experts_per_tok "must be in 1..E"), which say more than "must be non-negative".
std::int64_t req_size(const nlohmann::json& j, const char* key, const std::string& where) {
  return detail::config_required(opt_size(j, key, where), key, where);
}
std::optional<double> opt_num(const nlohmann::json& j, const char* key, const std::string& where) {
  return detail::config_number(j, key, where);
}
std::optional<bool> opt_bool(const nlohmann::json& j, const char* key, const std::string& where) {
  return detail::config_bool(j, key, where);
}
std::optional<std::string> opt_str(const nlohmann::json& j, const char* key, const std::string& where,
                                   std::string_view name = {}) {
  return detail::config_string(j, key, where, name);
}

std::string supported_list() {
  std::string s;
  for (auto f : kFamilies) {
    if (!s.empty()) s += ", ";
    s += family_name(f);
  }
  return s;
}

}  // namespace

std::string_view family_name(ModelFamily f) {
  switch (f) {
    case ModelFamily::qwen3_moe: return "qwen3_moe";
    case ModelFamily::qwen2_moe: return "qwen2_moe";
    case ModelFamily::mixtral: return "mixtral";
    case ModelFamily::deepseek_v3: return "deepseek_v3";
    case ModelFamily::deepseek_v2: return "deepseek_v2";
    case ModelFamily::olmoe: return "olmoe";
  }
  return "?";
}

std::optional<ModelFamily> family_from_name(std::string_view s) {
  for (auto f : kFamilies)
    if (family_name(f) == s) return f;
  return std::nullopt;
}

std::vector<std::string> family_names() {
  std::vector<std::string> v;
  for (auto f : kFamilies) v.emplace_back(family_name(f));
  return v;
}

bool ModelConfig::is_moe_layer(std::int64_t L) const {
  if (L < 0 || num_experts <= 0) return false;
  if (is_qwen(family)) {
    if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), L) != mlp_only_layers.end()) return false;
    return decoder_sparse_step > 0 && (L + 1) % decoder_sparse_step == 0;
  }
  if (is_deepseek(family)) return L >= first_k_dense_replace && moe_layer_freq > 0 && L % moe_layer_freq == 0;
  return true;  // Mixtral, OLMoE: every decoder layer is sparse
}

std::vector<std::int64_t> ModelConfig::moe_layers() const {
  std::vector<std::int64_t> v;
  for (std::int64_t L = 0; L < num_hidden_layers; ++L)
    if (is_moe_layer(L)) v.push_back(L);
  return v;
}

namespace {

// ---------------------------------------------------------------------------
// parse_model_config, step by step: one reader per group of keys and one checker per validated
// thing, in the order the keys were always read, so the first bad key is the one reported.
// ---------------------------------------------------------------------------

void read_model_type(ModelConfig& c, const nlohmann::json& j, const std::string& where) {
  auto mt = opt_str(j, "model_type", where);
  if (!mt) detail::throw_config_key(where, "model_type", fmt::format("required but missing (supported: {})", supported_list()));
  c.model_type = *mt;
  auto fam = family_from_name(*mt);
  if (!fam)
    detail::throw_config_key(where, "model_type",
                             fmt::format("unsupported model_type \"{}\" (supported: {})", *mt, supported_list()));
  c.family = *fam;
}

void read_sizes(ModelConfig& c, const nlohmann::json& j, const std::string& where) {
  c.hidden_size = req_size(j, "hidden_size", where);
  c.num_hidden_layers = req_int(j, "num_hidden_layers", where);
  // The parsers and the model keep per-layer state for every declared layer before they meet the
  // checkpoint's first missing one, so a corrupt num_hidden_layers (2e9 on a 4-layer checkpoint)
  // would cost minutes and gigabytes before any error. Published models have at most about a hundred
  // layers.
  if (c.num_hidden_layers > kMaxLayers)
    detail::throw_config_key(where, "num_hidden_layers",
                             fmt::format("{} is more than lutb supports ({}; published models have about a hundred): "
                                         "a corrupt config.json?",
                                         c.num_hidden_layers, kMaxLayers));
  c.vocab_size = req_int(j, "vocab_size", where);
  c.num_experts_per_tok = req_size(j, "num_experts_per_tok", where);
  c.intermediate_size = opt_size(j, "intermediate_size", where).value_or(0);
}

// Experts count: any of the three keys; when several are present they must agree.
void read_experts_count(ModelConfig& c, const nlohmann::json& j, const std::string& where) {
  std::optional<std::int64_t> experts;
  std::string experts_key;
  for (const char* key : {"num_experts", "num_local_experts", "n_routed_experts"}) {
    auto v = opt_size(j, key, where);
    if (!v) continue;
    if (experts && *experts != *v)
      detail::throw_config_key(where, key, fmt::format("{} disagrees with key '{}' = {}", *v, experts_key, *experts));
    experts = v;
    experts_key = key;
  }
  if (!experts)
    detail::throw_config_key(where, "num_experts",
                             "required but missing (nor are its variants 'num_local_experts', 'n_routed_experts')");
  if (*experts < 1)  // else num_experts_per_tok would report "must be in 1..0"
    detail::throw_config_key(where, experts_key, fmt::format("the experts count must be >= 1, got {}", *experts));
  c.num_experts = *experts;
}

// Expert width: moe_intermediate_size; Mixtral's experts use intermediate_size, OLMoE's when
// moe_intermediate_size is absent.
void read_expert_width(ModelConfig& c, const nlohmann::json& j, const std::string& where) {
  if (c.family == ModelFamily::mixtral) {
    const auto v = opt_size(j, "moe_intermediate_size", where);
    // Neither key (or "intermediate_size": null) is a missing key, not a width of 0.
    if (!v && !opt_size(j, "intermediate_size", where))
      detail::throw_config_key(where, "intermediate_size",
                               "required but missing or null (Mixtral's expert width; nor is 'moe_intermediate_size' "
                               "given)");
    c.moe_intermediate_size = v.value_or(c.intermediate_size);
  } else {
    auto v = opt_size(j, "moe_intermediate_size", where);
    if (!v && c.family == ModelFamily::olmoe) v = c.intermediate_size;  // OLMoE experts use intermediate_size
    if (!v) detail::throw_config_key(where, "moe_intermediate_size", "required but missing");
    c.moe_intermediate_size = *v;
  }
}

void check_moe_sizes(const ModelConfig& c, const nlohmann::json& j, const std::string& where) {
  if (c.moe_intermediate_size <= 0)
    detail::throw_config_key(where,
                             c.family == ModelFamily::mixtral && !j.contains("moe_intermediate_size") ? "intermediate_size"
                                                                                                    : "moe_intermediate_size",
                             fmt::format("the expert width must be positive, got {}", c.moe_intermediate_size));
  if (c.hidden_size <= 0) detail::throw_config_key(where, "hidden_size", fmt::format("must be positive, got {}", c.hidden_size));
  if (c.num_experts_per_tok <= 0 || c.num_experts_per_tok > c.num_experts)
    detail::throw_config_key(where, "num_experts_per_tok",
                             fmt::format("must be in 1..{} (the experts count), got {}", c.num_experts, c.num_experts_per_tok));
}

// Only the methods lutb's routing implements (src/model/moe_block.cpp, spec 5): sigmoid scores with
// the noaux_tc group selection; softmax scores with greedy or group_limited_greedy. Any other value
// (a typo included) is refused, never routed as one of them.
void check_topk_method(const ModelConfig& c, const std::string& where) {
  const bool ds3 = c.family == ModelFamily::deepseek_v3;
  const bool sigmoid = c.scoring_func == ScoringFunc::sigmoid;
  const auto& m = c.topk_method;
  const bool known = m == "noaux_tc" || m == "greedy" || m == "group_limited_greedy";
  if (!known)
    detail::throw_config_key(where, "topk_method",
                             fmt::format("\"{}\" is not supported (accepted: \"noaux_tc\" with scoring_func "
                                         "\"sigmoid\"; \"greedy\" or \"group_limited_greedy\" with scoring_func "
                                         "\"softmax\")",
                                         m));
  if (sigmoid != (m == "noaux_tc"))
    detail::throw_config_key(
        where, "topk_method",
        fmt::format("\"{}\" with scoring_func \"{}\" is not supported (accepted: {}; the scoring_func default is "
                    "\"{}\" for {})",
                    m, sigmoid ? "sigmoid" : "softmax",
                    sigmoid ? "\"noaux_tc\" with sigmoid scores" : "\"greedy\" or \"group_limited_greedy\" with softmax scores",
                    ds3 ? "sigmoid" : "softmax", c.model_type));
}

// n_group must divide the experts and topk_group fit in it; the group selection (sigmoid / noaux_tc,
// group_limited_greedy) needs enough experts in the kept groups. Checked here, naming config.json and
// its keys, before a layer's router is built.
void check_groups(const ModelConfig& c, const std::string& where) {
  if (c.n_group <= 0 || c.num_experts % c.n_group != 0)
    detail::throw_config_key(where, "n_group", fmt::format("must divide the experts count {}, got {}", c.num_experts, c.n_group));
  if (c.topk_group <= 0 || c.topk_group > c.n_group)
    detail::throw_config_key(where, "topk_group", fmt::format("must be in 1..n_group ({}), got {}", c.n_group, c.topk_group));
  if (c.scoring_func != ScoringFunc::sigmoid && c.topk_method != "group_limited_greedy") return;
  const std::int64_t per = c.num_experts / c.n_group;
  if (c.scoring_func == ScoringFunc::sigmoid && per < 2)
    detail::throw_config_key(where, "n_group",
                             fmt::format("{} groups of the {} experts leave {} expert per group; sigmoid (noaux_tc) "
                                         "routing scores each group by the sum of its top 2 experts, so a group "
                                         "needs at least 2",
                                         c.n_group, c.num_experts, per));
  if (c.num_experts_per_tok > c.topk_group * per)
    detail::throw_config_key(where, "num_experts_per_tok",
                             fmt::format("{} exceeds the {} experts of the groups the router keeps (topk_group {} x "
                                         "{} experts per group: {} experts in n_group {})",
                                         c.num_experts_per_tok, c.topk_group * per, c.topk_group, per, c.num_experts,
                                         c.n_group));
}

// DeepSeek's routing keys (spec 5). scoring_func, topk_method, n_group, topk_group and
// routed_scaling_factor are DeepSeek's keys. The softmax top-k router of Qwen2/3-MoE, Mixtral and
// OLMoE (spec 5; transformers' Qwen3MoeTopKRouter, MixtralTopKRouter, ...) has no such parameters
// and transformers ignores the keys in their config.json: reading them for every family would route
// a qwen3_moe config.json carrying "routed_scaling_factor": 2.5 or "scoring_func": "sigmoid" with
// them (lutb eval --quant none 4.040 or 3.919 nats instead of transformers' 3.843 on tiny-qwen3-moe,
// 4 windows). Other families keep the defaults (softmax, no groups, factor 1), whatever the keys say.
void read_deepseek_routing(ModelConfig& c, const nlohmann::json& j, const std::string& where) {
  const bool ds3 = c.family == ModelFamily::deepseek_v3;
  auto sf = opt_str(j, "scoring_func", where).value_or(ds3 ? "sigmoid" : "softmax");
  if (sf == "softmax") c.scoring_func = ScoringFunc::softmax;
  else if (sf == "sigmoid") c.scoring_func = ScoringFunc::sigmoid;
  else detail::throw_config_key(where, "scoring_func", fmt::format("\"{}\" is not supported (softmax, sigmoid)", sf));
  c.topk_method = opt_str(j, "topk_method", where).value_or(ds3 ? "noaux_tc" : "greedy");
  check_topk_method(c, where);
  c.n_group = opt_int(j, "n_group", where).value_or(1);
  c.topk_group = opt_int(j, "topk_group", where).value_or(1);
  check_groups(c, where);
  c.routed_scaling_factor = opt_num(j, "routed_scaling_factor", where).value_or(1.0);
  // It multiplies the routing weights: a negative one would flip the sign of every expert's output;
  // zero switches the experts off.
  if (!(std::isfinite(c.routed_scaling_factor) && c.routed_scaling_factor > 0))
    detail::throw_config_key(where, "routed_scaling_factor",
                             fmt::format("must be a finite number > 0, got {}", c.routed_scaling_factor));
}

void read_shared_experts(ModelConfig& c, const nlohmann::json& j, const std::string& where) {
  if (is_deepseek(c.family)) {
    c.n_shared_experts = opt_size(j, "n_shared_experts", where).value_or(0);
    c.shared_expert_intermediate_size = c.n_shared_experts * c.moe_intermediate_size;
  } else if (c.family == ModelFamily::qwen2_moe) {
    c.shared_expert_intermediate_size = opt_size(j, "shared_expert_intermediate_size", where).value_or(0);
    c.n_shared_experts = c.shared_expert_intermediate_size > 0 ? 1 : 0;
  }
}

// Dense-layer selection: mlp_only_layers, decoder_sparse_step, first_k_dense_replace, moe_layer_freq.
void read_dense_layers(ModelConfig& c, const nlohmann::json& j, const std::string& where) {
  if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
    if (!it->is_array())
      detail::throw_config_key(where, "mlp_only_layers",
                               fmt::format("must be a list of layer indices, got {}", detail::json_excerpt(*it)));
    for (const auto& v : *it) {
      if (!v.is_number_integer())
        detail::throw_config_key(where, "mlp_only_layers", fmt::format("holds a non-integer {}", detail::json_excerpt(v)));
      c.mlp_only_layers.push_back(v.get<std::int64_t>());
    }
  }
  c.decoder_sparse_step = opt_int(j, "decoder_sparse_step", where).value_or(1);
  c.first_k_dense_replace = opt_int(j, "first_k_dense_replace", where).value_or(0);
  c.moe_layer_freq = opt_int(j, "moe_layer_freq", where).value_or(1);
  if (c.decoder_sparse_step <= 0)
    detail::throw_config_key(where, "decoder_sparse_step", fmt::format("must be positive, got {}", c.decoder_sparse_step));
  if (c.moe_layer_freq <= 0)
    detail::throw_config_key(where, "moe_layer_freq", fmt::format("must be positive, got {}", c.moe_layer_freq));
  // A negative count would make layer 0, dense in the checkpoint, a MoE layer (and the error would
  // name a missing router).
  if (c.first_k_dense_replace < 0)
    detail::throw_config_key(where, "first_k_dense_replace",
                             fmt::format("must be >= 0 (the number of leading dense layers), got {}", c.first_k_dense_replace));
}

// A checkpoint quantised by another method stores its weights in that method's format: DeepSeek-V3's
// official release is FP8 (F8_E4M3 weights with weight_scale_inv block scales), which lutb would read
// without the scales (lutb eval 7.84 nats instead of 3.89, and lutb quantize would write a "lut_b"
// config over the FP8 one). Only LUT-B or no quantization_config loads.
void check_quantization_config(const nlohmann::json& j, const std::string& where) {
  auto q = j.find("quantization_config");
  if (q == j.end() || q->is_null()) return;
  // transformers refuses a quantization_config that is not an object or names no quant_method
  // ("The model's quantization config from the arguments has no `quant_method` attribute"); lutb
  // refuses it too, rather than read the weights as plain floats, and words a non-string
  // quant_method (not a bare nlohmann type_error).
  if (!q->is_object())
    detail::throw_config_key(where, "quantization_config",
                             fmt::format("must be an object, got {}", detail::json_excerpt(*q)));
  const std::string method =
      opt_str(*q, "quant_method", where, "quantization_config.quant_method").value_or(std::string());
  if (method.empty())
    detail::throw_config_key(
        where, "quantization_config.quant_method",
        fmt::format("{}: a quantization_config must say which method stored the weights (LUT-B's is \"lut_b\"); "
                    "if the weights are BF16, F16 or F32, remove quantization_config from {}",
                    q->contains("quant_method") ? "is empty" : "required but missing", where));
  if (!method.empty() && method != "lut_b" && !parse_lutb_quant_config(j, where))
    detail::throw_config_key(
        where, "quantization_config.quant_method",
        fmt::format("\"{}\" is not supported: lutb reads checkpoints whose weights are BF16, F16 or F32 (or "
                    "LUT-B, quant_method \"lut_b\"){}; dequantise the checkpoint to BF16 first (if its weights "
                    "already are BF16, remove quantization_config from {})",
                    method,
                    method == "fp8" ? ", and an FP8 checkpoint (such as DeepSeek-V3's release) stores F8_E4M3 "
                                      "weights whose weight_scale_inv block scales lutb does not apply"
                                    : "",
                    where));
}

}  // namespace

ModelConfig parse_model_config(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw ConfigError(fmt::format("{}: not a JSON object", where));
  ModelConfig c;
  c.raw = j;
  c.source = where;
  read_model_type(c, j, where);
  read_sizes(c, j, where);
  read_experts_count(c, j, where);
  read_expert_width(c, j, where);
  check_moe_sizes(c, j, where);
  // Routing (spec 5).
  c.norm_topk_prob = opt_bool(j, "norm_topk_prob", where).value_or(c.family == ModelFamily::deepseek_v3);
  if (is_deepseek(c.family)) read_deepseek_routing(c, j, where);
  read_shared_experts(c, j, where);
  read_dense_layers(c, j, where);
  c.rms_norm_eps = opt_num(j, "rms_norm_eps", where).value_or(c.family == ModelFamily::mixtral ? 1e-5 : 1e-6);
  c.tie_word_embeddings = opt_bool(j, "tie_word_embeddings", where).value_or(false);
  c.hidden_act = opt_str(j, "hidden_act", where).value_or("silu");
  check_quantization_config(j, where);
  return c;
}

ModelConfig load_model_config(const std::filesystem::path& p) {
  if (const std::string why = detail::folder_access_problem(p); !why.empty()) throw ConfigError(why);
  std::filesystem::path file = std::filesystem::is_directory(p) ? p / "config.json" : p;
  if (std::filesystem::is_directory(file))  // reading a folder fails deep inside the stream
    throw ConfigError(fmt::format("{}: is a directory; the checkpoint's config.json must be a file", file.string()));
  if (const std::string kind = detail::non_regular_kind(file); !kind.empty())  // a FIFO blocked open() for ever
    throw ConfigError(fmt::format("{}: is {}; the checkpoint's config.json must be a regular file", file.string(), kind));
  errno = 0;
  std::ifstream in(file);
  if (!in) {
    // Only a missing file is "no config.json": one that cannot be read is reported with strerror's
    // reason.
    const int err = errno;
    if (err == ENOENT && std::filesystem::is_directory(p))
      throw ConfigError(fmt::format("{}: no config.json in the checkpoint directory", p.string()));
    throw ConfigError(fmt::format("{}{}", file.string(), detail::cannot_open(err)));
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(fmt::format("{}: invalid JSON: {}", file.string(), detail::json_error_text(e.what())));
  }
  return parse_model_config(j, file.string());
}

// ---------------------------------------------------------------------------
// Names
// ---------------------------------------------------------------------------
std::string_view proj_name(Proj p) {
  switch (p) {
    case Proj::gate: return "gate";
    case Proj::up: return "up";
    case Proj::down: return "down";
  }
  return "?";
}

std::string moe_prefix(const ModelConfig& c, std::int64_t L) {
  return fmt::format("model.layers.{}.{}", L, c.family == ModelFamily::mixtral ? "block_sparse_moe" : "mlp");
}

std::string expert_weight_name(const ModelConfig& c, std::int64_t L, std::int64_t e, Proj p) {
  static constexpr const char* kHf[] = {"gate_proj", "up_proj", "down_proj"};
  static constexpr const char* kMixtral[] = {"w1", "w3", "w2"};
  const char* n = (c.family == ModelFamily::mixtral ? kMixtral : kHf)[static_cast<int>(p)];
  return fmt::format("{}.experts.{}.{}.weight", moe_prefix(c, L), e, n);
}

std::string stacked_gate_up_name(const ModelConfig& c, std::int64_t L) { return moe_prefix(c, L) + ".experts.gate_up_proj"; }
std::string stacked_down_name(const ModelConfig& c, std::int64_t L) { return moe_prefix(c, L) + ".experts.down_proj"; }
std::string router_weight_name(const ModelConfig& c, std::int64_t L) { return moe_prefix(c, L) + ".gate.weight"; }
std::string router_bias_name(const ModelConfig& c, std::int64_t L) {
  return c.family == ModelFamily::deepseek_v3 ? moe_prefix(c, L) + ".gate.e_score_correction_bias" : std::string();
}

std::string routed_expert_pattern(const ModelConfig& c) {
  if (c.family == ModelFamily::mixtral)
    return R"(^model\.layers\.(\d+)\.(?:block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight|(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj))$)";
  return R"(^model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$)";
}

LutbNames lutb_names(const std::string& w) {
  // "X.weight" + "_packed" is "X.weight_packed" (spec 2.2); any other name gets the same suffixes.
  return {w + "_packed", w + "_codebook", w + "_scale"};
}

// ---------------------------------------------------------------------------
// quantization_config
// ---------------------------------------------------------------------------
std::optional<LutbQuantConfig> parse_lutb_quant_config(const nlohmann::json& config, std::string_view where) {
  auto it = config.find("quantization_config");
  if (it == config.end() || !it->is_object()) return std::nullopt;
  const auto& q = *it;
  LutbQuantConfig r;
  // A quant_method that is not a string (5, null, a list) escaped as nlohmann's "[json.exception.
  // type_error.302] type must be string, but is number", naming neither config.json nor the key.
  r.quant_method = detail::config_string(q, "quant_method", where, "quantization_config.quant_method").value_or("");
  auto str = [&](const nlohmann::json& o, const char* k) {
    auto i = o.find(k);
    return (i != o.end() && i->is_string()) ? i->get<std::string>() : std::string();
  };
  if (r.quant_method == "lut_b") {
    // What the loader relies on (spec 2.2): a stored checkpoint claiming another tile, index width,
    // codebook or scale type or activation format would otherwise be read as 3-bit 8x64 silently.
    const std::string w(where);
    auto want_string = [&](const char* key, std::initializer_list<const char*> allowed) {
      const auto v = detail::config_string(q, key, w, std::string("quantization_config.") + key);
      if (!v) return;
      for (const char* a : allowed)
        if (*v == a) return;
      detail::throw_config_key(w, std::string("quantization_config.") + key,
                               fmt::format("\"{}\" is not supported; LUT-B stores \"{}\"", *v, *allowed.begin()));
    };
    auto want_int = [&](const char* key, std::int64_t expected) {
      const auto v = detail::config_int(q, key, w, std::string("quantization_config.") + key);
      if (v && *v != expected)
        detail::throw_config_key(w, std::string("quantization_config.") + key,
                                 fmt::format("{} is not supported; LUT-B uses {}", *v, expected));
    };
    want_string("format", {"lut-b"});
    want_string("codebook_dtype", {"float8_e4m3fn"});
    want_string("scale_dtype", {"ue8m0"});
    want_string("activation", {"mxfp8"});
    want_int("index_bits", 3);
    want_int("codebook_size", kCodebookSize);
    want_int("activation_block", 32);
    if (auto t = q.find("tile"); t != q.end() && !t->is_null()) {
      const bool ok = t->is_array() && t->size() == 2 && (*t)[0].is_number_integer() &&
                      (*t)[1].is_number_integer() && (*t)[0].get<std::int64_t>() == kTileRows &&
                      (*t)[1].get<std::int64_t>() == kTileCols;
      if (!ok)
        detail::throw_config_key(w, "quantization_config.tile",
                                 fmt::format("{} is not supported; LUT-B tiles are [{}, {}]", detail::json_excerpt(*t),
                                             kTileRows, kTileCols));
    }
    if (auto ls = q.find("logical_shapes"); ls != q.end() && !ls->is_null()) {
      if (!ls->is_object())
        detail::throw_config_key(w, "quantization_config.logical_shapes",
                                 "must be an object of tensor name to [rows, cols]");
      for (auto& [k, v] : ls->items()) {
        bool ok = v.is_array() && !v.empty();
        if (ok)
          for (const auto& d : v) ok = ok && d.is_number_integer() && d.get<std::int64_t>() > 0;
        if (!ok)
          detail::throw_config_key(w, "quantization_config.logical_shapes." + k,
                                   fmt::format("must be an array of positive integers, got {}", detail::json_excerpt(v)));
      }
    }
    r.format = str(q, "format");
    r.fitter = str(q, "fitter");
    if (auto a = str(q, "activation"); !a.empty()) r.activation = a;
    r.modules = str(q, "modules");
    if (auto ls = q.find("logical_shapes"); ls != q.end() && ls->is_object())
      for (auto& [k, v] : ls->items())
        if (v.is_array()) r.logical_shapes[k] = v.get<std::vector<std::int64_t>>();
    return r;
  }
  if (r.quant_method == "compressed-tensors") {
    bool lut = str(q, "format") == "lut-b";
    if (auto g = q.find("config_groups"); g != q.end() && g->is_object())
      for (auto& [k, v] : g->items())
        if (v.is_object() && str(v, "format") == "lut-b") lut = true;
    if (!lut) return std::nullopt;
    r.format = "lut-b";
    r.fitter = "ct-lloyd";
    r.compressed_tensors = true;
    return r;
  }
  return std::nullopt;
}

}  // namespace lutb
