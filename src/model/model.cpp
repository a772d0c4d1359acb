// LanguageModel: loading the dense weights and the forward pass (transformers 5 conventions; see
// include/lutb/model.hpp for the per-family details).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>
#include <string_view>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "io/config_json.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "model/layers.hpp"

namespace lutb::model {
namespace {

struct Layer {
  std::vector<float> input_norm, post_norm;
  // Llama-style attention
  Linear q, k, v, o;
  std::vector<float> q_norm, k_norm;  // per head [head_dim] (qwen3) or whole projection (olmoe)
  // MLA
  Linear q_a, q_b, kv_a, kv_b;
  std::vector<float> q_a_norm, kv_a_norm;
  // feed-forward
  bool sparse = false;
  Mlp mlp;                 // dense layers
  std::unique_ptr<MoeBlock> moe;
};

}  // namespace

struct LanguageModel::Impl {
  TransformerConfig cfg;
  RopeTable rope;
  std::vector<float> embed;    // [V][H]
  std::vector<float> lm_head;  // [V][H]; empty when tied
  std::vector<float> final_norm;
  std::vector<Layer> layers;

  const float* head() const { return lm_head.empty() ? embed.data() : lm_head.data(); }
  void attention(const Layer& L, const float* h, std::int64_t B, std::int64_t T, float* out) const;
  void feed_forward(const Layer& L, int layer, const float* h, std::int64_t BT, float* out) const;
  /// Runs layers [0, upto) on x [B*T][H] in place; when `stop_at_moe` >= 0, stops after the
  /// post-attention norm of that layer and writes it to `moe_in`.
  void run_layers(float* x, std::int64_t B, std::int64_t T, int stop_at_moe, std::vector<float>* moe_in);
};

namespace {

// The dtypes TensorView::to_float reads (its error for any other is the loader's wording below).
bool float_readable(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::F16 || t == DType::BF16 || t == DType::F8_E4M3;
}

struct Loader {
  const SafetensorsCollection& st;
  const std::string& dir;
  /// Check-only mode (check_model_tensors, for lutb quantize): tensor() checks presence, shape and a
  /// float dtype, records the name here and reads nothing (returns an empty vector).
  std::vector<std::string>* checked = nullptr;

