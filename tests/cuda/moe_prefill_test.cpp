// tests/cuda/moe_prefill_test.cpp: the large-batch (prefill) LUT-B kernels (src/cuda/moe/lutb_moe_prefill.cu:
// the mma.sync tile, and on sm_90 the wgmma tile of 64 rows and the register-weight kernels of 64 and
// 128 tokens) against the plain host reference of spec section 4 (tests/cuda/reference.hpp): random weights
// uploaded in lane-major order, padded odd shapes, empty experts, 1..300 tokens per expert, the
// DeepSeek-V3 / Qwen3 layer shapes (H, I, k as the models; fewer experts) at moderate T. Outputs
// and workspace are poisoned (NaN bytes) before every run. GPU tests skip without a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda/moe_paths.hpp"
#include "cuda/reference.hpp"
#include "lutb/cuda/lane_major.hpp"
#include "lutb/cuda/moe.hpp"

namespace lutb::test {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define LUTB_GPU_OR_SKIP() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: skipping GPU test"

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

template <class T>
struct DevBuf {
  T* p = nullptr;
  std::size_t n = 0;
  explicit DevBuf(std::size_t count) : n(count) {
    ck(cudaMalloc(&p, std::max<std::size_t>(1, count) * sizeof(T)), "cudaMalloc");
  }
  explicit DevBuf(const std::vector<T>& v) : DevBuf(v.size()) {
    ck(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "H2D");
  }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  std::vector<T> down() const {
    std::vector<T> v(n);
    ck(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "D2H");
    return v;
  }
};

/// Packed bytes of every tile permuted to the GPU's lane-major order (in parallel: large stacks).
std::vector<std::uint8_t> to_lane_major_host(const std::vector<std::uint8_t>& packed) {
  std::vector<std::uint8_t> out(packed.size());
  const std::int64_t tiles = static_cast<std::int64_t>(packed.size() / kPackedBytes);
  const int nt = static_cast<int>(std::clamp<std::int64_t>(tiles / 4096, 1, std::max(1u, std::thread::hardware_concurrency())));
  std::vector<std::thread> th;
  for (int i = 0; i < nt; ++i)
    th.emplace_back([&, i] {
      for (std::int64_t t = tiles * i / nt; t < tiles * (i + 1) / nt; ++t)
        cuda::tile_to_lane_major(&packed[t * kPackedBytes], &out[t * kPackedBytes]);
    });
  for (auto& x : th) x.join();
  return out;
}

/// A host stack uploaded in lane-major order.
struct DevLutbLM {
  DevBuf<std::uint8_t> packed, codebook, scale;
  cuda::DeviceLutb view;
  explicit DevLutbLM(const HostLutb& h)
      : packed(to_lane_major_host(h.packed)), codebook(h.codebook), scale(h.scale) {
    view.shape = h.shape;
    view.packed = packed.p;
    view.codebook = codebook.p;
    view.scale = scale.p;
    view.lane_major = true;  // uploaded already permuted on the host
  }
};

/// random_lutb (reference.hpp) with the bulk index bytes drawn 4 at a time (the large shapes).
HostLutb fast_random_lutb(LutbShape s, std::mt19937& rng) {
  HostLutb out(s);
  for (std::size_t i = 0; i < out.packed.size(); i += 4) {
    const std::uint32_t v = rng();
    for (std::size_t b = 0; b < 4 && i + b < out.packed.size(); ++b) out.packed[i + b] = static_cast<std::uint8_t>(v >> (8 * b));
  }
  std::uniform_int_distribution<int> byte(0, 255), sc(117, 123);
  for (std::int64_t t = 0; t < s.tiles(); ++t) {
    std::uint8_t cb[8];
    for (auto& b : cb) do b = static_cast<std::uint8_t>(byte(rng)); while (e4m3_is_nan(b));
    std::sort(cb, cb + 8, [](std::uint8_t a, std::uint8_t b) { return e4m3_to_float(a) < e4m3_to_float(b); });
    std::memcpy(&out.codebook[t * 8], cb, 8);
    out.scale[t] = static_cast<std::uint8_t>(sc(rng));
  }
  return out;
}

std::vector<std::uint16_t> random_bf16(std::size_t n, std::mt19937& rng, float sigma = 1.0f) {
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = bf16_from_float(d(rng));
  return v;
}

struct Cmp {
  double rel_l2 = 0;
  std::int64_t nan = 0, exact = 0, n = 0;
};
Cmp compare_bf16(const std::vector<std::uint16_t>& got, const std::vector<std::uint16_t>& ref) {
  Cmp c;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float g = bf16_to_float(got[i]), r = bf16_to_float(ref[i]);
    if (std::isnan(g)) { ++c.nan; continue; }
    num += (double(g) - r) * (double(g) - r);
    den += double(r) * r;
    c.exact += got[i] == ref[i];
  }
  c.n = static_cast<std::int64_t>(got.size());
  c.rel_l2 = std::sqrt(num / std::max(den, 1e-300));
  return c;
}

