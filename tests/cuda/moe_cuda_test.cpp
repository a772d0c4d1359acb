// tests/cuda/moe_cuda_test.cpp: the CUDA MoE forward and routing against the host reference of spec
// sections 4 and 5 (tests/cuda/reference.hpp), the golden vectors and a real model layer.
// Every GPU test skips when no CUDA device is present (CI compiles but cannot run them).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <tuple>
#include <random>
#include <string>
#include <vector>

#include "cuda/moe_paths.hpp"
#include "cuda/reference.hpp"
#include "lutb/cuda/lane_major.hpp"
#include "lutb/cuda/moe.hpp"
#include "support/test_support.hpp"

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
  explicit DevBuf(std::size_t count) : n(count) { ck(cudaMalloc(&p, std::max<std::size_t>(1, count) * sizeof(T)), "cudaMalloc"); }
  explicit DevBuf(const std::vector<T>& v) : DevBuf(v.size()) { up(v); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  void up(const std::vector<T>& v) { ck(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), "H2D"); }
  std::vector<T> down() const {
    std::vector<T> v(n);
    ck(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "D2H");
    return v;
  }
};

struct DevLutb {
  DevBuf<std::uint8_t> packed, codebook, scale;
  cuda::DeviceLutb view;
  explicit DevLutb(const HostLutb& h) : packed(h.packed), codebook(h.codebook), scale(h.scale) {
    view.shape = h.shape;
    view.packed = packed.p;
    view.codebook = codebook.p;
    view.scale = scale.p;
    cuda::to_lane_major(view, nullptr);  // the load-time index permutation the kernels need
  }
};

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

/// Runs the GPU forward on host data and returns out [T][H] (poisoned with NaN before the run).
std::vector<std::uint16_t> run_forward(const HostLutb& w13, const HostLutb& w2, std::int64_t E, std::int64_t H,
                                       std::int64_t I, const std::vector<std::uint16_t>& x, std::int64_t T, int k,
                                       const std::vector<std::int32_t>& ids, const std::vector<float>& wts,
                                       const cuda::heuristics::MoePlan& plan) {
  DevLutb d13(w13), d2(w2);
  cuda::DeviceMoeWeights w{E, H, I, d13.view, d2.view};
  DevBuf<std::uint16_t> dx(x), out(static_cast<std::size_t>(T * H));
  DevBuf<std::int32_t> did(ids);
  DevBuf<float> dw(wts);
  const std::size_t wsb = cuda::moe_workspace_bytes(T, k, E, H, I);
  DevBuf<char> ws(wsb);
  ck(cudaMemset(out.p, 0xff, T * H * 2), "poison out");
  ck(cudaMemset(ws.p, 0xff, wsb), "poison workspace");
  cuda::detail::moe_forward_plan(w, dx.p, T, k, did.p, dw.p, out.p, ws.p, wsb, nullptr, plan);
  ck(cudaDeviceSynchronize(), "moe_forward");
  return out.down();
}
std::vector<std::uint16_t> run_forward(const HostLutb& w13, const HostLutb& w2, std::int64_t E, std::int64_t H,
                                       std::int64_t I, const std::vector<std::uint16_t>& x, std::int64_t T, int k,
                                       const std::vector<std::int32_t>& ids, const std::vector<float>& wts,
                                       cuda::MoeStrategy strategy) {
  return run_forward(w13, w2, E, H, I, x, T, k, ids, wts, default_plan(T, k, E, H, strategy));
}

