// collect_calibration: the second moments of the routed experts' projection inputs over calibration
// tokens (lutb/calibration.hpp, issue 25).
//
// The model runs as the BF16 reference (spec section 4 without the MXFP8 steps). Each MoE block is
// wrapped: before the block's own forward, the wrapper routes the tokens exactly as the block does
// (MoeBlockParts), and for every expert e and the tokens routed to it accumulates
//   gate_up: x_c^2 with x = bf16(token)                       (the experts read BF16 tokens)
//   down:    h_c^2 with h = bf16(silu(g) * u), [g, u] = x . w13[e]^T in FP32
// in double, in token order, each token weighted by q: 1 (TokenWeight::Uniform), or the square of
// its routing weight for that expert (TokenWeight::RoutingWeight: the block's output is
// sum_k weight_k * y_e, so an error of y_e reaches the model scaled by weight_k). The means are the
// q-weighted means. With `down_input = QuantizedW13`, w13 is the LUT-B fit of w13 under the
// gate_up statistics of a first pass and x enters it through MXFP8 (what w2 sees in the quantised
// model); gate_up statistics always come from the BF16 model (w13's own input does not depend on w13).
// With `full_moments`, the same tokens also give the full q-weighted sums of x x^T and h h^T per
// expert (cblas_dsyrk on the rows sqrt(q) * x, in double; OpenBLAS runs single-threaded, so the sums do
// not depend on the thread count).
#include <cblas.h>

#include <cmath>
#include <cstring>
#include <memory>

#include <fmt/core.h>

#include "lutb/calibration.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/mxfp8.hpp"
#include "lutb/numerics.hpp"

namespace lutb::model {
namespace {

struct LayerSums {
  std::string prefix;
  std::int64_t E = 0, H = 0, I = 0;
  std::vector<double> gu, dn, tokens;  // [E][H], [E][I], [E]: sums of q * x^2, q * h^2, 1
  std::vector<double> qsum;            // [E]: sum of the token weights q (q = 1, or the routing weight^2)
  std::vector<double> gu_full, dn_full;  // [E][H][H], [E][I][I]: upper triangles of sum q x x^T, q h h^T
                                         // (empty without CalibrateOptions::full_moments)
  std::vector<float> w13;              // [E][2I][H] FP32: the weights h is computed with
  bool mxfp8_input = false;            // x enters w13 through MXFP8 (QuantizedW13)
  bool gate_weighted = false;          // q = routing weight^2 (TokenWeight::RoutingWeight)
};

// sum[C][C] (upper triangle, row-major) += sum_i q_i v_i v_i^T over the n rows v_i of v [n][C], in
// double: cblas_dsyrk on the rows sqrt(q_i) * v_i.
void add_outer(const float* v, std::int64_t n, std::int64_t C, const std::vector<double>& q, double* sum) {
  std::vector<double> a(static_cast<std::size_t>(n * C));
  for (std::int64_t i = 0; i < n; ++i) {
    const double sq = std::sqrt(q[static_cast<std::size_t>(i)]);
    for (std::int64_t c = 0; c < C; ++c)
      a[static_cast<std::size_t>(i * C + c)] = sq * static_cast<double>(v[static_cast<std::size_t>(i * C + c)]);
  }
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, static_cast<int>(C), static_cast<int>(n), 1.0, a.data(),
              static_cast<int>(C), 1.0, sum, static_cast<int>(C));
}

class RecordingBlock final : public MoeBlock {
 public:
  RecordingBlock(std::unique_ptr<MoeBlock> inner, LayerSums* sums, bool record_gate_up)
      : inner_(std::move(inner)), s_(sums), record_gate_up_(record_gate_up) {}

