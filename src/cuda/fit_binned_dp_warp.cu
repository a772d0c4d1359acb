// src/cuda/fit_binned_dp_warp.cu: the GPU fitters "binned-dp" (the default) and "optimal" (spec
// section 2.1) with one WARP per 8x64 tile, byte-identical to the CPU fitters (src/fit/binned_dp.cpp,
// optimal.cpp, dp.cpp, tile_common.cpp). ONE kernel source, templated on the fitter (`Opt`): both
// share the load and check, the sort and de-duplication, the prefix sums, the DP layer, the
// encoding; binned-dp adds the bin edges and the refinement, optimal runs the DP over every
// distinct value (identity positions, m = n <= 512) and optimal.cpp's scale search.
//
// The scalar arithmetic that decides bytes (run cost, nearest E4M3 value, entry of a run, sort
// keys, 2^e) is src/fit/fit_scalar.hpp, the very functions the CPU fitter calls; this file is
// compiled with -fmad=false (CMakeLists.txt, scripts/gpu_run.sh) as src/fit is with
// -ffp-contract=off, so every add/multiply/divide rounds as on the CPU. What is parallel here, and
// why each part gives the CPU's bits:
//  - sort: cub::WarpMergeSort of the 512 keys (16 per lane). Any correct sort gives the same array.
//  - de-duplication: head flags + a warp scan (integers). The prefix sums of x and x^2 are double
//    running sums whose rounding depends on the order, so they stay SEQUENTIAL in the CPU's order
//    (lane 0 sums x, lane 1 sums x^2 at the same time).
//  - bin edges (binned-dp): the CPU's "advance i while cnt[i] < target" loops are
//    max(i, lower_bound(target)) because cnt is increasing; each lane binary-searches one target,
//    lane 0 replays the pushes.
//  - DP layers: dp.cpp's divide and conquer computes, for each end position j (one tree node), the
//    leftmost minimum of prev[i] + cost(i, j) over a range that depends only on the node's
//    ancestors. The nodes of one tree level are therefore independent and run together: up to 32
//    nodes with 32 / (nodes) lanes per node (a node list carries each node's range, as dp.cpp
//    passes it down), each lane scanning a strided part of the range with the CPU's strict "<" and
//    the group combining by (smaller value, then lower index), which is the leftmost minimum the
//    CPU's scan finds (no NaN can occur: every run is non-empty). Levels of more than 32 nodes
//    (optimal's deeper trees, up to 256 nodes) run a lane per node in the CPU's scan order; their
//    nodes come from the tree's SHAPE, which depends only on (k, m), and a node [jlo, jhi] takes the
//    start range [opt(jlo - 1), opt(jhi + 1)] (k - 1 and m - 1 at the ends): the split points of the
//    ancestors that bound it, exactly the (ilo, bi) / (bi, ihi) dp.cpp passes down.
//  - refinement (binned-dp, dp_refine): the window costs of one layer are computed by all lanes
//    into a table, then one lane per end position scans it in the CPU's order with its strict "<".
//  - scale search (optimal, optimal.cpp search_scales): serial over scales as on the CPU; the
//    saturation bound is lane 0's loop in the CPU's order; each candidate's error is the encoding's
//    flat-order double sum, and a candidate's bytes are written only when its error is strictly
//    below the best so far (the first one always), so the last write is the CPU's choice.
//  - encoding: each lane assigns its 16 values (the CPU's midpoint rule, ties to the lower index);
//    the per-tile sse and sum of squares are double sums in flat order, so they are accumulated in
//    exactly that order (lane 0 and lane 1 at once), and only when needed.
//  - fit_compact_kernel (binned-dp, fit12; the default when the per-tile sums are written): the same
//    fit with a compact shared-memory layout (9.2 KB instead of 13.7 KB per warp, 20 resident warps
//    per SM instead of 16): the prefix sums only at the bin edges, the refinement windows' sums
//    re-derived per round in the CPU's order, the running and flat-order sums through a chunk
//    (details at fit_compact_kernel).
//  - DP modes (fit13; dp_layer_mode, launch_warp_dp in fit_dp_modes.cu): each DP layer's minima for
//    every end position at once over the full start ranges (dp_layer_full: 32 pairs per pass;
//    dp_layer_chunk: a contiguous chunk of pairs per lane), equal to the divide and conquer's when
//    they are monotone in j (proof at dp_layer_full; checked, the layer recomputed by dp_layer
//    otherwise). Mode 6 (dp_layer_chunk) on fit_warp_kernel is the default of bytes-only fits.
//  - DP modes 9..14 (fit16; fill_cost_table, dp_fit_c, launchers in fit_dp_modes_t.cu): the run cost
//    of every pair of bin edges computed once per tile into a shared-memory table (a memo of the
//    same doubles: the same comparisons, the same bytes), the layers reading it; on the compact
//    layout's table form (SmemCT<true>, 2-warp blocks, 16 warps per SM); slower than the default on
//    the H200 (docs/perf/fit-gpu.md, fit16), kept selectable.
//  - fit_pair_kernel (binned-dp, an experiment selected by launch_warp_tiles, not the default): two
//    tiles per warp, their DP and refinement at once on the two half-warps (the same functions with
//    G = 16 lanes per tile, every collective masked to the half); same bytes, slower on the H200
//    because a warp then holds two tiles' shared memory (docs/perf/fit-gpu.md, fit11).
// Keep in step with src/fit: tests/cuda/fit_gpu_test.cpp compares the bytes with the CPU's.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cub/warp/warp_merge_sort.cuh>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda/fit_internal.cuh"
#include "fit/fit_scalar.hpp"
#include "fit/fit_scalar_fast.hpp"
#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"