/// Random routing: k distinct experts per token from `allowed`, random positive weights.
void random_routing(std::int64_t T, int k, const std::vector<int>& allowed, std::mt19937& rng, std::vector<std::int32_t>& ids,
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

constexpr cuda::MoeStrategy kAllStrategies[] = {cuda::MoeStrategy::Decode, cuda::MoeStrategy::Prefill};
const char* strategy_name(cuda::MoeStrategy s) {
  switch (s) {
    case cuda::MoeStrategy::Decode: return "decode (swap-AB)";
    case cuda::MoeStrategy::Prefill: return "prefill";
    default: return "auto";
  }
}

struct Case {
  std::int64_t E, H, I, T;
  int k;
  bool only_even;  // leave odd experts empty
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "E=" << c.E << " H=" << c.H << " I=" << c.I << " T=" << c.T << " k=" << c.k << (c.only_even ? " (odd experts empty)" : "");
}

class MoeRandom : public ::testing::TestWithParam<Case> {};

TEST_P(MoeRandom, MatchesHostReferenceAllStrategiesAndDecoders) {
  LUTB_GPU_OR_SKIP();
  const Case c = GetParam();
  std::mt19937 rng(1234 + static_cast<unsigned>(c.E * 7 + c.H + c.I + c.T));
  const HostLutb w13 = random_lutb({c.E, 2 * c.I, c.H, true}, rng);
  const HostLutb w2 = random_lutb({c.E, c.H, c.I, true}, rng);
  const auto x = random_bf16(c.T * c.H, rng);
  std::vector<int> allowed;
  for (int e = 0; e < c.E; ++e)
    if (!c.only_even || e % 2 == 0) allowed.push_back(e);
  std::vector<std::int32_t> ids;
  std::vector<float> wts;
  random_routing(c.T, c.k, allowed, rng, ids, wts);
  const auto ref = moe_reference(w13, w2, c.H, c.I, x, c.T, c.k, ids, wts);
  for (const MoePath& path : all_paths(c.T, c.k, c.E, c.H)) {
    const auto got = run_forward(w13, w2, c.E, c.H, c.I, x, c.T, c.k, ids, wts, path.plan);
    const Cmp r = compare_bf16(got, ref);
    SCOPED_TRACE(::testing::Message() << "path " << path.name);
    EXPECT_EQ(r.nan, 0) << "unwritten or NaN outputs";
    EXPECT_LT(r.rel_l2, 1e-3) << "exact " << r.exact << " of " << r.n;
    EXPECT_GT(r.exact, r.n * 8 / 10) << "bit-equal BF16 outputs (FP32 order only differs)";
  }
}

// Swap-AB token blocks (decode_token_blocks): 1 for the first two cases and the last, 2 for the
// others (the third and fourth also need several 16-token tiles per expert). The sixth has few CTAs
// (128 in GEMM1, 64 in GEMM2) of 64 K-tiles each: swap_warps gives them 16-warp CTAs; the last two
// give each warp 40 (GEMM1) and 36 (GEMM2) K-tiles.
INSTANTIATE_TEST_SUITE_P(Shapes, MoeRandom,
                         ::testing::Values(Case{8, 256, 128, 1, 2, false},      // one token
                                           Case{16, 200, 72, 13, 4, false},     // padded H (K and N) and I
                                           Case{32, 512, 256, 100, 8, true},    // empty experts, several tiles
                                           Case{4, 128, 64, 70, 2, false},      // > 64 rows per expert
                                           Case{8, 320, 96, 40, 2, false},      // odd K-tiles, padded I groups
                                           Case{2, 4096, 4096, 1, 1, false},    // few CTAs, long K (16-warp CTAs)
                                           // 40 (GEMM1) and 36 (GEMM2) K-tiles per warp of 16-warp CTAs:
                                           // the cp.async ring wraps 6-7 times per warp; GEMM2 with one-
                                           // and two-token tiles.
                                           Case{1, 40960, 64, 1, 1, false},
                                           Case{2, 64, 36864, 3, 1, false}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           const Case& c = i.param;
                           return "E" + std::to_string(c.E) + "_H" + std::to_string(c.H) + "_I" + std::to_string(c.I) +
                                  "_T" + std::to_string(c.T) + "_k" + std::to_string(c.k) + (c.only_even ? "_holes" : "");
                         });

// Programmatic dependent launch (on sm_90): kernels overlap their predecessor's tail and the decode
// GEMMs read their weights before waiting. Three forwards are queued back to back on one stream and
// one workspace (the next forward's grouping and MXFP8 of x overwrite what the previous one's
// kernels read), for every strategy; each output must equal, bit for bit, the output of the same
// forward run alone (synchronised before and after).
TEST(MoeCuda, DependentLaunchBitIdenticalBackToBack) {
  LUTB_GPU_OR_SKIP();
  const std::int64_t E = 32, H = 512, I = 256;
  const int k = 8;
  std::mt19937 rng(77);
  const HostLutb w13 = random_lutb({E, 2 * I, H, true}, rng);
  const HostLutb w2 = random_lutb({E, H, I, true}, rng);
  DevLutb d13(w13), d2(w2);
  const cuda::DeviceMoeWeights w{E, H, I, d13.view, d2.view};
  std::vector<int> allowed(E);
  for (int e = 0; e < E; ++e) allowed[e] = e;
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  // One token (swap-AB without the grouping kernel: the MXFP8 of x comes first); 1 token block; 2
  // blocks; 2 blocks with several tiles per expert.
  for (const std::int64_t T : {std::int64_t{1}, std::int64_t{3}, std::int64_t{40}, std::int64_t{200}}) {
    std::deque<DevBuf<std::uint16_t>> xs, outs;  // deque: DevBuf does not move
    std::deque<DevBuf<std::int32_t>> ids;
    std::deque<DevBuf<float>> wts;
    for (int r = 0; r < 3; ++r) {
      std::vector<std::int32_t> id;
      std::vector<float> wt;
      random_routing(T, k, allowed, rng, id, wt);
      xs.emplace_back(random_bf16(T * H, rng));
      ids.emplace_back(id);
      wts.emplace_back(wt);
      outs.emplace_back(static_cast<std::size_t>(T * H));
    }
    const std::size_t wsb = cuda::moe_workspace_bytes(T, k, E, H, I);
    DevBuf<char> ws(wsb);
    for (int pass = 0; pass < 2; ++pass) {
      const auto s = kAllStrategies[pass];
      SCOPED_TRACE(::testing::Message() << "T " << T << " strategy " << strategy_name(s));
      std::vector<std::vector<std::uint16_t>> alone;
      for (int r = 0; r < 3; ++r) {
        ck(cudaMemset(outs[r].p, 0xff, T * H * 2), "poison out");
        cuda::moe_forward(w, xs[r].p, T, k, ids[r].p, wts[r].p, outs[r].p, ws.p, wsb, st, {s});
        ck(cudaStreamSynchronize(st), "forward alone");
        alone.push_back(outs[r].down());
      }
      for (int r = 0; r < 3; ++r) ck(cudaMemset(outs[r].p, 0xff, T * H * 2), "poison out");
      ck(cudaStreamSynchronize(nullptr), "poison");
      for (int r = 0; r < 3; ++r) cuda::moe_forward(w, xs[r].p, T, k, ids[r].p, wts[r].p, outs[r].p, ws.p, wsb, st, {s});
      ck(cudaStreamSynchronize(st), "forwards back to back");
      for (int r = 0; r < 3; ++r) {
        const auto got = outs[r].down();
        EXPECT_TRUE(got == alone[r]) << "forward " << r;
        int nan = 0;
        for (std::uint16_t v : got) nan += (v & 0x7fff) > 0x7f80;
        EXPECT_EQ(nan, 0) << "forward " << r;
      }
    }
  }
  ck(cudaStreamDestroy(st), "stream");
}

// out_f32 (the FP32 sums of the last step, for expert parallelism): rounded to BF16 they equal, bit
// for bit, the default forward's output, for every strategy and Auto (whose small batches fuse the
// reduction into GEMM2 on sm_90a: the FP32 form takes the separate kernel with the same operations
// in the same order), for moe_forward and moe_forward_bf16; `out` is then not written. An invalid
// expert id gives a NaN row in both forms.
TEST(MoeCuda, OutF32RoundsToTheDefaultOutput) {
  LUTB_GPU_OR_SKIP();
  const std::int64_t E = 32, H = 512, I = 256;
  const int k = 8;
  std::mt19937 rng(91);
  const HostLutb w13 = random_lutb({E, 2 * I, H, true}, rng);
  const HostLutb w2 = random_lutb({E, H, I, true}, rng);
  DevLutb d13(w13), d2(w2);
  const cuda::DeviceMoeWeights w{E, H, I, d13.view, d2.view};
  const auto b13 = random_bf16(E * 2 * I * H, rng, 0.05f), b2 = random_bf16(E * H * I, rng, 0.05f);
  DevBuf<std::uint16_t> db13(b13), db2(b2);
  const cuda::DeviceMoeWeightsBf16 wb{E, H, I, db13.p, db2.p};
  std::vector<int> allowed(E);
  for (int e = 0; e < E; ++e) allowed[e] = e;
  for (const std::int64_t T : {std::int64_t{1}, std::int64_t{3}, std::int64_t{40}, std::int64_t{200}}) {
    std::vector<std::int32_t> ids;
    std::vector<float> wts;
    random_routing(T, k, allowed, rng, ids, wts);
    if (T > 1) ids[k + 1] = static_cast<std::int32_t>(E);  // token 1: an invalid id, a NaN row
    DevBuf<std::uint16_t> dx(random_bf16(T * H, rng)), out(static_cast<std::size_t>(T * H));
    DevBuf<float> out32(static_cast<std::size_t>(T * H));
    DevBuf<std::int32_t> did(ids);
    DevBuf<float> dw(wts);
    const std::size_t wsb = cuda::moe_workspace_bytes(T, k, E, H, I);
    DevBuf<char> ws(wsb);
    for (const auto s : {cuda::MoeStrategy::Auto, cuda::MoeStrategy::Decode, cuda::MoeStrategy::Prefill}) {
      for (const bool bf16 : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "T " << T << " strategy " << static_cast<int>(s) << " bf16 " << bf16);
        ck(cudaMemset(out.p, 0xff, out.n * 2), "poison out");
        if (bf16) cuda::moe_forward_bf16(wb, dx.p, T, k, did.p, dw.p, out.p, ws.p, wsb, nullptr, {s});
        else cuda::moe_forward(w, dx.p, T, k, did.p, dw.p, out.p, ws.p, wsb, nullptr, {s});
        ck(cudaDeviceSynchronize(), "forward");
        const auto ref = out.down();
        ck(cudaMemset(out.p, 0x5a, out.n * 2), "mark out");
        ck(cudaMemset(out32.p, 0xff, out32.n * 4), "poison out_f32");
        if (bf16) cuda::moe_forward_bf16(wb, dx.p, T, k, did.p, dw.p, nullptr, ws.p, wsb, nullptr, {s}, out32.p);
        else cuda::moe_forward(w, dx.p, T, k, did.p, dw.p, nullptr, ws.p, wsb, nullptr, {s}, out32.p);
        ck(cudaDeviceSynchronize(), "forward out_f32");
        const auto got = out32.down();
        int differ = 0, nan = 0;
        for (std::int64_t i = 0; i < T * H; ++i) {
          const bool bad = T > 1 && i / H == 1;
          nan += std::isnan(got[i]) ? 1 : 0;
          if (bad) continue;
          differ += bf16_from_float(got[i]) != ref[i] ? 1 : 0;
        }
        EXPECT_EQ(differ, 0);
        EXPECT_EQ(nan, T > 1 ? H : 0);
        for (std::uint16_t v : out.down()) ASSERT_EQ(v, 0x5a5a) << "out written";
      }
    }
  }
}