using cuda::heuristics::PrefillKernel;

/// The prefill forward with `kernel` on device stacks; out [T][H] poisoned (0xffff = NaN) before the run.
std::vector<std::uint16_t> run_prefill(const cuda::DeviceMoeWeights& w, const std::vector<std::uint16_t>& x,
                                       std::int64_t T, int k, const std::vector<std::int32_t>& ids,
                                       const std::vector<float>& wts, PrefillKernel kernel) {
  DevBuf<std::uint16_t> dx(x), out(static_cast<std::size_t>(T * w.hidden));
  DevBuf<std::int32_t> did(ids);
  DevBuf<float> dw(wts);
  const std::size_t wsb = cuda::moe_workspace_bytes(T, k, w.experts, w.hidden, w.intermediate);
  DevBuf<char> ws(wsb);
  ck(cudaMemset(out.p, 0xff, out.n * 2), "poison out");
  ck(cudaMemset(ws.p, 0xff, wsb), "poison workspace");
  cuda::heuristics::MoePlan plan = default_plan(T, k, w.experts, w.hidden, cuda::MoeStrategy::Prefill);
  plan.prefill = kernel;
  cuda::detail::moe_forward_plan(w, dx.p, T, k, did.p, dw.p, out.p, ws.p, wsb, nullptr, plan);
  ck(cudaDeviceSynchronize(), "moe_forward (prefill)");
  return out.down();
}

void random_routing(std::int64_t T, int k, const std::vector<int>& allowed, std::mt19937& rng,
                    std::vector<std::int32_t>& ids, std::vector<float>& w) {
  ids.resize(T * k);
  w.resize(T * k);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<int> pool = allowed;
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int j = 0; j < k; ++j) {
      ids[t * k + j] = pool[j];
      w[t * k + j] = u(rng);
    }
  }
}

/// Rows `rows` of x / ids / weights (for checking large shapes on a sample of tokens).
template <class V>
V take_rows(const V& v, std::int64_t width, const std::vector<std::int64_t>& rows) {
  V out;
  for (std::int64_t r : rows) out.insert(out.end(), v.begin() + r * width, v.begin() + (r + 1) * width);
  return out;
}

/// The contract: rel. L2 below 1e-3 and at least 80 % bit-equal BF16 outputs (FP32 order only differs).
void expect_matches(const std::vector<std::uint16_t>& got, const std::vector<std::uint16_t>& ref) {
  const Cmp r = compare_bf16(got, ref);
  std::cout << "  vs host reference: rel. L2 " << r.rel_l2 << ", bit-equal " << r.exact << " of " << r.n << "\n";
  EXPECT_EQ(r.nan, 0) << "unwritten or NaN outputs";
  EXPECT_LT(r.rel_l2, 1e-3) << "exact " << r.exact << " of " << r.n;
  EXPECT_GT(r.exact, r.n * 8 / 10) << "bit-equal BF16 outputs (FP32 order only differs); rel L2 "
                                               << r.rel_l2;
}