  void forward(const float* x, std::int64_t T, float* out) override {
    const MoeBlockParts* p = inner_->parts();
    const int E = p->router.num_experts, k = p->router.top_k;
    const std::int64_t H = s_->H, I = s_->I;
    std::vector<float> logits(static_cast<std::size_t>(T * E)), w(static_cast<std::size_t>(T * k));
    std::vector<std::int32_t> ids(static_cast<std::size_t>(T * k));
    p->router_logits(x, T, logits.data());
    p->route(logits.data(), T, ids.data(), w.data());
    std::vector<std::vector<std::int64_t>> rows(static_cast<std::size_t>(E));
    std::vector<std::vector<double>> qs(static_cast<std::size_t>(E));
    for (std::int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) {
        const std::size_t i = static_cast<std::size_t>(t * k + j);
        const double g = w[i];
        rows[static_cast<std::size_t>(ids[i])].push_back(t);
        qs[static_cast<std::size_t>(ids[i])].push_back(s_->gate_weighted ? g * g : 1.0);
      }
    for (int e = 0; e < E; ++e) {
      const auto& r = rows[static_cast<std::size_t>(e)];
      const std::int64_t n = static_cast<std::int64_t>(r.size());
      if (n == 0) continue;
      std::vector<float> xe(static_cast<std::size_t>(n * H));
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t c = 0; c < H; ++c) xe[static_cast<std::size_t>(i * H + c)] = bf16_round(x[r[static_cast<std::size_t>(i)] * H + c]);
      const std::vector<double>& q = qs[static_cast<std::size_t>(e)];
      if (record_gate_up_)
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t c = 0; c < H; ++c) {
            const double v = xe[static_cast<std::size_t>(i * H + c)];
            s_->gu[static_cast<std::size_t>(e * H + c)] += q[static_cast<std::size_t>(i)] * (v * v);
          }
      if (record_gate_up_ && !s_->gu_full.empty()) add_outer(xe.data(), n, H, q, s_->gu_full.data() + e * H * H);
      if (s_->mxfp8_input) mxfp8_qdq_rows(xe.data(), n, H, xe.data());
      std::vector<float> gu(static_cast<std::size_t>(n * 2 * I));
      linear(xe.data(), s_->w13.data() + static_cast<std::size_t>(e) * 2 * I * H, nullptr, gu.data(), n, 2 * I, H);
      std::vector<float> hs(s_->dn_full.empty() ? 0 : static_cast<std::size_t>(n * I));
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t c = 0; c < I; ++c) {
          const float g = gu[static_cast<std::size_t>(i * 2 * I + c)], u = gu[static_cast<std::size_t>(i * 2 * I + I + c)];
          const double h = bf16_round(g / (1.0f + std::exp(-g)) * u);
          s_->dn[static_cast<std::size_t>(e * I + c)] += q[static_cast<std::size_t>(i)] * (h * h);
          if (!hs.empty()) hs[static_cast<std::size_t>(i * I + c)] = static_cast<float>(h);
        }
      if (!hs.empty()) add_outer(hs.data(), n, I, q, s_->dn_full.data() + e * I * I);
      s_->tokens[static_cast<std::size_t>(e)] += static_cast<double>(n);
      for (double v : q) s_->qsum[static_cast<std::size_t>(e)] += v;
    }
    inner_->forward(x, T, out);
  }

 private:
  std::unique_ptr<MoeBlock> inner_;
  LayerSums* s_;
  bool record_gate_up_;
};

// Runs the model over `windows` windows of tokens with every MoE block recorded into sums[layer].
void run_pass(const std::filesystem::path& dir, const std::vector<std::int32_t>& tokens, std::int64_t windows,
              const CalibrateOptions& opt, std::map<int, LayerSums>& sums, bool record_gate_up, int pass, int passes) {
  MoeOptions mo;
  mo.quant = Quant::None;
  mo.activations = moe::ActivationFormat::BF16;
  CheckpointMoe moe(dir, mo);
  MoeFactory inner = moe.factory();
  LanguageModel lm = LanguageModel::load(dir, [&](int layer) -> std::unique_ptr<MoeBlock> {
    return std::make_unique<RecordingBlock>(inner(layer), &sums.at(layer), record_gate_up);
  });
  const std::int64_t batch = std::max<std::int64_t>(1, opt.batch);
  for (std::int64_t w = 0; w < windows; w += batch) {
    const std::int64_t b = std::min(batch, windows - w);
    lm.forward(tokens.data() + w * opt.window, b, opt.window);
    if (opt.progress) opt.progress(pass * windows + w + b, passes * windows);
    if (const int sig = opt.interrupt ? opt.interrupt->load(std::memory_order_relaxed) : 0)
      throw Interrupted(sig, fmt::format("calibration: interrupted by signal {} ({}) after {} of {} windows", sig,
                                         strsignal(sig), pass * windows + w + b, passes * windows));
  }
}

