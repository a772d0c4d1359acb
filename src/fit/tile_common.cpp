// src/fit/tile_common.cpp: sorting, exact nearest-entry assignment and the final encoding shared by
// every fitter (spec section 2.1: nearest entry on the exact dequantised values, ties to the lower
// index; codebooks ascending).
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "fit/fit_internal.hpp"

namespace lutb::fit_detail {

namespace {

// LSD radix sort of 512 keys, 8-bit digits; passes whose digit is the same for all keys are skipped.
void radix_sort512(std::uint32_t* a) {
  std::uint32_t hist[4][256] = {};
  for (int i = 0; i < kTileSize; ++i) {
    const std::uint32_t k = a[i];
    ++hist[0][k & 0xff];
    ++hist[1][(k >> 8) & 0xff];
    ++hist[2][(k >> 16) & 0xff];
    ++hist[3][k >> 24];
  }
  std::uint32_t tmp[kTileSize];
  std::uint32_t* src = a;
  std::uint32_t* dst = tmp;
  for (int p = 0; p < 4; ++p) {
    const int shift = 8 * p;
    if (hist[p][(src[0] >> shift) & 0xff] == kTileSize) continue;  // all keys share this digit
    std::uint32_t off[256];
    std::uint32_t sum = 0;
    for (int d = 0; d < 256; ++d) {
      off[d] = sum;
      sum += hist[p][d];
    }
    for (int i = 0; i < kTileSize; ++i) {
      const std::uint32_t k = src[i];
      dst[off[(k >> shift) & 0xff]++] = k;
    }
    std::swap(src, dst);
  }
  if (src != a) std::memcpy(a, src, sizeof(tmp));
}

// build_sorted with weights: positions sorted by (value, flat index), so the weights of equal
// values are summed in flat order; each distinct value x of total weight W adds W*x and W*x^2, as
// the unweighted path adds c*x and c*x^2.
void build_sorted_weighted(const float* x512, const float* w512, SortedTile& st) {
  std::uint64_t keys[kTileSize];
  for (int i = 0; i < kTileSize; ++i)
    keys[i] = (static_cast<std::uint64_t>(sort_key(x512[i] == 0.0f ? 0.0f : x512[i])) << 32) | static_cast<unsigned>(i);
  std::sort(keys, keys + kTileSize);
  int n = 0;
  st.cnt[0] = 0;
  st.wc[0] = 0.0;
  st.p1[0] = 0.0;
  st.p2[0] = 0.0;
  for (int i = 0; i < kTileSize;) {
    const std::uint32_t k = static_cast<std::uint32_t>(keys[i] >> 32);
    const float x = from_key(k);
    double wsum = 0.0;
    int j = i;
    for (; j < kTileSize && static_cast<std::uint32_t>(keys[j] >> 32) == k; ++j)
      wsum += w512[keys[j] & 0xffffffffu];
    const double xd = x;
    st.u[n] = x;
    st.cnt[n + 1] = st.cnt[n] + (j - i);
    st.wc[n + 1] = st.wc[n] + wsum;
    st.p1[n + 1] = st.p1[n] + wsum * xd;
    st.p2[n + 1] = st.p2[n] + wsum * (xd * xd);
    ++n;
    i = j;
  }
  st.n = n;
  st.amax = std::max(std::fabs(st.u[0]), std::fabs(st.u[n - 1]));
}

}  // namespace

void build_sorted(const float* x512, const float* w512, SortedTile& st) {
  if (w512) return build_sorted_weighted(x512, w512, st);
  std::uint32_t keys[kTileSize];
  for (int i = 0; i < kTileSize; ++i) keys[i] = sort_key(x512[i]);
  radix_sort512(keys);
  float v[kTileSize + 1];
  for (int i = 0; i < kTileSize; ++i) v[i] = from_key(keys[i]);
  v[kTileSize] = INFINITY;  // sentinel (values are finite)
  int n = 0;
  st.cnt[0] = 0;
  st.wc[0] = 0.0;
  st.p1[0] = 0.0;
  st.p2[0] = 0.0;
  for (int i = 0; i < kTileSize;) {
    const float x = v[i];
    int j = i + 1;
    while (v[j] == x) ++j;  // +0 and -0 compare equal and merge
    const int c = j - i;
    const double xd = x;
    st.u[n] = x == 0.0f ? 0.0f : x;
    st.cnt[n + 1] = st.cnt[n] + c;
    st.wc[n + 1] = st.cnt[n + 1];
    st.p1[n + 1] = st.p1[n] + c * xd;
    st.p2[n + 1] = st.p2[n] + c * (xd * xd);
    ++n;
    i = j;
  }
  st.n = n;
  st.amax = std::max(std::fabs(st.u[0]), std::fabs(st.u[n - 1]));
}

double assign_sse(const float* x512, const float* cb, std::uint8_t* idx512) {
  // Distinct runs of the ascending codebook: value u_r, first index pos_r. A value goes to run r
  // when it is strictly above the midpoint between u_{r-1} and u_r (strictly closer to u_r), so
  // an exact tie stays with the lower index. The midpoint 0.5*u_{r-1} + 0.5*u_r of two
  // E4M3 * 2^(s-127) values (s = 3..246) is exact in FP32: each half is a multiple of 2^-134 and
  // the sum needs at most 21 significant bits and stays below 448 * 2^119.
  float mid[kCodebookSize];
  std::uint8_t pos[kCodebookSize];
  float val[kCodebookSize];
  int runs = 0;
  for (int j = 0; j < kCodebookSize; ++j) {
    if (runs == 0 || cb[j] != val[runs - 1]) {
      val[runs] = cb[j];
      pos[runs] = static_cast<std::uint8_t>(j);
      if (runs > 0) mid[runs - 1] = 0.5f * val[runs - 1] + 0.5f * cb[j];
      ++runs;
    }
  }
  for (int k = runs - 1; k < kCodebookSize; ++k) mid[k] = INFINITY;  // unused thresholds
  // Run index of every value: count of midpoints strictly below it (branch-free, vectorised).
  std::uint8_t run[kTileSize];
  for (int f = 0; f < kTileSize; ++f) {
    const float x = x512[f];
    int r = 0;
    for (int k = 0; k < kCodebookSize - 1; ++k) r += x > mid[k] ? 1 : 0;
    run[f] = static_cast<std::uint8_t>(r);
  }
  double sse = 0.0;
  for (int f = 0; f < kTileSize; ++f) {
    const double d = static_cast<double>(x512[f]) - val[run[f]];
    sse += d * d;
  }
  if (idx512)
    for (int f = 0; f < kTileSize; ++f) idx512[f] = pos[run[f]];
  return sse;
}

TileFit encode_tile(const float* x512, int scale, const std::uint8_t* entries, int n_entries, const float* w512) {
  // At most kCodebookSize distinct entries fit the codebook (every fitter hands over <= 8; the bound
  // also lets the compiler see that m stays in 1..8 below).
  if (n_entries < 0 || n_entries > kCodebookSize)
    throw std::invalid_argument("encode_tile: " + std::to_string(n_entries) + " codebook entries, at most " +
                                std::to_string(kCodebookSize));
  TileFit out;
  float vals[kCodebookSize];
  std::uint8_t bytes[kCodebookSize];
  int m = 0;
  for (int i = 0; i < n_entries; ++i) {
    std::uint8_t b = entries[i];
    if (b == 0x80) b = 0x00;  // write zero as +0
    const float v = e4m3_to_float(b);
    bool dup = false;
    for (int j = 0; j < m; ++j) dup = dup || bytes[j] == b;
    if (dup) continue;
    // insertion sort by value
    int p = m;
    while (p > 0 && vals[p - 1] > v) {
      vals[p] = vals[p - 1];
      bytes[p] = bytes[p - 1];
      --p;
    }
    vals[p] = v;
    bytes[p] = b;
    ++m;
  }
  if (m == 0) {
    vals[0] = 0.0f;
    bytes[0] = 0x00;
    m = 1;
  }
  // m is in 1..kCodebookSize here; the clamp says so to the compiler (the GPU machine's g++ warned
  // -Wstringop-overflow on bytes[m - 1] with m's range unknown).
  const int last = std::clamp(m, 1, kCodebookSize) - 1;
  for (int j = last + 1; j < kCodebookSize; ++j) {
    vals[j] = vals[last];
    bytes[j] = bytes[last];
  }
  float deq[kCodebookSize];
  for (int j = 0; j < kCodebookSize; ++j) deq[j] = ldexp_ue8m0(vals[j], static_cast<std::uint8_t>(scale));
  std::uint8_t idx[kTileSize];
  out.sse = assign_sse(x512, deq, idx);
  out.weighted_sse = out.sse;
  if (w512) {
    double wsse = 0.0;
    for (int f = 0; f < kTileSize; ++f) {
      const double d = static_cast<double>(x512[f]) - deq[idx[f]];
      wsse += w512[f] * (d * d);
    }
    out.weighted_sse = wsse;
  }
  double ss = 0.0;
  for (int f = 0; f < kTileSize; ++f) ss += static_cast<double>(x512[f]) * x512[f];
  out.sum_sq = ss;
  for (int g = 0; g < kTileSize / 8; ++g) pack8(idx + 8 * g, out.block.packed + 3 * g);
  std::memcpy(out.block.codebook, bytes, kCodebookSize);
  out.block.scale = static_cast<std::uint8_t>(scale);
  return out;
}

}  // namespace lutb::fit_detail
