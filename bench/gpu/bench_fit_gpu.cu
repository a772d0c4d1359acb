// bench/gpu/bench_fit_gpu.cu: throughput of the GPU fitters (lutb/cuda/fit.hpp) on a BF16 expert
// stack already on the device (default [8, 4096, 7168]: a DeepSeek-V3 w13 chunk), by named
// configuration:
//   binned-dp         fit_device with the default fitter, writing the per-tile sums (the default);
//   optimal           fit_device with the exact fitter;
//   binned-dp-weighted, optimal-weighted
//                     the same with column weights (the calibrated fit: fit_device's
//                     d_column_weights), log-uniform over 1e-3..1e3 per expert and column;
//   binned-dp-thread  the thread-per-tile baseline (only in a build with -DLUTB_BENCH_BASELINES=ON);
//   online            quantize_experts_online (check + fit + lane-major + stats, host-timed) on a
//                     layer of w13 = the stack [E, N, K] and w2 [E, K, N/2] (N a multiple of 16).
// Data by name: gaussian (sigma 0.02, rounded to BF16) or student-t (Student-t(3)-like: a Gaussian
// over the root of a chi-square(3)/3 of three more Gaussians, times 0.02).
//
//   bench_fit_gpu [--config NAME]... [--data NAME]... [--shape E,N,K] [--check-rows R]
//
// Method: bench/gpu/timing.cuh (one warm-up, 5 batches of 3 launches, the median batch's mean);
// the stack is far larger than the L2, so no rotation is needed. Output: one markdown row per
// (configuration, data): weights/s, the SQNR over the stack from the per-tile sums, and whether the
// GPU bytes equal lutb::quantize's on a sample (the first R rows of expert 0; 0 skips the check).
// Exit status 2 when a sample differs.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/fit/fit_internal.cuh"
#include "lutb/cuda/fit.hpp"
#include "lutb/cuda/online.hpp"
#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"
#include "timing.cuh"

namespace {

using lutb::bench::time_launches;
using lutb::bench::TimingOptions;
namespace cuda = lutb::cuda;

struct Args {
  std::vector<std::string> configs, data;
  std::int64_t E = 8, N = 4096, K = 7168;
  std::int64_t check_rows = 256;
};

bool known_config(const std::string& c) {
#ifdef LUTB_BENCH_BASELINES
  if (c == "binned-dp-thread") return true;
#endif
  return c == "binned-dp" || c == "optimal" || c == "binned-dp-weighted" || c == "optimal-weighted" || c == "online";
}

bool weighted(const std::string& c) { return c == "binned-dp-weighted" || c == "optimal-weighted"; }

// Column weights [E][K], log-uniform over 1e-3..1e3 (a fixed hash of expert and column).
std::vector<float> column_weights(std::int64_t E, std::int64_t K) {
  std::vector<float> w(static_cast<std::size_t>(E * K));
  for (std::size_t i = 0; i < w.size(); ++i) {
    const unsigned long long h = (i + 1) * 0x9e3779b97f4a7c15ull;
    w[i] = std::pow(10.0f, -3.0f + 6.0f * static_cast<float>((h >> 40) & 0xffffffu) / 16777216.0f);
  }
  return w;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    bool good = v != nullptr;
    if (good && k == "--config") good = known_config(v) && (a.configs.push_back(v), true);
    else if (good && k == "--data") good = (std::string(v) == "gaussian" || std::string(v) == "student-t") && (a.data.push_back(v), true);
    else if (good && k == "--shape") good = std::sscanf(v, "%ld,%ld,%ld", &a.E, &a.N, &a.K) == 3 && a.E > 0 && a.N > 0 && a.K > 0;
    else if (good && k == "--check-rows") a.check_rows = std::atoll(v);
    else good = false;
    ++i;
    if (!good) {
      std::fprintf(stderr,
                   "usage: bench_fit_gpu [--config binned-dp|optimal|binned-dp-weighted|optimal-weighted|online%s]... "
                   "[--data gaussian|student-t]... "
                   "[--shape E,N,K] [--check-rows R]\n",
#ifdef LUTB_BENCH_BASELINES
                   "|binned-dp-thread"
#else
                   ""
#endif
      );
      std::exit(1);
    }
  }
  if (a.configs.empty()) a.configs = {"binned-dp"};
  if (a.data.empty()) a.data = {"gaussian"};
  return a;
}

