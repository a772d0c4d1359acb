// src/cuda/fit/sm80_lutb_fit_warp.cuh: the per-tile device code of the GPU fitters "binned-dp"
// (the default) and "optimal" (spec section 2.1): one WARP per 8x64 tile, byte-identical to the CPU
// fitters (src/fit/binned_dp.cpp, optimal.cpp, dp.cpp, tile_common.cpp). Included by the two kernel
// files, each instantiating it for one fitter (`Opt`): sm80_lutb_fit_binned_dp_warp.cu and
// sm80_lutb_fit_optimal_warp.cu, and by the tile-check kernel (sm80_lutb_fit_check_tiles.cu: load
// and check only). Both fitters share the load and check, the sort and de-duplication, the prefix
// sums, the DP layers, the encoding; binned-dp adds the bin edges and the refinement, optimal runs
// the DP over every distinct value (identity positions, m = n <= 512) and optimal.cpp's scale
// search. The phases, in the order fit_one runs them, are described in docs/design/cuda-fit.md.
//
// The scalar arithmetic that decides bytes (run cost, nearest E4M3 value, entry of a run, sort
// keys, 2^e) is src/fit/fit_scalar.hpp and fit_scalar_fast.hpp, the functions the CPU fitter calls
// or their proven bit-equal forms; the files including this one are compiled with -fmad=false
// (CMakeLists.txt) as src/fit is with -ffp-contract=off, so every add/multiply/divide rounds as on
// the CPU. What is parallel here, and why each part gives the CPU's bits:
//  - sort: cub::WarpMergeSort of the 512 keys (16 per lane). Any correct sort gives the same array.
//  - de-duplication: head flags + a warp scan (integers). The prefix sums of x and x^2 are double
//    running sums whose rounding depends on the order, so they stay SEQUENTIAL in the CPU's order
//    (lane 0 sums x, lane 1 sums x^2 at the same time).
//  - bin edges (binned-dp): the CPU's "advance i while cnt[i] < target" loops are
//    max(i, lower_bound(target)) because cnt is increasing; each lane binary-searches one target,
//    lane 0 replays the pushes.
//  - DP layers: dp.cpp's divide and conquer computes, for each end position j (one tree node), the
//    leftmost minimum of prev[i] + cost(i, j) over a range that depends only on the node's
//    ancestors. dp_layer runs the nodes of one tree level together (a group of lanes per node, the
//    group combining by (smaller value, then lower index), which is the leftmost minimum the CPU's
//    strict "<" scan finds; no NaN can occur: every run is non-empty). Binned-dp first computes
//    every end position's minimum over its full start range at once (dp_layer_chunk) and keeps it
//    when the minima are monotone in j, where they provably equal the divide and conquer's; else
//    the layer is recomputed by dp_layer. Optimal (up to 512 positions) runs dp_layer directly.
//  - refinement (binned-dp, dp_refine): the window costs of one layer are computed by all lanes
//    into a table, then one lane per end position scans it in the CPU's order with its strict "<".
//  - scale search (optimal, optimal.cpp search_scales): serial over scales as on the CPU; the
//    saturation bound is lane 0's loop in the CPU's order; each candidate's error is the encoding's
//    flat-order double sum, and a candidate's bytes are written only when its error is strictly
//    below the best so far (the first one always), so the last write is the CPU's choice.
//  - encoding: each lane assigns its 16 values (the CPU's midpoint rule, ties to the lower index);
//    the per-tile sse and sum of squares are double sums in flat order, so they are accumulated in
//    exactly that order (lane 0 and lane 1 at once), and only when needed.
// Weighted fit (FitOptions::column_weights; the kernels' template parameter W, so the unweighted
// kernels are the code above unchanged): the tile's 64 column weights are read with it
// (tile_weights_warp: fit.cpp gather_weights and check_weights); the sort carries each value's weight
// and is stable, so equal values keep their flat order and their weights are summed in that order,
// as build_sorted_weighted sums them (one lane per distinct value: the sums are independent); the
// prefix arrays are the weight, sum w x and sum w x^2 (three sequential running sums); the run cost
// is fit_scalar.hpp run_cost itself (an IEEE division by the run's weight: the table of RN(1/count)
// covers integer counts only); optimal's saturation bound and scale choice use the weighted error
// (a third flat-order sum). A tile whose 64 weights are all equal runs the same code with unit
// weights: every weight sum is then the exact count and every weighted error the plain one, the
// unweighted fitter's values bit for bit, as fit.cpp fits such a tile unweighted.
// Keep in step with src/fit: tests/cuda/fit_gpu_test.cpp compares the bytes with the CPU's.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/warp/warp_merge_sort.cuh>
#include <type_traits>

#include "cuda/fit/fit_internal.cuh"
#include "cuda/heuristics/fit.hpp"
#include "fit/fit_scalar.hpp"
#include "fit/fit_scalar_fast.hpp"
#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"

