// bench/gpu/bench_moe_gpu.cu: fused LUT-B MoE forward vs the BF16 baseline on the same kernel
// skeleton, same routing, same run; plus the device's measured read bandwidth and cuBLAS BF16 dense
// throughput. Prints a markdown table (docs/perf/moe-gpu.md is this output).
//
// Usage: bench_moe_gpu [--quick] [--shape NAME] [--tokens T] [--variants LIST]
//   (NAME: deepseek-v3, qwen3-235b, qwen3-30b, mixtral-8x7b; --tokens T or T1,T2,...: only those batch sizes;
//   --variants, e.g. 0,7 or 1,10: only those forwards of the `make` switch (0..11, 20..37, 40..52, 65..76; 10 = the swap-AB
//   decode on FP8 wgmma, 11 = the warp-specialised swap-AB decode; 20..37: session 14's small-batch paths,
//   stage timing and forced K splits; 40..49: L2 prefetch of GEMM2's weights; 50 / 51 / 52: the late tile
//   scales everywhere at 128 / 96 registers / nowhere, session 16; 65..68: session 17 (small17), 65 = the default
//   (in a -DLUTB_SWAPAB_PHASES build followed by its GEMMs' phase tables), 66 / 67 / 68 = the default without
//   the one-token tail / kDecodeOneWave / both, 69 = the tail everywhere; 70..74: session 18 (act18), 70 = the
//   default with GEMM1's epilogue in the activation kernel everywhere (kDecodeActKernel), 71 = 70 without GEMM1's
//   split-K, 72 = the default without the kernel and without the split, 73 = 70 followed by the phase tables in a
//   -DLUTB_SWAPAB_PHASES build, 74 = the default without the kernel's rule (session 17's default); 75, 76:
//   session 19 (act19), second copies of 70 (the kernel everywhere) and 74 (nowhere) for ABBA in one process),
//   a compact row, no cuBLAS: for quick A/B runs of kernel changes)
// Each forward (routing kernel excluded; the routing is precomputed by route_softmax_topk /
// route_deepseek on random logits) is captured in a CUDA graph; R = 8 different routings are cycled
// so that the experts touched change from call to call (weights of one call are not in L2 for the
// next, except by chance); the time is the median over 7 batches of the mean per call.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "lutb/cuda/moe.hpp"

using namespace lutb;

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

__device__ __forceinline__ unsigned hash32(unsigned long long i, unsigned seed) {
  unsigned long long z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<unsigned>(z ^ (z >> 31));
}
// kind 0: random bytes; 1: E4M3 codebook bytes (no NaN); 2: scale bytes 117..123;
// 3: BF16 uniform(-a, a) (a = 0.05); 4: FP32 normal-ish logits; 5: BF16 activations ~uniform(-2, 2)
__global__ void fill_kernel(void* p, unsigned long long n, int kind, unsigned seed) {
  for (unsigned long long i = blockIdx.x * 256ull + threadIdx.x; i < n; i += 256ull * gridDim.x) {
    const unsigned h = hash32(i, seed);
    if (kind == 0) static_cast<unsigned char*>(p)[i] = static_cast<unsigned char>(h);
    else if (kind == 1) {
      unsigned char b = static_cast<unsigned char>(h);
      if ((b & 0x7f) == 0x7f) b ^= 1;
      static_cast<unsigned char*>(p)[i] = b;
    } else if (kind == 2) static_cast<unsigned char*>(p)[i] = static_cast<unsigned char>(117 + h % 7);
    else if (kind == 3 || kind == 5) {
      const float a = kind == 3 ? 0.05f : 2.0f;
      const float v = (static_cast<float>(h >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * a;
      static_cast<unsigned short*>(p)[i] = bf16_from_float(v);
    } else {
      const float u1 = (static_cast<float>(h >> 8) + 0.5f) * (1.0f / 16777216.0f);
      const float u2 = (static_cast<float>(hash32(i, seed + 1) >> 8) + 0.5f) * (1.0f / 16777216.0f);
      static_cast<float*>(p)[i] = sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
    }
  }
}
void fill(void* p, unsigned long long n, int kind, unsigned seed) {
  fill_kernel<<<4096, 256>>>(p, n, kind, seed);
  CK(cudaGetLastError());
}

__global__ void read_kernel(const uint4* __restrict__ p, unsigned long long n, unsigned* sink) {
  unsigned acc = 0;
  for (unsigned long long i = blockIdx.x * 256ull + threadIdx.x; i < n; i += 256ull * gridDim.x) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) atomicAdd(sink, acc);
}

/// Median over 7 repetitions of the mean time of `iters` calls of f(i) on `stream`, in ms.
template <class F>
float time_ms(F&& f, int iters, cudaStream_t stream = nullptr) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> v;
  for (int rep = 0; rep < 7; ++rep) {
    CK(cudaEventRecord(a, stream));
    for (int i = 0; i < iters; ++i) f(i);
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    v.push_back(ms / iters);
  }
  std::sort(v.begin(), v.end());
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return v[v.size() / 2];
}