// The BF16 baseline (moe_forward_bf16, the benchmarks' reference point: its speed is only
// meaningful if it computes the same function) against a host computation of that function
// (h = bf16(silu(g) * u), FP32 GEMMs, out = bf16(sum_j w_j y_j)), with decode and prefill tiles.
TEST(MoeCuda, Bf16BaselineMatchesHost) {
  LUTB_GPU_OR_SKIP();
  const std::int64_t E = 8, H = 256, I = 128;
  const int k = 2;
  std::mt19937 rng(31);
  const auto w13 = random_bf16(E * 2 * I * H, rng, 0.05f), w2 = random_bf16(E * H * I, rng, 0.05f);
  DevBuf<std::uint16_t> d13(w13), d2(w2);
  const cuda::DeviceMoeWeightsBf16 w{E, H, I, d13.p, d2.p};
  std::vector<int> allowed(E);
  for (int e = 0; e < E; ++e) allowed[e] = e;
  for (const std::int64_t T : {std::int64_t{1}, std::int64_t{16}, std::int64_t{64}, std::int64_t{100}}) {
    std::vector<std::int32_t> ids;
    std::vector<float> wts;
    random_routing(T, k, allowed, rng, ids, wts);
    const auto x = random_bf16(T * H, rng);
    // Host: double sums, rounded where the function rounds (h to BF16, out to BF16).
    std::vector<std::uint16_t> ref(T * H);
    for (std::int64_t t = 0; t < T; ++t) {
      std::vector<double> o(H, 0.0);
      for (int j = 0; j < k; ++j) {
        const std::int64_t e = ids[t * k + j];
        std::vector<float> h(I);
        for (std::int64_t i = 0; i < I; ++i) {
          double g = 0, u = 0;
          for (std::int64_t c = 0; c < H; ++c) {
            const double xv = bf16_to_float(x[t * H + c]);
            g += xv * bf16_to_float(w13[(e * 2 * I + i) * H + c]);
            u += xv * bf16_to_float(w13[(e * 2 * I + I + i) * H + c]);
          }
          h[i] = bf16_to_float(bf16_from_float(static_cast<float>(g / (1.0 + std::exp(-g)) * u)));
        }
        for (std::int64_t n = 0; n < H; ++n) {
          double y = 0;
          for (std::int64_t i = 0; i < I; ++i) y += double(h[i]) * bf16_to_float(w2[(e * H + n) * I + i]);
          o[n] += double(wts[t * k + j]) * static_cast<float>(y);
        }
      }
      for (std::int64_t n = 0; n < H; ++n) ref[t * H + n] = bf16_from_float(static_cast<float>(o[n]));
    }
    DevBuf<std::uint16_t> dx(x), out(static_cast<std::size_t>(T * H));
    DevBuf<std::int32_t> did(ids);
    DevBuf<float> dw(wts);
    const std::size_t wsb = cuda::moe_workspace_bytes(T, k, E, H, I);
    DevBuf<char> ws(wsb);
    for (auto s : {cuda::MoeStrategy::Decode, cuda::MoeStrategy::Prefill}) {
      SCOPED_TRACE(::testing::Message() << "T " << T << " strategy " << strategy_name(s));
      ck(cudaMemset(out.p, 0xff, out.n * 2), "poison out");
      ck(cudaMemset(ws.p, 0xff, wsb), "poison workspace");
      cuda::moe_forward_bf16(w, dx.p, T, k, did.p, dw.p, out.p, ws.p, wsb, nullptr, {s});
      ck(cudaDeviceSynchronize(), "moe_forward_bf16");
      const Cmp r = compare_bf16(out.down(), ref);
      EXPECT_EQ(r.nan, 0);
      EXPECT_LT(r.rel_l2, 5e-3);
    }
  }
}

