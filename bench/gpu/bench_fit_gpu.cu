// bench/gpu/bench_fit_gpu.cu: throughput of the GPU fitters (lutb/cuda/fit.hpp) on a BF16 expert
// stack already on the device (default: DeepSeek-V3 w13 chunk, 8 experts x 4096 x 7168), in one
// run: "binned-dp" on the warp kernel (default) with and without the per-tile error sums and on the
// first thread-per-tile kernel, "optimal" on the warp kernel, the CPU fitters (lutb::quantize, all
// cores, OpenMP) on expert 0, and the online method (lutb/cuda/online.hpp: check pass + fit +
// lane-major permutation + stats) on a DeepSeek-V3-shaped layer slice (E experts, H = 7168,
// I = 2048: w13 [E, 4096, 7168] = the stack above, w2 [E, 7168, 2048]). Bytes: binned-dp warp ==
// thread on the whole stack; GPU == CPU on expert 0 for both fitters.
//
//   bench_fit_gpu [E N K] [student]
// With LUTB_BENCH_PROFILE_ONLY=1: only one launch each of the default binned-dp kernel and the
// two-tiles-per-warp kernel over the stack (with per-tile sums), for a profiler (ncu), then exit;
// =2: one launch each of the binned-dp shared-memory layouts 0..4 (fit12); =3: one launch each of
// layout 1's DP modes 0, 13, 14, 10, 9, 6 (fit16).
// With LUTB_BENCH_ONLINE=1: only onl14's comparison of the online method, old (serial) against new
// (pipelined), with its parts on the device alone (see online_bench); =2: one old and one new call
// after a warm-up, for nsys.
// With LUTB_BENCH_FIT13=1: only fit13's comparison (the binned DP's layers by the divide and conquer,
// launch_warp_dp mode 0 = every kernel before fit13, against the full-range modes 1, 2, 6, 7, on
// layouts 0 and 1, with and without the per-tile sums, alternated twice in this process; whole-stack
// bytes and sums == mode 0's; expert 0 == CPU; the phase breakdown of the instrumented kernel with
// each mode), then exit.
// With LUTB_BENCH_FIT17=1: only fit17's comparison (the block shape as a launch choice,
// fit_internal::launch_warp_shape: 1-, 2-, 4-warp blocks through dynamic shared memory, one tile per
// warp or a persistent grid by stride or a shared counter, for layout 1 mode 0, layout 0 mode 6 and
// the table modes 9, 10, 13, against the static kernels (the defaults before fit17: layout 1 mode 0
// with the per-tile sums, layout 0 mode 6 bytes only); alternated forward / reverse / forward /
// reverse in this process; whole-stack bytes and sums == the default's; expert 0 == CPU), then exit.
// With LUTB_BENCH_FIT18=1: only fit18's comparison, in fit17's harness (the defaults since fit17 --
// layout 1 mode 10 with the per-tile sums, layout 0 mode 6 bytes only, both in 4-warp blocks -- against
// 8- and 16-warp blocks, 2- and 1-warp blocks, layout 0 mode 6 with the sums, layout 1 mode 0, and mode
// 10 bytes only); =2: the short list of fit18's run 2 (fit17's default with the sums, then layout 0
// mode 6 with the sums in 4- and 8-warp blocks, and bytes only); LUTB_BENCH_PROFILE_ONLY=4: one launch
// each of the shapes fit18 profiled with ncu (see there), then exit.
// With LUTB_BENCH_FIT16=1: only fit16's comparison (the binned DP over a per-tile table of every run
// cost, launch_warp_dp modes 9, 10, 12 and the diagnostics 13, 14 on layout 1, against the defaults: layout 1 mode 0 with the
// per-tile sums, layout 0 mode 6 bytes only; alternated forward / reverse / forward / reverse in this
// process; whole-stack bytes and sums == the default's; expert 0 == CPU), then exit.
// Weights: i.i.d. Gaussian (sigma 0.02) rounded to BF16, or Student-t(3)-like with "student" (a
// Gaussian divided by sqrt of a chi-square(3)/3 built from three more Gaussians).
// Output: markdown lines with seconds, weights/s, the ratio to the thread kernel and the implied
// time for DeepSeek-V3's 654e9 routed weights (issue 6 target: >= 45e9 weights/s). Each GPU
// figure is the best of 3 timed runs after a warm-up.
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/fit_internal.cuh"
#include "lutb/cuda/fit.hpp"
#include "lutb/cuda/lane_major.hpp"
#include "lutb/cuda/online.hpp"
#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"

namespace {

void ok(cudaError_t e) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(e));
    std::exit(1);
  }
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