/// cuBLAS grouped BF16 GEMMs of one MoE layer (the large-T baseline): per touched expert e with n_e
/// routed tokens, GEMM1 [n_e, H] x w13_e^T -> [n_e, 2I] and GEMM2 [n_e, I] x w2_e^T -> [n_e, H], each
/// as ONE cublasGemmGroupedBatchedEx call (one group per expert), BF16 in and out, FP32 compute.
/// Only the two GEMMs are timed (no gather, activation, quantisation or reduction), so this is a
/// lower bound on a cuBLAS-based BF16 MoE layer. Returns the median ms.
float cublas_grouped_ms(cublasHandle_t h, const std::vector<int>& ids, long long E, long long H, long long I,
                        const unsigned short* w13, const unsigned short* w2, cudaStream_t st) {
  std::vector<int> cnt(E, 0);
  for (int e : ids) cnt[e]++;
  std::vector<int> m1, n1, k1, lda1, ldb1, ldc1, m2, n2, k2, lda2, ldb2, ldc2, gs;
  std::vector<cublasOperation_t> ta, tb;
  std::vector<float> one, zero;
  std::vector<const void*> A1, B1, A2, B2;
  std::vector<void*> C1, C2;
  long long P = 0;
  for (long long e = 0; e < E; ++e) P += cnt[e];
  void *x, *h1, *hh, *y;
  CK(cudaMalloc(&x, 2ull * P * H));
  CK(cudaMalloc(&h1, 4ull * P * I));
  CK(cudaMalloc(&hh, 2ull * P * I));
  CK(cudaMalloc(&y, 2ull * P * H));
  fill(x, 1ull * P * H, 5, 31);
  fill(hh, 1ull * P * I, 5, 32);
  long long off = 0;
  for (long long e = 0; e < E; ++e) {
    if (!cnt[e]) continue;
    const int n = cnt[e];
    // Column-major views of row-major data: GEMM1 C (2I x n) = (w13_e as H x 2I)^T * (x_e as H x n).
    m1.push_back(static_cast<int>(2 * I)); n1.push_back(n); k1.push_back(static_cast<int>(H));
    lda1.push_back(static_cast<int>(H)); ldb1.push_back(static_cast<int>(H)); ldc1.push_back(static_cast<int>(2 * I));
    A1.push_back(w13 + e * 2 * I * H); B1.push_back(static_cast<unsigned short*>(x) + off * H);
    C1.push_back(static_cast<unsigned short*>(h1) + off * 2 * I);
    // GEMM2 C (H x n) = (w2_e as I x H)^T * (h_e as I x n).
    m2.push_back(static_cast<int>(H)); n2.push_back(n); k2.push_back(static_cast<int>(I));
    lda2.push_back(static_cast<int>(I)); ldb2.push_back(static_cast<int>(I)); ldc2.push_back(static_cast<int>(H));
    A2.push_back(w2 + e * H * I); B2.push_back(static_cast<unsigned short*>(hh) + off * I);
    C2.push_back(static_cast<unsigned short*>(y) + off * H);
    ta.push_back(CUBLAS_OP_T); tb.push_back(CUBLAS_OP_N); one.push_back(1.0f); zero.push_back(0.0f); gs.push_back(1);
    off += n;
  }
  const int G = static_cast<int>(gs.size());
  auto dev_ptrs = [&](const auto& v) {
    void** d = nullptr;
    CK(cudaMalloc(&d, sizeof(void*) * v.size()));
    CK(cudaMemcpy(d, v.data(), sizeof(void*) * v.size(), cudaMemcpyHostToDevice));
    return d;
  };
  void **dA1 = dev_ptrs(A1), **dB1 = dev_ptrs(B1), **dC1 = dev_ptrs(C1), **dA2 = dev_ptrs(A2), **dB2 = dev_ptrs(B2),
       **dC2 = dev_ptrs(C2);
  cublasSetStream(h, st);
  auto run = [&](int) {
    cublasStatus_t r1 = cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), m1.data(), n1.data(), k1.data(), one.data(),
                                                   dA1, CUDA_R_16BF, lda1.data(), dB1, CUDA_R_16BF, ldb1.data(),
                                                   zero.data(), dC1, CUDA_R_16BF, ldc1.data(), G, gs.data(),
                                                   CUBLAS_COMPUTE_32F);
    cublasStatus_t r2 = cublasGemmGroupedBatchedEx(h, ta.data(), tb.data(), m2.data(), n2.data(), k2.data(), one.data(),
                                                   dA2, CUDA_R_16BF, lda2.data(), dB2, CUDA_R_16BF, ldb2.data(),
                                                   zero.data(), dC2, CUDA_R_16BF, ldc2.data(), G, gs.data(),
                                                   CUBLAS_COMPUTE_32F);
    if (r1 != CUBLAS_STATUS_SUCCESS || r2 != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "cublasGemmGroupedBatchedEx failed: %d %d\n", static_cast<int>(r1), static_cast<int>(r2));
      std::exit(1);
    }
  };
  run(0);
  CK(cudaStreamSynchronize(st));
  const float ms = time_ms(run, 3, st);
  for (void* q : {x, h1, hh, y}) CK(cudaFree(q));
  for (void** q : {dA1, dB1, dC1, dA2, dB2, dC2}) CK(cudaFree(q));
  cublasSetStream(h, nullptr);
  return ms;
}

struct Shape {
  const char* name;
  long long E, H, I;
  int k;
  bool deepseek;
};

constexpr int kVariants = 77;  // forwards of the `make` switch below (0..11, 20..37, 40..52, 65..76)