  std::vector<float> tensor(const std::string& name, std::vector<std::int64_t> shape) const {
    if (!st.contains(name)) throw ModelError(fmt::format("{}: missing tensor {}{}", dir, name, st.absent_note(name)));
    const TensorView& t = st.get(name);
    // Errors name the file that holds the tensor (not the folder: a sharded checkpoint has many), and
    // the tensor once.
    const std::string file = st.file_of(name).path().string();
    // The expected shape comes from config.json's sizes, which may be the wrong side, so the message
    // says where the expected sizes come from (config.json and its keys).
    if (t.shape != shape)
      throw ModelError(fmt::format("{}: tensor {} has shape [{}], expected [{}] from the sizes in {}", file, name,
                                   fmt::join(t.shape, ", "), fmt::join(shape, ", "),
                                   (std::filesystem::path(dir) / "config.json").string()));
    if (checked) {
      if (!float_readable(t.dtype))  // TensorView::to_float's wording
        throw ModelError(fmt::format("{}: tensor '{}': dtype {} cannot be read as floating point", file, name,
                                     dtype_name(t.dtype)));
      checked->push_back(name);
      return {};
    }
    try {
      return t.to_float();
    } catch (const std::exception& e) {
      throw ModelError(fmt::format("{}: {}", file, e.what()));  // e names the tensor and the dtype
    }
  }
  /// A tensor whose element count (not its exact shape) must be `n` (the router's correction bias,
  /// Qwen2-MoE's shared_expert_gate [1, H]); check-only mode.
  void check_numel(const std::string& name, std::int64_t n, const std::string& shape) const {
    if (!st.contains(name)) throw ModelError(fmt::format("{}: missing tensor {}{}", dir, name, st.absent_note(name)));
    const TensorView& t = st.get(name);
    if (t.numel() != n)
      throw ModelError(fmt::format("{}: tensor {} has shape [{}], expected {} from the sizes in {}",
                                   st.file_of(name).path().string(), name, fmt::join(t.shape, ", "), shape,
                                   (std::filesystem::path(dir) / "config.json").string()));
    (void)tensor(name, t.shape);  // dtype, and recorded
  }
  bool has(const std::string& name) const { return st.contains(name); }
  Linear linear(const std::string& prefix, std::int64_t out, std::int64_t in, bool bias_optional = true) const {
    Linear l;
    l.out = out;
    l.in = in;
    l.w = tensor(prefix + ".weight", {out, in});
    if (bias_optional && has(prefix + ".bias")) l.b = tensor(prefix + ".bias", {out});
    return l;
  }
  Mlp mlp(const std::string& prefix, std::int64_t H, std::int64_t I) const {
    Mlp m;
    m.gate = linear(prefix + ".gate_proj", I, H, false);
    m.up = linear(prefix + ".up_proj", I, H, false);
    m.down = linear(prefix + ".down_proj", H, I, false);
    return m;
  }
};

/// The non-expert tensors of a MoE layer that CheckpointMoe reads through lutb::Checkpoint (router,
/// DeepSeek-V3's correction bias, shared experts), checked with the loader's wording (check-only mode).
void check_moe_dense(const Loader& ld, const TransformerConfig& tc, int l) {
  const lutb::ModelConfig& c = tc.moe;
  const std::int64_t E = c.num_experts, H = c.hidden_size;
  std::string router = router_weight_name(c, l);
  if (!ld.has(router) && c.family == ModelFamily::mixtral && ld.has(fmt::format("model.layers.{}.mlp.gate.weight", l)))
    router = fmt::format("model.layers.{}.mlp.gate.weight", l);
  (void)ld.tensor(router, {E, H});
  const std::string bias = router_bias_name(c, l);
  if (!bias.empty() && (ld.has(bias) || c.topk_method == "noaux_tc"))
    ld.check_numel(bias, E, fmt::format("[{}]", E));
  if (c.shared_expert_intermediate_size > 0) {
    const std::int64_t S = c.shared_expert_intermediate_size;
    const bool qwen2 = c.family == ModelFamily::qwen2_moe;
    const std::string base = moe_prefix(c, l) + (qwen2 ? ".shared_expert" : ".shared_experts");
    (void)ld.tensor(base + ".gate_proj.weight", {S, H});
    (void)ld.tensor(base + ".up_proj.weight", {S, H});
    (void)ld.tensor(base + ".down_proj.weight", {H, S});
    if (qwen2) ld.check_numel(moe_prefix(c, l) + ".shared_expert_gate.weight", H, fmt::format("[1, {}]", H));
  }
}

/// Loads (or, in check-only mode, checks) every tensor the model reads but the routed experts into
/// LanguageModel::Impl `m` (a template: Impl is private to LanguageModel).
template <class ModelImpl>
void load_tensors(ModelImpl& m, const Loader& ld, const SafetensorsCollection& st, const std::filesystem::path& dir,
                  const MoeFactory* moe);

}  // namespace

// Tensors of layers config.json does not declare (num_hidden_layers, plus DeepSeek-V3's
// num_nextn_predict_layers stored after them) would be skipped without a word, and the loss would be
// that of a shorter model: refused, as lutb quantize does. CheckpointMoe (lutb moe) refuses them
// too, rather than calling the stored layers beyond the config "out of range".
void check_declared_layers(const TransformerConfig& c, const SafetensorsCollection& st, const std::filesystem::path& dir) {
  std::int64_t extra = 0;
  if (const auto it = c.raw.find("num_nextn_predict_layers");
      it != c.raw.end() && it->is_number_integer() && it->get<std::int64_t>() > 0 && it->get<std::int64_t>() < 1024)
    extra = it->get<std::int64_t>();
  const std::int64_t end = c.num_layers + extra;
  static constexpr std::string_view kPrefix = "model.layers.";
  for (const std::string& name : st.names()) {
    if (name.compare(0, kPrefix.size(), kPrefix) != 0) continue;
    std::int64_t L = -1;
    const char* b = name.data() + kPrefix.size();
    const auto r = std::from_chars(b, name.data() + name.size(), L);
    if (r.ec != std::errc() || r.ptr == b || *r.ptr != '.' || L < end) continue;
    throw ModelError(fmt::format("{}: tensor {} belongs to layer {}, but {} declares num_hidden_layers {}{} "
                                 "(layers 0..{}): the checkpoint has layers the config does not",
                                 st.file_of(name).path().string(), name, L, (dir / "config.json").string(),
                                 c.num_layers, extra ? fmt::format(" and num_nextn_predict_layers {}", extra) : std::string(),
                                 end - 1));
  }
}

LanguageModel::LanguageModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
LanguageModel::LanguageModel(LanguageModel&&) noexcept = default;
LanguageModel& LanguageModel::operator=(LanguageModel&&) noexcept = default;
LanguageModel::~LanguageModel() = default;
const TransformerConfig& LanguageModel::config() const { return impl_->cfg; }

LanguageModel LanguageModel::load(const std::filesystem::path& dir, const MoeFactory& moe) {
  auto impl = std::make_unique<Impl>();
  impl->cfg = TransformerConfig::load(dir);
  impl->rope = make_rope_table(impl->cfg.rope);
  const auto st = SafetensorsCollection::open_dir(dir);
  const std::string where = dir.string();
  load_tensors(*impl, Loader{st, where}, st, dir, &moe);
  return LanguageModel(std::move(impl));
}

std::vector<std::string> LanguageModel::check_tensors(const std::filesystem::path& dir) {
  Impl m;
  m.cfg = TransformerConfig::load(dir);
  const auto st = SafetensorsCollection::open_dir(dir);
  const std::string where = dir.string();
  std::vector<std::string> names;
  load_tensors(m, Loader{st, where, &names}, st, dir, nullptr);
  return names;
}

namespace {

template <class ModelImpl>
void load_tensors(ModelImpl& m, const Loader& ld, const SafetensorsCollection& st, const std::filesystem::path& dir,
                  const MoeFactory* moe) {
  ModelImpl* impl = &m;
  const TransformerConfig& c = m.cfg;
  const std::string& where = ld.dir;
  const std::int64_t H = c.hidden_size, V = c.vocab_size;
  check_declared_layers(c, st, dir);

  impl->embed = ld.tensor("model.embed_tokens.weight", {V, H});
  impl->final_norm = ld.tensor("model.norm.weight", {H});
  if (!c.tie_word_embeddings) {
    if (ld.has("lm_head.weight")) impl->lm_head = ld.tensor("lm_head.weight", {V, H});
    // transformers ties when the head is absent from the checkpoint (it is never saved when tied).
  }

  impl->layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    Layer& L = impl->layers[l];
    const std::string p = fmt::format("model.layers.{}.", l);
    L.input_norm = ld.tensor(p + "input_layernorm.weight", {H});
    L.post_norm = ld.tensor(p + "post_attention_layernorm.weight", {H});
    const std::string a = p + "self_attn.";
    if (c.mla) {
      const std::int64_t nh = c.num_heads, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (c.q_lora_rank > 0) {
        L.q_a = ld.linear(a + "q_a_proj", c.q_lora_rank, H);
        L.q_a_norm = ld.tensor(a + "q_a_layernorm.weight", {c.q_lora_rank});
        L.q_b = ld.linear(a + "q_b_proj", nh * qk, c.q_lora_rank);
      } else {
        L.q = ld.linear(a + "q_proj", nh * qk, H);
      }
      L.kv_a = ld.linear(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, H);
      L.kv_a_norm = ld.tensor(a + "kv_a_layernorm.weight", {c.kv_lora_rank});
      L.kv_b = ld.linear(a + "kv_b_proj", nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
      L.o = ld.linear(a + "o_proj", H, nh * c.v_head_dim);
    } else {
      const std::int64_t hd = c.head_dim, nq = c.num_heads * hd, nkv = c.num_kv_heads * hd;
      L.q = ld.linear(a + "q_proj", nq, H);
      L.k = ld.linear(a + "k_proj", nkv, H);
      L.v = ld.linear(a + "v_proj", nkv, H);
      L.o = ld.linear(a + "o_proj", H, nq);
      // Whether the attention has q/k norms is the family's (transformers' Qwen3MoeAttention and
      // OlmoeAttention have them; MixtralAttention and Qwen2MoeAttention do not), never the checkpoint's:
      // deciding by the stored tensors would run a Qwen3-MoE layer that lacks its q_norm without QK-norm
      // (a different loss, no error) and apply stray norms of a Mixtral checkpoint. Required where the
      // family has them; elsewhere such tensors are ones eval does not read (io/tensor_names.cpp warns
      // about them).
      if (c.moe.family == ModelFamily::qwen3_moe || c.moe.family == ModelFamily::olmoe) {
        // qwen3_moe: per-head norm [head_dim]; olmoe: whole projection [heads*head_dim].
        const bool per_head = c.moe.family == ModelFamily::qwen3_moe;
        L.q_norm = ld.tensor(a + "q_norm.weight", {per_head ? hd : nq});
        L.k_norm = ld.tensor(a + "k_norm.weight", {per_head ? hd : nkv});
      }
    }
    L.sparse = c.sparse_layer[l];
    if (!L.sparse) {
      L.mlp = ld.mlp(p + "mlp", H, c.intermediate_size);
      continue;
    }
    if (!moe) {
      check_moe_dense(ld, c, l);
      continue;
    }
    L.moe = (*moe)(l);
    if (!L.moe) throw ModelError(fmt::format("{}: no MoE block was built for layer {}", where, l));
  }
}

}  // namespace

void LanguageModel::Impl::attention(const Layer& L, const float* h, std::int64_t B, std::int64_t T, float* out) const {
  const TransformerConfig& c = cfg;
  if (c.sliding_window > 0 && T > c.sliding_window)
    throw ModelError(detail::config_key_message(  // names the key, not only the family
        c.moe.source, "sliding_window",
        fmt::format("{} sets sliding-window attention with a window of {} tokens, which lutb does not implement, and "
                    "the sequences here are {} tokens long",
                    c.family, c.sliding_window, T)));
  const std::int64_t BT = B * T, nh = c.num_heads;
  std::vector<std::int32_t> pos(static_cast<std::size_t>(T));
  std::iota(pos.begin(), pos.end(), 0);
  std::vector<float> q, k, v, o;
  std::int64_t qk_dim, v_dim, nkv;
  if (c.mla) {
    const std::int64_t nope = c.qk_nope_head_dim, rd = c.qk_rope_head_dim, r = c.kv_lora_rank;
    qk_dim = nope + rd;
    v_dim = c.v_head_dim;
    nkv = nh;
    q.resize(static_cast<std::size_t>(BT * nh * qk_dim));
    if (!L.q_a.empty()) {
      std::vector<float> qa(static_cast<std::size_t>(BT * L.q_a.out));
      L.q_a.apply(h, qa.data(), BT);
      rms_norm(qa.data(), L.q_a_norm.data(), qa.data(), BT, L.q_a.out, static_cast<float>(c.rms_norm_eps));
      L.q_b.apply(qa.data(), q.data(), BT);
    } else {
      L.q.apply(h, q.data(), BT);
    }
    std::vector<float> ckv(static_cast<std::size_t>(BT * (r + rd)));
    L.kv_a.apply(h, ckv.data(), BT);
    std::vector<float> lat(static_cast<std::size_t>(BT * r));
    for (std::int64_t t = 0; t < BT; ++t) std::copy_n(ckv.data() + t * (r + rd), r, lat.data() + t * r);
    rms_norm(lat.data(), L.kv_a_norm.data(), lat.data(), BT, r, static_cast<float>(c.rms_norm_eps));
    std::vector<float> kv(static_cast<std::size_t>(BT * nh * (nope + v_dim)));
    L.kv_b.apply(lat.data(), kv.data(), BT);
    for (std::int64_t b = 0; b < B; ++b) {
      // rope on q's rope part (per head) and on the single shared k_rope vector
      apply_rope(q.data() + b * T * nh * qk_dim, T, pos.data(), static_cast<int>(nh), nh * qk_dim, qk_dim, nope, rope,
                 c.rope_interleave);
      apply_rope(ckv.data() + b * T * (r + rd), T, pos.data(), 1, r + rd, 0, r, rope, c.rope_interleave);
    }
    k.resize(static_cast<std::size_t>(BT * nh * qk_dim));
    v.resize(static_cast<std::size_t>(BT * nh * v_dim));
    for (std::int64_t t = 0; t < BT; ++t)
      for (std::int64_t hh = 0; hh < nh; ++hh) {
        const float* src = kv.data() + (t * nh + hh) * (nope + v_dim);
        float* kd = k.data() + (t * nh + hh) * qk_dim;
        std::copy_n(src, nope, kd);
        std::copy_n(ckv.data() + t * (r + rd) + r, rd, kd + nope);
        std::copy_n(src + nope, v_dim, v.data() + (t * nh + hh) * v_dim);
      }
  } else {
    qk_dim = v_dim = c.head_dim;
    nkv = c.num_kv_heads;
    q.resize(static_cast<std::size_t>(BT * nh * qk_dim));
    k.resize(static_cast<std::size_t>(BT * nkv * qk_dim));
    v.resize(static_cast<std::size_t>(BT * nkv * qk_dim));
    L.q.apply(h, q.data(), BT);
    L.k.apply(h, k.data(), BT);
    L.v.apply(h, v.data(), BT);
    if (!L.q_norm.empty()) {
      const float eps = static_cast<float>(c.rms_norm_eps);
      const bool per_head = static_cast<std::int64_t>(L.q_norm.size()) == qk_dim;
      if (per_head) {
        rms_norm(q.data(), L.q_norm.data(), q.data(), BT * nh, qk_dim, eps);
        rms_norm(k.data(), L.k_norm.data(), k.data(), BT * nkv, qk_dim, eps);
      } else {
        rms_norm(q.data(), L.q_norm.data(), q.data(), BT, nh * qk_dim, eps);
        rms_norm(k.data(), L.k_norm.data(), k.data(), BT, nkv * qk_dim, eps);
      }
    }
    // OLMoE: the clamp follows the q/k norms (transformers OlmoeAttention).
    if (c.clip_qkv > 0) {
      const float cl = static_cast<float>(c.clip_qkv);
      for (auto* vec : {&q, &k, &v})
        for (float& x : *vec) x = std::clamp(x, -cl, cl);
    }
    for (std::int64_t b = 0; b < B; ++b) {
      apply_rope(q.data() + b * T * nh * qk_dim, T, pos.data(), static_cast<int>(nh), nh * qk_dim, qk_dim, 0, rope, false);
      apply_rope(k.data() + b * T * nkv * qk_dim, T, pos.data(), static_cast<int>(nkv), nkv * qk_dim, qk_dim, 0, rope, false);
    }
  }
  o.resize(static_cast<std::size_t>(BT * nh * v_dim));
  for (std::int64_t b = 0; b < B; ++b)
    causal_attention(q.data() + b * T * nh * qk_dim, k.data() + b * T * nkv * qk_dim, v.data() + b * T * nkv * v_dim,
                     o.data() + b * T * nh * v_dim, T, static_cast<int>(nh), static_cast<int>(nkv), static_cast<int>(qk_dim),
                     static_cast<int>(v_dim), c.attention_scale);
  L.o.apply(o.data(), out, BT);
}

void LanguageModel::Impl::feed_forward(const Layer& L, int layer, const float* h, std::int64_t BT, float* out) const {
  (void)layer;
  if (!L.sparse) {
    L.mlp.apply(h, out, BT, false);
    return;
  }
  L.moe->forward(h, BT, out);
}

void LanguageModel::Impl::run_layers(float* x, std::int64_t B, std::int64_t T, int stop_at_moe, std::vector<float>* moe_in) {
  const std::int64_t H = cfg.hidden_size, BT = B * T;
  const float eps = static_cast<float>(cfg.rms_norm_eps);
  std::vector<float> h(static_cast<std::size_t>(BT * H)), a(static_cast<std::size_t>(BT * H));
  for (int l = 0; l < cfg.num_layers; ++l) {
    const Layer& L = layers[l];
    rms_norm(x, L.input_norm.data(), h.data(), BT, H, eps);
    attention(L, h.data(), B, T, a.data());
    for (std::int64_t i = 0; i < BT * H; ++i) x[i] += a[i];
    rms_norm(x, L.post_norm.data(), h.data(), BT, H, eps);
    if (l == stop_at_moe) {
      *moe_in = h;
      return;
    }
    feed_forward(L, l, h.data(), BT, a.data());
    for (std::int64_t i = 0; i < BT * H; ++i) x[i] += a[i];
  }
}

double LanguageModel::forward(const std::int32_t* tokens, std::int64_t batch, std::int64_t T, float* logits) {
  Impl& m = *impl_;
  const std::int64_t H = m.cfg.hidden_size, V = m.cfg.vocab_size, BT = batch * T;
  std::vector<float> x(static_cast<std::size_t>(BT * H));
  for (std::int64_t i = 0; i < BT; ++i) {
    const std::int32_t id = tokens[i];
    if (id < 0 || id >= V) throw ModelError(fmt::format("token id {} at position {} is outside the vocabulary [0, {})", id, i, V));
    std::copy_n(m.embed.data() + static_cast<std::int64_t>(id) * H, H, x.data() + i * H);
  }
  m.run_layers(x.data(), batch, T, -1, nullptr);
  rms_norm(x.data(), m.final_norm.data(), x.data(), BT, H, static_cast<float>(m.cfg.rms_norm_eps));
  // Logits one sequence at a time to bound memory: [T][V].
  double total = 0.0;
  std::vector<float> buf(logits ? 0 : static_cast<std::size_t>(T * V));
  for (std::int64_t b = 0; b < batch; ++b) {
    float* lg = logits ? logits + b * T * V : buf.data();
    linear(x.data() + b * T * H, m.head(), nullptr, lg, T, V, H);
    // Per-position losses in parallel, summed in position order: an OpenMP reduction combines the
    // threads' partial sums in an unspecified order, which made the loss differ in its last bit
    // between two runs of the same command (CliGpu.EvalGpuFitEqualsStoredCpuFit checks it).
    std::vector<double> per(static_cast<std::size_t>(T > 1 ? T - 1 : 0));
#pragma omp parallel for schedule(static)
    for (std::int64_t t = 0; t < T - 1; ++t) per[static_cast<std::size_t>(t)] = nll(lg + t * V, V, tokens[b * T + t + 1]);
    double s = 0.0;
    for (const double v : per) s += v;
    total += s;
  }
  return total;
}

std::vector<float> LanguageModel::moe_input(const std::int32_t* tokens, std::int64_t T, int layer) {
  Impl& m = *impl_;
  if (layer < 0 || layer >= m.cfg.num_layers || !m.layers[layer].sparse)
    throw ModelError(fmt::format("layer {} is not a sparse MoE layer", layer));
  const std::int64_t H = m.cfg.hidden_size;
  std::vector<float> x(static_cast<std::size_t>(T * H));
  for (std::int64_t i = 0; i < T; ++i) std::copy_n(m.embed.data() + static_cast<std::int64_t>(tokens[i]) * H, H, x.data() + i * H);
  std::vector<float> out;
  m.run_layers(x.data(), 1, T, layer, &out);
  return out;
}

}  // namespace lutb::model
