// CheckpointMoe: the MoE blocks of a checkpoint (router + routed experts through lutb/moe.hpp).
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <fmt/core.h>
#include <fmt/ranges.h>

#include "io/config_json.hpp"
#include "lutb/model.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "model/expert_source.hpp"
#include "model/layers.hpp"

namespace lutb::model {

std::string quant_name(Quant q) {
  switch (q) {
    case Quant::None: return "none";
    case Quant::Lutb: return "lutb";
    case Quant::Int3G128: return "int3-g128";
    case Quant::Mxfp4: return "mxfp4";
  }
  return "?";
}

Quant quant_from_name(const std::string& name) {
  for (Quant q : {Quant::None, Quant::Lutb, Quant::Int3G128, Quant::Mxfp4})
    if (quant_name(q) == name) return q;
  throw ModelError(fmt::format("--quant '{}' is not supported (none, lutb, int3-g128, mxfp4)", name));
}

double ExpertTensorStats::sqnr_db() const {
  if (sse == 0) return std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(sum_sq / sse);
}

namespace {

/// Refuses BF16 expert weights that `q` cannot quantise before fitting them, naming the stored
/// tensor, its file and the element: NaN / Inf for every format, and for LUT-B a magnitude that
/// needs a tile scale byte above 246 (spec 2). Quant::None: a magnitude of 2^64 or more, before the
/// forward pass overflows on it. Checked here because the fitter sees only the fused stack and would
/// name it ("quantize: tensor w2_weight, expert 3, tile (0, 1)"), not the file, layer or stored tensor.
void check_quantizable(const ExpertSource& src, int layer, Quant q, const std::vector<std::uint16_t>& w, bool w13,
                       std::int64_t rows, std::int64_t cols) {
  const std::int64_t per = rows * cols;
  for (std::size_t i = 0; i < w.size(); ++i) {
    const std::uint16_t b = w[i];
    std::string what;
    if (q == Quant::None) {
      // NaN / Inf are left to the forward pass (its error names the first stored non-finite tensor); a
      // finite weight of 2^64 or more (BF16 exponent byte >= 191) overflows it into a "non-finite loss"
      // that names no tensor, so it is refused here.
      if ((b & 0x7f80u) == 0x7f80u || (b & 0x7f80u) < (191u << 7)) continue;
      throw ModelError(fmt::format(
          "{}: magnitude {} is 2^64 or more, far beyond any trained weight: the FP32 products and sums of the layer "
          "overflow or lose every other term; the checkpoint's tensor is likely corrupt",
          src.locate(layer, w13, static_cast<std::int64_t>(i) / per, (static_cast<std::int64_t>(i) % per) / cols,
                     static_cast<std::int64_t>(i) % cols),
          std::fabs(bf16_to_float(b))));
    }
    if ((b & 0x7f80u) == 0x7f80u) {
      what = (b & 0x7fu) ? "NaN" : ((b & 0x8000u) ? "-Inf" : "+Inf");
    } else if (q == Quant::Lutb) {
      const float v = std::fabs(bf16_to_float(b));
      if (v != 0.0f && ue8m0_rceil(v) > 246) what = fmt::format("magnitude {}", v);
    }
    if (what.empty()) continue;
    const auto at = static_cast<std::int64_t>(i);
    const std::string fmt_name = q == Quant::Lutb ? "LUT-B" : quant_name(q);
    const std::string why = what.rfind("magnitude", 0) == 0
                                ? " needs a scale byte above 246 (spec section 2); it cannot be quantised to " + fmt_name
                                : "; a non-finite weight cannot be quantised to " + fmt_name +
                                      (q == Quant::Lutb ? " (spec 2.1)" : "");
    throw ModelError(fmt::format("{}: {}{}", src.locate(layer, w13, at / per, (at % per) / cols, at % cols), what, why));
  }
}

/// Refuses stored LUT-B weights of magnitude 2^64 or more, naming the scale tensor, the expert and the
/// tile: the rule check_quantizable applies to BF16 weights for --quant none. Scale bytes 3..246 are
/// valid LUT-B (spec section 2: every value exact in FP32), but 448 * 2^119 (scale byte 246) and
/// anything from 2^64 up is far beyond a trained weight: the layer's FP32 products and sums overflow
/// into a "non-finite loss" that names no tensor. Scale
/// bytes above 246 whose weights pass FP32 are refused by the checkpoint reader.
void check_lutb_magnitudes(const ExpertSource& src, int layer, const LutbTensor& w, bool w13) {
  const std::int64_t per = w.shape.tiles_per_expert(), tk = w.shape.tiles_k();
  for (std::int64_t t = 0; t < w.shape.tiles(); ++t) {
    const int s = w.scale[static_cast<std::size_t>(t)];
    if (s < 127 + 55) continue;  // |E4M3| <= 448 < 2^9: below 2^64 whatever the codebook
    for (int j = 0; j < kCodebookSize; ++j) {
      const std::uint8_t b = w.codebook[static_cast<std::size_t>(t * kCodebookSize + j)];
      const double c = std::fabs(static_cast<double>(e4m3_to_float(b)));
      const double v = std::ldexp(c, s - 127);
      if (!(v >= 0x1p64)) continue;
      const std::int64_t e = t / per, r = (t % per) / tk, col = t % tk;
      throw ModelError(fmt::format(
          "{}: scale byte {} with codebook entry {} ({}) gives weights of magnitude {:.4g} (2^{:.1f}): 2^64 or more, far "
          "beyond any trained weight, so the FP32 products and sums of the layer overflow (the loss would be NaN). "
          "Scale bytes up to 246 are valid LUT-B (spec section 2), but a fitter writes such a scale only for weights "
          "of that size; the checkpoint's tensor is likely corrupt",
          src.locate_lutb_tile(layer, w13, e, r, col), s, j, e4m3_to_float(b), v, std::log2(v)));
    }
  }
}

/// The fit of layer `layer`'s w13 [E, 2I, H] and w2 [E, H, I] with the column weights of `cal`
/// (lutb/calibration.hpp): `base` (or lutb::quantize) called with FitOptions::column_weights set, w13
/// and w2 told apart by their shapes (rows 2I and cols H is w13; 2I == H == I cannot occur with I > 0).
/// With `error_feedback` and full second moments in every layer of `cal` (has_second_moments(), the
/// rule of `lutb quantize --calibration`, so that the online fit gives the checkpoint's bytes), also
/// FitOptions::error_feedback with the layer's blended moments (read here, one layer at a time) and
/// `damping`.
moe::FitFunction calibrated_fit(const CalibrationStats& cal, int layer, std::int64_t E, std::int64_t H, std::int64_t I,
                                bool error_feedback, double damping, moe::FitFunction base) {
  const auto it = cal.layers.find(layer);
  const std::string file = cal.source.empty() ? std::string("calibration statistics") : cal.source;
  if (it == cal.layers.end())
    throw ModelError(fmt::format("{}: no statistics for MoE layer {} (were they collected on this model?)", file, layer));
  const LayerCalibration& lc = it->second;
  if (lc.experts != E || lc.hidden != H || lc.intermediate != I)
    throw ModelError(fmt::format("{}: layer {} ({}) has statistics of {} experts, hidden {}, intermediate {}; the model "
                                 "has {}, {}, {}",
                                 file, layer, lc.prefix, lc.experts, lc.hidden, lc.intermediate, E, H, I));
  auto w13 = std::make_shared<const std::vector<float>>(cal.column_weights(layer, CalibratedInput::kGateUp));
  auto w2 = std::make_shared<const std::vector<float>>(cal.column_weights(layer, CalibratedInput::kDown));
  std::shared_ptr<const std::vector<float>> c13, c2;
  if (error_feedback && cal.has_second_moments()) {
    c13 = std::make_shared<const std::vector<float>>(cal.second_moments(layer, CalibratedInput::kGateUp, 0, E));
    c2 = std::make_shared<const std::vector<float>>(cal.second_moments(layer, CalibratedInput::kDown, 0, E));
  }
  return [w13, w2, c13, c2, H, I, damping, base = std::move(base)](const void* src, DType t, const LutbShape& s,
                                                                   LutbTensor& out, const FitOptions& o,
                                                                   const std::string& name) {
    FitOptions f = o;
    const bool is_w13 = s.rows == 2 * I && s.cols == H;
    f.column_weights = (is_w13 ? w13 : w2)->data();
    if (c13) {
      f.error_feedback.second_moments = (is_w13 ? c13 : c2)->data();
      f.error_feedback.damping = damping;
    }
    return base ? base(src, t, s, out, f, name) : quantize(src, t, s, out, f, name);
  };
}

/// DeepSeek-V2 "group_limited_greedy" (transformers modeling_deepseek_v2 DeepseekV2Moe.route_tokens):
/// softmax scores; group score = the max of its experts; keep topk_group groups; top-k of the
/// scores inside them; weights = scores (renormalised when norm_topk_prob) * routed_scaling_factor.
void route_group_limited_greedy(const moe::RouterConfig& rc, const float* logits, std::int64_t T, std::int32_t* ids,
                                float* weights) {
  const int E = rc.num_experts, G = rc.n_group, per = E / G, k = rc.top_k;
  std::vector<float> p(E), gs(G);
  std::vector<int> order(E), gorder(G);
  for (std::int64_t t = 0; t < T; ++t) {
    const float* l = logits + t * E;
    float m = -std::numeric_limits<float>::infinity();
    for (int e = 0; e < E; ++e) m = std::max(m, l[e]);
    float s = 0;
    for (int e = 0; e < E; ++e) s += (p[e] = std::exp(l[e] - m));
    for (int e = 0; e < E; ++e) p[e] /= s;
    for (int g = 0; g < G; ++g) gs[g] = *std::max_element(p.begin() + g * per, p.begin() + (g + 1) * per);
    std::iota(gorder.begin(), gorder.end(), 0);
    std::stable_sort(gorder.begin(), gorder.end(), [&](int a, int b) { return gs[a] > gs[b]; });
    std::vector<bool> keep(G, false);
    for (int i = 0; i < rc.topk_group; ++i) keep[gorder[i]] = true;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const float va = keep[a / per] ? p[a] : 0.0f, vb = keep[b / per] ? p[b] : 0.0f;
      return va > vb;
    });
    float sum = 0;
    for (int i = 0; i < k; ++i) sum += p[order[i]];
    for (int i = 0; i < k; ++i) {
      ids[t * k + i] = order[i];
      float w = p[order[i]];
      if (rc.norm_topk_prob && k > 1) w /= (sum + 1e-20f);
      weights[t * k + i] = w * rc.routed_scaling_factor;
    }
  }
}