namespace lutb::cuda::fit_internal {
namespace {

using fit_detail::CountRecip;
using fit_detail::from_key;
using fit_detail::pow2;
using fit_detail::run_cost;
using fit_detail::run_cost_fast;
using fit_detail::run_entry;
using fit_detail::sort_key;

constexpr unsigned kFull = 0xffffffffu;
constexpr int kN = kTileSize;  // 512
constexpr int kIpt = kN / 32;  // values per lane
constexpr int kMinScale = 3, kMaxScale = 246;
constexpr int kBins = 32, kTail = 8, kWindow = 8, kRounds = 4, kSettled = 3;  // binned_dp.cpp, dp.cpp
constexpr int kWin = 2 * kWindow + 1;
constexpr int kMaxPos = kBins + 2 * kTail + 2;  // binned_dp.cpp's pos[] size: m < kMaxPos
constexpr int kOptRows = kCodebookSize - 2;     // opt rows of layers 2..7 (row k - 2)

// Cost evaluations issued together in the DP scans (scan_min), per fitter.
template <bool Opt>
inline constexpr int kUnroll = Opt ? heuristics::kFitOptimalDpUnroll : heuristics::kFitBinnedDpDpUnroll;

// The table of (count, RN(1/count)) for div_by_count, count = 0..512 (row 0 unused), read through
// the read-only data cache: the same literals as the host's fit_detail::kCountRecip.
__device__ const CountRecip g_count_recip[fit_detail::kMaxCount + 1] = {
    {0.0, 0.0},
#define X(c, y) {static_cast<double>(c), y},
    LUTB_COUNT_RECIP_LIST
#undef X
};

// fit_scalar.hpp run_cost(c, a, b) for the run count c >= 1, with the bits of run_cost (proofs and
// CPU tests: src/fit/fit_scalar_fast.hpp, tests/fit/fit_scalar_fast_test.cpp): the division by the
// count from the table of RN(1/count) and an FMA correction (div_by_count), e4m3_nearest_fast.
// a and b are the run's sums already scaled to the tile's scale: the prefix sums are scaled in place
// once per scale (prescale) instead of both ends of every run in every evaluation.
__device__ __forceinline__ double cost_of(int c, double a, double b) {
  const double2 t = __ldg(reinterpret_cast<const double2*>(g_count_recip) + c);
  return run_cost_fast(t.x, t.y, a, b);
}

// The kernels' arguments: a view (KernelArgs), and its column weights for the weighted fit (W).
template <bool W>
using FitArgs = std::conditional_t<W, WeightedKernelArgs, KernelArgs>;

using WarpSort = cub::WarpMergeSort<std::uint32_t, kIpt, 32>;
// The weighted sort: keys with each value's weight as the item. StableSort keeps equal keys in their
// input (flat) order.
using WarpSortWeighted = cub::WarpMergeSort<std::uint32_t, kIpt, 32, float>;
struct KeyLess {
  __device__ bool operator()(std::uint32_t a, std::uint32_t b) const { return a < b; }
};

// A node of dp.cpp's divide and conquer: end positions [jlo, jhi], start range [ilo, ihi].
struct Node {
  short jlo, jhi, ilo, ihi;
};

// dp_layer_chunk's scratch: per end position j, i = e + rb[j] for the layer's flat pair index e,
// and the flat index of row j's first pair. At most sum_{j=2..49} (j - 1) = 1176 pairs a layer
// (m <= 49).
struct ChunkScratch {
  std::int16_t rb[kMaxPos];
  std::int16_t roff[kMaxPos];
};

// DP tables. binned-dp: prefix sums at the bin edges (scaled units), as dp.cpp's Dp. optimal: the
// positions are the distinct values themselves, so the costs read the (prescaled) prefix sums
// directly, which saves 12 KiB per warp.
template <bool Opt>
struct DpTables {
  double cd[kMaxPos], s1[kMaxPos], s2[kMaxPos];
  std::int16_t ci[kMaxPos];  // the counts at the bin edges as integers (cd's values), the table's index
  double buf[2][kMaxPos];
  std::int16_t opt[kOptRows][kMaxPos];
  Node nodes[2][32];  // the nodes of one tree level (at most 32: m - 1 <= 48 end positions)
  ChunkScratch chunk;  // dp_layer_chunk
};
template <>
struct DpTables<true> {
  double buf[2][kN + 1];  // (also the encoding's scratch for the flat-order sums: Smem::enc)
  std::int16_t opt[kOptRows][kN + 1];
  Node nodes[2][32];  // the nodes of one tree level while it has at most 32
};

// What the weighted kernels add per warp (nothing for the unweighted ones: an empty base).
template <bool W>
struct SmemWeights {};
template <>
struct SmemWeights<true> {
  double wc[kN + 1];      // prefix weights over the distinct values (SortedTile::wc)
  float cw[kTileCols];    // the tile's column weights (all 1 when they are all equal)
};

// Per-warp shared memory (binned-dp ~13.7 KiB, optimal ~26 KiB; weighted (W) 4.3 KiB more). The
// union members are used one after the other.
template <bool Opt, bool W = false>
struct Smem : SmemWeights<W> {
  static constexpr bool kWeighted = W;
  union {
    WarpSort::TempStorage sort;
    WarpSortWeighted::TempStorage sort_weighted;
    float u[Opt ? 1 : kN];  // binned-dp: distinct values, ascending (+0 for zero); dead after the prefix sums
    DpTables<Opt> dp;
    struct {
      double F[kCodebookSize + 1][kWin];
      double V[kWin][kWin];  // V[j - jl][i - il] = F[k-1][i - il] + cost(i, j)
      std::int16_t arg[kCodebookSize + 1][kWin];
    } rf;
    // optimal: the encoding's flat-order sums (sse, sum of squares, weighted error) over dp.buf
    // (rows 0, 1) and dp.opt (row 2), dead by then.
    double enc[Opt ? 3 : 1][Opt ? kN + 1 : 1];
  };
  float su[Opt ? kN : 1];       // optimal: distinct values, kept for the saturation bound
  double p[2][kN + 1];          // prefix sums of x and x^2 (unscaled), over distinct values
  std::uint16_t cnt[kN + 1];    // prefix counts
  int pos[Opt ? 1 : kMaxPos];   // bin edges
  int lb[32];                   // lower bounds of the bin targets
  int seg[kCodebookSize + 1];   // DP boundaries (indices into pos)
  int bounds[kCodebookSize + 1];  // boundaries at full resolution
  int lo[kCodebookSize], hi[kCodebookSize], wk[kCodebookSize];
  float cbv[kCodebookSize];
  std::uint8_t entries[kCodebookSize];
  std::uint8_t cbb[kCodebookSize];
  double cost;  // the DP's minimum (optimal.cpp's d.cost), unscaled
  int m, K, edge;