// The means [E][C][C] (both triangles, float) of the upper-triangle sums `sum` over the token weights
// qsum[e] (0 for an expert no token reached).
std::vector<float> full_means(const std::vector<double>& sum, const std::vector<double>& qsum, std::int64_t E,
                              std::int64_t C) {
  std::vector<float> out(static_cast<std::size_t>(E * C * C), 0.0f);
  for (std::int64_t e = 0; e < E; ++e) {
    const double qn = qsum[static_cast<std::size_t>(e)];
    if (!(qn > 0)) continue;
    const double* s = sum.data() + e * C * C;
    float* o = out.data() + e * C * C;
    for (std::int64_t i = 0; i < C; ++i)
      for (std::int64_t j = i; j < C; ++j)
        o[i * C + j] = o[j * C + i] = static_cast<float>(s[i * C + j] / qn);
  }
  return out;
}

// Refuses a NaN or infinite weight of a routed expert's stack (w13 [E, 2I, H] or w2 [E, H, I]) before
// the model runs, named in the stored tensor's own rows: the BF16 forward would carry it into the
// statistics of every token the expert takes and of every later layer, and no fit accepts it either.
// `v` holds the stack's elements as FP32 (exact for every float dtype's non-finite values).
void check_finite_weights(const Checkpoint& ck, int layer, bool w13, const DenseStack& s, const std::vector<float>& v) {
  const std::int64_t per = s.rows * s.cols;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const float x = v[i];
    if (std::isfinite(x)) continue;
    const auto at = static_cast<std::int64_t>(i);
    throw ModelError(fmt::format(
        "{}: {}; a non-finite weight makes the statistics of the tokens it reaches NaN (and cannot be quantised to "
        "LUT-B, spec 2.1)",
        ck.expert_location(layer, w13, at / per, (at % per) / s.cols, at % s.cols),
        std::isnan(x) ? "NaN" : (x > 0 ? "+Inf" : "-Inf")));
  }
}

}  // namespace