/// Every prefill kernel the device runs: the mma.sync tile, and on sm_90 the wgmma tile and the
/// register-weight kernels.
std::vector<PrefillKernel> all_tiles() {
  std::vector<PrefillKernel> v = {PrefillKernel::Sm80Mma64};
  if (cuda::detail::moe_device().sm90a) {
    v.push_back(PrefillKernel::Sm90Wgmma64);
    v.push_back(PrefillKernel::Sm90WgmmaRs64);
    v.push_back(PrefillKernel::Sm90WgmmaRs128);
  }
  return v;
}
/// The register-weight kernels: the same operands and 128-column promotion as the mma.sync tile,
/// but each k16 step's tensor-core sum takes other columns, so equal up to FP32 addition order.
bool bit_identical_to_mma(PrefillKernel t) {
  return t != PrefillKernel::Sm90WgmmaRs64 && t != PrefillKernel::Sm90WgmmaRs128;
}
const char* tile_name(PrefillKernel t) {
  switch (t) {
    case PrefillKernel::Sm80Mma64: return "sm80 mma.sync 64";
    case PrefillKernel::Sm90Wgmma64: return "sm90 wgmma 64";
    case PrefillKernel::Sm90WgmmaRs64: return "sm90 wgmma rs 64";
    case PrefillKernel::Sm90WgmmaRs128: return "sm90 wgmma rs 128";
  }
  return "?";
}
/// The strategy rule of the LUT-B forward (heuristics::choose_strategy) as a yes / no.
bool prefer_prefill(std::int64_t T, int k, std::int64_t E, bool wgmma = false) {
  return T > 0 && cuda::heuristics::choose_strategy(T, k, E, true, wgmma) == cuda::MoeStrategy::Prefill;
}

struct Case {
  const char* name;
  std::int64_t E, H, I, T;
  int k;
  bool only_even;    // leave odd experts empty
  int check_tokens;  // 0: all tokens against the host reference, else this many sampled tokens
};
// Readable parameters in failure messages (gtest otherwise dumps the struct's bytes).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name << " (E=" << c.E << ", H=" << c.H << ", I=" << c.I << ", T=" << c.T << ", k=" << c.k << ")";
}

class PrefillRandom : public ::testing::TestWithParam<Case> {};