  __device__ float* uv() {
    if constexpr (Opt) return su;
    else return u;
  }
  // Scratch for the encoding's two flat-order sums: the prefix sums are dead by then in
  // binned-dp; optimal needs them for the next scale, and uses the DP tables instead (enc, whose
  // row 2 holds the weighted error's terms).
  __device__ double (*scratch())[kN + 1] {
    if constexpr (Opt) return enc;
    else return p;
  }
};

__device__ __forceinline__ double inf() { return __longlong_as_double(0x7ff0000000000000ll); }

__device__ __forceinline__ void keep_min(double& bv, int& bi, double ov, int oi) {
  if (ov < bv || (ov == bv && oi < bi)) {
    bv = ov;
    bi = oi;
  }
}

// Leftmost minimum over groups of `gs` lanes (gs a power of two, groups aligned).
__device__ __forceinline__ void group_argmin(double& bv, int& bi, int gs) {
  for (int off = gs >> 1; off > 0; off >>= 1) {
    const double ov = __shfl_xor_sync(kFull, bv, off);
    const int oi = __shfl_xor_sync(kFull, bi, off);
    keep_min(bv, bi, ov, oi);
  }
}

// In place: P[0] = 0, P[d] = P[d-1] + P[d] for d = 1..n (a double running sum, in order).
__device__ __forceinline__ void running_sum(double* P, int n) {
  P[0] = 0.0;
  double acc = 0.0;
  int d = 1;
  for (; d + 7 <= n; d += 8) {
    double t[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) t[r] = P[d + r];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      acc = acc + t[r];
      P[d + r] = acc;
    }
  }
  for (; d <= n; ++d) {
    acc = acc + P[d];
    P[d] = acc;
  }
}

// dp.cpp Dp::cost on the bin-edge tables (the count cd[j] - cd[i] is the exact integer
// ci[j] - ci[i], the table's index). Weighted: cd holds the prefix weights, and the cost is
// run_cost's own IEEE division by the run's weight.
template <bool W>
__device__ __forceinline__ double cost_bin(const Smem<false, W>& s, int i, int j) {
  if constexpr (W) return run_cost(s.dp.cd[j] - s.dp.cd[i], s.dp.s1[j] - s.dp.s1[i], s.dp.s2[j] - s.dp.s2[i]);
  else return cost_of(s.dp.ci[j] - s.dp.ci[i], s.dp.s1[j] - s.dp.s1[i], s.dp.s2[j] - s.dp.s2[i]);
}
// dp.cpp's cost over every distinct value (dp_fit with identity positions, dp_refine), on the
// prefix sums scaled in place (prescale): dp.cpp's tables (p1 * inv, p2 * inv2) bit for bit; the
// count is st.wc's (the prefix weights when weighted).
template <class S>
__device__ __forceinline__ double cost_full(const S& s, int i, int j) {
  if constexpr (S::kWeighted) return run_cost(s.wc[j] - s.wc[i], s.p[0][j] - s.p[0][i], s.p[1][j] - s.p[1][i]);
  else
    return cost_of(static_cast<int>(s.cnt[j]) - static_cast<int>(s.cnt[i]), s.p[0][j] - s.p[0][i],
                   s.p[1][j] - s.p[1][i]);
}
// A run's count as dp.cpp's tables hold it (st.wc): the prefix weights' difference when weighted,
// else the count's.
template <class S>
__device__ __forceinline__ double run_weight(const S& s, int i, int j) {
  if constexpr (S::kWeighted) return s.wc[j] - s.wc[i];
  else return static_cast<double>(s.cnt[j]) - static_cast<double>(s.cnt[i]);
}

// Leftmost minimum of prev[i] + cost(i, j) over i = i0, i0 + step, ... <= hi, folded into (bv, bi)
// with the CPU's strict "<" in increasing i. U evaluations are issued before their comparisons
// (independent: they overlap their latencies); the comparisons stay in increasing i, so the result
// is that of the one-by-one scan. (An index past hi is evaluated at hi and not compared.)
template <int U, class Cost>
__device__ __forceinline__ void scan_min(const double* prev, int i0, int hi, int step, int j, const Cost& cost,
                                         double& bv, int& bi) {
  for (int i = i0; i <= hi; i += U * step) {
    double v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int iu = min(i + u * step, hi);
      v[u] = prev[iu] + cost(iu, j);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (i + u * step <= hi && v[u] < bv) {
        bv = v[u];
        bi = i + u * step;
      }
  }
}

// The interval [jlo, jhi] of candidate node c (bits from the root: 0 left, 1 right) at depth L of
// dp.cpp's divide and conquer over end positions [k, m]; empty (jlo > jhi) when it does not exist.
__device__ __forceinline__ void descend(int k, int m, int c, int L, int& jlo, int& jhi) {
  jlo = k;
  jhi = m;
  for (int b = L - 1; b >= 0 && jlo <= jhi; --b) {
    const int mid = (jlo + jhi) >> 1;
    if ((c >> b) & 1) jlo = mid + 1;
    else jhi = mid - 1;
  }
}

// One layer k of dp.cpp Dp::solve (cur[j], opt row of layer k for j in [k, m]), level by level.
// `optk` is the layer's opt row, `lower` the previous layer's (null for k = 2). Levels of at most 32
// nodes run from a node list carrying each node's start range (what
// dp.cpp passes down), a group of lanes per node; a level of more than 32 nodes (optimal's deeper
// trees only: binned-dp has m <= 46 bin edges, at most 7 + 31 + 7 + 1, so at most 16 nodes a level)
// and all below it enumerate the nodes from the tree's shape (descend) and read the start ranges
// from optk, a lane per node.
template <int U, class S, class Cost>
__device__ void dp_layer(S& s, int lane, int k, int m, const double* prev, double* cur, std::int16_t* optk,
                         const std::int16_t* lower, const Cost& cost) {
  auto clamp_range = [&](int j, int ilo, int ihi, int& lo, int& hi) {
    lo = max(max(ilo, k - 1), lower ? static_cast<int>(lower[j]) : 0);
    hi = min(ihi, j - 1);
    lo = min(lo, hi);  // (dp.cpp: only reachable through rounding-level ties)
  };
  Node* nb = s.dp.nodes[0];
  Node* nn = s.dp.nodes[1];
  if (lane == 0) nb[0] = Node{static_cast<short>(k), static_cast<short>(m), static_cast<short>(k - 1),
                              static_cast<short>(m - 1)};
  int count = 1, L = 0;
  __syncwarp();
  while (count > 0 && count <= 32) {
    int lg = 0;
    while ((1 << lg) < count) ++lg;
    const int gs = 32 >> lg;  // lanes per node
    const int g = lane >> (5 - lg), sub = lane & (gs - 1);
    const bool valid = g < count;
    Node nd{0, -1, 0, 0};
    int j = 0, lo = 0, hi = -1;
    if (valid) {
      nd = nb[g];
      j = (nd.jlo + nd.jhi) >> 1;
      clamp_range(j, nd.ilo, nd.ihi, lo, hi);
    }
    double bv = inf();
    int bi = INT_MAX;
    scan_min<U>(prev, lo + sub, hi, gs, j, cost, bv, bi);
    group_argmin(bv, bi, gs);
    const bool leader = valid && sub == 0;
    bool hasl = false, hasr = false;
    if (leader) {
      cur[j] = bv;
      optk[j] = static_cast<std::int16_t>(bi);
      hasl = nd.jlo <= j - 1;
      hasr = j + 1 <= nd.jhi;
    }
    const unsigned ml = __ballot_sync(kFull, hasl), mr = __ballot_sync(kFull, hasr);
    const int next = __popc(ml) + __popc(mr);
    if (leader && next <= 32) {
      const unsigned lt = (1u << lane) - 1u;
      int p = __popc(ml & lt) + __popc(mr & lt);
      if (hasl) nn[p++] = Node{nd.jlo, static_cast<short>(j - 1), nd.ilo, static_cast<short>(bi)};
      if (hasr) nn[p] = Node{static_cast<short>(j + 1), nd.jhi, static_cast<short>(bi), nd.ihi};
    }
    count = next;
    ++L;
    __syncwarp();
    Node* t = nb;
    nb = nn;
    nn = t;
  }
  if (count == 0) return;
  for (;; ++L) {  // levels of more than 32 nodes: a lane per node, the CPU's scan order
    bool any = false;
    for (int c = lane; c < (1 << L); c += 32) {
      int jlo, jhi;
      descend(k, m, c, L, jlo, jhi);
      if (jlo > jhi) continue;
      any = true;
      // The start range dp.cpp passes down: the split points of the ancestors that bound the node.
      const int j = (jlo + jhi) >> 1;
      int lo, hi;
      clamp_range(j, jlo > k ? static_cast<int>(optk[jlo - 1]) : k - 1, jhi < m ? static_cast<int>(optk[jhi + 1]) : m - 1,
                  lo, hi);
      double bv = inf();  // (every value is finite: the first comparison takes it, as the CPU's start)
      int bi = lo;
      scan_min<U>(prev, lo, hi, 1, j, cost, bv, bi);
      cur[j] = bv;
      optk[j] = static_cast<std::int16_t>(bi);
    }
    if (__ballot_sync(kFull, any) == 0u) break;
    __syncwarp();
  }
}

// One layer k of dp.cpp Dp::solve computed for EVERY end position at once, without the divide and
// conquer's tree levels (binned-dp). For each end position j in [k, m] it takes g(j) = the leftmost
// minimum of prev[i] + cost(i, j) over the FULL range R(j) = [max(k - 1, lower[j]), j - 1] (lower:
// the previous layer's opt row, none for k = 2), and returns whether g is non-decreasing in j. When
// it is, g and the minima ARE what dp.cpp's (and dp_layer's) divide and conquer computes, bit for
// bit:
//   Claim. If g(j) <= g(j + 1) for all j in [k, m - 1], then every node j of dp.cpp's recursion
//   scans a range containing g(j) and takes g(j) with the value prev[g(j)] + cost(g(j), j).
//   Proof, by induction from the root down. A node j gets (ilo, ihi) = (the split point of its
//   nearest ancestor to the left, or k - 1; that of its nearest ancestor to the right, or m - 1).
//   By the induction hypothesis those split points are g(ja) for an ancestor ja < j and g(jb) for
//   jb > j, so ilo <= g(j) <= ihi by monotonicity (k - 1 <= g(j) <= m - 1 trivially). The node scans
//   [lo, hi] with lo = max(ilo, k - 1, lower[j]) <= g(j) (g(j) is in R(j)) and hi = min(ihi, j - 1)
//   >= g(j) (so the "lo = min(lo, hi)" clamp does not act). [lo, hi] is a sub-range of R(j) that
//   contains g(j): every i < g(j) in it has a value strictly above the minimum over R(j) (g(j) is
//   the LEFTMOST minimum of R(j), and no value is NaN: every run is non-empty), every i > g(j) a
//   value >= it, so the scan's strict "<" (the group argmin's (value, index) order) ends on g(j),
//   with the same bits (the same expression prev[i] + cost(i, j) on the same inputs).           []
// In exact arithmetic g is always monotone (the quadrangle inequality, dp.cpp's header); in
// floating point a rounding-level violation is possible (about 1 % of the layers of Gaussian BF16
// tiles: docs/design/cuda-fit.md), and then this returns false and the caller recomputes the layer
// with dp_layer (every cur[j] and optk[j], j in [k, m], is overwritten there), so the bytes never
// depend on the check's outcome.
// Work division: each lane takes a CONTIGUOUS chunk of ceil(pairs / 32) of the layer's (j, i) pairs
// in j-major order and scans it sequentially (the evaluations are independent: two are issued per
// step), keeping the running (value, index) minimum of its current row with the CPU's strict "<" in
// increasing i; a row that ends inside the chunk and started inside it is written directly. Rows
// that cross chunk boundaries are combined once per layer: a lane's outgoing partial (the minimum of
// the row that crosses its chunk's end) is its own partial, or, when its whole chunk lies inside a
// row that started before it ("pass-through"), the incoming partial combined with its own; that
// recurrence is one segmented (value, index) scan over the lanes (5 shuffle rounds); a lane whose
// first row started before its chunk and ends inside it combines the incoming partial (lower
// indices) with its own head minimum and writes the row. The (value, index) minimum is associative
// and commutative, so every row's result is the leftmost minimum over R(j) (the CPU's scan),
// whatever the chunking.
template <class S, class Cost>
__device__ bool dp_layer_chunk(S& s, int lane, int k, int m, const double* prev, double* cur, std::int16_t* optk,
                               const std::int16_t* lower, const Cost& cost) {
  ChunkScratch& fs = s.dp.chunk;
  const int j0 = k + lane, j1 = k + 32 + lane;
  const int lo0 = j0 <= m ? max(k - 1, lower ? static_cast<int>(lower[j0]) : 0) : 0;
  const int lo1 = j1 <= m ? max(k - 1, lower ? static_cast<int>(lower[j1]) : 0) : 0;
  const int len0 = j0 <= m ? j0 - lo0 : 0, len1 = j1 <= m ? j1 - lo1 : 0;
  int incl = len0 | (len1 << 16);
  for (int off = 1; off < 32; off <<= 1) {
    const int t = __shfl_up_sync(kFull, incl, off);
    if (lane >= off) incl += t;
  }
  const int tot = __shfl_sync(kFull, incl, 31);
  const int total0 = tot & 0xffff, total = total0 + (tot >> 16);
  const int off0 = (incl & 0xffff) - len0, off1 = total0 + (incl >> 16) - len1;
  if (len0 > 0) {
    fs.roff[j0] = static_cast<std::int16_t>(off0);
    fs.rb[j0] = static_cast<std::int16_t>(lo0 - off0);
  }
  if (len1 > 0) {
    fs.roff[j1] = static_cast<std::int16_t>(off1);
    fs.rb[j1] = static_cast<std::int16_t>(lo1 - off1);
  }
  __syncwarp();
  const int C = (total + 31) >> 5;  // pairs per lane
  const int c0 = min(lane * C, total), c1 = min(c0 + C, total);
  // Row of pair c0: the last j in [k, m] with roff[j] <= c0.
  int j = k;
  if (c0 < c1) {
    int a = k, b = m;
    while (a < b) {
      const int mid = (a + b + 1) >> 1;
      if (fs.roff[mid] <= c0) a = mid;
      else b = mid - 1;
    }
    j = a;
  }
  const int jh = j;  // my first row
  const bool head_cont = c0 < c1 && fs.roff[j] < c0;  // my first row started in an earlier chunk
  bool first = true;       // still in my first row
  bool head_ends = false;  // (head_cont) my first row ends in my chunk
  double hv = inf(), rv = inf();  // head minimum (head_cont rows), running minimum of the current row
  int hix = INT_MAX, ri = INT_MAX;
  int i = c0 < c1 ? c0 + fs.rb[j] : 0;
  // Folds the pair (i, j) with value v into the current row; at the row's last pair (i = j - 1)
  // writes it (or keeps it as the head minimum) and moves to the next row.
  auto fold = [&](double v, int ii, int jj) {
    if (v < rv) {  // (increasing i within a row: the CPU's strict "<")
      rv = v;
      ri = ii;
    }
    if (ii == jj - 1) {
      if (first && head_cont) {
        hv = rv;
        hix = ri;
        head_ends = true;
      } else {
        cur[jj] = rv;
        optk[jj] = static_cast<std::int16_t>(ri);
      }
      first = false;
      rv = inf();
      ri = INT_MAX;
    }
  };
  int e = c0;
  for (; e + 1 < c1; e += 2) {  // two independent evaluations per step
    const int ia = i, ja = j;
    int ib, jb;
    if (ia == ja - 1) {
      jb = ja + 1;
      ib = e + 1 + fs.rb[jb];
    } else {
      jb = ja;
      ib = ia + 1;
    }
    const double va = prev[ia] + cost(ia, ja);
    const double vb = prev[ib] + cost(ib, jb);
    fold(va, ia, ja);
    fold(vb, ib, jb);
    if (ib == jb - 1) {
      j = jb + 1;
      i = (j <= m) ? e + 2 + fs.rb[j] : 0;
    } else {
      j = jb;
      i = ib + 1;
    }
  }
  if (e < c1) fold(prev[i] + cost(i, j), i, j);
  // Outgoing partial (the row crossing my chunk's end): pass-through lanes combine the incoming one.
  const bool pass = c0 < c1 && first && head_cont;  // my whole chunk inside a row begun before it
  double ov = rv;  // (inf when my last row ended at c1 - 1, or an empty chunk)
  int oi = ri;
  const unsigned starts = __ballot_sync(kFull, !pass);  // (lane 0 never passes through: c0 = 0)
  const int seg = 31 - __clz(starts & (0xffffffffu >> (31 - lane)));
  for (int d = 1; d < 32; d <<= 1) {
    const double pv = __shfl_up_sync(kFull, ov, d);
    const int pi = __shfl_up_sync(kFull, oi, d);
    if (lane - d >= seg) keep_min(ov, oi, pv, pi);
  }
  double inval = __shfl_up_sync(kFull, ov, 1);  // the incoming partial: lane - 1's outgoing one
  int inidx = __shfl_up_sync(kFull, oi, 1);
  if (head_cont && head_ends) {  // my first row: the incoming partial (lower indices), then mine
    keep_min(inval, inidx, hv, hix);
    cur[jh] = inval;
    optk[jh] = static_cast<std::int16_t>(inidx);
  }
  __syncwarp();
  bool mono = true;
  if (j0 < m) mono = optk[j0] <= optk[j0 + 1];
  if (j1 < m) mono = mono && optk[j1] <= optk[j1 + 1];
  return __all_sync(kFull, mono);
}

// The prefix sums, scaled to scale `from` (127: unscaled), rescaled to `to` in place. Exact:
// p * 2^(127 - s) for every prefix sum and scale 3..246, because the sums are 0 or multiples of
// 2^-149 (x^2: 2^-298) below 2^137 (x^2: 2^265), so the products lie in [2^-536, 2^513], far inside
// the normal range; hence p[j] * inv - p[i] * inv (dp.cpp's scaled tables) == (p[j] * inv) -
// (p[i] * inv) read from the scaled array, bit for bit. Weighted, each term is a rounded product of
// a sum of float weights (at least 2^-149, below 2^137) and x (x^2), so the sums are 0 or multiples
// of 2^-350 (x^2: 2^-499) below 2^265 (x^2: 2^393), and the products lie in [2^-737, 2^641]: exact too.
template <class S>
__device__ __forceinline__ void prescale(S& s, int lane, int n, int from, int to) {
  const double f = pow2(from - to), f2 = f * f;
  for (int i = lane; i <= n; i += 32) {
    s.p[0][i] = s.p[0][i] * f;
    s.p[1][i] = s.p[1][i] * f2;
  }
  __syncwarp();
}

// dp.cpp dp_fit over m + 1 positions: the bin edges s.pos[0..m] (binned-dp) or every distinct value
// (optimal, m = n), on prefix sums already scaled to `scale` (prescale). Leaves s.K, s.entries,
// s.bounds and (optimal) s.cost = the DP minimum / inv^2. Layers 2..K-1: binned-dp takes
// dp_layer_chunk's full-range minima when they are monotone, else recomputes the layer by
// dp_layer's divide and conquer; optimal runs dp_layer (up to 512 positions: the full ranges would
// be up to 130,000 pairs a layer). Weighted (W): the runs' counts are the prefix weights s.wc.
template <bool Opt, bool W>
__device__ void dp_fit_warp(Smem<Opt, W>& s, int lane, int m, int scale) {
  constexpr int U = kUnroll<Opt>;
  const double inv = pow2(127 - scale);
  [[maybe_unused]] const double inv2 = inv * inv;
  if constexpr (!Opt) {
    for (int i = lane; i <= m; i += 32) {
      const int p = s.pos[i];
      if constexpr (W) {
        s.dp.cd[i] = s.wc[p];
      } else {
        s.dp.cd[i] = static_cast<double>(s.cnt[p]);
        s.dp.ci[i] = static_cast<std::int16_t>(s.cnt[p]);
      }
      s.dp.s1[i] = s.p[0][p];
      s.dp.s2[i] = s.p[1][p];
    }
    __syncwarp();
  }
  auto cost = [&](int i, int j) {
    if constexpr (Opt) return cost_full(s, i, j);
    else return cost_bin(s, i, j);
  };
  const int K = min(m, kCodebookSize);
  if (K == m) {
    if (lane <= m) s.seg[lane] = lane;
    if constexpr (Opt) {
      if (lane == 0) {  // every value alone: the cost is the sum in order
        double total = 0.0;
        for (int i = 0; i < m; ++i) total += cost(i, i + 1);
        s.cost = total / inv2;
      }
    }
  } else {
    double* prev = s.dp.buf[0];
    double* cur = s.dp.buf[1];
    for (int j = 1 + lane; j <= m; j += 32) prev[j] = cost(0, j);
    __syncwarp();
    for (int k = 2; k < K; ++k) {
      std::int16_t* optk = s.dp.opt[k - 2];
      const std::int16_t* lower = k > 2 ? s.dp.opt[k - 3] : nullptr;
      if constexpr (Opt) {
        dp_layer<U>(s, lane, k, m, prev, cur, optk, lower, cost);
      } else if (!dp_layer_chunk(s, lane, k, m, prev, cur, optk, lower, cost)) {
        __syncwarp();
        dp_layer<U>(s, lane, k, m, prev, cur, optk, lower, cost);
      }
      __syncwarp();
      double* t = prev;
      prev = cur;
      cur = t;
    }
    const int start = K > 2 ? s.dp.opt[K - 3][m] : K - 1;
    double bv = inf();
    int bi = INT_MAX;
    scan_min<U>(prev, start + lane, m - 1, 32, m, cost, bv, bi);
    group_argmin(bv, bi, 32);
    if (lane == 0) {
      s.seg[K] = m;
      s.seg[K - 1] = bi;
      for (int k = K - 1; k >= 2; --k) s.seg[k - 1] = s.dp.opt[k - 2][s.seg[k]];
      s.seg[0] = 0;
      if constexpr (Opt) s.cost = bv / inv2;
    }
  }
  __syncwarp();
  if constexpr (Opt) {
    if (lane <= K) s.bounds[lane] = s.seg[lane];
    if (lane < K) {
      const int i = s.seg[lane], j = s.seg[lane + 1];
      s.entries[lane] = run_entry(s.p[0][j] - s.p[0][i], run_weight(s, i, j));
    }
  } else {
    if (lane <= K) s.bounds[lane] = s.pos[s.seg[lane]];
    if (lane < K) {
      const int i = s.seg[lane], j = s.seg[lane + 1];
      s.entries[lane] = run_entry(s.dp.s1[j] - s.dp.s1[i], s.dp.cd[j] - s.dp.cd[i]);
    }
  }
  if (lane == 0) s.K = K;
  __syncwarp();
}

// dp.cpp dp_refine with w = kWindow, rounds = kRounds, over n distinct values (binned-dp), on the
// prefix sums scaled to the tile's scale (prescale).
template <bool W>
__device__ void dp_refine_warp(Smem<false, W>& s, int lane, int n) {
  const int K = s.K;
  const int m = n;
  if (K < 2 || K >= m) return;
  if (lane >= 1 && lane < K) s.wk[lane] = kWindow;
  for (int round = 0; round < kRounds; ++round) {
    if (lane >= 1 && lane < K) {
      const int b = s.bounds[lane];
      s.lo[lane] = max(b - s.wk[lane], lane);
      s.hi[lane] = min(b + s.wk[lane], m - (K - lane));
    }
    __syncwarp();
    {
      const int l1 = s.lo[1], h1 = s.hi[1];
      for (int j = l1 + lane; j <= h1; j += 32) s.rf.F[1][j - l1] = cost_full(s, 0, j);
    }
    __syncwarp();
    for (int k = 2; k <= K; ++k) {
      const int jl = k < K ? s.lo[k] : m, jh = k < K ? s.hi[k] : m;
      const int il = s.lo[k - 1], ihm = s.hi[k - 1];
      const int nj = jh - jl + 1, ni = ihm - il + 1;
      const int tot = nj * ni;
      for (int idx = lane; idx < tot; idx += 64) {  // two independent evaluations per lane and pass
        const int jj = idx / ni, ii = idx - jj * ni;
        const int idx2 = idx + 32;
        const int jj2 = idx2 / ni, ii2 = idx2 - jj2 * ni;
        const bool ok1 = il + ii <= jl + jj - 1;
        const bool ok2 = idx2 < tot && il + ii2 <= jl + jj2 - 1;
        // (a valid dummy run where a slot is unused: its value is not stored)
        const double v1 = s.rf.F[k - 1][ok1 ? ii : 0] + cost_full(s, ok1 ? il + ii : 0, ok1 ? jl + jj : 1);
        const double v2 = s.rf.F[k - 1][ok2 ? ii2 : 0] + cost_full(s, ok2 ? il + ii2 : 0, ok2 ? jl + jj2 : 1);
        if (ok1) s.rf.V[jj][ii] = v1;
        if (ok2) s.rf.V[jj2][ii2] = v2;
      }
      __syncwarp();
      if (const int jj = lane; jj < nj) {  // (nj <= 17: a lane per end position)
        const int j = jl + jj, ih = min(ihm, j - 1);
        double best = inf();
        int bi = il;
        for (int i = il; i <= ih; ++i) {
          const double v = s.rf.V[jj][i - il];
          if (v < best) {
            best = v;
            bi = i;
          }
        }
        s.rf.F[k][jj] = best;
        s.rf.arg[k][jj] = static_cast<std::int16_t>(bi);
      }
      __syncwarp();
    }
    if (lane == 0) {
      int* nb = s.seg;  // (free here: dp_fit_warp's boundaries are in s.bounds)
      nb[K] = m;
      nb[0] = 0;
      for (int k = K; k >= 2; --k) nb[k - 1] = s.rf.arg[k][nb[k] - (k < K ? s.lo[k] : m)];
      bool edge = false;
      for (int k = 1; k < K; ++k) {
        const bool e = (nb[k] == s.lo[k] && s.lo[k] > k) || (nb[k] == s.hi[k] && s.hi[k] < m - (K - k));
        edge = edge || e;
        s.wk[k] = e ? kWindow : kSettled;
        s.bounds[k] = nb[k];
      }
      s.edge = edge;
    }
    __syncwarp();
    if (!s.edge) break;
  }
  if (lane < K) {
    const int i = s.bounds[lane], j = s.bounds[lane + 1];
    s.entries[lane] = run_entry(s.p[0][j] - s.p[0][i], run_weight(s, i, j));
  }
  __syncwarp();
}

// optimal.cpp saturation_bound (lane 0; the CPU's order): a lower bound on the (weighted) error at
// scale s; each value's squared excess counts with its multiplicity (weighted: its weight).
template <bool W>
__device__ double saturation_bound(Smem<true, W>& s, int n, int sc) {
  const double top = 448.0 * pow2(sc - 127);
  const float* u = s.su;
  auto weight = [&](int i) {
    if constexpr (W) return s.wc[i + 1] - s.wc[i];
    else return static_cast<double>(static_cast<int>(s.cnt[i + 1]) - static_cast<int>(s.cnt[i]));
  };
  double lb = 0.0;
  for (int i = 0; i < n && -static_cast<double>(u[i]) > top; ++i) {
    const double d = -static_cast<double>(u[i]) - top;
    lb += weight(i) * (d * d);
  }
  for (int i = n - 1; i >= 0 && static_cast<double>(u[i]) > top; --i) {
    const double d = static_cast<double>(u[i]) - top;
    lb += weight(i) * (d * d);
  }
  return lb;
}

// Where a tile's results go.
struct TileOut {
  std::uint8_t* packed;
  std::uint8_t* codebook;
  std::uint8_t* scale;
  double* sse;
  double* ssq;
};

// tile_common.cpp encode_tile's codebook (lane 0): ascending, duplicates dropped, padded with the
// largest entry, into s.cbv (dequantised) and s.cbb (bytes).
template <class S>
__device__ __forceinline__ void build_codebook(S& s, int scale, int n_entries) {
  {
    float* vals = s.cbv;  // (sorted in shared memory: no per-thread local arrays)
    std::uint8_t* bytes = s.cbb;
    int m = 0;
    for (int i = 0; i < n_entries; ++i) {
      std::uint8_t b = s.entries[i];
      if (b == 0x80) b = 0x00;
      const float v = e4m3_to_float(b);
      bool dup = false;
      for (int j = 0; j < m; ++j) dup = dup || bytes[j] == b;
      if (dup) continue;
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
    for (int j = m; j < kCodebookSize; ++j) {
      vals[j] = vals[m - 1];
      bytes[j] = bytes[m - 1];
    }
    for (int j = 0; j < kCodebookSize; ++j) vals[j] = ldexp_ue8m0(vals[j], static_cast<std::uint8_t>(scale));
  }
}

// First part of the encoding (all lanes): the codebook, every value's index into w, and, when
// `sums`, the terms of the two flat-order sums into the scratch rows 1..512 (row 0 sse, row 1 sum
// of squares); when `werr` (weighted optimal), those of the weighted error, w_c * (x - x_hat)^2
// (encode_tile's weighted_sse), into row 2.
template <bool Opt, bool W>
__device__ __forceinline__ void encode_assign(Smem<Opt, W>& s, int lane, const float (&x)[kIpt], int scale,
                                              int n_entries, bool sums, bool werr, std::uint32_t (&w)[2]) {
  if (lane == 0) build_codebook(s, scale, n_entries);
  __syncwarp();
  // assign_sse: run boundaries where the dequantised value changes; a value goes to run r when it
  // is strictly above the midpoint 0.5*u_{r-1} + 0.5*u_r (ties stay with the lower index); the
  // index written is the first codebook slot of its run. Midpoints ascend, so the last boundary
  // below x is the count the CPU takes.
  float cb[kCodebookSize], mid[kCodebookSize];
#pragma unroll
  for (int j = 0; j < kCodebookSize; ++j) cb[j] = s.cbv[j];
  mid[0] = __int_as_float(0x7f800000);
#pragma unroll
  for (int j = 1; j < kCodebookSize; ++j)
    mid[j] = cb[j] != cb[j - 1] ? 0.5f * cb[j - 1] + 0.5f * cb[j] : __int_as_float(0x7f800000);
  // Value of the run of slot j is cb[j] (every slot of a run holds the same value).
  w[0] = w[1] = 0u;
  double dsq[kIpt], xsq[kIpt];
#pragma unroll
  for (int q = 0; q < kIpt; ++q) {
    const float xv = x[q];
    int idx = 0;
    float val = cb[0];
#pragma unroll
    for (int j = 1; j < kCodebookSize; ++j)
      if (xv > mid[j]) {
        idx = j;
        val = cb[j];
      }
    w[q >> 3] |= static_cast<std::uint32_t>(idx) << (3 * (q & 7));
    const double d = static_cast<double>(xv) - static_cast<double>(val);
    dsq[q] = d * d;
    const double xd = static_cast<double>(xv);
    xsq[q] = xd * xd;
  }
  if (sums) {  // the terms of the flat-order double sums into the scratch rows
    double(*scr)[kN + 1] = s.scratch();
#pragma unroll
    for (int q = 0; q < kIpt; ++q) {
      scr[0][kIpt * lane + q + 1] = dsq[q];
      scr[1][kIpt * lane + q + 1] = xsq[q];
    }
  }
  if constexpr (Opt && W) {
    if (werr) {  // lane L's values are columns 16 (L % 4) + q of the tile
#pragma unroll
      for (int q = 0; q < kIpt; ++q)
        s.enc[2][kIpt * lane + q + 1] = static_cast<double>(s.cw[kIpt * (lane & 3) + q]) * dsq[q];
    }
  }
}

// Last part (all lanes): writes the packed indices w, the codebook and the scale, and sse / ssq
// where o asks for them.
template <class S>
__device__ __forceinline__ void encode_write(const S& s, int lane, const std::uint32_t (&w)[2], int scale,
                                             const TileOut& o, double sse, double ssq) {
  {
    // Lane L holds flat positions 16L..16L+15: bytes 6L..6L+5 of the packed stream.
#pragma unroll
    for (int b = 0; b < 3; ++b) {
      o.packed[6 * lane + b] = static_cast<std::uint8_t>(w[0] >> (8 * b));
      o.packed[6 * lane + 3 + b] = static_cast<std::uint8_t>(w[1] >> (8 * b));
    }
    if (lane < kCodebookSize) o.codebook[lane] = s.cbb[lane];
    if (lane == 0) {
      *o.scale = static_cast<std::uint8_t>(scale);
      if (o.sse) *o.sse = sse;
      if (o.ssq) *o.ssq = ssq;
    }
  }
}

// tile_common.cpp encode_tile + assign_sse. Entries in s.entries[0..n_entries). With `need_sse`
// (optimal's scale search) computes the tile's error, the CPU's flat-order double sum: the sse, or
// weighted (W) the weighted error; returns it to every lane (0 when not computed), and writes the
// outputs only when !need_sse or that error < write_below (strictly better than the best so far).
// The per-tile sse / sum of squares are computed when the caller wants them.
template <bool Opt, bool W>
__device__ double encode_warp(Smem<Opt, W>& s, int lane, const float (&x)[kIpt], int scale, int n_entries,
                              const TileOut& o, bool need_sse, double write_below) {
  const bool werr = Opt && W && need_sse;  // (binned-dp never needs the error: no scale search)
  const bool sums = (need_sse && !W) || o.sse || o.ssq;
  std::uint32_t w[2];
  encode_assign(s, lane, x, scale, n_entries, sums, werr, w);
  double sse = 0.0, ssq = 0.0, err = 0.0;
  if (sums || werr) {  // flat-order double sums: lane 0 sse, lane 1 sum of squares, lane 2 weighted error
    double(*scr)[kN + 1] = s.scratch();
    __syncwarp();
    if (sums && lane < 2 && (lane == 0 || o.ssq)) running_sum(scr[lane], kN);
    if constexpr (Opt && W) {
      if (werr && lane == 2) running_sum(s.enc[2], kN);
    }
    __syncwarp();
    if (sums) {
      sse = scr[0][kN];
      ssq = scr[1][kN];
    }
    if constexpr (Opt && W) err = werr ? s.enc[2][kN] : 0.0;
    else err = sse;
    __syncwarp();  // (the scratch is reused by the caller's next step)
  }
  if (!need_sse || err < write_below) encode_write(s, lane, w, scale, o, sse, ssq);
  __syncwarp();
  return err;
}

__device__ __forceinline__ float load1(const void* src, int dtype, std::int64_t i) {
  if (dtype == 0) return static_cast<const float*>(src)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(src)[i];
  return dtype == 1 ? bf16_to_float(h) : fp16_to_float(h);
}

__device__ __forceinline__ float bits16_to_float(std::uint16_t h, int dtype) {
  return dtype == 1 ? bf16_to_float(h) : fp16_to_float(h);
}

// Lane's 16 values: flat positions 16L..16L+15 = row L/4, columns 16(L%4)..+15 (zero padding as
// gather_tile).
__device__ __forceinline__ void load_tile(const KernelArgs& a, std::int64_t lt, int lane, float (&x)[kIpt]) {
  const std::int64_t tpe = a.tiles_n * a.tiles_k;
  const std::int64_t e = lt / tpe, rem = lt - e * tpe, tn = rem / a.tiles_k, tk = rem - tn * a.tiles_k;
  const std::int64_t row = tn * kTileRows + (lane >> 2), col0 = tk * kTileCols + (lane & 3) * kIpt;
  std::int64_t nc = row < a.rows ? a.cols - col0 : 0;
  nc = nc < 0 ? 0 : (nc > kIpt ? kIpt : nc);
  const std::int64_t base = (e * a.rows + row) * a.cols + col0;
  const int esz = a.dtype == 0 ? 4 : 2;
  const char* p = static_cast<const char*>(a.src) + base * esz;
  if (nc == kIpt && (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0) {
    if (a.dtype == 0) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const float4 f = reinterpret_cast<const float4*>(p)[v];
        x[4 * v] = f.x;
        x[4 * v + 1] = f.y;
        x[4 * v + 2] = f.z;
        x[4 * v + 3] = f.w;
      }
    } else {
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const uint4 u = reinterpret_cast<const uint4*>(p)[v];
        const std::uint32_t wv[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          x[8 * v + 2 * h] = bits16_to_float(static_cast<std::uint16_t>(wv[h] & 0xffffu), a.dtype);
          x[8 * v + 2 * h + 1] = bits16_to_float(static_cast<std::uint16_t>(wv[h] >> 16), a.dtype);
        }
      }
    }
  } else {
#pragma unroll
    for (int q = 0; q < kIpt; ++q) x[q] = q < nc ? load1(a.src, a.dtype, base + q) : 0.0f;
  }
}