TEST(MoeCuda, GoldenLayer) {
  // The host reference is checked against the golden layer first (no GPU needed), then the GPU.
  LUTB_GOLDEN_OR_SKIP(g, "lutb_moe_layer.json");
  const std::int64_t T = g["T"], H = g["H"], I = g["I"], E = g["E"];
  const int k = g["k"];
  HostLutb w13({E, 2 * I, H, true}), w2({E, H, I, true});
  auto load = [](const nlohmann::json& tiles, HostLutb& w, std::int64_t e) {
    const std::int64_t per = w.shape.tiles_per_expert();
    ASSERT_EQ(static_cast<std::int64_t>(tiles.size()), per);
    for (std::int64_t i = 0; i < per; ++i) {
      const auto p = parse_hex_bytes(tiles[i]["packed"].get<std::string>());
      std::vector<std::uint8_t> cb;
      if (tiles[i]["codebook"].is_string()) cb = parse_hex_bytes(tiles[i]["codebook"].get<std::string>());
      else for (const auto& v : tiles[i]["codebook"]) cb.push_back(static_cast<std::uint8_t>(v.get<int>()));
      ASSERT_EQ(p.size(), 192u);
      ASSERT_EQ(cb.size(), 8u);
      std::memcpy(&w.packed[(e * per + i) * 192], p.data(), 192);
      std::memcpy(&w.codebook[(e * per + i) * 8], cb.data(), 8);
      const auto& s = tiles[i]["scale"];
      w.scale[e * per + i] = static_cast<std::uint8_t>(s.is_string() ? parse_hex(s.get<std::string>()) : s.get<int>());
    }
  };
  for (std::int64_t e = 0; e < E; ++e) {
    load(g["experts"][e]["w13"], w13, e);
    load(g["experts"][e]["w2"], w2, e);
  }
  std::vector<std::uint16_t> x(T * H);
  std::vector<std::int32_t> ids(T * k);
  std::vector<float> wts(T * k);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t c = 0; c < H; ++c) x[t * H + c] = bf16_from_float(f32_hex(g["x"][t][c]));
    for (int j = 0; j < k; ++j) {
      ids[t * k + j] = g["topk_ids"][t][j];
      wts[t * k + j] = f32_hex(g["topk_weights"][t][j]);
    }
  }
  std::vector<std::uint16_t> expect(T * H);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t c = 0; c < H; ++c) expect[t * H + c] = bf16_from_float(f32_hex(g["out"][t][c]));
  const auto ref = moe_reference(w13, w2, H, I, x, T, k, ids, wts);
  const Cmp rr = compare_bf16(ref, expect);
  EXPECT_LT(rr.rel_l2, 1e-3) << "host reference vs golden";
  EXPECT_EQ(rr.nan, 0);
  LUTB_GPU_OR_SKIP();
  for (auto s : kAllStrategies) {
    const auto got = run_forward(w13, w2, E, H, I, x, T, k, ids, wts, s);
    const Cmp r = compare_bf16(got, expect);
    EXPECT_EQ(r.nan, 0);
    EXPECT_LT(r.rel_l2, 1e-3) << "GPU vs golden";
  }
}

