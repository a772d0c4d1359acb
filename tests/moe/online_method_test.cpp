// The online method (spec section 6, the seed): errors, backend selection and its logged reason,
// processing (padding, quantisation, release, idempotence), LUT-B checkpoints, the sm_107 layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "lutb/fit.hpp"
#include "lutb/sm107_layout.hpp"
#include "moe/moe_test_util.hpp"

namespace lutb::moe {
namespace {

using test::make_config;
using test::rel_l2;

// A simple, independent fitter for these tests (they test the method, not fitting): per tile the
// rceil scale of the amax, 8 E4M3 entries evenly spread from min to max (snapped), nearest index.
FitStats simple_fit(const void* src, DType t, const LutbShape& s, LutbTensor& out, const FitOptions&,
                    const std::string& name) {
  if (t != DType::BF16) throw std::invalid_argument("simple_fit: BF16 only");
  out = LutbTensor(s);
  FitStats st;
  const auto* w = static_cast<const std::uint16_t*>(src);
  float v[512];
  std::uint8_t idx[512];
  for (std::int64_t e = 0; e < s.experts; ++e)
    for (std::int64_t tn = 0; tn < s.tiles_n(); ++tn)
      for (std::int64_t tk = 0; tk < s.tiles_k(); ++tk) {
        const std::int64_t tile = (e * s.tiles_n() + tn) * s.tiles_k() + tk;
        gather_tile_bf16(w + e * s.rows * s.cols, s.rows, s.cols, tn, tk, v);
        float lo = v[0], hi = v[0], amax = 0;
        for (float x : v) {
          if (!std::isfinite(x)) throw std::invalid_argument(name + ": non-finite");
          lo = std::min(lo, x), hi = std::max(hi, x), amax = std::max(amax, std::abs(x));
        }
        const std::uint8_t sc = std::max<std::uint8_t>(3, ue8m0_rceil(amax));
        float cb[8];
        for (int i = 0; i < 8; ++i) {
          const std::uint8_t b = e4m3_from_float(ldexp_ue8m0(lo + (hi - lo) * i / 7.0f, static_cast<std::uint8_t>(254 - sc)));
          out.codebook[tile * 8 + i] = b;
          cb[i] = ldexp_ue8m0(e4m3_to_float(b), sc);
        }
        out.scale[tile] = sc;
        for (int f = 0; f < 512; ++f) {
          int best = 0;
          for (int i = 1; i < 8; ++i)
            if (std::abs(v[f] - cb[i]) < std::abs(v[f] - cb[best])) best = i;
          idx[f] = static_cast<std::uint8_t>(best);
          st.sse += (v[f] - cb[best]) * double(v[f] - cb[best]);
          st.sum_sq += double(v[f]) * v[f];
        }
        pack_tile_indices(idx, out.packed.data() + tile * kPackedBytes);
        ++st.tiles;
      }
  return st;
}

OnlineOptions test_options(std::optional<NativeSupport> ns = std::nullopt) {
  OnlineOptions o;
  o.fit_function = simple_fit;
  o.native_support = std::move(ns);
  return o;
}

struct LogCapture {
  std::vector<std::string> lines;
  MoeLogger prev;
  LogCapture() {
    reset_log_once();
    prev = set_moe_logger([this](LogLevel, std::string_view m) { lines.emplace_back(m); });
  }
  ~LogCapture() {
    set_moe_logger(prev);
    reset_log_once();
  }
};

TEST(OnlineMethod, SeedErrors) {
  MoeConfig c = make_config(4, 2, 128, 128);
  c.has_bias = true;
  try {
    LutBOnlineMoEMethod m(c);
    FAIL() << "bias accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "LUT-B online MoE quantization does not support bias.");
  }
  c.has_bias = false;
  for (const char* bad : {"triton", "cutlass", "", "Auto"}) {
    c.moe_backend = bad;
    try {
      LutBOnlineMoEMethod m(c);
      FAIL() << "moe_backend accepted: " << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), std::string("moe_backend='") + bad +
                                           "' is not supported for LUT-B MoE; expected 'auto' or 'emulation'.");
    }
  }
}

TEST(OnlineMethod, NativeSupportReasons) {
  const NativeSupport here = NativeSupport::probe();
  EXPECT_FALSE(here.supported);
  EXPECT_EQ(here.reason, "built without sm_107 support");
  EXPECT_EQ(NativeSupport::decide(true, -1, 0).reason, "no CUDA device with compute capability 10.7 (no CUDA device found)");
  EXPECT_EQ(NativeSupport::decide(true, 9, 0).reason, "no CUDA device with compute capability 10.7 (device has 9.0)");
  EXPECT_FALSE(NativeSupport::decide(true, 10, 0).supported);
  EXPECT_TRUE(NativeSupport::decide(true, 10, 7).supported);
  EXPECT_EQ(NativeSupport::decide(false, 10, 7).reason, "built without sm_107 support");
}