#ifdef LUTB_SWAPAB_PHASES
// Variant 65 in a -DLUTB_SWAPAB_PHASES build (session 17, small17; lutb/cuda/moe.hpp SwapPhaseRecord
// has the marks): after the timing, each routing's graph is replayed once more with the phase buffer
// set, and per swap-AB GEMM this prints (a) the marks' times since the first GEMM1 warp's entry
// (%globaltimer; GEMM2's marks on the same origin), percentiles over all warps of all replays; (b)
// the phases' durations per warp (clock64 cycles, converted with the clock the run measured: the
// warps' globaltimer spans over their clock64 spans); (c) the SM placement: SMs by the number of
// CTAs they ran (per replay), with when their last warp ended.
void print_swap_phases(const std::vector<cudaGraphExec_t>& gs, cudaStream_t st, const char* shape, long long T) {
  constexpr size_t kMax = cuda::kSwapPhaseMaxWarps, n = 2 * kMax;
  cuda::SwapPhaseRecord* d = nullptr;
  CK(cudaMalloc(&d, n * sizeof *d));
  std::vector<cuda::SwapPhaseRecord> h(n);
  struct Warp {
    double t[8];       // us since the replay's first GEMM1 entry (-1: mark not reached)
    long long c[8];    // clock64
    unsigned sm, cta, warp, nw, kt;
    int rep;
  };
  std::vector<Warp> all[2];
  unsigned long long gran = ~0ull;  // smallest positive globaltimer step seen inside one warp
  double sum_ns = 0, sum_cyc = 0;
  cuda::set_swap_phase_buffer(d);
  for (size_t r = 0; r < gs.size(); ++r) {
    CK(cudaMemsetAsync(d, 0, n * sizeof *d, st));
    CK(cudaGraphLaunch(gs[r], st));
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(h.data(), d, n * sizeof *d, cudaMemcpyDeviceToHost));
    unsigned long long t0 = ~0ull;
    for (size_t i = 0; i < kMax; ++i)
      if (h[i].gt[0]) t0 = std::min(t0, h[i].gt[0]);
    for (size_t i = 0; t0 == ~0ull && i < n; ++i)
      if (h[i].gt[0]) t0 = std::min(t0, h[i].gt[0]);
    for (int g = 0; g < 2; ++g)
      for (size_t i = 0; i < kMax; ++i) {
        const cuda::SwapPhaseRecord& q = h[g * kMax + i];
        if (!q.gt[0]) continue;
        Warp w{};
        for (int m = 0; m < 8; ++m) {
          w.t[m] = q.gt[m] ? (static_cast<double>(q.gt[m]) - static_cast<double>(t0)) * 1e-3 : -1.0;
          w.c[m] = q.clk[m];
        }
        for (int m = 1; m < 8; ++m)
          if (q.gt[m] && q.gt[m - 1] && q.gt[m] > q.gt[m - 1]) gran = std::min(gran, q.gt[m] - q.gt[m - 1]);
        const int last = q.gt[7] ? 7 : 6;
        if (q.gt[last] > q.gt[0] + 2000) {  // spans > 2 us: the clock estimate
          sum_ns += static_cast<double>(q.gt[last] - q.gt[0]);
          sum_cyc += static_cast<double>(q.clk[last] - q.clk[0]);
        }
        w.sm = q.smid;
        w.cta = q.cta;
        w.warp = q.warp_info & 255u;
        w.nw = (q.warp_info >> 8) & 255u;
        w.kt = q.ktiles;
        w.rep = static_cast<int>(r);
        all[g].push_back(w);
      }
  }
  // The forward's time with the marks stored (the variant's own row is timed with the buffer unset).
  const float marked_ms = time_ms(
      [&](int i) {
        for (size_t r = 0; r < gs.size(); ++r) CK(cudaGraphLaunch(gs[(i + r) % gs.size()], st));
      },
      4, st) / static_cast<float>(gs.size());
  cuda::set_swap_phase_buffer(nullptr);
  CK(cudaFree(d));
  std::printf("\n#### forward with the phase marks stored: %.1f us per forward\n", marked_ms * 1e3);
  const double ghz = sum_ns > 0 ? sum_cyc / sum_ns : 1.98;
  auto pct = [](std::vector<double> v, double p) {
    if (v.empty()) return -1.0;
    std::sort(v.begin(), v.end());
    return v[static_cast<size_t>(p * (v.size() - 1) + 0.5)];
  };
  std::printf("\n#### phases: %s T = %lld (%zu replays; globaltimer step >= %llu ns; SM clock from the warps' "
              "spans %.3f GHz)\n", shape, T, gs.size(), gran == ~0ull ? 0ull : gran, ghz);
  const char* mark_name[8] = {"0 entry", "1 prologue done", "2 ring issued", "3 after PDL wait", "4 first data",
                              "5 K-loop done", "6 reduce done", "7 epilogue done (warp 0)"};
  const char* phase_name[7] = {"prologue (routing, strips, pointers)", "ring prologue issue", "PDL wait",
                               "first ring data", "K-loop", "cross-warp reduce (+ cluster combine)",
                               "epilogue (warp 0)"};
  for (int g = 0; g < 2; ++g) {
    const std::vector<Warp>& A = all[g];
    if (A.empty()) continue;
    std::vector<double> kt;
    std::set<std::pair<int, unsigned>> ctas;
    for (const Warp& w : A) {
      kt.push_back(w.kt);
      ctas.insert({w.rep, w.cta});
    }
    std::printf("\nGEMM%d: %zu warps per replay in %zu CTAs of %u warps; K-tiles per warp median %.0f (min %.0f, max "
                "%.0f)\n\n| mark | p10 us | median us | p90 us | max us |\n|---|---|---|---|---|\n",
                g + 1, A.size() / gs.size(), ctas.size() / gs.size(), A.front().nw, pct(kt, 0.5), pct(kt, 0.0),
                pct(kt, 1.0));
    for (int m = 0; m < 8; ++m) {
      std::vector<double> v;
      for (const Warp& w : A)
        if (w.t[m] >= 0) v.push_back(w.t[m]);
      if (v.empty()) continue;
      std::printf("| %s | %.2f | %.2f | %.2f | %.2f |\n", mark_name[m], pct(v, 0.1), pct(v, 0.5), pct(v, 0.9),
                  pct(v, 1.0));
    }
    std::printf("\n| phase (per warp, clock64) | median cycles | p90 cycles | median us | p90 us |\n|---|---|---|---|---|\n");
    for (int m = 0; m < 7; ++m) {
      std::vector<double> v;
      for (const Warp& w : A)
        if (w.t[m] >= 0 && w.t[m + 1] >= 0) v.push_back(static_cast<double>(w.c[m + 1] - w.c[m]));
      if (v.empty()) continue;
      std::printf("| %d-%d %s | %.0f | %.0f | %.2f | %.2f |\n", m, m + 1, phase_name[m], pct(v, 0.5), pct(v, 0.9),
                  pct(v, 0.5) / ghz * 1e-3, pct(v, 0.9) / ghz * 1e-3);
    }
    {
      std::vector<double> v;
      for (const Warp& w : A)
        if (w.t[6] >= 0) v.push_back(static_cast<double>(w.c[6] - w.c[0]));
      std::printf("| 0-6 warp life to reduce done | %.0f | %.0f | %.2f | %.2f |\n", pct(v, 0.5), pct(v, 0.9),
                  pct(v, 0.5) / ghz * 1e-3, pct(v, 0.9) / ghz * 1e-3);
    }
    // SM placement: per (replay, SM): CTAs, first entry, last end.
    struct Sm {
      std::set<unsigned> ctas;
      double first = 1e30, end = -1;
    };
    std::vector<std::vector<Sm>> sms(gs.size(), std::vector<Sm>(1024));
    for (const Warp& w : A) {
      if (w.sm >= 1024) continue;
      Sm& q = sms[w.rep][w.sm];
      q.ctas.insert(w.cta);
      q.first = std::min(q.first, w.t[0]);
      q.end = std::max(q.end, w.t[7] >= 0 ? w.t[7] : w.t[6]);
    }
    std::printf("\n| CTAs on the SM | SMs (per replay) | SM first entry, mean us | SM last end, mean us | max us |\n"
                "|---|---|---|---|---|\n");
    for (size_t c = 0; c <= 16; ++c) {
      double cnt = 0, f = 0, e = 0, mx = -1;
      for (auto& rep : sms)
        for (auto& q : rep)
          if (q.ctas.size() == c && (c > 0)) {
            cnt += 1;
            f += q.first;
            e += q.end;
            mx = std::max(mx, q.end);
          }
      if (cnt > 0)
        std::printf("| %zu | %.1f | %.2f | %.2f | %.2f |\n", c, cnt / gs.size(), f / cnt, e / cnt, mx);
    }
    {
      double idle = 0;
      for (auto& rep : sms)
        for (auto& q : rep)
          if (q.ctas.empty()) idle += 1;
      std::printf("| 0 (of the first 1024 SM ids) | %.1f | - | - | - |\n", idle / gs.size());
    }
  }
  std::fflush(stdout);
}
#endif