/// bf16(x) of n FP32 values, as FP32 (spec section 4: the routed experts read BF16 tokens).
std::vector<float> bf16_rows(const float* x, std::int64_t n) {
  std::vector<float> r(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) r[static_cast<std::size_t>(i)] = bf16_round(x[i]);
  return r;
}

class RoutedBlock final : public MoeBlock {
 public:
  RoutedBlock(moe::RouterConfig rc, bool group_limited_greedy, std::vector<float> gate, std::vector<float> bias,
              std::shared_ptr<const void> owner, const moe::Experts* experts, std::int64_t H, SharedExperts shared)
      : rc_(rc), glg_(group_limited_greedy), gate_(std::move(gate)), bias_(std::move(bias)), owner_(std::move(owner)),
        experts_(experts), H_(H), shared_(std::move(shared)) {
    parts_.router = rc_;
    parts_.group_limited_greedy = glg_;
    parts_.correction_bias = &bias_;
    parts_.experts = experts_;
    parts_.router_logits = [this](const float* x, std::int64_t T, float* logits) {
      linear(x, gate_.data(), nullptr, logits, T, rc_.num_experts, H_);
    };
    parts_.route = [this](const float* logits, std::int64_t T, std::int32_t* ids, float* w) { route(logits, T, ids, w); };
    parts_.add_shared = [this](const float* x, float* out, std::int64_t T) { shared_.add(x, out, T); };
  }