TEST_P(PrefillRandom, MatchesHostReference) {
  LUTB_GPU_OR_SKIP();
  const Case c = GetParam();
  std::mt19937 rng(777 + static_cast<unsigned>(c.E * 7 + c.H + c.I + c.T));
  const HostLutb w13 = fast_random_lutb({c.E, 2 * c.I, c.H, true}, rng);
  const HostLutb w2 = fast_random_lutb({c.E, c.H, c.I, true}, rng);
  const auto x = random_bf16(c.T * c.H, rng);
  std::vector<int> allowed;
  for (int e = 0; e < c.E; ++e)
    if (!c.only_even || e % 2 == 0) allowed.push_back(e);
  std::vector<std::int32_t> ids;
  std::vector<float> wts;
  random_routing(c.T, c.k, allowed, rng, ids, wts);
  DevLutbLM d13(w13), d2(w2);
  const cuda::DeviceMoeWeights w{c.E, c.H, c.I, d13.view, d2.view};
  std::vector<std::int64_t> rows;
  if (c.check_tokens == 0) {
    for (std::int64_t t = 0; t < c.T; ++t) rows.push_back(t);
  } else {
    for (int i = 0; i < c.check_tokens; ++i) rows.push_back((c.T - 1) * i / std::max(1, c.check_tokens - 1));
  }
  const auto ref = moe_reference(w13, w2, c.H, c.I, take_rows(x, c.H, rows), static_cast<std::int64_t>(rows.size()),
                                 c.k, take_rows(ids, c.k, rows), take_rows(wts, c.k, rows));
  // Every prefill kernel against the same reference.
  std::vector<std::uint16_t> m64;
  for (const PrefillKernel tile : all_tiles()) {
    SCOPED_TRACE(tile_name(tile));
    std::cout << "  tile " << tile_name(tile) << "\n";
    const auto got = run_prefill(w, x, c.T, c.k, ids, wts, tile);
    expect_matches(take_rows(got, c.H, rows), ref);
    if (tile == PrefillKernel::Sm80Mma64) m64 = got;
    if (tile != PrefillKernel::Sm80Mma64 && !m64.empty()) {
      // The wgmma tiles use the mma.sync tile's numerics (exact BF16 operands, tensor-core sums over
      // the same 128 columns, the same FP32 promotion): bit-identical on all rows. The register-weight
      // kernels group each k16 step's columns differently (bit_identical_to_mma).
      const Cmp d = compare_bf16(got, m64);
      std::cout << "  " << tile_name(tile) << " vs mma.sync (all rows): rel. L2 " << d.rel_l2 << ", bit-equal "
                << d.exact << " of " << d.n << "\n";
      if (bit_identical_to_mma(tile)) {
        EXPECT_EQ(d.exact, d.n) << tile_name(tile) << " is not bit-identical to the mma.sync tile";
      } else {
        EXPECT_LT(d.rel_l2, 1e-3) << tile_name(tile) << " vs the mma.sync tile";
        EXPECT_GT(d.exact, d.n * 8 / 10) << tile_name(tile) << " vs the mma.sync tile: FP32 order only differs";
      }
    }
    if (c.check_tokens != 0) {
      // Every row written and finite (the sampled check covers the values).
      std::int64_t bad = 0;
      for (auto v : got) bad += std::isnan(bf16_to_float(v));
      EXPECT_EQ(bad, 0) << "unwritten or NaN outputs outside the sampled rows";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PrefillRandom,
    ::testing::Values(Case{"one_token", 8, 256, 128, 1, 2, false, 0},
                      Case{"padded_odd", 16, 200, 72, 13, 4, false, 0},        // H, I padded in K and N
                      Case{"empty_experts", 32, 512, 256, 100, 8, true, 0},    // odd experts empty
                      Case{"several_tiles", 4, 1024, 512, 200, 2, false, 0},   // ~100 rows per expert, 2 N-blocks
                      Case{"padded_many_rows", 3, 328, 136, 250, 2, false, 0},  // > 2 token tiles, ragged edges
                      Case{"deepseek_v3_shape", 12, 7168, 2048, 96, 8, false, 2},
                      Case{"qwen3_235b_shape", 16, 4096, 1536, 160, 8, false, 3},
                      Case{"qwen3_30b_shape", 32, 2048, 768, 256, 8, false, 8},
                      // >= 128 pairs per expert: full 128-token tiles and a ragged last tile per expert,
                      // H and I padded in K and N.
                      Case{"m128_ragged", 4, 328, 136, 600, 2, false, 0},
                      // 128-token tiles with odd experts empty (E=16, 8 used, k=4: 4 * 700 / 8 = 350 pairs each).
                      Case{"m128_empty_experts", 16, 512, 256, 700, 4, true, 0},
                      // DeepSeek-V3 layer shape (H=7168, I=2048, k=8) at >= 128 pairs per expert:
                      // E=8 experts, T=160 -> every expert gets all 160 tokens.
                      Case{"deepseek_v3_shape_m128", 8, 7168, 2048, 160, 8, false, 3},
                      // GEMM1 K = 16448 = 257 K-tiles > kMaxScaleTiles: the per-lane scale loads
                      // instead of the shared-memory scale rows (GEMM2 with K = 64 uses those).
                      Case{"long_k_scale_fallback", 2, 16448, 64, 40, 1, false, 0}),
    [](const ::testing::TestParamInfo<Case>& i) { return std::string(i.param.name); });

TEST(PrefillCuda, SkewedRouting1To300TokensPerExpert) {
  LUTB_GPU_OR_SKIP();
  // Expert 0: all 300 tokens (4 full token tiles + 44); expert 1: every 4th (75); expert 2: one
  // token; expert 3: none; 4..7: the third choice at random.
  const std::int64_t E = 8, H = 328, I = 136, T = 300;
  const int k = 3;
  std::mt19937 rng(4242);
  const HostLutb w13 = fast_random_lutb({E, 2 * I, H, true}, rng), w2 = fast_random_lutb({E, H, I, true}, rng);
  const auto x = random_bf16(T * H, rng);
  std::vector<std::int32_t> ids(T * k);
  std::vector<float> wts(T * k);
  std::uniform_int_distribution<int> other(4, 7);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (std::int64_t t = 0; t < T; ++t) {
    ids[t * k + 0] = 0;
    ids[t * k + 1] = (t % 4 == 0) ? 1 : (t == 7 ? 2 : other(rng));
    int third = other(rng);
    while (third == ids[t * k + 1]) third = other(rng);
    ids[t * k + 2] = third;
    for (int j = 0; j < k; ++j) wts[t * k + j] = u(rng);
  }
  DevLutbLM d13(w13), d2(w2);
  const auto ref = moe_reference(w13, w2, H, I, x, T, k, ids, wts);
  for (const PrefillKernel tile : all_tiles()) {  // 300 rows: 2 full 128-row tiles + 44, or 4 x 64 + 44
    SCOPED_TRACE(tile_name(tile));
    expect_matches(run_prefill({E, H, I, d13.view, d2.view}, x, T, k, ids, wts, tile), ref);
  }
}

TEST(PrefillCuda, InvalidExpertIdWritesNanRowOnly) {
  LUTB_GPU_OR_SKIP();
  std::mt19937 rng(5);
  const std::int64_t E = 4, H = 64, I = 64, T = 3;
  const int k = 2;
  const HostLutb w13 = random_lutb({E, 2 * I, H, true}, rng), w2 = random_lutb({E, H, I, true}, rng);
  const auto x = random_bf16(T * H, rng);
  const std::vector<std::int32_t> ids = {0, 1, 2, 7, 3, 0};  // token 1 has an out-of-range id
  const std::vector<float> wts = {0.5f, 0.5f, 0.3f, 0.7f, 0.6f, 0.4f};
  DevLutbLM d13(w13), d2(w2);
  const auto ref = moe_reference(w13, w2, H, I, x, T, k, ids, wts);
  for (const PrefillKernel tile : all_tiles()) {
    SCOPED_TRACE(tile_name(tile));
    const auto got = run_prefill({E, H, I, d13.view, d2.view}, x, T, k, ids, wts, tile);
    for (std::int64_t c = 0; c < H; ++c) {
      EXPECT_TRUE(std::isnan(bf16_to_float(got[1 * H + c])));
      EXPECT_EQ(got[0 * H + c], ref[0 * H + c]) << "column " << c;
      EXPECT_FALSE(std::isnan(bf16_to_float(got[2 * H + c])));
    }
  }
}

TEST(PrefillCuda, NonFiniteActivationBlockGivesNanRowLikeTheReference) {
  LUTB_GPU_OR_SKIP();
  // An Inf in x makes its MXFP8 block scale 255 (spec 3): the token's row is NaN in the reference;
  // every other row must be unaffected.
  std::mt19937 rng(11);
  const std::int64_t E = 4, H = 256, I = 128, T = 5;
  const int k = 2;
  const HostLutb w13 = random_lutb({E, 2 * I, H, true}, rng), w2 = random_lutb({E, H, I, true}, rng);
  auto x = random_bf16(T * H, rng);
  x[2 * H + 77] = bf16_from_float(INFINITY);
  std::vector<std::int32_t> ids;
  std::vector<float> wts;
  random_routing(T, k, {0, 1, 2, 3}, rng, ids, wts);
  DevLutbLM d13(w13), d2(w2);
  const auto ref = moe_reference(w13, w2, H, I, x, T, k, ids, wts);
  for (const PrefillKernel tile : all_tiles()) {
    SCOPED_TRACE(tile_name(tile));
    const auto got = run_prefill({E, H, I, d13.view, d2.view}, x, T, k, ids, wts, tile);
    for (std::int64_t c = 0; c < H; ++c) {
      EXPECT_TRUE(std::isnan(bf16_to_float(ref[2 * H + c])));
      EXPECT_TRUE(std::isnan(bf16_to_float(got[2 * H + c]))) << "column " << c;
    }
    const std::vector<std::int64_t> rows = {0, 1, 3, 4};
    expect_matches(take_rows(got, H, rows), take_rows(ref, H, rows));
  }
}

// The measured crossover (src/cuda/heuristics/moe_heuristics.hpp, kPrefillMinTokensPerExpert):
// swap-AB decode up to 32 pairs per touched expert, prefill from 40; with the sm_90a wgmma prefill
// tile (kPrefillMinTokensPerExpertWgmma) decode up to 24, prefill from 32; the benchmark shapes'
// batch sizes on either side.
TEST(PrefillCuda, HeuristicThresholdIs28PairsPerTouchedExpertWithTheWgmmaTile) {
  EXPECT_EQ(cuda::heuristics::kPrefillMinTokensPerExpertWgmma, 28.0);
  EXPECT_FALSE(prefer_prefill(768, 8, 256, true));   // DeepSeek-V3, T = 768: 24
  EXPECT_FALSE(prefer_prefill(892, 8, 256, true));   // 27.9
  EXPECT_TRUE(prefer_prefill(896, 8, 256, true));    // 28
  EXPECT_TRUE(prefer_prefill(1024, 8, 256, true));   // DeepSeek-V3, T = 1024: 32
  EXPECT_FALSE(prefer_prefill(384, 8, 128, true));   // Qwen3, T = 384: 24
  EXPECT_TRUE(prefer_prefill(512, 8, 128, true));    // Qwen3, T = 512: 32
  EXPECT_FALSE(prefer_prefill(96, 2, 8, true));      // Mixtral, T = 96: 24
  EXPECT_TRUE(prefer_prefill(128, 2, 8, true));      // Mixtral, T = 128: 32
  EXPECT_FALSE(prefer_prefill(0, 8, 256, true));
  EXPECT_EQ(cuda::heuristics::choose_strategy(1024, 8, 256, true, true), cuda::MoeStrategy::Prefill);
  EXPECT_EQ(cuda::heuristics::choose_strategy(1024, 8, 256, true, false), cuda::MoeStrategy::Decode);
  EXPECT_EQ(cuda::heuristics::choose_strategy(256, 8, 256, true, true), cuda::MoeStrategy::Decode);
  // The BF16 baseline's rule does not depend on the LUT-B prefill tile.
  EXPECT_EQ(cuda::heuristics::choose_strategy(1024, 8, 256, false, true), cuda::MoeStrategy::Decode);
}

TEST(PrefillCuda, HeuristicThresholdIs36PairsPerTouchedExpert) {
  EXPECT_EQ(cuda::heuristics::kPrefillMinTokensPerExpert, 36.0);
  EXPECT_FALSE(prefer_prefill(256, 8, 256));   // DeepSeek-V3, T = 256: 8 pairs per expert
  EXPECT_FALSE(prefer_prefill(1024, 8, 256));  // DeepSeek-V3, T = 1024: 32
  EXPECT_FALSE(prefer_prefill(1136, 8, 256));  // 35.5
  EXPECT_TRUE(prefer_prefill(1152, 8, 256));   // 36
  EXPECT_TRUE(prefer_prefill(1280, 8, 256));   // 40
  EXPECT_FALSE(prefer_prefill(512, 8, 128));   // Qwen3, T = 512: 32
  EXPECT_TRUE(prefer_prefill(640, 8, 128));    // Qwen3, T = 640: 40
  EXPECT_FALSE(prefer_prefill(128, 2, 8));     // Mixtral, T = 128: 32
  EXPECT_TRUE(prefer_prefill(160, 2, 8));      // Mixtral, T = 160: 40
  EXPECT_FALSE(prefer_prefill(4, 2, 8));       // 8 pairs over 8 experts
  EXPECT_FALSE(prefer_prefill(0, 8, 256));
  // The dispatcher (choose_strategy) applies the same rule.
  EXPECT_EQ(cuda::heuristics::choose_strategy(1, 8, 256), cuda::MoeStrategy::Decode);
  EXPECT_EQ(cuda::heuristics::choose_strategy(1024, 8, 256), cuda::MoeStrategy::Decode);
  EXPECT_EQ(cuda::heuristics::choose_strategy(640, 8, 128), cuda::MoeStrategy::Prefill);
  EXPECT_EQ(cuda::heuristics::choose_strategy(4096, 8, 256), cuda::MoeStrategy::Prefill);
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(1, 8, 256), 1);
  // One 8-token block up to 10 tokens per expert (measured crossover between 8 and 12), two above.
  EXPECT_EQ(cuda::heuristics::kSwapOneBlockMaxTokensPerExpert, 10.0);
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(192, 8, 256), 1);   // 6 pairs per expert
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(256, 8, 256), 1);   // 8: one block was 1.10x faster
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(320, 8, 256), 1);   // 10
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(384, 8, 256), 2);   // 12: two blocks were 1.08x faster
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(128, 8, 128), 1);   // Qwen3, 8
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(256, 8, 128), 2);   // 16: two 16-token tiles per expert
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(32, 2, 8), 1);      // Mixtral, 8
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(48, 2, 8), 2);      // Mixtral, 12
  EXPECT_EQ(cuda::heuristics::decode_token_blocks(1024, 8, 256), 2);  // 32: the decode side of the threshold
}

