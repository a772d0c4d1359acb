// The BF16 reference experts (DenseExperts) and the LUT-B emulation reference (spec section 4 step by step).
#include <stdexcept>
#include <vector>

#include <fmt/format.h>

#include "lutb/numerics.hpp"
#include "moe/cpu_kernels.hpp"
#include "moe/moe_internal.hpp"

namespace lutb::moe {

// ---------------------------------------------------------------------------
// DenseExperts
// ---------------------------------------------------------------------------
DenseExperts::DenseExperts(MoeConfig cfg, std::vector<std::uint16_t> w13_bf16, std::vector<std::uint16_t> w2_bf16,
                           ActivationFormat act, CpuIsa isa)
    : Experts(std::move(cfg)), w13_(std::move(w13_bf16)), w2_(std::move(w2_bf16)), act_(act),
      isa_(detail::runnable_isa(isa)) {
  const std::size_t E = static_cast<std::size_t>(cfg_.local_experts());
  const std::size_t H = static_cast<std::size_t>(cfg_.hidden_size), I = static_cast<std::size_t>(cfg_.intermediate_size_per_partition);
  if (w13_.size() != E * 2 * I * H)
    throw std::invalid_argument(fmt::format("DenseExperts: w13 holds {} elements, expected [{}, {}, {}] = {}",
                                            w13_.size(), E, 2 * I, H, E * 2 * I * H));
  if (w2_.size() != E * H * I)
    throw std::invalid_argument(fmt::format("DenseExperts: w2 holds {} elements, expected [{}, {}, {}] = {}",
                                            w2_.size(), E, H, I, E * H * I));
}

std::string DenseExperts::name() const {
  return (act_ == ActivationFormat::BF16 ? "bf16-reference/" : "dequantized-mxfp8/") + std::string(cpu_isa_name(isa_));
}

std::size_t DenseExperts::weight_bytes() const { return (w13_.size() + w2_.size()) * sizeof(std::uint16_t); }

void DenseExperts::apply_f32(const HiddenStates& x, const TopK& topk, float* out) const {
  const std::int64_t H = cfg_.hidden_size, I = cfg_.intermediate_size_per_partition;
  const std::uint16_t* w13 = w13_.data();
  const std::uint16_t* w2 = w2_.data();
  detail::run_grouped(
      cfg_, x, topk, act_,
      [&](int which, int e, std::int64_t n0, std::int64_t n1, const float* const* a, int ntok, float* const* c) {
        if (which == 0)
          detail::dense_gemm(isa_, w13 + static_cast<std::int64_t>(e) * 2 * I * H, H, n0, n1, a, ntok, c);
        else
          detail::dense_gemm(isa_, w2 + static_cast<std::int64_t>(e) * H * I, I, n0, n1, a, ntok, c);
      },
      /*job_weights=*/std::int64_t{1} << 15, out);
}

// ---------------------------------------------------------------------------
// LUT-B shape checks shared by the LUT-B experts
// ---------------------------------------------------------------------------
namespace detail {
void check_lutb_pair(const MoeConfig& cfg, const LutbTensor& w13, const LutbTensor& w2, const char* who) {
  auto check = [&](const LutbTensor& w, const LutbShape& want, const char* name) {
    if (w.shape.experts != want.experts || w.shape.rows != want.rows || w.shape.cols != want.cols)
      throw std::invalid_argument(fmt::format("{}: {} has shape [{}, {}, {}], the MoE config needs [{}, {}, {}]", who,
                                              name, w.shape.experts, w.shape.rows, w.shape.cols, want.experts,
                                              want.rows, want.cols));
    check_sizes(w.shape, w.packed.size(), w.codebook.size(), w.scale.size(), std::string(who) + " " + name);
    validate(w.view(), std::string(who) + " " + name);
  };
  check(w13, cfg.w13_shape(), "w13");
  check(w2, cfg.w2_shape(), "w2");
}
}  // namespace detail

// ---------------------------------------------------------------------------
// LutbReferenceExperts: spec section 4, one token and one slot at a time.
// ---------------------------------------------------------------------------
LutbReferenceExperts::LutbReferenceExperts(MoeConfig cfg, LutbTensor w13, LutbTensor w2, ActivationFormat act)
    : Experts(std::move(cfg)), w13_(std::move(w13)), w2_(std::move(w2)), act_(act) {
  detail::check_lutb_pair(cfg_, w13_, w2_, "LutbReferenceExperts");
}

void LutbReferenceExperts::apply_f32(const HiddenStates& x, const TopK& topk, float* out) const {
  detail::check_inputs(cfg_, x, topk);
  const std::int64_t T = x.tokens, H = cfg_.hidden_size, I = cfg_.intermediate_size_per_partition;
  const std::int64_t Hu = cfg_.hidden_unpadded();
  const int k = topk.k;
  // Dequantised weights of the experts this call uses (exact FP32 values, logical shapes).
  std::vector<std::vector<float>> d13(cfg_.local_experts()), d2(cfg_.local_experts());
  std::vector<float> a(H), g(I), u(I), h(I), y(H);
  for (std::int64_t t = 0; t < T; ++t) {
    float* o = out + t * H;
    for (std::int64_t n = 0; n < H; ++n) o[n] = 0.0f;
    // Step 2: a = mxfp8_qdq(x) along H.
    detail::load_activation_row(cfg_, x, t, act_, H, a.data());
    for (int j = 0; j < k; ++j) {
      // Step 1 (given): expert and weight of slot j; non-local experts contribute nothing here.
      const int e = detail::local_id(cfg_, topk.ids[t * k + j], t, j);
      if (e < 0) continue;
      if (d13[e].empty()) {
        d13[e] = dequantize(w13_.view().expert(e));
        d2[e] = dequantize(w2_.view().expert(e));
      }
      const float* W13 = d13[e].data();  // [2I][H]
      const float* W2 = d2[e].data();    // [H][I]
      // Step 3: g, u = a . w13^T, FP32 accumulation.
      for (std::int64_t i = 0; i < I; ++i) {
        float sg = 0.0f, su = 0.0f;
        for (std::int64_t c = 0; c < H; ++c) {
          sg += a[c] * W13[i * H + c];
          su += a[c] * W13[(I + i) * H + c];
        }
        g[i] = sg;
        u[i] = su;
      }
      // Step 4: h = mxfp8_qdq(bf16(silu(g) * u)) along I.
      detail::gated_activation_row(cfg_, g.data(), u.data(), act_, I, h.data());
      // Step 5: y = h . w2^T.
      for (std::int64_t n = 0; n < H; ++n) {
        float s = 0.0f;
        for (std::int64_t i = 0; i < I; ++i) s += h[i] * W2[n * I + i];
        y[n] = s;
      }
      // Step 6: out += weight * y in FP32 (the BF16 rounding is Experts::apply's).
      const float w = topk.weights[t * k + j];
      for (std::int64_t n = 0; n < Hu; ++n) o[n] += w * y[n];
    }
  }
}

}  // namespace lutb::moe