  RoutedBlock(const RoutedBlock&) = delete;  // parts_ captures this
  RoutedBlock& operator=(const RoutedBlock&) = delete;

  const MoeBlockParts* parts() const override { return &parts_; }

  void route(const float* logits, std::int64_t T, std::int32_t* ids, float* w) const {
    if (glg_) route_group_limited_greedy(rc_, logits, T, ids, w);
    else moe::route(rc_, logits, T, bias_.empty() ? nullptr : bias_.data(), ids, w);
  }

  // Spec section 4 at both ends of the routed experts: their input x is BF16 and their output is
  // out = bf16(sum_k weight_k * y_e). The FP32 model rounds x to BF16 for the routed experts only
  // (the router logits and the shared experts read the FP32 x, spec 5: they stay as loaded), and the
  // routed sum to BF16 before the shared experts are added. The GPU kernel (moe_forward) reads BF16 x
  // and writes BF16 too, so eval on the two devices differs only by FP32 summation order (FP32 at
  // both ends moved the CPU loss by 1e-4..5e-4 away from the GPU's).
  void forward(const float* x, std::int64_t T, float* out) override {
    const int E = rc_.num_experts, k = rc_.top_k;
    std::vector<float> logits(static_cast<std::size_t>(T * E)), w(static_cast<std::size_t>(T * k));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(T * k));
    linear(x, gate_.data(), nullptr, logits.data(), T, E, H_);
    route(logits.data(), T, ids.data(), w.data());
    const std::vector<float> xb = bf16_rows(x, T * H_);
    experts_->apply_f32(moe::HiddenStates::f32(xb.data(), T), moe::TopK{ids.data(), w.data(), k}, out);
    for (std::int64_t i = 0; i < T * H_; ++i) out[i] = bf16_round(out[i]);
    shared_.add(x, out, T);
  }

 private:
  moe::RouterConfig rc_;
  bool glg_;
  std::vector<float> gate_, bias_;
  std::shared_ptr<const void> owner_;  // keeps the experts alive
  const moe::Experts* experts_;
  std::int64_t H_;
  SharedExperts shared_;
  MoeBlockParts parts_;
};

}  // namespace