TEST(MoeCuda, InvalidExpertIdWritesNanRow) {
  LUTB_GPU_OR_SKIP();
  std::mt19937 rng(5);
  const std::int64_t E = 4, H = 64, I = 64, T = 3;
  const int k = 2;
  const HostLutb w13 = random_lutb({E, 2 * I, H, true}, rng), w2 = random_lutb({E, H, I, true}, rng);
  const auto x = random_bf16(T * H, rng);
  std::vector<std::int32_t> ids = {0, 1, 2, 7, 3, 0};  // token 1 has an out-of-range id
  std::vector<float> wts = {0.5f, 0.5f, 0.3f, 0.7f, 0.6f, 0.4f};
  const auto got = run_forward(w13, w2, E, H, I, x, T, k, ids, wts, cuda::MoeStrategy::Auto);
  const auto ref = moe_reference(w13, w2, H, I, x, T, k, ids, wts);
  for (std::int64_t c = 0; c < H; ++c) {
    EXPECT_TRUE(std::isnan(bf16_to_float(got[1 * H + c])));
    EXPECT_FALSE(std::isnan(bf16_to_float(got[0 * H + c])));
    EXPECT_FALSE(std::isnan(bf16_to_float(got[2 * H + c])));
  }
}

// One token (the swap-AB decode then skips the grouping: its k pairs are the token tiles): an
// invalid expert id gives the NaN row, a repeated expert is summed twice like any two experts, and
// every strategy agrees with the host reference.
TEST(MoeCuda, SingleTokenInvalidAndRepeatedExperts) {
  LUTB_GPU_OR_SKIP();
  std::mt19937 rng(8);
  const std::int64_t E = 6, H = 192, I = 64, T = 1;
  const int k = 3;
  const HostLutb w13 = random_lutb({E, 2 * I, H, true}, rng), w2 = random_lutb({E, H, I, true}, rng);
  const auto x = random_bf16(T * H, rng);
  const std::vector<float> wts = {0.5f, 0.3f, 0.2f};
  for (const std::vector<std::int32_t>& ids : {std::vector<std::int32_t>{4, 1, 5}, std::vector<std::int32_t>{2, 2, 0},
                                               std::vector<std::int32_t>{3, 6, 1}, std::vector<std::int32_t>{-1, 0, 1}}) {
    const bool invalid = ids[1] >= E || ids[0] < 0;
    const auto ref = moe_reference(w13, w2, H, I, x, T, k, invalid ? std::vector<std::int32_t>{0, 0, 0} : ids, wts);
    for (const MoePath& path : all_paths(T, k, E, H)) {
      SCOPED_TRACE(::testing::Message() << "ids " << ids[0] << "," << ids[1] << "," << ids[2] << " path " << path.name);
      const auto got = run_forward(w13, w2, E, H, I, x, T, k, ids, wts, path.plan);
      if (invalid) {
        for (std::int64_t c = 0; c < H; ++c) EXPECT_TRUE(std::isnan(bf16_to_float(got[c]))) << c;
      } else {
        const Cmp r = compare_bf16(got, ref);
        EXPECT_EQ(r.nan, 0);
        EXPECT_LT(r.rel_l2, 1e-3);
      }
    }
  }
}

TEST(MoeCuda, RejectsBadArguments) {
  // Argument checks run before any CUDA call: no device needed.
  cuda::DeviceMoeWeights w{4, 64, 60, {}, {}};
  EXPECT_THROW(cuda::moe_forward(w, nullptr, 1, 2, nullptr, nullptr, nullptr, nullptr, 0, nullptr), std::invalid_argument);
  w.intermediate = 64;
  w.w13.shape = {4, 128, 64, true};
  w.w2.shape = {4, 64, 32, true};  // wrong K
  EXPECT_THROW(cuda::moe_forward(w, nullptr, 1, 2, nullptr, nullptr, nullptr, nullptr, 0, nullptr), std::invalid_argument);
  // Right shapes, but the index bytes are still in checkpoint order: refused, naming the fix.
  w.w2.shape = {4, 64, 64, true};
  alignas(16) static std::uint8_t fake[16];
  for (auto* d : {&w.w13, &w.w2}) d->packed = d->codebook = d->scale = fake;
  try {
    cuda::moe_forward(w, nullptr, 1, 2, nullptr, nullptr, nullptr, nullptr, 0, nullptr);
    ADD_FAILURE() << "checkpoint-order weights accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("to_lane_major"), std::string::npos) << e.what();
  }
  w.w13.lane_major = true;
  EXPECT_THROW(cuda::to_lane_major(w.w13, nullptr), std::invalid_argument) << "converting twice";
}