namespace lutb::cuda::fit_internal {
namespace {

using fit_detail::from_key;
using fit_detail::pow2;
using fit_detail::CountRecip;
using fit_detail::run_cost;
using fit_detail::run_cost_div;
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
constexpr int kProfSlots = kProfPhases + 5;      // phases, then tiles, sum n, sum m, refine rounds, DP layer reruns
// Cost evaluations issued together in the DP scans (scan_min), per fitter, as measured on the H200
// (docs/perf/fit-gpu.md, gpufit3 run 2): binned-dp's scans are 1-3 evaluations long, 2 at a time
// was no faster and 4 6 % slower; optimal's are longer, 4 at a time was 5 % faster than 2 and 10 %
// faster than 1.
template <bool Opt>
inline constexpr int kUnroll = Opt ? 4 : 1;
// How a DP cost evaluation computes fit_scalar.hpp's run_cost (all give its bits; proofs and CPU
// tests: src/fit/fit_scalar_fast.hpp, tests/fit/fit_scalar_fast_test.cpp):
//   0: run_cost itself (IEEE division, the four-operation subnormal branch of e4m3_nearest);
//   1: run_cost_div: the division by the run count from the table of RN(1/count) and an FMA
//      correction (div_by_count);
//   2: run_cost_fast: 1 plus e4m3_nearest_fast (32-bit rounding, two-FMA subnormal branch);
//   3: 2 with the prefix sums scaled in place (prescale) once per scale instead of multiplying
//      both ends of every run by inv and inv^2 in every evaluation (optimal's DP, the refinement).
//      p * 2^(127 - s) is exact for every prefix sum and scale 3..246: the sums are 0 or multiples
//      of 2^-149 (x^2: 2^-298) below 2^137 (x^2: 2^265), so the products lie in [2^-536, 2^513],
//      far inside the normal range; hence p[j] * inv - p[i] * inv == (p[j] * inv) - (p[i] * inv)
//      read from the scaled array, bit for bit.
inline constexpr int kArith = kWarpArithDefault;

// The table of (count, RN(1/count)) for div_by_count, count = 0..512 (row 0 unused), read through
// the read-only data cache: the same literals as the host's fit_detail::kCountRecip.
__device__ const CountRecip g_count_recip[fit_detail::kMaxCount + 1] = {
    {0.0, 0.0},
#define X(c, y) {static_cast<double>(c), y},
    LUTB_COUNT_RECIP_LIST
#undef X
};

// fit_scalar.hpp run_cost(c, a, b) for the run count c >= 1 as the table variants (Ar 1, 2) compute it.
template <int Ar>
__device__ __forceinline__ double cost_of(int c, double a, double b) {
  static_assert(Ar >= 1 && Ar <= 3);
  const double2 t = __ldg(reinterpret_cast<const double2*>(g_count_recip) + c);
  if constexpr (Ar == 1) return run_cost_div(t.x, t.y, a, b);
  else return run_cost_fast(t.x, t.y, a, b);
}

// Warps (tiles in flight) per block: the static shared memory of a block stays under 48 KiB.
template <bool Opt>
struct Cfg {
  static constexpr int kWarps = Opt ? 1 : 2;
};

using WarpSort = cub::WarpMergeSort<std::uint32_t, kIpt, 32>;
struct KeyLess {
  __device__ bool operator()(std::uint32_t a, std::uint32_t b) const { return a < b; }
};

// A node of dp.cpp's divide and conquer: end positions [jlo, jhi], start range [ilo, ihi].
struct Node {
  short jlo, jhi, ilo, ihi;
};

// dp_layer_full's scratch (fit13): per end position j, i = e + rb[j] for the layer's flat pair
// index e; a bit per flat index where a row (end position) starts. At most sum_{j=2..49} (j - 1) =
// 1176 pairs a layer (m <= 49).
constexpr int kFullWords = 40;
struct FullScratch {
  std::int16_t rb[kMaxPos];
  std::uint32_t bits[kFullWords];
  std::int16_t roff[kMaxPos];  // dp_layer_chunk: the flat index of row j's first pair
};

// DP tables. binned-dp: prefix sums at the bin edges (scaled units), as dp.cpp's Dp. optimal: the
// positions are the distinct values themselves, so the costs read the prefix sums directly and
// scale them on the fly (the same products dp.cpp stores), which saves 12 KiB per warp.
template <bool Opt>
struct DpTables {
  double cd[kMaxPos], s1[kMaxPos], s2[kMaxPos];
  std::int16_t ci[kMaxPos];  // the counts at the bin edges as integers (cd's values), the table's index
  double buf[2][kMaxPos];
  std::int16_t opt[kOptRows][kMaxPos];
  Node nodes[2][32];  // the nodes of one tree level (at most 32: m - 1 <= 48 end positions)
  FullScratch full;   // dp_layer_full (fit13)
};
template <>
struct DpTables<true> {
  double buf[2][kN + 1];  // (also the encoding's scratch for the flat-order sums)
  std::int16_t opt[kOptRows][kN + 1];
  Node nodes[2][32];  // the nodes of one tree level while it has at most 32
};

// Per-warp shared memory (binned-dp ~13 KiB, optimal ~26 KiB). The union members are used one
// after the other.
template <bool Opt>
struct Smem {
  static constexpr bool kCompact = false;
  union {
    WarpSort::TempStorage sort;
    float u[Opt ? 1 : kN];  // binned-dp: distinct values, ascending (+0 for zero); dead after the prefix sums
    DpTables<Opt> dp;
    struct {
      double F[kCodebookSize + 1][kWin];
      double V[kWin][kWin];  // V[j - jl][i - il] = F[k-1][i - il] + cost(i, j)
      std::int16_t arg[kCodebookSize + 1][kWin];
    } rf;
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
  // binned-dp; optimal needs them for the next scale, and uses the DP buffers instead.
  __device__ double (*scratch())[kN + 1] {
    if constexpr (Opt) return dp.buf;
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

// The lanes of a tile: the whole warp (G = 32, one tile per warp) or, in the DP phase of the
// two-tiles-per-warp kernel (fit_pair_kernel), the half-warp (G = 16) that holds the tile. Every
// warp collective of the DP and the refinement uses this mask, so the two halves may diverge.
template <int G>
__device__ __forceinline__ unsigned grp_mask(int lane) {
  static_assert(G == 32 || G == 16);
  if constexpr (G == 32) return kFull;
  else return 0xffffu << (lane & 16);
}

// Leftmost minimum over groups of `gs` lanes (gs a power of two, groups aligned, inside the lanes
// `gm` of one tile).
__device__ __forceinline__ void group_argmin(double& bv, int& bi, int gs, unsigned gm = kFull) {
  for (int off = gs >> 1; off > 0; off >>= 1) {
    const double ov = __shfl_xor_sync(gm, bv, off);
    const int oi = __shfl_xor_sync(gm, bi, off);
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

// dp.cpp Dp::cost on the bin-edge tables (cd[j] - cd[i] is the exact integer ci[j] - ci[i], which
// the table variants read as a double from the table).
template <int Ar>
__device__ __forceinline__ double cost_bin(const Smem<false>& s, int i, int j) {
  if constexpr (Ar == 0)
    return run_cost(s.dp.cd[j] - s.dp.cd[i], s.dp.s1[j] - s.dp.s1[i], s.dp.s2[j] - s.dp.s2[i]);
  else
    return cost_of<Ar>(s.dp.ci[j] - s.dp.ci[i], s.dp.s1[j] - s.dp.s1[i], s.dp.s2[j] - s.dp.s2[i]);
}
// dp.cpp's cost over every distinct value (dp_fit with identity positions, dp_refine): its tables
// (count as double, p1 * inv, p2 * inv2) formed on the fly.
// (The difference of the two exact integer-valued doubles is the integer cnt[j] - cnt[i].)
template <int Ar, class S>
__device__ __forceinline__ double cost_full(const S& s, int i, int j, double inv, double inv2) {
  if constexpr (Ar >= 3) return cost_of<Ar>(static_cast<int>(s.cnt[j]) - static_cast<int>(s.cnt[i]), s.p[0][j] - s.p[0][i], s.p[1][j] - s.p[1][i]);
  const double a = s.p[0][j] * inv - s.p[0][i] * inv, b = s.p[1][j] * inv2 - s.p[1][i] * inv2;
  if constexpr (Ar == 0) return run_cost(static_cast<double>(s.cnt[j]) - static_cast<double>(s.cnt[i]), a, b);
  else return cost_of<Ar>(static_cast<int>(s.cnt[j]) - static_cast<int>(s.cnt[i]), a, b);
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
// `optk` is the layer's opt row, `lower` the previous layer's (null for k = 2). Levels of at most G
// nodes (G = the tile's lanes, 32 or 16) run from a node list carrying each node's start range (what
// dp.cpp passes down), a group of lanes per node; a level of more than G nodes (optimal's deeper
// trees only: binned-dp has m <= 46 bin edges, at most 7 + 31 + 7 + 1, so at most 16 nodes a level)
// and all below it enumerate the nodes from the tree's shape (descend) and read the start ranges
// from optk, a lane per node.
template <int U, int G = 32, class S, class Cost>
__device__ void dp_layer(S& s, int lane, int k, int m, const double* prev, double* cur, std::int16_t* optk,
                         const std::int16_t* lower, const Cost& cost) {
  constexpr int kLg = G == 32 ? 5 : 4;
  const unsigned gm = grp_mask<G>(lane);
  const int gl = lane & (G - 1);  // lane within the tile's lanes
  auto clamp_range = [&](int j, int ilo, int ihi, int& lo, int& hi) {
    lo = max(max(ilo, k - 1), lower ? static_cast<int>(lower[j]) : 0);
    hi = min(ihi, j - 1);
    lo = min(lo, hi);  // (dp.cpp: only reachable through rounding-level ties)
  };
  Node* nb = s.dp.nodes[0];
  Node* nn = s.dp.nodes[1];
  if (gl == 0) nb[0] = Node{static_cast<short>(k), static_cast<short>(m), static_cast<short>(k - 1),
                            static_cast<short>(m - 1)};
  int count = 1, L = 0;
  __syncwarp(gm);
  while (count > 0 && count <= G) {
    int lg = 0;
    while ((1 << lg) < count) ++lg;
    const int gs = G >> lg;  // lanes per node
    const int g = gl >> (kLg - lg), sub = gl & (gs - 1);
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
    group_argmin(bv, bi, gs, gm);
    const bool leader = valid && sub == 0;
    bool hasl = false, hasr = false;
    if (leader) {
      cur[j] = bv;
      optk[j] = static_cast<std::int16_t>(bi);
      hasl = nd.jlo <= j - 1;
      hasr = j + 1 <= nd.jhi;
    }
    const unsigned ml = __ballot_sync(gm, hasl) & gm, mr = __ballot_sync(gm, hasr) & gm;
    const int next = __popc(ml) + __popc(mr);
    if (leader && next <= G) {
      const unsigned lt = (1u << lane) - 1u;
      int p = __popc(ml & lt) + __popc(mr & lt);
      if (hasl) nn[p++] = Node{nd.jlo, static_cast<short>(j - 1), nd.ilo, static_cast<short>(bi)};
      if (hasr) nn[p] = Node{static_cast<short>(j + 1), nd.jhi, static_cast<short>(bi), nd.ihi};
    }
    count = next;
    ++L;
    __syncwarp(gm);
    Node* t = nb;
    nb = nn;
    nn = t;
  }
  if (count == 0) return;
  for (;; ++L) {  // levels of more than G nodes: a lane per node, the CPU's scan order
    bool any = false;
    for (int c = gl; c < (1 << L); c += G) {
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
    if ((__ballot_sync(gm, any) & gm) == 0u) break;
    __syncwarp(gm);
  }
}

// fit13: one layer k of dp.cpp Dp::solve computed for EVERY end position at once, without the
// divide and conquer's tree levels (binned-dp, G = 32 only). For each end position j in [k, m] it
// takes g(j) = the leftmost minimum of prev[i] + cost(i, j) over the FULL range
// R(j) = [max(k - 1, lower[j]), j - 1] (lower: the previous layer's opt row, none for k = 2), and
// returns whether g is non-decreasing in j. When it is, g and the minima ARE what dp.cpp's (and
// dp_layer's) divide and conquer computes, bit for bit:
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
// floating point a rounding-level violation is possible (on the H200 benchmark stack: 1.1 % of the
// layers of Gaussian BF16 tiles, 0.16 % of Student-t(3) ones, docs/perf/fit-gpu.md fit13), and
// then this returns false and the caller recomputes the layer with dp_layer (every cur[j] and
// optk[j], j in [k, m], is overwritten there), so the bytes never depend on the check's outcome.
// Work division: the layer's (j, i) pairs in j-major order, 32 consecutive pairs per pass (a lane
// each, all lanes busy, no per-level bookkeeping); a pair's row j from a bitmap of row starts
// (popc), i = e + rb[j]; the leftmost minimum per row by a segmented (value, index) scan over the
// lanes, a row continuing from the previous pass entering through lane 0 (its indices are lower).
// PU: passes per loop iteration (1, or 2: both passes' cost evaluations and segmented scans are
// independent and overlap; the row continuing from the previous pass is folded in after the scan,
// into the lanes of the pass's first segment, which the (value, index) minimum allows: it is
// associative and commutative).
template <int PU, class S, class Cost>
__device__ bool dp_layer_full(S& s, int lane, int k, int m, const double* prev, double* cur, std::int16_t* optk,
                              const std::int16_t* lower, const Cost& cost) {
  static_assert(PU == 1 || PU == 2);
  FullScratch& fs = s.dp.full;
  // Rows (end positions) j0 = k + lane and j1 = k + 32 + lane (at most 48 rows: m <= 49).
  const int j0 = k + lane, j1 = k + 32 + lane;
  const int lo0 = j0 <= m ? max(k - 1, lower ? static_cast<int>(lower[j0]) : 0) : 0;
  const int lo1 = j1 <= m ? max(k - 1, lower ? static_cast<int>(lower[j1]) : 0) : 0;
  const int len0 = j0 <= m ? j0 - lo0 : 0, len1 = j1 <= m ? j1 - lo1 : 0;  // (>= 1: lower[j] <= j - 1)
  // Row offsets: one inclusive scan of both lengths packed into one word (each sum < 2^16).
  int incl = len0 | (len1 << 16);
  for (int off = 1; off < 32; off <<= 1) {
    const int t = __shfl_up_sync(kFull, incl, off);
    if (lane >= off) incl += t;
  }
  const int tot = __shfl_sync(kFull, incl, 31);
  const int total0 = tot & 0xffff, total = total0 + (tot >> 16);
  const int off0 = (incl & 0xffff) - len0, off1 = total0 + (incl >> 16) - len1;
  const int maxlen = static_cast<int>(__reduce_max_sync(kFull, static_cast<unsigned>(max(len0, len1))));
  for (int w = lane; w < kFullWords; w += 32) fs.bits[w] = 0u;  // (total <= 1176: words 0..36, +1 read by PU 2)
  __syncwarp();
  if (len0 > 0) {
    atomicOr(&fs.bits[off0 >> 5], 1u << (off0 & 31));
    fs.rb[j0] = static_cast<std::int16_t>(lo0 - off0);
  }
  if (len1 > 0) {
    atomicOr(&fs.bits[off1 >> 5], 1u << (off1 & 31));
    fs.rb[j1] = static_cast<std::int16_t>(lo1 - off1);
  }
  __syncwarp();
  const unsigned upto = 0xffffffffu >> (31 - lane);  // bits 0..lane
  double cv = 0.0;  // the minimum (value, index) so far of the row continuing from the last pass
  int ci = 0;
  int rowbase = k - 1;  // rows started before this pass, + k - 1
  for (int e0 = 0; e0 < total; e0 += 32 * PU) {
    unsigned word[PU];
    int j[PU], i[PU], bi[PU], seg[PU];
    bool valid[PU];
    double bv[PU];
#pragma unroll
    for (int u = 0; u < PU; ++u) {
      word[u] = fs.bits[(e0 >> 5) + u];
      j[u] = rowbase + __popc(word[u] & upto);  // (past the last pair: m)
      rowbase += __popc(word[u]);
      const int e = e0 + 32 * u + lane;
      valid[u] = e < total;
      i[u] = valid[u] ? e + fs.rb[j[u]] : j[u] - 1;  // (a valid dummy run past the last pair, not stored)
      seg[u] = 31 - __clz((word[u] | 1u) & upto);  // this lane's row starts at lane seg (or before)
    }
#pragma unroll
    for (int u = 0; u < PU; ++u) {
      bv[u] = prev[i[u]] + cost(i[u], j[u]);
      bi[u] = i[u];
      if (!valid[u]) bv[u] = inf();
    }
    for (int d = 1; d < maxlen && d < 32; d <<= 1) {  // segmented inclusive (value, index) minimum
#pragma unroll
      for (int u = 0; u < PU; ++u) {
        const double ov = __shfl_up_sync(kFull, bv[u], d);
        const int oi = __shfl_up_sync(kFull, bi[u], d);
        if (lane - d >= seg[u]) keep_min(bv[u], bi[u], ov, oi);
      }
    }
#pragma unroll
    for (int u = 0; u < PU; ++u) {
      // The row continuing from the previous pass (no row start at bit 0): its lanes are those of
      // the first segment; the carried part has the lower indices.
      if ((e0 > 0 || u > 0) && !(word[u] & 1u) && seg[u] == 0) keep_min(bv[u], bi[u], cv, ci);
      if (valid[u] && i[u] == j[u] - 1) {  // the row's last pair: its minimum over R(j)
        cur[j[u]] = bv[u];
        optk[j[u]] = static_cast<std::int16_t>(bi[u]);
      }
      cv = __shfl_sync(kFull, bv[u], 31);
      ci = __shfl_sync(kFull, bi[u], 31);
    }
  }
  __syncwarp();
  bool mono = true;
  if (j0 < m) mono = optk[j0] <= optk[j0 + 1];
  if (j1 < m) mono = mono && optk[j1] <= optk[j1 + 1];
  return __all_sync(kFull, mono);
}

// fit13, second form: the same full-range minima g(j) (same proof, same fallback), but each lane
// takes a CONTIGUOUS chunk of ceil(pairs / 32) of the layer's (j, i) pairs in j-major order and
// scans it sequentially (the evaluations are independent: two are issued per step), keeping the
// running (value, index) minimum of its current row with the CPU's strict "<" in increasing i; a
// row that ends inside the chunk and started inside it is written directly. Rows that cross chunk
// boundaries are combined once per layer: a lane's outgoing partial (the minimum of the row that
// crosses its chunk's end) is its own partial, or, when its whole chunk lies inside a row that
// started before it ("pass-through"), the incoming partial combined with its own; that recurrence is
// one segmented (value, index) scan over the lanes (5 shuffle rounds); a lane whose first row started
// before its chunk and ends inside it combines the incoming partial (lower indices) with its own
// head minimum and writes the row. The (value, index) minimum is associative and commutative, so
// every row's result is the leftmost minimum over R(j) (the CPU's scan), whatever the chunking.
template <class S, class Cost>
__device__ bool dp_layer_chunk(S& s, int lane, int k, int m, const double* prev, double* cur, std::int16_t* optk,
                               const std::int16_t* lower, const Cost& cost) {
  FullScratch& fs = s.dp.full;
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

// dp_fit's layers 2..K-1 by the DP mode Dm (fit13; launch_warp_dp): 0 dp_layer (the divide and
// conquer level by level, fit12's kernels); 1 dp_layer_full for every layer; 2 dp_layer for layer
// 2 (no lower row: its full range is the whole triangle), dp_layer_full from layer 3; 3 (tests
// only) dp_layer_full and then ALWAYS dp_layer, the path a non-monotone layer takes; 4, 5: 1, 2
// with two passes per iteration (PU = 2); 6, 7: 1, 2 with dp_layer_chunk (a contiguous chunk of
// pairs per lane) instead of dp_layer_full; 8 (tests only): 6, then ALWAYS dp_layer. Returns 1
// when dp_layer reran a layer after the full-range form.
template <int Dm, int U, class S, class Cost>
__device__ __forceinline__ int dp_layer_mode(S& s, int lane, int k, int m, const double* prev, double* cur,
                                             std::int16_t* optk, const std::int16_t* lower, const Cost& cost) {
  static_assert(Dm >= 0 && Dm <= 8);
  if constexpr (Dm == 0) {
    dp_layer<U, 32>(s, lane, k, m, prev, cur, optk, lower, cost);
    return 0;
  } else {
    if ((Dm == 2 || Dm == 5 || Dm == 7) && k == 2) {
      dp_layer<U, 32>(s, lane, k, m, prev, cur, optk, lower, cost);
      return 0;
    }
    bool mono;
    if constexpr (Dm >= 6) mono = dp_layer_chunk(s, lane, k, m, prev, cur, optk, lower, cost);
    else mono = dp_layer_full<Dm >= 4 ? 2 : 1>(s, lane, k, m, prev, cur, optk, lower, cost);
    if (mono && Dm != 3 && Dm != 8) return 0;
    __syncwarp();
    dp_layer<U, 32>(s, lane, k, m, prev, cur, optk, lower, cost);
    return 1;
  }
}

// Arithmetic variant 3: the prefix sums, scaled to scale `from` (127: unscaled), rescaled to `to`
// in place (exact, see kArith).
template <bool Opt>
__device__ __forceinline__ void prescale(Smem<Opt>& s, int lane, int n, int from, int to) {
  const double f = pow2(from - to), f2 = f * f;
  for (int i = lane; i <= n; i += 32) {
    s.p[0][i] = s.p[0][i] * f;
    s.p[1][i] = s.p[1][i] * f2;
  }
  __syncwarp();
}

// dp.cpp dp_fit over m + 1 positions: the bin edges s.pos[0..m] (binned-dp) or every distinct value
// (optimal, m = n). Leaves s.K, s.entries, s.bounds and (optimal) s.cost = the DP minimum / inv^2.
// G: the lanes of the tile (32, or the half-warp of fit_pair_kernel, binned-dp only); `lane_w` is
// the warp lane.
// Dm: the DP mode of the layers (dp_layer_mode; binned-dp with G = 32 only). Returns the layers
// that dp_layer_full left to dp_layer (0 for Dm = 0).
template <int U, int Ar, bool Opt, int G = 32, int Dm = 0>
__device__ int dp_fit_warp(Smem<Opt>& s, int lane_w, int m, int scale) {
  static_assert(G == 32 || !Opt);
  static_assert(Dm == 0 || (G == 32 && !Opt));
  int reruns = 0;
  const unsigned gm = grp_mask<G>(lane_w);
  const int lane = lane_w & (G - 1);  // lane within the tile's lanes
  const double inv = pow2(127 - scale);
  const double inv2 = inv * inv;
  if constexpr (!Opt) {
    for (int i = lane; i <= m; i += G) {
      const int p = s.pos[i];
      s.dp.cd[i] = static_cast<double>(s.cnt[p]);
      s.dp.ci[i] = static_cast<std::int16_t>(s.cnt[p]);
      s.dp.s1[i] = Ar >= 3 ? s.p[0][p] : s.p[0][p] * inv;
      s.dp.s2[i] = Ar >= 3 ? s.p[1][p] : s.p[1][p] * inv2;
    }
    __syncwarp(gm);
  }
  auto cost = [&](int i, int j) {
    if constexpr (Opt) return cost_full<Ar>(s, i, j, inv, inv2);
    else return cost_bin<Ar>(s, i, j);
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
    for (int j = 1 + lane; j <= m; j += G) prev[j] = cost(0, j);
    __syncwarp(gm);
    for (int k = 2; k < K; ++k) {
      if constexpr (Dm == 0)
        dp_layer<U, G>(s, lane_w, k, m, prev, cur, s.dp.opt[k - 2], k > 2 ? s.dp.opt[k - 3] : nullptr, cost);
      else
        reruns += dp_layer_mode<Dm, U>(s, lane_w, k, m, prev, cur, s.dp.opt[k - 2], k > 2 ? s.dp.opt[k - 3] : nullptr, cost);
      __syncwarp(gm);
      double* t = prev;
      prev = cur;
      cur = t;
    }
    const int start = K > 2 ? s.dp.opt[K - 3][m] : K - 1;
    double bv = inf();
    int bi = INT_MAX;
    scan_min<U>(prev, start + lane, m - 1, G, m, cost, bv, bi);
    group_argmin(bv, bi, G, gm);
    if (lane == 0) {
      s.seg[K] = m;
      s.seg[K - 1] = bi;
      for (int k = K - 1; k >= 2; --k) s.seg[k - 1] = s.dp.opt[k - 2][s.seg[k]];
      s.seg[0] = 0;
      if constexpr (Opt) s.cost = bv / inv2;
    }
  }
  __syncwarp(gm);
  if constexpr (Opt) {
    if (lane <= K) s.bounds[lane] = s.seg[lane];
    if (lane < K) {
      const int i = s.seg[lane], j = s.seg[lane + 1];
      s.entries[lane] = run_entry(Ar >= 3 ? s.p[0][j] - s.p[0][i] : s.p[0][j] * inv - s.p[0][i] * inv,
                                  static_cast<double>(s.cnt[j]) - static_cast<double>(s.cnt[i]));
    }
  } else {
    if (lane <= K) s.bounds[lane] = s.pos[s.seg[lane]];
    if (lane < K) {
      const int i = s.seg[lane], j = s.seg[lane + 1];
      s.entries[lane] = run_entry(s.dp.s1[j] - s.dp.s1[i], s.dp.cd[j] - s.dp.cd[i]);
    }
  }
  if (lane == 0) s.K = K;
  __syncwarp(gm);
  return reruns;
}

// dp.cpp dp_refine with w = kWindow, rounds = kRounds, over n distinct values (binned-dp).
template <int Ar, int G = 32>
__device__ int dp_refine_warp(Smem<false>& s, int lane_w, int n, int scale) {
  const unsigned gm = grp_mask<G>(lane_w);
  const int lane = lane_w & (G - 1);  // lane within the tile's lanes
  const int K = s.K;
  const int m = n;
  if (K < 2 || K >= m) return 0;
  int rounds = 0;
  const double inv = pow2(127 - scale);
  const double inv2 = inv * inv;
  if (lane >= 1 && lane < K) s.wk[lane] = kWindow;
  for (int round = 0; round < kRounds; ++round) {
    ++rounds;
    if (lane >= 1 && lane < K) {
      const int b = s.bounds[lane];
      s.lo[lane] = max(b - s.wk[lane], lane);
      s.hi[lane] = min(b + s.wk[lane], m - (K - lane));
    }
    __syncwarp(gm);
    {
      const int l1 = s.lo[1], h1 = s.hi[1];
      for (int j = l1 + lane; j <= h1; j += G) s.rf.F[1][j - l1] = cost_full<Ar>(s, 0, j, inv, inv2);
    }
    __syncwarp(gm);
    for (int k = 2; k <= K; ++k) {
      const int jl = k < K ? s.lo[k] : m, jh = k < K ? s.hi[k] : m;
      const int il = s.lo[k - 1], ihm = s.hi[k - 1];
      const int nj = jh - jl + 1, ni = ihm - il + 1;
      const int tot = nj * ni;
      for (int idx = lane; idx < tot; idx += 2 * G) {  // two independent evaluations per lane and pass
        const int jj = idx / ni, ii = idx - jj * ni;
        const int idx2 = idx + G;
        const int jj2 = idx2 / ni, ii2 = idx2 - jj2 * ni;
        const bool ok1 = il + ii <= jl + jj - 1;
        const bool ok2 = idx2 < tot && il + ii2 <= jl + jj2 - 1;
        // (a valid dummy run where a slot is unused: its value is not stored)
        const double v1 = s.rf.F[k - 1][ok1 ? ii : 0] + cost_full<Ar>(s, ok1 ? il + ii : 0, ok1 ? jl + jj : 1, inv, inv2);
        const double v2 = s.rf.F[k - 1][ok2 ? ii2 : 0] + cost_full<Ar>(s, ok2 ? il + ii2 : 0, ok2 ? jl + jj2 : 1, inv, inv2);
        if (ok1) s.rf.V[jj][ii] = v1;
        if (ok2) s.rf.V[jj2][ii2] = v2;
      }
      __syncwarp(gm);
      for (int jj = lane; jj < nj; jj += G) {  // (nj <= 17: one pass for G = 32)
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
        if constexpr (G == 32) break;
      }
      __syncwarp(gm);
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
    __syncwarp(gm);
    if (!s.edge) break;
  }
  if (lane < K) {
    const int i = s.bounds[lane], j = s.bounds[lane + 1];
    s.entries[lane] = run_entry(Ar >= 3 ? s.p[0][j] - s.p[0][i] : s.p[0][j] * inv - s.p[0][i] * inv,
                                static_cast<double>(s.cnt[j]) - static_cast<double>(s.cnt[i]));
  }
  __syncwarp(gm);
  return rounds;
}

// optimal.cpp saturation_bound (lane 0; the CPU's order): a lower bound on the error at scale s.
__device__ double saturation_bound(Smem<true>& s, int n, int sc) {
  const double top = 448.0 * pow2(sc - 127);
  const float* u = s.su;
  double lb = 0.0;
  for (int i = 0; i < n && -static_cast<double>(u[i]) > top; ++i) {
    const double d = -static_cast<double>(u[i]) - top;
    lb += static_cast<double>(static_cast<int>(s.cnt[i + 1]) - static_cast<int>(s.cnt[i])) * (d * d);
  }
  for (int i = n - 1; i >= 0 && static_cast<double>(u[i]) > top; --i) {
    const double d = static_cast<double>(u[i]) - top;
    lb += static_cast<double>(static_cast<int>(s.cnt[i + 1]) - static_cast<int>(s.cnt[i])) * (d * d);
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

// tile_common.cpp encode_tile + assign_sse. Entries in s.entries[0..n_entries). Computes the
// tile's sse (the CPU's flat-order double sum) when `need_sse` or the caller wants the per-tile
// sums, returns it to every lane (0 when not computed), and writes the outputs only when
// !need_sse or sse < write_below (optimal's scale search: strictly better than the best so far).
// First part (all lanes): the codebook, every value's index into w, and, when `sums`, the terms of
// the two flat-order sums into the scratch rows 1..512 (row 0 sse, row 1 sum of squares).
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

template <bool Opt>
__device__ __forceinline__ void encode_assign(Smem<Opt>& s, int lane, const float (&x)[kIpt], int scale, int n_entries,
                                              bool sums, std::uint32_t (&w)[2]) {
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
}

// Last part (all lanes): writes the packed indices w, the codebook and the scale, and sse / ssq
// where o asks for them.
template <bool Opt>
__device__ __forceinline__ void encode_write(const Smem<Opt>& s, int lane, const std::uint32_t (&w)[2], int scale,
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

template <bool Opt>
__device__ double encode_warp(Smem<Opt>& s, int lane, const float (&x)[kIpt], int scale, int n_entries,
                              const TileOut& o, bool need_sse, double write_below) {
  const bool sums = need_sse || o.sse || o.ssq;
  std::uint32_t w[2];
  encode_assign(s, lane, x, scale, n_entries, sums, w);
  double sse = 0.0, ssq = 0.0;
  if (sums) {  // flat-order double sums in the scratch rows, lane 0 sse and lane 1 sum of squares
    double(*scr)[kN + 1] = s.scratch();
    __syncwarp();
    if (lane < 2 && (lane == 0 || o.ssq)) running_sum(scr[lane], kN);
    __syncwarp();
    sse = scr[0][kN];
    ssq = scr[1][kN];
    __syncwarp();  // (the scratch is reused by the caller's next step)
  }
  if (!need_sse || sse < write_below) encode_write(s, lane, w, scale, o, sse, ssq);
  __syncwarp();
  return sse;
}

__device__ __forceinline__ float load1(const void* src, int dtype, std::int64_t i) {
  if (dtype == 0) return static_cast<const float*>(src)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(src)[i];
  return dtype == 1 ? bf16_to_float(h) : fp16_to_float(h);
}

__device__ __forceinline__ float cvt16(std::uint16_t h, int dtype) {
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
          x[8 * v + 2 * h] = cvt16(static_cast<std::uint16_t>(wv[h] & 0xffffu), a.dtype);
          x[8 * v + 2 * h + 1] = cvt16(static_cast<std::uint16_t>(wv[h] >> 16), a.dtype);
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
// largest magnitude (all lanes). Used by the fit kernels and by check_kernel (the same code).
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

// Phase timing (the profiled instantiation only): lane 0 adds clock64() deltas per phase.
struct Prof {
  long long t = 0;
  long long c[kProfSlots] = {};
};
template <bool P>
__device__ __forceinline__ void phase(Prof& pr, int lane, int i) {
  if constexpr (P) {
    if (lane == 0) {
      const long long t = clock64();
      pr.c[i] += t - pr.t;
      pr.t = t;
    }
  }
}

__device__ __forceinline__ TileOut tile_out(const KernelArgs& a, std::int64_t lt) {
  return TileOut{a.out.packed + lt * kPackedBytes, a.out.codebook + lt * kCodebookSize, a.out.scale + lt,
                 a.out.sse ? a.out.sse + lt : nullptr, a.out.sum_sq ? a.out.sum_sq + lt : nullptr};
}

// First part of a tile's fit, the whole warp: load + check (a failing tile sets the error word),
// build_sorted (sort, de-duplication, the terms c * x and c * x^2 of every distinct value into
// s.p[.][1..n]). Returns false when the tile is done (error, or a.check_only); else n = the number
// of distinct values and am = the largest magnitude. The running sums are the caller's.
template <bool P, bool Opt, class S>
__device__ __forceinline__ bool fit_front_a(S& s, int lane, const KernelArgs& a, std::int64_t lt, Prof& pr,
                                            float (&x)[kIpt], float& am_out, int& n_out) {
  if constexpr (P) {
    if (lane == 0) pr.t = clock64();
  }
  load_tile(a, lt, lane, x);
  float am;
  if (!check_tile_warp(a, lt, lane, x, am)) return false;
  if (a.check_only) return false;
  phase<P>(pr, lane, 0);

  // tile_common.cpp build_sorted.
  float* const u = s.uv();
  {
    std::uint32_t keys[kIpt];
#pragma unroll
    for (int q = 0; q < kIpt; ++q) keys[q] = sort_key(x[q]);
    WarpSort(s.sort).Sort(keys, KeyLess());
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
  phase<P>(pr, lane, 1);
  const int n = s.m;
  if constexpr (!S::kCompact) {
    // The terms c * x and c * x^2 of every distinct value (independent: all lanes), then the running
    // sums in the CPU's order (lane 0 sum x, lane 1 sum x^2), loads batched ahead of the adds.
    for (int d = lane; d < n; d += 32) {
      const double c = static_cast<double>(s.cnt[d + 1] - s.cnt[d]);
      const double xd = static_cast<double>(u[d]);
      s.p[0][d + 1] = c * xd;
      s.p[1][d + 1] = c * (xd * xd);
    }
    __syncwarp();
  }
  am_out = am;
  n_out = n;
  return true;
}

// Second part, the whole warp, after the running sums (s.p, s.cnt complete): bin edges
// (binned-dp), the scale; all-zero tiles are encoded here. Returns true when the DP must run, with
// m = the DP's positions (bin edges, or n) and sc = the scale (prefix sums already scaled to it).
template <bool P, bool Opt, int Ar>
__device__ __forceinline__ bool fit_front_b(Smem<Opt>& s, int lane, const KernelArgs& a, std::int64_t lt, Prof& pr,
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
  phase<P>(pr, lane, 3);
  int sc;
  if (a.forced_scale >= 0) {
    sc = a.forced_scale;
  } else if (am == 0.0f) {
    if (lane == 0) s.entries[0] = 0x00;
    __syncwarp();
    encode_warp(s, lane, x, 127, 1, tile_out(a, lt), false, 0.0);
    phase<P>(pr, lane, 6);
    return false;
  } else {
    sc = max(static_cast<int>(ue8m0_rceil(am)), kMinScale);
  }
  if constexpr (Ar >= 3) prescale(s, lane, n, 127, sc);
  m_out = m;
  sc_out = sc;
  return true;
}

template <bool P, bool Opt, int U, int Ar, int Dm = 0>
__device__ __forceinline__ void fit_one(Smem<Opt>& s, int lane, const KernelArgs& a, std::int64_t lt, Prof& pr) {
  float x[kIpt];
  float am;
  int n, m, sc;
  if (!fit_front_a<P, Opt>(s, lane, a, lt, pr, x, am, n)) return;
  if (lane < 2) running_sum(s.p[lane], n);
  // (binned-dp: the other lanes go on to the bin edges, which read only cnt and sync before the DP)
  if constexpr (P || Opt) __syncwarp();
  phase<P>(pr, lane, 2);
  if (!fit_front_b<P, Opt, Ar>(s, lane, a, lt, pr, x, am, n, m, sc)) return;
  const TileOut o = tile_out(a, lt);
  const int reruns = dp_fit_warp<U, Ar, Opt, 32, Dm>(s, lane, m, sc);
  phase<P>(pr, lane, 4);
  int rounds = 0;  // refinement rounds (binned-dp), scales evaluated below the first (optimal)
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
        ++rounds;
        if constexpr (Ar >= 3) prescale(s, lane, n, t + 1, t);
        dp_fit_warp<U, Ar>(s, lane, m, t);
        if (s.cost > best * (1.0 + 1e-12)) continue;  // cannot beat the best even after reassigning
        const double e = encode_warp(s, lane, x, t, s.K, o, true, best);
        if (e < best) best = e;
      }
      phase<P>(pr, lane, 5);
    } else {
      phase<P>(pr, lane, 5);
      encode_warp(s, lane, x, sc, s.K, o, false, 0.0);
    }
  } else {
    if (m != n) rounds = dp_refine_warp<Ar>(s, lane, n, sc);
    phase<P>(pr, lane, 5);
    encode_warp(s, lane, x, sc, s.K, o, false, 0.0);
  }
  phase<P>(pr, lane, 6);
  if constexpr (P) {
    pr.c[kProfPhases] += 1;
    pr.c[kProfPhases + 1] += n;
    pr.c[kProfPhases + 2] += m;
    pr.c[kProfPhases + 3] += rounds;
    pr.c[kProfPhases + 4] += reruns;
  }
}

template <bool P, bool Opt, int U, int Ar, int Dm = 0>
__global__ void __launch_bounds__(32 * Cfg<Opt>::kWarps) fit_warp_kernel(KernelArgs a, unsigned long long* prof) {
  constexpr int kWarps = Cfg<Opt>::kWarps;
  __shared__ Smem<Opt> sm[kWarps];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kWarps;
  Prof pr;
  for (std::int64_t lt = static_cast<std::int64_t>(blockIdx.x) * kWarps + w; lt < a.tiles; lt += stride) {
    fit_one<P, Opt, U, Ar, Dm>(sm[w], lane, a, lt, pr);
    __syncwarp();
  }
  if constexpr (P) {
    if (lane == 0)
      for (int i = 0; i < kProfSlots; ++i) atomicAdd(prof + i, static_cast<unsigned long long>(pr.c[i]));
  }
}

// Binned-dp with TWO tiles per warp in the DP phase (issue 6, fit11): the warp runs the first part
// of both tiles (load, check, sort, de-duplication, terms) one after the other with all 32 lanes,
// their running sums at once (lanes 0-1 and 16-17), the bin edges and scales one after the other;
// then the DP (dp_fit_warp) and the refinement (dp_refine_warp) of tile 0 on lanes 0-15 and of
// tile 1 on lanes 16-31 at the same time (G = 16: every collective masked to the half, so the
// halves may diverge), and the two encodings with all lanes. Idle lanes of the level-by-level DP
// get the other tile's independent work; no comparison changes its order, so the bytes are the
// one-tile kernel's (tested against the CPU). Shared memory: two Smem per warp, one warp per block.
// PairRefine false: only the DP on the half-warps, each refinement then with all 32 lanes (for the
// benchmark's comparison).
template <int U, int Ar, bool PairRefine>
__global__ void __launch_bounds__(32) fit_pair_kernel(KernelArgs a) {
  __shared__ Smem<false> sm[2];
  const int lane = threadIdx.x & 31, half = lane >> 4, hl = lane & 15;
  const std::int64_t stride = 2 * static_cast<std::int64_t>(gridDim.x);
  Prof pr;
  for (std::int64_t l0 = 2 * static_cast<std::int64_t>(blockIdx.x); l0 < a.tiles; l0 += stride) {
    const bool two = l0 + 1 < a.tiles;
    float x0[kIpt], x1[kIpt];
    float am0 = 0.0f, am1 = 0.0f;
    int n0 = 0, n1 = 0, m0 = 0, m1 = 0, sc0 = 0, sc1 = 0;
    bool d0 = fit_front_a<false, false>(sm[0], lane, a, l0, pr, x0, am0, n0);
    bool d1 = two && fit_front_a<false, false>(sm[1], lane, a, l0 + 1, pr, x1, am1, n1);
    if (hl < 2 && (half ? d1 : d0)) running_sum(sm[half].p[hl], half ? n1 : n0);
    __syncwarp();
    d0 = d0 && fit_front_b<false, false, Ar>(sm[0], lane, a, l0, pr, x0, am0, n0, m0, sc0);
    d1 = d1 && fit_front_b<false, false, Ar>(sm[1], lane, a, l0 + 1, pr, x1, am1, n1, m1, sc1);
    if (half ? d1 : d0) {
      Smem<false>& s = sm[half];
      const int n = half ? n1 : n0, m = half ? m1 : m0, sc = half ? sc1 : sc0;
      dp_fit_warp<U, Ar, false, 16>(s, lane, m, sc);
      if constexpr (PairRefine) {
        if (m != n) dp_refine_warp<Ar, 16>(s, lane, n, sc);
      }
    }
    __syncwarp();
    if constexpr (!PairRefine) {
      if (d0 && m0 != n0) dp_refine_warp<Ar>(sm[0], lane, n0, sc0);
      if (d1 && m1 != n1) dp_refine_warp<Ar>(sm[1], lane, n1, sc1);
    }
    // Encoding: the assignments one after the other, the flat-order sums of both tiles at once
    // (lanes 0-1 tile 0, lanes 16-17 tile 1), then the writes.
    const bool sums = a.out.sse || a.out.sum_sq;
    std::uint32_t w0[2], w1[2];
    if (d0) encode_assign(sm[0], lane, x0, sc0, sm[0].K, sums, w0);
    if (d1) encode_assign(sm[1], lane, x1, sc1, sm[1].K, sums, w1);
    double sse0 = 0.0, ssq0 = 0.0, sse1 = 0.0, ssq1 = 0.0;
    if (sums) {
      __syncwarp();
      if (hl < 2 && (half ? d1 : d0) && (hl == 0 || a.out.sum_sq)) running_sum(sm[half].scratch()[hl], kN);
      __syncwarp();
      sse0 = sm[0].p[0][kN];
      ssq0 = sm[0].p[1][kN];
      sse1 = sm[1].p[0][kN];
      ssq1 = sm[1].p[1][kN];
    }
    if (d0) encode_write(sm[0], lane, w0, sc0, tile_out(a, l0), sse0, ssq0);
    if (d1) encode_write(sm[1], lane, w1, sc1, tile_out(a, l0 + 1), sse1, ssq1);
    __syncwarp();
  }
}

// ---------------------------------------------------------------------------------------------
// fit12: the COMPACT shared-memory layout of the binned-dp warp kernel (fit_compact_kernel), made
// to raise the resident warps per SM (the kernel is latency-bound per warp: docs/perf/fit-gpu.md,
// fit11). Layout 0 (Smem) keeps the prefix sums p[2][513] (8.2 KB of its 13.7 KB per warp) for
// the refinement and the encoding's flat-order sums. This one keeps only what the DP needs:
//  - the running sums (the CPU's order, lanes 0 and 1) go through a 256-position chunk in the
//    union (terms in, prefix sums out); after each chunk all lanes copy the prefix sums at the bin
//    edges (computed first: they need only the counts) into sp[] (x, x^2 together), scaled to the
//    tile's scale (the exact products prescale forms);
//  - per refinement round, the windows' prefix sums are RE-DERIVED in the CPU's order: a lane per
//    window and sum (at most 14) starts from the raw prefix sum at the nearest bin edge at or below
//    the window (sp / scale, exact) and adds the terms c * x (c * (x * x)) of the distinct values
//    u[], cnt[] one by one, exactly as build_sorted does, storing each sum times the scale (so
//    every value is the bit pattern that layout 0 reads from its prescaled p[]); the
//    window tables g[row][slot] (and the counts, cnt + lo) feed the evaluation loop through row
//    pointers computed per layer, so the loop has no extra index work;
//  - the refinement's F table keeps two rows (k - 1 and k), its arg rows k = 2..K;
//  - the encoding's two flat-order sums run over two 256-position halves of the same chunk (lanes
//    0-15, then 16-31, write their terms), the additions in flat order, so the same bits.
// Every comparison and every double operation is layout 0's in the same order (same bytes,
// tested). Why the values agree bit for bit: a prefix sum at a bin edge is the running sum itself,
// times the scale factor (exact: a power of two, every value in the normal range, see kArith); a
// re-derived window sum starts from that raw sum (the scaled one times 2^(s - 127), exact again)
// and adds the same terms in the same order as build_sorted, so it is the running sum's value at
// that position. 9,168 B per warp: 24 warps per SM fit in shared memory, 20 in registers without
// spilling (96; 24 need 80, where ptxas spills: layouts 2 and 4 of launch_warp_layout).
constexpr int kChunk = 256;
// fit16: the binned DP's run-cost table (DP modes 9..11 of launch_warp_dp): C(i, j) for the bin
// edges 1 <= i < j <= m, row j at ((j - 1) (j - 2)) / 2, at most kMaxEdges (kMaxEdges - 1) / 2
// doubles. m <= kMaxEdges = 46: binned_dp.cpp pushes at most 7 low-tail edges (cnt[i] < 8 with
// cnt strictly increasing: i = 1..7), 31 bin edges, 7 high-tail ones (cnt[i] > 504 with i < n:
// n - i <= 7) and n itself; tiles with n <= 32 distinct values have m = n.
constexpr int kMaxEdges = 7 + (kBins - 1) + 7 + 1;
constexpr int kTabMax = kMaxEdges * (kMaxEdges - 1) / 2;  // 1035
__host__ __device__ constexpr int tab_row(int j) { return ((j - 1) * (j - 2)) >> 1; }
// The compact layout's refinement tables (a member of its union).
struct RfC {
  double F[2][kWin];
  double V[kWin][kWin];        // V[j - jl][i - il] = F[k-1][i - il] + cost(i, j)
  double2 g[kCodebookSize][kWin];  // row k - 1: window k's prefix sums (x, x^2), scaled; window K = {n}
  std::int16_t arg[kCodebookSize - 1][kWin];  // rows k = 2..K
};
// The compact layout's DP tables (a member of its union).
struct DpC {
  std::int16_t ci[kMaxPos];    // the counts at the bin edges
  double buf[2][kMaxPos];
  std::int16_t opt[kOptRows][kMaxPos];
  Node nodes[2][32];
  FullScratch full;  // dp_layer_full (fit13)
};
// fit16's DP tables: DpC with the run-cost table; the divide and conquer's node lists share their
// bytes with dp_layer_chunk's scratch (a layer runs dp_layer_chunk, then, only when it falls back,
// dp_layer, which does not read the scratch; the next layer's dp_layer_chunk writes every roff[j]
// and rb[j] it reads, j in [k, m], before reading them).
struct DpCT {
  std::int16_t ci[kMaxPos];
  double buf[2][kMaxPos];
  std::int16_t opt[kOptRows][kMaxPos];
  union {
    Node nodes[2][32];
    FullScratch full;
  };
  double T[kTabMax];  // the run costs C(i, j), 1 <= i < j <= m, row j at tab_row(j)
};
// Where the table layout keeps the distinct values u[] in the union: above the chunk and the
// refinement tables, which are in use while u[] is (the running sums, the windows' sums); inside the
// DP tables, whose phase keeps u[] in registers instead (dp_fit_c saves and restores it); the sort's
// storage is dead when u[] is written.
inline constexpr int kUOff = static_cast<int>(((sizeof(RfC) > sizeof(double) * 2 * kChunk ? sizeof(RfC) : sizeof(double) * 2 * kChunk) + 15) / 16 * 16);
struct UinUnion {
  unsigned char pad[kUOff];
  float u[kN];
};
// Tab = false: fit12's compact layout (launch_warp_layout 1..4). Tab = true: fit16's table layout
// (DP modes 9..11): DpCT in the union and u[] inside the union at kUOff (2,048 B fewer outside it).
template <bool Tab>
struct SmemCT {
  static constexpr bool kCompact = true;
  static constexpr bool kTable = Tab;
  union {
    WarpSort::TempStorage sort;
    int lb[32];                    // lower bounds of the bin targets
    double chunk[2][kChunk];       // running sums' terms / prefix sums; encoding's flat-order terms
    std::conditional_t<Tab, DpCT, DpC> dp;
    RfC rf;
    std::conditional_t<Tab, UinUnion, char> uu;  // (Tab: u[])
  };
  double2 sp[kMaxPos];             // prefix sums (x, x^2) at the bin edges, scaled to the tile's scale
  float u[Tab ? 1 : kN];           // distinct values, ascending (+0 for zero); Tab: uu.u
  std::uint16_t cnt[kN + 1];       // prefix counts
  std::int16_t pos[kMaxPos];       // bin edges
  int seg[kCodebookSize + 1];
  int bounds[kCodebookSize + 1];
  std::int16_t lo[kCodebookSize], hi[kCodebookSize], wk[kCodebookSize];
  float cbv[kCodebookSize];
  std::uint8_t entries[kCodebookSize];
  std::uint8_t cbb[kCodebookSize];
  int m, K, edge;

  __device__ float* uv() {
    if constexpr (Tab) return uu.u;
    else return u;
  }
};
static_assert(kUOff + sizeof(float) * kN <= sizeof(DpCT), "u[] must lie inside the table layout's DP tables");
using SmemC = SmemCT<false>;
static_assert(!SmemC::kTable);
static_assert(sizeof(SmemC) == 9168, "the compact layout's size (fit12) must not change with fit16's table");


// binned_dp.cpp's bin edges into s.pos[0..m] (the default layout's code, fit_front_b); returns m.
template <class SC>
__device__ __forceinline__ int bin_edges_c(SC& s, int lane, int n) {
  if (n <= kBins) {
    if (lane <= n) s.pos[lane] = static_cast<std::int16_t>(lane);
    if (n == 32 && lane == 0) s.pos[32] = 32;
    __syncwarp();
    return n;
  }
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
      if (e > s.pos[mm] && e < n) s.pos[++mm] = static_cast<std::int16_t>(e);
    };
    for (; i < s.lb[0]; ++i) push(i);
    for (int b = 1; b < kBins; ++b) {
      i = max(i, s.lb[b]);
      push(i);
    }
    for (i = max(i, lb_end); i < n; ++i) push(i);
    s.pos[++mm] = static_cast<std::int16_t>(n);
    s.m = mm;
  }
  __syncwarp();
  return s.m;
}

// P[d] = acc + P[0] + ... + P[d] in place for d = 0..len-1 (a double running sum, in order, from
// acc); returns the last sum.
__device__ __forceinline__ double running_sum_from(double* P, int len, double acc) {
  int d = 0;
  for (; d + 7 < len; d += 8) {
    double t[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) t[r] = P[d + r];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      acc = acc + t[r];
      P[d + r] = acc;
    }
  }
  for (; d < len; ++d) {
    acc = acc + P[d];
    P[d] = acc;
  }
  return acc;
}

// acc + P[0] + ... + P[len - 1] in order.
__device__ __forceinline__ double sum_from(const double* P, int len, double acc) {
  int d = 0;
  for (; d + 7 < len; d += 8) {
    double t[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) t[r] = P[d + r];
#pragma unroll
    for (int r = 0; r < 8; ++r) acc = acc + t[r];
  }
  for (; d < len; ++d) acc = acc + P[d];
  return acc;
}

// build_sorted's prefix sums (p[d + 1] = p[d] + c * x, p2[d + 1] = p2[d] + c * (x * x), in order)
// at the bin edges s.pos[0..m], times f = 2^(127 - sc) (f2 = f^2) into s.sp: the values the
// default layout's DP tables hold after prescale.
template <class SC>
__device__ __forceinline__ void edge_sums_c(SC& s, int lane, int n, int m, double f, double f2) {
  double acc = 0.0;  // lane 0: sum of c * x; lane 1: sum of c * x^2
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    const int len = min(kChunk, n - c0);
    for (int d = lane; d < len; d += 32) {
      const int dd = c0 + d;
      const double c = static_cast<double>(s.cnt[dd + 1] - s.cnt[dd]);
      const double xd = static_cast<double>(s.uv()[dd]);
      s.chunk[0][d] = c * xd;
      s.chunk[1][d] = c * (xd * xd);
    }
    __syncwarp();
    if (lane < 2) acc = running_sum_from(s.chunk[lane], len, acc);  // chunk[.][d] = p[c0 + d + 1]
    __syncwarp();
    for (int e = lane; e <= m; e += 32) {
      const int P = s.pos[e];
      if (P > c0 && P <= c0 + len) s.sp[e] = make_double2(s.chunk[0][P - 1 - c0] * f, s.chunk[1][P - 1 - c0] * f2);
      else if (P == 0 && c0 == 0) s.sp[e] = make_double2(0.0, 0.0);
    }
    __syncwarp();
  }
}

// dp.cpp Dp::cost on the bin-edge tables of the compact layout.
template <class SC>
__device__ __forceinline__ double cost_bin_c(const SC& s, int i, int j) {
  const double2 pj = s.sp[j], pi = s.sp[i];
  return cost_of<3>(s.dp.ci[j] - s.dp.ci[i], pj.x - pi.x, pj.y - pi.y);
}

// fit16: fills the run-cost table s.dp.T with C(i, j) = cost_bin_c(s, i, j) for every pair of bin
// edges 1 <= i < j <= m in one pass over the flat index e = tab_row(j) + i - 1, all lanes busy (two
// independent evaluations per lane and step, no levels, no divergence but the last step's). Each
// entry is the very double cost_bin_c returns (the same function on the same inputs), so a DP that
// reads the table makes the same comparisons on the same bits as one that evaluates.
template <class SC>
__device__ __forceinline__ void fill_cost_table(SC& s, int lane, int m) {
  const int tot = tab_row(m + 1);  // m (m - 1) / 2
  // (r, j): flat index -> row j >= 2 and r = i - 1 in [0, j - 2]
  auto norm = [](int& r, int& j) {
    while (r >= j - 1) {
      r -= j - 1;
      ++j;
    }
  };
  int ja = 2, ra = lane;
  norm(ra, ja);
  int jb = ja, rb = ra + 32;
  norm(rb, jb);
  for (int e = lane; e < tot; e += 64) {
    const bool okb = e + 32 < tot;  // (otherwise a valid dummy run, (ra + 1, ja), not stored)
    const double va = cost_bin_c(s, ra + 1, ja);
    const double vb = cost_bin_c(s, okb ? rb + 1 : ra + 1, okb ? jb : ja);
    s.dp.T[e] = va;
    if (okb) s.dp.T[e + 32] = vb;
    ra = rb + 32;
    ja = jb;
    norm(ra, ja);
    rb = ra + 32;
    jb = ja;
    norm(rb, jb);
  }
  __syncwarp();
}

// dp_fit_c's layers 2..K-1, the last layer and the trace-back with the run cost `cost` and the
// layer mode Dl (dp_layer_mode).
template <int Dl, class SC, class Cost>
__device__ __forceinline__ int dp_layers_c(SC& s, int lane, int m, int K, const Cost& cost) {
  int reruns = 0;
  double* prev = s.dp.buf[0];
  double* cur = s.dp.buf[1];
  for (int j = 1 + lane; j <= m; j += 32) prev[j] = cost_bin_c(s, 0, j);
  __syncwarp();
  for (int k = 2; k < K; ++k) {
    reruns += dp_layer_mode<Dl, kUnroll<false>>(s, lane, k, m, prev, cur, s.dp.opt[k - 2], k > 2 ? s.dp.opt[k - 3] : nullptr, cost);
    __syncwarp();
    double* t = prev;
    prev = cur;
    cur = t;
  }
  const int start = K > 2 ? s.dp.opt[K - 3][m] : K - 1;
  double bv = inf();
  int bi = INT_MAX;
  scan_min<kUnroll<false>>(prev, start + lane, m - 1, 32, m, cost, bv, bi);
  group_argmin(bv, bi, 32);
  if (lane == 0) {
    s.seg[K] = m;
    s.seg[K - 1] = bi;
    for (int k = K - 1; k >= 2; --k) s.seg[k - 1] = s.dp.opt[k - 2][s.seg[k]];
    s.seg[0] = 0;
  }
  return reruns;
}

// dp_fit_warp for binned-dp on the compact layout (same operations, in the same order).
// Dm: the layer mode of dp_layer_mode (0..3, 6..8), or fit16's table modes: the run costs of every
// pair of bin edges computed once into s.dp.T (fill_cost_table; the layers do not depend on them,
// so every layer reads the same entries), then the layers as min-plus rows over the table: 9 with
// dp_layer_chunk's full ranges (mode 6's division, its monotonicity check and fallback), 10 with
// the divide and conquer level by level (mode 0's), 11 (tests) with 6's and then always the
// fallback (mode 8's). The table holds cost_bin_c's bits, so 9 / 10 / 11 make exactly the
// comparisons of 6 / 0 / 8 on the same values: the same bytes (the equality of 6 and 0 with the CPU:
// dp_layer_full's proof). Layer 1 (start 0) evaluates directly: column 0 is not stored.
template <int Dm, class SC>
__device__ int dp_fit_c(SC& s, int lane, int m) {
  int reruns = 0;
  for (int i = lane; i <= m; i += 32) s.dp.ci[i] = static_cast<std::int16_t>(s.cnt[s.pos[i]]);
  __syncwarp();
  const int K = min(m, kCodebookSize);
  if (K == m) {
    if (lane <= m) s.seg[lane] = lane;
  } else if constexpr (Dm >= 9) {
    static_assert(SC::kTable, "fit16's DP modes need the table layout");
    // (diagnostics, fit16 run 2: 13 the table layout without the table, mode 0's DP evaluating;
    // 14 the table filled but not read, mode 0's DP evaluating)
    constexpr bool kFill = Dm != 13, kRead = Dm <= 11;
    // u[] lies inside the table: kept in registers over the DP (16 values a lane, all 512 slots).
    float4 us[kIpt / 4];
    if constexpr (kFill) {
      const float4* u4 = reinterpret_cast<const float4*>(s.uv()) + (kIpt / 4) * lane;
#pragma unroll
      for (int q = 0; q < kIpt / 4; ++q) us[q] = u4[q];
      __syncwarp();
      fill_cost_table(s, lane, m);
    }
    if constexpr (kRead) {
      const double* T = s.dp.T;
      auto cost = [T](int i, int j) { return T[tab_row(j) + i - 1]; };  // (i >= 1 in layers 2..K)
      constexpr int Dl = Dm == 9 ? 6 : Dm == 10 ? 0 : 8;
      reruns = dp_layers_c<Dl>(s, lane, m, K, cost);
    } else {
      auto cost = [&](int i, int j) { return cost_bin_c(s, i, j); };
      reruns = dp_layers_c<0>(s, lane, m, K, cost);
    }
    if constexpr (kFill) {
      __syncwarp();
      float4* w4 = reinterpret_cast<float4*>(s.uv()) + (kIpt / 4) * lane;
#pragma unroll
      for (int q = 0; q < kIpt / 4; ++q) w4[q] = us[q];
    }
  } else {
    auto cost = [&](int i, int j) { return cost_bin_c(s, i, j); };
    reruns = dp_layers_c<Dm>(s, lane, m, K, cost);
  }
  __syncwarp();
  if (lane <= K) s.bounds[lane] = s.pos[s.seg[lane]];
  if (lane < K) {
    const int i = s.seg[lane], j = s.seg[lane + 1];
    // (cd[j] - cd[i] of the default layout: the same exact integer)
    s.entries[lane] = run_entry(s.sp[j].x - s.sp[i].x, static_cast<double>(s.dp.ci[j] - s.dp.ci[i]));
  }
  if (lane == 0) s.K = K;
  __syncwarp();
  return reruns;
}

// The windows' prefix sums of one refinement round (windows k = 1..K-1 in s.lo / s.hi): lane
// 2 (k - 1) + w re-derives sum w (0: c * x, 1: c * x^2) over window k in build_sorted's order from
// the nearest bin edge at or below s.lo[k] (its raw sum = sp / f, exact), storing each sum times f
// (f2), i.e. p[.] * f as prescale forms it. Window K = {n} goes to row K - 1.
template <class SC>
__device__ __forceinline__ void window_sums_c(SC& s, int lane, int K, int me, int scale) {
  if (lane < 2 * (K - 1)) {
    const double f = pow2(127 - scale), f2 = f * f;  // (prescale's factors)
    const double fi = pow2(scale - 127), fi2 = fi * fi;
    const int k = 1 + (lane >> 1), w = lane & 1;
    const int lo = s.lo[k], hi = s.hi[k];
    int a = 0, b = me;  // the largest edge e with pos[e] <= lo (pos[0] = 0)
    while (a < b) {
      const int mid = (a + b + 1) >> 1;
      if (s.pos[mid] <= lo) a = mid;
      else b = mid - 1;
    }
    int q = s.pos[a];
    const double sc = w ? f2 : f;
    double acc = w ? s.sp[a].y * fi2 : s.sp[a].x * fi;  // the raw prefix sum at q
    double* gw = reinterpret_cast<double*>(&s.rf.g[k - 1][0]) + w;
    for (; q < lo; ++q) {
      const double c = static_cast<double>(s.cnt[q + 1] - s.cnt[q]);
      const double xd = static_cast<double>(s.uv()[q]);
      acc = acc + (w ? c * (xd * xd) : c * xd);
    }
    gw[0] = acc * sc;
    for (int t = 2; q < hi; ++q, t += 2) {
      const double c = static_cast<double>(s.cnt[q + 1] - s.cnt[q]);
      const double xd = static_cast<double>(s.uv()[q]);
      acc = acc + (w ? c * (xd * xd) : c * xd);
      gw[t] = acc * sc;
    }
  }
  if (lane == 31) s.rf.g[K - 1][0] = s.sp[me];
}

// dp.cpp dp_refine on the compact layout (dp_refine_warp's operations in the same order; the
// costs read the window tables).
template <class SC>
__device__ int dp_refine_c(SC& s, int lane, int n, int me, int scale) {
  const int K = s.K;
  const int m = n;
  if (K < 2 || K >= m) return 0;
  int rounds = 0;
  if (lane >= 1 && lane < K) s.wk[lane] = kWindow;
  for (int round = 0; round < kRounds; ++round) {
    ++rounds;
    if (lane >= 1 && lane < K) {
      const int b = s.bounds[lane];
      s.lo[lane] = static_cast<std::int16_t>(max(b - s.wk[lane], lane));
      s.hi[lane] = static_cast<std::int16_t>(min(b + s.wk[lane], m - (K - lane)));
    }
    __syncwarp();
    window_sums_c(s, lane, K, me, scale);
    __syncwarp();
    {
      const int nj1 = s.hi[1] - s.lo[1] + 1;
      for (int jj = lane; jj < nj1; jj += 32) {  // (cost(0, j): p[0] = 0, cnt[0] = 0)
        const double2 pj = s.rf.g[0][jj];
        s.rf.F[1][jj] = cost_of<3>(static_cast<int>(s.cnt[s.lo[1] + jj]) - 0, pj.x - 0.0, pj.y - 0.0);
      }
    }
    __syncwarp();
    for (int k = 2; k <= K; ++k) {
      const int jl = k < K ? s.lo[k] : m, jh = k < K ? s.hi[k] : m;
      const int il = s.lo[k - 1], ihm = s.hi[k - 1];
      const int nj = jh - jl + 1, ni = ihm - il + 1;
      const int tot = nj * ni;
      const double2* gI = s.rf.g[k - 2];
      const double2* gJ = gI + kWin;
      const std::uint16_t* cJ = s.cnt + jl;
      const std::uint16_t* cI = s.cnt + il;
      const double* Fp = s.rf.F[(k - 1) & 1];
      double* Fc = s.rf.F[k & 1];
      for (int idx = lane; idx < tot; idx += 64) {  // two independent evaluations per lane and pass
        const int jj = idx / ni, ii = idx - jj * ni;
        const int idx2 = idx + 32;
        const int jj2 = idx2 / ni, ii2 = idx2 - jj2 * ni;
        const bool ok1 = il + ii <= jl + jj - 1;
        const bool ok2 = idx2 < tot && il + ii2 <= jl + jj2 - 1;
        // (a valid dummy run where a slot is unused, (lo[k-1], hi[k]): its value is not stored)
        const int a1 = ok1 ? ii : 0, b1 = ok1 ? jj : nj - 1, a2 = ok2 ? ii2 : 0, b2 = ok2 ? jj2 : nj - 1;
        const double2 pj1 = gJ[b1], pi1 = gI[a1], pj2 = gJ[b2], pi2 = gI[a2];
        const double v1 = Fp[a1] + cost_of<3>(static_cast<int>(cJ[b1]) - static_cast<int>(cI[a1]), pj1.x - pi1.x, pj1.y - pi1.y);
        const double v2 = Fp[a2] + cost_of<3>(static_cast<int>(cJ[b2]) - static_cast<int>(cI[a2]), pj2.x - pi2.x, pj2.y - pi2.y);
        if (ok1) s.rf.V[jj][ii] = v1;
        if (ok2) s.rf.V[jj2][ii2] = v2;
      }
      __syncwarp();
      if (lane < nj) {  // (nj <= 17)
        const int jj = lane;
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
        Fc[jj] = best;
        s.rf.arg[k - 2][jj] = static_cast<std::int16_t>(bi);
      }
      __syncwarp();
    }
    if (lane == 0) {
      int* nb = s.seg;  // (free here: dp_fit_c's boundaries are in s.bounds)
      nb[K] = m;
      nb[0] = 0;
      for (int k = K; k >= 2; --k) nb[k - 1] = s.rf.arg[k - 2][nb[k] - (k < K ? s.lo[k] : m)];
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
  if (lane < K) {  // the bounds lie in this round's windows (0 and n at the ends)
    const int i = s.bounds[lane], j = s.bounds[lane + 1];
    const double pi = lane == 0 ? 0.0 : s.rf.g[lane - 1][i - s.lo[lane]].x;
    const double pj = s.rf.g[lane][lane + 1 == K ? 0 : j - s.lo[lane + 1]].x;
    s.entries[lane] = run_entry(pj - pi, static_cast<double>(s.cnt[j]) - static_cast<double>(s.cnt[i]));
  }
  __syncwarp();
  return rounds;
}

// encode_warp (need_sse false) on the compact layout: the flat-order sums over two halves of the
// chunk (flat positions 0..255 from lanes 0-15, then 256..511 from lanes 16-31), in order.
template <class SC>
__device__ void encode_c(SC& s, int lane, const float (&x)[kIpt], int scale, int n_entries, const TileOut& o) {
  if (lane == 0) build_codebook(s, scale, n_entries);
  __syncwarp();
  float cb[kCodebookSize], mid[kCodebookSize];
#pragma unroll
  for (int j = 0; j < kCodebookSize; ++j) cb[j] = s.cbv[j];
  mid[0] = __int_as_float(0x7f800000);
#pragma unroll
  for (int j = 1; j < kCodebookSize; ++j)
    mid[j] = cb[j] != cb[j - 1] ? 0.5f * cb[j - 1] + 0.5f * cb[j] : __int_as_float(0x7f800000);
  std::uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int q = 0; q < kIpt; ++q) {
    const float xv = x[q];
    int idx = 0;
#pragma unroll
    for (int j = 1; j < kCodebookSize; ++j)
      if (xv > mid[j]) idx = j;
    w[q >> 3] |= static_cast<std::uint32_t>(idx) << (3 * (q & 7));
  }
  double sse = 0.0, ssq = 0.0;
  if (o.sse || o.ssq) {
    double acc = 0.0;  // lane 0: sse, lane 1: sum of squares
    for (int h = 0; h < 2; ++h) {
      if ((lane >> 4) == h) {
#pragma unroll
        for (int q = 0; q < kIpt; ++q) {
          // (the value of the run of slot idx is cb[idx], as encode_assign's val)
          const float val = s.cbv[(w[q >> 3] >> (3 * (q & 7))) & 7u];
          const double d = static_cast<double>(x[q]) - static_cast<double>(val);
          const double xd = static_cast<double>(x[q]);
          s.chunk[0][kIpt * (lane & 15) + q] = d * d;
          s.chunk[1][kIpt * (lane & 15) + q] = xd * xd;
        }
      }
      __syncwarp();
      if (lane < 2 && (lane == 0 || o.ssq)) acc = sum_from(s.chunk[lane], kChunk, acc);
      __syncwarp();
    }
    sse = __shfl_sync(kFull, acc, 0);
    ssq = __shfl_sync(kFull, acc, 1);
  }
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
  __syncwarp();
}

// Reload: the tile's values are read again from global memory for the encoding instead of being
// kept in 16 registers over the DP and the refinement.
template <bool Reload, int Dm, class SC>
__device__ __forceinline__ void fit_one_c(SC& s, int lane, const KernelArgs& a, std::int64_t lt) {
  float x[kIpt];
  float am;
  int n;
  Prof pr;
  if (!fit_front_a<false, false>(s, lane, a, lt, pr, x, am, n)) return;
  int sc;
  if (a.forced_scale >= 0) {
    sc = a.forced_scale;
  } else if (am == 0.0f) {
    if (lane == 0) s.entries[0] = 0x00;
    __syncwarp();
    encode_c(s, lane, x, 127, 1, tile_out(a, lt));
    return;
  } else {
    sc = max(static_cast<int>(ue8m0_rceil(am)), kMinScale);
  }
  const int me = bin_edges_c(s, lane, n);
  const double f = pow2(127 - sc);
  edge_sums_c(s, lane, n, me, f, f * f);
  dp_fit_c<Dm>(s, lane, me);
  if (me != n) dp_refine_c(s, lane, n, me, sc);
  if constexpr (Reload) load_tile(a, lt, lane, x);  // (the same values, read again: x is dead over the DP)
  encode_c(s, lane, x, sc, s.K, tile_out(a, lt));
}

// W warps per block (2 or 4: static shared memory under 48 KiB); MinWarps: the resident warps per
// SM asked of the compiler (__launch_bounds__: 20 -> <= 96 registers, 24 -> <= 80).
template <int W, int MinWarps, bool Reload, int Dm = 0>
__global__ void __launch_bounds__(32 * W, MinWarps / W) fit_compact_kernel(KernelArgs a) {
  __shared__ SmemCT<(Dm >= 9)> sm[W];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * W;
  for (std::int64_t lt = static_cast<std::int64_t>(blockIdx.x) * W + w; lt < a.tiles; lt += stride) {
    fit_one_c<Reload, Dm>(sm[w], lane, a, lt);
    __syncwarp();
  }
}

template <int W, int MinWarps, bool Reload, int Dm = 0>
void launch_compact(const KernelArgs& a, cudaStream_t stream) {
  const std::int64_t blocks = std::min<std::int64_t>((a.tiles + W - 1) / W, std::int64_t{1} << 22);
  fit_compact_kernel<W, MinWarps, Reload, Dm><<<static_cast<unsigned>(blocks), 32 * W, 0, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("quantize_gpu: kernel launch: ") + cudaGetErrorString(e));
}

template <bool P, bool Opt, int U = kUnroll<Opt>, int Ar = kArith, int Dm = 0>
void launch_t(const KernelArgs& a, unsigned long long* d_prof, cudaStream_t stream, const char* who) {
  constexpr int kWarps = Cfg<Opt>::kWarps;
  const std::int64_t blocks = std::min<std::int64_t>((a.tiles + kWarps - 1) / kWarps, std::int64_t{1} << 22);
  fit_warp_kernel<P, Opt, U, Ar, Dm><<<static_cast<unsigned>(blocks), 32 * kWarps, 0, stream>>>(a, d_prof);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(who) + cudaGetErrorString(e));
}

// fit17: launch_warp_shape's kernels (fit_internal.cuh; launchers in fit_dp_modes_s.cu and
// fit_dp_modes_st.cu). The tile loop of a warp of a W-warp block: tile g = blockIdx.x * W + warp
// first, then g + G (G = gridDim.x * W: the stride; with one block per W tiles it ends after one
// tile, as in fit_warp_kernel / fit_compact_kernel) or, with ctr, G + the counter's next value,
// fetched by lane 0 before the current tile's fit and read (shuffled) after it, so the atomic's
// latency is hidden behind the fit. Each tile value is taken once (the counter's values are
// distinct), every tile < a.tiles is taken (warp g takes g < G; the counter hands out G, G + 1, ...
// until a warp receives one >= a.tiles and stops), and a tile's outputs depend only on the tile.
template <int W, class Fit>
__device__ __forceinline__ void shape_tiles(const KernelArgs& a, unsigned long long* ctr, Fit&& fit) {
  const int lane = threadIdx.x & 31;
  const std::int64_t G = static_cast<std::int64_t>(gridDim.x) * W;
  std::int64_t lt = static_cast<std::int64_t>(blockIdx.x) * W + (threadIdx.x >> 5);
  while (lt < a.tiles) {
    unsigned long long t = 0;
    if (ctr != nullptr && lane == 0) t = atomicAdd(ctr, 1ull);
    fit(lt);
    __syncwarp();
    lt = ctr != nullptr ? G + static_cast<std::int64_t>(__shfl_sync(kFull, t, 0)) : lt + G;
  }
}
// The per-warp shared memory lives in dynamic shared memory (the launcher opts in to more than 48 KiB).
extern __shared__ __align__(16) unsigned char g_shape_smem[];
// Layout 0 (fit_one, Smem<false>): compiled for 16 resident warps per SM (the static kernel's).
template <int W, int Dm>
__global__ void __launch_bounds__(32 * W, 16 / W) fit_shape0_kernel(KernelArgs a, unsigned long long* ctr) {
  Smem<false>& s = reinterpret_cast<Smem<false>*>(g_shape_smem)[threadIdx.x >> 5];
  const int lane = threadIdx.x & 31;
  Prof pr;
  shape_tiles<W>(a, ctr, [&](std::int64_t lt) { fit_one<false, false, kUnroll<false>, kArith, Dm>(s, lane, a, lt, pr); });
}
// The compact layouts (fit_one_c; SmemC, or SmemCT<true> for the table modes Dm >= 9), compiled for
// MinWarps resident warps per SM.
template <int W, int MinWarps, int Dm>
__global__ void __launch_bounds__(32 * W, MinWarps / W) fit_shapec_kernel(KernelArgs a, unsigned long long* ctr) {
  SmemCT<(Dm >= 9)>& s = reinterpret_cast<SmemCT<(Dm >= 9)>*>(g_shape_smem)[threadIdx.x >> 5];
  const int lane = threadIdx.x & 31;
  shape_tiles<W>(a, ctr, [&](std::int64_t lt) { fit_one_c<false, Dm>(s, lane, a, lt); });
}
// Launches `kernel` (W warps per block, smem_per_warp bytes of dynamic shared memory per warp) as
// launch_warp_shape's `grid` says; `who` prefixes a CUDA error.
template <class K>
void launch_shape_kernel(K* kernel, int W, std::size_t smem_per_warp, const KernelArgs& a, int grid,
                         unsigned long long* ctr, cudaStream_t stream, int max_blocks) {
  const std::size_t smem = smem_per_warp * static_cast<std::size_t>(W);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  std::int64_t blocks = std::min<std::int64_t>((a.tiles + W - 1) / W, std::int64_t{1} << 22);
  if (e == cudaSuccess && grid != kGridPerTile) {
    int dev = 0, sms = 0, per_sm = 0;
    e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 32 * W, smem);
    blocks = std::min<std::int64_t>(blocks, std::max<std::int64_t>(1, static_cast<std::int64_t>(per_sm) * sms));
    if (max_blocks > 0) blocks = std::min<std::int64_t>(blocks, max_blocks);
  }
  if (e == cudaSuccess && grid == kGridAtomic) e = cudaMemsetAsync(ctr, 0, sizeof(*ctr), stream);
  if (e == cudaSuccess) {
    kernel<<<static_cast<unsigned>(blocks), 32 * W, smem, stream>>>(a, grid == kGridAtomic ? ctr : nullptr);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) throw std::runtime_error(std::string("launch_warp_shape: ") + cudaGetErrorString(e));
}
// Resident warps per SM of a shape kernel (occupancy calculator with its dynamic shared memory).
template <class K>
int resident_shape(K* kernel, int W, std::size_t smem_per_warp) {
  const std::size_t smem = smem_per_warp * static_cast<std::size_t>(W);
  int blocks = 0;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, 32 * W, smem);
  return e == cudaSuccess ? blocks * W : -1;
}

}  // namespace

// fit_dp_modes.cu includes this file with LUTB_FIT_DP_MODES_TU defined, for the kernels and
// launchers of fit13's DP modes (launch_warp_dp): a second translation unit, compiled in parallel.
#ifndef LUTB_FIT_DP_MODES_TU
void launch_warp(const KernelArgs& a, cudaStream_t stream) {
  if (a.tiles == 0) return;
  // (the tile check alone is the same code in both instantiations: the smaller one runs it)
  if (a.optimal && !a.check_only) launch_t<false, true>(a, nullptr, stream, "quantize_gpu: kernel launch: ");
  else if (a.check_only) launch_t<false, false>(a, nullptr, stream, "quantize_gpu: kernel launch: ");
  else if (a.out.sse || a.out.sum_sq)
    launch_warp_shape(a, kWarpLayoutDefault, kWarpDpDefault, kWarpBlockDefault, kGridPerTile, nullptr, stream);
  else launch_warp_shape(a, kWarpLayoutBytesOnly, kWarpDpBytesOnly, kWarpBlockDefault, kGridPerTile, nullptr, stream);
}

void launch_warp_layout(const KernelArgs& a, int layout, cudaStream_t stream) {
  if (layout < 0 || layout > 4)
    throw std::invalid_argument("launch_warp_layout: layout must be 0..4, not " + std::to_string(layout));
  if (a.tiles == 0) return;
  if (a.optimal || a.check_only) return launch_warp(a, stream);
  if (layout == 0) launch_t<false, false>(a, nullptr, stream, "quantize_gpu: kernel launch: ");
  else if (layout == 1) launch_compact<4, 20, false>(a, stream);
  else if (layout == 2) launch_compact<4, 24, false>(a, stream);
  else if (layout == 3) launch_compact<2, 20, false>(a, stream);
  else launch_compact<2, 24, true>(a, stream);
}

void launch_warp_profiled(const KernelArgs& a, unsigned long long* d_prof, cudaStream_t stream, int arith,
                          int dp_mode) {
  if (a.tiles == 0) return;
  const char* who = "profile kernel launch: ";
  if (arith != kArith && !(arith == 0 && !a.optimal))
    throw std::invalid_argument("launch_warp_profiled: arith must be the default, or 0 for binned-dp");
  if (dp_mode != 0) {
    if (a.optimal || arith != kArith)
      throw std::invalid_argument("launch_warp_profiled: dp_mode other than 0 only for binned-dp with the default arithmetic");
    return launch_warp_profiled_dp(a, d_prof, dp_mode, stream);
  }
  if (a.optimal) launch_t<true, true>(a, d_prof, stream, who);
  else if (arith == 0) launch_t<true, false, kUnroll<false>, 0>(a, d_prof, stream, who);
  else launch_t<true, false>(a, d_prof, stream, who);
}

void launch_warp_variant(const KernelArgs& a, int unroll, int arith, cudaStream_t stream) {
  if (a.tiles == 0) return;
  const int du = a.optimal ? kUnroll<true> : kUnroll<false>;
  if (a.check_only || (unroll == du && arith == kArith)) return launch_warp(a, stream);
  const char* who = "warp kernel variant launch: ";
  if (arith == kArith) {
    if (unroll != 1 && unroll != 2 && unroll != 4)
      throw std::invalid_argument("launch_warp_variant: unroll must be 1, 2 or 4");
    if (a.optimal) {
      if (unroll == 1) launch_t<false, true, 1>(a, nullptr, stream, who);
      else launch_t<false, true, 2>(a, nullptr, stream, who);  // (4 is the default)
    } else {
      if (unroll == 2) launch_t<false, false, 2>(a, nullptr, stream, who);
      else launch_t<false, false, 4>(a, nullptr, stream, who);  // (1 is the default)
    }
    return;
  }
  if (unroll != du || arith < 0 || arith > 2 || (a.optimal && arith == 1))
    throw std::invalid_argument(
        "launch_warp_variant: other arithmetic only with the default unroll: arith 0, 2 (both fitters) or 1 (binned-dp)");
  if (a.optimal) {
    if (arith == 0) launch_t<false, true, kUnroll<true>, 0>(a, nullptr, stream, who);
    else launch_t<false, true, kUnroll<true>, 2>(a, nullptr, stream, who);
  } else {
    if (arith == 0) launch_t<false, false, kUnroll<false>, 0>(a, nullptr, stream, who);
    else if (arith == 1) launch_t<false, false, kUnroll<false>, 1>(a, nullptr, stream, who);
    else launch_t<false, false, kUnroll<false>, 2>(a, nullptr, stream, who);
  }
}

void launch_warp_tiles(const KernelArgs& a, int tiles_per_warp, cudaStream_t stream, bool pair_refine) {
  if (tiles_per_warp != 1 && tiles_per_warp != 2)
    throw std::invalid_argument("launch_warp_tiles: tiles_per_warp must be 1 or 2, not " + std::to_string(tiles_per_warp));
  if (a.tiles == 0) return;
  if (tiles_per_warp == 1 || a.check_only) return launch_warp(a, stream);
  if (a.optimal) throw std::invalid_argument("launch_warp_tiles: 2 tiles per warp is implemented for binned-dp only");
  const std::int64_t blocks = std::min<std::int64_t>((a.tiles + 1) / 2, std::int64_t{1} << 22);
  if (pair_refine) fit_pair_kernel<kUnroll<false>, kArith, true><<<static_cast<unsigned>(blocks), 32, 0, stream>>>(a);
  else fit_pair_kernel<kUnroll<false>, kArith, false><<<static_cast<unsigned>(blocks), 32, 0, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("quantize_gpu: kernel launch: ") + cudaGetErrorString(e));
}

int resident_warps_per_sm(int which, int pad_bytes) {
  int blocks = 0;
  cudaError_t e = cudaSuccess;
  if (which == 0) {
    auto* k = fit_warp_kernel<false, false, kUnroll<false>, kArith>;
    e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, pad_bytes);
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, 32 * Cfg<false>::kWarps, pad_bytes);
    return e == cudaSuccess ? blocks * Cfg<false>::kWarps : -1;
  }
  if (which >= 3 && which <= 6) {  // launch_warp_layout 1..4
    const int W = which <= 4 ? 4 : 2;
    auto* k = which == 3 ? fit_compact_kernel<4, 20, false>
              : which == 4 ? fit_compact_kernel<4, 24, false>
              : which == 5 ? fit_compact_kernel<2, 20, false>
                           : fit_compact_kernel<2, 24, true>;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k, 32 * W, 0);
    return e == cudaSuccess ? blocks * W : -1;
  }
  if (which == 1) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fit_pair_kernel<kUnroll<false>, kArith, true>, 32, 0);
  else e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fit_pair_kernel<kUnroll<false>, kArith, false>, 32, 0);
  return e == cudaSuccess ? blocks : -1;
}