TEST(PrefillCuda, TileHeuristicPicksRegisterWeights128From128PairsPerExpertOnSm90ElseWgmma64OrMma64) {
  // On sm_90a the register-weight kernel of 128 tokens from 128 pairs per touched expert (measured
  // 1.20-1.38x the wgmma tiles there), the wgmma tile of 64 below (bit-identical to the mma.sync
  // tile, asserted in MatchesHostReference); the mma.sync tile on every other device (host only).
  namespace hx = cuda::heuristics;
  static_assert(hx::kPrefillRs128MinPairs == 128);
  for (const bool sm90 : {false, true}) {
    const PrefillKernel small = sm90 ? PrefillKernel::Sm90Wgmma64 : PrefillKernel::Sm80Mma64;
    const PrefillKernel large = sm90 ? PrefillKernel::Sm90WgmmaRs128 : PrefillKernel::Sm80Mma64;
    EXPECT_EQ(hx::prefill_kernel(1024 * 8, 256, sm90), small);   // DeepSeek-V3, T = 1024: 32 pairs per expert
    EXPECT_EQ(hx::prefill_kernel(1024 * 8, 128, sm90), small);   // Qwen3, T = 1024: 64
    EXPECT_EQ(hx::prefill_kernel(4095 * 8, 256, sm90), small);   // 127.97
    EXPECT_EQ(hx::prefill_kernel(4096 * 8, 256, sm90), large);   // DeepSeek-V3, T = 4096: 128
    EXPECT_EQ(hx::prefill_kernel(4096 * 8, 128, sm90), large);   // Qwen3, T = 4096: 256
    EXPECT_EQ(hx::prefill_kernel(511 * 2, 8, sm90), small);      // Mixtral, T = 511: 127.75
    EXPECT_EQ(hx::prefill_kernel(512 * 2, 8, sm90), large);      // Mixtral, T = 512: 128
    EXPECT_EQ(hx::prefill_kernel(1024 * 2, 8, sm90), large);     // Mixtral, T = 1024: 256
    EXPECT_EQ(hx::prefill_kernel(16384 * 8, 256, sm90), large);  // DeepSeek-V3, T = 16384: 512
    EXPECT_EQ(hx::prefill_kernel(100, 1024, sm90), small);       // 100 pairs over 100 touched experts
    EXPECT_EQ(hx::prefill_kernel(128, 1, sm90), large);          // one expert
    EXPECT_EQ(hx::prefill_kernel(127, 1, sm90), small);
    // MoeOptions::prefill = RegisterWeights: the 64-token register-weight kernel below 128 pairs.
    EXPECT_EQ(hx::prefill_kernel(4095 * 8, 256, sm90, true), sm90 ? PrefillKernel::Sm90WgmmaRs64 : small);
    EXPECT_EQ(hx::prefill_kernel(4096 * 8, 256, sm90, true), large);
  }
  EXPECT_EQ(hx::prefill_tile_rows(PrefillKernel::Sm80Mma64), 64);
  EXPECT_EQ(hx::prefill_tile_rows(PrefillKernel::Sm90Wgmma64), 64);
  EXPECT_EQ(hx::prefill_tile_rows(PrefillKernel::Sm90WgmmaRs64), 64);
  EXPECT_EQ(hx::prefill_tile_rows(PrefillKernel::Sm90WgmmaRs128), 128);
  cuda::MoeOptions o;
  o.strategy = cuda::MoeStrategy::Prefill;
  EXPECT_EQ(hx::plan_moe(1024, 8, 256, 7168, true, o, {true, 132}).prefill, PrefillKernel::Sm90Wgmma64);
  EXPECT_EQ(hx::plan_moe(4096, 8, 256, 7168, true, o, {true, 132}).prefill, PrefillKernel::Sm90WgmmaRs128);
  EXPECT_EQ(hx::plan_moe(4096, 8, 256, 7168, true, o, {false, 108}).prefill, PrefillKernel::Sm80Mma64);
  o.prefill = cuda::MoePrefillKernel::RegisterWeights;
  EXPECT_EQ(hx::plan_moe(1024, 8, 256, 7168, true, o, {true, 132}).prefill, PrefillKernel::Sm90WgmmaRs64);
}