TEST(MoeCuda, ToLaneMajorOnDeviceEqualsHostPermutation) {
  LUTB_GPU_OR_SKIP();
  std::mt19937 rng(17);
  const LutbShape s{3, 40, 200, true};  // 3 x 5 x 4 tiles
  std::vector<std::uint8_t> packed(static_cast<std::size_t>(s.tiles()) * 192);
  for (auto& b : packed) b = static_cast<std::uint8_t>(rng());
  DevBuf<std::uint8_t> d(packed);
  cuda::DeviceLutb v;
  v.shape = s;
  v.packed = d.p;
  cuda::to_lane_major(v, nullptr);
  ck(cudaDeviceSynchronize(), "to_lane_major");
  EXPECT_TRUE(v.lane_major);
  const auto got = d.down();
  for (std::int64_t t = 0; t < s.tiles(); ++t) {
    std::uint8_t want[192];
    cuda::tile_to_lane_major(&packed[t * 192], want);
    ASSERT_EQ(std::memcmp(want, &got[t * 192], 192), 0) << "tile " << t;
  }
}

TEST(MoeCuda, TileOffsetIs64Bit) {
  // DeepSeek-V3 w13: 256 experts x 4096 rows x 7168 columns. The packed byte offset of the last tile
  // is about 2.8e9 > 2^31: any 32-bit step in the index arithmetic would wrap.
  const LutbShape s{256, 4096, 7168, true};
  const std::int64_t last = cuda::tile_offset(255, s.tiles_n() - 1, s.tiles_k() - 1, s.tiles_n(), s.tiles_k());
  EXPECT_EQ(last, s.tiles() - 1);
  EXPECT_EQ(last * 192, (256ll * 512 * 112 - 1) * 192);
  EXPECT_GT(last * 192, 2147483647ll);
}

