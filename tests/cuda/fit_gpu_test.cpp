// tests/cuda/fit_gpu_test.cpp: the GPU fitters "binned-dp" and "optimal" (lutb/cuda/fit.hpp) against
// the CPU fitters (lutb::quantize, src/fit): identical packed indices, codebooks, scales and
// FitStats on random Gaussian / Student-t / Laplace stacks, edge tiles, padding shapes, chunkings,
// forced scales, optimal's scale search, error tiles and real expert stacks of tiny-qwen3-moe.
// Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda/fit_internal.cuh"
#include "lutb/cuda/fit.hpp"
#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb::test {
namespace {

bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define LUTB_GPU_OR_SKIP() \
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device: skipping"

// Fits on the CPU and on the GPU with `fitter` (binned-dp: both GPU kernels, the default warp
// kernel and the first, thread-per-tile one; optimal: the warp kernel) and asserts byte equality;
// returns the number of tiles compared.
std::int64_t expect_same(const void* src, DType type, const LutbShape& shape, int forced_scale = -1,
                         std::size_t chunk_bytes = std::size_t{512} << 20, const std::string& fitter = "binned-dp") {
  FitOptions fo;
  fo.fitter = fitter;
  fo.forced_scale = forced_scale;
  LutbTensor cpu;
  const FitStats sc = quantize(src, type, shape, cpu, fo, "t");
  std::vector<cuda::GpuFitKernel> kernels{cuda::GpuFitKernel::Warp};
  if (fitter == "binned-dp") kernels.push_back(cuda::GpuFitKernel::Thread);
  for (cuda::GpuFitKernel kernel : kernels) {
    SCOPED_TRACE(fitter + (kernel == cuda::GpuFitKernel::Warp ? ", warp kernel" : ", thread kernel"));
    LutbTensor gpu;
    cuda::GpuFitOptions go;
    go.fitter = fitter;
    go.forced_scale = forced_scale;
    go.chunk_bytes = chunk_bytes;
    go.kernel = kernel;
    const FitStats sg = cuda::quantize_gpu(src, type, shape, gpu, go, "t");
    EXPECT_EQ(sg.tiles, sc.tiles);
    EXPECT_EQ(sg.sse, sc.sse);
    EXPECT_EQ(sg.sum_sq, sc.sum_sq);
    EXPECT_EQ(gpu.scale, cpu.scale);
    // First differing tile, for a readable failure.
    std::int64_t bad = -1, bad_cb = -1;
    for (std::int64_t t = 0; t < shape.tiles() && bad < 0; ++t)
      if (std::memcmp(gpu.packed.data() + t * kPackedBytes, cpu.packed.data() + t * kPackedBytes, kPackedBytes) != 0)
        bad = t;
    for (std::int64_t t = 0; t < shape.tiles() && bad_cb < 0; ++t)
      if (std::memcmp(gpu.codebook.data() + t * kCodebookSize, cpu.codebook.data() + t * kCodebookSize,
                      kCodebookSize) != 0)
        bad_cb = t;
    EXPECT_EQ(bad, -1) << "packed indices differ first at tile " << bad;
    EXPECT_EQ(bad_cb, -1) << "codebooks differ first at tile " << bad_cb;
  }
  return shape.tiles();
}

std::int64_t expect_same_optimal(const void* src, DType type, const LutbShape& shape, int forced_scale = -1,
                                 std::size_t chunk_bytes = std::size_t{512} << 20) {
  return expect_same(src, type, shape, forced_scale, chunk_bytes, "optimal");
}

enum class Dist { kGauss, kStudentT3, kLaplace };

std::vector<float> random_values(std::size_t n, Dist d, float sigma, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  std::student_t_distribution<float> td(3.0f);
  std::exponential_distribution<float> ed(1.0f / sigma);
  std::bernoulli_distribution coin(0.5);
  std::vector<float> v(n);
  for (auto& x : v) {
    if (d == Dist::kGauss) x = nd(g);
    else if (d == Dist::kStudentT3) x = sigma * td(g);
    else x = coin(g) ? ed(g) : -ed(g);
  }
  return v;
}

std::vector<std::uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<std::uint16_t> b(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) b[i] = bf16_from_float(v[i]);
  return b;
}

LutbShape stack(std::int64_t e, std::int64_t n, std::int64_t k) {
  LutbShape s;
  s.experts = e;
  s.rows = n;
  s.cols = k;
  s.stacked = e > 1;
  return s;
}

struct RandomCase {
  Dist dist;
  std::int64_t e, n, k;
  bool bf16;
  bool optimal = false;  // the fitter: binned-dp (both kernels) or optimal (warp kernel)
};

// Readable parameter names (the default printer dumps the struct's bytes, padding included).
void PrintTo(const RandomCase& c, std::ostream* os) {
  static const char* const kNames[] = {"gauss", "student-t3", "laplace"};
  *os << (c.optimal ? "optimal " : "binned-dp ") << kNames[static_cast<int>(c.dist)] << " [" << c.e << ", " << c.n
      << ", " << c.k << "] " << (c.bf16 ? "BF16" : "F32");
}

// Test names (ctest lists them): "gauss_2x64x512_bf16" instead of the index "/3" (new-user QA,
// session 12). The fitter is the instantiation's prefix (Shapes: binned-dp, Optimal: optimal).
std::string case_name(const ::testing::TestParamInfo<RandomCase>& i) {
  static const char* const kNames[] = {"gauss", "student_t3", "laplace"};
  const RandomCase& c = i.param;
  return std::string(kNames[static_cast<int>(c.dist)]) + "_" + std::to_string(c.e) + "x" + std::to_string(c.n) + "x" +
         std::to_string(c.k) + (c.bf16 ? "_bf16" : "_f32");
}

class FitGpuRandom : public ::testing::TestWithParam<RandomCase> {};

