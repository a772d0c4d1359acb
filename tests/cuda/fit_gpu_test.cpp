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

#include "cuda/fit/fit_internal.cuh"
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

#ifdef LUTB_BENCH_BASELINES
constexpr bool kThreadBaseline = true;

// The benchmark's baseline kernel (thread per tile, binned-dp) on the whole stack at once, with the
// per-tile sums added in tile order as quantize_gpu adds them.
FitStats thread_baseline(const void* src, DType type, const LutbShape& shape, int forced_scale, LutbTensor& out) {
  const std::size_t nt = static_cast<std::size_t>(shape.tiles());
  const std::size_t bytes = static_cast<std::size_t>(shape.experts * shape.rows * shape.cols) * dtype_size(type);
  void* d_src = nullptr;
  std::uint8_t* d_out = nullptr;
  double* d_sums = nullptr;
  unsigned long long* d_err = nullptr;
  EXPECT_EQ(cudaMalloc(&d_src, bytes ? bytes : 1), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_out, nt * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_sums, nt * 16), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d_src, src, bytes, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemset(d_err, 0xff, 8), cudaSuccess);
  const cuda::DeviceFitOut o{d_out, d_out + nt * kPackedBytes, d_out + nt * (kPackedBytes + kCodebookSize), d_sums,
                             d_sums + nt};
  cuda::fit_internal::launch_binned_dp_thread(
      cuda::fit_internal::stack_args(d_src, type, shape, o, forced_scale, d_err, cuda::GpuFitter::BinnedDp), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out.shape = shape;
  out.packed.resize(nt * kPackedBytes);
  out.codebook.resize(nt * kCodebookSize);
  out.scale.resize(nt);
  std::vector<double> sums(2 * nt);
  EXPECT_EQ(cudaMemcpy(out.packed.data(), o.packed, out.packed.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.codebook.data(), o.codebook, out.codebook.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(out.scale.data(), o.scale, nt, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(sums.data(), d_sums, nt * 16, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(d_src);
  cudaFree(d_out);
  cudaFree(d_sums);
  cudaFree(d_err);
  FitStats st;
  st.tiles = shape.tiles();
  for (std::size_t t = 0; t < nt; ++t) {
    st.sse += sums[t];
    st.sum_sq += sums[nt + t];
  }
  return st;
}
#else
constexpr bool kThreadBaseline = false;
#endif

// Fits on the CPU and on the GPU with `fitter` (quantize_gpu; binned-dp in a build with
// LUTB_BENCH_BASELINES also on the benchmark's thread-per-tile baseline) and asserts byte equality
// and equal FitStats; returns the number of tiles compared.
std::int64_t expect_same(const void* src, DType type, const LutbShape& shape, int forced_scale = -1,
                         std::size_t chunk_bytes = std::size_t{512} << 20, const std::string& fitter = "binned-dp") {
  FitOptions fo;
  fo.fitter = fitter;
  fo.forced_scale = forced_scale;
  LutbTensor cpu;
  const FitStats sc = quantize(src, type, shape, cpu, fo, "t");
  const int kernels = kThreadBaseline && fitter == "binned-dp" ? 2 : 1;
  for (int kernel = 0; kernel < kernels; ++kernel) {
    SCOPED_TRACE(fitter + (kernel == 0 ? ", warp kernel" : ", thread baseline"));
    LutbTensor gpu;
    FitStats sg;
    if (kernel == 0) {
      cuda::GpuFitOptions go;
      go.fitter = fitter;
      go.forced_scale = forced_scale;
      go.chunk_bytes = chunk_bytes;
      sg = cuda::quantize_gpu(src, type, shape, gpu, go, "t");
    } else {
#ifdef LUTB_BENCH_BASELINES
      sg = thread_baseline(src, type, shape, forced_scale, gpu);
#endif
    }
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
  bool optimal = false;  // the fitter: binned-dp or optimal
};

// Readable parameter names (the default printer dumps the struct's bytes, padding included).
void PrintTo(const RandomCase& c, std::ostream* os) {
  static const char* const kNames[] = {"gauss", "student-t3", "laplace"};
  *os << (c.optimal ? "optimal " : "binned-dp ") << kNames[static_cast<int>(c.dist)] << " [" << c.e << ", " << c.n
      << ", " << c.k << "] " << (c.bf16 ? "BF16" : "F32");
}

// Test names (ctest lists them): "gauss_2x64x512_bf16" instead of the index "/3". The fitter is the instantiation's prefix (Shapes: binned-dp, Optimal: optimal).
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

// A small stack for the sanitizers (memcheck, racecheck, synccheck): the edge tiles and two FP32
// tiles of 512 distinct values (binned-dp: the most bin edges, the most DP pairs per layer;
// optimal: the deepest DP trees), both fitters, with the per-tile sums (quantize_gpu) and without
// (fit_device), and the tile check.
TEST(FitGpuSmall, BothFittersWithAndWithoutSums) {
  LUTB_GPU_OR_SKIP();
  std::int64_t ne = 0;
  const std::vector<float> edges = edge_tiles(ne);
  const std::int64_t nr = 2, nt = ne + nr;
  const auto rnd = random_values(static_cast<std::size_t>(512 * nr), Dist::kStudentT3, 0.02f, 41);
  std::vector<float> m(static_cast<std::size_t>(512 * nt));
  for (int r = 0; r < 8; ++r)
    for (std::int64_t c = 0; c < 64 * nt; ++c)
      m[static_cast<std::size_t>(r * 64 * nt + c)] = c < 64 * ne ? edges[static_cast<std::size_t>(r * 64 * ne + c)]
                                                                 : rnd[static_cast<std::size_t>(r * 64 * nr + (c - 64 * ne))];
  const LutbShape s = stack(1, 8, 64 * nt);
  const std::size_t n = static_cast<std::size_t>(nt);
  float* d_src = nullptr;
  std::uint8_t* d_out = nullptr;
  unsigned long long* d_err = nullptr;
  ASSERT_EQ(cudaMalloc(&d_src, m.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, n * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_src, m.data(), m.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const cuda::DeviceFitOut o{d_out, d_out + n * kPackedBytes, d_out + n * (kPackedBytes + kCodebookSize), nullptr,
                             nullptr};
  for (cuda::GpuFitter f : {cuda::GpuFitter::BinnedDp, cuda::GpuFitter::Optimal}) {
    SCOPED_TRACE(cuda::gpu_fitter_name(f));
    EXPECT_EQ(expect_same(m.data(), DType::F32, s, -1, std::size_t{512} << 20, cuda::gpu_fitter_name(f)), nt);
    FitOptions fo;
    fo.fitter = cuda::gpu_fitter_name(f);
    LutbTensor cpu;
    quantize(m.data(), DType::F32, s, cpu, fo, "t");
    cuda::fit_device(d_src, DType::F32, s, o, f, -1, d_err, nullptr);
    std::vector<std::uint8_t> h(n * (kPackedBytes + kCodebookSize + 1));
    unsigned long long word = 0;
    ASSERT_EQ(cudaMemcpy(h.data(), d_out, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(&word, d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cuda::decode_fit_error(word).code, 0);
    EXPECT_TRUE(std::equal(cpu.packed.begin(), cpu.packed.end(), h.begin()));
    EXPECT_TRUE(std::equal(cpu.codebook.begin(), cpu.codebook.end(), h.begin() + n * kPackedBytes));
    EXPECT_TRUE(std::equal(cpu.scale.begin(), cpu.scale.end(), h.begin() + n * (kPackedBytes + kCodebookSize)));
  }
  cuda::check_tiles_device(d_src, DType::F32, s, d_err, nullptr);
  unsigned long long word = 0;
  ASSERT_EQ(cudaMemcpy(&word, d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cuda::decode_fit_error(word).code, 0);
  cudaFree(d_src);
  cudaFree(d_out);
  cudaFree(d_err);
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

// Shapes whose tile count or source bytes overflow 64 bits are refused before any GPU work (else
// [2^40, 2^40] would wrap to 0 tiles and return an empty tensor without an error), so this runs
// without a GPU too.
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

// Without a GPU, quantize_gpu says so plainly (not CUDA's raw "driver version is insufficient" from
// the first allocation).
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

// Fitters without a GPU kernel and unknown names: clear errors.
TEST(FitGpu, FitterSelectionErrors) {
  LUTB_GPU_OR_SKIP();
  EXPECT_EQ(cuda::gpu_fitter(""), cuda::GpuFitter::BinnedDp);
  EXPECT_EQ(cuda::gpu_fitter("binned-dp"), cuda::GpuFitter::BinnedDp);
  EXPECT_EQ(cuda::gpu_fitter("optimal"), cuda::GpuFitter::Optimal);
  EXPECT_STREQ(cuda::gpu_fitter_name(cuda::GpuFitter::Optimal), "optimal");
  std::vector<float> v(8 * 64, 0.5f);
  auto msg = [&](const std::string& fitter) {
    cuda::GpuFitOptions go;
    go.fitter = fitter;
    LutbTensor t;
    try {
      cuda::quantize_gpu(v.data(), DType::F32, stack(1, 8, 64), t, go, "w");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(msg("ct-lloyd"),
            "quantize_gpu: tensor w: fitter 'ct-lloyd' has no GPU kernel (GPU fitters: binned-dp, optimal); "
            "lutb::quantize runs it on the CPU");
  EXPECT_NE(msg("multistart").find("'multistart' has no GPU kernel"), std::string::npos);
  EXPECT_NE(msg("kmeans").find("unknown fitter 'kmeans'"), std::string::npos);
  EXPECT_EQ(msg("optimal"), "no error");
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
  }
}

// ---------------------------------------------------------------------------------------------
// The weighted (calibrated) fit: GpuFitOptions::column_weights / fit_device's d_column_weights
// against lutb::quantize with FitOptions::column_weights.
// ---------------------------------------------------------------------------------------------

enum class Weights { kLogUniform, kTies, kCalibLike };

// Column weights [experts][cols]: log-uniform over 1e-3..1e3 (the extreme ratios), few distinct
// values (ties between columns: equal values of different columns with equal or unequal weights),
// or log-normal normalised to mean 1 per expert and raised to at least 1e-3 (the shape of
// CalibrationStats::column_weights).
std::vector<float> column_weights(std::int64_t experts, std::int64_t cols, Weights kind, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> ud(-3.0f, 3.0f);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::uniform_int_distribution<int> pick(0, 3);
  const float ties[4] = {0.25f, 1.0f, 1.0f, 4.0f};
  std::vector<float> w(static_cast<std::size_t>(experts * cols));
  for (std::int64_t e = 0; e < experts; ++e) {
    float* r = w.data() + e * cols;
    for (std::int64_t c = 0; c < cols; ++c)
      r[c] = kind == Weights::kLogUniform ? std::pow(10.0f, ud(g)) : kind == Weights::kTies ? ties[pick(g)] : std::exp(nd(g));
    if (kind == Weights::kCalibLike) {
      double mean = 0.0;
      for (std::int64_t c = 0; c < cols; ++c) mean += r[c];
      mean /= static_cast<double>(cols);
      for (std::int64_t c = 0; c < cols; ++c) r[c] = std::max(static_cast<float>(r[c] / mean), 1e-3f);
    }
  }
  return w;
}

// Tiles whose packed indices or codebook differ between two fits of the same shape.
std::int64_t tiles_differing(const LutbTensor& a, const LutbTensor& b) {
  std::int64_t n = 0;
  for (std::int64_t t = 0; t < a.shape.tiles(); ++t)
    n += std::memcmp(a.packed.data() + t * kPackedBytes, b.packed.data() + t * kPackedBytes, kPackedBytes) != 0 ||
         std::memcmp(a.codebook.data() + t * kCodebookSize, b.codebook.data() + t * kCodebookSize, kCodebookSize) != 0 ||
         a.scale[static_cast<std::size_t>(t)] != b.scale[static_cast<std::size_t>(t)];
  return n;
}

// The weighted fit on the CPU and on the GPU (quantize_gpu, host weights [experts][cols]): equal
// bytes and FitStats. Returns the CPU's fit.
LutbTensor expect_same_weighted(const void* src, DType type, const LutbShape& shape, const std::vector<float>& cw,
                                const std::string& fitter, int forced_scale = -1,
                                std::size_t chunk_bytes = std::size_t{512} << 20) {
  EXPECT_EQ(cw.size(), static_cast<std::size_t>(shape.experts * shape.cols));
  FitOptions fo;
  fo.fitter = fitter;
  fo.forced_scale = forced_scale;
  fo.column_weights = cw.data();
  LutbTensor cpu, gpu;
  const FitStats sc = quantize(src, type, shape, cpu, fo, "t");
  cuda::GpuFitOptions go;
  go.fitter = fitter;
  go.forced_scale = forced_scale;
  go.chunk_bytes = chunk_bytes;
  go.column_weights = cw.data();
  SCOPED_TRACE(fitter + ", weighted");
  const FitStats sg = cuda::quantize_gpu(src, type, shape, gpu, go, "t");
  EXPECT_EQ(sg.tiles, sc.tiles);
  EXPECT_EQ(sg.sse, sc.sse);
  EXPECT_EQ(sg.sum_sq, sc.sum_sq);
  EXPECT_EQ(gpu.scale, cpu.scale);
  std::int64_t bad = -1, bad_cb = -1;
  for (std::int64_t t = 0; t < shape.tiles() && bad < 0; ++t)
    if (std::memcmp(gpu.packed.data() + t * kPackedBytes, cpu.packed.data() + t * kPackedBytes, kPackedBytes) != 0)
      bad = t;
  for (std::int64_t t = 0; t < shape.tiles() && bad_cb < 0; ++t)
    if (std::memcmp(gpu.codebook.data() + t * kCodebookSize, cpu.codebook.data() + t * kCodebookSize, kCodebookSize) !=
        0)
      bad_cb = t;
  EXPECT_EQ(bad, -1) << "packed indices differ first at tile " << bad;
  EXPECT_EQ(bad_cb, -1) << "codebooks differ first at tile " << bad_cb;
  return cpu;
}

// The unweighted CPU fit, to show that the weights changed the bytes (else an equality test
// would not see a GPU that ignores them).
LutbTensor cpu_unweighted(const void* src, DType type, const LutbShape& shape, const std::string& fitter,
                          int forced_scale = -1) {
  FitOptions fo;
  fo.fitter = fitter;
  fo.forced_scale = forced_scale;
  LutbTensor t;
  quantize(src, type, shape, t, fo, "t");
  return t;
}

struct WeightedCase {
  Dist dist;
  std::int64_t e, n, k;
  bool bf16;
  Weights weights;
  bool optimal = false;
};

void PrintTo(const WeightedCase& c, std::ostream* os) {
  static const char* const kDist[] = {"gauss", "student-t3", "laplace"};
  static const char* const kW[] = {"log-uniform", "ties", "calib-like"};
  *os << (c.optimal ? "optimal " : "binned-dp ") << kDist[static_cast<int>(c.dist)] << " [" << c.e << ", " << c.n
      << ", " << c.k << "] " << (c.bf16 ? "BF16" : "F32") << " weights " << kW[static_cast<int>(c.weights)];
}

std::string weighted_case_name(const ::testing::TestParamInfo<WeightedCase>& i) {
  static const char* const kDist[] = {"gauss", "student_t3", "laplace"};
  static const char* const kW[] = {"loguniform", "ties", "caliblike"};
  const WeightedCase& c = i.param;
  return std::string(kDist[static_cast<int>(c.dist)]) + "_" + std::to_string(c.e) + "x" + std::to_string(c.n) + "x" +
         std::to_string(c.k) + (c.bf16 ? "_bf16_" : "_f32_") + kW[static_cast<int>(c.weights)];
}

class FitGpuWeightedRandom : public ::testing::TestWithParam<WeightedCase> {};

TEST_P(FitGpuWeightedRandom, SameBytesAsCpu) {
  LUTB_GPU_OR_SKIP();
  const WeightedCase c = GetParam();
  const LutbShape s = stack(c.e, c.n, c.k);
  const std::uint32_t seed = static_cast<std::uint32_t>((c.optimal ? 53 : 29) * c.n + c.k + 7 * static_cast<int>(c.weights));
  const auto v = random_values(static_cast<std::size_t>(c.e * c.n * c.k), c.dist, 0.02f, seed);
  const auto cw = column_weights(c.e, c.k, c.weights, seed + 1);
  const std::string fitter = c.optimal ? "optimal" : "binned-dp";
  const auto b = to_bf16(v);
  const void* src = c.bf16 ? static_cast<const void*>(b.data()) : static_cast<const void*>(v.data());
  const DType type = c.bf16 ? DType::BF16 : DType::F32;
  const LutbTensor cpu = expect_same_weighted(src, type, s, cw, fitter);
  // The weights change the fit of most tiles with more than 8 distinct values.
  if (s.tiles() >= 4) {
    EXPECT_GT(tiles_differing(cpu, cpu_unweighted(src, type, s, fitter)), s.tiles() / 4);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, FitGpuWeightedRandom,
                         ::testing::Values(WeightedCase{Dist::kGauss, 2, 64, 512, true, Weights::kLogUniform},
                                           WeightedCase{Dist::kStudentT3, 2, 64, 512, true, Weights::kTies},
                                           WeightedCase{Dist::kLaplace, 2, 64, 512, true, Weights::kCalibLike},
                                           WeightedCase{Dist::kGauss, 3, 21, 200, false, Weights::kLogUniform},  // N%8, K%64
                                           WeightedCase{Dist::kStudentT3, 3, 21, 200, true, Weights::kCalibLike},
                                           WeightedCase{Dist::kLaplace, 1, 13, 70, true, Weights::kTies},
                                           WeightedCase{Dist::kGauss, 1, 5, 33, true, Weights::kLogUniform},  // one padded tile
                                           // FP32: 512 distinct values per tile (the most bin edges)
                                           WeightedCase{Dist::kStudentT3, 2, 128, 1024, false, Weights::kLogUniform},
                                           WeightedCase{Dist::kLaplace, 2, 64, 1024, false, Weights::kCalibLike}),
                         weighted_case_name);

INSTANTIATE_TEST_SUITE_P(Optimal, FitGpuWeightedRandom,
                         ::testing::Values(WeightedCase{Dist::kGauss, 2, 64, 512, true, Weights::kLogUniform, true},
                                           WeightedCase{Dist::kStudentT3, 1, 64, 512, true, Weights::kTies, true},
                                           WeightedCase{Dist::kLaplace, 1, 64, 512, true, Weights::kCalibLike, true},
                                           WeightedCase{Dist::kGauss, 3, 21, 200, false, Weights::kCalibLike, true},
                                           WeightedCase{Dist::kLaplace, 1, 13, 70, true, Weights::kLogUniform, true},
                                           WeightedCase{Dist::kGauss, 1, 5, 33, true, Weights::kTies, true},
                                           // FP32: 512 distinct values per tile (the deepest DP trees)
                                           WeightedCase{Dist::kStudentT3, 1, 32, 1024, false, Weights::kLogUniform, true}),
                         weighted_case_name);

// The edge tiles (edge_tiles) under each kind of weights, FP32 and BF16, and forced scales.
void weighted_edge_tiles_case(const std::string& fitter) {
  std::int64_t nt = 0;
  const std::vector<float> m = edge_tiles(nt);
  const LutbShape s = stack(1, 8, 64 * nt);
  const auto b = to_bf16(m);
  for (Weights kind : {Weights::kLogUniform, Weights::kTies, Weights::kCalibLike}) {
    SCOPED_TRACE(static_cast<int>(kind));
    const auto cw = column_weights(1, 64 * nt, kind, 71 + static_cast<std::uint32_t>(kind));
    expect_same_weighted(m.data(), DType::F32, s, cw, fitter);
    expect_same_weighted(b.data(), DType::BF16, s, cw, fitter);
  }
  const auto small = random_values(8 * 64 * 4, Dist::kStudentT3, 0.02f, 9);
  const auto cw = column_weights(1, 256, Weights::kLogUniform, 19);
  for (int fs : {3, 100, 120, 127, 246}) expect_same_weighted(small.data(), DType::F32, stack(1, 8, 256), cw, fitter, fs);
}

TEST(FitGpuWeighted, EdgeTiles) {
  LUTB_GPU_OR_SKIP();
  weighted_edge_tiles_case("binned-dp");
}

TEST(FitGpuWeightedOptimal, EdgeTiles) {
  LUTB_GPU_OR_SKIP();
  weighted_edge_tiles_case("optimal");
}

// The equal-weights rule (fit.cpp): a tile whose 64 column weights are all equal is fitted
// unweighted. Weights constant per expert (0.37, 5, 1e-3), equal within each tile but different
// between tiles, and a padded last tile whose 36 logical columns share one weight (its padding takes
// that weight too): the GPU's weighted fit writes the unweighted bytes; with four columns of one tile
// column weighing 1000 instead, those tiles are fitted weighted again.
TEST(FitGpuWeighted, EqualWeightsGiveTheUnweightedBytes) {
  LUTB_GPU_OR_SKIP();
  const LutbShape s = stack(3, 24, 164);  // tiles (3 tile rows) x (64, 64, 36 columns)
  const auto v = to_bf16(random_values(static_cast<std::size_t>(3 * 24 * 164), Dist::kStudentT3, 0.02f, 61));
  std::vector<float> per_expert(3 * 164), per_tile(3 * 164);
  for (int e = 0; e < 3; ++e)
    for (int c = 0; c < 164; ++c) {
      per_expert[static_cast<std::size_t>(e * 164 + c)] = e == 0 ? 0.37f : (e == 1 ? 5.0f : 1e-3f);
      per_tile[static_cast<std::size_t>(e * 164 + c)] = static_cast<float>(1 + (c / 64) + 3 * e) * 0.5f;
    }
  for (const std::string fitter : {"binned-dp", "optimal"}) {
    SCOPED_TRACE(fitter);
    const LutbTensor plain = cpu_unweighted(v.data(), DType::BF16, s, fitter);
    for (const auto* cw : {&per_expert, &per_tile}) {
      const LutbTensor w = expect_same_weighted(v.data(), DType::BF16, s, *cw, fitter);
      EXPECT_EQ(tiles_differing(w, plain), 0);
    }
    std::vector<float> one_off = per_tile;
    for (int c = 70; c < 74; ++c) one_off[static_cast<std::size_t>(1 * 164 + c)] = 1000.0f;  // expert 1, tile column 1
    const LutbTensor w = expect_same_weighted(v.data(), DType::BF16, s, one_off, fitter);
    EXPECT_GT(tiles_differing(w, plain), 0);
  }
}

// optimal's scale search under weights. The small values of FitGpuOptimal.ScaleSearchBelowRceil
// (odd multiples of 2^-10: halfway between scale 127's grid points, exact on scale 126's) and one
// value 232 + 2^-10 alone in its column (the column's other values 0): at 127 it rounds to 240, at
// 126 it saturates to 224, (8 + 2^-10)^2 against (8 - 2^-10)^2, 2^-5 more, while the small values
// save 2^-20 each at 126 (about 5e-4 in all). Unweighted, and with that column weighing 1e3 and
// the others 1e-3, 127 wins; with the weights the other way round the small values' savings
// outweigh the saturation and 126 wins: the scales are compared by the weighted error.
TEST(FitGpuWeightedOptimal, ScaleSearchUsesTheWeightedError) {
  LUTB_GPU_OR_SKIP();
  std::vector<float> t(512);
  for (int f = 0; f < 512; ++f) {
    const int q = (f * 13) % 7;
    t[static_cast<std::size_t>(f)] = f % 64 == 36 ? 0.0f : std::ldexp(static_cast<float>(2 * (q - 3) + 1), -10);
  }
  t[100] = 232.0f + std::ldexp(1.0f, -10);  // row 1, column 36
  std::vector<float> heavy(64, 1e-3f), light(64, 1e3f);
  heavy[36] = 1e3f;
  light[36] = 1e-3f;
  const LutbShape s = stack(1, 8, 64);
  EXPECT_EQ(cpu_unweighted(t.data(), DType::F32, s, "optimal").scale[0], 127);
  EXPECT_EQ(expect_same_weighted(t.data(), DType::F32, s, heavy, "optimal").scale[0], 127);
  EXPECT_EQ(expect_same_weighted(t.data(), DType::F32, s, light, "optimal").scale[0], 126);
}

TEST(FitGpuWeighted, ChunkingDoesNotChangeBytes) {
  LUTB_GPU_OR_SKIP();
  const LutbShape s = stack(4, 30, 130);
  const auto b = to_bf16(random_values(static_cast<std::size_t>(4 * 30 * 130), Dist::kGauss, 0.05f, 13));
  const auto cw = column_weights(4, 130, Weights::kLogUniform, 14);
  for (const std::string fitter : {"binned-dp", "optimal"}) {
    expect_same_weighted(b.data(), DType::BF16, s, cw, fitter, -1, 1);                  // one tile row per chunk
    expect_same_weighted(b.data(), DType::BF16, s, cw, fitter, -1, 30 * 130 * 2);       // one expert per chunk
    expect_same_weighted(b.data(), DType::BF16, s, cw, fitter, -1, 3 * 30 * 130 * 2);   // three experts, then one
  }
}

// fit_device with device column weights, without the per-tile sums, on a stream (both entry
// points); then a column weight that breaks the rule: error code 5 at the lowest tile that reads it,
// its tile column as the position, and the CPU refuses the same weights.
TEST(FitGpuWeighted, DeviceEntryWithDeviceWeights) {
  LUTB_GPU_OR_SKIP();
  const LutbShape s = stack(3, 40, 300);
  const auto b = to_bf16(random_values(static_cast<std::size_t>(3 * 40 * 300), Dist::kStudentT3, 0.02f, 27));
  auto cw = column_weights(3, 300, Weights::kCalibLike, 28);
  const DeviceStack d(b, s);
  float* d_cw = nullptr;
  ASSERT_EQ(cudaMalloc(&d_cw, cw.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_cw, cw.data(), cw.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t st = nullptr;
  ASSERT_EQ(cudaStreamCreate(&st), cudaSuccess);
  const std::size_t nt = d.tiles;
  for (cuda::GpuFitter f : {cuda::GpuFitter::BinnedDp, cuda::GpuFitter::Optimal}) {
    SCOPED_TRACE(cuda::gpu_fitter_name(f));
    FitOptions fo;
    fo.fitter = cuda::gpu_fitter_name(f);
    fo.column_weights = cw.data();
    LutbTensor cpu;
    quantize(b.data(), DType::BF16, s, cpu, fo, "t");
    EXPECT_GT(tiles_differing(cpu, cpu_unweighted(b.data(), DType::BF16, s, fo.fitter)), 0);
    for (int entry = 0; entry < (f == cuda::GpuFitter::BinnedDp ? 2 : 1); ++entry) {
      ASSERT_EQ(cudaMemset(d.out, 0, nt * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
      if (entry == 0) cuda::fit_device(d.src, DType::BF16, s, d.fit_out(), f, -1, d.err, st, d_cw);
      else cuda::fit_binned_dp_device(d.src, DType::BF16, s, d.fit_out(), -1, d.err, st, d_cw);
      ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
      std::vector<std::uint8_t> h(nt * (kPackedBytes + kCodebookSize + 1));
      unsigned long long word = 0;
      ASSERT_EQ(cudaMemcpy(h.data(), d.out, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(&word, d.err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cuda::decode_fit_error(word).code, 0);
      EXPECT_TRUE(std::equal(cpu.packed.begin(), cpu.packed.end(), h.begin()));
      EXPECT_TRUE(std::equal(cpu.codebook.begin(), cpu.codebook.end(), h.begin() + nt * kPackedBytes));
      EXPECT_TRUE(std::equal(cpu.scale.begin(), cpu.scale.end(), h.begin() + nt * (kPackedBytes + kCodebookSize)));
    }
  }
  // Bad weights: expert 2 column 5 is 0, expert 1 column 130 NaN (tile column 2, position 2): the
  // lowest failing tile is expert 1's tile (0, 2).
  cw[2 * 300 + 5] = 0.0f;
  cw[1 * 300 + 130] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_EQ(cudaMemcpy(d_cw, cw.data(), cw.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  for (cuda::GpuFitter f : {cuda::GpuFitter::BinnedDp, cuda::GpuFitter::Optimal}) {
    cuda::fit_device(d.src, DType::BF16, s, d.fit_out(), f, -1, d.err, st, d_cw);
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    unsigned long long word = 0;
    ASSERT_EQ(cudaMemcpy(&word, d.err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
    const cuda::GpuFitError e = cuda::decode_fit_error(word);
    EXPECT_EQ(e.code, 5);
    EXPECT_EQ(e.tile, 1 * s.tiles_per_expert() + 2);
    EXPECT_EQ(e.pos, 2);
  }
  FitOptions fo;
  fo.column_weights = cw.data();
  LutbTensor t;
  EXPECT_THROW(quantize(b.data(), DType::BF16, s, t, fo, "t"), std::invalid_argument);
  cudaStreamDestroy(st);
  cudaFree(d_cw);
}

// Weights that break the rule are refused before any GPU work, worded as lutb::quantize words them
// (so this runs without a GPU too).
TEST(FitGpuHost, BadColumnWeightsWordedAsOnTheCpu) {
  const std::vector<float> v(2 * 16 * 100, 0.5f);
  for (const bool stacked : {true, false}) {
    const LutbShape s = stacked ? stack(2, 16, 100) : stack(1, 16, 100);
    for (const float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
      std::vector<float> cw(static_cast<std::size_t>(s.experts * 100), 1.5f);
      cw[cw.size() - 100 + 77] = bad;  // last expert, column 77
      FitOptions fo;
      fo.column_weights = cw.data();
      cuda::GpuFitOptions go;
      go.column_weights = cw.data();
      std::string cpu_msg, gpu_msg;
      LutbTensor t;
      try {
        quantize(v.data(), DType::F32, s, t, fo, "w2");
      } catch (const std::invalid_argument& e) {
        cpu_msg = e.what();
      }
      try {
        cuda::quantize_gpu(v.data(), DType::F32, s, t, go, "w2");
      } catch (const std::invalid_argument& e) {
        gpu_msg = e.what();
      }
      ASSERT_EQ(cpu_msg.rfind("quantize: tensor w2", 0), 0u) << cpu_msg;
      EXPECT_NE(cpu_msg.find("column weight 77 is "), std::string::npos) << cpu_msg;
      ASSERT_EQ(gpu_msg.rfind("quantize_gpu: ", 0), 0u) << gpu_msg;
      EXPECT_EQ(gpu_msg.substr(14), cpu_msg.substr(10));
      EXPECT_TRUE(t.packed.empty());
    }
  }
}

// The real routed experts of tiny-qwen3-moe (layer 0 gate_proj and down_proj stacks) under
// calibration-like and log-uniform weights, both fitters.
TEST(FitGpuWeighted, TinyQwen3MoeExpertStacks) {
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
    const LutbShape s = stack(e, rows, cols);
    const auto calib = column_weights(e, cols, Weights::kCalibLike, 101);
    const auto wide = column_weights(e, cols, Weights::kLogUniform, 102);
    const LutbTensor cb = expect_same_weighted(data.data(), DType::BF16, s, calib, "binned-dp");
    EXPECT_GT(tiles_differing(cb, cpu_unweighted(data.data(), DType::BF16, s, "binned-dp")), s.tiles() / 2);
    expect_same_weighted(data.data(), DType::BF16, s, wide, "binned-dp");
    expect_same_weighted(data.data(), DType::BF16, s, calib, "optimal");
  }
}

// A small weighted case for the sanitizers (FitGpuSmall.*): the edge tiles and two FP32 tiles of 512
// distinct values under log-uniform weights, with a tile of equal weights among them; both fitters,
// with the per-tile sums (quantize_gpu) and without (fit_device).
TEST(FitGpuSmall, WeightedBothFittersWithAndWithoutSums) {
  LUTB_GPU_OR_SKIP();
  std::int64_t ne = 0;
  const std::vector<float> edges = edge_tiles(ne);
  const std::int64_t nr = 2, nt = ne + nr;
  const auto rnd = random_values(static_cast<std::size_t>(512 * nr), Dist::kStudentT3, 0.02f, 43);
  std::vector<float> m(static_cast<std::size_t>(512 * nt));
  for (int r = 0; r < 8; ++r)
    for (std::int64_t c = 0; c < 64 * nt; ++c)
      m[static_cast<std::size_t>(r * 64 * nt + c)] = c < 64 * ne ? edges[static_cast<std::size_t>(r * 64 * ne + c)]
                                                                 : rnd[static_cast<std::size_t>(r * 64 * nr + (c - 64 * ne))];
  const LutbShape s = stack(1, 8, 64 * nt);
  auto cw = column_weights(1, 64 * nt, Weights::kLogUniform, 44);
  std::fill(cw.begin() + 64, cw.begin() + 128, 3.0f);  // tile 1: equal weights
  const std::size_t n = static_cast<std::size_t>(nt);
  float* d_src = nullptr;
  float* d_cw = nullptr;
  std::uint8_t* d_out = nullptr;
  unsigned long long* d_err = nullptr;
  ASSERT_EQ(cudaMalloc(&d_src, m.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_cw, cw.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, n * (kPackedBytes + kCodebookSize + 1)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_err, 8), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_src, m.data(), m.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_cw, cw.data(), cw.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const cuda::DeviceFitOut o{d_out, d_out + n * kPackedBytes, d_out + n * (kPackedBytes + kCodebookSize), nullptr,
                             nullptr};
  for (cuda::GpuFitter f : {cuda::GpuFitter::BinnedDp, cuda::GpuFitter::Optimal}) {
    SCOPED_TRACE(cuda::gpu_fitter_name(f));
    const LutbTensor cpu = expect_same_weighted(m.data(), DType::F32, s, cw, cuda::gpu_fitter_name(f));
    cuda::fit_device(d_src, DType::F32, s, o, f, -1, d_err, nullptr, d_cw);
    std::vector<std::uint8_t> h(n * (kPackedBytes + kCodebookSize + 1));
    unsigned long long word = 0;
    ASSERT_EQ(cudaMemcpy(h.data(), d_out, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(&word, d_err, 8, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cuda::decode_fit_error(word).code, 0);
    EXPECT_TRUE(std::equal(cpu.packed.begin(), cpu.packed.end(), h.begin()));
    EXPECT_TRUE(std::equal(cpu.codebook.begin(), cpu.codebook.end(), h.begin() + n * kPackedBytes));
    EXPECT_TRUE(std::equal(cpu.scale.begin(), cpu.scale.end(), h.begin() + n * (kPackedBytes + kCodebookSize)));
  }
  cudaFree(d_src);
  cudaFree(d_cw);
  cudaFree(d_out);
  cudaFree(d_err);
}

}  // namespace
}  // namespace lutb::test