TEST(MoeCuda, LargeExpertStackBeyond2Pow31Bytes) {
  LUTB_GPU_OR_SKIP();
  // DeepSeek-V3 shape, random data in experts 0 and 255 only (the rest zero, scale 127): the last
  // expert's packed bytes start at 2.8e9.
  const std::int64_t E = 256, H = 7168, I = 2048, T = 2;
  const int k = 2;
  const LutbShape s13{E, 2 * I, H, true}, s2{E, H, I, true};
  std::size_t free_b = 0, total_b = 0;
  ck(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  const std::size_t need = static_cast<std::size_t>((s13.tiles() + s2.tiles()) * 201) + (1ull << 30);
  if (free_b < need) GTEST_SKIP() << "needs " << need << " bytes of device memory";
  std::mt19937 rng(99);
  const HostLutb e13 = random_lutb({1, 2 * I, H, true}, rng), e2 = random_lutb({1, H, I, true}, rng);
  DevBuf<std::uint8_t> p13(s13.tiles() * 192), c13(s13.tiles() * 8), sc13(s13.tiles());
  DevBuf<std::uint8_t> p2(s2.tiles() * 192), c2(s2.tiles() * 8), sc2(s2.tiles());
  ck(cudaMemset(p13.p, 0, p13.n), "memset");
  ck(cudaMemset(c13.p, 0, c13.n), "memset");
  ck(cudaMemset(sc13.p, 127, sc13.n), "memset");
  ck(cudaMemset(p2.p, 0, p2.n), "memset");
  ck(cudaMemset(c2.p, 0, c2.n), "memset");
  ck(cudaMemset(sc2.p, 127, sc2.n), "memset");
  HostLutb h13(LutbShape{2, 2 * I, H, true});
  HostLutb h2(LutbShape{2, H, I, true});
  for (std::int64_t slot = 0; slot < 2; ++slot) {
    const std::int64_t e = slot == 0 ? 0 : 255;
    const std::int64_t t13 = s13.tiles_per_expert(), t2 = s2.tiles_per_expert();
    ck(cudaMemcpy(p13.p + e * t13 * 192, e13.packed.data(), t13 * 192, cudaMemcpyHostToDevice), "H2D");
    ck(cudaMemcpy(c13.p + e * t13 * 8, e13.codebook.data(), t13 * 8, cudaMemcpyHostToDevice), "H2D");
    ck(cudaMemcpy(sc13.p + e * t13, e13.scale.data(), t13, cudaMemcpyHostToDevice), "H2D");
    ck(cudaMemcpy(p2.p + e * t2 * 192, e2.packed.data(), t2 * 192, cudaMemcpyHostToDevice), "H2D");
    ck(cudaMemcpy(c2.p + e * t2 * 8, e2.codebook.data(), t2 * 8, cudaMemcpyHostToDevice), "H2D");
    ck(cudaMemcpy(sc2.p + e * t2, e2.scale.data(), t2, cudaMemcpyHostToDevice), "H2D");
    std::memcpy(&h13.packed[slot * t13 * 192], e13.packed.data(), t13 * 192);
    std::memcpy(&h13.codebook[slot * t13 * 8], e13.codebook.data(), t13 * 8);
    std::memcpy(&h13.scale[slot * t13], e13.scale.data(), t13);
    std::memcpy(&h2.packed[slot * t2 * 192], e2.packed.data(), t2 * 192);
    std::memcpy(&h2.codebook[slot * t2 * 8], e2.codebook.data(), t2 * 8);
    std::memcpy(&h2.scale[slot * t2], e2.scale.data(), t2);
  }
  const auto x = random_bf16(T * H, rng);
  const std::vector<std::int32_t> ids = {255, 0, 0, 255}, ids_host = {1, 0, 0, 1};
  const std::vector<float> wts = {0.75f, 0.25f, 0.5f, 0.5f};
  cuda::DeviceMoeWeights w{E, H, I, {s13, p13.p, c13.p, sc13.p}, {s2, p2.p, c2.p, sc2.p}};
  cuda::to_lane_major(w.w13, nullptr);  // 2.9e9 packed bytes: the conversion's 64-bit indexing too
  cuda::to_lane_major(w.w2, nullptr);
  DevBuf<std::uint16_t> dx(x), out(T * H);
  DevBuf<std::int32_t> did(ids);
  DevBuf<float> dw(wts);
  const std::size_t wsb = cuda::moe_workspace_bytes(T, k, E, H, I);
  DevBuf<char> ws(wsb);
  ck(cudaMemset(out.p, 0xff, out.n * 2), "poison");
  cuda::moe_forward(w, dx.p, T, k, did.p, dw.p, out.p, ws.p, wsb, nullptr);
  ck(cudaDeviceSynchronize(), "moe_forward");
  const auto got = out.down();
  const auto ref = moe_reference(h13, h2, H, I, x, T, k, ids_host, wts);
  const Cmp r = compare_bf16(got, ref);
  EXPECT_EQ(r.nan, 0);
  EXPECT_LT(r.rel_l2, 1e-3);
}

// ---------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------
TEST(RoutingCuda, SoftmaxTopkMatchesReference) {
  LUTB_GPU_OR_SKIP();
  std::mt19937 rng(7);
  for (auto [T, E, k, renorm] : {std::tuple{37, 64, 6, true}, std::tuple{5, 8, 2, true}, std::tuple{100, 128, 8, false},
                                 std::tuple{3, 256, 8, true}}) {
    std::normal_distribution<float> d(0, 2);
    std::vector<float> logits(T * E);
    for (auto& v : logits) v = d(rng);
    DevBuf<float> dl(logits), dw(T * k);
    DevBuf<std::int32_t> di(T * k);
    cuda::route_softmax_topk(dl.p, T, E, k, renorm, di.p, dw.p, nullptr);
    ck(cudaDeviceSynchronize(), "route");
    const auto ids = di.down();
    const auto w = dw.down();
    for (int t = 0; t < T; ++t) {
      std::vector<std::int32_t> ri(k);
      std::vector<float> rw(k);
      softmax_topk_reference(&logits[t * E], E, k, renorm, ri.data(), rw.data());
      for (int j = 0; j < k; ++j) {
        EXPECT_EQ(ids[t * k + j], ri[j]) << "token " << t << " slot " << j;
        EXPECT_NEAR(w[t * k + j], rw[j], 1e-6 * std::fabs(rw[j]) + 1e-9);
      }
    }
  }
}

TEST(RoutingCuda, DeepSeekGolden) {
  LUTB_GPU_OR_SKIP();
  LUTB_GOLDEN_OR_SKIP(g, "deepseek_routing.json");
  for (const auto& c : g["cases"]) {
    std::vector<float> logits, bias;
    for (const auto& v : c["logits"]) logits.push_back(f32_hex(v));
    for (const auto& v : c["e_score_correction_bias"]) bias.push_back(f32_hex(v));
    const int E = static_cast<int>(logits.size()), k = c["top_k"];
    DevBuf<float> dl(logits), db(bias), dw(k);
    DevBuf<std::int32_t> di(k);
    cuda::route_deepseek(dl.p, db.p, 1, E, c["n_group"], c["topk_group"], k, c["norm_topk_prob"],
                         c["routed_scaling_factor"].get<float>(), di.p, dw.p, nullptr);
    ck(cudaDeviceSynchronize(), "route");
    const auto ids = di.down();
    const auto w = dw.down();
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(ids[j], c["expert_ids"][j].get<int>());
      const double ew = std::stod(c["weights"][j].get<std::string>());
      EXPECT_NEAR(w[j], ew, 1e-6 * std::fabs(ew));
    }
  }
}

TEST(RoutingCuda, DeepSeekRandomMatchesReference) {
  LUTB_GPU_OR_SKIP();
  std::mt19937 rng(11);
  const int T = 50, E = 256, n_group = 8, topk_group = 4, k = 8;
  std::normal_distribution<float> d(0, 2), db(0, 0.1f);
  std::vector<float> logits(T * E), bias(E);
  for (auto& v : logits) v = d(rng);
  for (auto& v : bias) v = db(rng);
  DevBuf<float> dl(logits), dbias(bias), dw(T * k);
  DevBuf<std::int32_t> di(T * k);
  cuda::route_deepseek(dl.p, dbias.p, T, E, n_group, topk_group, k, true, 2.5f, di.p, dw.p, nullptr);
  ck(cudaDeviceSynchronize(), "route");
  const auto ids = di.down();
  const auto w = dw.down();
  for (int t = 0; t < T; ++t) {
    std::vector<std::int32_t> ri(k);
    std::vector<float> rw(k);
    deepseek_reference(&logits[t * E], bias.data(), E, n_group, topk_group, k, true, 2.5f, ri.data(), rw.data());
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(ids[t * k + j], ri[j]);
      EXPECT_NEAR(w[t * k + j], rw[j], 1e-6 * std::fabs(rw[j]));
    }
  }
}