__device__ float gauss(unsigned long long i, unsigned k) {
  auto h = [](unsigned long long x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
  };
  const unsigned long long a = h(i * 8 + k), b = h(i * 8 + k + 4);
  const float u1 = (static_cast<float>(a >> 40) + 1.0f) / 16777217.0f;
  const float u2 = static_cast<float>(b >> 40) / 16777216.0f;
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__global__ void fill(std::uint16_t* w, unsigned long long n, bool student) {
  for (unsigned long long i = blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    float v = gauss(i, 0);
    if (student) {
      const float a = gauss(i, 1), b = gauss(i, 2), c = gauss(i, 3);
      v = v / sqrtf((a * a + b * b + c * c) / 3.0f + 1e-6f);
    }
    w[i] = lutb::bf16_from_float(0.02f * v);
  }
}

lutb::LutbShape stack(std::int64_t e, std::int64_t n, std::int64_t k) { return lutb::LutbShape{e, n, k, true}; }

// Device outputs for `tiles` tiles, with the per-tile sums.
struct DeviceOut {
  cuda::DeviceFitOut o;
  std::size_t tiles;
  explicit DeviceOut(std::size_t t) : tiles(t) {
    LUTB_BENCH_CHECK(cudaMalloc(&o.packed, t * lutb::kPackedBytes));
    LUTB_BENCH_CHECK(cudaMalloc(&o.codebook, t * lutb::kCodebookSize));
    LUTB_BENCH_CHECK(cudaMalloc(&o.scale, t));
    LUTB_BENCH_CHECK(cudaMalloc(&o.sse, t * 8));
    LUTB_BENCH_CHECK(cudaMalloc(&o.sum_sq, t * 8));
  }
  ~DeviceOut() {
    for (void* p : {static_cast<void*>(o.packed), static_cast<void*>(o.codebook), static_cast<void*>(o.scale),
                    static_cast<void*>(o.sse), static_cast<void*>(o.sum_sq)})
      cudaFree(p);
  }
  lutb::FitStats stats() const {  // summed in tile order, as lutb::quantize
    std::vector<double> a(tiles), b(tiles);
    LUTB_BENCH_CHECK(cudaMemcpy(a.data(), o.sse, tiles * 8, cudaMemcpyDeviceToHost));
    LUTB_BENCH_CHECK(cudaMemcpy(b.data(), o.sum_sq, tiles * 8, cudaMemcpyDeviceToHost));
    lutb::FitStats st;
    st.tiles = static_cast<std::int64_t>(tiles);
    for (std::size_t t = 0; t < tiles; ++t) {
      st.sse += a[t];
      st.sum_sq += b[t];
    }
    return st;
  }
};

// The GPU bytes of the first `rows` rows of expert 0 (whole tile rows: the leading tiles of the
// output) against lutb::quantize of those rows with `fitter` (and expert 0's column weights `cw`).
bool sample_equals_cpu(const std::uint16_t* d_w, const Args& a, const DeviceOut& out, const char* fitter,
                       const float* cw) {
  const std::int64_t rows = std::min(a.N, a.check_rows / lutb::kTileRows * lutb::kTileRows);
  const lutb::LutbShape s = stack(1, rows, a.K);
  const std::size_t nt = static_cast<std::size_t>(s.tiles());
  std::vector<std::uint16_t> h(static_cast<std::size_t>(rows * a.K));
  LUTB_BENCH_CHECK(cudaMemcpy(h.data(), d_w, h.size() * 2, cudaMemcpyDeviceToHost));
  lutb::LutbTensor cpu;
  lutb::FitOptions fo;
  fo.fitter = fitter;
  fo.column_weights = cw;
  lutb::quantize(h.data(), lutb::DType::BF16, s, cpu, fo, "sample");
  std::vector<std::uint8_t> p(nt * lutb::kPackedBytes), c(nt * lutb::kCodebookSize), sc(nt);
  LUTB_BENCH_CHECK(cudaMemcpy(p.data(), out.o.packed, p.size(), cudaMemcpyDeviceToHost));
  LUTB_BENCH_CHECK(cudaMemcpy(c.data(), out.o.codebook, c.size(), cudaMemcpyDeviceToHost));
  LUTB_BENCH_CHECK(cudaMemcpy(sc.data(), out.o.scale, sc.size(), cudaMemcpyDeviceToHost));
  return p == cpu.packed && c == cpu.codebook && sc == cpu.scale;
}

struct Row {
  double seconds = 0;
  lutb::FitStats stats;
  const char* check = "-";
};

// One kernel configuration on the stack d_w: timed launches, then the stats and the sample check.
Row run_kernel(const std::string& config, const std::uint16_t* d_w, const Args& a) {
  const lutb::LutbShape s = stack(a.E, a.N, a.K);
  DeviceOut out(static_cast<std::size_t>(s.tiles()));
  unsigned long long* d_err = nullptr;
  LUTB_BENCH_CHECK(cudaMalloc(&d_err, 8));
  const cuda::GpuFitter fitter =
      cuda::gpu_fitter(config == "optimal" || config == "optimal-weighted" ? "optimal" : "binned-dp");
  std::vector<float> cw;
  float* d_cw = nullptr;
  if (weighted(config)) {
    cw = column_weights(a.E, a.K);
    LUTB_BENCH_CHECK(cudaMalloc(&d_cw, cw.size() * sizeof(float)));
    LUTB_BENCH_CHECK(cudaMemcpy(d_cw, cw.data(), cw.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  auto launch = [&](std::int64_t) {
#ifdef LUTB_BENCH_BASELINES
    if (config == "binned-dp-thread")
      return cuda::fit_internal::launch_binned_dp_thread(
          cuda::fit_internal::stack_args(d_w, lutb::DType::BF16, s, out.o, -1, d_err, fitter), nullptr);
#endif
    cuda::fit_device(d_w, lutb::DType::BF16, s, out.o, fitter, -1, d_err, nullptr, d_cw);
  };
  Row r;
  r.seconds = time_launches(launch, nullptr, TimingOptions{1, 3, 5}).median_us * 1e-6;
  r.stats = out.stats();
  if (a.check_rows > 0)
    r.check = sample_equals_cpu(d_w, a, out, cuda::gpu_fitter_name(fitter), d_cw ? cw.data() : nullptr) ? "yes" : "NO";
  cudaFree(d_err);
  cudaFree(d_cw);
  return r;
}

// The online method on w13 = d_w [E, N, K], w2 [E, K, N/2]; host-timed, median of 5 after a warm-up.
Row run_online(const std::uint16_t* d_w, const std::uint16_t* d_w2, const Args& a) {
  std::vector<double> secs;
  Row r;
  for (int rep = 0; rep < 6; ++rep) {
    cuda::DeviceExpertSource src;
    src.dtype = lutb::DType::BF16;
    src.experts = a.E;
    src.hidden = a.K;
    src.intermediate = a.N / 2;
    src.w13 = {d_w};
    src.w2 = {d_w2};
    cuda::DeviceLutbLayer layer;
    const auto t0 = std::chrono::steady_clock::now();
    const cuda::GpuOnlineReport rep_ = cuda::quantize_experts_online(src, layer);
    if (rep > 0) secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    r.stats = rep_.w13;
    r.stats += rep_.w2;
  }
  std::sort(secs.begin(), secs.end());
  r.seconds = secs[secs.size() / 2];
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const std::int64_t weights = a.E * a.N * a.K, w2_weights = a.E * a.K * (a.N / 2);
  cudaDeviceProp prop{};
  LUTB_BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::uint16_t *d_w = nullptr, *d_w2 = nullptr;
  LUTB_BENCH_CHECK(cudaMalloc(&d_w, static_cast<std::size_t>(weights) * 2));
  LUTB_BENCH_CHECK(cudaMalloc(&d_w2, static_cast<std::size_t>(std::max<std::int64_t>(w2_weights, 1)) * 2));
  std::printf("GPU %s, %d SMs; BF16 stack [%ld, %ld, %ld]\n\n", prop.name, prop.multiProcessorCount, a.E, a.N, a.K);
  std::printf("| fitter | data | weights | time | weights/s | SQNR | bytes == CPU (first %ld rows) |\n", a.check_rows);
  std::printf("|---|---|---|---|---|---|---|\n");
  bool all_same = true;
  for (const std::string& data : a.data) {
    const bool student = data == "student-t";
    fill<<<4096, 256>>>(d_w, static_cast<unsigned long long>(weights), student);
    fill<<<4096, 256>>>(d_w2, static_cast<unsigned long long>(w2_weights), student);
    LUTB_BENCH_CHECK(cudaDeviceSynchronize());
    for (const std::string& config : a.configs) {
      if (config == "online" && a.N % 16 != 0) {
        std::fprintf(stderr, "online: N must be a multiple of 16 (w13 = [E, 2I, H], I %% 8 == 0)\n");
        return 1;
      }
      const Row r = config == "online" ? run_online(d_w, d_w2, a) : run_kernel(config, d_w, a);
      const double n = static_cast<double>(config == "online" ? weights + w2_weights : weights);
      all_same = all_same && std::strcmp(r.check, "NO") != 0;
      std::printf("| %s | %s | %.4g | %.4f s | %.4g | %.4f dB | %s |\n", config.c_str(), data.c_str(), n, r.seconds,
                  n / r.seconds, r.stats.sqnr_db(), r.check);
    }
  }
  cudaFree(d_w);
  cudaFree(d_w2);
  return all_same ? 0 : 2;
}
