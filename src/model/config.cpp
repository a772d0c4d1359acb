// TransformerConfig: config.json of the supported MoE families (transformers 5 keys, with the
// transformers 4 variants: rope_theta/rope_scaling beside rope_parameters, num_experts /
// num_local_experts / n_routed_experts).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <type_traits>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "io/config_json.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"

namespace lutb::model {
namespace {

using nlohmann::json;

const json* find(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

// Typed readers over io/config_json.hpp: the checkpoint parser's wording, "WHERE: key 'K': reason",
// thrown as ModelError. `name` reports a nested key ("rope_parameters.factor").
template <class T>
std::optional<T> read(const json& j, const char* key, const std::string& where, const std::string& name = {}) {
  try {
    if constexpr (std::is_same_v<T, int>) {
      const std::optional<std::int64_t> v = detail::config_int(j, key, where, name);
      if (!v) return std::nullopt;
      if (*v < std::numeric_limits<int>::min() || *v > std::numeric_limits<int>::max())
        detail::throw_config_key(where, name.empty() ? key : name, fmt::format("{} does not fit a 32-bit integer", *v));
      return static_cast<int>(*v);
    } else if constexpr (std::is_same_v<T, double>) {
      return detail::config_number(j, key, where, name);
    } else if constexpr (std::is_same_v<T, bool>) {
      return detail::config_bool(j, key, where, name);
    } else {
      static_assert(std::is_same_v<T, std::string>);
      return detail::config_string(j, key, where, name);
    }
  } catch (const ConfigError& e) {
    throw ModelError(e.what());
  }
}

template <class T>
T get_or(const json& j, const char* key, T dflt, const std::string& where, const std::string& name = {}) {
  return read<T>(j, key, where, name).value_or(dflt);
}

template <class T>
T require(const json& j, const char* key, const std::string& where) {
  const std::optional<T> v = read<T>(j, key, where);
  if (!v) throw ModelError(detail::config_key_message(where, key, "required but missing"));
  return *v;
}

[[noreturn]] void key_error(const std::string& where, const std::string& key, const std::string& reason) {
  throw ModelError(detail::config_key_message(where, key, reason));
}

double yarn_get_mscale(double scale, double mscale) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * mscale * std::log(scale) + 1.0;
}

}  // namespace

namespace {

RopeTable build_rope_table(const RopeConfig& r) {
  if (r.dim <= 0 || r.dim % 2 != 0) throw ModelError(fmt::format("rope dimension {} must be even and positive", r.dim));
  const int half = r.dim / 2;
  RopeTable t;
  t.inv_freq.resize(half);
  // transformers: inv_freq = 1 / base^(arange(0, dim, 2) / dim), computed in FP32.
  for (int i = 0; i < half; ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(r.dim);
    t.inv_freq[i] = 1.0f / static_cast<float>(std::pow(static_cast<double>(static_cast<float>(r.theta)), expo));
  }
  if (r.type == "default") return t;
  if (r.type == "linear") {
    for (float& f : t.inv_freq) f = static_cast<float>(f / r.factor);
    return t;
  }
  if (r.type == "yarn") {
    const double factor = r.factor;
    if (r.attention_factor) {
      t.attention_scaling = static_cast<float>(*r.attention_factor);
    } else if (r.mscale != 0 && r.mscale_all_dim != 0) {
      t.attention_scaling = static_cast<float>(yarn_get_mscale(factor, r.mscale) / yarn_get_mscale(factor, r.mscale_all_dim));
    } else {
      t.attention_scaling = static_cast<float>(yarn_get_mscale(factor, 1.0));
    }
    if (r.original_max_position <= 0) throw ModelError("rope yarn: original_max_position_embeddings missing");
    const double base = r.theta, dim = r.dim;
    auto correction_dim = [&](double rotations) {
      return dim * std::log(r.original_max_position / (rotations * 2 * M_PI)) / (2 * std::log(base));
    };
    double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
    if (r.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, dim - 1);
    if (low == high) high += 0.001;
    for (int i = 0; i < half; ++i) {
      const double pos_freq = std::pow(base, 2.0 * i / dim);
      const double extrapolation = 1.0 / pos_freq, interpolation = 1.0 / (factor * pos_freq);
      const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
      const double extra_factor = 1.0 - ramp;
      t.inv_freq[i] = static_cast<float>(interpolation * (1 - extra_factor) + extrapolation * extra_factor);
    }
    return t;
  }
  throw ModelError(fmt::format("rope type \"{}\" is not supported (default, linear, yarn)", r.type));
}

}  // namespace

RopeTable make_rope_table(const RopeConfig& r) {
  RopeTable t = build_rope_table(r);
  // A guard behind TransformerConfig::from_json's checks of the rope values: a non-finite frequency
  // or attention scaling would make every loss NaN and point at the checkpoint's tensors, so the
  // table is refused here, naming the rope parameters.
  if (!std::isfinite(t.attention_scaling))
    throw ModelError(fmt::format("rope type \"{}\": the attention scaling computed from the rope values is {}, not a "
                                 "finite number",
                                 r.type, t.attention_scaling));
  for (std::size_t i = 0; i < t.inv_freq.size(); ++i)
    if (!std::isfinite(t.inv_freq[i]))
      throw ModelError(fmt::format("rope type \"{}\": the rotary frequency {} of {} computed from the rope values "
                                   "(rope_theta {}, factor {}) is {}, not a finite number",
                                   r.type, i, t.inv_freq.size(), r.theta, r.factor, t.inv_freq[i]));
  return t;
}

TransformerConfig TransformerConfig::load(const std::filesystem::path& dir) {
  if (!std::filesystem::is_directory(dir))
    throw ModelError(fmt::format("{}: {} (a model is a Hugging Face checkpoint directory holding config.json and "
                                 "*.safetensors)",
                                 dir.string(), std::filesystem::exists(dir) ? "not a directory" : "no such directory"));
  if (const std::string why = detail::folder_access_problem(dir); !why.empty()) throw ModelError(why);
  const auto path = dir / "config.json";
  if (std::filesystem::is_directory(path))  // reading a folder fails deep inside the stream
    throw ModelError(fmt::format("{}: is a directory; the checkpoint's config.json must be a file", path.string()));
  if (const std::string kind = detail::non_regular_kind(path); !kind.empty())  // a FIFO blocked open() for ever
    throw ModelError(fmt::format("{}: is {}; the checkpoint's config.json must be a regular file", path.string(), kind));
  errno = 0;
  std::ifstream in(path);
  // An unreadable config.json is reported with the reason (strerror); the guess "not a Hugging Face
  // checkpoint directory?" is only for a missing one.
  if (!in) {
    const int err = errno;
    throw ModelError(fmt::format("{}{}{}", path.string(), detail::cannot_open(err),
                                 err == ENOENT ? " (not a Hugging Face checkpoint directory?)" : ""));
  }
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw ModelError(fmt::format("{}: invalid JSON: {}", path.string(), lutb::detail::json_error_text(e.what())));
  }
  return from_json(j, path.string());
}

