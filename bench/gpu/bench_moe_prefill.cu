// bench/gpu/bench_moe_prefill.cu: the large-batch (prefill) LUT-B path (src/cuda/moe_prefill.hpp)
// with each CTA tile (the heuristic's choice, M64 = the session-10 kernel and, on sm_90, W64 = the
// FP8 wgmma kernel of session 13, forced by set_prefill_tile), against the BF16 baseline on the same kernel skeleton (moe_forward_bf16, the
// better of its decode and prefill strategies) and cuBLAS grouped BF16 GEMMs (as bench_moe_gpu: the
// two GEMMs only, on routing 0's per-expert counts), same routing, same run.
// Prints a markdown table (docs/perf/moe-gpu-prefill.md).
//
// Usage: bench_moe_prefill [--shape NAME] [--T N[,N...]] [--tiles A,B,..] [--lean] [--quick]
//   default T in {256, 1024, 4096}, the 4 shapes; --tiles: the sm_90 wgmma tiles to run and time (names as
//   PrefillTile: WB64, WB64D, WB64T, W64, W64D, WS64, WB128, WB128P; default WB64,WB64D,WB64T,W64; M64 and the
//   heuristic's tile always); --lean: no BF16 baselines, cuBLAS or GEMMs-alone column; --quick: one
//   uncaptured forward per tile and no timing, for a profiler such as ncu); --cublas-only: keep the
//   cuBLAS grouped column but skip the BF16 baseline forwards and the GEMMs-alone column (their columns
//   print 0; shortens a device run at T = 16384)
// Method as bench_moe_gpu: the whole forward (routing precomputed by route_softmax_topk /
// route_deepseek on random N(0,1) logits) captured in a CUDA graph; R = 8 routings cycled; the time
// is the median over 7 batches of the mean per call. TFLOP/s = 6 * T * k * H * I / time.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/moe_prefill.hpp"
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

