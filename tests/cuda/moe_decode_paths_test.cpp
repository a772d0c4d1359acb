// tests/cuda/moe_decode_paths_test.cpp: the choices of the swap-AB decode forward
// (src/cuda/heuristics/moe_heuristics.hpp): the direct (ungrouped) forward, the weighted top-k
// reduction fused into GEMM2 through thread-block clusters, GEMM1's split-K, the late tile scales,
// the one-token tail and the activation kernel. The rules are tested on the host (no GPU needed);
// each path, run through detail::moe_forward_plan with the choice forced on or off, is compared with
// the host reference of spec section 4 (tests/cuda/reference.hpp) on odd shapes, empty experts, one
// token, repeated experts, invalid ids and poisoned outputs, and the paths that promise it must equal
// each other bit for bit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "cuda/reference.hpp"
#include "cuda/moe_paths.hpp"
#include "lutb/cuda/moe.hpp"

namespace lutb::test {
namespace {

bool gpu_here() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void ckd(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

template <class T>
struct Buf {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Buf(std::size_t count) : n(count) { ckd(cudaMalloc(&p, std::max<std::size_t>(1, count) * sizeof(T)), "cudaMalloc"); }
  explicit Buf(const std::vector<T>& v) : Buf(v.size()) {
    ckd(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "H2D");
  }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  std::vector<T> down() const {
    std::vector<T> v(n);
    ckd(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "D2H");
    return v;
  }
};

struct Layer {
  std::int64_t E, H, I;
  HostLutb w13, w2;
  Buf<std::uint8_t> p13, c13, s13, p2, c2, s2;
  cuda::DeviceMoeWeights w;
  Layer(std::int64_t e, std::int64_t h, std::int64_t i, std::mt19937& rng)
      : E(e), H(h), I(i), w13(random_lutb({e, 2 * i, h, true}, rng)), w2(random_lutb({e, h, i, true}, rng)),
        p13(w13.packed), c13(w13.codebook), s13(w13.scale), p2(w2.packed), c2(w2.codebook), s2(w2.scale) {
    w = cuda::DeviceMoeWeights{E, H, I, {w13.shape, p13.p, c13.p, s13.p}, {w2.shape, p2.p, c2.p, s2.p}};
    cuda::to_lane_major(w.w13, nullptr);
    cuda::to_lane_major(w.w2, nullptr);
  }
};

namespace hx = cuda::heuristics;

// The swap-AB choices as flags (each test names the paths it compares): a flag forces a choice, a
// *Rule flag takes the heuristic's decision; kDecodePathsDefault is what moe_forward runs.
constexpr unsigned kDecodeDirect = 1u, kDecodeDirectAlways = 2u, kDecodeClusterReduce = 4u, kDecodeNoDirect1 = 8u,
                   kDecodeSplitK = 16u, kDecodeClusterReduceAlways = 32u, kDecodeLateScales = 64u,
                   kDecodeLateScalesRule = 256u, kDecodeOneTokenTail = 512u, kDecodeOneTokenTailRule = 2048u,
                   kDecodeActKernel = 4096u, kDecodeActKernelRule = 8192u;
constexpr unsigned kDecodePathsDefault = kDecodeDirect | kDecodeClusterReduce | kDecodeSplitK | kDecodeLateScalesRule |
                                         kDecodeOneTokenTailRule | kDecodeActKernelRule;
/// The sm_80 byte decoder on every device (else the device's decoder: cvt on sm_90a).
bool g_byte_decoder = false;

/// The plan of a Decode forward with `paths`; `split`: GEMM1 split across 2 cluster CTAs (sm_90a).
hx::MoePlan plan_of(const Layer& L, std::int64_t T, int k, unsigned paths, bool split) {
  hx::MoePlan p = default_plan(T, k, L.E, L.H, cuda::MoeStrategy::Decode);
  const hx::MoeDevice dev = cuda::detail::moe_device();
  if (g_byte_decoder) p.cvt_decoder = false;
  const std::int64_t P = T * k;
  const bool direct = T == 1 ? !(paths & kDecodeNoDirect1)
                             : (paths & kDecodeDirectAlways) || ((paths & kDecodeDirect) && hx::decode_direct(T, k, L.E));
  p.direct = direct && p.token_blocks == 1 && P <= 65535;
  const std::int64_t gemm2_ctas = ((L.H + 7) / 8 + 7) / 8 * P;
  p.fuse_reduce = (paths & kDecodeClusterReduceAlways) ||
                  ((paths & kDecodeClusterReduce) && hx::decode_fuse_reduce(gemm2_ctas, k, dev.sms));
  p.gemm1_ksplit = split ? 2 : (paths & kDecodeSplitK) ? 0 : 1;
  p.late_scales = (paths & kDecodeLateScales) || ((paths & kDecodeLateScalesRule) && hx::decode_late_scales(L.H, p.token_blocks));
  p.one_token_tail = (paths & kDecodeOneTokenTail) || ((paths & kDecodeOneTokenTailRule) && hx::decode_one_token_tail(T, k, L.E));
  p.act_kernel = (paths & kDecodeActKernel) || ((paths & kDecodeActKernelRule) && hx::decode_act_kernel(T, k, L.E, L.H));
  return p;
}

/// One forward with the given decode paths (Decode strategy), outputs poisoned with NaN first.
std::vector<std::uint16_t> forward(const Layer& L, const std::vector<std::uint16_t>& x, std::int64_t T, int k,
                                   const std::vector<std::int32_t>& ids, const std::vector<float>& wts, unsigned paths,
                                   const int* split = nullptr) {
  Buf<std::uint16_t> dx(x), out(static_cast<std::size_t>(T * L.H));
  Buf<std::int32_t> did(ids);
  Buf<float> dw(wts);
  const std::size_t wsb = cuda::moe_workspace_bytes(T, k, L.E, L.H, L.I);
  Buf<char> ws(wsb);
  ckd(cudaMemset(out.p, 0xff, T * L.H * 2), "poison out");
  ckd(cudaMemset(ws.p, 0xff, wsb), "poison workspace");
  cuda::detail::moe_forward_plan(L.w, dx.p, T, k, did.p, dw.p, out.p, ws.p, wsb, nullptr,
                                 plan_of(L, T, k, paths, split != nullptr));
  ckd(cudaDeviceSynchronize(), "moe_forward");
  return out.down();
}

std::vector<std::uint16_t> rand_x(std::int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<std::uint16_t> v(n);
  for (auto& e : v) e = bf16_from_float(d(rng));
  return v;
}

void routing(std::int64_t T, int k, const std::vector<int>& allowed, std::mt19937& rng, std::vector<std::int32_t>& ids,
             std::vector<float>& w) {
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

void expect_close(const std::vector<std::uint16_t>& got, const std::vector<std::uint16_t>& ref) {
  double num = 0, den = 0;
  std::int64_t nan = 0, exact = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float g = bf16_to_float(got[i]), r = bf16_to_float(ref[i]);
    if (std::isnan(g)) {
      ++nan;
      continue;
    }
    num += (double(g) - r) * (double(g) - r);
    den += double(r) * r;
    exact += got[i] == ref[i];
  }
  EXPECT_EQ(nan, 0) << "unwritten or NaN outputs";
  EXPECT_LT(std::sqrt(num / std::max(den, 1e-300)), 1e-3);
  EXPECT_GT(exact, static_cast<std::int64_t>(got.size()) * 8 / 10) << "bit-equal BF16 outputs (FP32 order only differs)";
}

// The rule: expected pairs per touched expert under uniform routing, T k / (E (1 - (1 - k/E)^T)),
// at most kDirectMaxPairsPerExpert (1.10). Values by hand: E = 128, k = 8: T = 2 -> 16 / 15.50 =
// 1.032, T = 4 -> 32 / 29.12 = 1.0988, T = 5 -> 40 / 35.30 = 1.133; E = 256, k = 8: T = 4 -> 1.048,
// T = 7 -> 56 / 51.02 = 1.0977, T = 8 -> 64 / 57.42 = 1.1146; E = 8, k = 2 (Mixtral): T = 2 -> 4 /
// 3.5 = 1.143. And at most kDirectMaxTokens (4) tokens: DeepSeek-V3 T = 5..7 (ratios 1.064-1.098)
// were even or 4-5 % slower direct (docs/design/cuda-moe.md#heuristics).
TEST(MoeDecodePaths, DirectRuleHostOnly) {
  EXPECT_EQ(hx::kDirectMaxPairsPerExpert, 1.10);
  EXPECT_EQ(hx::kDirectMaxTokens, 4);
  EXPECT_TRUE(hx::decode_direct(1, 8, 128));
  EXPECT_TRUE(hx::decode_direct(1, 2, 8));
  EXPECT_TRUE(hx::decode_direct(2, 8, 128));
  EXPECT_TRUE(hx::decode_direct(4, 8, 128));
  EXPECT_FALSE(hx::decode_direct(5, 8, 128));
  EXPECT_TRUE(hx::decode_direct(4, 8, 256));
  EXPECT_FALSE(hx::decode_direct(5, 8, 256)) << "ratio 1.064, measured even";
  EXPECT_FALSE(hx::decode_direct(6, 8, 256)) << "ratio 1.081, measured 3.7 % slower direct";
  EXPECT_FALSE(hx::decode_direct(7, 8, 256)) << "ratio 1.098, measured 4.9 % slower direct";
  EXPECT_FALSE(hx::decode_direct(8, 8, 256)) << "measured 8 % slower direct (docs/perf/moe-gpu.md)";
  EXPECT_TRUE(hx::decode_direct(4, 8, 384)) << "Kimi K2: ratio 1.031";
  EXPECT_FALSE(hx::decode_direct(5, 8, 384)) << "Kimi K2: ratio 1.039, but more than 4 tokens";
  EXPECT_FALSE(hx::decode_direct(16, 8, 256));
  EXPECT_FALSE(hx::decode_direct(2, 2, 8));
  EXPECT_FALSE(hx::decode_direct(64, 8, 128));
  EXPECT_FALSE(hx::decode_direct(2, 9, 8)) << "top_k > experts";
  EXPECT_FALSE(hx::decode_direct(0, 8, 128));
  // Monotone in T for a fixed shape: once grouped, larger batches stay grouped.
  for (std::int64_t E : {8, 64, 128, 256, 384})
    for (int k : {1, 2, 6, 8}) {
      bool seen_false = false;
      for (std::int64_t T = 1; T <= 64; ++T) {
        const bool d = hx::decode_direct(T, k, E);
        if (seen_false) {
          EXPECT_FALSE(d) << "E " << E << " k " << k << " T " << T;
        }
        seen_false = seen_false || !d;
      }
    }
}

// The fused-reduction rule: top_k <= 8 and GEMM2's grid at most 2 CTAs per SM. Benchmark shapes at
// T = 1 on 132 SMs (strip groups x pairs): Qwen3-30B 32 x 8 = 256 and Mixtral 64 x 2 = 128 fused;
// Qwen3-235B 64 x 8 = 512 and DeepSeek-V3 112 x 8 = 896 not; Qwen3-30B T = 4: 32 x 32 = 1024 not.
TEST(MoeDecodePaths, FuseReduceRuleHostOnly) {
  EXPECT_TRUE(hx::decode_fuse_reduce(256, 8, 132));
  EXPECT_TRUE(hx::decode_fuse_reduce(128, 2, 132));
  EXPECT_TRUE(hx::decode_fuse_reduce(264, 8, 132));
  EXPECT_FALSE(hx::decode_fuse_reduce(265, 8, 132));
  EXPECT_FALSE(hx::decode_fuse_reduce(512, 8, 132));
  EXPECT_FALSE(hx::decode_fuse_reduce(896, 8, 132));
  EXPECT_FALSE(hx::decode_fuse_reduce(1024, 8, 132));
  EXPECT_FALSE(hx::decode_fuse_reduce(64, 9, 132)) << "clusters of more than 8 CTAs are not portable";
}

// The split rule (decode_k_split): 2 CTAs of half the warps when warps >= 4, >= 4 K-tiles per warp,
// the split grid resident at once and ceil(2c / sms) < 2 ceil(c / sms). GEMM1 of the benchmark
// shapes at T = 1 on 132 SMs: Qwen3-30B 192 CTAs x 8 warps, 32 K-tiles (2 -> 3 half CTAs per SM:
// split); DeepSeek-V3 512 x 4, 112 (4 -> 8: not); Qwen3-235B 384 x 4, 64 (3 -> 6: not); Mixtral 896 x 2.
TEST(MoeDecodePaths, SplitRuleHostOnly) {
  auto eq = [](hx::DecodeSplit s, int ks, int w) { return s.ksplit == ks && s.warps == w; };
  EXPECT_TRUE(eq(hx::decode_k_split(192, 32, 8, 132), 2, 4));
  EXPECT_TRUE(eq(hx::decode_k_split(512, 112, 4, 132), 1, 4));
  EXPECT_TRUE(eq(hx::decode_k_split(384, 64, 4, 132), 1, 4));
  EXPECT_TRUE(eq(hx::decode_k_split(896, 64, 2, 132), 1, 2));
  EXPECT_TRUE(eq(hx::decode_k_split(100, 31, 8, 132), 1, 8)) << "fewer than 4 K-tiles per warp";
  EXPECT_TRUE(eq(hx::decode_k_split(64, 256, 16, 132), 2, 8)) << "half the SMs idle: split";
  EXPECT_TRUE(eq(hx::decode_k_split(128, 64, 16, 132), 1, 16)) << "128 -> 256 CTAs: 2 per SM, no gain";
  EXPECT_TRUE(eq(hx::decode_k_split(150, 64, 4, 132), 2, 2)) << "2 -> 3 half CTAs per SM";
  EXPECT_TRUE(eq(hx::decode_k_split(200, 64, 4, 132), 1, 4)) << "2 -> 4 half CTAs per SM: no gain";
  EXPECT_TRUE(eq(hx::decode_k_split(768, 32, 8, 132), 1, 8)) << "not resident at once";
  EXPECT_TRUE(eq(hx::decode_k_split(192, 32, 8, 0), 1, 8)) << "no SM count";
}

struct PathCase {
  std::int64_t E, H, I, T;
  int k;
  bool holes;  // odd experts empty
};

class MoeDecodePathsRandom : public ::testing::TestWithParam<PathCase> {};

// Every path set against the host reference; the fused reduction bit-identical to the separate one
// on the same (direct) GEMMs.
TEST_P(MoeDecodePathsRandom, MatchReferenceAndFusedReductionBitIdentical) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  const PathCase c = GetParam();
  std::mt19937 rng(4321 + static_cast<unsigned>(c.E * 5 + c.H + c.I + c.T));
  const Layer L(c.E, c.H, c.I, rng);
  const auto x = rand_x(c.T * c.H, rng);
  std::vector<int> allowed;
  for (int e = 0; e < c.E; ++e)
    if (!c.holes || e % 2 == 0) allowed.push_back(e);
  std::vector<std::int32_t> ids;
  std::vector<float> wts;
  routing(c.T, c.k, allowed, rng, ids, wts);
  const auto ref = moe_reference(L.w13, L.w2, c.H, c.I, x, c.T, c.k, ids, wts);
  const unsigned sets[] = {0u,
                           kDecodePathsDefault,
                           kDecodeDirectAlways | kDecodeClusterReduceAlways,
                           kDecodeDirectAlways,
                           kDecodeNoDirect1,
                           kDecodeDirectAlways | kDecodeClusterReduceAlways | kDecodeSplitK,
                           kDecodeDirect | kDecodeSplitK,
                           // the activation kernel
                           kDecodePathsDefault | kDecodeActKernel,
                           kDecodeDirectAlways | kDecodeClusterReduceAlways | kDecodeSplitK |
                               kDecodeActKernel,
                           kDecodePathsDefault & ~kDecodeActKernelRule};
  std::vector<std::vector<std::uint16_t>> got;
  for (unsigned p : sets) {
    SCOPED_TRACE(::testing::Message() << "paths " << p);
    got.push_back(forward(L, x, c.T, c.k, ids, wts, p));
    expect_close(got.back(), ref);
  }
  EXPECT_TRUE(got[2] == got[3]) << "fused top-k reduction differs from the separate kernel";
  EXPECT_TRUE(got[7] == got[9]) << "the activation kernel changed the default path's bits";
  EXPECT_TRUE(got[1] == got[9]) << "the activation kernel's rule changed the default path's bits";
  EXPECT_TRUE(got[8] == got[5]) << "the activation kernel changed the fused path's bits";
  // Split-K across cluster CTAs, forced (grouped and direct forwards): against the reference, and
  // deterministic (the same bits in a second run).
  const int splits[1][4] = {{2, 1, 0, 0}};
  for (const auto& sp : splits)
    for (unsigned p : {0u, kDecodePathsDefault, kDecodeDirectAlways | kDecodeClusterReduceAlways}) {
      SCOPED_TRACE(::testing::Message() << "split " << sp[0] << "/" << sp[1] << " paths " << p);
      const auto a = forward(L, x, c.T, c.k, ids, wts, p, sp);
      expect_close(a, ref);
      EXPECT_TRUE(a == forward(L, x, c.T, c.k, ids, wts, p, sp)) << "split-K not deterministic";
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, MoeDecodePathsRandom,
                         ::testing::Values(PathCase{128, 256, 64, 1, 8, false},   // one token, cluster of 8
                                           PathCase{128, 256, 64, 4, 8, false},   // direct by the rule
                                           PathCase{16, 200, 72, 5, 4, false},    // padded H and I, repeats
                                           PathCase{32, 320, 96, 7, 8, true},     // empty experts, odd K-tiles
                                           PathCase{8, 136, 64, 9, 1, false},     // k = 1 (cluster of 1), H % 64 != 0
                                           PathCase{8, 4096, 1024, 2, 2, false}), // Mixtral-like: few CTAs, long K
                         [](const ::testing::TestParamInfo<PathCase>& i) {
                           const PathCase& c = i.param;
                           // Appended to one string (a chain of + made GCC 12 print a -Wrestrict false positive).
                           std::string n = "E";
                           for (const auto& [tag, v] : {std::pair<const char*, int>{"", c.E}, {"_H", c.H}, {"_I", c.I},
                                                        {"_T", c.T}, {"_k", c.k}}) {
                             n += tag;
                             n += std::to_string(v);
                           }
                           if (c.holes) n += "_holes";
                           return n;
                         });

// The rule decode_late_scales (moe_heuristics.hpp): two token blocks, or H <= 2048 (kLateScalesMaxHidden).
// The benchmark shapes by hand: Qwen3-30B (H 2048) at every T, Mixtral T = 64 (two blocks) fire;
// Qwen3-235B, Mixtral (H 4096) and DeepSeek-V3 (H 7168) with one block do not.
TEST(MoeDecodePaths, LateScalesRuleHostOnly) {
  EXPECT_TRUE(hx::decode_late_scales(2048, 1)) << "Qwen3-30B";
  EXPECT_TRUE(hx::decode_late_scales(1, 1));
  EXPECT_TRUE(hx::decode_late_scales(4096, 2)) << "Mixtral T = 64: two token blocks";
  EXPECT_TRUE(hx::decode_late_scales(7168, 2));
  EXPECT_FALSE(hx::decode_late_scales(2049, 1));
  EXPECT_FALSE(hx::decode_late_scales(4096, 1)) << "Qwen3-235B, Mixtral T <= 16";
  EXPECT_FALSE(hx::decode_late_scales(7168, 1)) << "DeepSeek-V3";
  EXPECT_FALSE(hx::decode_late_scales(0, 1)) << "no hidden size";
  EXPECT_EQ(hx::kLateScalesMaxHidden, 2048);
}

// kDecodeLateScales: the swap-AB K-loop with the tile scales kept as raw bytes one K-tile ahead and
// converted / shuffled when used (cvt decoder only); kDecodeLateScalesRule: the loop where the rule
// above says so (on by default). Same values and FP32 operations in the same order, so the output
// must equal the other K-loop's BIT FOR BIT (and the
// host reference within the contract bound), on every path the flags reach: the direct forward
// (one-token K-loop, fused reduction), the grouped general K-loop, two token blocks (NB = 2), forced
// split-K; shapes with padded H and I (H % 64 != 0), empty experts, odd K-tile counts and long K
// ranges (the ring wraps); T = 1, 4, 16, 64; outputs and workspace poisoned before every forward
// (forward() above). Not in the filters of scripts/gpu_run.sh sanitize, which run the small
// MoeDecodePaths cases below. On devices where the Cvt decoder does not run (below sm_90) the flags
// change nothing and the equalities hold trivially.
TEST(MoeDecodePaths, LateScalesBitIdenticalToDefault) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  const PathCase cases[] = {
      {128, 256, 64, 1, 8, false},   // T = 1: direct, one-token loop, fused reduction (cluster of 8)
      {128, 320, 96, 4, 8, false},   // T = 4: direct by the rule
      {16, 200, 72, 16, 4, false},   // T = 16: grouped, general loop, padded H and I
      {32, 320, 96, 16, 8, true},    // empty experts, odd K-tiles (5 in GEMM1)
      {8, 136, 64, 64, 2, false},    // T = 64, 16 pairs per expert: two token blocks (NB = 2)
      {8, 4096, 1024, 4, 2, false},  // long K (64 / 16 K-tiles per expert row): the ring wraps
      {8, 1024, 512, 64, 2, true},   // NB = 2 with long-ish K, empty experts
  };
  for (const PathCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "E " << c.E << " H " << c.H << " I " << c.I << " T " << c.T << " k " << c.k);
    std::mt19937 rng(977 + static_cast<unsigned>(c.E * 7 + c.H + 3 * c.I + c.T));
    const Layer L(c.E, c.H, c.I, rng);
    const auto x = rand_x(c.T * c.H, rng);
    std::vector<int> allowed;
    for (int e = 0; e < c.E; ++e)
      if (!c.holes || e % 2 == 0) allowed.push_back(e);
    std::vector<std::int32_t> ids;
    std::vector<float> wts;
    routing(c.T, c.k, allowed, rng, ids, wts);
    const auto ref = moe_reference(L.w13, L.w2, c.H, c.I, x, c.T, c.k, ids, wts);
    const int split[4] = {2, 1, 2, 1};
    constexpr unsigned kLate = kDecodeLateScales | kDecodeLateScalesRule;
    for (unsigned p : {kDecodePathsDefault, 0u, kDecodeDirectAlways | kDecodeClusterReduceAlways})
      for (const int* sp : {static_cast<const int*>(nullptr), static_cast<const int*>(split)}) {
        const unsigned q = p & ~kLate;  // the K-loop without late scales, whatever the default
        const auto base = forward(L, x, c.T, c.k, ids, wts, q, sp);
        expect_close(base, ref);
        for (unsigned f : {kDecodeLateScales, kDecodeLateScalesRule}) {
          SCOPED_TRACE(::testing::Message() << "paths " << q << " + " << f << (sp ? " split" : ""));
          const auto late = forward(L, x, c.T, c.k, ids, wts, q | f, sp);
          expect_close(late, ref);
          EXPECT_TRUE(late == base) << "late tile scales changed the output bits";
        }
      }
  }
}

// An out-of-range expert id in the fused reduction: the NaN row for that token only, wherever the id
// sits among the token's k pairs (rank 0 of the cluster, which writes the rows, or another rank).
TEST(MoeDecodePaths, FusedReductionInvalidIdGivesNanRowOnly) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  std::mt19937 rng(99);
  const std::int64_t E = 8, H = 200, I = 64, T = 3;
  const int k = 3;
  const Layer L(E, H, I, rng);
  const auto x = rand_x(T * H, rng);
  const std::vector<float> wts = {0.5f, 0.3f, 0.2f, 0.4f, 0.4f, 0.2f, 0.1f, 0.6f, 0.3f};
  for (int bad = 0; bad < k; ++bad) {
    std::vector<std::int32_t> ids = {1, 4, 6, 0, 2, 7, 5, 3, 1};
    ids[1 * k + bad] = bad == 1 ? -3 : 8;  // token 1
    std::vector<std::int32_t> ok_ids = ids;
    ok_ids[1 * k + bad] = 0;
    const auto ref = moe_reference(L.w13, L.w2, H, I, x, T, k, ok_ids, wts);
    for (unsigned p : {kDecodeDirectAlways | kDecodeClusterReduceAlways, kDecodeDirectAlways}) {
      SCOPED_TRACE(::testing::Message() << "bad position " << bad << " paths " << p);
      const auto got = forward(L, x, T, k, ids, wts, p);
      for (std::int64_t c = 0; c < H; ++c) {
        EXPECT_TRUE(std::isnan(bf16_to_float(got[1 * H + c]))) << c;
        for (std::int64_t t : {0, 2}) {
          const float g = bf16_to_float(got[t * H + c]), r = bf16_to_float(ref[t * H + c]);
          EXPECT_FALSE(std::isnan(g)) << t << "," << c;
          EXPECT_NEAR(g, r, 1e-2f * std::fabs(r) + 1e-3f) << t << "," << c;
        }
      }
    }
  }
}