// fit.cpp check_tile for the whole warp on the lane's values x (load_tile): the first non-finite
// value in flat order, else a magnitude that needs a scale byte above kMaxScale. A failing tile sets
// the error word (the lowest failing tile's word wins: atomicMin) and returns false. am: the tile's
// largest magnitude (all lanes). Used by the fit kernels and by the check kernel (the same code).
__device__ __forceinline__ bool check_tile_warp(const KernelArgs& a, std::int64_t lt, int lane, const float (&x)[kIpt],
                                                float& am_out) {
  int badq = -1, mycode = 0;
  float am = 0.0f;
#pragma unroll
  for (int q = 0; q < kIpt; ++q) {
    if (badq < 0 && !f32_is_finite(x[q])) {
      badq = q;
      mycode = f32_is_nan(x[q]) ? 1 : (x[q] > 0 ? 2 : 3);
    }
    am = fmaxf(am, fabsf(x[q]));
  }
  for (int off = 16; off > 0; off >>= 1) am = fmaxf(am, __shfl_xor_sync(kFull, am, off));
  am_out = am;
  const unsigned bm = __ballot_sync(kFull, badq >= 0);
  int code = 0, where = 0;
  if (bm) {
    const int fl = __ffs(bm) - 1;
    code = __shfl_sync(kFull, mycode, fl);
    where = fl * kIpt + __shfl_sync(kFull, badq, fl);
  } else if (am != 0.0f && static_cast<int>(ue8m0_rceil(am)) > kMaxScale) {
    code = 4;
  }
  if (code != 0) {
    if (lane == 0) atomicMin(a.err, error_word(a.t_base + lt, code, where));
    return false;
  }
  return true;
}