CalibrationStats collect_calibration(const std::filesystem::path& dir, const std::vector<std::int32_t>& tokens,
                                     const CalibrateOptions& opt) {
  if (opt.window < 2) throw ModelError(fmt::format("calibration window {} must be at least 2 tokens", opt.window));
  std::int64_t n_tok = static_cast<std::int64_t>(tokens.size());
  if (opt.max_tokens > 0) n_tok = std::min(n_tok, opt.max_tokens);
  const std::int64_t windows = n_tok / opt.window;
  if (windows == 0)
    throw ModelError(fmt::format("{} calibration tokens are fewer than one window of {}", n_tok, opt.window));
  const TransformerConfig cfg = TransformerConfig::load(dir);
  const Checkpoint ck(dir);
  if (ck.is_lutb())
    throw ModelError(fmt::format("{}: a LUT-B checkpoint holds no BF16 experts to calibrate; run lutb calibrate on the "
                                 "BF16 checkpoint it was quantised from",
                                 dir.string()));
  std::map<int, LayerSums> sums;
  for (int l = 0; l < cfg.num_layers; ++l) {
    if (!cfg.sparse_layer[static_cast<std::size_t>(l)]) continue;
    LayerSums& s = sums[l];
    s.prefix = moe_prefix(ck.config(), l) + ".experts";
    s.E = cfg.num_experts;
    s.H = cfg.hidden_size;
    s.I = cfg.moe_intermediate_size;
    s.gu.assign(static_cast<std::size_t>(s.E * s.H), 0.0);
    s.dn.assign(static_cast<std::size_t>(s.E * s.I), 0.0);
    s.tokens.assign(static_cast<std::size_t>(s.E), 0.0);
    s.qsum.assign(static_cast<std::size_t>(s.E), 0.0);
    if (opt.full_moments) {
      s.gu_full.assign(static_cast<std::size_t>(s.E * s.H * s.H), 0.0);
      s.dn_full.assign(static_cast<std::size_t>(s.E * s.I * s.I), 0.0);
    }
    s.gate_weighted = opt.token_weight == TokenWeight::RoutingWeight;
    ExpertsSource src = ck.experts_source(l);
    s.w13 = src.w13.to_float();
    check_finite_weights(ck, l, true, src.w13, s.w13);
    src.w13.data = {};
    check_finite_weights(ck, l, false, src.w2, src.w2.to_float());
  }
  const bool two_pass = opt.down_input == DownInput::QuantizedW13;
  run_pass(dir, tokens, windows, opt, sums, true, 0, two_pass ? 2 : 1);
  auto to_stats = [&] {
    CalibrationStats out;
    for (const auto& [l, s] : sums) {
      LayerCalibration& lc = out.layers[l];
      lc.prefix = s.prefix;
      lc.experts = s.E;
      lc.hidden = s.H;
      lc.intermediate = s.I;
      lc.gate_up_x2.resize(s.gu.size());
      lc.down_x2.resize(s.dn.size());
      for (std::int64_t e = 0; e < s.E; ++e) {
        const double n = s.tokens[static_cast<std::size_t>(e)], qn = s.qsum[static_cast<std::size_t>(e)];
        for (std::int64_t c = 0; c < s.H; ++c) {
          const std::size_t i = static_cast<std::size_t>(e * s.H + c);
          lc.gate_up_x2[i] = qn > 0 ? static_cast<float>(s.gu[i] / qn) : 0.0f;
        }
        for (std::int64_t c = 0; c < s.I; ++c) {
          const std::size_t i = static_cast<std::size_t>(e * s.I + c);
          lc.down_x2[i] = qn > 0 ? static_cast<float>(s.dn[i] / qn) : 0.0f;
        }
        lc.tokens.push_back(static_cast<float>(n));
      }
      if (!s.gu_full.empty()) {
        lc.full_moments = true;
        lc.gate_up_xxT = full_means(s.gu_full, s.qsum, s.E, s.H);
        lc.down_hhT = full_means(s.dn_full, s.qsum, s.E, s.I);
      }
    }
    out.metadata["tokens"] = std::to_string(windows * opt.window);
    out.metadata["down_input"] = two_pass ? "quantized-w13" : "bf16";
    out.metadata["token_weight"] = opt.token_weight == TokenWeight::RoutingWeight ? "routing" : "uniform";
    return out;
  };
  if (!two_pass) return to_stats();
  // Second pass: w13 fitted to LUT-B under the first pass's gate_up statistics, MXFP8 input.
  const CalibrationStats first = to_stats();
  for (auto& [l, s] : sums) {
    const std::vector<float> cw = first.column_weights(l, CalibratedInput::kGateUp);
    FitOptions fo = opt.fit;
    fo.column_weights = cw.data();
    if (opt.interrupt) fo.interrupt = opt.interrupt;
    const LutbShape shape{s.E, 2 * s.I, s.H, true};
    const LutbTensor q = quantize(s.w13.data(), shape, fo, nullptr, s.prefix + ".w13");
    dequantize(q.view(), s.w13.data());
    s.mxfp8_input = true;
    std::fill(s.dn.begin(), s.dn.end(), 0.0);
    std::fill(s.tokens.begin(), s.tokens.end(), 0.0);
    std::fill(s.qsum.begin(), s.qsum.end(), 0.0);
    std::fill(s.dn_full.begin(), s.dn_full.end(), 0.0);
  }
  run_pass(dir, tokens, windows, opt, sums, false, 1, 2);
  return to_stats();
}

}  // namespace lutb::model