// Three fused forwards queued back to back on one stream and workspace with programmatic dependent
// launch, against the same forwards run alone without it: bit-identical (the cluster GEMM2 is the
// forward's last kernel and the next forward's first kernel is a normal launch).
TEST(MoeDecodePaths, FusedBackToBackBitIdentical) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  std::mt19937 rng(7);
  const std::int64_t E = 64, H = 512, I = 256, T = 2;
  const int k = 8;
  const Layer L(E, H, I, rng);
  std::vector<int> allowed(E);
  for (int e = 0; e < E; ++e) allowed[e] = e;
  std::deque<Buf<std::uint16_t>> xs, outs;
  std::deque<Buf<std::int32_t>> ids;
  std::deque<Buf<float>> wts;
  for (int r = 0; r < 3; ++r) {
    std::vector<std::int32_t> id;
    std::vector<float> wt;
    routing(T, k, allowed, rng, id, wt);
    xs.emplace_back(rand_x(T * H, rng));
    ids.emplace_back(id);
    wts.emplace_back(wt);
    outs.emplace_back(static_cast<std::size_t>(T * H));
  }
  const std::size_t wsb = cuda::moe_workspace_bytes(T, k, E, H, I);
  Buf<char> ws(wsb);
  cudaStream_t st;
  ckd(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  const hx::MoePlan plan = plan_of(L, T, k, kDecodeDirectAlways | kDecodeClusterReduceAlways, false);
  std::vector<std::vector<std::uint16_t>> alone;
  for (int r = 0; r < 3; ++r) {
    ckd(cudaMemset(outs[r].p, 0xff, T * H * 2), "poison");
    cuda::detail::moe_forward_plan(L.w, xs[r].p, T, k, ids[r].p, wts[r].p, outs[r].p, ws.p, wsb, st, plan);
    ckd(cudaStreamSynchronize(st), "alone");
    alone.push_back(outs[r].down());
  }
  for (int r = 0; r < 3; ++r) ckd(cudaMemset(outs[r].p, 0xff, T * H * 2), "poison");
  ckd(cudaDeviceSynchronize(), "poison");
  for (int r = 0; r < 3; ++r)
    cuda::detail::moe_forward_plan(L.w, xs[r].p, T, k, ids[r].p, wts[r].p, outs[r].p, ws.p, wsb, st, plan);
  ckd(cudaStreamSynchronize(st), "back to back");
  for (int r = 0; r < 3; ++r) {
    const auto got = outs[r].down();
    EXPECT_TRUE(got == alone[r]) << "forward " << r;
    int nan = 0;
    for (std::uint16_t v : got) nan += (v & 0x7fff) > 0x7f80;
    EXPECT_EQ(nan, 0) << "forward " << r;
  }
  ckd(cudaStreamDestroy(st), "stream");
}