TEST(OnlineMethod, SelectionAndReasonLoggedOnce) {
  LogCapture log;
  const MoeConfig aligned = make_config(4, 2, 256, 128);
  {
    LutBOnlineMoEMethod a(aligned), b(aligned);  // this build: no sm_107
    EXPECT_EQ(a.backend(), Backend::Emulation);
    EXPECT_EQ(a.fallback_reason(), "built without sm_107 support");
    EXPECT_EQ(b.fallback_reason(), "built without sm_107 support");
  }
  ASSERT_EQ(log.lines.size(), 1u) << "logged once";
  EXPECT_EQ(log.lines[0],
            "LUT-B MoE: CPU emulation of Rubin's LUT-B numerics (native sm_107 path not used: built without sm_107 "
            "support)");

  // A supported device: native iff H and I are multiples of 128.
  const NativeSupport yes{true, ""};
  EXPECT_EQ(LutBOnlineMoEMethod(aligned, test_options(yes)).backend(), Backend::Native);
  EXPECT_EQ(log.lines.size(), 1u);
  const MoeConfig ragged = make_config(4, 2, 192, 128);  // H = 192
  LutBOnlineMoEMethod r(ragged, test_options(yes));
  EXPECT_EQ(r.backend(), Backend::Emulation);
  EXPECT_EQ(r.fallback_reason(), "hidden and intermediate sizes must be multiples of 128");
  ASSERT_EQ(log.lines.size(), 2u);
  EXPECT_EQ(log.lines[1],
            "LUT-B MoE: CPU emulation of Rubin's LUT-B numerics (native sm_107 path not used: hidden and "
            "intermediate sizes must be multiples of 128)");
  EXPECT_EQ(LutBOnlineMoEMethod(make_config(4, 2, 256, 64), test_options(yes)).backend(), Backend::Emulation);
  EXPECT_EQ(log.lines.size(), 2u) << "same reason, not logged again";

  // Explicit emulation: no fallback, nothing logged.
  MoeConfig emu = aligned;
  emu.moe_backend = "emulation";
  LutBOnlineMoEMethod e(emu, test_options(yes));
  EXPECT_EQ(e.backend(), Backend::Emulation);
  EXPECT_TRUE(e.fallback_reason().empty());
  EXPECT_EQ(log.lines.size(), 2u);
}

RoutedExpertsLayer random_layer(const MoeConfig& c, std::mt19937& rng) {
  RoutedExpertsLayer L(c);
  L.w13_weight = test::random_bf16(L.w13_weight.size(), rng, 0.05f);
  L.w2_weight = test::random_bf16(L.w2_weight.size(), rng, 0.05f);
  return L;
}

TEST(OnlineMethod, ProcessQuantizesReleasesAndIsIdempotent) {
  LogCapture log;
  std::mt19937 rng(21);
  const MoeConfig c = make_config(6, 2, 128, 192);
  RoutedExpertsLayer layer = random_layer(c, rng);
  const std::vector<std::uint16_t> w13_src = layer.w13_weight, w2_src = layer.w2_weight;

  LutBOnlineMoEMethod m(c, test_options());
  EXPECT_THROW(m.kernel(), std::logic_error);
  const QuantizeReport rep = m.process_weights_after_loading(layer);
  EXPECT_TRUE(layer.already_processed);
  // Source released: the memory really returns (capacity, not only size).
  EXPECT_EQ(layer.w13_weight.capacity(), 0u);
  EXPECT_EQ(layer.w2_weight.capacity(), 0u);
  EXPECT_EQ(rep.source_bytes, (w13_src.size() + w2_src.size()) * 2);
  EXPECT_EQ(rep.quantized_bytes, m.kernel().weight_bytes());
  EXPECT_NEAR(double(rep.quantized_bytes) * 8 / (w13_src.size() + w2_src.size()), kBitsPerWeight, 1e-9);
  EXPECT_EQ(rep.w13.tiles, c.w13_shape().tiles());
  EXPECT_EQ(m.kernel().name().rfind("lutb-cpu/", 0), 0u);

  // The kernel computes the emulation of exactly those LUT-B weights.
  LutbTensor q13, q2;
  simple_fit(w13_src.data(), DType::BF16, c.w13_shape(), q13, {}, "w13");
  simple_fit(w2_src.data(), DType::BF16, c.w2_shape(), q2, {}, "w2");
  const int T = 5;
  const auto x = test::random_bf16(T * 128, rng);
  std::vector<std::int32_t> ids;
  std::vector<float> w;
  test::random_topk(T, 2, 6, rng, ids, w);
  std::vector<float> got(T * 128), want(T * 128);
  m.apply_f32(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), 2}, got.data());
  LutbReferenceExperts(c, q13, q2).apply_f32(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), 2}, want.data());
  EXPECT_LE(rel_l2(got, want), 1e-4);

  // Idempotent: a second call does nothing and keeps the kernel.
  const Experts* k1 = &m.kernel();
  const QuantizeReport again = m.process_weights_after_loading(layer);
  EXPECT_EQ(again.source_bytes, 0u);
  EXPECT_EQ(&m.kernel(), k1);
  EXPECT_THROW(m.load_packed(layer, q13, q2), std::logic_error);
}