void launch_warp_padded(const KernelArgs& a, int pad_bytes, cudaStream_t stream) {
  if (a.optimal || a.check_only || pad_bytes < 0)
    throw std::invalid_argument("launch_warp_padded: binned-dp fits only, pad_bytes >= 0");
  if (a.tiles == 0) return;
  constexpr int kWarps = Cfg<false>::kWarps;
  auto* k = fit_warp_kernel<false, false, kUnroll<false>, kArith>;
  cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, pad_bytes);
  if (e == cudaSuccess) {
    const std::int64_t blocks = std::min<std::int64_t>((a.tiles + kWarps - 1) / kWarps, std::int64_t{1} << 22);
    k<<<static_cast<unsigned>(blocks), 32 * kWarps, static_cast<std::size_t>(pad_bytes), stream>>>(a, nullptr);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) throw std::runtime_error(std::string("launch_warp_padded: ") + cudaGetErrorString(e));
}

void launch_warp_unrolled(const KernelArgs& a, int unroll, cudaStream_t stream) {
  launch_warp_variant(a, unroll, kArith, stream);
}

namespace {
// The tile check alone (onl14): one warp per tile, no shared memory, 8 warps per block and up to
// 64 resident warps per SM, grid-stride, so that a check pass reads the source at close to memory
// speed instead of at the fit kernel's occupancy (16-20 warps per SM, one block per two or four
// tiles). The same load_tile and check_tile_warp as the fit kernels: the same error words.
constexpr int kCheckWarps = 8;
__global__ void __launch_bounds__(32 * kCheckWarps) check_kernel(KernelArgs a) {
  const int lane = threadIdx.x & 31;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kCheckWarps;
  for (std::int64_t lt = static_cast<std::int64_t>(blockIdx.x) * kCheckWarps + (threadIdx.x >> 5); lt < a.tiles;
       lt += stride) {
    float x[kIpt];
    float am;
    load_tile(a, lt, lane, x);
    check_tile_warp(a, lt, lane, x, am);
  }
}
}  // namespace

void launch_check(const KernelArgs& a, cudaStream_t stream) {
  if (a.tiles == 0) return;
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
    sms = 132;
  const std::int64_t blocks =
      std::min<std::int64_t>((a.tiles + kCheckWarps - 1) / kCheckWarps, static_cast<std::int64_t>(sms) * 16);
  check_kernel<<<static_cast<unsigned>(blocks), 32 * kCheckWarps, 0, stream>>>(a);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("check kernel launch: ") + cudaGetErrorString(e));
}

#endif  // LUTB_FIT_DP_MODES_TU

}  // namespace lutb::cuda::fit_internal