namespace {

// ---------------------------------------------------------------------------
// TransformerConfig::from_json, step by step: the family, the sizes, the rotary parameters, the
// attention, then one checker per validated thing, and the MoE layout. Keys are read in the same
// order as transformers' configs list them, so the first bad key is the one reported.
// ---------------------------------------------------------------------------

const std::set<std::string> kFamilies = {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3"};

// model_type, one of the families lutb runs. The supported families are listed whether model_type
// is missing or unknown, as lutb quantize's parser lists them.
std::string read_family(const json& j, const std::string& where) {
  const std::string supported = fmt::format("{}", fmt::join(family_names(), ", "));
  const std::optional<std::string> type = read<std::string>(j, "model_type", where);
  if (!type) key_error(where, "model_type", fmt::format("required but missing (supported: {})", supported));
  if (!kFamilies.count(*type))
    key_error(where, "model_type", fmt::format("unsupported model_type \"{}\" (supported: {})", *type, supported));
  return *type;
}

// The sizes, the norm's epsilon and the dense MLP's width.
void read_sizes(TransformerConfig& c, const json& j, const std::string& where) {
  c.hidden_size = require<int>(j, "hidden_size", where);
  c.num_layers = require<int>(j, "num_hidden_layers", where);
  c.vocab_size = require<int>(j, "vocab_size", where);
  c.num_heads = require<int>(j, "num_attention_heads", where);
  c.num_kv_heads = get_or<int>(j, "num_key_value_heads", c.num_heads, where);
  c.head_dim = get_or<int>(j, "head_dim", c.num_heads ? c.hidden_size / c.num_heads : 0, where);
  c.rms_norm_eps = get_or<double>(j, "rms_norm_eps", 1e-6, where);
  c.tie_word_embeddings = get_or<bool>(j, "tie_word_embeddings", false, where);
  c.intermediate_size = get_or<int>(j, "intermediate_size", 0, where);
  c.clip_qkv = get_or<double>(j, "clip_qkv", 0.0, where);
}

void check_sizes(const TransformerConfig& c, const std::string& where) {
  for (const auto& [key, v] : {std::pair<const char*, int>{"hidden_size", c.hidden_size},
                               {"num_hidden_layers", c.num_layers},
                               {"vocab_size", c.vocab_size},
                               {"num_attention_heads", c.num_heads},
                               {"num_key_value_heads", c.num_kv_heads}})
    if (v <= 0) key_error(where, key, fmt::format("must be positive, got {}", v));
  if (c.num_heads % c.num_kv_heads != 0)
    key_error(where, "num_key_value_heads",
              fmt::format("{} must divide num_attention_heads ({})", c.num_kv_heads, c.num_heads));
  // eps must be >= 0 and finite: rsqrt(mean_sq + eps) of a negative sum is NaN.
  if (!(std::isfinite(c.rms_norm_eps) && c.rms_norm_eps >= 0))
    key_error(where, "rms_norm_eps", fmt::format("must be a finite number >= 0, got {}", c.rms_norm_eps));
}

// Where the rotary parameters were read, for the keys errors name.
struct RopeKeys {
  json rp = json::object();            // the rotary parameters' object
  std::string rp_key = "rope_parameters";  // its key in config.json
  double partial = 1.0;                // partial_rotary_factor
  std::string partial_key;             // where partial_rotary_factor was read
  std::string in_rp(const char* k) const { return rp_key + "." + k; }
};

// Rotary parameters: transformers 5 rope_parameters, else transformers 4 rope_theta + rope_scaling.
RopeKeys read_rope(RopeConfig& r, const json& j, const std::string& where) {
  RopeKeys k;
  if (const json* p = find(j, "rope_parameters")) k.rp = *p;
  else if (const json* p = find(j, "rope_scaling")) k.rp = *p, k.rp_key = "rope_scaling";
  const json& rp = k.rp;
  if (!rp.is_object()) key_error(where, k.rp_key, fmt::format("must be an object, got {}", detail::json_excerpt(rp)));
  r.theta = read<double>(rp, "rope_theta", where, k.in_rp("rope_theta")).value_or(get_or<double>(j, "rope_theta", 10000.0, where));
  r.type = get_or<std::string>(rp, "rope_type", get_or<std::string>(rp, "type", "default", where, k.in_rp("type")), where,
                               k.in_rp("rope_type"));
  r.factor = get_or<double>(rp, "factor", 1.0, where, k.in_rp("factor"));
  r.original_max_position = get_or<double>(rp, "original_max_position_embeddings",
                                           get_or<double>(j, "max_position_embeddings", 0.0, where), where,
                                           k.in_rp("original_max_position_embeddings"));
  r.beta_fast = get_or<double>(rp, "beta_fast", 32.0, where, k.in_rp("beta_fast"));
  r.beta_slow = get_or<double>(rp, "beta_slow", 1.0, where, k.in_rp("beta_slow"));
  r.mscale = get_or<double>(rp, "mscale", 0.0, where, k.in_rp("mscale"));
  r.mscale_all_dim = get_or<double>(rp, "mscale_all_dim", 0.0, where, k.in_rp("mscale_all_dim"));
  r.attention_factor = read<double>(rp, "attention_factor", where, k.in_rp("attention_factor"));
  r.truncate = get_or<bool>(rp, "truncate", true, where, k.in_rp("truncate"));
  k.partial = get_or<double>(rp, "partial_rotary_factor", get_or<double>(j, "partial_rotary_factor", 1.0, where),
                             where, k.in_rp("partial_rotary_factor"));
  k.partial_key = find(rp, "partial_rotary_factor") ? k.in_rp("partial_rotary_factor") : std::string("partial_rotary_factor");
  return k;
}

bool is_deepseek(const TransformerConfig& c) { return c.family == "deepseek_v2" || c.family == "deepseek_v3"; }

// DeepSeek's multi-head latent attention: its widths, the rotary pairs and the softmax scale.
void read_mla(TransformerConfig& c, const json& j, const std::string& where) {
  RopeConfig& r = c.rope;
  c.mla = true;
  c.q_lora_rank = get_or<int>(j, "q_lora_rank", 0, where);
  c.kv_lora_rank = require<int>(j, "kv_lora_rank", where);
  c.qk_nope_head_dim = require<int>(j, "qk_nope_head_dim", where);
  c.qk_rope_head_dim = require<int>(j, "qk_rope_head_dim", where);
  c.v_head_dim = require<int>(j, "v_head_dim", where);
  // deepseek_v2 applies rope to interleaved pairs (complex form); deepseek_v3 when rope_interleave.
  c.rope_interleave = c.family == "deepseek_v2" ? true : get_or<bool>(j, "rope_interleave", true, where);
  r.dim = c.qk_rope_head_dim;
  double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_nope_head_dim + c.qk_rope_head_dim));
  // transformers 5: DeepseekV3Attention multiplies by yarn mscale(factor, mscale_all_dim)^2;
  // DeepseekV2Attention keeps qk_head_dim^-0.5 (its yarn scaling lives in the rope's cos/sin only).
  if (c.family == "deepseek_v3" && r.type != "default" && r.mscale_all_dim != 0) {
    const double m = yarn_get_mscale(r.factor, r.mscale_all_dim);
    scale *= m * m;
  }
  c.attention_scale = static_cast<float>(scale);
}