struct CheckpointMoe::Impl {
  std::filesystem::path dir;
  MoeOptions opt;
  TransformerConfig cfg;
  std::unique_ptr<ExpertSource> src;
  std::vector<ExpertTensorStats> stats;
  std::size_t source_bytes = 0, held_bytes = 0;
  std::int64_t weights = 0;
};

CheckpointMoe::CheckpointMoe(const std::filesystem::path& dir, MoeOptions opt) : impl_(std::make_unique<Impl>()) {
  impl_->dir = dir;
  impl_->opt = std::move(opt);
  impl_->cfg = TransformerConfig::load(dir);
  check_declared_layers(impl_->cfg, SafetensorsCollection::open_dir(dir), dir);
  impl_->src = ExpertSource::open(dir, impl_->cfg);
  if (impl_->src->lutb() && impl_->opt.quant != Quant::Lutb)
    throw ModelError(fmt::format("{}: a LUT-B checkpoint holds no BF16 experts; use --quant lutb", dir.string()));
}
CheckpointMoe::~CheckpointMoe() = default;
const TransformerConfig& CheckpointMoe::config() const { return impl_->cfg; }
bool CheckpointMoe::lutb_checkpoint() const { return impl_->src->lutb(); }
const MoeOptions& CheckpointMoe::options() const { return impl_->opt; }
const std::vector<ExpertTensorStats>& CheckpointMoe::stats() const { return impl_->stats; }
std::size_t CheckpointMoe::source_bytes() const { return impl_->source_bytes; }
std::size_t CheckpointMoe::held_bytes() const { return impl_->held_bytes; }

double CheckpointMoe::aggregate_sqnr_db() const {
  double sse = 0, ss = 0;
  for (const auto& s : impl_->stats) {
    sse += s.sse;
    ss += s.sum_sq;
  }
  if (impl_->stats.empty()) return std::numeric_limits<double>::quiet_NaN();
  if (sse == 0) return std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(ss / sse);
}

double CheckpointMoe::bits_per_weight() const {
  if (impl_->weights == 0) return 0;
  return 8.0 * static_cast<double>(impl_->held_bytes) / static_cast<double>(impl_->weights);
}

MoeFactory CheckpointMoe::factory() {
  return [this](int layer) { return build(layer); };
}

