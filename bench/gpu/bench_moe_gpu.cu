// bench/gpu/bench_moe_gpu.cu: the fused LUT-B MoE forward (moe_forward) against the BF16 baseline
// on the same kernel skeleton (moe_forward_bf16), same routings, same process. Prints a markdown
// table (docs/perf/moe-gpu.md is this output): shape, T, experts touched, microseconds per forward
// of each configuration, BF16 / LUT-B and the LUT-B forward's weight bytes per second as a share of
// the device's measured read bandwidth.
//
// Usage: bench_moe_gpu [--config NAME[,NAME...]] [--shape NAME] [--tokens T[,T...]]
//   --config: lutb (the library's choice; default), bf16-baseline (moe_forward_bf16), lutb-decode / lutb-prefill (the swap-AB decode or the prefill
//     kernels forced at every T), lutb-prefill-rs (the prefill forced with the sm_90a register-weight
//     kernels, MoePrefillKernel::RegisterWeights). Default: lutb and bf16-baseline.
//   --shape: deepseek-v3, qwen3-235b, qwen3-30b, mixtral-8x7b (default: all four).
//   --tokens: default 1, 4, 16, 64, 256, 1024, 4096.
// Method (bench/gpu/timing.cuh): each forward (routing precomputed by route_softmax_topk /
// route_deepseek on random logits) is captured in a CUDA graph; the graphs cycle over 8 routings
// and over enough copies of the weights that the weight bytes read between two uses of one copy
// exceed 4x the L2 size (rotation_copies; fewer when device memory does not hold them: the factor
// copies are printed); 3 warm-up launches, then the median over 7 batches of 20 launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "lutb/cuda/moe.hpp"
#include "timing.cuh"