// Llama-style attention: the rotary part of each head and the softmax scale.
void set_head_rope(TransformerConfig& c, const RopeKeys& k, const std::string& where) {
  // The rotary part of a head is its first head_dim x partial_rotary_factor values: the factor must
  // be in (0, 1], since a larger one rotates values of the next head and, for the last head, past
  // the end of the buffer.
  if (!(k.partial > 0.0 && k.partial <= 1.0))
    key_error(where, k.partial_key,
              fmt::format("must be in (0, 1] (the fraction of each head's {} dimensions that is rotated), got {}",
                          c.head_dim, k.partial));
  c.rope.dim = static_cast<int>(c.head_dim * k.partial);
  c.attention_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
}

// The rotary table's inputs, checked here so that an error names config.json and the key (the
// table's own check, "rope dimension 0 must be even and positive", names neither).
void check_rotary_dim(const TransformerConfig& c, const RopeKeys& k, const std::string& where) {
  const int dim = c.rope.dim;
  if (dim > 0 && dim % 2 == 0) return;
  const bool deepseek = is_deepseek(c);
  const std::string key = deepseek ? "qk_rope_head_dim" : (k.partial != 1.0 ? k.partial_key : "head_dim");
  key_error(where, key,
            deepseek ? fmt::format("gives a rotary dimension of {}; it must be even and positive", dim)
                     : fmt::format("head_dim {} x partial_rotary_factor {} gives a rotary dimension of {}; it must be "
                                   "even and positive",
                                   c.head_dim, k.partial, dim));
}