// decode_swap_warps: the warps rule, and its one-wave condition.
// resident = CTAs of 1, 2, 4, 8, 16 warps per SM of a 128-register one-token-block kernel (16 warps).
// By hand (132 SMs): Qwen3-235B T = 1 GEMM1, 384 CTAs x 64 K-tiles: 2 -> 4 (768, 1536 < 1584 warps)
// -> 8 by the old rule (1536 < 1584), but 384 CTAs fit 132 x 4 = 528 at 4 warps and not 132 x 2 =
// 264 at 8: stays 4 with the condition. Qwen3-30B T = 4 GEMM1, 768 CTAs x 32: 4 by the old rule;
// 768 <= 132 x 8 = 1056 at 2 warps, > 528 at 4: 2. Unchanged: Qwen3-30B T = 1 GEMM1 (192 CTAs, 8
// warps, 192 <= 264), DeepSeek-V3 T = 1 GEMM1 (512 x 112: 4 by the warps-per-SM cap, 512 <= 528),
// two waves already at 2 warps (1536 CTAs), Mixtral T = 1 GEMM2 (128 CTAs x 224: 16 warps, 128 <=
// 132), K ranges under 4 K-tiles (1 warp), the K-tile condition (doubling w while tiles_k >= 4 w).
TEST(MoeDecodePaths, SwapWarpsRuleHostOnly) {
  const int res[5] = {16, 8, 4, 2, 1};
  EXPECT_EQ(hx::decode_swap_warps(384, 64, 16, 132, res, false), 8);
  EXPECT_EQ(hx::decode_swap_warps(384, 64, 16, 132, res, true), 4) << "Qwen3-235B T = 1 GEMM1";
  EXPECT_EQ(hx::decode_swap_warps(768, 32, 16, 132, res, false), 4);
  EXPECT_EQ(hx::decode_swap_warps(768, 32, 16, 132, res, true), 2) << "Qwen3-30B T = 4 GEMM1";
  for (bool ow : {false, true}) {
    EXPECT_EQ(hx::decode_swap_warps(192, 32, 16, 132, res, ow), 8) << "Qwen3-30B T = 1 GEMM1";
    EXPECT_EQ(hx::decode_swap_warps(512, 112, 16, 132, res, ow), 4) << "DeepSeek-V3 T = 1 GEMM1";
    EXPECT_EQ(hx::decode_swap_warps(1536, 64, 16, 132, res, ow), 2) << "two waves at 2 warps already";
    EXPECT_EQ(hx::decode_swap_warps(128, 224, 16, 132, res, ow), 16) << "Mixtral T = 1 GEMM2";
    EXPECT_EQ(hx::decode_swap_warps(128, 224, 8, 132, res, ow), 8) << "two token blocks: at most 8";
    EXPECT_EQ(hx::decode_swap_warps(100, 3, 16, 132, res, ow), 1) << "fewer than 4 K-tiles";
    EXPECT_EQ(hx::decode_swap_warps(100, 12, 16, 132, res, ow), 4) << "doubled while K-tiles >= 4 x warps";
    EXPECT_EQ(hx::decode_swap_warps(100, 7, 16, 132, res, ow), 2) << "7 < 4 x 2: no doubling";
  }
  const int res_none[5] = {0, 0, 0, 0, 0};  // no residency known: the condition never fires
  EXPECT_EQ(hx::decode_swap_warps(384, 64, 16, 132, res_none, true), 8);
}

