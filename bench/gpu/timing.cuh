// bench/gpu/timing.cuh: the one timing helper of the GPU benchmarks.
//
// Method (docs/perf/*.md cite it): warm-up launches, then `batches` batches of `iters` launches
// timed with CUDA events on the given stream; the figure is the median over batches of the mean
// time per launch. A benchmark that reuses weights rotates over enough copies that the bytes
// touched between two uses of the same copy exceed `l2_factor` times the device's L2 size
// (rotation_copies), so the weights come from HBM, not from L2.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace lutb::bench {

// Exits with the file, line, call and CUDA's message when a CUDA call fails.
#define LUTB_BENCH_CHECK(x)                                                                    \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

struct TimingOptions {
  int warmup = 3;    // untimed launches before the first batch
  int iters = 20;    // launches per timed batch
  int batches = 7;   // timed batches; the median of their per-launch means is reported
};

struct Timing {
  double median_us = 0;  // median over batches of the mean time per launch, microseconds
  double min_us = 0;     // fastest batch's mean per launch
  double max_us = 0;     // slowest batch's mean per launch
};

// Times `launch(i)` (i counts launches from 0, so the callable can rotate buffers or routings)
// on `stream`. The callable only enqueues work on `stream`; nothing may synchronise inside it.
template <class Launch>
Timing time_launches(Launch&& launch, cudaStream_t stream, const TimingOptions& opt = {}) {
  cudaEvent_t start, stop;
  LUTB_BENCH_CHECK(cudaEventCreate(&start));
  LUTB_BENCH_CHECK(cudaEventCreate(&stop));
  std::int64_t i = 0;
  for (int w = 0; w < opt.warmup; ++w) launch(i++);
  LUTB_BENCH_CHECK(cudaGetLastError());
  LUTB_BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> per_launch_us;
  for (int b = 0; b < opt.batches; ++b) {
    LUTB_BENCH_CHECK(cudaEventRecord(start, stream));
    for (int it = 0; it < opt.iters; ++it) launch(i++);
    LUTB_BENCH_CHECK(cudaEventRecord(stop, stream));
    LUTB_BENCH_CHECK(cudaEventSynchronize(stop));
    LUTB_BENCH_CHECK(cudaGetLastError());
    float ms = 0;
    LUTB_BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
    per_launch_us.push_back(1e3 * ms / opt.iters);
  }
  LUTB_BENCH_CHECK(cudaEventDestroy(start));
  LUTB_BENCH_CHECK(cudaEventDestroy(stop));
  std::sort(per_launch_us.begin(), per_launch_us.end());
  return {per_launch_us[per_launch_us.size() / 2], per_launch_us.front(), per_launch_us.back()};
}

// The L2 size of the current device, in bytes.
inline std::int64_t l2_bytes() {
  int dev = 0, l2 = 0;
  LUTB_BENCH_CHECK(cudaGetDevice(&dev));
  LUTB_BENCH_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  return l2;
}

// How many copies of a buffer set of `bytes_per_copy` to rotate over so that the bytes touched
// between two uses of one copy are at least `l2_factor` times the L2 size: ceil(factor * L2 /
// bytes) + 1 (the copy in use does not count), at least 2.
inline int rotation_copies(std::int64_t bytes_per_copy, double l2_factor = 4.0) {
  const double need = l2_factor * static_cast<double>(l2_bytes());
  const auto n = static_cast<int>(need / static_cast<double>(std::max<std::int64_t>(bytes_per_copy, 1))) + 2;
  return std::max(n, 2);
}

}  // namespace lutb::bench