// ---------------------------------------------------------------------------
// Real weights: tiny-qwen3-moe layer 1 (router + experts + captured moe_input)
// ---------------------------------------------------------------------------
struct StTensor {
  std::vector<std::int64_t> shape;
  std::vector<std::uint16_t> bf16;
};
/// Minimal safetensors reader for BF16 tensors (test support only).
std::map<std::string, StTensor> read_bf16_tensors(const std::filesystem::path& file, const std::vector<std::string>& names) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + file.string());
  std::uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string hdr(n, '\0');
  in.read(hdr.data(), static_cast<std::streamsize>(n));
  const auto j = nlohmann::json::parse(hdr);
  std::map<std::string, StTensor> out;
  for (const auto& name : names) {
    if (!j.contains(name)) throw std::runtime_error(file.string() + ": no tensor " + name);
    const auto& t = j[name];
    if (t["dtype"] != "BF16") throw std::runtime_error(file.string() + ": " + name + " is not BF16");
    StTensor s;
    s.shape = t["shape"].get<std::vector<std::int64_t>>();
    const std::int64_t b = t["data_offsets"][0], e = t["data_offsets"][1];
    s.bf16.resize(static_cast<std::size_t>((e - b) / 2));
    in.seekg(static_cast<std::streamoff>(8 + n + b));
    in.read(reinterpret_cast<char*>(s.bf16.data()), e - b);
    out[name] = std::move(s);
  }
  return out;
}

TEST(MoeCuda, RealQwen3Layer) {
  LUTB_GPU_OR_SKIP();
  LUTB_MODEL_OR_SKIP(dir, "tiny-qwen3-moe");
  const int L = 1, E = 16, k = 4;
  const std::int64_t H = 256, I = 256, T = 64;
  std::vector<std::string> names = {"model.layers.1.mlp.gate.weight"};
  for (int e = 0; e < E; ++e)
    for (const char* p : {"gate_proj", "up_proj", "down_proj"})
      names.push_back("model.layers.1.mlp.experts." + std::to_string(e) + "." + p + ".weight");
  auto w = read_bf16_tensors(dir / "model.safetensors", names);
  auto act = read_bf16_tensors(dir / "moe_activations.safetensors", {"layers.1.moe_input", "layers.1.moe_output"});
  (void)L;
  std::vector<float> f13(E * 2 * I * H), f2(E * H * I);
  for (int e = 0; e < E; ++e) {
    const std::string pre = "model.layers.1.mlp.experts." + std::to_string(e) + ".";
    const auto& gp = w[pre + "gate_proj.weight"].bf16;
    const auto& up = w[pre + "up_proj.weight"].bf16;
    const auto& dp = w[pre + "down_proj.weight"].bf16;
    for (std::int64_t i = 0; i < I * H; ++i) {
      f13[e * 2 * I * H + i] = bf16_to_float(gp[i]);
      f13[e * 2 * I * H + I * H + i] = bf16_to_float(up[i]);
    }
    for (std::int64_t i = 0; i < H * I; ++i) f2[e * H * I + i] = bf16_to_float(dp[i]);
  }
  const HostLutb w13 = quantize_simple(f13, {E, 2 * I, H, true});
  const HostLutb w2 = quantize_simple(f2, {E, H, I, true});
  std::vector<std::uint16_t> x(act["layers.1.moe_input"].bf16.begin(), act["layers.1.moe_input"].bf16.begin() + T * H);
  // Router logits on the host (FP32 dot of the BF16 input and gate rows), routing on the GPU.
  const auto& gate = w["model.layers.1.mlp.gate.weight"].bf16;
  std::vector<float> logits(T * E);
  for (std::int64_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      float s = 0;
      for (std::int64_t c = 0; c < H; ++c) s += bf16_to_float(x[t * H + c]) * bf16_to_float(gate[e * H + c]);
      logits[t * E + e] = s;
    }
  DevBuf<float> dl(logits), dw(T * k);
  DevBuf<std::int32_t> di(T * k);
  cuda::route_softmax_topk(dl.p, T, E, k, true, di.p, dw.p, nullptr);
  ck(cudaDeviceSynchronize(), "route");
  const auto ids = di.down();
  const auto wts = dw.down();
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<std::int32_t> ri(k);
    std::vector<float> rw(k);
    softmax_topk_reference(&logits[t * E], E, k, true, ri.data(), rw.data());
    for (int j = 0; j < k; ++j) EXPECT_EQ(ids[t * k + j], ri[j]);
  }
  const auto ref = moe_reference(w13, w2, H, I, x, T, k, ids, wts);
  for (auto s : kAllStrategies) {
    SCOPED_TRACE(strategy_name(s));
    const auto got = run_forward(w13, w2, E, H, I, x, T, k, ids, wts, s);
    const Cmp r = compare_bf16(got, ref);
    EXPECT_EQ(r.nan, 0);
    EXPECT_LT(r.rel_l2, 1e-3) << "exact " << r.exact << " of " << r.n;
    // For information: distance to the captured BF16 model output (quantisation error of the
    // test-only quantiser, not a project fitter).
    std::vector<std::uint16_t> model(act["layers.1.moe_output"].bf16.begin(),
                                     act["layers.1.moe_output"].bf16.begin() + T * H);
    std::cout << "[info] tiny-qwen3-moe layer 1, 64 tokens: GPU vs host rel L2 " << r.rel_l2 << ", vs BF16 model output "
              << compare_bf16(got, model).rel_l2 << "\n";
  }
}

}  // namespace
}  // namespace lutb::test