// The column weights of tile lt (a.cw: [experts of the view][cols]), fit.cpp gather_weights and
// check_weights for the whole warp: lane L gets the weights of tile columns L (w0) and L + 32 (w1);
// columns past the matrix (zero padding) take the smallest weight of the tile's logical columns. A
// weight of a logical column that is not finite and > 0 sets the error word (code 5, the first such
// column of the tile as the position) and returns false. `equal`: all 64 weights are equal (all
// lanes). Used by the weighted fit kernels and by the check kernel.
__device__ __forceinline__ bool tile_weights_warp(const WeightedKernelArgs& a, std::int64_t lt, int lane, float& w0,
                                                  float& w1, bool& equal) {
  const std::int64_t tpe = a.tiles_n * a.tiles_k;
  const std::int64_t e = lt / tpe, tk = (lt - e * tpe) % a.tiles_k;
  const std::int64_t c0 = tk * kTileCols;
  const std::int64_t nc = a.cols - c0 < kTileCols ? a.cols - c0 : kTileCols;  // >= 1 logical columns
  const float* cw = a.cw + e * a.cols + c0;
  const float inf_f = __int_as_float(0x7f800000);
  w0 = lane < nc ? cw[lane] : inf_f;
  w1 = lane + 32 < nc ? cw[lane + 32] : inf_f;
  const bool bad0 = lane < nc && !(w0 > 0.0f && f32_is_finite(w0));
  const bool bad1 = lane + 32 < nc && !(w1 > 0.0f && f32_is_finite(w1));
  const unsigned b0 = __ballot_sync(kFull, bad0), b1 = __ballot_sync(kFull, bad1);
  if (b0 | b1) {
    const int col = b0 ? __ffs(b0) - 1 : 32 + __ffs(b1) - 1;
    if (lane == 0) atomicMin(a.err, error_word(a.t_base + lt, 5, col));
    return false;
  }
  float lo = fminf(w0, w1);  // (every logical weight is finite here, padding is +inf)
  for (int off = 16; off > 0; off >>= 1) lo = fminf(lo, __shfl_xor_sync(kFull, lo, off));
  if (lane >= nc) w0 = lo;
  if (lane + 32 >= nc) w1 = lo;
  const float first = __shfl_sync(kFull, w0, 0);
  equal = __all_sync(kFull, w0 == first && w1 == first);
  return true;
}