namespace lutb::bench {
namespace {

__device__ __forceinline__ unsigned hash32(unsigned long long i, unsigned seed) {
  unsigned long long z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<unsigned>(z ^ (z >> 31));
}

enum class Fill { Bytes, Codebook, Scale, Bf16Weight, Logit, Bf16Activation };

// Random contents: index bytes, E4M3 codebook bytes (no NaN), scale bytes 117..123, BF16 weights
// uniform(-0.05, 0.05), FP32 logits ~N(0, 1), BF16 activations uniform(-2, 2).
__global__ void fill_kernel(void* p, unsigned long long n, Fill kind, unsigned seed) {
  for (unsigned long long i = blockIdx.x * 256ull + threadIdx.x; i < n; i += 256ull * gridDim.x) {
    const unsigned h = hash32(i, seed);
    const float u = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
    switch (kind) {
      case Fill::Bytes: static_cast<unsigned char*>(p)[i] = static_cast<unsigned char>(h); break;
      case Fill::Codebook: {
        const unsigned char b = static_cast<unsigned char>(h);
        static_cast<unsigned char*>(p)[i] = (b & 0x7f) == 0x7f ? b ^ 1 : b;
        break;
      }
      case Fill::Scale: static_cast<unsigned char*>(p)[i] = static_cast<unsigned char>(117 + h % 7); break;
      case Fill::Bf16Weight: static_cast<unsigned short*>(p)[i] = bf16_from_float((2.0f * u - 1.0f) * 0.05f); break;
      case Fill::Bf16Activation: static_cast<unsigned short*>(p)[i] = bf16_from_float((2.0f * u - 1.0f) * 2.0f); break;
      case Fill::Logit: {
        const float u2 = (static_cast<float>(hash32(i, seed + 1) >> 8) + 0.5f) * (1.0f / 16777216.0f);
        static_cast<float*>(p)[i] = sqrtf(-2.0f * logf(u + 0.5f / 16777216.0f)) * cosf(6.2831853f * u2);
        break;
      }
    }
  }
}

void* device_fill(unsigned long long n, std::size_t elem, Fill kind, unsigned seed) {
  void* p = nullptr;
  LUTB_BENCH_CHECK(cudaMalloc(&p, std::max<unsigned long long>(n, 1) * elem));
  fill_kernel<<<4096, 256>>>(p, n, kind, seed);
  LUTB_BENCH_CHECK(cudaGetLastError());
  return p;
}

__global__ void read_kernel(const uint4* __restrict__ p, unsigned long long n, unsigned* sink) {
  unsigned acc = 0;
  for (unsigned long long i = blockIdx.x * 256ull + threadIdx.x; i < n; i += 256ull * gridDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) atomicAdd(sink, acc);
}

/// The device's read bandwidth (bytes / s): an 8 GiB read kernel.
double read_bandwidth() {
  const unsigned long long bytes = 8ull << 30;
  void* big = device_fill(bytes, 1, Fill::Bytes, 1);
  unsigned* sink = nullptr;
  LUTB_BENCH_CHECK(cudaMalloc(&sink, 4));
  int sms = 0;
  LUTB_BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Timing t = time_launches(
      [&](std::int64_t) { read_kernel<<<sms * 8, 256>>>(static_cast<const uint4*>(big), bytes / 16, sink); }, nullptr,
      {1, 3, 5});
  LUTB_BENCH_CHECK(cudaFree(big));
  LUTB_BENCH_CHECK(cudaFree(sink));
  return bytes / (t.median_us * 1e-6);
}

struct Shape {
  const char* name;
  long long E, H, I;
  int k;
  bool deepseek;  // grouped sigmoid routing (8 groups, 4 chosen), else softmax top-k
};
constexpr Shape kShapes[] = {{"deepseek-v3", 256, 7168, 2048, 8, true},
                             {"qwen3-235b", 128, 4096, 1536, 8, false},
                             {"qwen3-30b", 128, 2048, 768, 8, false},
                             {"mixtral-8x7b", 8, 4096, 14336, 2, false}};

/// A named configuration: which forward, and whether it reads LUT-B or BF16 weights.
struct Config {
  std::string name;
  bool bf16;
  cuda::MoeStrategy strategy;
  cuda::MoePrefillKernel prefill = cuda::MoePrefillKernel::Auto;
};
const std::vector<Config>& known_configs() {
  static const std::vector<Config> v = {{"lutb", false, cuda::MoeStrategy::Auto},
                                        {"bf16-baseline", true, cuda::MoeStrategy::Auto},
                                        {"lutb-decode", false, cuda::MoeStrategy::Decode},
                                        {"lutb-prefill", false, cuda::MoeStrategy::Prefill},
                                        {"lutb-prefill-rs", false, cuda::MoeStrategy::Prefill,
                                         cuda::MoePrefillKernel::RegisterWeights}};
  return v;
}

/// Copies of one configuration's weight stacks, rotated so that HBM, not L2, serves the weights.
struct Weights {
  std::vector<cuda::DeviceMoeWeights> lutb;
  std::vector<cuda::DeviceMoeWeightsBf16> bf16;
  std::vector<void*> buffers;
  ~Weights() {
    for (void* p : buffers) cudaFree(p);
  }
};

/// `copies` copies (fewer when they do not fit in 90 % of the free memory) of random stacks.
void make_weights(Weights& w, const Shape& s, bool bf16, int copies, std::int64_t stack_bytes) {
  std::size_t free = 0, total = 0;
  LUTB_BENCH_CHECK(cudaMemGetInfo(&free, &total));
  copies = std::max(1, std::min<int>(copies, static_cast<int>(0.9 * static_cast<double>(free) / stack_bytes)));
  const LutbShape s13{s.E, 2 * s.I, s.H, true}, s2{s.E, s.H, s.I, true};
  for (int c = 0; c < copies; ++c) {
    const unsigned seed = 100 + 10 * c;
    if (bf16) {
      auto* b13 = static_cast<std::uint16_t*>(device_fill(2ull * s.E * s.I * s.H, 2, Fill::Bf16Weight, seed));
      auto* b2 = static_cast<std::uint16_t*>(device_fill(1ull * s.E * s.H * s.I, 2, Fill::Bf16Weight, seed + 1));
      w.buffers.insert(w.buffers.end(), {b13, b2});
      w.bf16.push_back({s.E, s.H, s.I, b13, b2});
      continue;
    }
    auto stack = [&](const LutbShape& sh, unsigned sd) {
      auto* p = static_cast<std::uint8_t*>(device_fill(sh.tiles() * 192, 1, Fill::Bytes, sd));
      auto* cb = static_cast<std::uint8_t*>(device_fill(sh.tiles() * 8, 1, Fill::Codebook, sd + 1));
      auto* sc = static_cast<std::uint8_t*>(device_fill(sh.tiles(), 1, Fill::Scale, sd + 2));
      w.buffers.insert(w.buffers.end(), {p, cb, sc});
      cuda::DeviceLutb d{sh, p, cb, sc};
      cuda::to_lane_major(d, nullptr);
      return d;
    };
    w.lutb.push_back({s.E, s.H, s.I, stack(s13, seed), stack(s2, seed + 5)});
  }
}

/// Microseconds per forward of `cfg` at T tokens, cycling over `routings` and the weight copies.
double time_config(const Config& cfg, const Weights& w, const Shape& s, long long T, int routings,
                   const std::uint16_t* x, const int* ids, const float* wts, std::uint16_t* out, void* ws,
                   std::size_t wsb, long long Tmax, cudaStream_t st) {
  const int copies = static_cast<int>(cfg.bf16 ? w.buffers.size() / 2 : w.lutb.size());
  const int graphs = std::max(copies, routings);
  std::vector<cudaGraphExec_t> execs(graphs);
  for (int j = 0; j < graphs; ++j) {
    const int r = j % routings, c = j % copies;
    cudaGraph_t g;
    LUTB_BENCH_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    const cuda::MoeOptions opt{cfg.strategy, cfg.prefill};
    const auto* xr = x + 1ull * r * Tmax * s.H;
    const int* id = ids + 1ull * r * Tmax * s.k;
    const float* wt = wts + 1ull * r * Tmax * s.k;
    if (cfg.bf16) cuda::moe_forward_bf16(w.bf16[c], xr, T, s.k, id, wt, out, ws, wsb, st, opt);
    if (!cfg.bf16) cuda::moe_forward(w.lutb[c], xr, T, s.k, id, wt, out, ws, wsb, st, opt);
    LUTB_BENCH_CHECK(cudaStreamEndCapture(st, &g));
    LUTB_BENCH_CHECK(cudaGraphInstantiate(&execs[j], g, 0));
    LUTB_BENCH_CHECK(cudaGraphDestroy(g));
  }
  const Timing t = time_launches([&](std::int64_t i) { LUTB_BENCH_CHECK(cudaGraphLaunch(execs[i % graphs], st)); }, st);
  for (auto e : execs) LUTB_BENCH_CHECK(cudaGraphExecDestroy(e));
  return t.median_us;
}

/// One shape: every T, every configuration; prints the table rows.
void run_shape(const Shape& s, const std::vector<Config>& cfgs, const std::vector<long long>& Ts, double read_bw) {
  constexpr int kRoutings = 8;
  const long long Tmax = *std::max_element(Ts.begin(), Ts.end());
  const std::int64_t lutb_expert = (LutbShape{1, 2 * s.I, s.H, true}.tiles() + LutbShape{1, s.H, s.I, true}.tiles()) * 201;
  const std::int64_t bf16_expert = 2ll * 3 * s.H * s.I;
  // Copies for the smallest batch (k experts per forward): the most any T needs. One set of LUT-B
  // and one of BF16 stacks, shared by the configurations that read them.
  Weights lutb_w, bf16_w;
  for (const bool bf16 : {false, true}) {
    if (std::none_of(cfgs.begin(), cfgs.end(), [&](const Config& c) { return c.bf16 == bf16; })) continue;
    const std::int64_t per_expert = bf16 ? bf16_expert : lutb_expert;
    make_weights(bf16 ? bf16_w : lutb_w, s, bf16, rotation_copies(s.k * per_expert, 4.0), s.E * per_expert);
  }
  auto* x = static_cast<std::uint16_t*>(device_fill(1ull * Tmax * s.H * kRoutings, 2, Fill::Bf16Activation, 18));
  auto* logits = static_cast<float*>(device_fill(1ull * Tmax * s.E * kRoutings, 4, Fill::Logit, 19));
  int* ids = nullptr;
  float *wts = nullptr, *bias = nullptr;
  std::uint16_t* out = nullptr;
  LUTB_BENCH_CHECK(cudaMalloc(&ids, 4ull * Tmax * s.k * kRoutings));
  LUTB_BENCH_CHECK(cudaMalloc(&wts, 4ull * Tmax * s.k * kRoutings));
  LUTB_BENCH_CHECK(cudaMalloc(&bias, 4ull * s.E));
  LUTB_BENCH_CHECK(cudaMemset(bias, 0, 4ull * s.E));
  LUTB_BENCH_CHECK(cudaMalloc(&out, 2ull * Tmax * s.H));
  const std::size_t wsb = cuda::moe_workspace_bytes(Tmax, s.k, s.E, s.H, s.I);
  void* ws = nullptr;
  LUTB_BENCH_CHECK(cudaMalloc(&ws, wsb));
  cudaStream_t st;
  LUTB_BENCH_CHECK(cudaStreamCreate(&st));
  for (long long T : Ts) {
    double touched = 0;
    for (int r = 0; r < kRoutings; ++r) {
      const float* lg = logits + 1ull * r * Tmax * s.E;
      int* id = ids + 1ull * r * Tmax * s.k;
      float* wt = wts + 1ull * r * Tmax * s.k;
      if (s.deepseek) cuda::route_deepseek(lg, bias, T, static_cast<int>(s.E), 8, 4, s.k, true, 2.5f, id, wt, st);
      else cuda::route_softmax_topk(lg, T, static_cast<int>(s.E), s.k, true, id, wt, st);
      std::vector<int> h(T * s.k);
      LUTB_BENCH_CHECK(cudaMemcpyAsync(h.data(), id, 4ull * T * s.k, cudaMemcpyDeviceToHost, st));
      LUTB_BENCH_CHECK(cudaStreamSynchronize(st));
      touched += static_cast<double>(std::set<int>(h.begin(), h.end()).size()) / kRoutings;
    }
    std::printf("| %s | %lld | %.1f |", s.name, T, touched);
    double lutb_us = 0, bf16_us = 0;
    for (std::size_t c = 0; c < cfgs.size(); ++c) {
      const double us = time_config(cfgs[c], cfgs[c].bf16 ? bf16_w : lutb_w, s, T, kRoutings, x, ids, wts, out, ws, wsb, Tmax, st);
      if (cfgs[c].name == "lutb") lutb_us = us;
      if (cfgs[c].name == "bf16-baseline") bf16_us = us;
      std::printf(" %.1f |", us);
    }
    if (lutb_us > 0 && bf16_us > 0) std::printf(" %.2f |", bf16_us / lutb_us);
    if (lutb_us > 0) std::printf(" %.0f %% |", 100.0 * touched * lutb_expert / (lutb_us * 1e-6) / read_bw);
    std::printf("\n");
  }
  std::printf("<!-- %s: %zu LUT-B and %zu BF16 weight copies -->\n", s.name, lutb_w.lutb.size(), bf16_w.buffers.size() / 2);
  LUTB_BENCH_CHECK(cudaStreamDestroy(st));
  for (void* p : {static_cast<void*>(x), static_cast<void*>(logits), static_cast<void*>(ids), static_cast<void*>(wts),
                  static_cast<void*>(bias), static_cast<void*>(out), ws})
    LUTB_BENCH_CHECK(cudaFree(p));
}

/// Splits "a,b,c".
std::vector<std::string> split_list(const char* s) {
  std::vector<std::string> v;
  std::string cur;
  for (const char* c = s;; ++c) {
    if (*c == ',' || *c == '\0') {
      if (!cur.empty()) v.push_back(cur);
      cur.clear();
      if (*c == '\0') break;
    } else {
      cur += *c;
    }
  }
  return v;
}

/// The configurations named in `names` (empty: lutb and, when built, bf16-baseline); exits on an unknown one.
std::vector<Config> pick_configs(const std::vector<std::string>& names) {
  std::vector<std::string> want = names;
  if (want.empty()) want = {"lutb", "bf16-baseline"};
  std::vector<Config> v;
  for (const std::string& n : want) {
    auto it = std::find_if(known_configs().begin(), known_configs().end(), [&](const Config& c) { return c.name == n; });
    if (it == known_configs().end()) {
      std::fprintf(stderr, "bench_moe_gpu: unknown --config %s (lutb, bf16-baseline, "
                           "lutb-decode, lutb-prefill, lutb-prefill-rs)\n", n.c_str());
      std::exit(2);
    }
    v.push_back(*it);
  }
  return v;
}

}  // namespace
}  // namespace lutb::bench