// Per-head widths (after the rotary dimension's own check, which words a non-positive head_dim or
// qk_rope_head_dim): the rotary table (head_dim x partial_rotary_factor / 2 FP32 values, or
// qk_rope_head_dim / 2) is built before the attention tensors' shapes are compared with them, so a
// corrupt width (2e9) must be refused here, before it allocates gigabytes. Published MoE models use
// 64-256 (DeepSeek's MLA: 64 + 128, v 128); the bound is far above any of them. A negative MLA
// width is refused here too: the shape check would word it as a tensor "expected [124, 64]".
void check_head_widths(const TransformerConfig& c, const std::string& where) {
  constexpr int kMaxHeadWidth = 65536;
  std::vector<std::pair<const char*, int>> widths;
  if (is_deepseek(c)) {
    widths = {{"qk_nope_head_dim", c.qk_nope_head_dim}, {"qk_rope_head_dim", c.qk_rope_head_dim},
              {"v_head_dim", c.v_head_dim}, {"kv_lora_rank", c.kv_lora_rank}};
    if (c.q_lora_rank < 0)
      key_error(where, "q_lora_rank", fmt::format("must be positive (or 0 / null for no query compression), got {}",
                                                  c.q_lora_rank));
  } else {
    widths = {{"head_dim", c.head_dim}};
  }
  for (const auto& [key, v] : widths) {
    if (v <= 0) key_error(where, key, fmt::format("must be positive, got {}", v));
    if (v > kMaxHeadWidth)
      key_error(where, key,
                fmt::format("{} is more than lutb supports ({}; published models use 64-256): a corrupt config.json?",
                            v, kMaxHeadWidth));
  }
}