// LUTB_BENCH_ONLINE=1 (onl14): only the online method (lutb/cuda/online.hpp) on the DeepSeek-V3-shaped
// slice (w13 = the benchmark's stack [E, N, K], w2 [E, K, N/2] filled the same way), then exit:
//  - the parts on the device alone, CUDA events, best of 3 after a warm-up: the two fit launches
//    over the whole w13 and w2 stacks with the per-tile sums (what the method's fits cost without
//    anything around them), the check pass on the fit kernel (check_tiles_device, the method before
//    onl14) and on the check kernel (fit_internal::launch_check), the lane-major permutation;
//  - the method, host-timed, the old way (GpuOnlineOptions::pipeline = false) and the new (pipelined,
//    the default) alternated 3 times after one warm-up each, the default chunk (256 MiB); then the
//    new way with other chunk sizes, and both ways with a release callback that calls cudaFree (as a
//    loader freeing its per-chunk buffers would: cudaFree synchronises the device);
//  - the old and new outputs compared byte for byte (the whole allocation) and their FitStats.
// LUTB_BENCH_ONLINE=2: one warm-up, then one old and one new call (for nsys), then exit.
int online_bench(const std::uint16_t* d_w13, std::int64_t E, std::int64_t N, std::int64_t K, bool student, int mode) {
  namespace lc = lutb::cuda;
  const std::int64_t H = K, I = N / 2;
  std::uint16_t* d_w2 = nullptr;
  ok(cudaMalloc(&d_w2, static_cast<std::size_t>(E * H * I) * 2));
  fill<<<4096, 256>>>(d_w2, static_cast<unsigned long long>(E * H * I), student);
  ok(cudaDeviceSynchronize());
  const double weights = static_cast<double>(E * 3 * H * I);
  auto run = [&](bool pipeline, std::size_t chunk, bool free_release, lc::DeviceLutbLayer& layer) {
    lc::DeviceExpertSource src;
    src.dtype = lutb::DType::BF16;
    src.experts = E;
    src.hidden = H;
    src.intermediate = I;
    src.w13 = {d_w13};
    src.w2 = {d_w2};
    std::vector<void*> dummies;
    if (free_release) {  // one 1 MiB buffer per expert, freed at its chunk's release
      dummies.resize(static_cast<std::size_t>(E));
      for (auto& p : dummies) ok(cudaMalloc(&p, 1 << 20));
      src.release = [&](std::int64_t e0, std::int64_t e1) {
        for (std::int64_t e = e0; e < e1; ++e) cudaFree(dummies[static_cast<std::size_t>(e)]);
      };
    }
    lc::GpuOnlineOptions opt;
    opt.pipeline = pipeline;
    opt.chunk_bytes = chunk;
    ok(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    lc::GpuOnlineReport r = lc::quantize_experts_online(src, layer, opt);
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return std::make_pair(t, r);
  };
  const std::size_t kChunk = std::size_t{256} << 20;
  if (mode == 2) {
    for (bool p : {false, true}) {
      lc::DeviceLutbLayer l;
      run(p, kChunk, false, l);
    }
    for (bool p : {false, true}) {
      lc::DeviceLutbLayer l;
      const double t = run(p, kChunk, false, l).first;
      std::printf("online %s: %.4f s\n", p ? "new" : "old", t);
    }
    cudaFree(d_w2);
    return 0;
  }

  // The parts on the device alone.
  lutb::LutbShape s13, s2;
  s13.experts = s2.experts = E;
  s13.stacked = s2.stacked = true;
  s13.rows = 2 * I;
  s13.cols = H;
  s2.rows = H;
  s2.cols = I;
  const lutb::LutbShape* shp[2] = {&s13, &s2};
  const void* srcs[2] = {d_w13, d_w2};
  lc::DeviceFitOut o[2];
  for (int t = 0; t < 2; ++t) {
    const std::size_t nt = static_cast<std::size_t>(shp[t]->tiles());
    ok(cudaMalloc(&o[t].packed, nt * lutb::kPackedBytes));
    ok(cudaMalloc(&o[t].codebook, nt * lutb::kCodebookSize));
    ok(cudaMalloc(&o[t].scale, nt));
    ok(cudaMalloc(&o[t].sse, nt * 8));
    ok(cudaMalloc(&o[t].sum_sq, nt * 8));
  }
  unsigned long long* d_err = nullptr;
  ok(cudaMalloc(&d_err, 16));
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a));
  ok(cudaEventCreate(&b));
  auto time_dev = [&](auto&& body) {
    float best = 1e30f;
    for (int rep = 0; rep < 4; ++rep) {  // first = warm-up
      ok(cudaEventRecord(a));
      body();
      ok(cudaEventRecord(b));
      ok(cudaEventSynchronize(b));
      float ms = 0;
      ok(cudaEventElapsedTime(&ms, a, b));
      if (rep > 0) best = std::min(best, ms);
    }
    return best * 1e-3;
  };
  const double t_fit = time_dev([&] {
    for (int t = 0; t < 2; ++t)
      lc::fit_device(srcs[t], lutb::DType::BF16, *shp[t], o[t], lc::GpuFitter::BinnedDp, -1, d_err, nullptr);
  });
  // The shared-memory layouts with the per-tile sums on these two stacks: layout 0 and layout 0
  // with DP mode 6 against the default (layout 1), same run; bytes and sums of each == the default's.
  // (onl14-run1 measured layout 0 with its encoding sums computed without stored prefixes, as the
  // compact layout's: 1.016-1.041x layout 1's time, so that variant was not kept; fit-gpu.md "onl14".)
  namespace fi = lc::fit_internal;
  auto host_of = [](const void* p, std::size_t n) {
    std::vector<std::uint8_t> h(n);
    ok(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
    return h;
  };
  auto snapshot = [&]() {
    std::vector<std::vector<std::uint8_t>> v;
    for (int t = 0; t < 2; ++t) {
      const std::size_t nt = static_cast<std::size_t>(shp[t]->tiles());
      v.push_back(host_of(o[t].packed, nt * lutb::kPackedBytes));
      v.push_back(host_of(o[t].codebook, nt * lutb::kCodebookSize));
      v.push_back(host_of(o[t].scale, nt));
      v.push_back(host_of(o[t].sse, nt * 8));
      v.push_back(host_of(o[t].sum_sq, nt * 8));
    }
    return v;
  };
  const auto ref_fit = snapshot();  // the default's (fit_device: layout 1 with the sums)
  double t_layout[3];
  bool same_layout = true;
  for (int v = 0; v < 3; ++v) {  // 0: layout 0, 1: layout 1 (= default), 2: layout 0 with DP mode 6
    t_layout[v] = time_dev([&] {
      for (int t = 0; t < 2; ++t) {
        fi::KernelArgs ka{srcs[t], 1, shp[t]->rows, shp[t]->cols, shp[t]->tiles_n(), shp[t]->tiles_k(),
                          shp[t]->tiles(), 0, o[t], -1, d_err};
        if (v == 2) fi::launch_warp_dp(ka, 0, 6, nullptr);
        else fi::launch_warp_layout(ka, v, nullptr);
      }
    });
    same_layout = same_layout && snapshot() == ref_fit;
  }
  const double t_fit2 = time_dev([&] {  // the default again, after the layouts (drift)
    for (int t = 0; t < 2; ++t)
      lc::fit_device(srcs[t], lutb::DType::BF16, *shp[t], o[t], lc::GpuFitter::BinnedDp, -1, d_err, nullptr);
  });
  const double t_check_old = time_dev([&] {
    for (int t = 0; t < 2; ++t) lc::check_tiles_device(srcs[t], lutb::DType::BF16, *shp[t], d_err + t, nullptr);
  });
  const double t_check_new = time_dev([&] {
    ok(cudaMemsetAsync(d_err, 0xff, 16, nullptr));
    for (int t = 0; t < 2; ++t) {
      lc::fit_internal::KernelArgs ka{srcs[t], 1, shp[t]->rows, shp[t]->cols, shp[t]->tiles_n(), shp[t]->tiles_k(),
                                      shp[t]->tiles(), 0, lc::DeviceFitOut{}, -1, d_err + t};
      ka.check_only = true;
      lc::fit_internal::launch_check(ka, nullptr);
    }
  });
  const double t_lane = time_dev([&] {
    for (int t = 0; t < 2; ++t) lc::packed_to_lane_major(o[t].packed, shp[t]->tiles(), nullptr);
  });
  unsigned long long words[2];
  ok(cudaMemcpy(words, d_err, 16, cudaMemcpyDeviceToHost));
  const bool check_clean = words[0] == ~0ull && words[1] == ~0ull;
  for (auto& x : o) {
    cudaFree(x.packed);
    cudaFree(x.codebook);
    cudaFree(x.scale);
    cudaFree(x.sse);
    cudaFree(x.sum_sq);
  }

  // The method: old and new alternated.
  using Rep = lc::GpuOnlineReport;
  double best[2] = {1e30, 1e30};
  Rep best_rep[2];
  std::vector<double> all[2];
  lc::DeviceLutbLayer keep[2];
  for (int p = 0; p < 2; ++p) {  // warm-up; kept for the byte comparison
    run(p == 1, kChunk, false, keep[p]);
  }
  for (int round = 0; round < 3; ++round)
    for (int p = 0; p < 2; ++p) {
      lc::DeviceLutbLayer l;
      const auto [t, r] = run(p == 1, kChunk, false, l);
      all[p].push_back(t);
      if (t < best[p]) {
        best[p] = t;
        best_rep[p] = r;
      }
    }
  // Same output bytes and stats, old vs new (the old method's bytes == the CPU's: tests).
  bool same = keep[0].bytes() == keep[1].bytes();
  if (same) {
    std::vector<std::uint8_t> h0(keep[0].bytes()), h1(keep[1].bytes());
    const auto& w0 = keep[0].weights();
    const auto& w1 = keep[1].weights();
    ok(cudaMemcpy(h0.data(), w0.w13.packed, h0.size(), cudaMemcpyDeviceToHost));  // w13.packed = allocation start
    ok(cudaMemcpy(h1.data(), w1.w13.packed, h1.size(), cudaMemcpyDeviceToHost));
    same = h0 == h1;
  }
  same = same && best_rep[0].w13.sse == best_rep[1].w13.sse && best_rep[0].w13.sum_sq == best_rep[1].w13.sum_sq &&
         best_rep[0].w2.sse == best_rep[1].w2.sse && best_rep[0].w2.sum_sq == best_rep[1].w2.sum_sq;
  // Chunk sizes (new) and a release that frees (both).
  const std::size_t chunks[4] = {std::size_t{88} << 20, std::size_t{176} << 20, std::size_t{512} << 20,
                                 std::size_t{1} << 30};
  double t_chunk[4];
  Rep r_chunk[4];
  for (int c = 0; c < 4; ++c) {
    t_chunk[c] = 1e30;
    for (int rep = 0; rep < 2; ++rep) {
      lc::DeviceLutbLayer l;
      const auto [t, r] = run(true, chunks[c], false, l);
      if (t < t_chunk[c]) {
        t_chunk[c] = t;
        r_chunk[c] = r;
      }
    }
  }
  double t_free[2] = {1e30, 1e30};
  for (int round = 0; round < 2; ++round)
    for (int p = 0; p < 2; ++p) {
      lc::DeviceLutbLayer l;
      t_free[p] = std::min(t_free[p], run(p == 1, kChunk, true, l).first);
    }

  cudaDeviceProp prop{};
  ok(cudaGetDeviceProperties(&prop, 0));
  std::printf("## onl14: the online method, %s data, [%lld x (%lld x %lld + %lld x %lld)] BF16 = %.4g weights (%s, %d SMs)\n\n",
              student ? "Student-t(3)" : "Gaussian", static_cast<long long>(E), static_cast<long long>(2 * I),
              static_cast<long long>(H), static_cast<long long>(H), static_cast<long long>(I), weights, prop.name,
              prop.multiProcessorCount);
  std::printf("| part on the device alone (events, best of 3) | time | weights/s | 654e9 weights |\n|---|---|---|---|\n");
  auto dev_row = [&](const char* what, double t) {
    std::printf("| %s | %.3f ms | %.3g | %.0f s |\n", what, t * 1e3, weights / t, 654e9 / (weights / t));
  };
  dev_row("fits alone: w13 + w2 stacks, one launch each, with per-tile sums", t_fit);
  dev_row("same, again after the layouts below", t_fit2);
  dev_row("fits alone, layout 0 (fit11's), with per-tile sums", t_layout[0]);
  dev_row("fits alone, layout 1 (compact; the default with sums), with per-tile sums", t_layout[1]);
  dev_row("fits alone, layout 0 with DP mode 6, with per-tile sums", t_layout[2]);
  std::printf("| layout 0 / layout 1 time, with sums | %.3f | | |\n", t_layout[0] / t_layout[1]);
  std::printf("| layout 0 mode 6 / layout 1 time, with sums | %.3f | | |\n", t_layout[2] / t_layout[1]);
  std::printf("| layouts 0, 1, 0+mode 6 == default: bytes and per-tile sums, both stacks | %s |\n",
              same_layout ? "yes" : "NO");
  dev_row("check pass on the fit kernel (check_tiles_device x 2; old method)", t_check_old);
  dev_row("check pass on the check kernel (launch_check x 2; new method)", t_check_new);
  dev_row("lane-major permutation of both outputs", t_lane);
  std::printf("| check kernels found no error | %s |\n\n", check_clean ? "yes" : "NO");
  std::printf("| online method, host-timed, chunk 256 MiB (%lld experts) | best | all runs (alternated) | weights/s (best) | 654e9 weights | vs fits alone |\n|---|---|---|---|---|---|\n",
              static_cast<long long>(best_rep[1].experts_per_chunk));
  for (int p = 0; p < 2; ++p) {
    std::printf("| %s | %.3f ms | %.3f / %.3f / %.3f ms | %.3g | %.1f s | %.3fx the time |\n",
                p ? "**new: pipelined (default)**" : "old: serial (pipeline = false)", best[p] * 1e3,
                all[p][0] * 1e3, all[p][1] * 1e3, all[p][2] * 1e3, weights / best[p], 654e9 * best[p] / weights,
                best[p] / t_fit);
  }
  std::printf("| new / old time | %.3f | | %.3fx the throughput | | |\n\n", best[1] / best[0], best[0] / best[1]);
  std::printf("| host-side parts of the best run (ms) | check | alloc | loop | wait | sums | release | finish | total |\n|---|---|---|---|---|---|---|---|---|\n");
  auto ph = [&](const char* what, const Rep& r) {
    const auto& x = r.seconds;
    std::printf("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", what, x.check * 1e3,
                x.alloc * 1e3, x.loop * 1e3, x.wait * 1e3, x.sums * 1e3, x.release * 1e3, x.finish * 1e3,
                x.total * 1e3);
  };
  ph("old", best_rep[0]);
  ph("new", best_rep[1]);
  std::printf("\n| new method, other chunk sizes (best of 2) | experts per chunk | chunks | time | weights/s | temporaries |\n|---|---|---|---|---|---|\n");
  for (int c = 0; c < 4; ++c)
    std::printf("| chunk %zu MiB | %lld | %lld | %.3f ms | %.3g | %zu B |\n", chunks[c] >> 20,
                static_cast<long long>(r_chunk[c].experts_per_chunk), static_cast<long long>(r_chunk[c].chunks),
                t_chunk[c] * 1e3, weights / t_chunk[c], r_chunk[c].temp_bytes);
  std::printf("| default chunk 256 MiB | %lld | %lld | %.3f ms | %.3g | %zu B (old: %zu B) |\n",
              static_cast<long long>(best_rep[1].experts_per_chunk), static_cast<long long>(best_rep[1].chunks),
              best[1] * 1e3, weights / best[1], best_rep[1].temp_bytes, best_rep[0].temp_bytes);
  std::printf("\n| release callback that calls cudaFree (best of 2) | old | new | new / old |\n|---|---|---|---|\n");
  std::printf("| chunk 256 MiB | %.3f ms | %.3f ms | %.3f |\n\n", t_free[0] * 1e3, t_free[1] * 1e3, t_free[1] / t_free[0]);
  std::printf("| old == new: output bytes (whole allocation) and FitStats | %s |\n", same ? "yes" : "NO");
  std::printf("| FitStats w13 sse / sum_sq (new) | %.17g / %.17g |\n", best_rep[1].w13.sse, best_rep[1].w13.sum_sq);
  cudaFree(d_w2);
  cudaFree(d_err);
  return same && check_clean && same_layout ? 0 : 2;
}
}  // namespace