TEST(OnlineMethod, PaddingIsZeroedBeforeFitting) {
  std::mt19937 rng(4);
  const MoeConfig c = make_config(3, 1, 128, 128, 100, 90);  // unpadded H = 100, I = 90
  RoutedExpertsLayer a = random_layer(c, rng);
  RoutedExpertsLayer b = a;
  // Junk in b's padding only.
  for (int e = 0; e < 3; ++e) {
    std::uint16_t* w13 = b.w13_expert(e);
    for (int n = 0; n < 256; ++n)
      for (int k = 0; k < 128; ++k)
        if (n % 128 >= 90 || k >= 100) w13[n * 128 + k] = bf16_from_float(5.0f);
    std::uint16_t* w2 = b.w2_expert(e);
    for (int n = 0; n < 128; ++n)
      for (int k = 0; k < 128; ++k)
        if (n >= 100 || k >= 90) w2[n * 128 + k] = bf16_from_float(-3.0f);
  }
  OnlineOptions o = test_options();
  o.emulation = EmulationKernel::Reference;
  LutBOnlineMoEMethod ma(c, o), mb(c, o);
  ma.process_weights_after_loading(a);
  mb.process_weights_after_loading(b);
  const int T = 4;
  const auto x = test::random_bf16(T * 128, rng);
  std::vector<std::int32_t> ids = {0, 1, 2, 0};
  std::vector<float> w = {1.0f, 0.5f, 0.25f, 2.0f};
  std::vector<std::uint16_t> oa(T * 128), ob(T * 128);
  ma.apply(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), 1}, oa.data());
  mb.apply(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), 1}, ob.data());
  EXPECT_EQ(oa, ob);
  for (int t = 0; t < T; ++t)
    for (int i = 100; i < 128; ++i) EXPECT_EQ(ob[t * 128 + i], 0) << "padded output column";
}

TEST(OnlineMethod, NativeBackendKeepsTheSm107LayoutAndComputesTheSameNumerics) {
  std::mt19937 rng(8);
  const MoeConfig c = make_config(4, 2, 256, 128);
  RoutedExpertsLayer ln = random_layer(c, rng);
  RoutedExpertsLayer le = ln;
  LutBOnlineMoEMethod native(c, test_options(NativeSupport{true, ""}));
  MoeConfig ce = c;
  ce.moe_backend = "emulation";
  LutBOnlineMoEMethod emu(ce, test_options(NativeSupport{true, ""}));
  ASSERT_EQ(native.backend(), Backend::Native);
  native.process_weights_after_loading(ln);
  emu.process_weights_after_loading(le);
  EXPECT_EQ(native.kernel().name(), "lutb-sm107");
  EXPECT_EQ(ln.w13_weight.capacity(), 0u);
  const int T = 3;
  const auto x = test::random_bf16(T * 256, rng);
  std::vector<std::int32_t> ids;
  std::vector<float> w;
  test::random_topk(T, 2, 4, rng, ids, w);
  std::vector<std::uint16_t> a(T * 256), b(T * 256);
  native.apply(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), 2}, a.data());
  emu.apply(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), 2}, b.data());
  EXPECT_EQ(a, b);
}

TEST(OnlineMethod, LoadPackedFromACheckpoint) {
  std::mt19937 rng(12);
  const MoeConfig c = make_config(5, 2, 128, 64, -1, -1, 1, 2);  // EP rank 1 of 2: experts 3, 4
  ASSERT_EQ(c.local_experts(), 2);
  const LutbTensor w13 = test::random_lutb(c.w13_shape(), rng), w2 = test::random_lutb(c.w2_shape(), rng);
  RoutedExpertsLayer layer(c);
  for (auto kind : {EmulationKernel::Fast, EmulationKernel::Reference, EmulationKernel::Dequantized}) {
    RoutedExpertsLayer l(c);
    OnlineOptions o;
    o.emulation = kind;
    LutBOnlineMoEMethod m(c, o);
    m.load_packed(l, w13, w2);
    EXPECT_TRUE(l.already_processed);
    EXPECT_EQ(l.w13_weight.capacity(), 0u);
    const int T = 4;
    const auto x = test::random_bf16(T * 128, rng);
    std::vector<std::int32_t> ids = {3, 4, 0, 4, 1, 2, 3, 0};
    std::vector<float> w = {0.5f, 0.5f, 0.7f, 0.3f, 0.6f, 0.4f, 0.9f, 0.1f};
    std::vector<float> got(T * 128), want(T * 128);
    m.apply_f32(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), 2}, got.data());
    LutbReferenceExperts(c, w13, w2).apply_f32(HiddenStates::bf16(x.data(), T), {ids.data(), w.data(), 2}, want.data());
    EXPECT_LE(rel_l2(got, want), 1e-4);
    for (int i = 0; i < 128; ++i) EXPECT_EQ(got[2 * 128 + i], 0.0f) << "token 2 has no local expert";
  }
}