TEST(PrefillCuda, BadArgumentsThrowBeforeAnyLaunch) {
  // Argument checks run before any CUDA call: no device needed.
  cuda::DeviceMoeWeights w{4, 64, 60, {}, {}};
  EXPECT_THROW(cuda::moe_forward(w, nullptr, 1, 2, nullptr, nullptr, nullptr, nullptr, 0, nullptr, {cuda::MoeStrategy::Prefill}),
               std::invalid_argument);  // I % 8 != 0
  w.intermediate = 64;
  w.w13.shape = {4, 128, 64, true};
  w.w2.shape = {4, 64, 32, true};  // wrong K
  EXPECT_THROW(cuda::moe_forward(w, nullptr, 1, 2, nullptr, nullptr, nullptr, nullptr, 0, nullptr, {cuda::MoeStrategy::Prefill}),
               std::invalid_argument);
  w.w2.shape = {4, 64, 64, true};
  EXPECT_THROW(cuda::moe_forward(w, nullptr, 1, 2, nullptr, nullptr, nullptr, nullptr, 0, nullptr, {cuda::MoeStrategy::Prefill}),
               std::invalid_argument);  // null stacks
  alignas(16) static const std::uint8_t dummy[256] = {};
  w.w13.packed = w.w13.codebook = w.w13.scale = dummy;
  w.w2.packed = w.w2.codebook = w.w2.scale = dummy;
  w.w13.lane_major = true;  // w2 still in checkpoint order
  try {
    cuda::moe_forward(w, nullptr, 1, 2, nullptr, nullptr, nullptr, nullptr, 0, nullptr, {cuda::MoeStrategy::Prefill});
    ADD_FAILURE() << "checkpoint-order w2 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("to_lane_major"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lutb::test
