// Tensor names of a checkpoint against its config.json (see tensor_names.hpp).
#include "io/tensor_names.hpp"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <map>
#include <optional>
#include <utility>

#include <fmt/core.h>
#include <fmt/ranges.h>

namespace lutb::detail {

namespace {

enum class Kind { Model, Extra, Unknown, Expert, Scale, LutbWithoutConfig };

struct Verdict {
  Kind kind = Kind::Unknown;
  std::string why;  // Unknown: a hint ("" or " (...)"); Expert: the reason
  // A routed-expert tensor of the model: its layer and its layout ("mlp. stacked", "mlp. per expert";
  // Mixtral's prefix block_sparse_moe. too), so that a layer storing its experts twice is refused
  // (check_tensor_names).
  std::int64_t layer = -1;
  std::string layout;
  // Built from one to four values ({Kind::Model, {}}): as an aggregate, every such initialiser left
  // out `layer` or `layout`, and GCC warned 25 times (-Wmissing-field-initializers) in a fresh build.
  Verdict() = default;
  Verdict(Kind k, std::string w, std::int64_t l = -1, std::string lay = {})
      : kind(k), why(std::move(w)), layer(l), layout(std::move(lay)) {}
};

bool starts(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends(std::string_view s, std::string_view p) { return s.size() >= p.size() && s.substr(s.size() - p.size()) == p; }
bool contains(std::string_view s, std::string_view p) { return s.find(p) != std::string_view::npos; }

// "123" -> 123; nullopt for anything else (no sign, no leading '+', fits 63 bits).
std::optional<std::int64_t> index(std::string_view s) {
  std::int64_t v = -1;
  const auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || r.ec != std::errc() || r.ptr != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

struct Ctx {
  const ModelConfig& c;
  std::string config;  // config.json's path, for messages
  bool lutb = false;
  bool q_lora = false;
  std::int64_t layer_end = 0;  // num_hidden_layers + DeepSeek-V3's num_nextn_predict_layers
};

bool is_deepseek(ModelFamily f) { return f == ModelFamily::deepseek_v3 || f == ModelFamily::deepseek_v2; }

std::string moe_layers(const ModelConfig& c) {
  const auto v = c.moe_layers();
  return v.empty() ? std::string("none") : fmt::format("{}", fmt::join(v, ", "));
}

// What the routed experts of layer L are named, for the messages.
std::string expected_experts(const Ctx& x, std::int64_t L) {
  const std::string sfx = x.lutb ? "_packed (with _codebook, _scale)" : "";
  return fmt::format("per expert {}{} for experts 0..{} and gate, up, down, or stacked {}{} and {}{}",
                     expert_weight_name(x.c, L, 0, Proj::gate), sfx, x.c.num_experts - 1,
                     stacked_gate_up_name(x.c, L), x.lutb ? "_packed" : "", stacked_down_name(x.c, L),
                     x.lutb ? "_packed" : "");
}

// The part of a MoE layer's name after "model.layers.L." and the MoE prefix.
Verdict moe_part(const Ctx& x, std::int64_t L, std::string_view prefix, std::string_view r) {
  const ModelConfig& c = x.c;
  if (r == "gate.weight") return {Kind::Model, {}};
  if (c.family == ModelFamily::deepseek_v3 && r == "gate.e_score_correction_bias") return {Kind::Model, {}};
  if (c.shared_expert_intermediate_size > 0) {
    const std::string_view base = c.family == ModelFamily::qwen2_moe ? "shared_expert." : "shared_experts.";
    if (starts(r, base)) {
      const std::string_view p = r.substr(base.size());
      if (p == "gate_proj.weight" || p == "up_proj.weight" || p == "down_proj.weight") return {Kind::Model, {}};
    }
    if (c.family == ModelFamily::qwen2_moe && r == "shared_expert_gate.weight") return {Kind::Model, {}};
  }
  if (starts(r, "experts.")) {
    std::string_view e = r.substr(8);
    std::string_view sfx;
    for (std::string_view s : {"_packed", "_codebook", "_scale"})
      if (ends(e, s)) {
        sfx = s;
        e.remove_suffix(s.size());
        break;
      }
    bool named = false, stacked = false;
    if (e == "gate_up_proj" || e == "down_proj") {
      named = stacked = true;
    } else if (const std::size_t dot = e.find('.'); dot != std::string_view::npos) {
      const std::optional<std::int64_t> n = index(e.substr(0, dot));
      std::string_view p = e.substr(dot + 1);
      const bool mixtral = c.family == ModelFamily::mixtral;
      const bool proj_ok = ends(p, ".weight") &&
                           (mixtral ? (prefix == "block_sparse_moe." &&
                                       (starts(p, "w1.") || starts(p, "w2.") || starts(p, "w3.")) && p.size() == 9)
                                    : (p == "gate_proj.weight" || p == "up_proj.weight" || p == "down_proj.weight"));
      if (n && proj_ok) {
        if (*n >= c.num_experts)
          return {Kind::Expert, fmt::format("names expert {}, but {} declares {} experts (0..{})", *n, x.config,
                                            c.num_experts, c.num_experts - 1)};
        named = true;
      }
    }
    if (named) {
      if (!sfx.empty() && !x.lutb) return {Kind::LutbWithoutConfig, {}};
      if (sfx.empty() && x.lutb)
        return {Kind::Unknown, " (a float routed-expert weight in a LUT-B checkpoint, whose experts are the *_packed, "
                               "*_codebook and *_scale tensors)"};
      return {Kind::Model, {}, L, std::string(prefix) + (stacked ? " stacked" : " per expert")};
    }
  }
  if (contains(r, "expert"))
    return {Kind::Expert, fmt::format("is named like an expert tensor of MoE layer {} but is not one the model has "
                                      "(expected {}; a misspelt name?)",
                                      L, expected_experts(x, L))};
  if (r == "gate_proj.weight" || r == "up_proj.weight" || r == "down_proj.weight")
    return {Kind::Unknown, fmt::format(" (a dense MLP weight, but {} makes layer {} a MoE layer)", x.config, L)};
  return {Kind::Unknown, {}};
}

Verdict classify(const Ctx& x, const std::string& name) {
  const ModelConfig& c = x.c;
  // Block scales of weights quantised by another method (FP8: DeepSeek-V3's release stores F8_E4M3
  // weights with *.weight_scale_inv, compressed-tensors FP8 *.weight_scale). Without a
  // quantization_config (refused when present, parse_model_config) the F8_E4M3 weight would be read
  // as plain floats, without its scale, so they are refused. A routed expert's *.weight_scale is refused below as a LUT-B
  // tensor without a LUT-B config.
  if (!x.lutb && (ends(name, ".weight_scale_inv") || (ends(name, ".weight_scale") && !contains(name, ".experts."))))
    return {Kind::Scale, {}};
  if (name == "model.embed_tokens.weight" || name == "model.norm.weight" || name == "lm_head.weight")
    return {Kind::Model, {}};  // lm_head of a tied model: stored by some exporters, unused (as in transformers)
  if (ends(name, ".rotary_emb.inv_freq")) return {Kind::Extra, {}};  // recomputed from config.json
  static constexpr std::string_view kLayers = "model.layers.";
  if (!starts(name, kLayers)) return {Kind::Unknown, {}};
  const std::string_view rest0 = std::string_view(name).substr(kLayers.size());
  const std::size_t dot = rest0.find('.');
  const std::optional<std::int64_t> L = dot == std::string_view::npos ? std::nullopt : index(rest0.substr(0, dot));
  if (!L) return {Kind::Unknown, {}};
  if (*L >= c.num_hidden_layers) return {Kind::Extra, {}};  // MTP layers pass; beyond them the callers refuse
  const std::string_view r = rest0.substr(dot + 1);
  if (r == "input_layernorm.weight" || r == "post_attention_layernorm.weight") return {Kind::Model, {}};
  if (starts(r, "self_attn.")) {
    const std::string_view a = r.substr(10);
    std::vector<std::string_view> linears, norms;
    if (is_deepseek(c.family)) {
      if (x.q_lora) {
        linears = {"q_a_proj", "q_b_proj"};
        norms = {"q_a_layernorm", "kv_a_layernorm"};
      } else {
        linears = {"q_proj"};
        norms = {"kv_a_layernorm"};
      }
      linears.insert(linears.end(), {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"});
    } else {
      linears = {"q_proj", "k_proj", "v_proj", "o_proj"};
      // q/k norms are the family's (transformers: Qwen3-MoE and OLMoE attention have them, Mixtral and
      // Qwen2-MoE not): a Mixtral checkpoint's stray q_norm/k_norm are left unread, as any other unknown
      // tensor.
      if (c.family == ModelFamily::qwen3_moe || c.family == ModelFamily::olmoe) norms = {"q_norm", "k_norm"};
    }
    for (std::string_view l : linears)
      if (starts(a, l) && (a.substr(l.size()) == ".weight" || a.substr(l.size()) == ".bias")) return {Kind::Model, {}};
    for (std::string_view n : norms)
      if (starts(a, n) && a.substr(n.size()) == ".weight") return {Kind::Model, {}};
    if (a == "q_norm.weight" || a == "k_norm.weight")
      return {Kind::Unknown, fmt::format(" (a q/k norm, which the {} attention does not have)", c.model_type)};
    return {Kind::Unknown, {}};
  }
  if (!c.is_moe_layer(*L)) {
    if (r == "mlp.gate_proj.weight" || r == "mlp.up_proj.weight" || r == "mlp.down_proj.weight") return {Kind::Model, {}};
    if (contains(r, "expert"))
      return {Kind::Expert, fmt::format("is an expert tensor of layer {}, but {} makes layer {} a dense layer (its MoE "
                                        "layers: {}); the config and the weights disagree",
                                        *L, x.config, *L, moe_layers(c))};
    return {Kind::Unknown, {}};
  }
  for (std::string_view prefix : {std::string_view("mlp."), std::string_view("block_sparse_moe.")}) {
    if (prefix == "block_sparse_moe." && c.family != ModelFamily::mixtral) continue;
    if (starts(r, prefix)) return moe_part(x, *L, prefix, r.substr(prefix.size()));
  }
  if (contains(r, "expert"))
    return {Kind::Expert, fmt::format("is named like an expert tensor of MoE layer {} but is not one the model has "
                                      "(expected {}; a misspelt name?)",
                                      *L, expected_experts(x, L.value()))};
  return {Kind::Unknown, {}};
}

}  // namespace

std::vector<std::string> check_tensor_names(const ModelConfig& cfg, const SafetensorsCollection& st,
                                            const std::filesystem::path& config_path, std::string_view consequence,
                                            std::string_view error_suffix) {
  Ctx x{cfg, config_path.string()};
  x.lutb = parse_lutb_quant_config(cfg.raw, x.config).has_value();
  if (const auto it = cfg.raw.find("q_lora_rank"); it != cfg.raw.end() && it->is_number_integer())
    x.q_lora = it->get<std::int64_t>() > 0;
  std::vector<std::string> names = st.names();
  std::sort(names.begin(), names.end());
  std::vector<std::string> unknown;
  std::vector<std::string> hints;
  std::map<std::int64_t, std::pair<std::string, std::string>> layouts;  // layer -> (layout, first tensor)
  for (const std::string& n : names) {
    const Verdict v = classify(x, n);
    // A layer with both stacked (gate_up_proj) and per-expert (experts.0.gate_proj) tensors, or, for
    // Mixtral, experts under both block_sparse_moe. and mlp.: refused, since a reader would take one
    // layout and ignore the other.
    if (!v.layout.empty()) {
      const auto [it, first] = layouts.emplace(v.layer, std::make_pair(v.layout, n));
      if (!first && it->second.first != v.layout)
        throw CheckpointError(fmt::format(
            "{}: layer {} stores its routed experts twice, in two layouts ({} and {}); lutb would read one and "
            "ignore the other: remove the copy that is not the model's{}",
            st.file_of(n).path().string(), v.layer, it->second.second, n, error_suffix));
    }
    if (v.kind == Kind::Scale)
      throw CheckpointError(fmt::format(
          "{}: tensor {} is the block scale of a weight quantised by another method (an FP8 checkpoint, such as "
          "DeepSeek-V3's release, stores F8_E4M3 weights with weight_scale_inv block scales), which lutb does not "
          "apply: it would read the weight without its scale; {} has no LUT-B quantization_config: dequantise the "
          "checkpoint to BF16 first{}",
          st.file_of(n).path().string(), n, x.config, error_suffix));
    // A LUT-B expert tensor without a LUT-B quantization_config: either the checkpoint's experts are
    // LUT-B and config.json lost the entry that says how to read them (spec 2.2), or a stray tensor sits
    // among float experts. The message names both, not only the
    // advice for a misspelt expert ("lutb would not read it: rename or remove it").
    if (v.kind == Kind::LutbWithoutConfig)
      throw CheckpointError(fmt::format(
          "{}: tensor {} is a LUT-B tensor of a routed expert, but {} has no LUT-B quantization_config (the "
          "\"quantization_config\" with \"quant_method\": \"lut_b\" that says how to read LUT-B weights, spec 2.2; a "
          "BF16 checkpoint's experts are float tensors): if the checkpoint's experts are LUT-B, restore the config.json "
          "written with them; otherwise remove the tensor{}",
          st.file_of(n).path().string(), n, x.config, error_suffix));
    if (v.kind == Kind::Expert)
      throw CheckpointError(fmt::format("{}: tensor {} {}; lutb would not read it: rename or remove it{}", st.file_of(n).path().string(), n,
                                        v.why, error_suffix));
    if (v.kind == Kind::Unknown) {
      unknown.push_back(n);
      hints.push_back(v.why);
    }
  }
  std::vector<std::string> out;
  constexpr std::size_t kListed = 5;
  for (std::size_t i = 0; i < unknown.size() && i < kListed; ++i)
    out.push_back(fmt::format("{}: tensor {} is not a tensor of the {} model {} describes{}; {}",
                              st.file_of(unknown[i]).path().string(), unknown[i], cfg.model_type, x.config, hints[i],
                              consequence));
  if (unknown.size() > kListed)
    // "1 more tensors are not ...; lutb eval does not read it".
    out.push_back(fmt::format("{} more {} not {} of the {} model {} describes (the first {} are listed above); for "
                              "each: {}",
                              unknown.size() - kListed, unknown.size() - kListed == 1 ? "tensor is" : "tensors are",
                              unknown.size() - kListed == 1 ? "a tensor" : "tensors", cfg.model_type, x.config,
                              kListed, consequence));
  return out;
}

}  // namespace lutb::detail