int main(int argc, char** argv) {
  bool quick = false;
  std::string only;
  std::vector<long long> only_Ts;
  std::vector<int> variants;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--tokens") && i + 1 < argc) {  // one batch size or a list "1,16"
      for (const char* c = argv[++i]; *c;) {
        char* end = nullptr;
        const long long t = std::strtoll(c, &end, 10);
        if (end == c) break;
        if (t > 0) only_Ts.push_back(t);
        c = *end == ',' ? end + 1 : end;
      }
    }
    else if (!std::strcmp(argv[i], "--variants") && i + 1 < argc) {
      // Quick A/B rows: only these variants (numbers of the `make` switch below, e.g. "0,7"), a
      // compact row, no cuBLAS runs.
      for (const char* c = argv[++i]; *c;) {
        char* end = nullptr;
        const long v = std::strtol(c, &end, 10);
        if (end == c) {
          ++c;
          continue;
        }
        if (v >= 0 && v < kVariants) variants.push_back(static_cast<int>(v));
        c = end;
      }
    }
  }
  const bool compact = !variants.empty();
  if (!compact)  // the full table's columns (variant 11 only on request: --variants)
    for (int v = 0; v < 11; ++v) variants.push_back(v);
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# device: %s, %d SMs, L2 %d MB, %.1f GB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              prop.totalGlobalMem / 1e9);

  // ---- measured read bandwidth (8 GiB buffer) and D2D copy
  const unsigned long long bw_bytes = 8ull << 30;
  void* big = nullptr;
  CK(cudaMalloc(&big, bw_bytes));
  unsigned* sink = nullptr;
  CK(cudaMalloc(&sink, 4));
  fill(big, bw_bytes, 0, 1);
  read_kernel<<<prop.multiProcessorCount * 8, 256>>>(static_cast<const uint4*>(big), bw_bytes / 16, sink);
  const float rd_ms = time_ms([&](int) { read_kernel<<<prop.multiProcessorCount * 8, 256>>>(static_cast<const uint4*>(big), bw_bytes / 16, sink); }, 3);
  const double read_bw = bw_bytes / (rd_ms * 1e-3);
  const float cp_ms = time_ms([&](int) { CK(cudaMemcpyAsync(static_cast<char*>(big) + bw_bytes / 2, big, bw_bytes / 2, cudaMemcpyDeviceToDevice)); }, 3);
  const double copy_bw = bw_bytes / (cp_ms * 1e-3);  // bytes read + written
  std::printf("# measured read bandwidth %.0f GB/s (8 GiB read kernel); D2D copy %.0f GB/s (read + write)\n",
              read_bw / 1e9, copy_bw / 1e9);
  // ---- cuBLAS BF16 dense
  if (!compact) {
    const int n = 8192;
    void *A, *B, *C;
    CK(cudaMalloc(&A, 2ull * n * n));
    CK(cudaMalloc(&B, 2ull * n * n));
    CK(cudaMalloc(&C, 2ull * n * n));
    fill(A, 1ull * n * n, 3, 2);
    fill(B, 1ull * n * n, 3, 3);
    cublasHandle_t h;
    cublasCreate(&h);
    const float one = 1, zero = 0;
    auto gemm = [&](int) {
      cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, A, CUDA_R_16BF, n, B, CUDA_R_16BF, n, &zero, C,
                   CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    };
    gemm(0);
    const float ms = time_ms(gemm, 5);
    std::printf("# cuBLAS BF16 dense 8192^3: %.0f TFLOP/s (random data)\n", 2.0 * n * n * (double)n / (ms * 1e-3) / 1e12);
    cublasDestroy(h);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
  }
  CK(cudaFree(big));

  cublasHandle_t cublas;
  cublasCreate(&cublas);
  const Shape shapes[] = {{"deepseek-v3", 256, 7168, 2048, 8, true},
                          {"qwen3-235b", 128, 4096, 1536, 8, false},
                          {"qwen3-30b", 128, 2048, 768, 8, false},
                          {"mixtral-8x7b", 8, 4096, 14336, 2, false}};
  std::vector<long long> Ts = {1, 4, 16, 64, 256, 1024, 4096};
  if (quick) Ts = {1, 16, 256, 4096};
  if (!only_Ts.empty()) Ts = only_Ts;
  const int R = 8;
  if (compact) {
    std::printf("\n| shape | T | experts touched |");
    for (int v : variants) std::printf(" variant %d us |", v);
    std::printf(" variant %d %% of read BW |\n|---|---|---|", variants[0]);
    for (size_t j = 0; j <= variants.size(); ++j) std::printf("---|");
    std::printf("\n");
  } else
  std::printf("\n| shape | T | experts touched | LUT-B us | LUT-B byte-dec us | LUT-B decode (swap-AB) us | swap-AB fp8-mma us | swap-AB fp8-wgmma us | LUT-B prefill us | decode-m16 us | BF16 us (best of decode, prefill) | BF16 best | speed-up | LUT-B GB/s | %% of read BW | BF16 GB/s | %% of read BW | LUT-B TFLOP/s | BF16 TFLOP/s | LUT-B no-PDL us | BF16 best no-PDL us | cuBLAS grouped BF16 GEMMs us (T >= 256) | LUT-B vs cuBLAS |\n");
  if (!compact)
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& s : shapes) {
    if (!only.empty() && only != s.name) continue;
    const long long E = s.E, H = s.H, I = s.I;
    const LutbShape s13{E, 2 * I, H, true}, s2{E, H, I, true};
    unsigned char *p13, *c13, *sc13, *p2, *c2, *sc2;
    CK(cudaMalloc(&p13, s13.tiles() * 192));
    CK(cudaMalloc(&c13, s13.tiles() * 8));
    CK(cudaMalloc(&sc13, s13.tiles()));
    CK(cudaMalloc(&p2, s2.tiles() * 192));
    CK(cudaMalloc(&c2, s2.tiles() * 8));
    CK(cudaMalloc(&sc2, s2.tiles()));
    fill(p13, s13.tiles() * 192, 0, 10);
    fill(c13, s13.tiles() * 8, 1, 11);
    fill(sc13, s13.tiles(), 2, 12);
    fill(p2, s2.tiles() * 192, 0, 13);
    fill(c2, s2.tiles() * 8, 1, 14);
    fill(sc2, s2.tiles(), 2, 15);
    unsigned short *b13, *b2;
    CK(cudaMalloc(&b13, 2ull * E * 2 * I * H));
    CK(cudaMalloc(&b2, 2ull * E * H * I));
    fill(b13, 1ull * E * 2 * I * H, 3, 16);
    fill(b2, 1ull * E * H * I, 3, 17);
    cuda::DeviceMoeWeights w{E, H, I, {s13, p13, c13, sc13}, {s2, p2, c2, sc2}};
    cuda::to_lane_major(w.w13, nullptr);  // load-time index permutation (lutb/cuda/lane_major.hpp)
    cuda::to_lane_major(w.w2, nullptr);
    cuda::DeviceMoeWeightsBf16 wb{E, H, I, b13, b2};
    const double lutb_expert = static_cast<double>(cuda::lutb_bytes_per_expert(w));
    const double bf16_expert = 2.0 * 3 * H * I;
    const long long Tmax = Ts.back();
    const std::size_t wsb = cuda::moe_workspace_bytes(Tmax, s.k, E, H, I);
    void* ws;
    CK(cudaMalloc(&ws, wsb));
    unsigned short *x, *out;
    CK(cudaMalloc(&x, 2ull * Tmax * H * R));
    CK(cudaMalloc(&out, 2ull * Tmax * H));
    fill(x, 1ull * Tmax * H * R, 5, 18);
    float *logits, *bias, *wts;
    int* ids;
    CK(cudaMalloc(&logits, 4ull * Tmax * E * R));
    CK(cudaMalloc(&bias, 4ull * E));
    CK(cudaMalloc(&wts, 4ull * Tmax * s.k * R));
    CK(cudaMalloc(&ids, 4ull * Tmax * s.k * R));
    fill(logits, 1ull * Tmax * E * R, 4, 19);
    CK(cudaMemset(bias, 0, 4ull * E));
    CK(cudaDeviceSynchronize());
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    for (long long T : Ts) {
      // R routings of T tokens each.
      double touched_sum = 0;
      std::vector<int> ids0;  // routing 0 on the host (the cuBLAS baseline's per-expert token counts)
      for (int r = 0; r < R; ++r) {
        float* lg = logits + 1ull * r * Tmax * E;
        int* id = ids + 1ull * r * Tmax * s.k;
        float* wt = wts + 1ull * r * Tmax * s.k;
        if (s.deepseek) cuda::route_deepseek(lg, bias, T, E, 8, 4, s.k, true, 2.5f, id, wt, st);
        else cuda::route_softmax_topk(lg, T, E, s.k, true, id, wt, st);
        std::vector<int> h(T * s.k);
        CK(cudaMemcpyAsync(h.data(), id, 4ull * T * s.k, cudaMemcpyDeviceToHost, st));
        CK(cudaStreamSynchronize(st));
        touched_sum += std::set<int>(h.begin(), h.end()).size();
        if (r == 0) ids0 = h;
      }
      const double touched = touched_sum / R;
      float ms[kVariants] = {};  // per variant (variant 9 reads 4 and 5)
      // Graphs: one per routing and variant.
      auto make = [&](int variant, int r) {
        const unsigned short* xr = x + 1ull * r * Tmax * H;
        const int* id = ids + 1ull * r * Tmax * s.k;
        const float* wt = wts + 1ull * r * Tmax * s.k;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        switch (variant) {
          case 0: cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st); break;
          // Session 17 (small17): 65 = the default forward; in a -DLUTB_SWAPAB_PHASES build its row
          // is followed by the phase tables of its swap-AB GEMMs (print_swap_phases).
          case 65: cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st); break;
          case 66:  // the default without the one-token tail (kDecodeOneTokenTail and its rule)
          case 67:  // the default without the one-wave warps condition (kDecodeOneWave)
          case 68:  // without both (session 16's default)
          case 69: {  // the one-token tail everywhere instead of by rule (run small17-run2's variant 0)
            constexpr unsigned kTail = cuda::kDecodeOneTokenTail | cuda::kDecodeOneTokenTailRule;
            const unsigned off[4] = {kTail, cuda::kDecodeOneWave, kTail | cuda::kDecodeOneWave, 0u};
            const unsigned on = variant == 69 ? cuda::kDecodeOneTokenTail : 0u;
            cuda::set_decode_paths((cuda::kDecodePathsDefault & ~off[variant - 66]) | on);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          }
          case 1: cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::Decode); break;
          case 2: cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::Prefill); break;
          case 3:
            cuda::set_weight_decoder(cuda::WeightDecoder::BytePermute);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_weight_decoder(cuda::WeightDecoder::Auto);
            break;
          case 4: cuda::moe_forward_bf16(wb, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::Decode); break;
          case 5: cuda::moe_forward_bf16(wb, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::Prefill); break;
          case 6: cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::DecodeM16); break;
          case 7:
            cuda::set_weight_decoder(cuda::WeightDecoder::Fp8Mma);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::Decode);
            cuda::set_weight_decoder(cuda::WeightDecoder::Auto);
            break;
          case 8:  // the default without programmatic dependent launch (launch overlap measured)
            cuda::set_dependent_launch(false);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_dependent_launch(true);
            break;
          case 10:  // swap-AB decode on FP8 wgmma (WeightDecoder::Fp8Wgmma, session 13)
            cuda::set_weight_decoder(cuda::WeightDecoder::Fp8Wgmma);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::Decode);
            cuda::set_weight_decoder(cuda::WeightDecoder::Auto);
            break;
          case 11:  // warp-specialised swap-AB decode (WeightDecoder::CvtWs, session 14; compare with 1)
            cuda::set_weight_decoder(cuda::WeightDecoder::CvtWs);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::Decode);
            cuda::set_weight_decoder(cuda::WeightDecoder::Auto);
            break;
          // Session 14 (small14): the small-batch fixed-cost paths (moe.hpp set_decode_paths) against
          // the old path in the same run, and stage timing (set_forward_stop_after). All Auto strategy.
          case 20:  // the old path: grouping kernel at T > 1, separate top-k reduction kernel
            cuda::set_decode_paths(0);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          case 21:  // direct forward only (no fused reduction, no split)
            cuda::set_decode_paths(cuda::kDecodeDirect);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          case 22:  // direct forward for every one-block batch (crossover), fused reduction always
            cuda::set_decode_paths(cuda::kDecodeDirectAlways | cuda::kDecodeClusterReduceAlways);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          case 23:  // direct forward for every one-block batch, separate reduction
            cuda::set_decode_paths(cuda::kDecodeDirectAlways);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          case 24:  // T = 1 through the grouping kernel too (session 10's old T = 1 path)
            cuda::set_decode_paths(cuda::kDecodeNoDirect1);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          case 25:  // stage timing of the default: up to the MXFP8 of x (and grouping)
          case 26:  // ... up to GEMM1
          case 27:  // ... up to GEMM2 (with the fused reduction when it runs)
            cuda::set_forward_stop_after(variant - 24);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_forward_stop_after(0);
            break;
          case 28:  // stage timing of the old path (variant 20): up to the grouping + MXFP8 of x
          case 29:  // ... up to GEMM1
          case 30:  // ... up to GEMM2
            cuda::set_decode_paths(0);
            cuda::set_forward_stop_after(variant - 27);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_forward_stop_after(0);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          case 36:  // the default without the split-K rule
          case 37:  // the default without the fused top-k reduction
            cuda::set_decode_paths(variant == 36 ? (cuda::kDecodePathsDefault & ~cuda::kDecodeSplitK)
                                                 : (cuda::kDecodePathsDefault & ~cuda::kDecodeClusterReduce));
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          // Split-K across cluster CTAs forced (set_decode_split: split, warps halved `shift` times).
          case 31:  // GEMM1 only: 2 CTAs x half the warps
          case 32:  // both GEMMs: 2 CTAs x half the warps
          case 33:  // both: 2 CTAs x the same warps
          case 34:  // both: 4 CTAs x a quarter of the warps
          case 35: {  // both: 4 CTAs x half the warps
            const int sp[5][4] = {{2, 1, 1, 0}, {2, 1, 2, 1}, {2, 0, 2, 0}, {4, 2, 4, 2}, {4, 1, 4, 1}};
            const int* q = sp[variant - 31];
            cuda::set_decode_split(q[0], q[1], q[2], q[3]);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_split(0, 0, 0, 0);
            break;
          }
          // Session 14 (l2pf14): L2 prefetch of GEMM2's weights by GEMM1's CTAs (set_decode_l2_prefetch),
          // budget in bytes of w2 per forward; the default (0) is the baseline in the same run.
          case 40:  // all of the touched experts' w2 (no budget)
          case 41:  // 24 MiB budget (about 40 % of the H200's 60 MiB L2)
          case 42:  // 8 MiB budget
          case 43:  // all, with an L2::evict_last hint
          case 44:  // 24 MiB, evict_last
          case 45: {  // off (explicitly; equals the default while kDecodeL2PrefetchDefault = 0)
            const long long budgets[6] = {1ll << 62, 24ll << 20, 8ll << 20, 1ll << 62, 24ll << 20, 0};
            cuda::set_decode_l2_prefetch(budgets[variant - 40], variant == 43 || variant == 44);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_l2_prefetch(cuda::kDecodeL2PrefetchDefault);
            break;
          }
          case 47:  // all, issued after each GEMM1 CTA's K-loop
          case 48:  // 8 MiB, after the K-loop
            cuda::set_decode_l2_prefetch(variant == 47 ? (1ll << 62) : (8ll << 20), false, true);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_l2_prefetch(cuda::kDecodeL2PrefetchDefault);
            break;
          case 49:  // stage timing: up to GEMM1 with variant 47's prefetch (compare with 26)
            cuda::set_decode_l2_prefetch(1ll << 62, false, true);
            cuda::set_forward_stop_after(2);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_forward_stop_after(0);
            cuda::set_decode_l2_prefetch(cuda::kDecodeL2PrefetchDefault);
            break;
          case 46:  // stage timing: up to GEMM1 with the prefetch of all w2 (compare with 26: GEMM1's cost)
            cuda::set_decode_l2_prefetch(1ll << 62);
            cuda::set_forward_stop_after(2);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_forward_stop_after(0);
            cuda::set_decode_l2_prefetch(cuda::kDecodeL2PrefetchDefault);
            break;
          // Session 18 (act18): GEMM1's SiLU*up / MXFP8 epilogue and split-K combine in the activation
          // kernel everywhere (kDecodeActKernel; the default has it by rule, kDecodeActKernelRule);
          // 71 / 72 without GEMM1's split-K (with / without the kernel); 73 = 70, in a
          // -DLUTB_SWAPAB_PHASES build followed by its GEMMs' phase tables; 74 = the default without
          // the kernel's rule (session 17's default paths).
          // Session 19 (act19): 75 = 70 and 76 = 74 again (same-process ABBA: 74, 70, 75, 76).
          case 70:
          case 71:
          case 72:
          case 73:
          case 74:
          case 75:
          case 76: {
            const bool off_act = variant == 72 || variant == 74 || variant == 76;
            const unsigned act = off_act ? 0u : cuda::kDecodeActKernel;
            const unsigned off = (variant == 71 || variant == 72 ? cuda::kDecodeSplitK : 0u) |
                                 (off_act ? cuda::kDecodeActKernelRule : 0u);
            cuda::set_decode_paths((cuda::kDecodePathsDefault & ~off) | act);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          }
          case 50:  // session 16 (dec16): the late tile scales everywhere (kDecodeLateScales)
          case 51:  // ... and the one-token-block kernels at 96 registers (kDecodeLateScales96)
          case 52: {  // session 15's K-loop everywhere (the default without kDecodeLateScalesRule)
            const unsigned late = cuda::kDecodeLateScales | cuda::kDecodeLateScales96 | cuda::kDecodeLateScalesRule;
            const unsigned add[3] = {cuda::kDecodeLateScales, cuda::kDecodeLateScales96, 0u};
            cuda::set_decode_paths((cuda::kDecodePathsDefault & ~late) | add[variant - 50]);
            cuda::moe_forward(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_decode_paths(cuda::kDecodePathsDefault);
            break;
          }
          case 9:
            cuda::set_dependent_launch(false);
            cuda::moe_forward_bf16(wb, xr, T, s.k, id, wt, out, ws, wsb, st,
                                   ms[4] <= ms[5] ? cuda::MoeStrategy::Decode : cuda::MoeStrategy::Prefill);
            cuda::set_dependent_launch(true);
            break;
        }
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphDestroy(g));
        return ge;
      };
      for (int v : variants) {
        std::vector<cudaGraphExec_t> gs;
        for (int r = 0; r < R; ++r) gs.push_back(make(v, r));
        for (int r = 0; r < R; ++r) CK(cudaGraphLaunch(gs[r], st));
        CK(cudaStreamSynchronize(st));
        const int iters = T >= 1024 ? R : 4 * R;
        // Warm-up before the first row of a shape: right after the weights are written, the first
        // variant measured 5-17 % slower at T = 1 than the same configuration measured later in the
        // row (device run 2026-11-30d-run3, docs/perf/moe-gpu.md). ~200 ms of the same graphs first.
        if (v == variants.front() && T == Ts.front()) {
          cudaEvent_t a, b;
          CK(cudaEventCreate(&a));
          CK(cudaEventCreate(&b));
          float spent = 0;
          while (spent < 200.0f) {
            CK(cudaEventRecord(a, st));
            for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(gs[i % R], st));
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float m = 0;
            CK(cudaEventElapsedTime(&m, a, b));
            spent += m;
          }
          CK(cudaEventDestroy(a));
          CK(cudaEventDestroy(b));
        }
        cudaEvent_t a, b;
        CK(cudaEventCreate(&a));
        CK(cudaEventCreate(&b));
        std::vector<float> v7;
        for (int rep = 0; rep < 7; ++rep) {
          CK(cudaEventRecord(a, st));
          for (int i = 0; i < iters; ++i) CK(cudaGraphLaunch(gs[i % R], st));
          CK(cudaEventRecord(b, st));
          CK(cudaEventSynchronize(b));
          float m = 0;
          CK(cudaEventElapsedTime(&m, a, b));
          v7.push_back(m / iters);
        }
        std::sort(v7.begin(), v7.end());
        ms[v] = v7[3];