// decode_one_token_tail: expected pairs per touched expert T k / (E (1 - (1 - k/E)^T))
// <= 2. By hand: Mixtral (E = 8, k = 2) T = 4: 8 / (8 (1 - 0.75^4)) = 1.46, T = 16: 32 / 7.92 = 4.04;
// Qwen3 (128, 8) T = 16: 128 / (128 (1 - (15/16)^16)) = 1.55, T = 64: 4.07; DeepSeek-V3 (256, 8)
// T = 16: 1.26, T = 64: 2.30; T = 1 always; k > E (repeated experts) counts every expert touched.
TEST(MoeDecodePaths, OneTokenTailRuleHostOnly) {
  EXPECT_EQ(hx::kOneTokenTailMaxPairsPerExpert, 2.0);
  EXPECT_TRUE(hx::decode_one_token_tail(1, 8, 128));
  EXPECT_TRUE(hx::decode_one_token_tail(1, 4, 2)) << "T = 1 with k > E";
  EXPECT_TRUE(hx::decode_one_token_tail(4, 2, 8)) << "Mixtral T = 4";
  EXPECT_FALSE(hx::decode_one_token_tail(16, 2, 8)) << "Mixtral T = 16";
  EXPECT_TRUE(hx::decode_one_token_tail(16, 8, 128)) << "Qwen3 T = 16";
  EXPECT_FALSE(hx::decode_one_token_tail(64, 8, 128)) << "Qwen3 T = 64";
  EXPECT_TRUE(hx::decode_one_token_tail(16, 8, 256)) << "DeepSeek-V3 T = 16";
  EXPECT_FALSE(hx::decode_one_token_tail(64, 8, 256)) << "DeepSeek-V3 T = 64";
  EXPECT_FALSE(hx::decode_one_token_tail(3, 4, 2)) << "k > E, T > 1: 6 pairs per expert";
  EXPECT_FALSE(hx::decode_one_token_tail(0, 8, 128));
  EXPECT_FALSE(hx::decode_one_token_tail(4, 0, 128));
}