namespace {

moe::RouterConfig router_config(const TransformerConfig& tc, bool* group_limited_greedy) {
  const lutb::ModelConfig& c = tc.moe;
  moe::RouterConfig rc;
  rc.num_experts = static_cast<int>(c.num_experts);
  rc.top_k = static_cast<int>(c.num_experts_per_tok);
  rc.norm_topk_prob = c.renormalize();
  rc.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
  *group_limited_greedy = false;
  if (c.scoring_func == lutb::ScoringFunc::sigmoid) {
    // DeepSeek-V3 noaux_tc (spec 5)
    rc.scoring = moe::ScoringFunc::Sigmoid;
    rc.n_group = static_cast<int>(c.n_group);
    rc.topk_group = static_cast<int>(c.topk_group);
  } else if (c.family == lutb::ModelFamily::deepseek_v2) {
    // transformers 5 DeepseekV2Moe: softmax, greedy or group_limited_greedy, never renormalised,
    // times routed_scaling_factor.
    rc.norm_topk_prob = false;
    if (c.topk_method == "group_limited_greedy") {
      *group_limited_greedy = true;
      rc.n_group = static_cast<int>(c.n_group);
      rc.topk_group = static_cast<int>(c.topk_group);
    } else if (!c.topk_method.empty() && c.topk_method != "greedy") {  // refused by the config parser already
      throw ModelError(detail::config_key_message(
          c.source, "topk_method",
          fmt::format("\"{}\" is not supported for deepseek_v2 (greedy, group_limited_greedy)", c.topk_method)));
    }
  } else if (c.topk_method == "group_limited_greedy") {
    *group_limited_greedy = true;
    rc.n_group = static_cast<int>(c.n_group);
    rc.topk_group = static_cast<int>(c.topk_group);
  } else if (!c.topk_method.empty() && c.topk_method != "greedy") {  // refused by the config parser already
    throw ModelError(detail::config_key_message(
        c.source, "topk_method",
        fmt::format("\"{}\" with softmax scoring is not supported (greedy, group_limited_greedy)", c.topk_method)));
  }
  try {
    rc.validate();
  } catch (const std::exception& e) {
    // The config parser checks what this validates, naming the keys; a remaining fault names the file.
    throw ModelError(fmt::format("{}: the routing keys (num_experts_per_tok, n_group, topk_group, "
                                 "routed_scaling_factor) describe a router lutb cannot run: {}",
                                 c.source, e.what()));
  }
  return rc;
}

}  // namespace