TEST(OnlineMethod, LayerMismatchAndBadSources) {
  std::mt19937 rng(2);
  const MoeConfig c = make_config(4, 2, 128, 64);
  LutBOnlineMoEMethod m(c, test_options());
  RoutedExpertsLayer other(make_config(4, 2, 128, 128));
  EXPECT_THROW(m.process_weights_after_loading(other), std::invalid_argument);
  RoutedExpertsLayer l(c);
  l.w2_weight.resize(10);
  EXPECT_THROW(m.process_weights_after_loading(l), std::invalid_argument);
  EXPECT_FALSE(l.already_processed);
  EXPECT_THROW(RoutedExpertsLayer(c, DType::F32), std::invalid_argument);
}

// ---------------------------------------------------------------------------
// sm_107 layout
// ---------------------------------------------------------------------------
TEST(Sm107Layout, RoundTripAndPlacement) {
  std::mt19937 rng(31);
  LutbShape s;
  s.experts = 3;
  s.rows = 72;   // 9 tile rows -> 2 regions of 64 (padded)
  s.cols = 200;  // 4 tile columns -> 2 regions of 128
  s.stacked = true;
  const LutbTensor w = test::random_lutb(s, rng);
  const sm107::Sm107Tensor n = sm107::to_sm107(w.view());
  EXPECT_EQ(n.regions_n, 2);
  EXPECT_EQ(n.regions_k, 2);
  EXPECT_EQ(n.packed.size(), 3u * 4 * 64 * 48);
  EXPECT_EQ(n.codebooks.size(), 3u * 4 * 128);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(n.codebooks.data()) % 128, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(n.packed.data()) % 128, 0u);
  const LutbTensor back = sm107::from_sm107(n);
  EXPECT_EQ(back.packed, w.packed);
  EXPECT_EQ(back.codebook, w.codebook);
  EXPECT_EQ(back.scale, w.scale);
  for (int e = 0; e < 3; ++e) {
    const LutbTensor one = sm107::expert_from_sm107(n, e);
    const std::int64_t tpe = s.tiles_per_expert();
    EXPECT_TRUE(std::equal(one.packed.begin(), one.packed.end(), w.packed.begin() + e * tpe * 192));
    EXPECT_TRUE(std::equal(one.scale.begin(), one.scale.end(), w.scale.begin() + e * tpe));
  }
  // Placement (A1..A3): expert 1, tile (tn = 3, tk = 3) row r = 5 -> region (rn 0, rk 1),
  // column n_local = 3*8 + 5 = 29, second half of its 48 bytes; codebook slot 3*2 + 1 = 7.
  const std::int64_t tile = (1 * s.tiles_n() + 3) * s.tiles_k() + 3;
  const std::int64_t region = (1 * 2 + 0) * 2 + 1;
  EXPECT_EQ(0, std::memcmp(n.packed.data() + region * 3072 + 29 * 48 + 24, w.packed.data() + tile * 192 + 5 * 24, 24));
  EXPECT_EQ(0, std::memcmp(n.codebooks.data() + region * 128 + 7 * 8, w.codebook.data() + tile * 8, 8));
  EXPECT_EQ(n.scales[region * 16 + 7], w.scale[tile]);
  // Padding tiles (A5): tile row 9..15 of region rn = 1 do not exist: zero indices and codebook, scale 127.
  const std::int64_t pregion = (0 * 2 + 1) * 2 + 0;
  EXPECT_EQ(n.scales[pregion * 16 + 2 * 2], 127);
  for (int b = 0; b < 48; ++b) EXPECT_EQ(n.packed[pregion * 3072 + 8 * 48 + b], 0);
  // Invalid data is refused.
  LutbTensor bad = w;
  bad.scale[0] = 255;
  EXPECT_THROW(sm107::to_sm107(bad.view()), FormatError);
  sm107::Sm107Tensor cut = n;
  cut.packed.resize(100);
  EXPECT_THROW(sm107::from_sm107(cut), FormatError);
}

}  // namespace
}  // namespace lutb::moe