// kDecodeOneTokenTail: one-token tiles exchange, combine and finish only the
// accumulator column that holds the token; nothing else changes, so the output must equal the same
// forward without the flag BIT FOR BIT (and the host reference within the contract bound), on every
// path with one-token tiles: direct forwards (T = 1; T = 4 by the rule; with and without the fused
// reduction), grouped tiles of one pair (the holes / E = 128 cases), forced split-K (the cluster
// combine), the cvt and byte decoders' epilogues, padded H and I, outputs and workspace poisoned
// before every forward. kDecodeOneWave: on the last shape (E = 8, H = 2048, I = 1536, T = 1, k = 8:
// GEMM1 is 8 x 48 = 384 CTAs of 32 K-tiles, 4 warps instead of 8 on an H200) the warps change, so only
// the summation order may: against the reference. On devices without the sm_90a kernels the flags
// change nothing and the equalities hold trivially.
TEST(MoeDecodePaths, OneTokenTailBitIdenticalOneWaveMatchesReference) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  const PathCase cases[] = {
      {128, 256, 64, 1, 8, false},   // T = 1: direct, fused reduction
      {128, 320, 96, 4, 8, false},   // T = 4: direct by the rule
      {32, 320, 96, 16, 8, true},    // grouped; some tiles of one pair; odd K-tiles
      {16, 200, 72, 16, 4, false},   // padded H and I
      {8, 4096, 1024, 4, 2, false},  // long K: the ring wraps; grouped one-pair tiles
      {8, 2048, 1536, 1, 8, false},  // the one-wave condition fires on GEMM1 (H200)
  };
  const bool decs[] = {false, true};  // the device's decoder, the byte decoder
  for (const PathCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "E " << c.E << " H " << c.H << " I " << c.I << " T " << c.T << " k " << c.k);
    std::mt19937 rng(1717 + static_cast<unsigned>(c.E * 7 + c.H + 3 * c.I + c.T));
    const Layer L(c.E, c.H, c.I, rng);
    const auto x = rand_x(c.T * c.H, rng);
    std::vector<int> allowed;
    for (int e = 0; e < c.E; ++e)
      if (!c.holes || e % 2 == 0) allowed.push_back(e);
    std::vector<std::int32_t> ids;
    std::vector<float> wts;
    routing(c.T, c.k, allowed, rng, ids, wts);
    const auto ref = moe_reference(L.w13, L.w2, c.H, c.I, x, c.T, c.k, ids, wts);
    const int split[4] = {2, 1, 2, 1};
    constexpr unsigned kTail = kDecodeOneTokenTail | kDecodeOneTokenTailRule;
    for (const bool d : decs) {
      g_byte_decoder = d;
      for (unsigned p : {kDecodePathsDefault, 0u,
                         kDecodeDirectAlways | kDecodeClusterReduceAlways})
        for (const int* sp : {static_cast<const int*>(nullptr), static_cast<const int*>(split)}) {
          SCOPED_TRACE(::testing::Message() << (d ? "byte decoder" : "device decoder") << " paths " << p << (sp ? " split" : ""));
          const auto base = forward(L, x, c.T, c.k, ids, wts, p & ~kTail, sp);
          expect_close(base, ref);
          const auto tail = forward(L, x, c.T, c.k, ids, wts, p | kDecodeOneTokenTail, sp);
          EXPECT_TRUE(tail == base) << "the one-token tail changed the output bits";
        }
    }
    g_byte_decoder = false;
    expect_close(forward(L, x, c.T, c.k, ids, wts, kDecodePathsDefault), ref);
  }
}

}  // namespace
}  // namespace lutb::test

