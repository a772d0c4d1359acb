// src/cuda/fit/sm80_lutb_fit_binned_dp_thread.cu: the benchmark's baseline (built only with
// -DLUTB_BENCH_BASELINES=ON; fit_internal.cuh launch_binned_dp_thread): "binned-dp" with one THREAD
// per tile (spec section 2.1), byte-identical to the CPU fitter (src/fit/binned_dp.cpp, dp.cpp,
// tile_common.cpp, fit_internal.hpp, fit.cpp) and to the default warp kernel
// (sm80_lutb_fit_binned_dp_warp.cu), which replaced it: ~19 KiB of per-thread local memory, for
// which the CUDA context reserves local memory for every resident thread (~5 GiB on an H200).
//
// An operation-for-operation port of the CPU code, one thread per tile. Every floating point
// operation that decides anything is written with an IEEE round-to-nearest intrinsic (__dadd_rn,
// __dsub_rn, __dmul_rn, __ddiv_rn, __fadd_rn, __fmul_rn), which nvcc never contracts to FMA,
// matching the CPU build's -ffp-contract=off (the file is also compiled with -fmad=false).
// Differences from the CPU code that cannot change a result (each argued where it is made):
//  - the divide-and-conquer DP uses an explicit stack instead of recursion (every node computes the
//    same minimum over the same range, whatever the order in which the nodes run);
//  - the vectorised row_costs + argmin and the scalar loop are one loop here (same values compared
//    in the same order with the same strict "<");
//  - the DP's own cost value (never used for a decision in binned-dp) is not computed;
//  - dp_refine's tables are sized for its window (2 * kWindow + 1 positions).
// Keep this file in step with src/fit: tests/cuda/fit_gpu_test.cpp compares the bytes.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/fit/fit_internal.cuh"
#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"

namespace lutb::cuda::fit_internal {
namespace {


constexpr int kN = kTileSize;  // 512
constexpr int kMinScale = 3, kMaxScale = 246;
constexpr int kBins = 32, kTail = 8, kWindow = 8, kRounds = 4;  // binned_dp.cpp
constexpr int kWin = 2 * kWindow + 1;
constexpr int kMaxPos = kBins + 2 * kTail + 2;  // binned_dp.cpp's pos[] size: the binned DP has m < kMaxPos

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("quantize_gpu: ") + what + ": " + cudaGetErrorString(e));
}

__device__ __forceinline__ double pow2(int e) {
  return __longlong_as_double(static_cast<long long>(static_cast<unsigned long long>(1023 + e) << 52));
}

// fit_internal.hpp e4m3_nearest, same bit operations.
__device__ __forceinline__ double e4m3_nearest(double mu) {
  const unsigned long long mb = static_cast<unsigned long long>(__double_as_longlong(mu));
  const unsigned long long sign = mb & 0x8000000000000000ull;
  const unsigned long long ab = mb & 0x7fffffffffffffffull;
  const double a = __longlong_as_double(static_cast<long long>(ab));
  unsigned long long nb = (ab + ((1ull << 48) - 1) + ((ab >> 49) & 1ull)) & ~((1ull << 49) - 1);
  const unsigned long long k448 = 0x407C000000000000ull;
  nb = nb > k448 ? k448 : nb;
  const double t = __dmul_rn(a, 512.0);
  const double r = __dmul_rn(__dsub_rn(__dadd_rn(t, 4503599627370496.0), 4503599627370496.0), 0.001953125);
  const unsigned long long sb = static_cast<unsigned long long>(__double_as_longlong(r));
  const unsigned long long is_sub = 0ull - static_cast<unsigned long long>(ab < 0x3F90000000000000ull);
  return __longlong_as_double(static_cast<long long>(((sb & is_sub) | (nb & ~is_sub)) | sign));
}

__device__ __forceinline__ std::uint8_t e4m3_byte_exact(double v) {
  if (v == 0.0) return 0x00;
  return e4m3_from_float(__double2float_rn(v));
}