__device__ __forceinline__ TileOut tile_out(const KernelArgs& a, std::int64_t lt) {
  return TileOut{a.out.packed + lt * kPackedBytes, a.out.codebook + lt * kCodebookSize, a.out.scale + lt,
                 a.out.sse ? a.out.sse + lt : nullptr, a.out.sum_sq ? a.out.sum_sq + lt : nullptr};
}

// First part of a tile's fit, the whole warp: load + check (a failing tile sets the error word),
// build_sorted (sort, de-duplication, the terms c * x and c * x^2 of every distinct value into
// s.p[.][1..n]). Returns false when the tile is done (error); else n = the number
// of distinct values and am = the largest magnitude. The running sums are the caller's.
// Weighted (W): the weights are checked first (fit.cpp checks them before the tiles) and kept in
// s.cw (all 1 when the tile's weights are all equal: fit.cpp fits such a tile unweighted, and unit
// weights give exactly the unweighted values); build_sorted_weighted: the terms W_d * x and
// W_d * x^2 with W_d the weight of distinct value d, and W_d itself into s.wc[1..n].
template <bool Opt, bool W>
__device__ __forceinline__ bool fit_front_a(Smem<Opt, W>& s, int lane, const FitArgs<W>& a, std::int64_t lt,
                                            float (&x)[kIpt], float& am_out, int& n_out) {
  load_tile(a, lt, lane, x);
  if constexpr (W) {
    float w0, w1;
    bool equal;
    if (!tile_weights_warp(a, lt, lane, w0, w1, equal)) return false;
    s.cw[lane] = equal ? 1.0f : w0;
    s.cw[lane + 32] = equal ? 1.0f : w1;
  }
  float am;
  if (!check_tile_warp(a, lt, lane, x, am)) return false;

  // tile_common.cpp build_sorted (weighted: build_sorted_weighted).
  float* const u = s.uv();
  {
    std::uint32_t keys[kIpt];
    if constexpr (W) {
      // Keys of (value, flat index), +0 for -0 (build_sorted_weighted's order): the stable sort of
      // the keys in flat order (lane L holds flat positions 16L..16L+15) with each value's weight,
      // the weight of its column 16 (L % 4) + q, as the item.
      float wv[kIpt];
      __syncwarp();  // (s.cw)
#pragma unroll
      for (int q = 0; q < kIpt; ++q) {
        keys[q] = sort_key(x[q] == 0.0f ? 0.0f : x[q]);
        wv[q] = s.cw[kIpt * (lane & 3) + q];
      }
      WarpSortWeighted(s.sort_weighted).StableSort(keys, wv, KeyLess());
      // The weights in sorted order into s.p[1][0..511] (free until the terms below).
#pragma unroll
      for (int q = 0; q < kIpt; ++q) s.p[1][kIpt * lane + q] = static_cast<double>(wv[q]);
    } else {
#pragma unroll
      for (int q = 0; q < kIpt; ++q) keys[q] = sort_key(x[q]);
      WarpSort(s.sort).Sort(keys, KeyLess());
    }
    __syncwarp();
    float v[kIpt];
#pragma unroll
    for (int q = 0; q < kIpt; ++q) v[q] = from_key(keys[q]);
    const float before = __shfl_up_sync(kFull, v[kIpt - 1], 1);
    unsigned hm = 0;
#pragma unroll
    for (int q = 0; q < kIpt; ++q) {
      const float pv = q ? v[q - 1] : before;
      const bool h = (lane == 0 && q == 0) || v[q] != pv;  // +0 and -0 compare equal and merge
      hm |= static_cast<unsigned>(h) << q;
    }
    const int hc = __popc(hm);
    int incl = hc;
    for (int off = 1; off < 32; off <<= 1) {
      const int t = __shfl_up_sync(kFull, incl, off);
      if (lane >= off) incl += t;
    }
    int d = incl - hc;
#pragma unroll
    for (int q = 0; q < kIpt; ++q)
      if ((hm >> q) & 1u) {
        u[d] = v[q] == 0.0f ? 0.0f : v[q];
        s.cnt[d] = static_cast<std::uint16_t>(kIpt * lane + q);
        ++d;
      }
    if (lane == 31) {
      s.cnt[incl] = kN;
      s.m = incl;  // n, temporarily
    }
  }
  __syncwarp();
  const int n = s.m;
  if constexpr (W) {
    // The weight of each distinct value: its elements' weights summed in double in sorted (= flat)
    // order from 0, as build_sorted_weighted's wsum (one lane per value: the sums are independent).
    for (int d = lane; d < n; d += 32) {
      double wsum = 0.0;
      for (int i = s.cnt[d]; i < s.cnt[d + 1]; ++i) wsum += s.p[1][i];
      s.wc[d + 1] = wsum;
    }
    __syncwarp();
    for (int d = lane; d < n; d += 32) {
      const double wsum = s.wc[d + 1];
      const double xd = static_cast<double>(u[d]);
      s.p[0][d + 1] = wsum * xd;
      s.p[1][d + 1] = wsum * (xd * xd);
    }
  } else {
    // The terms c * x and c * x^2 of every distinct value (independent: all lanes), then the running
    // sums in the CPU's order (lane 0 sum x, lane 1 sum x^2), loads batched ahead of the adds.
    for (int d = lane; d < n; d += 32) {
      const double c = static_cast<double>(s.cnt[d + 1] - s.cnt[d]);
      const double xd = static_cast<double>(u[d]);
      s.p[0][d + 1] = c * xd;
      s.p[1][d + 1] = c * (xd * xd);
    }
  }
  __syncwarp();
  am_out = am;
  n_out = n;
  return true;
}