namespace lutb::test {
namespace {

// kDecodeActKernel: GEMM1's SiLU*up / MXFP8-of-h epilogue and its split-K
// combine in a separate activation kernel. Its outputs must equal the default path's bit for bit
// (the same FP32 / BF16 / E4M3 operations in the same order, the split ranks' sums added in rank
// order), for every weight decoder of the mma.sync kernels, with and without the direct forward, the
// fused top-k reduction and GEMM1's split (by rule and forced), at T = 1..4.
// `quick` (the compute-sanitizer case): the default decoder and the default paths only,
// unsplit and forced split.
void expect_act_bit_identical(const PathCase& c, unsigned seed, std::initializer_list<std::int64_t> Ts,
                              bool invalid_ids = false, bool quick = false) {
  std::mt19937 rng(seed + static_cast<unsigned>(c.E * 7 + c.H + 3 * c.I));
  const Layer L(c.E, c.H, c.I, rng);
  std::vector<int> allowed;
  for (int e = 0; e < c.E; ++e)
    if (!c.holes || e % 2 == 0) allowed.push_back(e);
  const bool decs[] = {false, true};  // the device's decoder, the byte decoder
  const int split[4] = {2, 1, 2, 1};
  for (std::int64_t T : Ts) {
    const auto x = rand_x(T * c.H, rng);
    std::vector<std::int32_t> ids;
    std::vector<float> wts;
    routing(T, c.k, allowed, rng, ids, wts);
    if (invalid_ids) {  // an id below and one above the range: their tokens' rows are NaN in both paths
      ids[0] = -1;
      if (T > 1) ids[ids.size() - 1] = static_cast<std::int32_t>(c.E + 3);
    }
    for (const bool d : decs) {
      if (quick && d) continue;
      g_byte_decoder = d;
      for (unsigned p : {kDecodePathsDefault, kDecodePathsDefault & ~kDecodeSplitK, 0u,
                         kDecodeDirectAlways | kDecodeClusterReduceAlways | kDecodeSplitK})
        for (const int* sp : {static_cast<const int*>(nullptr), static_cast<const int*>(split)}) {
          if (quick && p != kDecodePathsDefault) continue;
          SCOPED_TRACE(::testing::Message() << "E " << c.E << " H " << c.H << " I " << c.I << " T " << T << " k "
                                            << c.k << (d ? " byte decoder" : "") << " paths " << p
                                            << (sp ? " split" : ""));
          constexpr unsigned kAct = kDecodeActKernel | kDecodeActKernelRule;
          const auto base = forward(L, x, T, c.k, ids, wts, p & ~kAct, sp);
          const auto act = forward(L, x, T, c.k, ids, wts, (p & ~kAct) | kDecodeActKernel, sp);
          EXPECT_TRUE(act == base) << "the activation kernel changed the output bits";
          if (p & kDecodeActKernelRule) {
            EXPECT_TRUE(forward(L, x, T, c.k, ids, wts, p, sp) == base) << "the rule changed the output bits";
          }
          if (!invalid_ids) {
            std::int64_t nan = 0;
            for (std::uint16_t v : act) nan += std::isnan(bf16_to_float(v));
            EXPECT_EQ(nan, 0) << "unwritten (poisoned) outputs";
          }
        }
    }
    g_byte_decoder = false;
  }
}

// The rule decode_act_kernel (moe_heuristics.hpp): T > 1, expected pairs per touched expert above 1.5 and at
// most 64 K-tiles in GEMM1 (hidden <= 4096). By hand (E (1 - (1 - k/E)^T) touched):
// DeepSeek-V3 (E 256, k 8) T = 8 -> 64 / 57.42 = 1.115, T = 12 -> 96 / 81.10 = 1.184, T = 16 ->
// 128 / 101.96 = 1.255, T = 32 -> 256 / 163.3 = 1.57; Qwen3 (E 128, k 8) T = 4 -> 32 / 29.12 =
// 1.099, T = 6 -> 48 / 41.10 = 1.168, T = 8 -> 64 / 51.62 = 1.240, T = 16 -> 1.553, T = 128 -> 1024 /
// 127.9 = 8.0; Mixtral (E 8, k 2) T = 2 -> 4 / 3.5 = 1.143, T = 4 -> 8 / 5.47 = 1.463; E 4, k 8,
// T = 2: every expert, 16 / 4 = 4.
TEST(MoeDecodePaths, ActKernelRuleHostOnly) {
  EXPECT_EQ(hx::kActMinPairsPerExpert, 1.5);
  EXPECT_EQ(hx::kActMaxTilesK, 64);
  const std::int64_t ds = 7168, q235 = 4096, q30 = 2048, mx = 4096;  // the shapes' hidden sizes
  EXPECT_FALSE(hx::decode_act_kernel(1, 8, 256, ds)) << "T = 1: never (0.95-0.98x measured)";
  EXPECT_FALSE(hx::decode_act_kernel(1, 2, 8, mx));
  EXPECT_FALSE(hx::decode_act_kernel(1, 8, 4, 256)) << "T = 1 even with k > E (direct one-token tiles)";
  EXPECT_FALSE(hx::decode_act_kernel(8, 8, 256, ds)) << "DeepSeek-V3 T = 8: 1.115";
  EXPECT_FALSE(hx::decode_act_kernel(12, 8, 256, ds));
  EXPECT_FALSE(hx::decode_act_kernel(16, 8, 256, ds)) << "DeepSeek-V3 T = 16: 1.255 (1.003-1.008x measured)";
  EXPECT_FALSE(hx::decode_act_kernel(32, 8, 256, ds)) << "DeepSeek-V3 T = 32: 1.57 but 112 K-tiles (0.960x / 1.056x measured)";
  EXPECT_FALSE(hx::decode_act_kernel(64, 8, 256, ds)) << "DeepSeek-V3 T = 64: 112 K-tiles (1.004x / 1.013x)";
  EXPECT_TRUE(hx::decode_act_kernel(32, 8, 256, 4096)) << "1.57 pairs per expert at 64 K-tiles";
  EXPECT_TRUE(hx::decode_act_kernel(32, 8, 256, 4096 - 63)) << "ceil(4033 / 64) = 64 K-tiles";
  EXPECT_FALSE(hx::decode_act_kernel(32, 8, 256, 4097)) << "65 K-tiles";
  EXPECT_FALSE(hx::decode_act_kernel(4, 8, 128, q30)) << "Qwen3 T = 4: 1.099 (0.93-0.98x measured)";
  EXPECT_FALSE(hx::decode_act_kernel(6, 8, 128, q30));
  EXPECT_FALSE(hx::decode_act_kernel(8, 8, 128, q235)) << "Qwen3 T = 8: 1.240 (1.003-1.018x)";
  EXPECT_TRUE(hx::decode_act_kernel(16, 8, 128, q235)) << "Qwen3 T = 16: 1.553 (1.025-1.05x)";
  EXPECT_TRUE(hx::decode_act_kernel(64, 8, 128, q235)) << "Qwen3-235B T = 64: 512 pairs (1.007x / 1.011x)";
  EXPECT_TRUE(hx::decode_act_kernel(128, 8, 128, q30)) << "Qwen3-30B T = 128: 1024 pairs (1.036x / 1.035x)";
  EXPECT_FALSE(hx::decode_act_kernel(2, 2, 8, mx)) << "Mixtral T = 2: 1.143";
  EXPECT_FALSE(hx::decode_act_kernel(4, 2, 8, mx)) << "Mixtral T = 4: 1.463 (0.983-0.987x measured)";
  EXPECT_TRUE(hx::decode_act_kernel(8, 2, 8, mx)) << "Mixtral T = 8: 2.22";
  EXPECT_TRUE(hx::decode_act_kernel(64, 2, 8, mx)) << "Mixtral T = 64: 16 (two token blocks, 1.056x)";
  EXPECT_TRUE(hx::decode_act_kernel(2, 8, 4, 256));
  EXPECT_FALSE(hx::decode_act_kernel(0, 8, 128, q30));
  EXPECT_FALSE(hx::decode_act_kernel(4, 0, 128, q30));
  EXPECT_FALSE(hx::decode_act_kernel(4, 8, 0, q30));
  EXPECT_FALSE(hx::decode_act_kernel(16, 8, 128, 0));
  EXPECT_TRUE((kDecodePathsDefault & kDecodeActKernelRule) != 0);
  EXPECT_EQ(kDecodePathsDefault & kDecodeActKernel, 0u);
}

// The workspace rows of GEMM1's sums (act_rows): min(P x kActMaxSplit,
// kActMaxRows = 1024, ceil(36 E)). By hand: DeepSeek-V3 (E 256) T = 16, k = 8: 2 x 128 = 256; T = 64:
// 2 x 512 = 1024; T = 128: 1024 (the limit; 1024 pairs unsplit); Mixtral (E 8, k 2) T = 64: 2 x 128 =
// 256; T = 100: 36 x 8 = 288 (Auto leaves swap-AB decode at 28-36 pairs per expert). That the region
// is the workspace's last, of act_rows x 2 Ip FP32.
TEST(MoeDecodePaths, ActRowsHostOnly) {
  EXPECT_EQ(hx::kActMaxRows, 1024);
  EXPECT_EQ(hx::kActMaxSplit, 2);
  EXPECT_EQ(hx::act_rows(128, 256), 256);
  EXPECT_EQ(hx::act_rows(512, 256), 1024);
  EXPECT_EQ(hx::act_rows(1024, 256), 1024);
  EXPECT_EQ(hx::act_rows(9000, 256), 1024);
  EXPECT_EQ(hx::act_rows(128, 8), 256);
  EXPECT_EQ(hx::act_rows(200, 8), 288);
  EXPECT_EQ(hx::act_rows(1, 1), 2);
  EXPECT_EQ(hx::act_rows(100, 1), 36);
  EXPECT_EQ(hx::act_rows(0, 8), 0);
  EXPECT_EQ(hx::act_rows(8, 0), 0);
}

// Small and odd shapes (also run under compute-sanitizer memcheck by scripts/gpu_run.sh sanitize).
TEST(MoeDecodePaths, ActKernelBitIdenticalToDefault) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  expect_act_bit_identical({128, 256, 64, 0, 8, false}, 1801, {1, 2, 3, 4});  // direct, fused, clusters of 8
  expect_act_bit_identical({16, 200, 72, 0, 4, false}, 1802, {1, 3, 4});      // padded H and I (Ip 128 > I 72)
  expect_act_bit_identical({32, 320, 96, 0, 8, true}, 1803, {1, 2, 4});       // empty experts, odd K-tiles
  expect_act_bit_identical({8, 136, 64, 0, 1, false}, 1804, {1, 4});          // k = 1, H % 64 != 0
  expect_act_bit_identical({16, 256, 64, 0, 4, false}, 1805, {1, 3}, true);   // invalid expert ids: NaN rows
  // T = 16 (the rule fires: 4 pairs per expert) and T = 64 with 16 and 32 pairs per expert (two
  // token blocks, NB = 2). Above 128 pairs: the next test.
  expect_act_bit_identical({8, 136, 64, 0, 2, false}, 1806, {16, 64});
  expect_act_bit_identical({8, 1024, 512, 0, 2, true}, 1807, {64});
}

// Above 128 pairs (within act_rows), at top-8 on
// reduced shapes, forced Decode strategy, outputs and workspace poisoned. Token blocks
// (decode_token_blocks: 1 up to 10 tokens per touched expert) and the workspace rows act_rows(P, E)
// = min(2P, 1024, 36 E) of each case, against P x GEMM1's split (unsplit here by the rule: few
// K-tiles; the forced split {2, 1, 2, 1} of expect_act_bit_identical makes it 2):
//   E 32, T 20: P 160, NB 1, rows 320: the kernel runs unsplit and split (2 x 160 = 320);
//   E 32, T 64: P 512, NB 2, rows 1024: unsplit and split (2 x 512 = 1024, the workspace's limit);
//   E 8, T 20 (k = E: every expert): P 160, NB 2, rows 288: unsplit; split (320 > 288) falls back to
//     GEMM1's own tail, which must give the same bits too; H % 64 != 0;
//   E 16, T 20, odd experts empty, padded I (Ip 128 > I 72): P 160, NB 1, rows 320.
TEST(MoeDecodePaths, ActKernelBitIdenticalToDefaultAbove128Pairs) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  expect_act_bit_identical({32, 256, 64, 0, 8, false}, 1901, {20, 64});
  expect_act_bit_identical({8, 136, 64, 0, 8, false}, 1902, {20});
  expect_act_bit_identical({16, 200, 72, 0, 8, true}, 1903, {20});
}