// rope_theta may sit in rope_parameters (transformers 5) or at the top level (transformers 4).
// Returns the key it was read from.
std::string check_rope_theta(const RopeConfig& r, const RopeKeys& k, const std::string& where) {
  const std::string theta_key = find(k.rp, "rope_theta") ? k.in_rp("rope_theta") : std::string("rope_theta");
  if (!(std::isfinite(r.theta) && r.theta > 0))
    key_error(where, theta_key, fmt::format("must be a positive finite number, got {}", r.theta));
  return theta_key;
}

bool rope_type_supported(const RopeConfig& r) { return r.type == "default" || r.type == "linear" || r.type == "yarn"; }

// The scaled rope types' values, with transformers' rules (modeling_rope_utils.py,
// _validate_linear_scaling_rope_parameters and _validate_yarn_parameters: factor >= 1, attention_factor
// > 0, beta_fast not below beta_slow), plus what the formulas need to stay finite (beta_slow > 0, the
// logarithm of a positive number of rotations; rope_theta > 1 for yarn, whose correction range divides
// by ln(rope_theta)). Values outside them give a NaN loss that would point at the checkpoint's
// tensors (yarn with factor 4 and beta_fast 0, yarn with beta_slow -1 and rope_theta 1, linear with
// factor 1e-300). transformers only warns about most of these, and reads a beta of 0 as its default:
// lutb refuses rather than guess.
void check_scaled_rope(const RopeConfig& r, const RopeKeys& k, const std::string& theta_key, const std::string& where) {
  const bool scaled = r.type == "linear" || r.type == "yarn";
  if (scaled && !(std::isfinite(r.factor) && r.factor >= 1))
    key_error(where, k.in_rp("factor"),
              fmt::format("must be a finite number >= 1 for rope_type \"{}\" (the factor by which the context is "
                          "extended, as transformers requires), got {}",
                          r.type, r.factor));
  if (r.type != "yarn") return;
  if (!(std::isfinite(r.original_max_position) && r.original_max_position > 0))
    key_error(where, k.in_rp("original_max_position_embeddings"),
              "required for rope_type \"yarn\" (or max_position_embeddings), and positive");
  if (!(r.theta > 1))
    key_error(where, theta_key,
              fmt::format("must be greater than 1 for rope_type \"yarn\" (its correction range divides by "
                          "ln(rope_theta)), got {}",
                          r.theta));
  if (!(std::isfinite(r.beta_slow) && r.beta_slow > 0))
    key_error(where, k.in_rp("beta_slow"),
              fmt::format("must be a positive finite number for rope_type \"yarn\" (a number of rotations; "
                          "default 1), got {}",
                          r.beta_slow));
  if (!(std::isfinite(r.beta_fast) && r.beta_fast > 0))
    key_error(where, k.in_rp("beta_fast"),
              fmt::format("must be a positive finite number for rope_type \"yarn\" (a number of rotations; "
                          "default 32), got {}",
                          r.beta_fast));
  if (r.beta_fast < r.beta_slow)
    key_error(where, k.in_rp("beta_fast"),
              fmt::format("must not be below beta_slow for rope_type \"yarn\" (transformers' rule), got beta_fast "
                          "{} and beta_slow {}",
                          r.beta_fast, r.beta_slow));
  if (r.attention_factor && !(std::isfinite(*r.attention_factor) && *r.attention_factor > 0))
    key_error(where, k.in_rp("attention_factor"),
              fmt::format("must be a positive finite number for rope_type \"yarn\", got {}", *r.attention_factor));
  for (const auto& [key, v] : {std::pair<const char*, double>{"mscale", r.mscale}, {"mscale_all_dim", r.mscale_all_dim}})
    if (!std::isfinite(v)) key_error(where, k.in_rp(key), fmt::format("must be a finite number, got {}", v));
}