// Second part, the whole warp, after the running sums (s.p, s.cnt complete): bin edges
// (binned-dp), the scale; all-zero tiles are encoded here. Returns true when the DP must run, with
// m = the DP's positions (bin edges, or n) and sc = the scale (prefix sums already scaled to it).
template <bool Opt, bool W>
__device__ __forceinline__ bool fit_front_b(Smem<Opt, W>& s, int lane, const KernelArgs& a, std::int64_t lt,
                                            const float (&x)[kIpt], float am, int n, int& m_out, int& sc_out) {
  int m = n;
  if constexpr (!Opt) {
    // binned_dp.cpp: bin edges.
    if (n <= kBins) {
      if (lane <= n) s.pos[lane] = lane;
      if (n == 32 && lane == 0) s.pos[32] = 32;
    } else {
      auto lower_bound = [&](int t) {
        int lo = 0, hi = n;
        while (lo < hi) {
          const int mid = (lo + hi) >> 1;
          if (s.cnt[mid] < t) lo = mid + 1;
          else hi = mid;
        }
        return lo;
      };
      s.lb[lane] = lower_bound(lane == 0 ? kTail : lane * (kN / kBins));
      const int lb_end = lower_bound(kN - kTail + 1);
      __syncwarp();
      if (lane == 0) {
        int mm = 0, i = 0;
        s.pos[0] = 0;
        auto push = [&](int e) {
          if (e > s.pos[mm] && e < n) s.pos[++mm] = e;
        };
        for (; i < s.lb[0]; ++i) push(i);
        for (int b = 1; b < kBins; ++b) {
          i = max(i, s.lb[b]);
          push(i);
        }
        for (i = max(i, lb_end); i < n; ++i) push(i);
        s.pos[++mm] = n;
        s.m = mm;
      }
    }
    __syncwarp();
    m = n <= kBins ? n : s.m;
  }
  int sc;
  if (a.forced_scale >= 0) {
    sc = a.forced_scale;
  } else if (am == 0.0f) {
    if (lane == 0) s.entries[0] = 0x00;
    __syncwarp();
    encode_warp(s, lane, x, 127, 1, tile_out(a, lt), false, 0.0);
    return false;
  } else {
    sc = max(static_cast<int>(ue8m0_rceil(am)), kMinScale);
  }
  prescale(s, lane, n, 127, sc);
  m_out = m;
  sc_out = sc;
  return true;
}