// One case above 128 pairs for compute-sanitizer memcheck / racecheck (the whole test above is too
// slow for the filters of scripts/gpu_run.sh sanitize): E 32, T 20, k 8 (160 pairs, the rule on:
// 5 pairs per expert), the default paths unsplit and with GEMM1 split in two.
TEST(MoeDecodePaths, ActKernelAbove128PairsSanitizerCase) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  ASSERT_TRUE(hx::decode_act_kernel(20, 8, 32, 256));
  expect_act_bit_identical({32, 256, 64, 0, 8, false}, 1904, {20}, false, /*quick=*/true);
}

// The four benchmark shapes at their real H and I (DeepSeek-V3, Qwen3-235B, Qwen3-30B; Mixtral with
// I reduced to 1792), fewer experts: the real K-loop lengths, warp counts and GEMM1 split (Qwen3-30B
// at T = 1 splits by the rule: 8 x 24 CTAs of 8 warps), one-token and multi-token tiles.
TEST(MoeActKernel, IssueShapesBitIdenticalToDefault) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  expect_act_bit_identical({16, 2048, 768, 0, 8, false}, 1811, {1, 2, 3, 4});   // Qwen3-30B-A3B
  expect_act_bit_identical({16, 4096, 1536, 0, 8, false}, 1812, {1, 2, 3, 4});  // Qwen3-235B-A22B
  expect_act_bit_identical({8, 7168, 2048, 0, 8, false}, 1813, {1, 2, 3, 4});   // DeepSeek-V3
  expect_act_bit_identical({8, 4096, 1792, 0, 2, false}, 1814, {1, 2, 3, 4});   // Mixtral-8x7B, I / 8
}