int main(int argc, char** argv) {
  std::int64_t E = 8, N = 4096, K = 7168;
  if (argc >= 4) {
    E = std::atoll(argv[1]);
    N = std::atoll(argv[2]);
    K = std::atoll(argv[3]);
  }
  const bool student = argc >= 5 && std::string(argv[4]) == "student";
  lutb::LutbShape s;
  s.experts = E;
  s.rows = N;
  s.cols = K;
  s.stacked = true;
  const std::int64_t tiles = s.tiles(), weights = E * N * K;
  cudaDeviceProp prop{};
  ok(cudaGetDeviceProperties(&prop, 0));

  std::uint16_t* d_w = nullptr;
  ok(cudaMalloc(&d_w, static_cast<std::size_t>(weights) * 2));
  fill<<<4096, 256>>>(d_w, static_cast<unsigned long long>(weights), student);
  ok(cudaGetLastError());
  const std::size_t nt = static_cast<std::size_t>(tiles);
  // [0] binned-dp warp, [1] binned-dp thread, [2] optimal warp, [3] binned-dp warp variants
  lutb::cuda::DeviceFitOut out[4];
  for (auto& o : out) {
    ok(cudaMalloc(&o.packed, nt * lutb::kPackedBytes));
    ok(cudaMalloc(&o.codebook, nt * lutb::kCodebookSize));
    ok(cudaMalloc(&o.scale, nt));
    ok(cudaMalloc(&o.sse, nt * 8));
    ok(cudaMalloc(&o.sum_sq, nt * 8));
  }
  unsigned long long* d_err = nullptr;
  ok(cudaMalloc(&d_err, 8));
  cudaEvent_t a, b;
  ok(cudaEventCreate(&a));
  ok(cudaEventCreate(&b));
  lutb::LutbShape s1 = s;
  s1.experts = 1;
  if (const char* on = std::getenv("LUTB_BENCH_ONLINE"); on != nullptr && (std::string(on) == "1" || std::string(on) == "2")) {
    if (N % 16 != 0) {
      std::fprintf(stderr, "LUTB_BENCH_ONLINE needs N = 2I with I %% 8 == 0\n");
      return 1;
    }
    return online_bench(d_w, E, N, K, student, std::string(on) == "1" ? 1 : 2);
  }

  // Best of 3 after a warm-up on expert 0 (the first thread-kernel launch also reserves its local
  // memory).
  auto time_kernel = [&](lutb::cuda::GpuFitKernel kernel, const lutb::cuda::DeviceFitOut& o,
                         lutb::cuda::GpuFitter fitter = lutb::cuda::GpuFitter::BinnedDp) {
    lutb::cuda::fit_device(d_w, lutb::DType::BF16, s1, o, fitter, -1, d_err, nullptr, kernel);
    ok(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int rep = 0; rep < 3; ++rep) {
      ok(cudaEventRecord(a));
      lutb::cuda::fit_device(d_w, lutb::DType::BF16, s, o, fitter, -1, d_err, nullptr, kernel);
      ok(cudaEventRecord(b));
      ok(cudaEventSynchronize(b));
      float ms = 0;
      ok(cudaEventElapsedTime(&ms, a, b));
      best = std::min(best, ms);
      unsigned long long err = 0;
      ok(cudaMemcpy(&err, d_err, 8, cudaMemcpyDeviceToHost));
      if (lutb::cuda::decode_fit_error(err).code != 0) std::printf("unexpected tile error\n");
    }
    return best * 1e-3;
  };
  // binned-dp with 1 (default) or 2 tiles per warp (fit_internal::launch_warp_tiles) into out[3]:
  // best of 3 after a warm-up, and whether bytes and per-tile sums equal `ref`'s (whole stack).
  // tpw: 1, 2 (DP and refinement on the half-warps), 3 (= 2 with the refinement on all lanes), 4 (= 1
  // with its resident warps per SM capped at the 2-tile kernel's by kPad bytes of dynamic shared
  // memory per block).
  constexpr int kPad = 24576;
  auto time_tiles = [&](int tpw, const lutb::cuda::DeviceFitOut* ref) {
    lutb::cuda::fit_internal::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, out[3], -1, d_err};
    float best = 1e30f;
    for (int rep = 0; rep < 4; ++rep) {  // first = warm-up
      ok(cudaMemset(d_err, 0xff, 8));
      ok(cudaEventRecord(a));
      if (tpw == 4) lutb::cuda::fit_internal::launch_warp_padded(ka, kPad, nullptr);
      else lutb::cuda::fit_internal::launch_warp_tiles(ka, tpw == 1 ? 1 : 2, nullptr, tpw == 2);
      ok(cudaEventRecord(b));
      ok(cudaEventSynchronize(b));
      float ms = 0;
      ok(cudaEventElapsedTime(&ms, a, b));
      if (rep > 0) best = std::min(best, ms);
      if (ref == nullptr) break;  // (profile only: one launch)
    }
    return best * 1e-3;
  };
  if (const char* po = std::getenv("LUTB_BENCH_PROFILE_ONLY"); po != nullptr && std::string(po) == "2") {
    for (int layout = 0; layout < 5; ++layout) {  // fit12: one launch per layout, with per-tile sums
      lutb::cuda::fit_internal::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, out[3], -1, d_err};
      lutb::cuda::fit_internal::launch_warp_layout(ka, layout, nullptr);
    }
    ok(cudaDeviceSynchronize());
    std::printf("profile-only: one launch each of the binned-dp layouts 0..4, %lld tiles\n", static_cast<long long>(tiles));
    return 0;
  }
  if (const char* po = std::getenv("LUTB_BENCH_PROFILE_ONLY"); po != nullptr && std::string(po) == "3") {
    // fit16: one launch each of layout 1's DP modes 0, 13, 14, 10, 9, 6, with per-tile sums
    for (int dp : {0, 13, 14, 10, 9, 6}) {
      lutb::cuda::fit_internal::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, out[3], -1, d_err};
      lutb::cuda::fit_internal::launch_warp_dp(ka, 1, dp, nullptr);
    }
    ok(cudaDeviceSynchronize());
    std::printf("profile-only: one launch each of layout 1's DP modes 0, 13, 14, 10, 9, 6, %lld tiles\n",
                static_cast<long long>(tiles));
    return 0;
  }
  if (const char* po = std::getenv("LUTB_BENCH_PROFILE_ONLY"); po != nullptr && std::string(po) == "1") {
    time_tiles(1, nullptr);
    time_tiles(2, nullptr);
    time_tiles(3, nullptr);
    ok(cudaDeviceSynchronize());
    std::printf("profile-only: one launch each of the 1- and 2-tiles-per-warp binned-dp kernels, %lld tiles\n",
                static_cast<long long>(tiles));
    return 0;
  }
  if (const char* po = std::getenv("LUTB_BENCH_PROFILE_ONLY"); po != nullptr && std::string(po) == "4") {
    // fit18: one launch each of launch_warp_shape's (1, 10) (the default with the per-tile sums) in
    // 4-warp blocks (the default's launch), 1-warp blocks, 4-warp blocks on the persistent counter grid,
    // 8- and 16-warp blocks (all with sums), then (0, 6) bytes only in 4- and 2-warp blocks
    namespace fi = lutb::cuda::fit_internal;
    unsigned long long* d_ctr = nullptr;
    ok(cudaMalloc(&d_ctr, 8));
    lutb::cuda::DeviceFitOut ob = out[3];
    ob.sse = ob.sum_sq = nullptr;
    const fi::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, out[3], -1, d_err};
    const fi::KernelArgs kb{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, ob, -1, d_err};
    fi::launch_warp_shape(ka, 1, 10, 4, fi::kGridPerTile, d_ctr, nullptr);
    fi::launch_warp_shape(ka, 1, 10, 1, fi::kGridPerTile, d_ctr, nullptr);
    fi::launch_warp_shape(ka, 1, 10, 4, fi::kGridAtomic, d_ctr, nullptr);
    fi::launch_warp_shape(ka, 1, 10, 8, fi::kGridPerTile, d_ctr, nullptr);
    fi::launch_warp_shape(ka, 1, 10, 16, fi::kGridPerTile, d_ctr, nullptr);
    fi::launch_warp_shape(kb, 0, 6, 4, fi::kGridPerTile, d_ctr, nullptr);
    fi::launch_warp_shape(kb, 0, 6, 2, fi::kGridPerTile, d_ctr, nullptr);
    ok(cudaDeviceSynchronize());
    ok(cudaFree(d_ctr));
    std::printf("profile-only: one launch each of (1, 10) 4-warp, 1-warp, 4-warp counter grid, 8-warp, 16-warp (sums), "
                "(0, 6) 4-warp, 2-warp (bytes only), %lld tiles\n", static_cast<long long>(tiles));
    return 0;
  }
  const char* f18e = std::getenv("LUTB_BENCH_FIT18");
  const bool f18 = f18e != nullptr && (std::string(f18e) == "1" || std::string(f18e) == "2");
  const bool f18b = f18 && std::string(f18e) == "2";  // fit18 run 2: the old default against the new one
  if (const char* f17 = std::getenv("LUTB_BENCH_FIT17"); f18 || (f17 != nullptr && std::string(f17) == "1")) {
    namespace fi = lutb::cuda::fit_internal;
    auto hostv = [](const void* p, std::size_t n) {
      std::vector<std::uint8_t> h(n);
      ok(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
      return h;
    };
    unsigned long long* d_ctr = nullptr;
    ok(cudaMalloc(&d_ctr, 8));
    struct V {
      int layout, dp, warps, grid;  // warps 0: the static kernel of launch_warp_dp(layout, dp)
      bool sums;
    };
    auto launch = [&](const V& v, const fi::KernelArgs& ka) {
      if (v.warps == 0) fi::launch_warp_dp(ka, v.layout, v.dp, nullptr);
      else fi::launch_warp_shape(ka, v.layout, v.dp, v.warps, v.grid, d_ctr, nullptr);
    };
    // Best of 3 after a warm-up into `o` (its outputs overwritten with 0xa5 first, so that a variant
    // that skipped a tile cannot pass the comparison on an earlier variant's bytes).
    auto time_v = [&](const V& v, const lutb::cuda::DeviceFitOut& o) {
      ok(cudaMemset(o.packed, 0xa5, nt * lutb::kPackedBytes));
      ok(cudaMemset(o.codebook, 0xa5, nt * 8));
      ok(cudaMemset(o.scale, 0xa5, nt));
      ok(cudaMemset(o.sse, 0xa5, nt * 8));
      ok(cudaMemset(o.sum_sq, 0xa5, nt * 8));
      lutb::cuda::DeviceFitOut oo = o;
      if (!v.sums) oo.sse = oo.sum_sq = nullptr;
      fi::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, oo, -1, d_err};
      float best = 1e30f;
      for (int rep = 0; rep < 4; ++rep) {  // first = warm-up
        ok(cudaMemset(d_err, 0xff, 8));
        ok(cudaEventRecord(a));
        launch(v, ka);
        ok(cudaEventRecord(b));
        ok(cudaEventSynchronize(b));
        float ms = 0;
        ok(cudaEventElapsedTime(&ms, a, b));
        if (rep > 0) best = std::min(best, ms);
      }
      unsigned long long err = 0;
      ok(cudaMemcpy(&err, d_err, 8, cudaMemcpyDeviceToHost));
      if (lutb::cuda::decode_fit_error(err).code != 0) std::printf("unexpected tile error\n");
      return best * 1e-3;
    };
    // Reference: the default with the per-tile sums (layout 1, mode 0, static 4-warp blocks), into out[0].
    time_v(V{1, 0, 0, 0, true}, out[0]);
    const auto r_packed = hostv(out[0].packed, nt * lutb::kPackedBytes), r_cb = hostv(out[0].codebook, nt * 8),
               r_sc = hostv(out[0].scale, nt), r_sse = hostv(out[0].sse, nt * 8), r_ssq = hostv(out[0].sum_sq, nt * 8);
    auto same17 = [&](const lutb::cuda::DeviceFitOut& x, bool sums) {
      return hostv(x.packed, nt * lutb::kPackedBytes) == r_packed && hostv(x.codebook, nt * 8) == r_cb &&
             hostv(x.scale, nt) == r_sc && (!sums || (hostv(x.sse, nt * 8) == r_sse && hostv(x.sum_sq, nt * 8) == r_ssq));
    };
    // The defaults first in each group (with the sums: layout 1 mode 0, static 4-warp blocks; bytes
    // only: layout 0 mode 6, static 2-warp blocks); grid 0 a tile per warp, 1 persistent stride, 2
    // persistent counter.
    // fit18 (LUTB_BENCH_FIT18=1; =2: the short list of run 2, the fit17 default with the sums first, then
    // fit18's, layout 0 mode 6 in 4-warp blocks, and 8-warp blocks): the defaults since fit17 first in each group (with the sums: layout 1
    // mode 10 in dynamic 4-warp blocks; bytes only: layout 0 mode 6 in dynamic 4-warp blocks), against
    // 8- and 16-warp blocks, smaller blocks, layout 0 with the sums, and layout 1 mode 0.
    const std::vector<V> vs =
        f18b ? std::vector<V>{{1, 10, 4, 0, true}, {0, 6, 4, 0, true}, {0, 6, 8, 0, true}, {0, 6, 4, 0, false}, {0, 6, 8, 0, false}}
        : f18 ? std::vector<V>{{1, 10, 4, 0, true},  {1, 10, 8, 0, true},  {1, 10, 16, 0, true}, {1, 10, 2, 0, true},
                             {1, 10, 1, 0, true},  {0, 6, 4, 0, true},   {0, 6, 8, 0, true},   {0, 6, 16, 0, true},
                             {1, 0, 4, 0, true},   {1, 0, 8, 0, true},   {0, 6, 4, 0, false},  {0, 6, 8, 0, false},
                             {0, 6, 16, 0, false}, {0, 6, 2, 0, false},  {1, 10, 4, 0, false}, {1, 10, 8, 0, false}}
            : std::vector<V>{{1, 0, 0, 0, true},   {1, 0, 4, 0, true},   {1, 0, 2, 0, true},   {1, 0, 1, 0, true},
                             {1, 0, 4, 1, true},   {1, 0, 4, 2, true},   {1, 0, 2, 2, true},   {1, 0, 1, 2, true},
                             {1, 10, 0, 0, true},  {1, 10, 4, 0, true},  {1, 10, 4, 2, true},  {1, 10, 2, 2, true},
                             {1, 10, 1, 2, true},  {1, 9, 4, 2, true},   {1, 13, 0, 0, true},  {1, 13, 4, 0, true},
                             {0, 6, 0, 0, false},  {0, 6, 4, 0, false},  {0, 6, 2, 0, false},  {0, 6, 1, 0, false},
                             {0, 6, 4, 2, false},  {0, 6, 2, 2, false},  {1, 0, 4, 2, false},  {1, 10, 4, 2, false}};
    const int kV = static_cast<int>(vs.size());
    int kBytesBase = 0;  // the first bytes-only variant
    while (vs[static_cast<std::size_t>(kBytesBase)].sums) ++kBytesBase;
    constexpr int kR = 4;  // alternations: forward, reverse, forward, reverse (ABBA)
    std::vector<std::array<double, kR>> t17(static_cast<std::size_t>(kV));
    bool same_all = true;
    for (int r = 0; r < kR; ++r)
      for (int q = 0; q < kV; ++q) {
        const int v = (r & 1) ? kV - 1 - q : q;
        t17[v][r] = time_v(vs[v], out[3]);
        const bool eq = same17(out[3], vs[v].sums);
        if (!eq)
          std::printf("fit17/18: layout %d DP mode %d warps %d grid %d sums %d: bytes or sums DIFFER from the default\n",
                      vs[v].layout, vs[v].dp, vs[v].warps, vs[v].grid, vs[v].sums ? 1 : 0);
        same_all = same_all && eq;
      }
    // Expert 0 == CPU (binned-dp), bytes and FitStats (the per-tile sums added in tile order).
    const std::int64_t tpe = s.tiles_per_expert();
    std::vector<std::uint16_t> h(static_cast<std::size_t>(N * K));
    ok(cudaMemcpy(h.data(), d_w, h.size() * 2, cudaMemcpyDeviceToHost));
    lutb::LutbTensor cpu;
    lutb::FitOptions fo;
    fo.fitter = "binned-dp";
    const lutb::FitStats st = lutb::quantize(h.data(), lutb::DType::BF16, s1, cpu, fo, "w13");
    lutb::FitStats sg;
    for (std::int64_t t = 0; t < tpe; ++t) {
      double e = 0, q = 0;
      std::memcpy(&e, r_sse.data() + 8 * t, 8);
      std::memcpy(&q, r_ssq.data() + 8 * t, 8);
      sg.sse += e;
      sg.sum_sq += q;
    }
    const auto tp = static_cast<std::size_t>(tpe);
    const bool same_cpu = std::equal(cpu.packed.begin(), cpu.packed.end(), r_packed.begin()) &&
                          cpu.packed.size() == tp * lutb::kPackedBytes &&
                          std::equal(cpu.codebook.begin(), cpu.codebook.end(), r_cb.begin()) && cpu.codebook.size() == tp * 8 &&
                          std::equal(cpu.scale.begin(), cpu.scale.end(), r_sc.begin()) && cpu.scale.size() == tp &&
                          sg.sse == st.sse && sg.sum_sq == st.sum_sq;
    std::printf("| GPU | %s, %d SMs |\n", prop.name, prop.multiProcessorCount);
    std::printf("| data | BF16 %s sigma 0.02, [%lld, %lld, %lld] = %.3g weights, %lld tiles |\n\n",
                student ? "Student-t(3)-like" : "Gaussian", static_cast<long long>(E), static_cast<long long>(N),
                static_cast<long long>(K), static_cast<double>(weights), static_cast<long long>(tiles));
    std::printf("| %s: binned-dp, layout, DP mode, block, grid, sums | warps/SM | time alt. 1 / 2 / 3 / 4 (fwd, rev, fwd, rev) "
                "| weights/s (best) | time / group default (alt. 1 / 2 / 3 / 4) | 654e9 weights | of 45e9/s |\n"
                "|---|---|---|---|---|---|---|\n", f18 ? "fit18" : "fit17");
    const char* grid_name[] = {"a tile per warp", "persistent, stride", "persistent, counter"};
    for (int v = 0; v < kV; ++v) {
      const int base = vs[v].sums ? 0 : kBytesBase;
      double tb = 1e30;
      for (int r = 0; r < kR; ++r) tb = std::min(tb, t17[v][r]);
      const double rate = static_cast<double>(weights) / tb;
      int rw = 0;
      char block[64];
      if (vs[v].warps == 0) {
        rw = vs[v].layout == 0 ? fi::resident_warps_per_sm(0) : vs[v].dp == 0 ? fi::resident_warps_per_sm(3)
                                                                              : fi::resident_warps_table(vs[v].dp);
        std::snprintf(block, sizeof(block), "static %d-warp", vs[v].layout == 1 && vs[v].dp == 0 ? 4 : 2);
      } else {
        rw = fi::resident_warps_shape(vs[v].layout, vs[v].dp, vs[v].warps);
        std::snprintf(block, sizeof(block), "dynamic %d-warp", vs[v].warps);
      }
      std::printf("| layout %d, DP mode %d, %s, %s, %s | %d | %.4f / %.4f / %.4f / %.4f s | %.3g | %.3f / %.3f / %.3f / %.3f | %.0f s | %.1f%% |\n",
                  vs[v].layout, vs[v].dp, block, grid_name[vs[v].grid], vs[v].sums ? "with per-tile sums" : "bytes only", rw,
                  t17[v][0], t17[v][1], t17[v][2], t17[v][3], rate, t17[v][0] / t17[base][0], t17[v][1] / t17[base][1],
                  t17[v][2] / t17[base][2], t17[v][3] / t17[base][3], 654e9 / rate, 100.0 * rate / 45e9);
    }
    std::printf("\n| every variant == the default (layout 1, mode 0, with sums): bytes and sums (bytes only: bytes), whole stack | %s |\n",
                same_all ? "yes" : "NO");
    std::printf("| expert 0: GPU default == CPU binned-dp: bytes and FitStats | %s |\n", same_cpu ? "yes" : "NO");
    ok(cudaFree(d_ctr));
    return same_all && same_cpu ? 0 : 2;
  }
  if (const char* f16 = std::getenv("LUTB_BENCH_FIT16"); f16 != nullptr && std::string(f16) == "1") {
    namespace fi = lutb::cuda::fit_internal;
    auto hostv = [](const void* p, std::size_t n) {
      std::vector<std::uint8_t> h(n);
      ok(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
      return h;
    };
    auto same16 = [&](const lutb::cuda::DeviceFitOut& x, const lutb::cuda::DeviceFitOut& y, bool sums) {
      return hostv(x.packed, nt * lutb::kPackedBytes) == hostv(y.packed, nt * lutb::kPackedBytes) &&
             hostv(x.codebook, nt * 8) == hostv(y.codebook, nt * 8) && hostv(x.scale, nt) == hostv(y.scale, nt) &&
             (!sums || (hostv(x.sse, nt * 8) == hostv(y.sse, nt * 8) && hostv(x.sum_sq, nt * 8) == hostv(y.sum_sq, nt * 8)));
    };
    auto time_dp = [&](int layout, int dp, bool sums, const lutb::cuda::DeviceFitOut& o) {
      lutb::cuda::DeviceFitOut oo = o;
      if (!sums) oo.sse = oo.sum_sq = nullptr;
      fi::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, oo, -1, d_err};
      float best = 1e30f;
      for (int rep = 0; rep < 4; ++rep) {  // first = warm-up
        ok(cudaMemset(d_err, 0xff, 8));
        ok(cudaEventRecord(a));
        fi::launch_warp_dp(ka, layout, dp, nullptr);
        ok(cudaEventRecord(b));
        ok(cudaEventSynchronize(b));
        float ms = 0;
        ok(cudaEventElapsedTime(&ms, a, b));
        if (rep > 0) best = std::min(best, ms);
      }
      unsigned long long err = 0;
      ok(cudaMemcpy(&err, d_err, 8, cudaMemcpyDeviceToHost));
      if (lutb::cuda::decode_fit_error(err).code != 0) std::printf("unexpected tile error\n");
      return best * 1e-3;
    };
    // Reference: the default with sums (layout 1, mode 0), into out[0].
    time_dp(1, 0, true, out[0]);
    struct V {
      int layout, dp;
      bool sums;
    };
    // The defaults first in each group (with the sums: layout 1 mode 0; bytes only: layout 0 mode 6).
    const V vs[] = {{1, 0, true}, {1, 9, true},  {1, 10, true}, {1, 12, true}, {1, 6, true}, {1, 13, true},
                    {1, 14, true}, {0, 6, false}, {1, 9, false}, {1, 10, false}, {1, 12, false}};
    constexpr int kV = sizeof(vs) / sizeof(vs[0]);
    constexpr int kR = 4;  // alternations: forward, reverse, forward, reverse (ABBA)
    double t16[kR][kV] = {};
    bool same_all = true;
    for (int r = 0; r < kR; ++r)
      for (int q = 0; q < kV; ++q) {
        const int v = (r & 1) ? kV - 1 - q : q;
        t16[r][v] = time_dp(vs[v].layout, vs[v].dp, vs[v].sums, out[3]);
        const bool eq = same16(out[3], out[0], vs[v].sums);
        if (!eq) std::printf("fit16: layout %d DP mode %d sums %d: bytes or sums DIFFER from the default\n", vs[v].layout,
                             vs[v].dp, vs[v].sums ? 1 : 0);
        same_all = same_all && eq;
      }
    // Expert 0 == CPU (binned-dp), bytes and FitStats (the per-tile sums added in tile order).
    const std::int64_t tpe = s.tiles_per_expert();
    std::vector<std::uint16_t> h(static_cast<std::size_t>(N * K));
    ok(cudaMemcpy(h.data(), d_w, h.size() * 2, cudaMemcpyDeviceToHost));
    lutb::LutbTensor cpu;
    lutb::FitOptions fo;
    fo.fitter = "binned-dp";
    const lutb::FitStats st = lutb::quantize(h.data(), lutb::DType::BF16, s1, cpu, fo, "w13");
    std::vector<double> sse(static_cast<std::size_t>(tpe)), ssq(static_cast<std::size_t>(tpe));
    ok(cudaMemcpy(sse.data(), out[0].sse, sse.size() * 8, cudaMemcpyDeviceToHost));
    ok(cudaMemcpy(ssq.data(), out[0].sum_sq, ssq.size() * 8, cudaMemcpyDeviceToHost));
    lutb::FitStats sg;
    for (std::size_t t = 0; t < sse.size(); ++t) {
      sg.sse += sse[t];
      sg.sum_sq += ssq[t];
    }
    const bool same_cpu = cpu.packed == hostv(out[0].packed, static_cast<std::size_t>(tpe) * lutb::kPackedBytes) &&
                          cpu.codebook == hostv(out[0].codebook, static_cast<std::size_t>(tpe) * 8) &&
                          cpu.scale == hostv(out[0].scale, static_cast<std::size_t>(tpe)) && sg.sse == st.sse &&
                          sg.sum_sq == st.sum_sq;
    std::printf("| GPU | %s, %d SMs |\n", prop.name, prop.multiProcessorCount);
    std::printf("| data | BF16 %s sigma 0.02, [%lld, %lld, %lld] = %.3g weights, %lld tiles |\n\n",
                student ? "Student-t(3)-like" : "Gaussian", static_cast<long long>(E), static_cast<long long>(N),
                static_cast<long long>(K), static_cast<double>(weights), static_cast<long long>(tiles));
    std::printf("| fit16: binned-dp, layout, DP mode, sums | time alt. 1 / 2 / 3 / 4 (fwd, rev, fwd, rev) | weights/s (best) "
                "| time / group default (alt. 1 / 2 / 3 / 4) | 654e9 weights | of 45e9/s |\n|---|---|---|---|---|---|\n");
    auto dp_name = [](int dp) -> const char* {
      switch (dp) {
        case 0: return "0 divide and conquer";
        case 6: return "6 full range, chunk per lane";
        case 9: return "9 cost table + 6's layers";
        case 10: return "10 cost table + divide and conquer";
        case 12: return "12 = 9 at 18 warps (spills)";
        case 13: return "13 table layout, no table, 0's DP (diagnostic)";
        case 14: return "14 table filled, not read, 0's DP (diagnostic)";
        default: return "?";
      }
    };
    for (int v = 0; v < kV; ++v) {
      const int base = vs[v].sums ? 0 : 7;
      double tb = 1e30;
      for (int r = 0; r < kR; ++r) tb = std::min(tb, t16[r][v]);
      const double rate = static_cast<double>(weights) / tb;
      std::printf("| layout %d, DP mode %s, %s | %.4f / %.4f / %.4f / %.4f s | %.3g | %.3f / %.3f / %.3f / %.3f | %.0f s | %.1f%% |\n",
                  vs[v].layout, dp_name(vs[v].dp), vs[v].sums ? "with per-tile sums" : "bytes only", t16[0][v], t16[1][v],
                  t16[2][v], t16[3][v], rate, t16[0][v] / t16[0][base], t16[1][v] / t16[1][base], t16[2][v] / t16[2][base],
                  t16[3][v] / t16[3][base], 654e9 / rate, 100.0 * rate / 45e9);
    }
    std::printf("| resident warps per SM: layout 0 / layout 1 / table modes 9-11 / mode 12 | %d / %d / %d / %d |\n",
                fi::resident_warps_per_sm(0), fi::resident_warps_per_sm(3), fi::resident_warps_table(9),
                fi::resident_warps_table(12));
    std::printf("\n| every variant == the default (layout 1, mode 0, with sums): bytes and sums (bytes only: bytes), whole stack | %s |\n",
                same_all ? "yes" : "NO");
    std::printf("| expert 0: GPU default == CPU binned-dp: bytes and FitStats | %s |\n", same_cpu ? "yes" : "NO");
    return same_all && same_cpu ? 0 : 2;
  }
  if (const char* f13 = std::getenv("LUTB_BENCH_FIT13"); f13 != nullptr && std::string(f13) == "1") {
    namespace fi = lutb::cuda::fit_internal;
    auto hostv = [](const void* p, std::size_t n) {
      std::vector<std::uint8_t> h(n);
      ok(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
      return h;
    };
    auto same13 = [&](const lutb::cuda::DeviceFitOut& x, const lutb::cuda::DeviceFitOut& y, bool sums) {
      return hostv(x.packed, nt * lutb::kPackedBytes) == hostv(y.packed, nt * lutb::kPackedBytes) &&
             hostv(x.codebook, nt * 8) == hostv(y.codebook, nt * 8) && hostv(x.scale, nt) == hostv(y.scale, nt) &&
             (!sums || (hostv(x.sse, nt * 8) == hostv(y.sse, nt * 8) && hostv(x.sum_sq, nt * 8) == hostv(y.sum_sq, nt * 8)));
    };
    auto time_dp = [&](int layout, int dp, bool sums, const lutb::cuda::DeviceFitOut& o) {
      lutb::cuda::DeviceFitOut oo = o;
      if (!sums) oo.sse = oo.sum_sq = nullptr;
      fi::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, oo, -1, d_err};
      float best = 1e30f;
      for (int rep = 0; rep < 4; ++rep) {  // first = warm-up
        ok(cudaMemset(d_err, 0xff, 8));
        ok(cudaEventRecord(a));
        fi::launch_warp_dp(ka, layout, dp, nullptr);
        ok(cudaEventRecord(b));
        ok(cudaEventSynchronize(b));
        float ms = 0;
        ok(cudaEventElapsedTime(&ms, a, b));
        if (rep > 0) best = std::min(best, ms);
      }
      unsigned long long err = 0;
      ok(cudaMemcpy(&err, d_err, 8, cudaMemcpyDeviceToHost));
      if (lutb::cuda::decode_fit_error(err).code != 0) std::printf("unexpected tile error\n");
      return best * 1e-3;
    };
    // Reference: mode 0 (the divide and conquer), layout 0, with the per-tile sums, into out[0].
    time_dp(0, 0, true, out[0]);
    struct V {
      int layout, dp;
      bool sums;
    };
    const V vs[] = {{1, 0, true},  {1, 6, true},  {1, 7, true},  {0, 0, true},  {0, 6, true},  {0, 7, true},
                    {0, 2, true},  {0, 0, false}, {0, 6, false}, {0, 7, false}, {1, 0, false}, {1, 6, false},
                    {1, 7, false}};
    constexpr int kV = sizeof(vs) / sizeof(vs[0]);
    double t13[2][kV] = {};
    bool same_all = true;
    for (int r = 0; r < 2; ++r)
      for (int v = 0; v < kV; ++v) {
        t13[r][v] = time_dp(vs[v].layout, vs[v].dp, vs[v].sums, out[3]);
        const bool eq = same13(out[3], out[0], vs[v].sums);
        if (!eq) std::printf("fit13: layout %d DP mode %d sums %d: bytes or sums DIFFER from mode 0\n", vs[v].layout,
                             vs[v].dp, vs[v].sums ? 1 : 0);
        same_all = same_all && eq;
      }
    // Expert 0 == CPU (binned-dp), bytes and FitStats (the per-tile sums added in tile order).
    const std::int64_t tpe = s.tiles_per_expert();
    std::vector<std::uint16_t> h(static_cast<std::size_t>(N * K));
    ok(cudaMemcpy(h.data(), d_w, h.size() * 2, cudaMemcpyDeviceToHost));
    lutb::LutbTensor cpu;
    lutb::FitOptions fo;
    fo.fitter = "binned-dp";
    const auto t0 = std::chrono::steady_clock::now();
    const lutb::FitStats st = lutb::quantize(h.data(), lutb::DType::BF16, s1, cpu, fo, "w13");
    const double cpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<double> sse(static_cast<std::size_t>(tpe)), ssq(static_cast<std::size_t>(tpe));
    ok(cudaMemcpy(sse.data(), out[0].sse, sse.size() * 8, cudaMemcpyDeviceToHost));
    ok(cudaMemcpy(ssq.data(), out[0].sum_sq, ssq.size() * 8, cudaMemcpyDeviceToHost));
    lutb::FitStats sg;
    for (std::size_t t = 0; t < sse.size(); ++t) {
      sg.sse += sse[t];
      sg.sum_sq += ssq[t];
    }
    const bool same_cpu = cpu.packed == hostv(out[0].packed, static_cast<std::size_t>(tpe) * lutb::kPackedBytes) &&
                          cpu.codebook == hostv(out[0].codebook, static_cast<std::size_t>(tpe) * 8) &&
                          cpu.scale == hostv(out[0].scale, static_cast<std::size_t>(tpe)) && sg.sse == st.sse &&
                          sg.sum_sq == st.sum_sq;
    // Phase breakdown: the instrumented kernel (layout 0) with DP modes 0, 1, 2.
    unsigned long long* d_prof = nullptr;
    constexpr int kSlots13 = fi::kProfSlotsTotal;
    constexpr int kPm = 5;
    static const int kPmode[kPm] = {0, 1, 2, 6, 7};
    unsigned long long prof13[kPm][kSlots13] = {};
    ok(cudaMalloc(&d_prof, sizeof(prof13[0])));
    for (int pm = 0; pm < kPm; ++pm) {
      const int dp = kPmode[pm];
      ok(cudaMemset(d_prof, 0, sizeof(prof13[pm])));
      fi::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, out[3], -1, d_err};
      ok(cudaMemset(d_err, 0xff, 8));
      fi::launch_warp_profiled(ka, d_prof, nullptr, fi::kWarpArithDefault, dp);
      ok(cudaMemcpy(prof13[pm], d_prof, sizeof(prof13[pm]), cudaMemcpyDeviceToHost));
      const bool eq = same13(out[3], out[0], true);
      if (!eq) std::printf("fit13: profiled DP mode %d: bytes or sums DIFFER from mode 0\n", dp);
      same_all = same_all && eq;
    }
    cudaFree(d_prof);
    std::printf("| GPU | %s, %d SMs |\n", prop.name, prop.multiProcessorCount);
    std::printf("| data | BF16 %s sigma 0.02, [%lld, %lld, %lld] = %.3g weights, %lld tiles |\n\n",
                student ? "Student-t(3)-like" : "Gaussian", static_cast<long long>(E), static_cast<long long>(N),
                static_cast<long long>(K), static_cast<double>(weights), static_cast<long long>(tiles));
    std::printf("| fit13: binned-dp, layout, DP mode, sums | time alt. 1 / 2 | weights/s (best) | time / same layout's mode 0 "
                "(alt. 1 / 2) | 654e9 weights | of 45e9/s |\n|---|---|---|---|---|---|\n");
    static const char* const kDp[8] = {"0 divide and conquer (baseline)", "1 full range, every layer",
                                       "2 full range from layer 3", "3",
                                       "4 full range, every layer, 2 passes at a time", "5",
                                       "6 full range, a chunk of pairs per lane, every layer",
                                       "7 full range, a chunk of pairs per lane, from layer 3"};
    for (int v = 0; v < kV; ++v) {
      int base = v;
      for (int u = 0; u < kV; ++u)
        if (vs[u].layout == vs[v].layout && vs[u].sums == vs[v].sums && vs[u].dp == 0) base = u;
      const double tb = std::min(t13[0][v], t13[1][v]);
      const double rate = static_cast<double>(weights) / tb;
      std::printf("| layout %d, DP mode %s, %s | %.4f / %.4f s | %.3g | %.3f / %.3f | %.0f s | %.1f%% |\n", vs[v].layout,
                  kDp[vs[v].dp], vs[v].sums ? "with per-tile sums" : "bytes only", t13[0][v], t13[1][v], rate,
                  t13[0][v] / t13[0][base], t13[1][v] / t13[1][base], 654e9 / rate, 100.0 * rate / 45e9);
    }
    std::printf("| default selection (fit_internal.cuh): with sums layout %d DP mode %d, bytes only layout %d DP mode %d | |\n",
                fi::kWarpLayoutDefault, fi::kWarpDpDefault, fi::kWarpLayoutBytesOnly, fi::kWarpDpBytesOnly);
    std::printf("| resident warps per SM: layout 0 / layout 1 | %d / %d |\n", fi::resident_warps_per_sm(0),
                fi::resident_warps_per_sm(3));
    static const char* const kPh[7] = {"load + check", "sort + de-duplication", "prefix sums (serial)", "bin edges",
                                       "binned DP (layers 1..K)", "refinement (window DP)",
                                       "encoding + per-tile sums (serial)"};
    constexpr int P = fi::kProfPhases;
    std::printf("\n| phase (layout 0, instrumented: lane-0 clock64 cycles per tile) | DP mode 0 | DP mode 1 | DP mode 2 | DP mode 6 "
                "| DP mode 7 |\n|---|---|---|---|---|---|\n");
    double tot[kPm] = {};
    for (int pm = 0; pm < kPm; ++pm)
      for (int i = 0; i < P; ++i) tot[pm] += static_cast<double>(prof13[pm][i]);
    for (int i = 0; i < P; ++i) {
      std::printf("| %s |", kPh[i]);
      for (int pm = 0; pm < kPm; ++pm)
        std::printf(" %.0f (%.1f%%) |", static_cast<double>(prof13[pm][i]) / static_cast<double>(prof13[pm][P]),
                    100.0 * static_cast<double>(prof13[pm][i]) / tot[pm]);
      std::printf("\n");
    }
    std::printf("| total per tile |");
    for (int pm = 0; pm < kPm; ++pm) std::printf(" %.0f |", tot[pm] / static_cast<double>(prof13[pm][P]));
    std::printf("\n| distinct values n / bin edges m / refinement rounds per tile |");
    for (int pm = 0; pm < kPm; ++pm) {
      const double q = static_cast<double>(prof13[pm][P]);
      std::printf(" %.1f / %.1f / %.2f |", static_cast<double>(prof13[pm][P + 1]) / q,
                  static_cast<double>(prof13[pm][P + 2]) / q, static_cast<double>(prof13[pm][P + 3]) / q);
    }
    std::printf("\n| DP layers recomputed by the divide and conquer (non-monotone full-range minima), per tile (count) |");
    for (int pm = 0; pm < kPm; ++pm)
      std::printf(" %.5f (%llu) |", static_cast<double>(prof13[pm][P + 4]) / static_cast<double>(prof13[pm][P]),
                  prof13[pm][P + 4]);
    std::printf("\n\n| every mode and layout == mode 0, layout 0: bytes and sums (bytes only: bytes), whole stack | %s |\n",
                same_all ? "yes" : "NO");
    std::printf("| expert 0: GPU (mode 0 reference) == CPU binned-dp (%d threads, %.3f s): bytes and FitStats | %s |\n",
                omp_get_max_threads(), cpu_s, same_cpu ? "yes" : "NO");
    return same_all && same_cpu ? 0 : 2;
  }
  const double t_thread = time_kernel(lutb::cuda::GpuFitKernel::Thread, out[1]);
  lutb::cuda::DeviceFitOut nostats = out[0];
  nostats.sse = nostats.sum_sq = nullptr;
  const double t_warp_nostats = time_kernel(lutb::cuda::GpuFitKernel::Warp, nostats);
  const double t_warp = time_kernel(lutb::cuda::GpuFitKernel::Warp, out[0]);
  const double t_opt = time_kernel(lutb::cuda::GpuFitKernel::Warp, out[2], lutb::cuda::GpuFitter::Optimal);

  auto host = [](const void* p, std::size_t n) {
    std::vector<std::uint8_t> h(n);
    ok(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
    return h;
  };
  auto same_out = [&](const lutb::cuda::DeviceFitOut& x, const lutb::cuda::DeviceFitOut& y) {
    return host(x.packed, nt * lutb::kPackedBytes) == host(y.packed, nt * lutb::kPackedBytes) &&
           host(x.codebook, nt * 8) == host(y.codebook, nt * 8) && host(x.scale, nt) == host(y.scale, nt) &&
           host(x.sse, nt * 8) == host(y.sse, nt * 8) && host(x.sum_sq, nt * 8) == host(y.sum_sq, nt * 8);
  };
  // fit11: 1 tile per warp (the default) against 2 (the DP and refinement of two tiles on the
  // half-warps), alternated twice in this run: 1, 2, 1, 2; the 2-tile kernel's bytes and sums ==
  // the default's (whole stack).
  double t_tiles[2][4] = {};  // [repetition][variant - 1]
  bool same_tiles = true;
  for (int r = 0; r < 2; ++r)
    for (int tpw : {1, 2, 3, 4}) {
      t_tiles[r][tpw - 1] = time_tiles(tpw, &out[0]);
      same_tiles = same_tiles && same_out(out[3], out[0]);
    }
  // fit12: the one-tile binned-dp kernel's shared-memory layouts (fit_internal::launch_warp_layout: 0
  // fit11's, 1..4 compact: 4-warp blocks for 20 / 24 warps per SM, 2-warp blocks for 20 / 24),
  // alternated twice in this run (0..4, 0..4), with the per-tile sums; then bytes only (0, 1, 3
  // twice); bytes and per-tile sums == the default's (whole stack).
  auto time_layout = [&](int layout, bool sums) {
    lutb::cuda::DeviceFitOut o3 = out[3];
    if (!sums) o3.sse = o3.sum_sq = nullptr;
    lutb::cuda::fit_internal::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, o3, -1, d_err};
    float best = 1e30f;
    for (int rep = 0; rep < 4; ++rep) {  // first = warm-up
      ok(cudaMemset(d_err, 0xff, 8));
      ok(cudaEventRecord(a));
      lutb::cuda::fit_internal::launch_warp_layout(ka, layout, nullptr);
      ok(cudaEventRecord(b));
      ok(cudaEventSynchronize(b));
      float ms = 0;
      ok(cudaEventElapsedTime(&ms, a, b));
      if (rep > 0) best = std::min(best, ms);
    }
    return best * 1e-3;
  };
  constexpr int kLayouts = 5;
  double t_layout[2][kLayouts] = {}, t_layout_nosums[2][kLayouts] = {};  // [repetition][layout]
  bool same_layout = true;
  for (int r = 0; r < 2; ++r)
    for (int layout = 0; layout < kLayouts; ++layout) {
      t_layout[r][layout] = time_layout(layout, true);
      same_layout = same_layout && same_out(out[3], out[0]);
    }
  for (int r = 0; r < 2; ++r)
    for (int layout : {0, 1, 3}) t_layout_nosums[r][layout] = time_layout(layout, false);
  same_layout = same_layout && host(out[3].packed, nt * lutb::kPackedBytes) == host(out[0].packed, nt * lutb::kPackedBytes);
  // Warp kernel variants: cost evaluations issued together in the DP scans (default: binned-dp 1,
  // optimal 4), same run, same bytes as the default's (whole stack, bytes and per-tile sums).
  constexpr int kDefArith = lutb::cuda::fit_internal::kWarpArithDefault;
  auto time_variant = [&](int unroll, bool optimal, const lutb::cuda::DeviceFitOut& ref, int arith = lutb::cuda::fit_internal::kWarpArithDefault) {
    lutb::cuda::fit_internal::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, out[3], -1, d_err};
    ka.optimal = optimal;
    float best = 1e30f;
    for (int rep = 0; rep < 4; ++rep) {  // first = warm-up
      ok(cudaMemset(d_err, 0xff, 8));
      ok(cudaEventRecord(a));
      lutb::cuda::fit_internal::launch_warp_variant(ka, unroll, arith, nullptr);
      ok(cudaEventRecord(b));
      ok(cudaEventSynchronize(b));
      float ms = 0;
      ok(cudaEventElapsedTime(&ms, a, b));
      if (rep > 0) best = std::min(best, ms);
    }
    const bool eq = same_out(out[3], ref);
    return std::pair<double, bool>(best * 1e-3, eq);
  };
  double t_unroll[2][5] = {};  // [optimal][unroll]
  bool same_unroll = true;
  t_unroll[0][1] = t_warp;
  t_unroll[1][4] = t_opt;
  for (int u : {2, 4}) {
    const auto r = time_variant(u, false, out[0]);
    t_unroll[0][u] = r.first;
    same_unroll = same_unroll && r.second;
  }
  for (int u : {1, 2}) {
    const auto r = time_variant(u, true, out[2]);
    t_unroll[1][u] = r.first;
    same_unroll = same_unroll && r.second;
  }
  // Cost-arithmetic variants (fit_internal.cuh kWarpArithDefault): 0 = the IEEE division (the
  // kernel before fit10), 1 = table division only; same bytes and sums as the default's.
  static_assert(kDefArith == 3);
  double t_arith[2][4] = {};  // [optimal][arith]
  bool same_arith = true;
  t_arith[0][kDefArith] = t_warp;
  t_arith[1][kDefArith] = t_opt;
  for (int ar : {0, 1, 2}) {
    const auto r = time_variant(1, false, out[0], ar);
    t_arith[0][ar] = r.first;
    same_arith = same_arith && r.second;
  }
  for (int ar : {0, 2}) {
    const auto r = time_variant(4, true, out[2], ar);
    t_arith[1][ar] = r.first;
    same_arith = same_arith && r.second;
  }

  // Where the warp kernel's time goes: per-phase clock64() cycles of lane 0, summed over warps
  // (an instrumented copy of the kernel; same bytes).
  unsigned long long* d_prof = nullptr;
  constexpr int kSlots = lutb::cuda::fit_internal::kProfSlotsTotal;
  unsigned long long prof[3][kSlots] = {};  // [0] binned-dp, [1] optimal, [2] binned-dp with arith 0
  ok(cudaMalloc(&d_prof, sizeof(prof[0])));
  for (int f = 0; f < 3; ++f) {
    ok(cudaMemset(d_prof, 0, sizeof(prof[f])));
    lutb::cuda::fit_internal::KernelArgs ka{d_w, 1, N, K, s.tiles_n(), s.tiles_k(), tiles, 0, out[f == 1 ? 2 : f == 0 ? 0 : 3], -1, d_err};
    ka.optimal = f == 1;
    ok(cudaMemset(d_err, 0xff, 8));
    lutb::cuda::fit_internal::launch_warp_profiled(ka, d_prof, nullptr, f == 2 ? 0 : kDefArith);
    ok(cudaMemcpy(prof[f], d_prof, sizeof(prof[f]), cudaMemcpyDeviceToHost));
  }
  cudaFree(d_prof);

  // Whole-stack bytes: warp == thread.
  const bool same_kernels = host(out[0].packed, nt * lutb::kPackedBytes) == host(out[1].packed, nt * lutb::kPackedBytes) &&
                            host(out[0].codebook, nt * 8) == host(out[1].codebook, nt * 8) &&
                            host(out[0].scale, nt) == host(out[1].scale, nt) &&
                            host(out[0].sse, nt * 8) == host(out[1].sse, nt * 8);

  // CPU baseline (all cores) on expert 0, and byte comparison.
  const std::int64_t tpe = s.tiles_per_expert();
  std::vector<std::uint16_t> h(static_cast<std::size_t>(N * K));
  ok(cudaMemcpy(h.data(), d_w, h.size() * 2, cudaMemcpyDeviceToHost));
  const auto gp = host(out[0].packed, static_cast<std::size_t>(tpe) * lutb::kPackedBytes);
  const auto gc = host(out[0].codebook, static_cast<std::size_t>(tpe) * lutb::kCodebookSize);
  const auto gs = host(out[0].scale, static_cast<std::size_t>(tpe));
  lutb::LutbTensor cpu;
  lutb::FitOptions fo;
  fo.fitter = "binned-dp";
  const auto t0 = std::chrono::steady_clock::now();
  const lutb::FitStats st_b = lutb::quantize(h.data(), lutb::DType::BF16, s1, cpu, fo, "w13");
  const double cpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu_rate = static_cast<double>(N * K) / cpu_s;
  const bool same = cpu.packed == gp && cpu.codebook == gc && cpu.scale == gs;
  // The same for optimal.
  const auto op = host(out[2].packed, static_cast<std::size_t>(tpe) * lutb::kPackedBytes);
  const auto oc = host(out[2].codebook, static_cast<std::size_t>(tpe) * lutb::kCodebookSize);
  const auto os = host(out[2].scale, static_cast<std::size_t>(tpe));
  lutb::LutbTensor cpu_opt;
  fo.fitter = "optimal";
  const auto t1 = std::chrono::steady_clock::now();
  const lutb::FitStats st_opt = lutb::quantize(h.data(), lutb::DType::BF16, s1, cpu_opt, fo, "w13");
  const double cpu_opt_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const double cpu_opt_rate = static_cast<double>(N * K) / cpu_opt_s;
  const bool same_opt = cpu_opt.packed == op && cpu_opt.codebook == oc && cpu_opt.scale == os;

  for (auto& o : out) {
    cudaFree(o.packed);
    cudaFree(o.codebook);
    cudaFree(o.scale);
    cudaFree(o.sse);
    cudaFree(o.sum_sq);
  }

  // The online method on a DeepSeek-V3-shaped slice: w13 = the stack (needs N = 2I, K = H), w2
  // [E, H, I] filled the same way. Stacked source, released at the end by the caller.
  double t_online = 0.0, online_weights = 0.0;
  std::size_t online_temp = 0, online_out = 0;
  const std::int64_t Hh = K, Ii = N / 2;
  if (N % 16 == 0) {
    std::uint16_t* d_w2 = nullptr;
    ok(cudaMalloc(&d_w2, static_cast<std::size_t>(E * Hh * Ii) * 2));
    fill<<<4096, 256>>>(d_w2, static_cast<unsigned long long>(E * Hh * Ii), student);
    ok(cudaDeviceSynchronize());
    double best = 1e30;
    for (int rep = 0; rep < 2; ++rep) {
      lutb::cuda::DeviceExpertSource src;
      src.dtype = lutb::DType::BF16;
      src.experts = E;
      src.hidden = Hh;
      src.intermediate = Ii;
      src.w13 = {d_w};
      src.w2 = {d_w2};
      lutb::cuda::DeviceLutbLayer layer;
      const auto o0 = std::chrono::steady_clock::now();
      const lutb::cuda::GpuOnlineReport r = lutb::cuda::quantize_experts_online(src, layer);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - o0).count());
      online_temp = r.temp_bytes;
      online_out = r.quantized_bytes;
    }
    t_online = best;
    online_weights = static_cast<double>(E * 3 * Hh * Ii);
    cudaFree(d_w2);
  }

  auto row = [&](const char* what, double sec) {
    const double rate = static_cast<double>(weights) / sec;
    std::printf("| %s | %.4f s | %.3g | %.2fx | %.0f s | %.1f%% |\n", what, sec, rate, t_thread / sec, 654e9 / rate,
                100.0 * rate / 45e9);
  };
  std::printf("| GPU | %s, %d SMs |\n", prop.name, prop.multiProcessorCount);
  std::printf("| data | BF16 %s sigma 0.02, [%lld, %lld, %lld] = %.3g weights, %lld tiles |\n\n",
              student ? "Student-t(3)-like" : "Gaussian", static_cast<long long>(E), static_cast<long long>(N),
              static_cast<long long>(K), static_cast<double>(weights), static_cast<long long>(tiles));
  std::printf("| fitter (data on the device) | time | weights/s | vs thread kernel | 654e9 weights | of 45e9/s |\n");
  std::printf("|---|---|---|---|---|---|\n");
  row("GPU thread-per-tile kernel (old), with per-tile sums", t_thread);
  row("GPU warp-per-tile kernel (new, default: 1 evaluation at a time, cost arithmetic 3), with per-tile sums", t_warp);
  row("GPU warp kernel variant: arithmetic 0, **IEEE division** (the kernel before fit10), with per-tile sums", t_arith[0][0]);
  row("GPU warp kernel variant: arithmetic 1, table division, with per-tile sums", t_arith[0][1]);
  row("GPU warp kernel variant: arithmetic 2, table division + e4m3_nearest_fast, with per-tile sums", t_arith[0][2]);
  row("GPU warp-per-tile kernel (new), bytes only", t_warp_nostats);
  for (int r = 0; r < 2; ++r) {
    char what[200];
    static const char* const kTiles[4] = {
        "**1 tile per warp** (the default kernel)", "**2 tiles per warp** (DP + refinement on half-warps)",
        "2 tiles per warp, DP on half-warps, refinement on all lanes",
        "1 tile per warp, resident warps per SM capped like the 2-tile kernel's"};
    for (int v = 0; v < 4; ++v) {
      std::snprintf(what, sizeof what, "fit11 alternation %d: %s, with per-tile sums", r + 1, kTiles[v]);
      row(what, t_tiles[r][v]);
    }
  }
  std::printf("| fit11: time / 1 tile per warp's, alternation 1 and 2: 2 tiles per warp | %.3f / %.3f | | | | |\n",
              t_tiles[0][1] / t_tiles[0][0], t_tiles[1][1] / t_tiles[1][0]);
  std::printf("| fit11: same, 2 tiles per warp (refinement on all lanes) | %.3f / %.3f | | | | |\n",
              t_tiles[0][2] / t_tiles[0][0], t_tiles[1][2] / t_tiles[1][0]);
  std::printf("| fit11: same, 1 tile per warp capped like the 2-tile kernel | %.3f / %.3f | | | | |\n",
              t_tiles[0][3] / t_tiles[0][0], t_tiles[1][3] / t_tiles[1][0]);
  std::printf("| fit11: resident warps per SM (occupancy calculator): 1 tile per warp / 2 tiles / 2 tiles, "
              "refinement on all lanes / 1 tile capped | %d / %d / %d / %d |\n",
              lutb::cuda::fit_internal::resident_warps_per_sm(0), lutb::cuda::fit_internal::resident_warps_per_sm(1),
              lutb::cuda::fit_internal::resident_warps_per_sm(2), lutb::cuda::fit_internal::resident_warps_per_sm(0, kPad));
  static const char* const kLayoutName[kLayouts] = {
      "layout 0 (fit11's: prefix sums in shared memory, 2-warp blocks, 98 registers)",
      "layout 1 (compact, 4-warp blocks, <= 96 registers: 20 warps per SM)",
      "layout 2 (compact, 4-warp blocks, <= 80 registers (spills): 24 warps per SM)",
      "layout 3 (compact, 2-warp blocks, <= 96 registers: 20 warps per SM)",
      "layout 4 (compact, 2-warp blocks, <= 80 registers (spills), values reloaded for the encoding: 24 warps per SM)"};
  for (int r = 0; r < 2; ++r)
    for (int v = 0; v < kLayouts; ++v) {
      char what[240];
      std::snprintf(what, sizeof what, "fit12 alternation %d: %s, with per-tile sums", r + 1, kLayoutName[v]);
      row(what, t_layout[r][v]);
    }
  for (int r = 0; r < 2; ++r)
    for (int v : {0, 1, 3}) {
      char what[240];
      std::snprintf(what, sizeof what, "fit12 alternation %d: %s, bytes only", r + 1, kLayoutName[v]);
      row(what, t_layout_nosums[r][v]);
    }
  for (int v = 1; v < kLayouts; ++v)
    std::printf("| fit12: time / layout 0's, alternation 1 and 2, with sums: layout %d | %.3f / %.3f | | | | |\n", v,
                t_layout[0][v] / t_layout[0][0], t_layout[1][v] / t_layout[1][0]);
  for (int v : {1, 3})
    std::printf("| fit12: time / layout 0's, alternation 1 and 2, bytes only: layout %d | %.3f / %.3f | | | | |\n", v,
                t_layout_nosums[0][v] / t_layout_nosums[0][0], t_layout_nosums[1][v] / t_layout_nosums[1][0]);
  std::printf("| fit12: resident warps per SM (occupancy calculator): layout 0 / 1 / 2 / 3 / 4 | %d / %d / %d / %d / %d | "
              "default layout: %d |\n",
              lutb::cuda::fit_internal::resident_warps_per_sm(0), lutb::cuda::fit_internal::resident_warps_per_sm(3),
              lutb::cuda::fit_internal::resident_warps_per_sm(4), lutb::cuda::fit_internal::resident_warps_per_sm(5),
              lutb::cuda::fit_internal::resident_warps_per_sm(6), lutb::cuda::fit_internal::kWarpLayoutDefault);
  row("GPU warp kernel variant: DP scans 2 evaluations at a time, with per-tile sums", t_unroll[0][2]);
  row("GPU warp kernel variant: DP scans 4 evaluations at a time, with per-tile sums", t_unroll[0][4]);
  row("GPU **optimal**, warp-per-tile kernel (default: 4 evaluations at a time), with per-tile sums", t_opt);
  row("GPU optimal variant: arithmetic 0, **IEEE division** (the kernel before fit10), with per-tile sums", t_arith[1][0]);
  row("GPU optimal variant: arithmetic 2 (table division + e4m3_nearest_fast, prefix sums scaled per evaluation), with per-tile sums", t_arith[1][2]);
  row("GPU optimal variant: DP scans 1 evaluation at a time, with per-tile sums", t_unroll[1][1]);
  row("GPU optimal variant: DP scans 2 evaluations at a time, with per-tile sums", t_unroll[1][2]);
  std::printf("| optimal vs binned-dp (warp, with sums) | %.2fx the time | | | | |\n", t_opt / t_warp);
  std::printf("| CPU binned-dp, %d threads, expert 0 only | %.3f s | %.3g | | %.0f s | |\n", omp_get_max_threads(),
              cpu_s, cpu_rate, 654e9 / cpu_rate);
  std::printf("| CPU optimal, %d threads, expert 0 only | %.3f s | %.3g | | %.0f s | |\n", omp_get_max_threads(),
              cpu_opt_s, cpu_opt_rate, 654e9 / cpu_opt_rate);
  std::printf("| SQNR expert 0 (CPU = GPU bytes): binned-dp / optimal | %.4f dB / %.4f dB | | | | |\n",
              st_b.sqnr_db(), st_opt.sqnr_db());
  if (t_online > 0.0) {
    const double rate = online_weights / t_online;
    std::printf("| online method, [%lld x (4096x7168 + 7168x2048)]-shaped layer (%.3g weights): check + fit + "
                "lane-major + stats, host-timed | %.4f s | %.3g | | %.0f s | %.1f%% |\n",
                static_cast<long long>(E), online_weights, t_online, rate, 654e9 / rate, 100.0 * rate / 45e9);
    std::printf("| online method device memory | output %zu B, temporaries %zu B |\n", online_out, online_temp);
  }
  for (int f = 0; f < 3; ++f) {
    static const char* const kPhase[3][7] = {
        {"load + check", "sort + de-duplication", "prefix sums (serial)", "bin edges",
         "binned DP (6 layers, level-parallel)", "refinement (window DP)", "encoding + per-tile sums (serial)"},
        {"load + check", "sort + de-duplication", "prefix sums (serial)", "bin edges",
         "binned DP (6 layers, level-parallel)", "refinement (window DP)", "encoding + per-tile sums (serial)"},
        {"load + check", "sort + de-duplication", "prefix sums (serial)", "(no bin edges)",
         "DP over all distinct values at the first scale", "rest of the scale search (+ every candidate's encoding)",
         "encoding (forced / all-zero tiles only)"}};
    constexpr int P = lutb::cuda::fit_internal::kProfPhases;
    const unsigned long long* pf = prof[f];
    double total = 0.0;
    for (int i = 0; i < P; ++i) total += static_cast<double>(pf[i]);
    const double nt_d = static_cast<double>(pf[P]);
    std::printf("\n| %s warp kernel phase (instrumented run, lane-0 clock64 cycles per tile) | cycles/tile | share |\n",
                f == 0 ? "binned-dp" : f == 1 ? "optimal" : "binned-dp, IEEE-division variant (before fit10),");
    std::printf("|---|---|---|\n");
    for (int i = 0; i < P; ++i)
      std::printf("| %s | %.0f | %.1f%% |\n", kPhase[f == 1 ? 2 : f == 2 ? 1 : 0][i], static_cast<double>(pf[i]) / nt_d,
                  100.0 * static_cast<double>(pf[i]) / total);
    std::printf("| total per tile (one warp) | %.0f | |\n", total / nt_d);
    if (f != 1)
      std::printf("| mean distinct values n / bin edges m / refinement rounds per tile | %.1f / %.1f / %.2f | |\n",
                  static_cast<double>(pf[P + 1]) / nt_d, static_cast<double>(pf[P + 2]) / nt_d,
                  static_cast<double>(pf[P + 3]) / nt_d);
    else
      std::printf("| mean distinct values n / scales evaluated below the first per tile | %.1f / %.3f | |\n",
                  static_cast<double>(pf[P + 1]) / nt_d, static_cast<double>(pf[P + 3]) / nt_d);
  }
  std::printf("\n| warp == thread kernel bytes and sums (whole stack) | %s |\n", same_kernels ? "yes" : "NO");
  std::printf("| warp kernel variants (binned-dp 2, 4; optimal 1, 2 evaluations at a time) == defaults: bytes and "
              "sums, whole stack | %s |\n",
              same_unroll ? "yes" : "NO");
  std::printf("| warp kernel arithmetic variants (binned-dp 0, 1, 2; optimal 0, 2) == defaults: bytes and sums, whole stack "
              "| %s |\n",
              same_arith ? "yes" : "NO");
  std::printf("| fit11 variants (2 tiles per warp, both kinds; 1 tile capped) == default: bytes and sums, whole stack | %s |\n",
              same_tiles ? "yes" : "NO");
  std::printf("| fit12 layouts 0..4 == default: bytes and sums (bytes only: bytes), whole stack | %s |\n",
              same_layout ? "yes" : "NO");
  std::printf("| expert 0 bytes GPU == CPU, binned-dp | %s |\n", same ? "yes" : "NO");
  std::printf("| expert 0 bytes GPU == CPU, optimal | %s |\n", same_opt ? "yes" : "NO");
  return same && same_opt && same_kernels && same_unroll && same_arith && same_tiles && same_layout ? 0 : 2;
}