// Per-thread working set (local memory, ~16 KiB). SortedTile without u[] (only its two ends are
// read, for amax); the binned DP's tables at the bin edges only (m < kMaxPos); the refinement reads
// the prefix sums directly and scales them on the fly (the same products dp_refine precomputes).
// The sort scratch is dead once the prefix sums exist, so it shares storage with the DP tables.
struct Work {
  int n;
  float amax;
  int cnt[kN + 1];
  double p1[kN + 1];
  double p2[kN + 1];
  union {
    struct {
      std::uint32_t keys[kN];
      std::uint32_t tmp[kN];
      std::uint16_t hist[4][256];
    } sort;
    struct {
      double cd[kMaxPos];
      double s1[kMaxPos];
      double s2[kMaxPos];
      double buf[2][kMaxPos];
      std::int16_t opt[kCodebookSize][kMaxPos];
    };
  };
};

struct DpRes {
  int n_entries;
  std::uint8_t entries[kCodebookSize];
  int bounds[kCodebookSize + 1];
};

__device__ __forceinline__ std::uint32_t sort_key(float x) {
  const std::uint32_t u = f32_bits(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_key(std::uint32_t k) {
  return f32_from_bits((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Any correct sort of the keys gives the same array; this is tile_common.cpp's LSD radix sort.
__device__ void radix_sort512(Work& w) {
  std::uint16_t(&hist)[4][256] = w.sort.hist;  // counts <= 512
  for (int p = 0; p < 4; ++p)
    for (int d = 0; d < 256; ++d) hist[p][d] = 0;
  std::uint32_t* a = w.sort.keys;
  for (int i = 0; i < kN; ++i) {
    const std::uint32_t k = a[i];
    ++hist[0][k & 0xff];
    ++hist[1][(k >> 8) & 0xff];
    ++hist[2][(k >> 16) & 0xff];
    ++hist[3][k >> 24];
  }
  std::uint32_t* src = a;
  std::uint32_t* dst = w.sort.tmp;
  for (int p = 0; p < 4; ++p) {
    const int shift = 8 * p;
    if (hist[p][(src[0] >> shift) & 0xff] == kN) continue;
    std::uint32_t sum = 0;
    for (int d = 0; d < 256; ++d) {  // exclusive prefix, in place
      const std::uint32_t h = hist[p][d];
      hist[p][d] = static_cast<std::uint16_t>(sum);
      sum += h;
    }
    for (int i = 0; i < kN; ++i) {
      const std::uint32_t k = src[i];
      dst[hist[p][(k >> shift) & 0xff]++] = k;
    }
    std::uint32_t* t = src;
    src = dst;
    dst = t;
  }
  if (src != a)
    for (int i = 0; i < kN; ++i) a[i] = src[i];
}

// tile_common.cpp build_sorted.
__device__ void build_sorted(const float* x, Work& w) {
  for (int i = 0; i < kN; ++i) w.sort.keys[i] = sort_key(x[i]);
  radix_sort512(w);
  int n = 0;
  float first = 0.0f, last = 0.0f;
  w.cnt[0] = 0;
  w.p1[0] = 0.0;
  w.p2[0] = 0.0;
  for (int i = 0; i < kN;) {
    const float xv = from_key(w.sort.keys[i]);
    int j = i + 1;
    while (j < kN && from_key(w.sort.keys[j]) == xv) ++j;  // +0 and -0 compare equal and merge
    const int c = j - i;
    const double xd = xv;
    const double cdd = static_cast<double>(c);
    const float uv = xv == 0.0f ? 0.0f : xv;
    if (n == 0) first = uv;
    last = uv;
    w.cnt[n + 1] = w.cnt[n] + c;
    w.p1[n + 1] = __dadd_rn(w.p1[n], __dmul_rn(cdd, xd));
    w.p2[n + 1] = __dadd_rn(w.p2[n], __dmul_rn(cdd, __dmul_rn(xd, xd)));
    ++n;
    i = j;
  }
  w.n = n;
  w.amax = fmaxf(fabsf(first), fabsf(last));
}

// dp.cpp Dp::cost (= LUTB_ROW_COSTS_BODY), same operation order.
__device__ __forceinline__ double cost(const Work& w, int i, int j) {
  const double cc = __dsub_rn(w.cd[j], w.cd[i]);
  const double a = __dsub_rn(w.s1[j], w.s1[i]);
  const double b = __dsub_rn(w.s2[j], w.s2[i]);
  const double mean = __ddiv_rn(a, cc);
  const double d = __dsub_rn(mean, e4m3_nearest(mean));
  return __dadd_rn(__dsub_rn(b, __dmul_rn(a, mean)), __dmul_rn(cc, __dmul_rn(d, d)));
}

// The same cost at full resolution (dp_refine): cd/s1/s2 formed on the fly exactly as dp_refine
// fills its tables (count as double, p1 * inv_scale, p2 * inv_scale^2).
__device__ __forceinline__ double cost_full(const Work& w, int i, int j, double inv, double inv2) {
  const double cc = __dsub_rn(static_cast<double>(w.cnt[j]), static_cast<double>(w.cnt[i]));
  const double a = __dsub_rn(__dmul_rn(w.p1[j], inv), __dmul_rn(w.p1[i], inv));
  const double b = __dsub_rn(__dmul_rn(w.p2[j], inv2), __dmul_rn(w.p2[i], inv2));
  const double mean = __ddiv_rn(a, cc);
  const double d = __dsub_rn(mean, e4m3_nearest(mean));
  return __dadd_rn(__dsub_rn(b, __dmul_rn(a, mean)), __dmul_rn(cc, __dmul_rn(d, d)));
}

__device__ __forceinline__ std::uint8_t entry_of_run_full(const Work& w, int i, int j, double inv) {
  const double mean = __ddiv_rn(__dsub_rn(__dmul_rn(w.p1[j], inv), __dmul_rn(w.p1[i], inv)),
                                __dsub_rn(static_cast<double>(w.cnt[j]), static_cast<double>(w.cnt[i])));
  return e4m3_byte_exact(e4m3_nearest(mean));
}

__device__ __forceinline__ std::uint8_t entry_of_run(const Work& w, int i, int j) {
  const double mean = __ddiv_rn(__dsub_rn(w.s1[j], w.s1[i]), __dsub_rn(w.cd[j], w.cd[i]));
  return e4m3_byte_exact(e4m3_nearest(mean));
}

// dp.cpp Dp::solve with an explicit stack (node order does not change any node's result: each
// node's range [lo, hi] depends only on its ancestors' results).
__device__ void dp_solve(Work& w, const double* prev, double* cur, int k, int m, const std::int16_t* lower) {
  struct Frame {
    short jlo, jhi, ilo, ihi;
  };
  Frame st[64];
  int sp = 0;
  st[sp++] = {static_cast<short>(k), static_cast<short>(m), static_cast<short>(k - 1), static_cast<short>(m - 1)};
  while (sp > 0) {
    const Frame f = st[--sp];
    if (f.jlo > f.jhi) continue;
    const int j = (f.jlo + f.jhi) >> 1;
    int lo = max(max(static_cast<int>(f.ilo), k - 1), lower ? static_cast<int>(lower[j]) : 0);
    const int hi = min(static_cast<int>(f.ihi), j - 1);
    lo = min(lo, hi);
    double best = __dadd_rn(prev[lo], cost(w, lo, j));
    int bi = lo;
    for (int i = lo + 1; i <= hi; ++i) {
      const double v = __dadd_rn(prev[i], cost(w, i, j));
      if (v < best) {
        best = v;
        bi = i;
      }
    }
    cur[j] = best;
    w.opt[k - 1][j] = static_cast<std::int16_t>(bi);
    st[sp++] = {static_cast<short>(j + 1), f.jhi, static_cast<short>(bi), f.ihi};
    st[sp++] = {f.jlo, static_cast<short>(j - 1), f.ilo, static_cast<short>(bi)};
  }
}

// dp.cpp dp_fit (without the cost value).
__device__ void dp_fit(Work& w, const int* pos, int m, int scale, DpRes& res) {
  const double inv_scale = pow2(127 - scale);
  const double inv_scale2 = __dmul_rn(inv_scale, inv_scale);
  for (int i = 0; i <= m; ++i) {
    w.cd[i] = static_cast<double>(w.cnt[pos[i]]);
    w.s1[i] = __dmul_rn(w.p1[pos[i]], inv_scale);
    w.s2[i] = __dmul_rn(w.p2[pos[i]], inv_scale2);
  }
  const int K = min(m, kCodebookSize);
  int seg_end[kCodebookSize + 1];
  if (K == m) {
    for (int i = 0; i <= m; ++i) seg_end[i] = i;
  } else {
    double* prev = w.buf[0];
    double* cur = w.buf[1];
    for (int j = 1; j <= m; ++j) prev[j] = cost(w, 0, j);
    for (int k = 2; k < K; ++k) {
      dp_solve(w, prev, cur, k, m, k > 2 ? w.opt[k - 2] : nullptr);
      double* t = prev;
      prev = cur;
      cur = t;
    }
    double best = __longlong_as_double(0x7ff0000000000000ll);
    int bi = K - 1;
    for (int i = K > 2 ? w.opt[K - 2][m] : K - 1; i < m; ++i) {
      const double v = __dadd_rn(prev[i], cost(w, i, m));
      if (v < best) {
        best = v;
        bi = i;
      }
    }
    seg_end[K] = m;
    seg_end[K - 1] = bi;
    for (int k = K - 1; k >= 2; --k) seg_end[k - 1] = w.opt[k - 1][seg_end[k]];
    seg_end[0] = 0;
  }
  res.n_entries = K;
  for (int k = 0; k <= K; ++k) res.bounds[k] = pos[seg_end[k]];
  for (int k = 0; k < K; ++k) res.entries[k] = entry_of_run(w, seg_end[k], seg_end[k + 1]);
}

// dp.cpp dp_refine with w = kWindow, rounds = kRounds.
__device__ void dp_refine(Work& w, int scale, DpRes& res) {
  const int K = res.n_entries;
  const int m = w.n;
  if (K < 2 || K >= m) return;
  const double inv_scale = pow2(127 - scale);
  const double inv_scale2 = __dmul_rn(inv_scale, inv_scale);
  int* b = res.bounds;
  double F[kCodebookSize + 1][kWin];
  std::int16_t arg[kCodebookSize + 1][kWin];
  constexpr int kSettledWindow = 3;  // dp.cpp: later rounds narrow the boundaries that settled
  int wk[kCodebookSize];             // window half-width per boundary (<= kWindow: tables fit)
  for (int k = 1; k < K; ++k) wk[k] = kWindow;
  for (int round = 0; round < kRounds; ++round) {
    int lo[kCodebookSize], hi[kCodebookSize];
    for (int k = 1; k < K; ++k) {
      lo[k] = max(b[k] - wk[k], k);
      hi[k] = min(b[k] + wk[k], m - (K - k));
    }
    for (int j = lo[1]; j <= hi[1]; ++j) F[1][j - lo[1]] = cost_full(w, 0, j, inv_scale, inv_scale2);
    for (int k = 2; k <= K; ++k) {
      const int jl = k < K ? lo[k] : m, jh = k < K ? hi[k] : m;
      const int pl = lo[k - 1];
      for (int j = jl; j <= jh; ++j) {
        const int il = pl, ih = min(hi[k - 1], j - 1);
        double best = __longlong_as_double(0x7ff0000000000000ll);
        int bi = il;
        for (int i = il; i <= ih; ++i) {
          const double v = __dadd_rn(F[k - 1][i - pl], cost_full(w, i, j, inv_scale, inv_scale2));
          if (v < best) {
            best = v;
            bi = i;
          }
        }
        F[k][j - jl] = best;
        arg[k][j - jl] = static_cast<std::int16_t>(bi);
      }
    }
    int nb[kCodebookSize + 1];
    nb[K] = m;
    nb[0] = 0;
    for (int k = K; k >= 2; --k) nb[k - 1] = arg[k][nb[k] - (k < K ? lo[k] : m)];
    bool edge = false;
    for (int k = 1; k < K; ++k) {
      const bool e = (nb[k] == lo[k] && lo[k] > k) || (nb[k] == hi[k] && hi[k] < m - (K - k));
      edge = edge || e;
      wk[k] = e ? kWindow : kSettledWindow;
      b[k] = nb[k];
    }
    if (!edge) break;
  }
  for (int k = 0; k < K; ++k) res.entries[k] = entry_of_run_full(w, b[k], b[k + 1], inv_scale);
}

// tile_common.cpp assign_sse + encode_tile; writes the block and the two sums.
__device__ void encode_tile(const float* x, int scale, const std::uint8_t* entries, int n_entries,
                            std::uint8_t* packed, std::uint8_t* codebook, std::uint8_t* scale_out, double* sse_out,
                            double* ssq_out) {
  float vals[kCodebookSize];
  std::uint8_t bytes[kCodebookSize];
  int m = 0;
  for (int i = 0; i < n_entries; ++i) {
    std::uint8_t bb = entries[i];
    if (bb == 0x80) bb = 0x00;
    const float v = e4m3_to_float(bb);
    bool dup = false;
    for (int j = 0; j < m; ++j) dup = dup || bytes[j] == bb;
    if (dup) continue;
    int p = m;
    while (p > 0 && vals[p - 1] > v) {
      vals[p] = vals[p - 1];
      bytes[p] = bytes[p - 1];
      --p;
    }
    vals[p] = v;
    bytes[p] = bb;
    ++m;
  }
  if (m == 0) {
    vals[0] = 0.0f;
    bytes[0] = 0x00;
    m = 1;
  }
  for (int j = m; j < kCodebookSize; ++j) {
    vals[j] = vals[m - 1];
    bytes[j] = bytes[m - 1];
  }
  float cb[kCodebookSize];
  for (int j = 0; j < kCodebookSize; ++j) cb[j] = ldexp_ue8m0(vals[j], static_cast<std::uint8_t>(scale));
  // assign_sse
  float mid[kCodebookSize];
  std::uint8_t pos[kCodebookSize];
  float val[kCodebookSize];
  int runs = 0;
  for (int j = 0; j < kCodebookSize; ++j) {
    if (runs == 0 || cb[j] != val[runs - 1]) {
      val[runs] = cb[j];
      pos[runs] = static_cast<std::uint8_t>(j);
      if (runs > 0) mid[runs - 1] = __fadd_rn(__fmul_rn(0.5f, val[runs - 1]), __fmul_rn(0.5f, cb[j]));
      ++runs;
    }
  }
  for (int k = runs - 1; k < kCodebookSize; ++k) mid[k] = __int_as_float(0x7f800000);
  double sse = 0.0, ss = 0.0;
  for (int g = 0; g < kN / 8; ++g) {
    std::uint8_t idx[8];
    for (int q = 0; q < 8; ++q) {
      const float xv = x[8 * g + q];
      int r = 0;
      for (int k = 0; k < kCodebookSize - 1; ++k) r += xv > mid[k] ? 1 : 0;
      idx[q] = pos[r];
      const double d = __dsub_rn(static_cast<double>(xv), static_cast<double>(val[r]));
      sse = __dadd_rn(sse, __dmul_rn(d, d));
    }
    std::uint8_t o[3];
    pack8(idx, o);
    packed[3 * g] = o[0];
    packed[3 * g + 1] = o[1];
    packed[3 * g + 2] = o[2];
  }
  for (int f = 0; f < kN; ++f) {
    const double xd = static_cast<double>(x[f]);
    ss = __dadd_rn(ss, __dmul_rn(xd, xd));
  }
  for (int j = 0; j < kCodebookSize; ++j) codebook[j] = bytes[j];
  *scale_out = static_cast<std::uint8_t>(scale);
  if (sse_out) *sse_out = sse;
  if (ssq_out) *ssq_out = ss;
}

// binned_dp.cpp fit_binned_dp.
__device__ void fit_binned_dp(const float* x, int forced_scale, Work& w, std::uint8_t* packed, std::uint8_t* codebook,
                              std::uint8_t* scale_out, double* sse, double* ssq) {
  build_sorted(x, w);
  int pos[kMaxPos];
  int m = 0;
  const int n = w.n;
  if (n <= kBins) {
    for (int i = 0; i <= n; ++i) pos[i] = i;
    m = n;
  } else {
    pos[0] = 0;
    int i = 0;
#define LUTB_PUSH(e)                        \
  do {                                      \
    const int e_ = (e);                     \
    if (e_ > pos[m] && e_ < n) pos[++m] = e_; \
  } while (0)
    while (i < n && w.cnt[i] < kTail) {
      LUTB_PUSH(i);
      ++i;
    }
    for (int bb = 1; bb < kBins; ++bb) {
      const int target = bb * (kN / kBins);
      while (i < n && w.cnt[i] < target) ++i;
      LUTB_PUSH(i);
    }
    while (i < n && w.cnt[i] <= kN - kTail) ++i;
    while (i < n) {
      LUTB_PUSH(i);
      ++i;
    }
#undef LUTB_PUSH
    pos[++m] = n;
  }
  const bool exact = m == n;
  int s;
  if (forced_scale >= 0) {
    s = forced_scale;
  } else if (w.amax == 0.0f) {
    const std::uint8_t zero = 0x00;
    encode_tile(x, 127, &zero, 1, packed, codebook, scale_out, sse, ssq);
    return;
  } else {
    s = max(static_cast<int>(ue8m0_rceil(w.amax)), kMinScale);
  }
  DpRes r;
  dp_fit(w, pos, m, s, r);
  if (!exact) dp_refine(w, s, r);
  encode_tile(x, s, r.entries, r.n_entries, packed, codebook, scale_out, sse, ssq);
}

__device__ __forceinline__ float load(const void* src, int dtype, std::int64_t i) {
  if (dtype == 0) return static_cast<const float*>(src)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(src)[i];
  return dtype == 1 ? bf16_to_float(h) : fp16_to_float(h);
}

__global__ void __launch_bounds__(64) sm80_lutb_fit_binned_dp_thread(KernelArgs a) {
  const std::int64_t lt = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (lt >= a.tiles) return;
  const std::int64_t tpe = a.tiles_n * a.tiles_k;
  const std::int64_t e = lt / tpe, tn = (lt % tpe) / a.tiles_k, tk = lt % a.tiles_k;
  float x[kN];
  // gather_tile: rows beyond `rows` and columns beyond `cols` are zero.
  const std::int64_t ebase = e * a.rows * a.cols;
  for (int r = 0; r < kTileRows; ++r) {
    const std::int64_t row = tn * kTileRows + r, c0 = tk * kTileCols;
    std::int64_t nc = row < a.rows ? a.cols - c0 : 0;
    nc = nc < 0 ? 0 : (nc > kTileCols ? kTileCols : nc);
    for (int c = 0; c < kTileCols; ++c)
      x[r * kTileCols + c] = c < nc ? load(a.src, a.dtype, ebase + row * a.cols + c0 + c) : 0.0f;
  }
  // fit.cpp check_tile.
  float amax = 0.0f;
  int code = 0, where = 0;
  for (int f = 0; f < kN; ++f) {
    const float v = x[f];
    if (!f32_is_finite(v)) {
      code = f32_is_nan(v) ? 1 : (v > 0 ? 2 : 3);
      where = f;
      break;
    }
    amax = fmaxf(amax, fabsf(v));
  }
  if (code == 0 && amax != 0.0f && static_cast<int>(ue8m0_rceil(amax)) > kMaxScale) code = 4;
  if (code != 0) {
    const unsigned long long word = (static_cast<unsigned long long>(a.t_base + lt) << 12) |
                                    (static_cast<unsigned long long>(code) << 9) | static_cast<unsigned long long>(where);
    atomicMin(a.err, word);
    return;
  }
  Work w;
  fit_binned_dp(x, a.forced_scale, w, a.out.packed + lt * kPackedBytes, a.out.codebook + lt * kCodebookSize,
                a.out.scale + lt, a.out.sse ? a.out.sse + lt : nullptr, a.out.sum_sq ? a.out.sum_sq + lt : nullptr);
}
}  // namespace

void launch_binned_dp_thread(const KernelArgs& a, cudaStream_t stream) {
  if (a.tiles == 0) return;
  if (a.optimal) throw std::invalid_argument("launch_binned_dp_thread: the thread kernel implements binned-dp only");
  constexpr int kBlock = 64;
  const std::int64_t blocks = (a.tiles + kBlock - 1) / kBlock;
  sm80_lutb_fit_binned_dp_thread<<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(a);
  ok(cudaGetLastError(), "kernel launch");
}

}  // namespace lutb::cuda::fit_internal