TEST_P(FitGpuRandom, SameBytesAsCpu) {
  LUTB_GPU_OR_SKIP();
  const RandomCase c = GetParam();
  const LutbShape s = stack(c.e, c.n, c.k);
  const auto v = random_values(static_cast<std::size_t>(c.e * c.n * c.k), c.dist, 0.02f,
                               static_cast<std::uint32_t>((c.optimal ? 31 : 17) * c.n + c.k + static_cast<int>(c.dist)));
  const std::string fitter = c.optimal ? "optimal" : "binned-dp";
  const std::size_t chunk = std::size_t{512} << 20;
  if (c.bf16) {
    const auto b = to_bf16(v);
    EXPECT_GT(expect_same(b.data(), DType::BF16, s, -1, chunk, fitter), 0);
  } else {
    EXPECT_GT(expect_same(v.data(), DType::F32, s, -1, chunk, fitter), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, FitGpuRandom,
                         ::testing::Values(RandomCase{Dist::kGauss, 2, 64, 512, true},
                                           RandomCase{Dist::kStudentT3, 2, 64, 512, true},
                                           RandomCase{Dist::kLaplace, 2, 64, 512, true},
                                           RandomCase{Dist::kGauss, 3, 21, 200, false},     // N%8, K%64 != 0
                                           RandomCase{Dist::kStudentT3, 3, 21, 200, true},
                                           RandomCase{Dist::kLaplace, 1, 13, 70, false},
                                           RandomCase{Dist::kGauss, 1, 5, 33, true},        // one padded tile
                                           // FP32: 512 distinct values per tile (49 bin edges, the
                                           // deepest DP trees), many tiles
                                           RandomCase{Dist::kStudentT3, 2, 128, 1024, false},
                                           RandomCase{Dist::kLaplace, 2, 128, 1024, false},
                                           RandomCase{Dist::kGauss, 4, 128, 1024, true}),
                         case_name);

// The optimal fitter; sizes keep the CPU optimal fitter (~2 M weights/s per core) fast.
INSTANTIATE_TEST_SUITE_P(Optimal, FitGpuRandom,
                         ::testing::Values(RandomCase{Dist::kGauss, 2, 64, 512, true, true},
                                           RandomCase{Dist::kStudentT3, 2, 64, 512, true, true},
                                           RandomCase{Dist::kLaplace, 1, 64, 512, true, true},
                                           RandomCase{Dist::kGauss, 3, 21, 200, false, true},  // N%8, K%64 != 0
                                           RandomCase{Dist::kStudentT3, 1, 13, 70, true, true},
                                           RandomCase{Dist::kGauss, 1, 5, 33, true, true},     // one padded tile
                                           // FP32: 512 distinct values per tile (DP trees 9 levels deep)
                                           RandomCase{Dist::kGauss, 1, 64, 1024, false, true},
                                           RandomCase{Dist::kStudentT3, 1, 64, 1024, false, true}),
                         case_name);

// The edge-case tiles, one 8 x 64 tile per pattern side by side along K: [8, 64 * count] FP32.
std::vector<float> edge_tiles(std::int64_t& count) {
  std::vector<std::vector<float>> tiles;
  std::mt19937 g(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  tiles.push_back(std::vector<float>(512, 0.0f));  // all zero
  {
    std::vector<float> t(512, 0.0f);
    for (int i = 0; i < 512; ++i) t[i] = (i & 1) ? -0.0f : 0.0f;  // +0 / -0 mix
    tiles.push_back(t);
  }
  tiles.push_back(std::vector<float>(512, 0.37f));   // constant
  tiles.push_back(std::vector<float>(512, -5e-3f));  // constant negative
  for (int distinct : {2, 3, 7, 8, 9, 31, 32, 33, 40}) {  // few distinct values, around the bin count
    std::vector<float> t(512);
    for (int i = 0; i < 512; ++i) t[i] = 0.01f * static_cast<float>((i * 7919) % distinct) - 0.1f;
    tiles.push_back(t);
  }
  for (float mag : {1e-36f, 3e-38f, 1e-40f, 1e-44f}) {  // tiny magnitudes: scale 3, FP32 subnormals
    std::vector<float> t(512);
    for (auto& x : t) x = mag * nd(g);
    tiles.push_back(t);
  }
  {
    std::vector<float> t(512);  // one outlier
    for (auto& x : t) x = 0.01f * nd(g);
    t[77] = 3.0f;
    tiles.push_back(t);
  }
  {
    std::vector<float> t(512);  // large but legal magnitude (scale near 246)
    for (auto& x : t) x = 1e37f * nd(g);
    tiles.push_back(t);
  }
  {
    std::vector<float> t(512);  // bimodal, many ties at midpoints
    for (int i = 0; i < 512; ++i) t[i] = (i % 4 == 0) ? 1.0f : ((i % 4 == 1) ? -1.0f : 0.5f * static_cast<float>(i % 3));
    tiles.push_back(t);
  }
  const std::int64_t nt = static_cast<std::int64_t>(tiles.size());
  std::vector<float> m(static_cast<std::size_t>(8 * 64 * nt));
  for (std::int64_t t = 0; t < nt; ++t)
    for (int r = 0; r < 8; ++r)
      for (int c = 0; c < 64; ++c) m[static_cast<std::size_t>(r * 64 * nt + t * 64 + c)] = tiles[t][r * 64 + c];
  count = nt;
  return m;
}

void edge_tiles_case(const std::string& fitter) {
  std::int64_t nt = 0;
  const std::vector<float> m = edge_tiles(nt);
  const LutbShape s = stack(1, 8, 64 * nt);
  const std::size_t chunk = std::size_t{512} << 20;
  EXPECT_EQ(expect_same(m.data(), DType::F32, s, -1, chunk, fitter), nt);
  const auto b = to_bf16(m);
  EXPECT_EQ(expect_same(b.data(), DType::BF16, s, -1, chunk, fitter), nt);
  // Forced scales (the DP at a scale that is not the fitter's own), except on tiles that saturate badly.
  const auto small = random_values(8 * 64 * 4, Dist::kStudentT3, 0.02f, 9);
  for (int fs : {3, 100, 120, 127, 246}) expect_same(small.data(), DType::F32, stack(1, 8, 256), fs, chunk, fitter);
}

TEST(FitGpu, EdgeTiles) {
  LUTB_GPU_OR_SKIP();
  edge_tiles_case("binned-dp");
}

TEST(FitGpuOptimal, EdgeTiles) {
  LUTB_GPU_OR_SKIP();
  edge_tiles_case("optimal");
}

// optimal's scale search (src/fit/optimal.cpp): tiles whose optimum is BELOW rceil. The largest
// magnitude 224 * (1 + 2^-20) has rceil 127; at scale 126 it saturates to 224 (error
// (224 * 2^-20)^2 ~ 4.6e-8), but the small values, odd multiples of 2^-10, sit exactly on scale 126's subnormal
// grid and halfway between scale 127's points (error 2^-20 each, ~5e-4 in all). So 126 wins; 125 is cut by the
// saturation bound. Variants: 8 distinct values (the DP's "every value alone" case), 36 distinct
// values (7 tight clusters and the outlier: full DP layers), a negative outlier, and an ordinary
// tile beside them.
TEST(FitGpuOptimal, ScaleSearchBelowRceil) {
  LUTB_GPU_OR_SKIP();
  const float big = 224.0f * (1.0f + std::ldexp(1.0f, -20));
  std::vector<std::vector<float>> tiles;
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<float> t(512);
    for (int f = 0; f < 512; ++f) {
      const int q = (f * 13) % 7;  // -5, -3, ..., 7 times 2^-10
      t[f] = std::ldexp(static_cast<float>(2 * (q - 3) + 1), -10);
      if (variant == 1) t[f] += std::ldexp(static_cast<float>((f * 7) % 5 - 2), -22);  // 35 distinct
    }
    t[100] = variant == 2 ? -big : big;
    tiles.push_back(t);
  }
  tiles.push_back(random_values(512, Dist::kGauss, 0.02f, 4));
  const std::int64_t nt = static_cast<std::int64_t>(tiles.size());
  std::vector<float> m(static_cast<std::size_t>(512 * nt));
  for (std::int64_t t = 0; t < nt; ++t)
    for (int f = 0; f < 512; ++f) m[static_cast<std::size_t>((f / 64) * 64 * nt + t * 64 + f % 64)] = tiles[t][f];
  const LutbShape s = stack(1, 8, 64 * nt);
  FitOptions fo;
  fo.fitter = "optimal";
  LutbTensor cpu;
  quantize(m.data(), DType::F32, s, cpu, fo, "t");
  // The CPU reference really takes a scale below rceil (127) on the constructed tiles.
  for (int t = 0; t < 3; ++t) EXPECT_EQ(cpu.scale[static_cast<std::size_t>(t)], 126) << "tile " << t;
  EXPECT_EQ(expect_same_optimal(m.data(), DType::F32, s), nt);
}

// The warp kernel's scan variants (cost evaluations issued 1, 2 or 4 at a time) and cost-arithmetic
// variants (0: IEEE division, the previous default; 1: table division only; 2: table division +
// e4m3_nearest_fast; the default 3: 2 with prefix sums scaled once per scale; the benchmark times
// them) write the CPU's bytes and per-tile sums
// too, for both fitters: edge tiles (subnormal magnitudes, forced-scale-like extremes, zeros) and
// Student-t tiles side by side.
TEST(FitGpu, ScanVariantsSameBytes) {
  LUTB_GPU_OR_SKIP();
  std::int64_t ne = 0;
  const std::vector<float> edges = edge_tiles(ne);
  const std::int64_t nr = 12, nt = ne + nr;
  const auto rnd = random_values(static_cast<std::size_t>(512 * nr), Dist::kStudentT3, 0.02f, 41);
  std::vector<float> m(static_cast<std::size_t>(512 * nt));
  for (int r = 0; r < 8; ++r)
    for (std::int64_t c = 0; c < 64 * nt; ++c)
      m[static_cast<std::size_t>(r * 64 * nt + c)] =
          c < 64 * ne ? edges[static_cast<std::size_t>(r * 64 * ne + c)]
                      : rnd[static_cast<std::size_t>(r * 64 * nr + (c - 64 * ne))];
  const LutbShape s = stack(1, 8, 64 * nt);
  const std::size_t n = static_cast<std::size_t>(nt);
  float* d_src = nullptr;
  std::uint8_t* d_out = nullptr;
  double* d_sums = nullptr;
  unsigned long long* d_err = nullptr;
  ASSERT_EQ(cudaMalloc(&d_src, m.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, n * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_sums, n * 16), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_src, m.data(), m.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  for (const char* fitter : {"binned-dp", "optimal"}) {
    FitOptions fo;
    fo.fitter = fitter;
    LutbTensor cpu;
    const FitStats sc = quantize(m.data(), DType::F32, s, cpu, fo, "t");
    const bool opt = std::string(fitter) == "optimal";
    const int du = opt ? 4 : 1, da = cuda::fit_internal::kWarpArithDefault;
    std::vector<std::pair<int, int>> variants{{1, da}, {2, da}, {4, da}, {du, 0}, {du, 2}};
    if (!opt) variants.emplace_back(du, 1);
    for (const auto& [unroll, arith] : variants) {
      SCOPED_TRACE(std::string(fitter) + ", unroll " + std::to_string(unroll) + ", arith " + std::to_string(arith));
      cuda::fit_internal::KernelArgs ka{d_src, 0, 8, 64 * nt, 1, nt, nt, 0,
                                        cuda::DeviceFitOut{d_out, d_out + n * kPackedBytes,
                                                           d_out + n * (kPackedBytes + kCodebookSize), d_sums, d_sums + n},
                                        -1, d_err};
      ka.optimal = opt;
      ASSERT_EQ(cudaMemset(d_out, 0, n * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
      ASSERT_EQ(cudaMemset(d_err, 0xff, 8), cudaSuccess);
      cuda::fit_internal::launch_warp_variant(ka, unroll, arith, nullptr);
      std::vector<std::uint8_t> h(n * (kPackedBytes + kCodebookSize + 1));
      std::vector<double> sums(2 * n);
      unsigned long long word = 0;
      ASSERT_EQ(cudaMemcpy(h.data(), d_out, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(sums.data(), d_sums, n * 16, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(&word, d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cuda::decode_fit_error(word).code, 0);
      EXPECT_TRUE(std::equal(cpu.packed.begin(), cpu.packed.end(), h.begin()));
      EXPECT_TRUE(std::equal(cpu.codebook.begin(), cpu.codebook.end(), h.begin() + n * kPackedBytes));
      EXPECT_TRUE(std::equal(cpu.scale.begin(), cpu.scale.end(), h.begin() + n * (kPackedBytes + kCodebookSize)));
      FitStats sg;
      for (std::size_t t = 0; t < n; ++t) {
        sg.sse += sums[t];
        sg.sum_sq += sums[n + t];
      }
      EXPECT_EQ(sg.sse, sc.sse);
      EXPECT_EQ(sg.sum_sq, sc.sum_sq);
    }
  }
  cudaFree(d_src);
  cudaFree(d_out);
  cudaFree(d_sums);
  cudaFree(d_err);
}

// The binned-dp kernel with two tiles per warp (fit_internal::launch_warp_tiles(a, 2): the DP and
// the refinement of two tiles at once, 16 lanes each) on `src` ([e, n, k], F32 or BF16): the CPU's
// packed bytes, codebooks, scales, per-tile sums (sse and sum of squares added in tile order ==
// FitStats) and no error word; with `sums` false, the bytes without the per-tile sums. Returns the
// number of tiles.
// `layout` -1: two tiles per warp (launch_warp_tiles(a, 2)); 0..4: the one-tile kernel with that
// shared-memory layout (launch_warp_layout, fit12), with the DP mode `dp_mode` (launch_warp_dp, fit13);
// with `shape` (warps > 0) through fit17's launch_warp_shape(layout, dp_mode, warps, grid, a counter,
// max_blocks) instead.
struct ShapeSel {
  int warps = 0, grid = 0, max_blocks = 0;
};
std::int64_t expect_two_tiles_same(const void* src, DType type, const LutbShape& s, int forced_scale = -1,
                                   bool sums = true, int layout = -1, int dp_mode = 0, const ShapeSel* shape = nullptr) {
  FitOptions fo;
  fo.forced_scale = forced_scale;
  LutbTensor cpu;
  const FitStats sc = quantize(src, type, s, cpu, fo, "t");
  const std::size_t n = static_cast<std::size_t>(s.tiles());
  const std::size_t bytes = static_cast<std::size_t>(s.experts * s.rows * s.cols) * (type == DType::F32 ? 4 : 2);
  void* d_src = nullptr;
  std::uint8_t* d_out = nullptr;
  double* d_sums = nullptr;
  unsigned long long* d_err = nullptr;
  EXPECT_EQ(cudaMalloc(&d_src, bytes), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_out, n * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_sums, n * 16), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d_src, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_out, 0, n * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_sums, 0, n * 16), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_err, 0xff, 8), cudaSuccess);
  cuda::fit_internal::KernelArgs ka{d_src, type == DType::F32 ? 0 : 1, s.rows, s.cols, s.tiles_n(), s.tiles_k(),
                                    s.tiles(), 0,
                                    cuda::DeviceFitOut{d_out, d_out + n * kPackedBytes,
                                                       d_out + n * (kPackedBytes + kCodebookSize),
                                                       sums ? d_sums : nullptr, sums ? d_sums + n : nullptr},
                                    forced_scale, d_err};
  unsigned long long* d_ctr = nullptr;
  if (shape != nullptr && shape->warps > 0) {
    EXPECT_EQ(cudaMalloc(&d_ctr, 8), cudaSuccess);
    cuda::fit_internal::launch_warp_shape(ka, layout, dp_mode, shape->warps, shape->grid, d_ctr, nullptr, shape->max_blocks);
  } else if (layout < 0) {
    cuda::fit_internal::launch_warp_tiles(ka, 2, nullptr);
  } else if (dp_mode != 0) {
    cuda::fit_internal::launch_warp_dp(ka, layout, dp_mode, nullptr);
  } else {
    cuda::fit_internal::launch_warp_layout(ka, layout, nullptr);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaFree(d_ctr);
  std::vector<std::uint8_t> h(n * (kPackedBytes + kCodebookSize + 1));
  std::vector<double> hs(2 * n);
  unsigned long long word = 0;
  EXPECT_EQ(cudaMemcpy(h.data(), d_out, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(hs.data(), d_sums, n * 16, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(&word, d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d_src);
  cudaFree(d_out);
  cudaFree(d_sums);
  cudaFree(d_err);
  EXPECT_EQ(cuda::decode_fit_error(word).code, 0);
  std::int64_t bad = -1;
  for (std::size_t t = 0; t < n && bad < 0; ++t)
    if (std::memcmp(h.data() + t * kPackedBytes, cpu.packed.data() + t * kPackedBytes, kPackedBytes) != 0 ||
        std::memcmp(h.data() + n * kPackedBytes + t * kCodebookSize, cpu.codebook.data() + t * kCodebookSize,
                    kCodebookSize) != 0 ||
        h[n * (kPackedBytes + kCodebookSize) + t] != cpu.scale[t])
      bad = static_cast<std::int64_t>(t);
  EXPECT_EQ(bad, -1) << (layout < 0 ? "two tiles per warp" : "layout " + std::to_string(layout))
                     << (dp_mode != 0 ? ", DP mode " + std::to_string(dp_mode) : std::string())
                     << (shape != nullptr ? ", warps " + std::to_string(shape->warps) + " grid " + std::to_string(shape->grid) +
                                                " max_blocks " + std::to_string(shape->max_blocks)
                                          : std::string())
                     << ": bytes differ first at tile " << bad;
  if (sums) {
    FitStats sg;
    for (std::size_t t = 0; t < n; ++t) {
      sg.sse += hs[t];
      sg.sum_sq += hs[n + t];
    }
    EXPECT_EQ(sg.sse, sc.sse);
    EXPECT_EQ(sg.sum_sq, sc.sum_sq);
  } else {
    EXPECT_TRUE(std::all_of(hs.begin(), hs.end(), [](double x) { return x == 0.0; }));  // nothing written
  }
  return static_cast<std::int64_t>(n);
}

// Two tiles per warp (the DP phase on half-warps) writes the CPU's bytes and sums: the edge tiles
// (an odd count: the last warp has one tile), F32 and BF16, forced scales, mixed tiles, one padded
// tile alone; the error word of a NaN / -Inf tile in either position of a pair equals the one-tile
// kernel's; optimal and other widths are refused. (Random stacks: TwoTilesPerWarpRandom.)
TEST(FitGpu, TwoTilesPerWarpEdgeTiles) {
  LUTB_GPU_OR_SKIP();
  std::int64_t ne0 = 0;
  const std::vector<float> e0 = edge_tiles(ne0);
  // An odd count (the last warp has one tile): the edge tiles, plus one Student-t tile when even.
  const std::int64_t ne = ne0 | 1;
  std::vector<float> edges(static_cast<std::size_t>(8 * 64 * ne));
  const auto extra = random_values(512, Dist::kStudentT3, 0.02f, 3);
  for (int r = 0; r < 8; ++r)
    for (std::int64_t c = 0; c < 64 * ne; ++c)
      edges[static_cast<std::size_t>(r * 64 * ne + c)] = c < 64 * ne0 ? e0[static_cast<std::size_t>(r * 64 * ne0 + c)]
                                                                      : extra[static_cast<std::size_t>(r * 64 + c % 64)];
  EXPECT_EQ(expect_two_tiles_same(edges.data(), DType::F32, stack(1, 8, 64 * ne)), ne);
  const auto eb = to_bf16(edges);
  EXPECT_EQ(expect_two_tiles_same(eb.data(), DType::BF16, stack(1, 8, 64 * ne)), ne);
  const auto small = random_values(8 * 64 * 5, Dist::kStudentT3, 0.02f, 9);
  for (int fs : {3, 100, 120, 127, 246}) {
    SCOPED_TRACE("forced scale " + std::to_string(fs));
    expect_two_tiles_same(small.data(), DType::F32, stack(1, 8, 320), fs);
  }
  {
    const auto one = to_bf16(random_values(5 * 33, Dist::kGauss, 0.02f, 4));  // [1, 5, 33]: one padded tile
    EXPECT_EQ(expect_two_tiles_same(one.data(), DType::BF16, stack(1, 5, 33)), 1);
  }
  {  // mixed tiles: log-uniform magnitudes over 32 binades, sparse tiles, 33..64 distinct values
    std::mt19937 g(78);
    std::uniform_real_distribution<float> ud(-30.0f, 2.0f);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::bernoulli_distribution sign(0.5), sparse(0.1);
    const int nt = 63;
    std::vector<float> m(static_cast<std::size_t>(8 * 64 * nt));
    for (int t = 0; t < nt; ++t)
      for (int f = 0; f < 512; ++f) {
        float v;
        if (t % 3 == 0) v = (sign(g) ? 1.0f : -1.0f) * std::exp2(ud(g));
        else if (t % 3 == 1) v = sparse(g) ? 0.05f * nd(g) : 0.0f;
        else v = 0.001f * static_cast<float>((f * 37) % (33 + t % 32)) - 0.02f;
        m[static_cast<std::size_t>((f / 64) * 64 * nt + t * 64 + f % 64)] = v;
      }
    EXPECT_EQ(expect_two_tiles_same(m.data(), DType::F32, stack(1, 8, 64 * nt)), nt);
  }
  // Error words: a NaN in tile 2 (first of a pair) or tile 3 (second), and -Inf in both.
  for (int which = 0; which < 3; ++which) {
    SCOPED_TRACE("error case " + std::to_string(which));
    auto v = random_values(8 * 64 * 6, Dist::kGauss, 0.02f, 12);
    if (which != 1) v[static_cast<std::size_t>(3 * 64 * 6 + 2 * 64 + 17)] = std::numeric_limits<float>::quiet_NaN();
    if (which != 0) v[static_cast<std::size_t>(5 * 64 * 6 + 3 * 64 + 60)] = -std::numeric_limits<float>::infinity();
    float* d_src = nullptr;
    std::uint8_t* d_out = nullptr;
    unsigned long long* d_err = nullptr;
    ASSERT_EQ(cudaMalloc(&d_src, v.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_out, 6 * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_src, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    unsigned long long words[2] = {};
    for (int tpw : {1, 2}) {
      cuda::fit_internal::KernelArgs ka{d_src, 0, 8, 64 * 6, 1, 6, 6, 0,
                                        cuda::DeviceFitOut{d_out, d_out + 6 * kPackedBytes,
                                                           d_out + 6 * (kPackedBytes + kCodebookSize), nullptr, nullptr},
                                        -1, d_err};
      ASSERT_EQ(cudaMemset(d_err, 0xff, 8), cudaSuccess);
      cuda::fit_internal::launch_warp_tiles(ka, tpw, nullptr);
      ASSERT_EQ(cudaMemcpy(&words[tpw - 1], d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    const cuda::GpuFitError e = cuda::decode_fit_error(words[1]);
    EXPECT_EQ(words[1], words[0]);
    EXPECT_EQ(e.tile, which == 1 ? 3 : 2);
    EXPECT_EQ(e.code, which == 1 ? 3 : 1);  // 1 NaN, 3 -Inf
    cudaFree(d_src);
    cudaFree(d_out);
    cudaFree(d_err);
  }
  cuda::fit_internal::KernelArgs ka{};
  ka.tiles = 1;
  ka.optimal = true;
  EXPECT_THROW(cuda::fit_internal::launch_warp_tiles(ka, 2, nullptr), std::invalid_argument);
  ka.optimal = false;
  EXPECT_THROW(cuda::fit_internal::launch_warp_tiles(ka, 4, nullptr), std::invalid_argument);
}

// Two tiles per warp on random Gaussian / Student-t(3) / Laplace stacks: BF16 [2, 64, 512] (also
// without the per-tile sums), FP32 [2, 128, 1024] (512 distinct values per tile: the most bin
// edges, the widest DP tree levels), padded [3, 21, 200], [1, 13, 70], [1, 5, 33].
TEST(FitGpu, TwoTilesPerWarpRandom) {
  LUTB_GPU_OR_SKIP();
  struct Case {
    Dist d;
    std::int64_t e, n, k;
    bool bf16;
  };
  for (const Case& c : {Case{Dist::kGauss, 2, 64, 512, true}, Case{Dist::kStudentT3, 2, 64, 512, true},
                        Case{Dist::kLaplace, 2, 64, 512, true}, Case{Dist::kStudentT3, 2, 128, 1024, false},
                        Case{Dist::kGauss, 2, 128, 1024, false}, Case{Dist::kGauss, 3, 21, 200, false},
                        Case{Dist::kStudentT3, 3, 21, 200, true}, Case{Dist::kLaplace, 1, 13, 70, false},
                        Case{Dist::kGauss, 1, 5, 33, true}}) {
    SCOPED_TRACE("dist " + std::to_string(static_cast<int>(c.d)) + " [" + std::to_string(c.e) + ", " +
                 std::to_string(c.n) + ", " + std::to_string(c.k) + "]" + (c.bf16 ? " BF16" : " F32"));
    const LutbShape s = stack(c.e, c.n, c.k);
    const auto v = random_values(static_cast<std::size_t>(c.e * c.n * c.k), c.d, 0.02f,
                                 static_cast<std::uint32_t>(101 * c.n + c.k + static_cast<int>(c.d)));
    if (c.bf16) {
      const auto b = to_bf16(v);
      EXPECT_GT(expect_two_tiles_same(b.data(), DType::BF16, s), 0);
      if (c.n == 64 && c.d == Dist::kGauss) {
        EXPECT_GT(expect_two_tiles_same(b.data(), DType::BF16, s, -1, false), 0);
      }
    } else {
      EXPECT_GT(expect_two_tiles_same(v.data(), DType::F32, s), 0);
    }
  }
}

// The one-tile binned-dp kernel's shared-memory layouts (fit12, fit_internal::launch_warp_layout):
// 0 fit11's (prefix sums in shared memory), 1..4 the compact one (prefix sums at the bin edges,
// the refinement windows' sums re-derived per round, chunked running and flat-order sums) in 4- and
// 2-warp blocks compiled for 20 and 24 resident warps per SM (4: the values read again for the
// encoding). Each writes the CPU's bytes and sums: the edge tiles F32 and
// BF16 (also without the sums), forced scales 3..246, mixed tiles (log-uniform over 32 binades,
// sparse, 33..64 distinct values), one padded tile, random Gaussian / Student-t(3) / Laplace BF16
// [2, 64, 512], FP32 [2, 128, 1024] (512 distinct values: the most bin edges and refinement
// windows), padded [3, 21, 200] and [1, 13, 70]; the error word of a NaN / -Inf stack equals
// layout 0's; other layouts are refused.
// The cases of LayoutsSameBytes for one (layout, DP mode) pair.
void layout_cases(int layout, int dp_mode, const ShapeSel* shape = nullptr) {
  std::int64_t ne = 0;
  const std::vector<float> edges = edge_tiles(ne);
  const auto eb = to_bf16(edges);
  const auto small = random_values(8 * 64 * 5, Dist::kStudentT3, 0.02f, 9);
  std::vector<float> mixed;
  const int nmix = 63;
  {
    std::mt19937 g(79);
    std::uniform_real_distribution<float> ud(-30.0f, 2.0f);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::bernoulli_distribution sign(0.5), sparse(0.1);
    mixed.resize(static_cast<std::size_t>(8 * 64 * nmix));
    for (int t = 0; t < nmix; ++t)
      for (int f = 0; f < 512; ++f) {
        float v;
        if (t % 3 == 0) v = (sign(g) ? 1.0f : -1.0f) * std::exp2(ud(g));
        else if (t % 3 == 1) v = sparse(g) ? 0.05f * nd(g) : 0.0f;
        else v = 0.001f * static_cast<float>((f * 37) % (33 + t % 32)) - 0.02f;
        mixed[static_cast<std::size_t>((f / 64) * 64 * nmix + t * 64 + f % 64)] = v;
      }
  }
  {
    SCOPED_TRACE("layout " + std::to_string(layout) + ", DP mode " + std::to_string(dp_mode) +
                 (shape != nullptr ? ", warps " + std::to_string(shape->warps) + ", grid " + std::to_string(shape->grid) : std::string()));
    EXPECT_EQ(expect_two_tiles_same(edges.data(), DType::F32, stack(1, 8, 64 * ne), -1, true, layout, dp_mode, shape), ne);
    EXPECT_EQ(expect_two_tiles_same(eb.data(), DType::BF16, stack(1, 8, 64 * ne), -1, true, layout, dp_mode, shape), ne);
    EXPECT_EQ(expect_two_tiles_same(eb.data(), DType::BF16, stack(1, 8, 64 * ne), -1, false, layout, dp_mode, shape), ne);
    for (int fs : {3, 100, 120, 127, 246}) {
      SCOPED_TRACE("forced scale " + std::to_string(fs));
      expect_two_tiles_same(small.data(), DType::F32, stack(1, 8, 320), fs, true, layout, dp_mode, shape);
    }
    EXPECT_EQ(expect_two_tiles_same(mixed.data(), DType::F32, stack(1, 8, 64 * nmix), -1, true, layout, dp_mode, shape), nmix);
    struct Case {
      Dist d;
      std::int64_t e, n, k;
      bool bf16;
    };
    for (const Case& c : {Case{Dist::kGauss, 2, 64, 512, true}, Case{Dist::kStudentT3, 2, 64, 512, true},
                          Case{Dist::kLaplace, 2, 64, 512, true}, Case{Dist::kStudentT3, 2, 128, 1024, false},
                          Case{Dist::kGauss, 2, 128, 1024, false}, Case{Dist::kGauss, 3, 21, 200, false},
                          Case{Dist::kLaplace, 1, 13, 70, true}, Case{Dist::kGauss, 1, 5, 33, true}}) {
      SCOPED_TRACE("dist " + std::to_string(static_cast<int>(c.d)) + " [" + std::to_string(c.e) + ", " +
                   std::to_string(c.n) + ", " + std::to_string(c.k) + "]" + (c.bf16 ? " BF16" : " F32"));
      const LutbShape s = stack(c.e, c.n, c.k);
      const auto v = random_values(static_cast<std::size_t>(c.e * c.n * c.k), c.d, 0.02f,
                                   static_cast<std::uint32_t>(103 * c.n + c.k + static_cast<int>(c.d)));
      if (c.bf16) EXPECT_GT(expect_two_tiles_same(to_bf16(v).data(), DType::BF16, s, -1, true, layout, dp_mode, shape), 0);
      else EXPECT_GT(expect_two_tiles_same(v.data(), DType::F32, s, -1, true, layout, dp_mode, shape), 0);
    }
  }
}

TEST(FitGpu, LayoutsSameBytes) {
  LUTB_GPU_OR_SKIP();
  for (int layout : {0, 1, 2, 3, 4}) layout_cases(layout, 0);
  {  // error words: NaN in tile 2, -Inf in tile 3 of 6
    auto v = random_values(8 * 64 * 6, Dist::kGauss, 0.02f, 13);
    v[static_cast<std::size_t>(3 * 64 * 6 + 2 * 64 + 17)] = std::numeric_limits<float>::quiet_NaN();
    v[static_cast<std::size_t>(5 * 64 * 6 + 3 * 64 + 60)] = -std::numeric_limits<float>::infinity();
    float* d_src = nullptr;
    std::uint8_t* d_out = nullptr;
    unsigned long long* d_err = nullptr;
    ASSERT_EQ(cudaMalloc(&d_src, v.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_out, 6 * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_src, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    unsigned long long words[5] = {};
    for (int layout : {0, 1, 2, 3, 4}) {
      cuda::fit_internal::KernelArgs ka{d_src, 0, 8, 64 * 6, 1, 6, 6, 0,
                                        cuda::DeviceFitOut{d_out, d_out + 6 * kPackedBytes,
                                                           d_out + 6 * (kPackedBytes + kCodebookSize), nullptr, nullptr},
                                        -1, d_err};
      ASSERT_EQ(cudaMemset(d_err, 0xff, 8), cudaSuccess);
      cuda::fit_internal::launch_warp_layout(ka, layout, nullptr);
      ASSERT_EQ(cudaMemcpy(&words[layout], d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    for (int layout = 1; layout < 5; ++layout) EXPECT_EQ(words[layout], words[0]) << "layout " << layout;
    EXPECT_EQ(cuda::decode_fit_error(words[0]).tile, 2);
    EXPECT_EQ(cuda::decode_fit_error(words[0]).code, 1);
    cudaFree(d_src);
    cudaFree(d_out);
    cudaFree(d_err);
  }
  cuda::fit_internal::KernelArgs ka{};
  ka.tiles = 1;
  EXPECT_THROW(cuda::fit_internal::launch_warp_layout(ka, 5, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_layout(ka, -1, nullptr), std::invalid_argument);
}

// fit13: the binned DP's layers solved for every end position at once over the full start ranges
// (fit_internal::launch_warp_dp modes 1, 2, the two-passes-per-iteration form 4, the
// chunk-per-lane forms 6, 7; layouts 0 and 1), and modes 3 and 8, where every layer is
// solved that way and then ALWAYS recomputed by the divide and conquer (the path of a layer whose
// minima are not monotone): the CPU's bytes and sums on every case of LayoutsSameBytes (edge tiles,
// forced scales, mixed tiles, random Gaussian / Student-t(3) / Laplace, 512-distinct FP32 tiles with
// up to 49 bin edges, padded tiles). Mode 0 is launch_warp_layout itself; bad modes are refused.
TEST(FitGpu, FullRangeDpSameBytes) {
  LUTB_GPU_OR_SKIP();
  for (int layout : {0, 1})
    for (int dp_mode : {1, 2, 3, 4, 6, 7, 8})
      if (layout == 0 || dp_mode != 4) layout_cases(layout, dp_mode);
  {  // error words of a NaN / -Inf stack: those of the default DP
    auto v = random_values(8 * 64 * 6, Dist::kGauss, 0.02f, 13);
    v[static_cast<std::size_t>(3 * 64 * 6 + 2 * 64 + 17)] = std::numeric_limits<float>::quiet_NaN();
    v[static_cast<std::size_t>(5 * 64 * 6 + 3 * 64 + 60)] = -std::numeric_limits<float>::infinity();
    float* d_src = nullptr;
    std::uint8_t* d_out = nullptr;
    unsigned long long* d_err = nullptr;
    ASSERT_EQ(cudaMalloc(&d_src, v.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_out, 6 * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_src, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    for (int layout : {0, 1})
      for (int dp_mode : {1, 2, 4, 6, 7}) {
        if (layout == 1 && dp_mode == 4) continue;
        cuda::fit_internal::KernelArgs ka{d_src, 0, 8, 64 * 6, 1, 6, 6, 0,
                                          cuda::DeviceFitOut{d_out, d_out + 6 * kPackedBytes,
                                                             d_out + 6 * (kPackedBytes + kCodebookSize), nullptr, nullptr},
                                          -1, d_err};
        unsigned long long word = 0;
        ASSERT_EQ(cudaMemset(d_err, 0xff, 8), cudaSuccess);
        cuda::fit_internal::launch_warp_dp(ka, layout, dp_mode, nullptr);
        ASSERT_EQ(cudaMemcpy(&word, d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(cuda::decode_fit_error(word).tile, 2) << "layout " << layout << ", DP mode " << dp_mode;
        EXPECT_EQ(cuda::decode_fit_error(word).code, 1) << "layout " << layout << ", DP mode " << dp_mode;
      }
    cudaFree(d_src);
    cudaFree(d_out);
    cudaFree(d_err);
  }
  cuda::fit_internal::KernelArgs ka{};
  ka.tiles = 1;
  EXPECT_THROW(cuda::fit_internal::launch_warp_dp(ka, 0, 9, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_dp(ka, 0, 5, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_dp(ka, 1, -1, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_dp(ka, 2, 1, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_dp(ka, 1, 4, nullptr), std::invalid_argument);
}

// The same on a small stack for the sanitizers (memcheck, racecheck, synccheck): the edge tiles and
// two 512-distinct FP32 tiles (the most bin edges: the most pairs per layer), DP modes 1, 3 (the
// fallback path), 4 (two passes at a time), 6 (a chunk per lane), 8 (6 + the fallback) on layout
// 0, all but 4 on layout 1.
TEST(FitGpu, FullRangeDpEdgeTiles) {
  LUTB_GPU_OR_SKIP();
  std::int64_t ne = 0;
  const std::vector<float> edges = edge_tiles(ne);
  const auto wide = random_values(8 * 64 * 2, Dist::kStudentT3, 0.02f, 41);
  for (int layout : {0, 1})
    for (int dp_mode : {1, 3, 4, 6, 8}) {
      if (layout == 1 && dp_mode == 4) continue;
      SCOPED_TRACE("layout " + std::to_string(layout) + ", DP mode " + std::to_string(dp_mode));
      EXPECT_EQ(expect_two_tiles_same(edges.data(), DType::F32, stack(1, 8, 64 * ne), -1, true, layout, dp_mode), ne);
      EXPECT_EQ(expect_two_tiles_same(wide.data(), DType::F32, stack(1, 8, 128), -1, true, layout, dp_mode), 2);
    }
}

// fit16: the binned DP over a table of every pair of bin edges' run cost, computed once per tile
// (fit_internal::launch_warp_dp modes 9: the layers as mode 6 reading the table, 10: as mode 0
// reading it, 11: as mode 8 (every layer then ALSO recomputed by the divide and conquer over the
// table: the fallback path), 12: 9 compiled for 18 warps per SM, 14: the table filled but mode 0's DP
// evaluating (a diagnostic); layout 1 only): the CPU's bytes and
// sums on every case of LayoutsSameBytes (edge tiles F32 / BF16 with and without the sums, forced
// scales 3..246, 63 mixed tiles, random Gaussian / Student-t(3) / Laplace, FP32 512-distinct tiles
// with the most bin edges (the largest tables), padded shapes); the error word of a NaN / -Inf
// stack; the table modes refused on other layouts.
TEST(FitGpu, CostTableDpSameBytes) {
  LUTB_GPU_OR_SKIP();
  for (int dp_mode : {9, 10, 11, 12, 14}) layout_cases(1, dp_mode);
  {  // 12,416 B of static shared memory per warp: 8 two-warp blocks per SM of 228 KiB (sm_90)
    int dev = 0, smem = 0;
    ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev), cudaSuccess);
    if (smem == 233472) {
      EXPECT_EQ(cuda::fit_internal::resident_warps_table(9), 16);
      EXPECT_EQ(cuda::fit_internal::resident_warps_table(12), 18);
    }
  }
  {  // error words of a NaN / -Inf stack: those of the default DP
    auto v = random_values(8 * 64 * 6, Dist::kGauss, 0.02f, 13);
    v[static_cast<std::size_t>(3 * 64 * 6 + 2 * 64 + 17)] = std::numeric_limits<float>::quiet_NaN();
    v[static_cast<std::size_t>(5 * 64 * 6 + 3 * 64 + 60)] = -std::numeric_limits<float>::infinity();
    float* d_src = nullptr;
    std::uint8_t* d_out = nullptr;
    unsigned long long* d_err = nullptr;
    ASSERT_EQ(cudaMalloc(&d_src, v.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_out, 6 * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_src, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    for (int dp_mode : {9, 10, 12}) {
      cuda::fit_internal::KernelArgs ka{d_src, 0, 8, 64 * 6, 1, 6, 6, 0,
                                        cuda::DeviceFitOut{d_out, d_out + 6 * kPackedBytes,
                                                           d_out + 6 * (kPackedBytes + kCodebookSize), nullptr, nullptr},
                                        -1, d_err};
      unsigned long long word = 0;
      ASSERT_EQ(cudaMemset(d_err, 0xff, 8), cudaSuccess);
      cuda::fit_internal::launch_warp_dp(ka, 1, dp_mode, nullptr);
      ASSERT_EQ(cudaMemcpy(&word, d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cuda::decode_fit_error(word).tile, 2) << "DP mode " << dp_mode;
      EXPECT_EQ(cuda::decode_fit_error(word).code, 1) << "DP mode " << dp_mode;
    }
    cudaFree(d_src);
    cudaFree(d_out);
    cudaFree(d_err);
  }
  cuda::fit_internal::KernelArgs ka{};
  ka.tiles = 1;
  for (int layout : {0, 2, 3, 4})
    EXPECT_THROW(cuda::fit_internal::launch_warp_dp(ka, layout, 9, nullptr), std::invalid_argument) << layout;
  EXPECT_THROW(cuda::fit_internal::launch_warp_dp(ka, 1, 15, nullptr), std::invalid_argument);
}

// The same on a small stack for the sanitizers (memcheck, racecheck, synccheck): the edge tiles and
// two 512-distinct FP32 tiles (the most bin edges: the largest table), every table mode, and the
// diagnostic modes 13 (the table layout without the table) and 14 (the table filled, not read).
TEST(FitGpu, CostTableDpEdgeTiles) {
  LUTB_GPU_OR_SKIP();
  std::int64_t ne = 0;
  const std::vector<float> edges = edge_tiles(ne);
  const auto wide = random_values(8 * 64 * 2, Dist::kStudentT3, 0.02f, 41);
  for (int dp_mode : {9, 10, 11, 12, 13, 14}) {
    SCOPED_TRACE("DP mode " + std::to_string(dp_mode));
    EXPECT_EQ(expect_two_tiles_same(edges.data(), DType::F32, stack(1, 8, 64 * ne), -1, true, 1, dp_mode), ne);
    EXPECT_EQ(expect_two_tiles_same(wide.data(), DType::F32, stack(1, 8, 128), -1, true, 1, dp_mode), 2);
  }
}

// fit17: the block shape as a launch choice (fit_internal::launch_warp_shape): every supported
// (layout, DP mode) -- (1, 0) fit12's kernel with the per-tile sums, (0, 6) the bytes-only kernel,
// (1, 9), (1, 10), (1, 13) fit16's table modes; (1, 10) and (0, 6) in 4-warp blocks, one tile per
// warp, are launch_warp's defaults since fit17 -- in 1-, 2- and 4-warp blocks of dynamic shared memory
// (and, fit18, 8- and 16-warp blocks for (1, 0), (0, 6) and (1, 10)),
// with one tile per warp (grid 0) and on persistent grids by stride (1) and by a shared counter (2),
// the persistent grids capped at 3 blocks so that every warp loops over many tiles (up to 171 on the
// 512-tile stacks) in an order that the counter makes depend on timing: the CPU's bytes and sums on
// every case of LayoutsSameBytes; a 4,096-tile stack (more tiles than an H200's resident warps)
// on the uncapped persistent grids; the error word of a NaN / -Inf stack (the lowest failing tile,
// whatever the order); the resident warps of the compact and table shapes; bad arguments refused.
TEST(FitGpu, BlockShapesSameBytes) {
  LUTB_GPU_OR_SKIP();
  const std::pair<int, int> pairs[] = {{1, 0}, {0, 6}, {1, 9}, {1, 10}, {1, 13}};
  // 8- and 16-warp blocks (fit18) exist for (1, 0), (0, 6) and (1, 10)
  const auto wide_ok = [](int layout, int dp_mode) { return layout == 0 || dp_mode == 0 || dp_mode == 10; };
  for (const auto& [layout, dp_mode] : pairs)
    for (int warps : {1, 2, 4, 8, 16})
      for (int grid : {0, 1, 2}) {
        if (warps > 4 && !wide_ok(layout, dp_mode)) continue;
        const ShapeSel sel{warps, grid, grid == 0 ? 0 : 3};
        layout_cases(layout, dp_mode, &sel);
      }
  {  // uncapped persistent grids on a stack of more tiles than the GPU has resident warps
    const LutbShape s = stack(1, 512, 4096);
    const auto b = to_bf16(random_values(512 * 4096, Dist::kStudentT3, 0.02f, 171));
    for (const auto& [layout, dp_mode] : pairs)
      for (int warps : {4, 16})
        for (int grid : {1, 2}) {
          if (warps > 4 && !wide_ok(layout, dp_mode)) continue;
          const ShapeSel sel{warps, grid, 0};
          EXPECT_EQ(expect_two_tiles_same(b.data(), DType::BF16, s, -1, true, layout, dp_mode, &sel), 4096)
              << layout << " " << dp_mode << " " << warps << " " << grid;
        }
  }
  {  // error words of a NaN / -Inf stack: tile 2 (NaN) whatever warp takes which tile
    auto v = random_values(8 * 64 * 6, Dist::kGauss, 0.02f, 13);
    v[static_cast<std::size_t>(3 * 64 * 6 + 2 * 64 + 17)] = std::numeric_limits<float>::quiet_NaN();
    v[static_cast<std::size_t>(5 * 64 * 6 + 3 * 64 + 60)] = -std::numeric_limits<float>::infinity();
    float* d_src = nullptr;
    std::uint8_t* d_out = nullptr;
    unsigned long long *d_err = nullptr, *d_ctr = nullptr;
    ASSERT_EQ(cudaMalloc(&d_src, v.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_out, 6 * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_ctr, 8), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_src, v.data(), v.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    for (const auto& [layout, dp_mode] : pairs)
      for (int warps : {1, 4, 8})
        for (int grid : {0, 1, 2}) {
          if (warps > 4 && !wide_ok(layout, dp_mode)) continue;
          cuda::fit_internal::KernelArgs ka{d_src, 0, 8, 64 * 6, 1, 6, 6, 0,
                                            cuda::DeviceFitOut{d_out, d_out + 6 * kPackedBytes,
                                                               d_out + 6 * (kPackedBytes + kCodebookSize), nullptr, nullptr},
                                            -1, d_err};
          unsigned long long word = 0;
          ASSERT_EQ(cudaMemset(d_err, 0xff, 8), cudaSuccess);
          cuda::fit_internal::launch_warp_shape(ka, layout, dp_mode, warps, grid, d_ctr, nullptr, grid == 0 ? 0 : 1);
          ASSERT_EQ(cudaMemcpy(&word, d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
          const std::string at = "layout " + std::to_string(layout) + ", DP mode " + std::to_string(dp_mode) + ", warps " +
                                 std::to_string(warps) + ", grid " + std::to_string(grid);
          EXPECT_EQ(cuda::decode_fit_error(word).tile, 2) << at;
          EXPECT_EQ(cuda::decode_fit_error(word).code, 1) << at;
          EXPECT_EQ(cuda::decode_fit_error(word).pos, 3 * 64 + 17) << at;
        }
    cudaFree(d_src);
    cudaFree(d_out);
    cudaFree(d_err);
    cudaFree(d_ctr);
  }
  {  // resident warps per SM of 228 KiB (sm_90): the compact layout at 20 in 1- to 4-warp blocks (9,168 B
     // per warp, 96 registers), the table layout at 16 in 4-warp blocks (4 x 12,416 B + 1 KiB per block);
     // 8- and 16-warp blocks (fit18) at 16 in every pair (compiled for 16: 2 blocks of 8, 1 of 16)
    int dev = 0, smem = 0;
    ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev), cudaSuccess);
    if (smem == 233472) {
      for (int warps : {1, 2, 4}) EXPECT_EQ(cuda::fit_internal::resident_warps_shape(1, 0, warps), 20) << warps;
      EXPECT_EQ(cuda::fit_internal::resident_warps_shape(1, 10, 4), 16);
      for (const auto& [layout, dp_mode] : {std::pair{1, 0}, std::pair{0, 6}, std::pair{1, 10}})
        for (int warps : {8, 16})
          EXPECT_EQ(cuda::fit_internal::resident_warps_shape(layout, dp_mode, warps), 16) << layout << " " << dp_mode << " " << warps;
    }
  }
  cuda::fit_internal::KernelArgs ka{};
  ka.tiles = 1;
  unsigned long long* no_ctr = nullptr;
  unsigned long long ctr_host = 0;  // (never written: every call below is refused first)
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 0, 0, 4, 0, &ctr_host, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 1, 6, 4, 0, &ctr_host, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 2, 0, 4, 0, &ctr_host, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 1, 12, 4, 0, &ctr_host, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 1, 0, 3, 0, &ctr_host, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 1, 0, 32, 0, &ctr_host, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 1, 9, 8, 0, &ctr_host, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 1, 13, 16, 0, &ctr_host, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 1, 0, 4, 3, &ctr_host, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::launch_warp_shape(ka, 1, 0, 4, 2, no_ctr, nullptr), std::invalid_argument);
  EXPECT_THROW(cuda::fit_internal::resident_warps_shape(0, 0, 4), std::invalid_argument);
}

// The same on a small stack for the sanitizers (memcheck, racecheck, synccheck): the edge tiles and
// two 512-distinct FP32 tiles through every supported (layout, DP mode) in 1- and 4-warp blocks (and
// 16-warp blocks where they exist), one
// tile per warp and a persistent grid of one block with the shared counter.
TEST(FitGpu, BlockShapeEdgeTiles) {
  LUTB_GPU_OR_SKIP();
  std::int64_t ne = 0;
  const std::vector<float> edges = edge_tiles(ne);
  const auto wide = random_values(8 * 64 * 2, Dist::kStudentT3, 0.02f, 41);
  for (const auto& [layout, dp_mode] : {std::pair{1, 0}, std::pair{0, 6}, std::pair{1, 9}, std::pair{1, 10}, std::pair{1, 13}})
    for (int warps : {1, 4, 16})
      for (int grid : {0, 2}) {
        if (warps > 4 && layout == 1 && dp_mode != 0 && dp_mode != 10) continue;  // (8, 16: fit18's pairs only)
        SCOPED_TRACE("layout " + std::to_string(layout) + ", DP mode " + std::to_string(dp_mode) + ", warps " +
                     std::to_string(warps) + ", grid " + std::to_string(grid));
        const ShapeSel sel{warps, grid, grid == 0 ? 0 : 1};
        EXPECT_EQ(expect_two_tiles_same(edges.data(), DType::F32, stack(1, 8, 64 * ne), -1, true, layout, dp_mode, &sel), ne);
        EXPECT_EQ(expect_two_tiles_same(wide.data(), DType::F32, stack(1, 8, 128), -1, true, layout, dp_mode, &sel), 2);
      }
}

// Heavy mixtures: log-uniform magnitudes over many binades (FP32 sums that round), sparse tiles
// (a few values and many zeros), and tiles with exactly 33..64 distinct values.
void mixed_tiles_case(const std::string& fitter) {
  std::mt19937 g(77);
  std::uniform_real_distribution<float> ud(-30.0f, 2.0f);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::bernoulli_distribution sign(0.5), sparse(0.1);
  const int nt = 96;
  std::vector<float> m(static_cast<std::size_t>(8 * 64 * nt));
  for (int t = 0; t < nt; ++t)
    for (int f = 0; f < 512; ++f) {
      float v;
      if (t % 3 == 0) v = (sign(g) ? 1.0f : -1.0f) * std::exp2(ud(g));
      else if (t % 3 == 1) v = sparse(g) ? 0.05f * nd(g) : 0.0f;
      else v = 0.001f * static_cast<float>((f * 37) % (33 + t % 32)) - 0.02f;
      m[static_cast<std::size_t>((f / 64) * 64 * nt + t * 64 + f % 64)] = v;
    }
  const std::size_t chunk = std::size_t{512} << 20;
  EXPECT_EQ(expect_same(m.data(), DType::F32, stack(1, 8, 64 * nt), -1, chunk, fitter), nt);
  const auto b = to_bf16(m);
  EXPECT_EQ(expect_same(b.data(), DType::BF16, stack(1, 8, 64 * nt), -1, chunk, fitter), nt);
}

TEST(FitGpu, MixedTiles) {
  LUTB_GPU_OR_SKIP();
  mixed_tiles_case("binned-dp");
}

TEST(FitGpuOptimal, MixedTiles) {
  LUTB_GPU_OR_SKIP();
  mixed_tiles_case("optimal");
}

// A BF16 stack on the device and room for its LUT-B bytes (packed, codebook, scale).
struct DeviceStack {
  void* src = nullptr;
  std::uint8_t* out = nullptr;
  unsigned long long* err = nullptr;
  std::size_t tiles = 0;
  DeviceStack(const std::vector<std::uint16_t>& b, const LutbShape& s) : tiles(static_cast<std::size_t>(s.tiles())) {
    EXPECT_EQ(cudaMalloc(&src, b.size() * 2), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&out, tiles * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&err, 8), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(src, b.data(), b.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceStack() {
    cudaFree(src);
    cudaFree(out);
    cudaFree(err);
  }
  cuda::DeviceFitOut fit_out() const {
    return cuda::DeviceFitOut{out, out + tiles * kPackedBytes, out + tiles * (kPackedBytes + kCodebookSize), nullptr,
                              nullptr};
  }
};

// fit_device without the per-tile sums (sse / sum_sq null), on `stream`: the CPU fitter's bytes.
void expect_device_entry_same(const std::vector<std::uint16_t>& b, const LutbShape& s, cuda::GpuFitter fitter,
                              cudaStream_t stream, const DeviceStack& d) {
  FitOptions fo;
  fo.fitter = cuda::gpu_fitter_name(fitter);
  LutbTensor cpu;
  quantize(b.data(), DType::BF16, s, cpu, fo, "t");
  const std::size_t nt = d.tiles;
  cuda::fit_device(d.src, DType::BF16, s, d.fit_out(), fitter, -1, d.err, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<std::uint8_t> h(nt * (kPackedBytes + kCodebookSize + 1));
  unsigned long long word = 0;
  ASSERT_EQ(cudaMemcpy(h.data(), d.out, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&word, d.err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cuda::decode_fit_error(word).code, 0);
  EXPECT_TRUE(std::equal(cpu.packed.begin(), cpu.packed.end(), h.begin()));
  EXPECT_TRUE(std::equal(cpu.codebook.begin(), cpu.codebook.end(), h.begin() + nt * kPackedBytes));
  EXPECT_TRUE(std::equal(cpu.scale.begin(), cpu.scale.end(), h.begin() + nt * (kPackedBytes + kCodebookSize)));
}

// The device entry point without the per-tile sums writes the same bytes; check_tiles_device.
TEST(FitGpu, DeviceEntryWithoutStats) {
  LUTB_GPU_OR_SKIP();
  const LutbShape s = stack(3, 40, 300);
  const auto b = to_bf16(random_values(static_cast<std::size_t>(3 * 40 * 300), Dist::kStudentT3, 0.02f, 21));
  const DeviceStack d(b, s);
  expect_device_entry_same(b, s, cuda::GpuFitter::BinnedDp, nullptr, d);
  // (the binned-dp-only entry point too)
  cuda::fit_binned_dp_device(d.src, DType::BF16, s, d.fit_out(), -1, d.err, nullptr);
  unsigned long long word = 0;
  ASSERT_EQ(cudaMemcpy(&word, d.err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cuda::decode_fit_error(word).code, 0);
  // check_tiles_device on the same stack: no error; with a NaN: the tile and position.
  cuda::check_tiles_device(d.src, DType::BF16, s, d.err, nullptr);
  ASSERT_EQ(cudaMemcpy(&word, d.err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cuda::decode_fit_error(word).code, 0);
  const std::uint16_t nan = 0x7fc0;
  const std::size_t at = (2 * 40 + 17) * 300 + 130;  // expert 2, row 17 (tile row 2), col 130 (tile col 2)
  ASSERT_EQ(cudaMemcpy(static_cast<std::uint16_t*>(d.src) + at, &nan, 2, cudaMemcpyHostToDevice), cudaSuccess);
  cuda::check_tiles_device(d.src, DType::BF16, s, d.err, nullptr);
  ASSERT_EQ(cudaMemcpy(&word, d.err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  const cuda::GpuFitError e = cuda::decode_fit_error(word);
  EXPECT_EQ(e.code, 1);
  EXPECT_EQ(e.tile, 2 * s.tiles_per_expert() + 2 * s.tiles_k() + 2);
  EXPECT_EQ(e.pos, 1 * 64 + 2);
}

// fit_device with the optimal fitter, no per-tile sums, on a stream: the CPU optimal fitter's bytes.
TEST(FitGpuOptimal, DeviceEntryWithoutStats) {
  LUTB_GPU_OR_SKIP();
  const LutbShape s = stack(2, 24, 200);
  const auto b = to_bf16(random_values(static_cast<std::size_t>(2 * 24 * 200), Dist::kStudentT3, 0.02f, 23));
  cudaStream_t st = nullptr;
  ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
  const DeviceStack d(b, s);
  expect_device_entry_same(b, s, cuda::GpuFitter::Optimal, st, d);
  // The thread kernel has no optimal: a clear error, nothing launched.
  EXPECT_THROW(cuda::fit_device(d.src, DType::BF16, s, d.fit_out(), cuda::GpuFitter::Optimal, -1, d.err, st,
                                cuda::GpuFitKernel::Thread),
               std::invalid_argument);
  cudaStreamDestroy(st);
}

TEST(FitGpuOptimal, ChunkingDoesNotChangeBytes) {
  LUTB_GPU_OR_SKIP();
  const LutbShape s = stack(3, 16, 130);
  const auto b = to_bf16(random_values(static_cast<std::size_t>(3 * 16 * 130), Dist::kLaplace, 0.05f, 5));
  expect_same_optimal(b.data(), DType::BF16, s, -1, 1);                 // one tile row per chunk
  expect_same_optimal(b.data(), DType::BF16, s, -1, 16 * 130 * 2 + 3);  // one expert per chunk
}

TEST(FitGpu, ChunkingDoesNotChangeBytes) {
  LUTB_GPU_OR_SKIP();
  const LutbShape s = stack(5, 30, 130);
  const auto b = to_bf16(random_values(static_cast<std::size_t>(5 * 30 * 130), Dist::kGauss, 0.05f, 3));
  expect_same(b.data(), DType::BF16, s, -1, 1);                       // one tile row per chunk
  expect_same(b.data(), DType::BF16, s, -1, 30 * 130 * 2);            // one expert per chunk
  expect_same(b.data(), DType::BF16, s, -1, 2 * 30 * 130 * 2 + 10);  // two experts per chunk
}

TEST(FitGpu, ErrorsMatchCpu) {
  LUTB_GPU_OR_SKIP();
  const LutbShape s = stack(2, 16, 128);
  for (int which = 0; which < 6; ++which) {  // 3..5: the same with the optimal fitter
    FitOptions fo;
    cuda::GpuFitOptions go;
    if (which >= 3) fo.fitter = go.fitter = "optimal";
    auto v = random_values(2 * 16 * 128, Dist::kGauss, 0.05f, 11);
    const std::size_t at = 1 * 16 * 128 + 9 * 128 + 70;  // expert 1, row 9, col 70
    v[at] = which % 3 == 0 ? std::numeric_limits<float>::quiet_NaN()
                           : (which % 3 == 1 ? -std::numeric_limits<float>::infinity() : 3.3e38f);
    // A later value of the same tile (last tile of the stack): the first in flat order is reported.
    if (which % 3 < 2) v[1 * 16 * 128 + 15 * 128 + 127] = std::numeric_limits<float>::quiet_NaN();
    std::string cpu_msg, gpu_msg;
    LutbTensor t;
    try {
      quantize(v.data(), DType::F32, s, t, fo, "w");
    } catch (const std::invalid_argument& e) {
      cpu_msg = e.what();
    }
    try {
      cuda::quantize_gpu(v.data(), DType::F32, s, t, go, "w");
    } catch (const std::invalid_argument& e) {
      gpu_msg = e.what();
    }
    ASSERT_EQ(cpu_msg.rfind("quantize: ", 0), 0u) << cpu_msg;
    ASSERT_EQ(gpu_msg.rfind("quantize_gpu: ", 0), 0u) << gpu_msg;
    EXPECT_EQ(gpu_msg.substr(14), cpu_msg.substr(10));
    EXPECT_EQ(t.packed.size(), 0u);
  }
  std::vector<float> v(16);
  LutbTensor t;
  cuda::GpuFitOptions bad;
  bad.forced_scale = 2;
  EXPECT_THROW(cuda::quantize_gpu(v.data(), DType::F32, stack(1, 4, 4), t, bad), std::invalid_argument);
  EXPECT_THROW(cuda::quantize_gpu(v.data(), DType::I32, stack(1, 4, 4), t), std::invalid_argument);
  bad.fitter = "optimal";
  EXPECT_THROW(cuda::quantize_gpu(v.data(), DType::F32, stack(1, 4, 4), t, bad), std::invalid_argument);
}

// Shapes whose tile count or source bytes overflow 64 bits are refused before any GPU work, so this
// runs without a GPU too (new-user QA, session 14: [2^40, 2^40] wrapped to 0 tiles and quantize_gpu
// returned an empty tensor without an error).
TEST(FitGpuHost, OversizedShapesRefused) {
  const std::vector<float> v(16);
  LutbTensor t;
  for (const LutbShape& s : {stack(1, std::int64_t{1} << 40, std::int64_t{1} << 40),
                             stack(std::int64_t{1} << 62, 8, 64),
                             stack(1, std::numeric_limits<std::int64_t>::max(), 64)}) {
    try {
      cuda::quantize_gpu(v.data(), DType::F32, s, t, {}, "w13_weight");
      ADD_FAILURE() << "no error for experts " << s.experts << " rows " << s.rows;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("quantize_gpu: tensor w13_weight: shape ["), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("is too large: its sizes overflow 64 bits"), std::string::npos) << e.what();
    }
    unsigned long long* no_gpu_word = reinterpret_cast<unsigned long long*>(16);  // never dereferenced
    EXPECT_THROW(cuda::check_tiles_device(v.data(), DType::F32, s, no_gpu_word, nullptr), std::invalid_argument);
  }
}

// Without a GPU, quantize_gpu says so plainly (new-user QA, session 14: CUDA's raw "driver version is
// insufficient" came from the first allocation).
TEST(FitGpuHost, NoGpuIsNamed) {
  if (gpu_present()) GTEST_SKIP() << "a CUDA device is present";
  const std::vector<float> v(8 * 64, 0.5f);
  LutbTensor t;
  try {
    cuda::quantize_gpu(v.data(), DType::F32, stack(1, 8, 64), t, {}, "w2_weight");
    ADD_FAILURE() << "no error without a GPU";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("quantize_gpu: tensor w2_weight: no usable CUDA GPU (", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("); lutb::quantize fits on the CPU"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(t.packed.empty());
}

// Fitters without a GPU kernel, unknown names and optimal on the thread kernel: clear errors.
TEST(FitGpu, FitterSelectionErrors) {
  LUTB_GPU_OR_SKIP();
  EXPECT_EQ(cuda::gpu_fitter(""), cuda::GpuFitter::BinnedDp);
  EXPECT_EQ(cuda::gpu_fitter("binned-dp"), cuda::GpuFitter::BinnedDp);
  EXPECT_EQ(cuda::gpu_fitter("optimal"), cuda::GpuFitter::Optimal);
  EXPECT_STREQ(cuda::gpu_fitter_name(cuda::GpuFitter::Optimal), "optimal");
  std::vector<float> v(8 * 64, 0.5f);
  auto msg = [&](const std::string& fitter, cuda::GpuFitKernel kernel) {
    cuda::GpuFitOptions go;
    go.fitter = fitter;
    go.kernel = kernel;
    LutbTensor t;
    try {
      cuda::quantize_gpu(v.data(), DType::F32, stack(1, 8, 64), t, go, "w");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(msg("ct-lloyd", cuda::GpuFitKernel::Warp),
            "quantize_gpu: tensor w: fitter 'ct-lloyd' has no GPU kernel (GPU fitters: binned-dp, optimal); "
            "lutb::quantize runs it on the CPU");
  EXPECT_NE(msg("multistart", cuda::GpuFitKernel::Warp).find("'multistart' has no GPU kernel"), std::string::npos);
  EXPECT_NE(msg("kmeans", cuda::GpuFitKernel::Warp).find("unknown fitter 'kmeans'"), std::string::npos);
  EXPECT_NE(msg("optimal", cuda::GpuFitKernel::Thread).find("implements binned-dp only"), std::string::npos);
  EXPECT_EQ(msg("optimal", cuda::GpuFitKernel::Warp), "no error");
}

TEST(FitGpu, TinyQwen3MoeExpertStacks) {
  LUTB_GPU_OR_SKIP();
  LUTB_MODEL_OR_SKIP(dir, "tiny-qwen3-moe");
  SafetensorsFile f(dir / "model.safetensors");
  for (const char* proj : {"gate_proj", "down_proj"}) {
    std::vector<std::uint16_t> data;
    std::int64_t e = 0, rows = 0, cols = 0;
    for (;; ++e) {
      const std::string name = "model.layers.0.mlp.experts." + std::to_string(e) + "." + proj + ".weight";
      if (!f.contains(name)) break;
      const TensorView& tv = f.get(name);
      ASSERT_EQ(tv.dtype, DType::BF16);
      rows = tv.shape[0];
      cols = tv.shape[1];
      const auto span = tv.as<std::uint16_t>(DType::BF16);
      data.insert(data.end(), span.begin(), span.end());
    }
    ASSERT_GT(e, 0);
    const std::int64_t tiles = e * (rows / 8) * ((cols + 63) / 64);
    EXPECT_EQ(expect_same(data.data(), DType::BF16, stack(e, rows, cols)), tiles);
    EXPECT_EQ(expect_same_optimal(data.data(), DType::BF16, stack(e, rows, cols)), tiles);
    // fit16's run-cost table DP (launch_warp_dp modes 9 and 10 on layout 1), with and without the sums
    for (int dp_mode : {9, 10}) {
      SCOPED_TRACE(std::string(proj) + ", DP mode " + std::to_string(dp_mode));
      EXPECT_EQ(expect_two_tiles_same(data.data(), DType::BF16, stack(e, rows, cols), -1, true, 1, dp_mode), tiles);
      EXPECT_EQ(expect_two_tiles_same(data.data(), DType::BF16, stack(e, rows, cols), -1, false, 1, dp_mode), tiles);
    }
  }
}

}  // namespace
}  // namespace lutb::test