// The table itself (make_rope_table refuses a non-finite one): a combination the checks above let
// through is still named here, with config.json, rather than as a NaN loss.
void check_rope_table(const RopeConfig& r, const RopeKeys& k, const std::string& where) {
  if (!rope_type_supported(r)) return;
  try {
    (void)make_rope_table(r);
  } catch (const ModelError& e) {
    key_error(where, k.rp_key, fmt::format("{} (its values cannot be used)", e.what()));
  }
}

// Sliding-window attention: Mixtral "sliding_window"; Qwen2/3-MoE only with use_sliding_window. A
// negative window is refused, not read as "no window"; 0 or null mean none, as in transformers'
// configs.
void read_sliding_window(TransformerConfig& c, const json& j, const std::string& where) {
  if (c.family == "mixtral") c.sliding_window = get_or<int>(j, "sliding_window", 0, where);
  if ((c.family == "qwen3_moe" || c.family == "qwen2_moe") && get_or<bool>(j, "use_sliding_window", false, where))
    c.sliding_window = get_or<int>(j, "sliding_window", 0, where);
  if (c.sliding_window < 0)
    key_error(where, "sliding_window",
              fmt::format("must be a positive number of tokens (or 0 / null for none), got {}", c.sliding_window));
}

// MoE layout and routing: the checkpoint module's parser (every spec-7 key variant).
void read_moe(TransformerConfig& c, const json& j, const std::string& where) {
  try {
    c.moe = parse_model_config(j, where);
  } catch (const ConfigError& e) {
    throw ModelError(e.what());
  }
  c.num_experts = static_cast<int>(c.moe.num_experts);
  c.moe_intermediate_size = static_cast<int>(c.moe.moe_intermediate_size);
  c.n_shared_experts = static_cast<int>(c.moe.n_shared_experts);
  c.shared_expert_intermediate_size = static_cast<int>(c.moe.shared_expert_intermediate_size);
  c.sparse_layer.assign(c.num_layers, false);
  for (int l = 0; l < c.num_layers; ++l) c.sparse_layer[l] = c.moe.is_moe_layer(l);
}

}  // namespace

TransformerConfig TransformerConfig::from_json(const json& j, const std::string& where) {
  // The checkpoint parser's wording (lutb quantize): a JSON array, number or null is not an object,
  // which says more than "key 'model_type': required but missing".
  if (!j.is_object()) throw ModelError(fmt::format("{}: not a JSON object", where));
  TransformerConfig c;
  c.raw = j;
  c.family = read_family(j, where);
  read_sizes(c, j, where);
  const std::string act = get_or<std::string>(j, "hidden_act", "silu", where);
  // A feature lutb's model does not implement is reported after every value is checked, so that an
  // invalid value is never hidden behind it (lutb quantize accepts the one, refuses the other).
  std::string unsupported;
  if (act != "silu")
    unsupported = detail::config_key_message(where, "hidden_act", fmt::format("\"{}\" is not supported (silu)", act));
  check_sizes(c, where);

  const RopeKeys rope = read_rope(c.rope, j, where);
  if (is_deepseek(c))
    read_mla(c, j, where);
  else
    set_head_rope(c, rope, where);
  check_rotary_dim(c, rope, where);
  check_head_widths(c, where);
  const std::string theta_key = check_rope_theta(c.rope, rope, where);
  if (!rope_type_supported(c.rope) && unsupported.empty())
    unsupported = detail::config_key_message(where, rope.in_rp("rope_type"),
                                             fmt::format("\"{}\" is not supported (default, linear, yarn)", c.rope.type));
  check_scaled_rope(c.rope, rope, theta_key, where);
  check_rope_table(c.rope, rope, where);

  read_sliding_window(c, j, where);
  read_moe(c, j, where);
  if (!unsupported.empty()) throw UnsupportedConfigError(unsupported);
  return c;
}

}  // namespace lutb::model