#ifdef LUTB_SWAPAB_PHASES
        if (v == 65 || v == 73) print_swap_phases(gs, st, s.name, T);
#endif
        for (auto g : gs) CK(cudaGraphExecDestroy(g));
        CK(cudaEventDestroy(a));
        CK(cudaEventDestroy(b));
      }
      if (compact) {
        std::printf("| %s | %lld | %.1f |", s.name, T, touched);
        for (int v : variants) std::printf(" %.1f |", ms[v] * 1e3);
        std::printf(" %.0f%% |\n", 100.0 * touched * lutb_expert / (ms[variants[0]] * 1e-3) / read_bw);
        std::fflush(stdout);
        continue;
      }
      const double lut_s = ms[0] * 1e-3, bf_s = std::min(ms[4], ms[5]) * 1e-3;
      const double flops = 6.0 * T * s.k * H * I;
      const auto strat = ms[4] <= ms[5] ? "decode" : "prefill";
      const float cub_ms = T >= 256 ? cublas_grouped_ms(cublas, ids0, E, H, I, b13, b2, st) : 0.0f;
      char cub[64] = "-", cubr[32] = "-";
      if (T >= 256) {
        std::snprintf(cub, sizeof cub, "%.1f (%.0f TFLOP/s)", cub_ms * 1e3, flops / (cub_ms * 1e-3) / 1e12);
        std::snprintf(cubr, sizeof cubr, "%.2fx", cub_ms * 1e-3 / lut_s);
      }
      std::printf("| %s | %lld | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %s | %.2fx | %.0f | %.0f%% | %.0f | %.0f%% | %.1f | %.1f | %.1f | %.1f | %s | %s |\n",
                  s.name, T, touched, ms[0] * 1e3, ms[3] * 1e3, ms[1] * 1e3, ms[7] * 1e3, ms[10] * 1e3, ms[2] * 1e3, ms[6] * 1e3, bf_s * 1e6, strat,
                  bf_s / lut_s, touched * lutb_expert / lut_s / 1e9, 100.0 * touched * lutb_expert / lut_s / read_bw,
                  touched * bf16_expert / bf_s / 1e9, 100.0 * touched * bf16_expert / bf_s / read_bw, flops / lut_s / 1e12,
                  flops / bf_s / 1e12, ms[8] * 1e3, ms[9] * 1e3, cub, cubr);
      std::fflush(stdout);
    }
    CK(cudaStreamDestroy(st));
    for (void* p : {(void*)p13, (void*)c13, (void*)sc13, (void*)p2, (void*)c2, (void*)sc2, (void*)b13, (void*)b2, ws,
                    (void*)x, (void*)out, (void*)logits, (void*)bias, (void*)wts, (void*)ids})
      CK(cudaFree(p));
  }
  cublasDestroy(cublas);
  return 0;
}