int main(int argc, char** argv) {
  std::string only;
  bool quick = false, lean = false, no_fwd_baselines = false;
  std::string tiles = "WB64,WB64D,WB64T,W64";  // the sm_90 wgmma tiles to time (--tiles)
  std::vector<long long> Ts = {256, 1024, 4096};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--lean")) lean = true;
    else if (!std::strcmp(argv[i], "--cublas-only")) no_fwd_baselines = true;
    else if (!std::strcmp(argv[i], "--tiles") && i + 1 < argc) tiles = argv[++i];
    else if (!std::strcmp(argv[i], "--T") && i + 1 < argc) {  // N or a list N,M,...
      Ts.clear();
      std::string list = argv[++i];
      for (std::size_t at = 0; at < list.size();) {
        const std::size_t comma = std::min(list.find(',', at), list.size());
        Ts.push_back(std::atoll(list.substr(at, comma - at).c_str()));
        at = comma + 1;
      }
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# device: %s, %d SMs, L2 %d MB, %.1f GB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              prop.totalGlobalMem / 1e9);
  const Shape shapes[] = {{"deepseek-v3", 256, 7168, 2048, 8, true},
                          {"qwen3-235b", 128, 4096, 1536, 8, false},
                          {"qwen3-30b", 128, 2048, 768, 8, false},
                          {"mixtral-8x7b", 8, 4096, 14336, 2, false}};
  const int R = 8;
  const bool sm90 = prop.major == 9 && prop.minor == 0;  // the wgmma tiles are built for sm_90a only
  auto wanted = [&](const char* name) {  // a wgmma tile named in --tiles (and the device is sm_90)
    const std::string list = "," + tiles + ",";
    return sm90 && list.find("," + std::string(name) + ",") != std::string::npos;
  };
  struct WTile {
    int variant;
    cuda::PrefillTile tile;
    const char* name;
  };
  const WTile wtiles[] = {{9, cuda::PrefillTile::WB64, "WB64"},   {11, cuda::PrefillTile::WB64D, "WB64D"},
                          {12, cuda::PrefillTile::WB64T, "WB64T"}, {13, cuda::PrefillTile::WS64, "WS64"},
                          {8, cuda::PrefillTile::W64, "W64"},     {10, cuda::PrefillTile::W64D, "W64D"},
                          {14, cuda::PrefillTile::WB128, "WB128"}, {15, cuda::PrefillTile::WB128P, "WB128P"}};
  std::printf("\n| shape | T | experts touched | auto tile | auto us | M64 (session 10) us (TFLOP/s)");
  for (const WTile& wt : wtiles)
    if (wanted(wt.name)) std::printf(" | %s us (TFLOP/s, vs M64)", wt.name);
  std::printf(" | BF16 us (best) | cuBLAS grouped us (TFLOP/s) | M64 / cuBLAS | best BF16-fold wgmma / cuBLAS | "
              "auto / BF16 | GEMMs alone us (auto tile) |\n|---|---|---|---|---|---|");
  for (const WTile& wt : wtiles)
    if (wanted(wt.name)) std::printf("---|");
  std::printf("---|---|---|---|---|---|\n");
  cublasHandle_t cublas;
  cublasCreate(&cublas);
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
    const long long Tmax = *std::max_element(Ts.begin(), Ts.end());
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
      auto make = [&](int variant, int r) {
        const unsigned short* xr = x + 1ull * r * Tmax * H;
        const int* id = ids + 1ull * r * Tmax * s.k;
        const float* wt = wts + 1ull * r * Tmax * s.k;
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        using cuda::PrefillTile;
        switch (variant) {
          case 0: cuda::moe_forward_lutb_prefill(w, xr, T, s.k, id, wt, out, ws, wsb, st); break;
          case 1: case 2: case 3: case 7: case 8: case 9: case 10: case 11: case 12: case 13: case 14: case 15:
            cuda::set_prefill_tile(variant == 1 ? PrefillTile::M64 : variant == 2 ? PrefillTile::M128
                                   : variant == 3 ? PrefillTile::M128W : variant == 8 ? PrefillTile::W64
                                   : variant == 9 ? PrefillTile::WB64 : variant == 10 ? PrefillTile::W64D
                                   : variant == 11 ? PrefillTile::WB64D : variant == 12 ? PrefillTile::WB64T
                                   : variant == 13 ? PrefillTile::WS64 : variant == 14 ? PrefillTile::WB128 : variant == 15 ? PrefillTile::WB128P
                                   : PrefillTile::M64IL);
            cuda::moe_forward_lutb_prefill(w, xr, T, s.k, id, wt, out, ws, wsb, st);
            cuda::set_prefill_tile(PrefillTile::Auto);
            break;
          case 4: cuda::moe_forward_bf16(wb, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::Decode); break;
          case 5: cuda::moe_forward_bf16(wb, xr, T, s.k, id, wt, out, ws, wsb, st, cuda::MoeStrategy::Prefill); break;
          case 6: {
            // The prefill GEMMs alone (xa -> BF16, GEMM1, GEMM2) on routing 0's grouping, made
            // before the capture (repeated in-place conversions leave garbage values in xa: the
            // time does not depend on them).
            const cuda::detail::Workspace wsp = cuda::detail::carve(ws, T, s.k, E, H, I);
            const cuda::kern::Routing rr{ids, wts, wsp.sorted, wsp.tile_expert, wsp.tile_start, wsp.tile_count,
                                         wsp.num_tiles, s.k};
            cuda::detail::launch_lutb_prefill_gemms(w, rr, wsp, T * s.k, cuda::prefill_tile(T * s.k, E), st);
            break;
          }
        }
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphDestroy(g));
        return ge;
      };
      // One uncaptured call per tile first (per-device kernel attributes are set there), then the
      // GEMMs-alone setup.
      // (M64 first, then the --tiles in the table's order: a profiler's --launch-count N picks their GEMMs)
      std::vector<cuda::PrefillTile> pre = {cuda::PrefillTile::M64};
      for (const WTile& wt : wtiles)
        if (wanted(wt.name)) pre.push_back(wt.tile);
      pre.push_back(cuda::PrefillTile::Auto);
      for (auto t : pre) {
        cuda::set_prefill_tile(t);
        cuda::moe_forward_lutb_prefill(w, x, T, s.k, ids, wts, out, ws, wsb, st);
      }
      CK(cudaStreamSynchronize(st));
      if (quick) {  // --quick: only the uncaptured calls above (a profiler's view of each tile's kernels)
        std::printf("# --quick: %s T = %lld, one uncaptured forward per tile\n", s.name, T);
        continue;
      }
      {
        const cuda::detail::Workspace wsp = cuda::detail::carve(ws, T, s.k, E, H, I);
        cuda::detail::launch_group(ids, T * s.k, E, cuda::prefill_tile_rows(cuda::prefill_tile(T * s.k, E)), wsp, st);
        cuda::detail::launch_quantize_x(x, T, H, w.w13.shape.padded_cols(), false, wsp.xa, nullptr, wsp.xs, nullptr, st);
      }
      // Session 13: M64IL, M128 and M128W (variants 7, 2, 3) are no longer timed (session 12 measured
      // them slower than M64); the wgmma tiles (8..15) named in --tiles, on sm_90 only.
      float ms[16] = {};
      std::vector<int> vars = {0, 1};
      if (!lean && !no_fwd_baselines) vars.insert(vars.begin(), 6);
      for (const WTile& wt : wtiles)
        if (wanted(wt.name)) vars.push_back(wt.variant);
      if (!lean && !no_fwd_baselines) {
        vars.push_back(4);
        vars.push_back(5);
      }
      for (int v : vars) {
        std::vector<cudaGraphExec_t> gs;
        for (int r = 0; r < R; ++r) gs.push_back(make(v, r));
        for (int r = 0; r < R; ++r) CK(cudaGraphLaunch(gs[r], st));
        CK(cudaStreamSynchronize(st));
        const int iters = T >= 1024 ? R : 4 * R;
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
        for (auto g : gs) CK(cudaGraphExecDestroy(g));
        CK(cudaEventDestroy(a));
        CK(cudaEventDestroy(b));
      }
      const float cub_ms = lean ? 0.0f : cublas_grouped_ms(cublas, ids0, E, H, I, b13, b2, st);
      const double flops = 6.0 * T * s.k * H * I;
      auto tf = [&](double m) { return m > 0 ? flops / (m * 1e-3) / 1e12 : 0.0; };
      const double bf = lean || no_fwd_baselines ? 0.0 : std::min(ms[4], ms[5]);
      const cuda::PrefillTile at = cuda::prefill_tile(T * s.k, E);
      const char* an = at == cuda::PrefillTile::M64 ? "M64" : "other";
      for (const WTile& wt : wtiles)
        if (at == wt.tile) an = wt.name;
      std::printf("| %s | %lld | %.1f | %s | %.1f | %.1f (%.1f)", s.name, T, touched, an, ms[0] * 1e3, ms[1] * 1e3,
                  tf(ms[1]));
      double best = 0;
      for (const WTile& wt : wtiles) {
        if (!wanted(wt.name)) continue;
        const float m = ms[wt.variant];
        std::printf(" | %.1f (%.1f, %.2fx)", m * 1e3, tf(m), m > 0 ? ms[1] / m : 0.0);
        if (wt.variant != 8 && wt.variant != 10 && m > 0 && (best == 0 || m < best)) best = m;
      }
      std::printf(" | %.1f | %.1f (%.1f) | %.2fx | %.2fx | %.2fx | %.1f |\n", bf * 1e3, cub_ms * 1e3, tf(cub_ms),
                  ms[1] > 0 ? cub_ms / ms[1] : 0.0, best > 0 ? cub_ms / best : 0.0, ms[0] > 0 ? bf / ms[0] : 0.0,
                  ms[6] * 1e3);
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
