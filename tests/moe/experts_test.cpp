// Expert implementations: the LUT-B MoE golden layer, fast kernel vs reference on random shapes
// (padding, many experts and few tokens, one token, empty experts, expert parallel, every ISA), the
// BF16 reference against an independent double-precision loop.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "lutb/mxfp8.hpp"
#include "moe/cpu_kernels.hpp"
#include "moe/moe_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb::moe {
namespace {

using test::make_config;
using test::rel_l2;

/// Every instruction set of the CPU kernels that this CPU runs.
std::vector<CpuIsa> runnable_isas() {
  std::vector<CpuIsa> v;
  for (CpuIsa isa : {CpuIsa::Scalar, CpuIsa::Avx2, CpuIsa::Avx512})
    if (isa <= best_cpu_isa()) v.push_back(isa);
  return v;
}

// ---------------------------------------------------------------------------
// Golden: ../shared/golden/lutb_moe_layer.json (spec section 4 with given routing)
// ---------------------------------------------------------------------------
struct GoldenLayer {
  MoeConfig cfg;
  LutbTensor w13, w2;
  std::vector<std::uint16_t> x;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  std::vector<float> expected;
};

LutbTensor golden_stack(const nlohmann::json& experts, const char* key, int E, std::int64_t N, std::int64_t K) {
  LutbShape s;
  s.experts = E;
  s.rows = N;
  s.cols = K;
  s.stacked = true;
  LutbTensor t(s);
  std::int64_t tile = 0;
  for (int e = 0; e < E; ++e) {
    const auto& tiles = experts[e][key];
    EXPECT_EQ(static_cast<std::int64_t>(tiles.size()), s.tiles_per_expert());
    for (const auto& tj : tiles) {
      const auto packed = lutb::test::parse_hex_bytes(tj["packed"].get<std::string>());
      EXPECT_EQ(packed.size(), 192u);
      std::copy(packed.begin(), packed.end(), t.packed.begin() + tile * kPackedBytes);
      for (int i = 0; i < 8; ++i) t.codebook[tile * 8 + i] = static_cast<std::uint8_t>(tj["codebook"][i].get<int>());
      t.scale[tile] = static_cast<std::uint8_t>(tj["scale"].get<int>());
      ++tile;
    }
  }
  return t;
}

GoldenLayer load_golden_layer(const nlohmann::json& g) {
  GoldenLayer L;
  const int T = g["T"], H = g["H"], I = g["I"], E = g["E"], k = g["k"];
  L.cfg = make_config(E, k, H, I);
  L.w13 = golden_stack(g["experts"], "w13", E, 2 * I, H);
  L.w2 = golden_stack(g["experts"], "w2", E, H, I);
  for (int t = 0; t < T; ++t) {
    for (int i = 0; i < H; ++i) {
      const float v = lutb::test::f32_hex(g["x"][t][i].get<std::string>());
      L.x.push_back(bf16_from_float(v));
      EXPECT_EQ(bf16_to_float(L.x.back()), v) << "x is BF16-valued";
      L.expected.push_back(lutb::test::f32_hex(g["out"][t][i].get<std::string>()));
    }
    for (int j = 0; j < k; ++j) {
      L.ids.push_back(g["topk_ids"][t][j].get<int>());
      L.weights.push_back(lutb::test::f32_hex(g["topk_weights"][t][j].get<std::string>()));
    }
  }
  return L;
}

void check_golden(const Experts& ex, const GoldenLayer& L, const std::string& what) {
  const std::int64_t T = static_cast<std::int64_t>(L.ids.size()) / L.cfg.top_k;
  std::vector<std::uint16_t> out(L.expected.size(), 0xFFFF);
  ex.apply(HiddenStates::bf16(L.x.data(), T), {L.ids.data(), L.weights.data(), L.cfg.top_k}, out.data());
  const auto got = test::bf16_to_f32(out);
  for (float v : got) ASSERT_FALSE(std::isnan(v)) << what;
  const double err = rel_l2(got, L.expected);
  EXPECT_LE(err, 1e-3) << what;
  std::printf("[golden lutb_moe_layer] %-28s rel L2 = %.3g\n", what.c_str(), err);
}

TEST(MoeGolden, LutbMoeLayerBothEmulations) {
  LUTB_GOLDEN_OR_SKIP(g, "lutb_moe_layer.json");
  const GoldenLayer L = load_golden_layer(g);
  check_golden(LutbReferenceExperts(L.cfg, L.w13, L.w2), L, "lutb-reference");
  for (CpuIsa isa : runnable_isas()) {
    LutbCpuExperts fast(L.cfg, L.w13, L.w2, ActivationFormat::MXFP8, isa);
    EXPECT_EQ(fast.name(), std::string("lutb-cpu/") + cpu_isa_name(isa));
    check_golden(fast, L, fast.name());
  }
  check_golden(*make_lutb_experts(L.cfg, L.w13, L.w2, EmulationKernel::Dequantized), L, "dequantized-mxfp8");
  check_golden(Sm107Experts(L.cfg, L.w13, L.w2), L, "sm107-layout");
}

TEST(MoeGolden, BreakingOneStepIsDetected) {
  // Without the MXFP8 steps the result must differ measurably from the golden output: the golden
  // test above cannot pass by accident with the BF16 pipeline.
  LUTB_GOLDEN_OR_SKIP(g, "lutb_moe_layer.json");
  const GoldenLayer L = load_golden_layer(g);
  LutbReferenceExperts bf16act(L.cfg, L.w13, L.w2, ActivationFormat::BF16);
  const std::int64_t T = static_cast<std::int64_t>(L.ids.size()) / L.cfg.top_k;
  std::vector<std::uint16_t> out(L.expected.size());
  bf16act.apply(HiddenStates::bf16(L.x.data(), T), {L.ids.data(), L.weights.data(), L.cfg.top_k}, out.data());
  EXPECT_GT(rel_l2(test::bf16_to_f32(out), L.expected), 3e-3);
}

TEST(Experts, KernelTableDecodeIsExactForEveryByteAndScale) {
  // The SIMD kernels decode a tile's table as bits((b & 0x7F) << 20) * 2^120 * 2^(s-127); it must
  // equal e4m3_to_float(b) scaled by ldexp_ue8m0 for every non-NaN byte and every scale 0..254.
  for (CpuIsa isa : runnable_isas()) {
    for (int s = 0; s <= 254; ++s)
      for (int b0 = 0; b0 < 256; b0 += 8) {
        std::uint8_t cb[8];
        for (int i = 0; i < 8; ++i) cb[i] = static_cast<std::uint8_t>(e4m3_is_nan(b0 + i) ? 0 : b0 + i);
        float got[8];
        detail::lutb_decode_codebook_dispatch(isa, cb, static_cast<std::uint8_t>(s), got);
        for (int i = 0; i < 8; ++i) {
          const float want = ldexp_ue8m0(e4m3_to_float(cb[i]), static_cast<std::uint8_t>(s));
          ASSERT_EQ(f32_bits(got[i]), f32_bits(want)) << cpu_isa_name(isa) << " byte " << int(cb[i]) << " scale " << s;
        }
      }
  }
}

// ---------------------------------------------------------------------------
// Fast kernel vs reference on random shapes
// ---------------------------------------------------------------------------
struct Case {
  const char* name;
  int E, k;
  std::int64_t H, I, Hu, Iu;
  std::int64_t T;
  int ep_rank, ep_size;
  int only_first;  // route only to the first experts (others stay empty); 0 = all
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class FastVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(FastVsReference, EqualUpToSummationOrder) {
  const Case c = GetParam();
  std::mt19937 rng(1234 + static_cast<unsigned>(c.H * 7 + c.I + c.T));
  const MoeConfig cfg = make_config(c.E, c.k, c.H, c.I, c.Hu, c.Iu, c.ep_rank, c.ep_size);
  const LutbTensor w13 = test::random_lutb(cfg.w13_shape(), rng);
  const LutbTensor w2 = test::random_lutb(cfg.w2_shape(), rng);
  const auto x = test::random_bf16(static_cast<std::size_t>(c.T * c.H), rng);
  std::vector<std::int32_t> ids;
  std::vector<float> wts;
  test::random_topk(c.T, c.k, c.E, rng, ids, wts, c.only_first);
  const TopK topk{ids.data(), wts.data(), c.k};

  std::vector<float> ref(static_cast<std::size_t>(c.T * c.H), -7.0f);
  LutbReferenceExperts(cfg, w13, w2).apply_f32(HiddenStates::bf16(x.data(), c.T), topk, ref.data());
  // The reference must not be trivially zero (unless nothing is local).
  double norm = 0;
  for (float v : ref) norm += double(v) * v;
  EXPECT_GT(norm, 0.0);
  const std::int64_t Hu = cfg.hidden_unpadded();
  for (std::int64_t t = 0; t < c.T; ++t)
    for (std::int64_t i = Hu; i < c.H; ++i) ASSERT_EQ(ref[t * c.H + i], 0.0f) << "padded output column";

  for (CpuIsa isa : runnable_isas()) {
    LutbCpuExperts fast(cfg, w13, w2, ActivationFormat::MXFP8, isa);
    std::vector<float> got(ref.size(), std::nanf(""));  // poisoned: every element must be written
    fast.apply_f32(HiddenStates::bf16(x.data(), c.T), topk, got.data());
    for (std::size_t i = 0; i < got.size(); ++i) {
      ASSERT_FALSE(std::isnan(got[i])) << fast.name() << " element " << i;
      // FP32 summation-order differences only. They can flip a rounding of h (BF16, then E4M3) in
      // rare elements, which moves an output by ~1e-3 of its scale; a wrong index, row or scale
      // moves it by O(1).
      const double scale = std::sqrt(norm / ref.size()) + 1e-30;
      ASSERT_LE(std::abs(double(got[i]) - ref[i]) / scale, 1e-2) << fast.name() << " element " << i;
    }
    EXPECT_LE(rel_l2(got, ref), 1e-4) << fast.name();
  }
  // Dequantised mode: the same numerics through the dense kernel.
  std::vector<float> deq(ref.size());
  make_lutb_experts(cfg, w13, w2, EmulationKernel::Dequantized)->apply_f32(HiddenStates::bf16(x.data(), c.T), topk, deq.data());
  EXPECT_LE(rel_l2(deq, ref), 1e-4);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, FastVsReference,
    ::testing::Values(Case{"aligned", 8, 2, 128, 128, -1, -1, 9, 0, 1, 0},
                      Case{"one_token", 16, 4, 256, 128, -1, -1, 1, 0, 1, 0},
                      Case{"ragged_H_I", 6, 2, 200, 136, -1, -1, 7, 0, 1, 0},   // H, I not multiples of 64
                      Case{"unpadded_sizes", 4, 2, 192, 128, 180, 100, 5, 0, 1, 0},  // vLLM padded dims
                      Case{"many_experts_few_tokens", 64, 4, 64, 64, -1, -1, 3, 0, 1, 0},
                      Case{"empty_experts", 16, 2, 128, 64, -1, -1, 11, 0, 1, 3},
                      Case{"ep_rank1_of3", 10, 3, 128, 64, -1, -1, 8, 1, 3, 0},
                      Case{"tokens_chunks", 2, 2, 64, 192, -1, -1, 13, 0, 1, 0}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(Experts, ZeroTokensAndNoLocalExperts) {
  std::mt19937 rng(5);
  const MoeConfig cfg = make_config(4, 2, 64, 64, -1, -1, 1, 2);  // rank 1 holds experts 2, 3
  LutbCpuExperts fast(cfg, test::random_lutb(cfg.w13_shape(), rng), test::random_lutb(cfg.w2_shape(), rng));
  const auto x = test::random_bf16(3 * 64, rng);
  std::vector<std::int32_t> ids = {0, 1, 1, 0, 0, 1};  // all on rank 0
  std::vector<float> w = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  std::vector<float> out(3 * 64, 9.0f);
  fast.apply_f32(HiddenStates::bf16(x.data(), 3), {ids.data(), w.data(), 2}, out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
  fast.apply_f32(HiddenStates::bf16(x.data(), 0), {ids.data(), w.data(), 2}, out.data());  // no-op
}

TEST(Experts, ExpertParallelRanksSumToTheWholeLayer) {
  std::mt19937 rng(77);
  const int E = 7, k = 3, H = 128, I = 64, T = 6;
  const MoeConfig whole = make_config(E, k, H, I);
  const LutbTensor w13 = test::random_lutb(whole.w13_shape(), rng), w2 = test::random_lutb(whole.w2_shape(), rng);
  const auto x = test::random_bf16(T * H, rng);
  std::vector<std::int32_t> ids;
  std::vector<float> w;
  test::random_topk(T, k, E, rng, ids, w);
  std::vector<float> full(T * H), sum(T * H, 0.0f), part(T * H);
  LutbCpuExperts(whole, w13, w2).apply_f32(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), k}, full.data());
  for (int r = 0; r < 3; ++r) {
    const MoeConfig rc = make_config(E, k, H, I, -1, -1, r, 3);
    // Slice this rank's experts out of the whole stacks.
    auto slice = [&](const LutbTensor& src, LutbShape s) {
      LutbTensor t(s);
      const std::int64_t tpe = s.tiles_per_expert();
      for (int l = 0; l < rc.local_experts(); ++l) {
        const std::int64_t g = rc.expert_map.local_to_global[l];
        std::copy_n(src.packed.begin() + g * tpe * kPackedBytes, tpe * kPackedBytes, t.packed.begin() + l * tpe * kPackedBytes);
        std::copy_n(src.codebook.begin() + g * tpe * 8, tpe * 8, t.codebook.begin() + l * tpe * 8);
        std::copy_n(src.scale.begin() + g * tpe, tpe, t.scale.begin() + l * tpe);
      }
      return t;
    };
    LutbCpuExperts ex(rc, slice(w13, rc.w13_shape()), slice(w2, rc.w2_shape()));
    ex.apply_f32(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), k}, part.data());
    for (int i = 0; i < T * H; ++i) sum[i] += part[i];
  }
  EXPECT_LE(rel_l2(sum, full), 1e-6);
  EXPECT_GT(rel_l2(part, full), 0.1);  // one rank alone is not the whole layer
}

TEST(Experts, Fp32HiddenStatesEqualBf16OnesOfTheSameValues) {
  std::mt19937 rng(19);
  const MoeConfig cfg = make_config(4, 2, 128, 64);
  const LutbTensor w13 = test::random_lutb(cfg.w13_shape(), rng), w2 = test::random_lutb(cfg.w2_shape(), rng);
  const int T = 3;
  const auto xb = test::random_bf16(T * 128, rng);
  const auto xf = test::bf16_to_f32(xb);
  std::vector<std::int32_t> ids = {0, 3, 1, 2, 3, 0};
  std::vector<float> w = {0.6f, 0.4f, 0.5f, 0.5f, 0.9f, 0.1f};
  for (int kind = 0; kind < 3; ++kind) {
    std::unique_ptr<Experts> ex = make_lutb_experts(cfg, w13, w2, static_cast<EmulationKernel>(kind));
    std::vector<std::uint16_t> ob(T * 128), of(T * 128);
    ex->apply(HiddenStates::bf16(xb.data(), T), {ids.data(), w.data(), 2}, ob.data());
    ex->apply(HiddenStates::f32(xf.data(), T), {ids.data(), w.data(), 2}, of.data());
    EXPECT_EQ(ob, of) << ex->name();
  }
}

TEST(Experts, InputErrors) {
  std::mt19937 rng(3);
  const MoeConfig cfg = make_config(4, 2, 64, 64);
  LutbCpuExperts fast(cfg, test::random_lutb(cfg.w13_shape(), rng), test::random_lutb(cfg.w2_shape(), rng));
  const auto x = test::random_bf16(64, rng);
  std::vector<std::int32_t> ids = {0, 4};
  std::vector<float> w = {0.5f, 0.5f}, out(64);
  EXPECT_THROW(fast.apply_f32(HiddenStates::bf16(x.data(), 1), {ids.data(), w.data(), 2}, out.data()), std::out_of_range);
  ids[1] = 1;
  EXPECT_THROW(fast.apply_f32(HiddenStates::bf16(x.data(), 1), {ids.data(), w.data(), 1}, out.data()),
               std::invalid_argument);
  EXPECT_THROW(fast.apply_f32({x.data(), DType::F16, 1}, {ids.data(), w.data(), 2}, out.data()), std::invalid_argument);
  // Wrong LUT-B shapes and invalid data.
  LutbShape s = cfg.w13_shape();
  s.rows = 64;
  EXPECT_THROW(LutbCpuExperts(cfg, test::random_lutb(s, rng), test::random_lutb(cfg.w2_shape(), rng)),
               std::invalid_argument);
  LutbTensor bad = test::random_lutb(cfg.w2_shape(), rng);
  bad.scale[3] = 255;
  EXPECT_THROW(LutbCpuExperts(cfg, test::random_lutb(cfg.w13_shape(), rng), bad), FormatError);
  EXPECT_THROW(DenseExperts(cfg, std::vector<std::uint16_t>(10), std::vector<std::uint16_t>(4 * 64 * 64)),
               std::invalid_argument);
}

// ---------------------------------------------------------------------------
// BF16 reference against an independent double-precision loop (no MXFP8, BF16 h)
// ---------------------------------------------------------------------------
TEST(Experts, Bf16ReferenceMatchesIndependentLoop) {
  std::mt19937 rng(11);
  const int E = 5, k = 2, T = 6;
  const std::int64_t H = 72, I = 40;  // not multiples of 8/64: exercises the kernels' K tails
  const MoeConfig cfg = make_config(E, k, H, I);
  const auto w13 = test::random_bf16(E * 2 * I * H, rng, 0.05f), w2 = test::random_bf16(E * H * I, rng, 0.05f);
  const auto x = test::random_bf16(T * H, rng);
  std::vector<std::int32_t> ids;
  std::vector<float> w;
  test::random_topk(T, k, E, rng, ids, w);
  std::vector<double> want(T * H, 0.0);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int e = ids[t * k + j];
      std::vector<double> h(I);
      for (int i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int c = 0; c < H; ++c) {
          g += double(bf16_to_float(x[t * H + c])) * bf16_to_float(w13[(e * 2 * I + i) * H + c]);
          u += double(bf16_to_float(x[t * H + c])) * bf16_to_float(w13[(e * 2 * I + I + i) * H + c]);
        }
        h[i] = bf16_round(static_cast<float>(g / (1 + std::exp(-g)) * u));
      }
      for (int n = 0; n < H; ++n) {
        double y = 0;
        for (int i = 0; i < I; ++i) y += h[i] * bf16_to_float(w2[(e * H + n) * I + i]);
        want[t * H + n] += w[t * k + j] * y;
      }
    }
  for (CpuIsa isa : runnable_isas()) {
    DenseExperts ref(cfg, w13, w2, ActivationFormat::BF16, isa);
    std::vector<float> got(T * H);
    ref.apply_f32(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), k}, got.data());
    double num = 0, den = 0;
    for (int i = 0; i < T * H; ++i) {
      num += (got[i] - want[i]) * (got[i] - want[i]);
      den += want[i] * want[i];
    }
    // h is rounded to BF16 in both; an FP32-vs-double flip of that rounding is the only larger term.
    EXPECT_LE(std::sqrt(num / den), 1e-3) << ref.name();
    EXPECT_GT(den, 0.0);
  }
}

}  // namespace
}  // namespace lutb::moe