std::unique_ptr<MoeBlock> CheckpointMoe::build(int layer) {
  Impl& m = *impl_;
  const TransformerConfig& c = m.cfg;
  if (layer < 0 || layer >= c.num_layers)
    throw ModelError(fmt::format("{}: layer {} is out of range (the model has {} layers)", m.dir.string(), layer, c.num_layers));
  if (!c.sparse_layer[layer]) {
    std::vector<int> sparse;
    for (int l = 0; l < c.num_layers; ++l)
      if (c.sparse_layer[l]) sparse.push_back(l);
    throw ModelError(fmt::format("{}: layer {} is a dense (non-MoE) layer per {} (its MoE layers: {})", m.dir.string(),
                                 layer, c.moe.source, sparse.empty() ? "none" : fmt::format("{}", fmt::join(sparse, ", "))));
  }
  bool glg = false;
  const moe::RouterConfig rc = router_config(c, &glg);
  RouterWeights router = m.src->router(layer);

  moe::MoeConfig mc;
  mc.global_experts = c.num_experts;
  mc.top_k = rc.top_k;
  mc.hidden_size = c.hidden_size;
  mc.intermediate_size_per_partition = c.moe_intermediate_size;
  mc.finalize();
  const std::int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  const std::int64_t n13 = E * 2 * I * H, n2 = E * H * I;
  const std::string base = m.src->expert_prefix(layer);

  std::shared_ptr<const void> owner;
  const moe::Experts* kernel = nullptr;
  auto record = [&](const char* which, std::int64_t n, const FitStats& fs, std::size_t qbytes) {
    ExpertTensorStats s;
    s.layer = layer;
    s.name = base + "." + which;
    s.weights = n;
    s.sse = fs.sse;
    s.sum_sq = fs.sum_sq;
    s.source_bytes = static_cast<std::size_t>(n) * 2;
    s.quantized_bytes = qbytes;
    m.stats.push_back(s);
  };

  if (m.src->lutb()) {
    // Stored LUT-B weights (spec 2.2): no source to compare with; SQNR is not defined here.
    auto [w13, w2] = m.src->lutb_stacks(layer);
    check_lutb_magnitudes(*m.src, layer, w13, true);
    check_lutb_magnitudes(*m.src, layer, w2, false);
    moe::OnlineOptions oo;
    oo.emulation = m.opt.kernel;
    oo.activations = m.opt.activations;
    auto method = std::make_shared<moe::LutBOnlineMoEMethod>(mc, oo);
    moe::RoutedExpertsLayer rl(mc, DType::BF16);
    rl.w13_weight.clear();
    rl.w13_weight.shrink_to_fit();
    rl.w2_weight.clear();
    rl.w2_weight.shrink_to_fit();
    const std::size_t qbytes = w13.bytes() + w2.bytes();
    method->load_packed(rl, std::move(w13), std::move(w2));
    kernel = &method->kernel();
    owner = method;
    m.source_bytes += static_cast<std::size_t>(n13 + n2) * 2;
    m.held_bytes += qbytes;
    m.weights += n13 + n2;
  } else {
    auto [w13, w2] = m.src->bf16_stacks(layer);
    check_quantizable(*m.src, layer, m.opt.quant, w13, true, 2 * I, H);
    check_quantizable(*m.src, layer, m.opt.quant, w2, false, H, I);
    m.source_bytes += (w13.size() + w2.size()) * 2;
    m.weights += n13 + n2;
    switch (m.opt.quant) {
      case Quant::None: {
        auto ex = std::make_shared<moe::DenseExperts>(mc, std::move(w13), std::move(w2), m.opt.activations);
        m.held_bytes += ex->weight_bytes();
        kernel = ex.get();
        owner = ex;
        break;
      }
      case Quant::Lutb: {
        moe::OnlineOptions oo;
        oo.fit = m.opt.fit;
        oo.fit_function = m.opt.fit_function;
        if (m.opt.calibration)
          oo.fit_function = calibrated_fit(*m.opt.calibration, layer, E, H, I, m.opt.error_feedback, m.opt.damping,
                                           oo.fit_function);
        oo.emulation = m.opt.kernel;
        oo.activations = m.opt.activations;
        auto method = std::make_shared<moe::LutBOnlineMoEMethod>(mc, oo);
        moe::RoutedExpertsLayer rl(mc, DType::BF16);
        rl.w13_weight = std::move(w13);
        rl.w2_weight = std::move(w2);
        const moe::QuantizeReport rep = method->process_weights_after_loading(rl);
        const std::size_t b13 = static_cast<std::size_t>(mc.w13_shape().tiles()) * sizeof(TileBlock);
        const std::size_t b2 = static_cast<std::size_t>(mc.w2_shape().tiles()) * sizeof(TileBlock);
        record("w13", n13, rep.w13, b13);
        record("w2", n2, rep.w2, b2);
        m.held_bytes += b13 + b2;
        kernel = &method->kernel();
        owner = method;
        break;
      }
      case Quant::Int3G128:
      case Quant::Mxfp4: {
        FitStats s13, s2;
        std::size_t q13 = 0, q2 = 0;
        baseline_qdq(m.opt.quant, w13, E * 2 * I, H, base + ".w13", &s13, &q13);
        baseline_qdq(m.opt.quant, w2, E * H, I, base + ".w2", &s2, &q2);
        record("w13", n13, s13, q13);
        record("w2", n2, s2, q2);
        m.held_bytes += q13 + q2;
        auto ex = std::make_shared<moe::DenseExperts>(mc, std::move(w13), std::move(w2), m.opt.activations);
        kernel = ex.get();
        owner = ex;
        break;
      }
    }
  }
  return std::make_unique<RoutedBlock>(rc, glg, std::move(router.gate), std::move(router.correction_bias), owner, kernel, H,
                                       m.src->shared(layer));
}

}  // namespace lutb::model