// The whole fit of tile lt by the warp: fit.cpp quantize_tile with binned_dp.cpp's fit (binned-dp)
// or optimal.cpp's (Opt), weighted by the column weights a.cw (W).
template <bool Opt, bool W>
__device__ __forceinline__ void fit_one(Smem<Opt, W>& s, int lane, const FitArgs<W>& a, std::int64_t lt) {
  float x[kIpt];
  float am;
  int n, m, sc;
  if (!fit_front_a(s, lane, a, lt, x, am, n)) return;
  if (lane < 2) running_sum(s.p[lane], n);
  if constexpr (W) {
    if (lane == 2) running_sum(s.wc, n);  // the prefix weights (SortedTile::wc)
  }
  // (binned-dp: the other lanes go on to the bin edges, which read only cnt and sync before the DP)
  if constexpr (Opt) __syncwarp();
  if (!fit_front_b(s, lane, a, lt, x, am, n, m, sc)) return;
  const TileOut o = tile_out(a, lt);
  dp_fit_warp(s, lane, m, sc);
  if constexpr (Opt) {
    if (a.forced_scale < 0) {
      // optimal.cpp search_scales: rceil (at least 3), then downward while the saturation bound
      // allows; a scale whose DP minimum exceeds the best error cannot win; strictly smaller errors
      // replace the best (ties keep the larger scale, found first). Each candidate's bytes are
      // written only when it is the best so far.
      double best = encode_warp(s, lane, x, sc, s.K, o, true, inf());
      for (int t = sc - 1; t >= kMinScale; --t) {
        double lb = 0.0;
        if (lane == 0) lb = saturation_bound(s, n, t);
        lb = __shfl_sync(kFull, lb, 0);
        if (lb >= best) break;
        prescale(s, lane, n, t + 1, t);
        dp_fit_warp(s, lane, m, t);
        if (s.cost > best * (1.0 + 1e-12)) continue;  // cannot beat the best even after reassigning
        const double e = encode_warp(s, lane, x, t, s.K, o, true, best);
        if (e < best) best = e;
      }
    } else {
      encode_warp(s, lane, x, sc, s.K, o, false, 0.0);
    }
  } else {
    if (m != n) dp_refine_warp(s, lane, n);
    encode_warp(s, lane, x, sc, s.K, o, false, 0.0);
  }
}

}  // namespace
}  // namespace lutb::cuda::fit_internal
