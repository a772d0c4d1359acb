// src/fit/lloyd.cpp: the upstream Lloyd fitters, kept as compatibility and comparison baselines.
//
//   ct-lloyd    compressed-tensors PR #801 as spec section 2.1 states it: start from the tile mean,
//               add repeatedly the value farthest from the current centres until there are 8;
//               snap to E4M3; sort; then 8 Lloyd iterations (assign to nearest, move each centre
//               to its cluster mean, an empty cluster keeps its centre, snap to E4M3, sort);
//               assign. No scale: scale byte 127.
//   multistart  vLLM PR #51880: three starts (that farthest-point start; the quantiles at ranks
//               (i + 0.5)/8; 8 evenly spaced values from min to max), each snapped, sorted and
//               followed by 16 snapped Lloyd iterations; the codebook with the lowest squared
//               error is kept (the first on ties). No scale: scale byte 127.
//
// Where upstream (PyTorch, FP32) leaves details to the framework, this file fixes them so the
// result is deterministic and machine independent: means are accumulated in double in flat tile
// order and rounded once to FP32 before snapping (PyTorch sums FP32 in a backend-dependent order);
// distances are |x - c| in double; the farthest value and the nearest centre take the first index
// on ties (torch.argmax / argmin); quantiles interpolate linearly (torch.quantile's default) at
// position q * 511 of the sorted values; evenly spaced values are min + (max - min) * i / 7.
#include <algorithm>
#include <cmath>

#include "fit/fit_internal.hpp"

namespace lutb::fit_detail {
namespace {

constexpr int K = kCodebookSize;

void snap_sort(float* c) {
  for (int j = 0; j < K; ++j) c[j] = e4m3_round(c[j]);
  std::sort(c, c + K);
}

void farthest_start(const float* x, float* c) {
  double sum = 0.0;
  for (int f = 0; f < kTileSize; ++f) sum += x[f];
  c[0] = static_cast<float>(sum / kTileSize);
  double dmin[kTileSize];
  for (int f = 0; f < kTileSize; ++f) dmin[f] = std::fabs(static_cast<double>(x[f]) - c[0]);
  for (int k = 1; k < K; ++k) {
    int best = 0;
    for (int f = 1; f < kTileSize; ++f)
      if (dmin[f] > dmin[best]) best = f;
    c[k] = x[best];
    for (int f = 0; f < kTileSize; ++f)
      dmin[f] = std::min(dmin[f], std::fabs(static_cast<double>(x[f]) - c[k]));
  }
  snap_sort(c);
}

void lloyd(const float* x, float* c, int iterations) {
  for (int it = 0; it < iterations; ++it) {
    double sum[K] = {};
    int cnt[K] = {};
    for (int f = 0; f < kTileSize; ++f) {
      const double v = x[f];
      int best = 0;
      double bd = std::fabs(v - c[0]);
      for (int j = 1; j < K; ++j) {
        const double d = std::fabs(v - c[j]);
        if (d < bd) {
          bd = d;
          best = j;
        }
      }
      sum[best] += v;
      ++cnt[best];
    }
    for (int j = 0; j < K; ++j)
      if (cnt[j] > 0) c[j] = static_cast<float>(sum[j] / cnt[j]);
    snap_sort(c);
  }
}

TileFit encode127(const float* x, const float* c) {
  std::uint8_t b[K];
  for (int j = 0; j < K; ++j) b[j] = e4m3_from_float(c[j]);
  return encode_tile(x, 127, b, K);
}

}  // namespace

TileFit fit_ct_lloyd(const float* x512) {
  float c[K];
  farthest_start(x512, c);
  lloyd(x512, c, 8);
  return encode127(x512, c);
}

TileFit fit_multistart(const float* x512) {
  float starts[3][K];
  farthest_start(x512, starts[0]);
  float s[kTileSize];
  std::memcpy(s, x512, sizeof(s));
  std::sort(s, s + kTileSize);
  for (int i = 0; i < K; ++i) {
    const double pos = (i + 0.5) / K * (kTileSize - 1);
    const int lo = static_cast<int>(std::floor(pos));
    const double fr = pos - lo;
    const int hi = std::min(lo + 1, kTileSize - 1);
    starts[1][i] = static_cast<float>(s[lo] + fr * (static_cast<double>(s[hi]) - s[lo]));
    starts[2][i] = static_cast<float>(s[0] + (static_cast<double>(s[kTileSize - 1]) - s[0]) * i / (K - 1));
  }
  snap_sort(starts[1]);
  snap_sort(starts[2]);
  int best = -1;
  double best_sse = 0.0;
  for (int k = 0; k < 3; ++k) {
    lloyd(x512, starts[k], 16);
    const double e = assign_sse(x512, starts[k], nullptr);
    if (best < 0 || e < best_sse) {
      best = k;
      best_sse = e;
    }
  }
  return encode127(x512, starts[best]);
}

}  // namespace lutb::fit_detail