// The option really moves the epilogue: after the forward, the workspace's GEMM1-sum rows of every
// pair are written (finite FP32 values) with kDecodeActKernel, and with the default paths where
// decode_act_kernel says so, and left as poisoned (all bytes 0xff) otherwise; where P x GEMM1's
// split exceeds the workspace's rows (act_rows) the option is ignored: T = 64, 128 (512 and 1024
// pairs: the kernel runs; 1024 = kActMaxRows), 129 (1032 pairs > 1024 rows: not) and the forced split
// (mode 3: two ranks per pair, so T = 64 fills the 1024 rows and T = 128 does not fit).
TEST(MoeDecodePaths, ActKernelWritesGemm1SumsOnlyWhenSelected) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device: skipping GPU test";
  std::mt19937 rng(1820);
  const std::int64_t E = 128, H = 256, I = 64, Ip = 64;
  const int k = 8;
  const Layer L(E, H, I, rng);
  // The forced split needs cluster launches (sm_90a image, cc 9.x): mode 3 is skipped elsewhere.
  int dev = 0, major = 0;
  ckd(cudaGetDevice(&dev), "cudaGetDevice");
  ckd(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), "cc");
  const bool split_here = major == 9;
  EXPECT_EQ(hx::kActMaxRows, 1024);
  EXPECT_EQ(hx::act_rows(1032, E), 1024);
  EXPECT_EQ(hx::act_rows(136, E), 272);
  for (std::int64_t T : {1, 4, 8, 16, 17, 64, 128, 129}) {
    std::vector<int> allowed(E);
    for (int e = 0; e < E; ++e) allowed[e] = e;
    std::vector<std::int32_t> ids;
    std::vector<float> wts;
    routing(T, k, allowed, rng, ids, wts);
    const auto x = rand_x(T * H, rng);
    const std::int64_t P = T * k;
    const std::size_t wsb = cuda::moe_workspace_bytes(T, k, E, H, I);
    // The sums are the last region of the workspace (lutb_moe_steps.cu carve): act_rows(P, E) rows of
    // 2 Ip FP32 (one per pair and split rank), 256-byte aligned.
    const std::int64_t rows = hx::act_rows(P, E);
    EXPECT_EQ(rows, std::min<std::int64_t>(2 * P, 1024));  // 36 E = 4608 does not bind here
    const std::size_t part_floats = static_cast<std::size_t>(rows) * 2 * Ip;
    const std::size_t part_bytes = part_floats * sizeof(float);
    ASSERT_GE(wsb, part_bytes);
    const std::size_t part_at = wsb - ((part_bytes + 255) / 256 * 256);
    // Without the kernel, forced, the default (its rule), forced with GEMM1 split in two.
    for (int mode = 0; mode < (split_here ? 4 : 3); ++mode) {
      SCOPED_TRACE(::testing::Message() << "T " << T << " mode " << mode);
      Buf<std::uint16_t> dx(x), out(static_cast<std::size_t>(T * H));
      Buf<std::int32_t> did(ids);
      Buf<float> dw(wts);
      Buf<char> ws(wsb);
      ckd(cudaMemset(ws.p, 0xff, wsb), "poison workspace");
      const unsigned paths[4] = {kDecodePathsDefault & ~kDecodeActKernelRule, kDecodePathsDefault | kDecodeActKernel,
                                 kDecodePathsDefault, kDecodePathsDefault | kDecodeActKernel};
      // Nothing after GEMM1 and the activation kernel touches the sums' region.
      cuda::detail::moe_forward_plan(L.w, dx.p, T, k, did.p, dw.p, out.p, ws.p, wsb, nullptr,
                                     plan_of(L, T, k, paths[mode], mode == 3));
      ckd(cudaDeviceSynchronize(), "moe_forward");
      std::vector<float> part(part_floats);
      ckd(cudaMemcpy(part.data(), ws.p + part_at, part_bytes, cudaMemcpyDeviceToHost), "D2H");
      std::int64_t finite = 0, poisoned = 0;
      for (float v : part) {
        std::uint32_t b;
        std::memcpy(&b, &v, 4);
        finite += std::isfinite(v);
        poisoned += b == 0xffffffffu;
      }
      // GEMM1 unsplit here by the rule (4 K-tiles): rank 0's row of each pair, 2 Ip values; mode 3
      // two ranks' rows per pair. The rule says yes from T = 16 (1.55 pairs per expert), no at T = 1,
      // 4, 8 (1.00, 1.10, 1.24).
      const bool act = mode == 1 || mode == 3 || (mode == 2 && hx::decode_act_kernel(T, k, E, H));
      EXPECT_EQ(hx::decode_act_kernel(T, k, E, H), T >= 16);
      const std::int64_t ranks = mode == 3 ? 2 : 1;
      const std::int64_t expect_written = act && P * ranks <= rows ? P * ranks * 2 * Ip : 0;
      EXPECT_EQ(finite, expect_written);
      EXPECT_EQ(poisoned, static_cast<std::int64_t>(part_floats) - expect_written);
    }
  }
}

}  // namespace
}  // namespace lutb::test