int main(int argc, char** argv) {
  using namespace lutb::bench;
  std::vector<std::string> config_names, shape_names;
  std::vector<long long> Ts = {1, 4, 16, 64, 256, 1024, 4096};
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 == argc) {
      std::fprintf(stderr, "bench_moe_gpu: %s needs a value\n", argv[i]);
      return 2;
    }
    if (!std::strcmp(argv[i], "--config")) config_names = split_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--shape")) shape_names = split_list(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--tokens")) {
      Ts.clear();
      for (const std::string& t : split_list(argv[i + 1])) Ts.push_back(std::stoll(t));
    } else {
      std::fprintf(stderr, "usage: bench_moe_gpu [--config NAME,...] [--shape NAME,...] [--tokens T,...]\n");
      return 2;
    }
  }
  const std::vector<Config> cfgs = pick_configs(config_names);
  cudaDeviceProp prop;
  LUTB_BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double read_bw = read_bandwidth();
  std::printf("# %s, %d SMs, L2 %d MB; measured read bandwidth %.0f GB/s; weight copies rotated for >= 4x L2\n\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, read_bw / 1e9);
  std::printf("| shape | T | experts touched |");
  for (const Config& c : cfgs) std::printf(" %s us |", c.name.c_str());
  const bool ratio = std::any_of(cfgs.begin(), cfgs.end(), [](const Config& c) { return c.name == "bf16-baseline"; }) &&
                     std::any_of(cfgs.begin(), cfgs.end(), [](const Config& c) { return c.name == "lutb"; });
  const bool lutb = std::any_of(cfgs.begin(), cfgs.end(), [](const Config& c) { return c.name == "lutb"; });
  std::printf("%s%s\n|---|---|---|", ratio ? " BF16 / LUT-B |" : "", lutb ? " LUT-B % of read BW |" : "");
  for (std::size_t j = 0; j < cfgs.size() + ratio + lutb; ++j) std::printf("---|");
  std::printf("\n");
  for (const Shape& s : kShapes)
    if (shape_names.empty() || std::find(shape_names.begin(), shape_names.end(), s.name) != shape_names.end())
      run_shape(s, cfgs, Ts, read_bw);
  return 0;
}
