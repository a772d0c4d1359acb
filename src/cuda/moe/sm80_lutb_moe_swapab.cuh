// src/cuda/moe/sm80_lutb_moe_swapab.cuh: the small-batch (decode) LUT-B expert GEMMs, "swap AB": the WEIGHTS are
// the M operand of mma.sync (m16n8k32 E4M3 or m16n8k16 FP16) and the tokens the N operand (8 tokens
// per n-block), so one tensor-core instruction consumes 256 weights (the token-as-M kernels of
// sm80_moe_gemm_m16.cuh consume 128 and waste 15/16 of the token rows at one token per expert).
// Kernels: sm80_lutb_moe_swapab_gemm1, sm80_lutb_moe_swapab_gemm2 (the same code runs on sm_90a
// with the cvt decoder, thread-block clusters for split-K and the fused top-k reduction).
//
// Work split. A CTA owns one token tile (<= 8*NB pairs of one expert) and one "strip group": 4
// pairs of tile row-strips (a, b), i.e. 4 m16 tiles whose rows g come from strip a and rows g+8
// from strip b:
//   GEMM1 (w13 [2I, H]): a = gate strip 4G+m, b = the up strip I/8 + 4G+m, so each lane holds
//     gate and up of the same I-column and the SiLU*up epilogue and the MXFP8 block of h (the 32
//     I-columns 32G..32G+31 = the 4 m16 tiles x 8 rows) stay inside one warp;
//   GEMM2 (w2 [H, I]): a = strip 8G+m, b = 8G+4+m (64 output rows per CTA).
// The CTA's warps split K (contiguous K-tile ranges), stream their tiles through a per-warp
// cp.async ring and add their FP32 partial sums in warp order at the end (deterministic).
//
// Decoding (lane L = 4g + t; tiles in lane-major order, lutb/cuda/lane_major.hpp): per tile and
// K-tile a lane loads X (4 B) and Y (2 B), builds 4 PRMT selectors and looks up its 16 E4M3 bytes
// in the tile codebook (4 PRMT), 4 bytes = 4 consecutive columns per PRMT. Two decoders (kDec):
//   kDecCvt (sm_90a): pairs of bytes -> FP16x2 by sm_89+ cvt, two mma.m16n8k16 per block (step s uses
//     columns 32*block + 8t + 4*(s%2) + {0,1 | 2,3}), FP16 activations at the same columns;
//   kDecByte (any sm_80+): the exact byte trick, values times 2^-8 and pairs (0,2),(1,3), matched
//     by quantize_x's swapped activation order.
//
// Numerics (spec section 4, exact products): the tensor core multiplies the unscaled E4M3 values
// and sums one 32-column MXFP8 block; that partial sum is multiplied by the token's power-of-two
// block scale 2^(b_x-127) and promoted to FP32, and once per K-tile by the tile scale
// 2^(s_w-127). Only the order (and the tensor core's internal rounding inside one 32-column block)
// of the FP32 additions differs from the CPU emulation.
#pragma once

#include "cuda/e4m3_encode.cuh"
#include "cuda/moe/sm80_moe_gemm_m16.cuh"
#include "cuda/moe/lutb_moe_device.cuh"
#include "cuda/moe/lutb_moe_swapab_prologue.hpp"

namespace lutb::cuda::kern {

/// Bits of the swap-AB kernels' `one_token` argument (lutb_moe_forward.cu sets them; tile-uniform tests on
/// tk.count == 1 apply them):
///   kOneTokenTail (heuristics::decode_one_token_tail): one-token tiles exchange only accumulator
///     column 2t in swap_reduce / swap_cluster_combine and skip column 2t + 1 in swap_epilogue1
///     (nothing reads it: bit-identical outputs).
/// One-token tiles always take swap_warp_gemm's kOne K-loop.
constexpr unsigned kOneTokenTail = 2u;

/// Per-warp ring stage: 8 strips x one K-tile (strip i = 2m + (0 for a, 1 for b)): index bytes and
/// codebooks. The scale bytes (1 per tile) are loaded into registers one K-tile ahead instead.
struct SwapRing {
  static constexpr int kStrips = 8;
  static constexpr int kStages = 6;
  static constexpr int kCb = kStrips * 192;        // [8][8] codebook bytes
  static constexpr int kStageBytes = kCb + kStrips * 8;
  static constexpr int kWarpBytes = kStages * kStageBytes;
  static constexpr int kCopies = kStrips * 12 + kStrips;  // 16 B and 8 B copies
  static constexpr int kRounds = (kCopies + 31) / 32;
};
static_assert(SwapRing::kStageBytes % 16 == 0, "stages stay 16-byte aligned");
static_assert(SwapRing::kStageBytes == 8 * 200, "8 tiles of 192 index + 8 codebook bytes");

/// 2^(b-127) for every UE8M0 byte b (0 -> 2^-127, 255 -> NaN), in constant memory: the tile scale
/// of a K-tile is the same in every lane, so one LDC replaces the 5-instruction conversion.
struct Ue8m0Table {
  float v[256];
};
constexpr Ue8m0Table make_ue8m0_table() {
  Ue8m0Table t{};
  for (unsigned b = 0; b < 256; ++b)
    t.v[b] = __builtin_bit_cast(float, b == 255u ? 0x7fc00000u : (b == 0u ? 0x00400000u : b << 23));
  return t;
}
__constant__ Ue8m0Table kUe8m0 = make_ue8m0_table();

/// Strips of group G: strip[2m] = a, strip[2m+1] = b (see the file comment).
template <bool kGated>
__device__ __forceinline__ void group_strips(long long G, long long tiles_n, long long half, long long (&strip)[8],
                                             bool (&ok)[8]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    if constexpr (kGated) {
      const long long s = 4 * G + m;  // gate strip; half = I/8
      strip[2 * m] = s;
      strip[2 * m + 1] = half + s;
      ok[2 * m] = ok[2 * m + 1] = s < half;
    } else {
      strip[2 * m] = 8 * G + m;
      strip[2 * m + 1] = 8 * G + 4 + m;
      ok[2 * m] = strip[2 * m] < tiles_n;
      ok[2 * m + 1] = strip[2 * m + 1] < tiles_n;
    }
  }
}


/// 4 codebook bytes (column order) -> two FP16x2 operand registers: lo = columns (+0,+1), hi =
/// (+2,+3) (kCvt); byte trick: lo = (+0,+2), hi = (+1,+3), values times 2^-8.
template <bool kCvt>
__device__ __forceinline__ void bytes_to_f16(unsigned p, unsigned& lo, unsigned& hi) {
  if constexpr (kCvt) {
    e4m3x4_to_f16x2x2(p, lo, hi);
  } else {
    lo = ((p << 8) & 0x80008000u) | ((p << 7) & 0x3f803f80u);
    hi = (p & 0x80008000u) | ((p >> 1) & 0x3f803f80u);
  }
}

__device__ __forceinline__ void mma_f16_zero(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
}

/// Token rows of this CTA's tile for n-block nb: the pair of column n = g (B operand) and of the
/// accumulator columns n = 2t, 2t+1.
template <int NB>
struct SwapTokens {
  int count;             // pairs in the tile (1..8*NB)
  int first;             // pair of the tile's first row (always valid)
  int pair_g[NB];        // pair of token row g of block nb (or -1)
  int pair_c[NB][2];     // pairs of accumulator columns 2t, 2t+1 (or -1)
};

template <int NB>
__device__ __forceinline__ bool swap_tile(const Routing& r, int slot, int& expert, SwapTokens<NB>& tk) {
  if (r.direct_pairs > 0) {  // T = 1, no grouping: slot j = pair j (ids are the caller's input)
    if (slot >= r.direct_pairs) return false;
    expert = r.ids[slot];
    if (expert < 0 || expert >= r.direct_experts) return false;  // the reduction writes its NaN row
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    tk.count = 1;
    tk.first = slot;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      tk.pair_g[nb] = (nb == 0 && g == 0) ? slot : -1;
      tk.pair_c[nb][0] = (nb == 0 && t == 0) ? slot : -1;
      tk.pair_c[nb][1] = -1;
    }
    return true;
  }
  if (slot >= *r.num_tiles) return false;
  expert = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  tk.count = count;
  tk.first = r.sorted[start];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    tk.pair_g[nb] = (8 * nb + g < count) ? r.sorted[start + 8 * nb + g] : -1;
#pragma unroll
    for (int u = 0; u < 2; ++u)
      tk.pair_c[nb][u] = (8 * nb + 2 * t + u < count) ? r.sorted[start + 8 * nb + 2 * t + u] : -1;
  }
  return true;
}

/// cp.async of 16 (8) bytes into shared memory that writes zeros when `bytes` is 0 (the source is
/// then not read): missing strips get zero index bytes and a zero codebook with no branch.
__device__ __forceinline__ void cp_async16_zfill(unsigned s, const void* gmem, unsigned bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async8_zfill(unsigned s, const void* gmem, unsigned bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}

/// The 8 tile scales of one K-tile in swap_warp_gemm's look-ahead registers: shuffled FP32 values
/// (default), or (kLateW) this lane's raw UE8M0 byte, converted and shuffled when used.
template <bool kLateW>
struct SwapTileScales {
  float fw[8];
};
template <>
struct SwapTileScales<true> {
  unsigned wb;
};

/// Activations of one K-tile in swap_warp_gemm: token g's E4M3 bytes (or FP16 values) of both
/// 32-column blocks, the FP32 block scales of tokens 2t, 2t+1, and the 8 tile scales as FP32
/// (times 2^8 for the byte decoder).
template <int NB, bool kLateW>
struct SwapXTile {
  uint4 v[NB][2];
  float sx[NB][2][2];  // [nb][block][u]
  SwapTileScales<kLateW> w;
};

/// The cp.async sources of one lane for swap_warp_gemm's K-tiles: lane L copies the 16-byte index
/// chunks (L % 4) + 4 j (j = 0..2) of strip L / 4, i.e. ONE source pointer with immediate offsets
/// 0 / 64 / 128, and lanes 0..7 the 8-byte codebook of strip `lane`. Sources advance by 192 / 8
/// bytes per K-tile. One source pointer per lane (not one per strip touched) saves 8-16
/// instructions per K-tile (docs/perf/moe-gpu.md). scp: the tile-scale bytes of strip lane & 7
/// (missing strips read strip 0's: their codebooks are zero, so any finite scale gives zero
/// products).
struct SwapCopies {
  const unsigned char* srci;
  const unsigned char* srcc;
  unsigned dsti, dstc, bytesi, bytesc;
  bool cb_lane;
  const unsigned char* scp;
};

/// strip[i], ok[i] for a lane-dependent i, selected without indexing the arrays (they stay in registers).
__device__ __forceinline__ void swap_select_strip(const long long (&strip)[8], const bool (&ok)[8], int i,
                                                  long long& si, bool& sok) {
  si = 0;
  sok = false;
#pragma unroll
  for (int u = 0; u < SwapRing::kStrips; ++u)
    if (u == i) {
      si = strip[u];
      sok = ok[u];
    }
}

/// This lane's copy sources at K-tile k0; tile0 = tile index of (e, strip 0, k0).
__device__ __forceinline__ void swap_copies_init(const LutbW& w, const long long (&strip)[8], const bool (&ok)[8],
                                                 long long tile0, long long tiles_k, int lane, SwapCopies& c) {
  using R = SwapRing;
  {
    const int i = lane >> 2;
    long long si;
    bool sok;
    swap_select_strip(strip, ok, i, si, sok);
    const long long tile = tile0 + (sok ? si : 0) * tiles_k;
    c.srci = w.packed + tile * 192 + (lane & 3) * 16;
    c.dsti = static_cast<unsigned>(i * 192 + (lane & 3) * 16);
    c.bytesi = sok ? 16u : 0u;
  }
  {
    const int i = lane & 7;
    long long si;
    bool sok;
    swap_select_strip(strip, ok, i, si, sok);
    const long long tile = tile0 + (sok ? si : 0) * tiles_k;
    c.srcc = w.codebook + tile * 8;
    c.dstc = static_cast<unsigned>(R::kCb + 8 * i);
    c.bytesc = sok ? 8u : 0u;
  }
  c.cb_lane = lane < R::kStrips;
  {
    const int i = lane & 7;
    long long si;
    bool sok;
    swap_select_strip(strip, ok, i, si, sok);
    c.scp = w.scale + tile0 + (sok ? si : 0) * tiles_k;
  }
}

/// Issues the copies of K-tile kk (kk < n; the sources are running pointers: K-tiles are issued in
/// order) into the ring stage at slot_addr, and commits a group (empty past the range).
__device__ __forceinline__ void swap_issue(SwapCopies& c, int kk, int n, unsigned slot_addr) {
  if (kk < n) {
#pragma unroll
    for (int j = 0; j < 3; ++j) cp_async16_zfill(slot_addr + c.dsti + 64 * j, c.srci + 64 * j, c.bytesi);
    c.srci += 192;
    if (c.cb_lane) cp_async8_zfill(slot_addr + c.dstc, c.srcc, c.bytesc);
    c.srcc += 8;
  }
  cp_async_commit();
}

/// The tile scales of K-tile kk into xw (wmul: the byte trick's 2^-8 folded in).
template <bool kLateW>
__device__ __forceinline__ void swap_load_w(const unsigned char* scp, float wmul, int kk,
                                            SwapTileScales<kLateW>& xw) {
  if constexpr (kLateW) {
    xw.wb = __ldg(scp + kk);
  } else {
    const float f = ue8m0_f(__ldg(scp + kk)) * wmul;
#pragma unroll
    for (int i = 0; i < 8; ++i) xw.fw[i] = __shfl_sync(0xffffffffu, f, i);
  }
}

/// The activations and block scales of K-tile kk into x (abase, sbase: this lane's bases at k0).
template <int NB, bool kOne, bool kLateW>
__device__ __forceinline__ void swap_load_x(const unsigned char* const (&abase)[NB], const float2* const (&sbase)[NB][2],
                                            int nblocks, int kk, SwapXTile<NB, kLateW>& x) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    if (nb > 0 && nb >= nblocks) continue;
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      x.v[nb][blk] = __ldg(reinterpret_cast<const uint4*>(abase[nb] + kk * 128 + 64 * blk));  // 8 FP16 values
    }
#pragma unroll
    for (int u = 0; u < (kOne ? 1 : 2); ++u) {
      const float2 sc = __ldg(sbase[nb][u] + kk);
      x.sx[nb][0][u] = sc.x;
      x.sx[nb][1][u] = sc.y;
    }
  }
}

/// Block blk of m16 tile m: decodes the A operands of its two k16 steps from the codebooks cb
/// (strips a: x, y; b: z, w), multiplies them by every token block's activations and adds the
/// block-scaled 32-column sums into part (blk 0 writes, blk 1 accumulates).
template <int kDec, int NB, bool kOne, bool kLateW>
__device__ __forceinline__ void swap_block_mma(const uint4& cb, const unsigned (&sel)[2][4], int blk, int nblocks,
                                               const SwapXTile<NB, kLateW>& cur, float (&part)[NB][4]) {
  unsigned a0[4], a1[4];  // A operands of the block's two k16 steps
  {
    unsigned pa = prmt_raw(cb.x, cb.y, sel[0][2 * blk]), pb = prmt_raw(cb.z, cb.w, sel[1][2 * blk]);
    bytes_to_f16<kDec == kDecCvt>(pa, a0[0], a0[2]);
    bytes_to_f16<kDec == kDecCvt>(pb, a0[1], a0[3]);
    pa = prmt_raw(cb.x, cb.y, sel[0][2 * blk + 1]);
    pb = prmt_raw(cb.z, cb.w, sel[1][2 * blk + 1]);
    bytes_to_f16<kDec == kDecCvt>(pa, a1[0], a1[2]);
    bytes_to_f16<kDec == kDecCvt>(pb, a1[1], a1[3]);
  }
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    if (nb > 0 && nb >= nblocks) continue;  // token block 0 always holds a token
    const uint4 xv = cur.v[nb][blk];
    float c[4];
    mma_f16_zero(c, a0, xv.x, xv.y);
    mma16816<false>(c, a1, xv.z, xv.w);
    // Exact: the 32-column partial sum times the power-of-two block scale of each token.
    const float s0 = cur.sx[nb][blk][0], s1 = kOne ? 0.0f : cur.sx[nb][blk][1];
    if (blk == 0) {
      part[nb][0] = c[0] * s0;
      part[nb][2] = c[2] * s0;
      if constexpr (!kOne) {
        part[nb][1] = c[1] * s1;
        part[nb][3] = c[3] * s1;
      }
    } else {
      part[nb][0] = fmaf(c[0], s0, part[nb][0]);
      part[nb][2] = fmaf(c[2], s0, part[nb][2]);
      if constexpr (!kOne) {
        part[nb][1] = fmaf(c[1], s1, part[nb][1]);
        part[nb][3] = fmaf(c[3], s1, part[nb][3]);
      }
    }
  }
}

/// acc[m] += part times the tile scales (powers of two, exact) of strips a (rows g: fa) and b
/// (rows g+8: fb).
template <int NB, bool kOne>
__device__ __forceinline__ void swap_add_tile(const float (&part)[NB][4], float fa, float fb, int nblocks,
                                              float (&accm)[NB][4]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    if (nb > 0 && nb >= nblocks) continue;
    accm[nb][0] = fmaf(part[nb][0], fa, accm[nb][0]);
    accm[nb][2] = fmaf(part[nb][2], fb, accm[nb][2]);
    if constexpr (!kOne) {
      accm[nb][1] = fmaf(part[nb][1], fa, accm[nb][1]);
      accm[nb][3] = fmaf(part[nb][3], fb, accm[nb][3]);
    }
  }
}

/// One warp's K-range [k0, k1) of the swap-AB product for 8 strips and NB token n-blocks.
/// arow[nb]: activation row of token g: FP16 E4M3 values.
/// srow[nb][u]: FP32 block-scale row (2^(b-127) per 32 columns, written by quantize_x / GEMM1) of
/// the token of accumulator column 2t+u. acc[m][nb][4]: FP32, rows (a: g, b: g+8) x cols (2t, 2t+1).
///
/// Per-K-tile bookkeeping is kept to a few instructions, because decode is bound by instruction
/// issue (docs/perf/moe-gpu.md): the copy sources are per-lane pointers advanced by a constant, the
/// missing strips are zero-filled by the copy itself, the 8 tile scales are loaded and converted by
/// lanes 0..7 (lane & 7) and broadcast with 8 shuffles, and the activation block scales arrive as
/// FP32 (one 8-byte load per token and K-tile, no conversion).
/// `before_wait` runs after the first ring stages are issued and before the first activation load:
/// the kernels put the programmatic-dependent-launch wait there, so the weight prefetch overlaps
/// the previous kernel's tail.
/// kOne (NB = 1 only): the tile holds ONE token, so only accumulator column 0 (c0, c2 of the lanes
/// t = 0) is ever stored: the promotion of columns 2t+1 (c1, c3) and their block-scale loads are
/// skipped, a quarter fewer FP32 operations per K-tile (acc[..][1], acc[..][3] stay 0). Decode
/// batches of large-E models are mostly one-token tiles (T = 1: all of them).
/// kLateW (heuristics::decode_late_scales): the next K-tile's tile-scale byte is
/// loaded one K-tile ahead as before, but kept as the raw byte (one register) instead of 8
/// shuffled FP32 values; it is converted at the top of the K-tile that uses it and each m16 tile
/// shuffles its two values (strips 2m, 2m + 1) just before it applies them. Same values, same FP32
/// operations in the same order (bit-identical to kLateW = false); 14 fewer values live across the
/// K-loop (the two XTiles' fw[8] -> one byte each; ptxas -v: the one-block kernels 127-128 -> 120-124
/// registers) and no wait for the byte's load inside the iteration that issues it.
template <int kDec, int NB, bool kOne, bool kLateW, class BeforeWait>
__device__ __forceinline__ void swap_warp_gemm(const LutbW& w, long long e, const long long (&strip)[8],
                                               const bool (&ok)[8], const void* const (&arow)[NB],
                                               const float* const (&srow)[NB][2], int nblocks, long long k0,
                                               long long k1, unsigned char* ring, float (&acc)[4][NB][4],
                                               BeforeWait&& before_wait) {
  using R = SwapRing;
  const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[m][nb][r] = 0.0f;
  if (k0 >= k1) {
    before_wait();
    return;
  }

  const long long tiles_k = w.tiles_k;
  const int n = static_cast<int>(k1 - k0);
  const unsigned ring_s = static_cast<unsigned>(__cvta_generic_to_shared(ring));
  const long long tile0 = e * w.tiles_n * tiles_k + k0;  // tile index of (e, strip 0, k0)
  SwapCopies cp;
  swap_copies_init(w, strip, ok, tile0, tiles_k, lane, cp);

  const float wmul = kDec == kDecByte ? 256.0f : 1.0f;  // the byte trick's 2^-8
  // Per-lane bases at k0 (this lane's 8 columns of block 0), indexed by the 32-bit kk below.
  const unsigned char* abase[NB];  // FP16 values, K-tile k0
  const float2* sbase[NB][2];      // the two block scales of K-tile k0
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    abase[nb] = static_cast<const unsigned char*>(arow[nb]) + (k0 * 64 + 8 * t) * 2;
#pragma unroll
    for (int u = 0; u < 2; ++u) sbase[nb][u] = reinterpret_cast<const float2*>(srow[nb][u] + 2 * k0);
  }

#pragma unroll
  for (int s = 0; s < R::kStages - 1; ++s) swap_issue(cp, s, n, ring_s + s * R::kStageBytes);
  SwapXTile<NB, kLateW> cur;
  swap_load_w<kLateW>(cp.scp, wmul, 0, cur.w);
  before_wait();
  swap_load_x<NB, kOne>(abase, sbase, nblocks, 0, cur);
  unsigned rd_off = 0, wr_off = (R::kStages - 1) * R::kStageBytes;  // ring byte offsets

  // Unrolled by two so that cur / nxt alternate registers instead of being copied.
#pragma unroll 2
  for (int kk = 0; kk < n; ++kk) {
    swap_issue(cp, kk + R::kStages - 1, n, ring_s + wr_off);
    // Next K-tile's scales and activations (the last iteration reloads its own: no test on the
    // register copy below).
    SwapXTile<NB, kLateW> nxt;
    const int kn = kk + 1 < n ? kk + 1 : kk;
    swap_load_w<kLateW>(cp.scp, wmul, kn, nxt.w);
    swap_load_x<NB, kOne>(abase, sbase, nblocks, kn, nxt);
    // kLateW: this K-tile's tile scale of strip lane & 7, from the byte loaded one K-tile ago.
    float fw_lane = 0.0f;
    if constexpr (kLateW) fw_lane = ue8m0_f(cur.w.wb) * wmul;
    cp_async_wait<R::kStages - 1>();
    __syncwarp();
    // The shared-memory loads (codebooks, index words) and the selectors stay in this body: as a
    // separate step they changed ptxas's register allocation of most instances (ptxas -v).
    const unsigned char* st = ring + rd_off;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      // codebooks of strips a (x, y) and b (z, w); this lane's index words of both strips.
      const uint4 cb = *reinterpret_cast<const uint4*>(st + R::kCb + 16 * m);
      unsigned sel[2][4];
#pragma unroll
      for (int ab = 0; ab < 2; ++ab) {
        const int i = 2 * m + ab;
        const unsigned x = *reinterpret_cast<const unsigned*>(st + i * 192 + 4 * lane);
        const unsigned y = *reinterpret_cast<const unsigned short*>(st + i * 192 + 128 + 2 * lane);
        // Selectors for prmt_raw: bit 3 of every nibble of bits 0..15 is 0 (xm and y & 0x7777 by the
        // masks; sel[3] by construction below), bits 16..31 are ignored.
        const unsigned xm = x & 0x77777777u;
        sel[ab][0] = xm;
        sel[ab][1] = xm >> 16;
        sel[ab][2] = y & 0x7777u;
        // The spare bit 3 of every nibble: x's low nibbles -> bit 0, x's high nibbles -> bit 1,
        // y's -> bit 2 of selector 3's nibbles. The three terms share no bit, so + is | and lets
        // ptxas fuse the shifts into LEA.HI / IADD3 (bits above 15 are junk PRMT ignores).
        const unsigned sx = x & 0x88888888u;
        sel[ab][3] = (sx >> 3) + (sx >> 18) + ((y & 0x8888u) >> 1);
      }
      float part[NB][4];  // this K-tile's sum over both blocks, activation scales applied
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) swap_block_mma<kDec, NB, kOne, kLateW>(cb, sel, blk, nblocks, cur, part);
      // Tile scales (powers of two, exact) of strips a (rows g) and b (rows g+8).
      float fa, fb;
      if constexpr (kLateW) {
        fa = __shfl_sync(0xffffffffu, fw_lane, 2 * m);
        fb = __shfl_sync(0xffffffffu, fw_lane, 2 * m + 1);
      } else {
        fa = cur.w.fw[2 * m];
        fb = cur.w.fw[2 * m + 1];
      }
      swap_add_tile<NB, kOne>(part, fa, fb, nblocks, acc[m]);
    }
    __syncwarp();
    cur = nxt;
    wr_off = rd_off;
    rd_off = rd_off == (R::kStages - 1) * R::kStageBytes ? 0u : rd_off + R::kStageBytes;
  }
  cp_async_wait<0>();
}

/// Adds the warps' partial sums in warp order into warp 0's acc (through the ring memory, which
/// is free once every warp has drained its copies). Returns true in warp 0.
/// `cols02` (CTA-uniform; the one-token tail, kOneTokenTail): only accumulator registers 0 and 2
/// (accumulator column 2t) are exchanged and added; registers 1 and 3 (column 2t + 1, no token in a
/// one-token tile: nothing reads them afterwards) are left as they are. The added values and their
/// order are unchanged.
template <int NB>
__device__ __forceinline__ bool swap_reduce(unsigned char* smem, float (&acc)[4][NB][4], bool cols02 = false) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);
  constexpr int kPer = 16 * NB;  // floats per lane
  if (warp > 0) {
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (!(cols02 && (r & 1))) red[((warp - 1) * kPer + (m * NB + nb) * 4 + r) * 32 + lane] = acc[m][nb][r];
  }
  __syncthreads();
  if (warp > 0) return false;
  for (int u = 1; u < nw; ++u)
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (!(cols02 && (r & 1))) acc[m][nb][r] += red[((u - 1) * kPer + (m * NB + nb) * 4 + r) * 32 + lane];
  return true;
}

/// Dynamic shared memory of a swap-AB CTA of `warps` warps.
template <int NB>
constexpr int swap_smem_bytes(int warps) {
  const int ring = warps * SwapRing::kWarpBytes, red = (warps - 1) * 16 * NB * 32 * 4;
  return ring > red ? ring : red;
}

/// Most warps per CTA: 16 with one token block (128 registers per thread fit 512 threads), 8 with
/// two (~195 registers).
constexpr int swap_max_warps(int nb) { return nb == 1 ? 16 : 8; }

/// Resident CTAs of swap_max_warps(nb) warps per SM the compiler must allow (sets the register cap:
/// 65536 / (32 * swap_max_warps * this) = 128 for NB = 1, 255 for NB = 2). Measured on the H200
/// (docs/perf/moe-gpu.md).
constexpr int swap_min_blocks(int) { return 1; }
#define LUTB_SWAPAB_BOUNDS(NB) __launch_bounds__(32 * swap_max_warps(NB), swap_min_blocks(NB))

/// GEMM1's epilogue in warp 0 (acc = the reduced sums of all 8 strips, mma.sync m16n8 layout per
/// m16 tile m): SiLU*up, BF16, the MXFP8 block of h, written in the decoder's activation form.
/// `tail` (the one-token tail, kOneTokenTail; CTA-uniform): accumulator column 2t + 1 (u = 1) is
/// skipped where no lane has a token in it (token block nb holds at most one token), instead of
/// being computed up to the amax shuffles and then dropped; and the Cvt decoder's FP16 copy of an
/// E4M3 element is converted by the hardware (cvt.rn.f16x2.e4m3x2, exact) instead of
/// __float2half_rn(e4m3_to_float()) (exact too). Same bytes written.
template <int kDec, int NB>
__device__ __forceinline__ void swap_epilogue1(const SwapTokens<NB>& tk, int nblocks, const bool (&ok)[8],
                                               const float (&acc)[4][NB][4], long long G, long long Ip, void* hq,
                                               float* hsf, bool tail = false) {
  const int g = (threadIdx.x & 31) >> 2;
  // Lane (g, t) holds gate (c0, c1) and up (c2, c3) of I-column 8(4G+m)+g for the tokens of
  // accumulator columns 2t, 2t+1. The MXFP8 block of h is I-columns 32G..32G+31 = (m, g).
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    if (nb >= nblocks) continue;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (u == 1 && tail && tk.count <= 8 * nb + 1) continue;  // no token in column 2t + 1 of this block
      float hv[4];
      float a = 0.0f;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const float gg = acc[m][nb][u], uu = acc[m][nb][2 + u];
        const float v = ok[2 * m] ? (gg / (1.0f + expf(-gg))) * uu : 0.0f;
        hv[m] = bf16_round(v);
        a = fmaxf(a, fabsf(hv[m]));
        if (!isfinite(hv[m])) a = INFINITY;
      }
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 4));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 8));
      a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 16));
      const unsigned char b = mx_block_scale(a, MxScaleRule::Rceil);
      const int p = tk.pair_c[nb][u];
      if (p < 0) continue;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        // Padding I-columns (I..Ip-1) are written as zeros: GEMM2 reads all Ip columns.
        // mx_encode_dev: the hardware E4M3 conversion, the same bytes as mx_encode (e4m3_encode.cuh).
        const unsigned char q8 = (b == 255) ? 0 : mx_encode_dev(hv[m], b);
        const long long at = static_cast<long long>(p) * Ip + 8 * (4 * G + m);
        if (kDec == kDecCvt && tail) {
          static_cast<uint16_t*>(hq)[at + perm8(g, false)] = static_cast<uint16_t>(e4m3x2_to_f16x2(q8) & 0xffffu);
        } else {
          static_cast<uint16_t*>(hq)[at + perm8(g, kDec == kDecByte)] = __half_as_ushort(__float2half_rn(e4m3_to_float(q8)));
        }
      }
      if (g == 0) hsf[static_cast<long long>(p) * (Ip / 32) + G] = ue8m0_f(b);
    }
  }
}

/// Bit of the swap-AB GEMM1's `one_token` argument (beside kOneTokenTail): GEMM1 writes its partial sums (swap_store_partials) to the buffer passed as `hq` instead
/// of running swap_cluster_combine and swap_epilogue1; hsf is not written; the activation kernel
/// (sm80_lutb_moe_swapab_act.cuh) does the epilogue. Launch-uniform (the host sets it for the whole
/// GEMM, lutb_moe_forward.cu launch_swapab).
constexpr unsigned kGemm1Partials = 4u;

/// GEMM1's partial-sum workspace: for pair p and split rank q (0..ksplit-1) one row of 2 Ip FP32
/// values at (p * ksplit + q) * 2 Ip: the gate sums of I-columns 0..Ip-1, then the up sums. Every
/// column of every valid pair is written by the GEMM1 CTA of its strip group and rank.
__host__ __device__ constexpr long long act_part_row(long long p, int ksplit, int rank, long long Ip) {
  return (p * ksplit + rank) * 2 * Ip;
}

/// GEMM1 CTA's partial sums after swap_reduce (warp 0 only; acc as swap_epilogue1 takes it): lane
/// (g, t) holds gate (acc[m][nb][u]) and up (acc[m][nb][2 + u]) of I-column 8 (4 G + m) + g for the
/// pair of accumulator column 2t + u. Pairs of no token (pair_c < 0) are skipped; with the one-token
/// tail only column 2t was reduced, and only it has a pair.
template <int NB>
__device__ __forceinline__ void swap_store_partials(const SwapTokens<NB>& tk, int nblocks, const float (&acc)[4][NB][4],
                                                    long long G, long long Ip, int rank, int ksplit, float* part) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    if (nb >= nblocks) continue;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int p = tk.pair_c[nb][u];
      if (p < 0) continue;
      float* row = part + act_part_row(p, ksplit, rank, Ip);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const long long c = 8 * (4 * G + m) + g;
        row[c] = acc[m][nb][u];
        row[Ip + c] = acc[m][nb][2 + u];
      }
    }
  }
}

/// GEMM2's epilogue in warp 0: the FP32 rows of y.
template <int NB>
__device__ __forceinline__ void swap_epilogue2(const SwapTokens<NB>& tk, int nblocks, const long long (&strip)[8],
                                               const bool (&ok)[8], const float (&acc)[4][NB][4], float* y,
                                               long long H) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    if (nb >= nblocks) continue;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int p = tk.pair_c[nb][u];
      if (p < 0) continue;
      float* dst = y + static_cast<long long>(p) * H;
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int ab = 0; ab < 2; ++ab) {
          const long long row = strip[2 * m + ab] * 8 + g;
          if (ok[2 * m + ab] && row < H) dst[row] = acc[m][nb][2 * ab + u];
        }
    }
  }
}

/// Strip group of this CTA: blockIdx.x / ksplit (the CTAs of one split share it). Read from the
/// special register each time it is needed (volatile), so that it is not kept in a register across
/// the K-loop: the one-block kernels sit at their 128-register cap. kCluster (the split kernels,
/// launched in clusters of (ksplit, 1, 1) CTAs, lutb_moe_forward.cu; sm_90 only): the
/// cluster's index %clusterid.x, which is that quotient without the division (%ctaid.x =
/// %clusterid.x * %cluster_nctaid.x + %cluster_ctaid.x, PTX ISA "Special registers"). Otherwise
/// %ctaid.x / ksplit (ksplit = 1 there: the unsplit kernels' constant). A runtime choice between
/// the two in the split kernels cost GEMM2's split general K-loop 6.5 SASS instructions per K-tile
/// (register allocation), hence the template parameter.
template <bool kCluster = false>
__device__ __forceinline__ long long swap_strip_group(int ksplit) {
  unsigned x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kCluster) {
    asm volatile("mov.u32 %0, %%clusterid.x;\n" : "=r"(x));
    return static_cast<long long>(x);
  }
#endif
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
  return static_cast<long long>(x / static_cast<unsigned>(ksplit));
}

/// Rank of this CTA in its thread-block cluster (0 below sm_90 or without a cluster launch).
__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
#else
  return 0;
#endif
}

__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

/// Split-K across the CTAs of a cluster (ksplit > 1: clusters of (ksplit, 1, 1) along grid x, all on
/// the same strip group and token tile; CTA rank r takes the r-th share of the K-tiles, see
/// swap_k_range): after swap_reduce, warp 0 of every rank > 0 puts its CTA's sums in shared memory,
/// and warp 0 of rank 0 adds them in rank order through distributed shared memory (deterministic:
/// the same order in every run). Every thread of every CTA of the cluster calls this. Returns true
/// in the one warp that holds the complete sums (warp 0 of rank 0). sm_90 only (ksplit = 1 below).
/// `cols02`: as in swap_reduce (the same value in every CTA of the cluster: they share the tile).
template <int NB>
__device__ __forceinline__ bool swap_cluster_combine(bool warp0, float (&acc)[4][NB][4], bool cols02 = false) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float part[16 * NB * 32];
  const int lane = threadIdx.x & 31;
  const unsigned rank = cluster_rank();
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  if (warp0 && rank > 0) {
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (!(cols02 && (r & 1))) part[((m * NB + nb) * 4 + r) * 32 + lane] = acc[m][nb][r];
  }
  cluster_sync_all();
  if (warp0 && rank == 0) {
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(part)) + 4u * lane;
    for (unsigned q = 1; q < n; ++q) {
      unsigned remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(q));
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if (cols02 && (r & 1)) continue;
            float v;
            asm volatile("ld.shared::cluster.f32 %0, [%1];\n"
                         : "=f"(v)
                         : "r"(remote + 4u * 32u * static_cast<unsigned>((m * NB + nb) * 4 + r))
                         : "memory");
            acc[m][nb][r] += v;
          }
    }
  }
  cluster_sync_all();
  return warp0 && rank == 0;
#else
  return warp0;
#endif
}

/// K-tile range [k0, k1) of warp `warp` of `nw` in share `part` of `ksplit` (the CTA's K split
/// across warps, times the cluster's split across CTAs): contiguous, in (part, warp) order.
/// `narrow` (GEMM1): in 32-bit arithmetic (lutb_moe_swapab_prologue.hpp swap_k_range32; tiles_k <=
/// kSwapMaxTilesK, the host's check), one 32-bit division instead of the 64-bit division's call;
/// otherwise (GEMM2) the 64-bit formula (swap_k_range64). Same numbers. Why not
/// GEMM2: without the 64-bit division's call ptxas allocates GEMM2's general K-loop differently at
/// the 128-register cap (ok[] re-selected inside the loop: 315 -> 360.5 SASS instructions per
/// K-tile, scripts/sass_kloop.py), and GEMM2's prologue overlaps its PDL wait anyway.
/// The 32-bit bounds are broadcast from lane 0 (they are warp-uniform): without that broadcast
/// GEMM1's general K-loop grew from 313.5 to 316 instructions per K-tile; with it, 312.5.
__device__ __forceinline__ void swap_k_range(long long tiles_k, int nw, int warp, int ksplit, int part, long long& k0,
                                             long long& k1, bool narrow) {
  if (!narrow) {
    swap_k_range64(tiles_k, nw, warp, ksplit, part, k0, k1);
    return;
  }
  unsigned a, b;
  swap_k_range32(static_cast<unsigned>(tiles_k), static_cast<unsigned>(nw), static_cast<unsigned>(warp),
                 static_cast<unsigned>(ksplit), static_cast<unsigned>(part), a, b);
  k0 = static_cast<long long>(__shfl_sync(0xffffffffu, a, 0));
  k1 = static_cast<long long>(__shfl_sync(0xffffffffu, b, 0));
}

/// The weighted top-k reduction of a direct forward (Routing::direct_pairs; one token per tile)
/// inside GEMM2, launched in thread-block clusters of (1, top_k) CTAs: the cluster of CTA
/// (G, slot) holds the k pairs of token slot / k and the same 64 output rows 64G..64G+63, cluster
/// rank j = pair j. Each CTA keeps its FP32 rows y[p, 64G + r] in shared memory; after a cluster
/// barrier (release / acquire) rank 0 reads the k rows through distributed shared memory and writes
/// out[t, n] = bf16(sum_j w[t, j] * y[t*k + j, n]) with the same operations in the same j order as
/// lutb_moe_steps_reduce_topk (lutb_moe_steps.cu), so the outputs are bit-identical to the separate kernel's; an
/// expert id out of range gives the NaN row, as there. A second barrier keeps every CTA's shared
/// memory alive until rank 0 has read it. `have`: this CTA computed its pair (false for an invalid
/// expert id); acc is valid in warp 0 when `have`. Every thread of every CTA of the cluster calls
/// this (no early exits before it). Latency: the k ids and weights are loaded by lanes 0..k-1 before
/// the first barrier and shuffled, and the k remote loads of a row are issued before the sum (one
/// round trip each, not k dependent ones). sm_90 only (the host launches clusters on sm_90a only).
template <int NB>
__device__ __forceinline__ void swap_cluster_reduce(bool have, const float (&acc)[4][NB][4], long long G,
                                                    const Routing& r, long long H, const float* __restrict__ topk_w,
                                                    uint16_t* __restrict__ out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float yrow[64];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // One token: lanes t = 0 of warp 0 hold accumulator column 0: rows (strip 8G+m, g) in acc[m][0][0]
  // and (strip 8G+4+m, g) in acc[m][0][2] (swap_epilogue2's mapping).
  if (have && warp == 0 && t == 0) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      yrow[m * 8 + g] = acc[m][0][0];
      yrow[(4 + m) * 8 + g] = acc[m][0][2];
    }
  }
  const bool reducer = cluster_rank() == 0 && threadIdx.x < 64;  // warps 0 and 1 of rank 0
  const int k = r.top_k;  // <= 8 (the host's rule)
  const long long tok = static_cast<long long>(blockIdx.y) / k;
  int id = 0;
  float wt = 0.0f;
  if (reducer && lane < k) {  // the caller's routing (no dependency on earlier kernels)
    id = r.ids[tok * k + lane];
    wt = topk_w[tok * k + lane];
  }
  cluster_sync_all();
  if (reducer) {
    const bool bad = lane < k && !(id >= 0 && id < r.direct_experts);
    const bool valid = !__any_sync(0xffffffffu, bad);
    float wj[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) wj[j] = __shfl_sync(0xffffffffu, wt, j);
    const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(yrow));
    for (int lr = threadIdx.x; lr < 64; lr += blockDim.x) {
      const long long row = 64 * G + lr;
      if (row >= H) break;
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[j] = 0.0f;
        if (j < k) {
          unsigned remote;
          asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local + 4u * lr), "r"(j));
          asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v[j]) : "r"(remote));
        }
      }
      float a = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j < k) a = __fadd_rn(a, __fmul_rn(wj[j], v[j]));
      out[tok * H + row] = bf16_from_float(valid ? a : __int_as_float(0x7fc00000));
    }
  }
  cluster_sync_all();
#else
  (void)have; (void)acc; (void)G; (void)r; (void)H; (void)topk_w; (void)out;
  __trap();
#endif
}

/// GEMM1 + SiLU*up + MXFP8 of h. Grid: (Ip/32 strip groups x ksplit, token tile slots); blockDim.x =
/// 32 * warps (K split across the warps). xa: [T, a_cols] FP16 E4M3 values in the decoder's column
/// order. Output hq [P, Ip] in the same form, hsf [P, Ip/32] FP32 block scales. kLateW: swap_warp_gemm's
/// late tile scales, same results.
/// With kGemm1Partials in `one_token` (every CTA of the launch): after swap_reduce, warp 0
/// stores the CTA's FP32 gate / up sums to `hq`, taken as the float buffer of act_part_row (its rank
/// in the cluster's split as the rank), and neither swap_cluster_combine nor swap_epilogue1 runs;
/// hsf is untouched (sm80_lutb_moe_swapab_act writes hq and hsf from the sums).
template <int kDec, int NB, bool kSplit, bool kLateW>
__device__ __forceinline__ void swapab_gemm1_body(LutbW w, const void* __restrict__ xa, const float* __restrict__ xsf,
                                                  long long a_cols, Routing r, long long I, long long Ip,
                                                  void* __restrict__ hq, float* __restrict__ hsf, unsigned one_token,
                                                  int ksplit_arg) {
  constexpr long long kEl = 2;  // bytes per activation element (FP16)
  // kSplit = false: no split, and none of its code (the one-block kernels sit at their 128-register
  // cap; the runtime split alone cost them a 12-byte spill).
  const int ksplit = kSplit ? ksplit_arg : 1;
  int e;
  SwapTokens<NB> tk;
  if (!swap_tile<NB>(r, blockIdx.y, e, tk)) return;  // the whole cluster (same slot) returns
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  long long strip[8];
  bool ok[8];
  group_strips<true>(swap_strip_group<kSplit>(ksplit), w.tiles_n, I / 8, strip, ok);
  const void* arow[NB];
  const float* srow[NB][2];
  const long long sblocks = a_cols / 32;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    // Token of a pair: p / top_k of valid pairs (p >= 0), in unsigned arithmetic (swap_pair_token).
    const int p = tk.pair_g[nb] >= 0 ? tk.pair_g[nb] : tk.first;
    arow[nb] = static_cast<const unsigned char*>(xa) + static_cast<long long>(swap_pair_token(p, r.top_k)) * a_cols * kEl;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int pc = tk.pair_c[nb][u] >= 0 ? tk.pair_c[nb][u] : tk.first;
      srow[nb][u] = xsf + static_cast<long long>(swap_pair_token(pc, r.top_k)) * sblocks;
    }
  }
  const int nblocks = (tk.count + 7) / 8;
  long long k0, k1;
  swap_k_range(w.tiles_k, nw, warp, ksplit, kSplit ? static_cast<int>(cluster_rank()) : 0, k0, k1, true);
  extern __shared__ __align__(16) unsigned char swap_smem[];
  float acc[4][NB][4];
  PdlWaitAndTrigger wait;  // after the ring prologue: the weight prefetch overlaps the previous kernel
  // One-token tiles take the lighter K-loop (CTA-uniform branch; NB = 1 only).
  if (NB == 1 && tk.count == 1)
    swap_warp_gemm<kDec, NB, NB == 1, kLateW>(w, e, strip, ok, arow, srow, nblocks, k0, k1,
                                              swap_smem + warp * SwapRing::kWarpBytes, acc, wait);
  else
    swap_warp_gemm<kDec, NB, false, kLateW>(w, e, strip, ok, arow, srow, nblocks, k0, k1,
                                            swap_smem + warp * SwapRing::kWarpBytes, acc, wait);
  const bool tail = (one_token & kOneTokenTail) && tk.count == 1;
  bool warp0 = swap_reduce<NB>(swap_smem, acc, tail);
  if (one_token & kGemm1Partials) {  // the activation kernel does the combine and the epilogue
    if (!warp0) return;
    swap_store_partials<NB>(tk, nblocks, acc, swap_strip_group(ksplit), Ip,
                            kSplit ? static_cast<int>(cluster_rank()) : 0, ksplit, static_cast<float*>(hq));
    return;
  }
  if constexpr (kSplit) warp0 = swap_cluster_combine<NB>(warp0, acc, tail);
  if (!warp0) return;
  swap_epilogue1<kDec, NB>(tk, nblocks, ok, acc, swap_strip_group<kSplit>(ksplit), Ip, hq, hsf, tail);
}

/// The GEMM1 kernel (swapab_gemm1_body above).
template <int kDec, int NB, bool kSplit, bool kLateW = false>
__global__ void LUTB_SWAPAB_BOUNDS(NB)
    sm80_lutb_moe_swapab_gemm1(LutbW w, const void* __restrict__ xa, const float* __restrict__ xsf,
                               long long a_cols, Routing r, long long I, long long Ip, void* __restrict__ hq,
                               float* __restrict__ hsf, unsigned one_token, int ksplit_arg) {
  swapab_gemm1_body<kDec, NB, kSplit, kLateW>(w, xa, xsf, a_cols, r, I, Ip, hq, hsf, one_token, ksplit_arg);
}

/// GEMM2: y[p, n] = h[p] . w2[e, n]^T (FP32). Grid: (ceil(tiles_n/8) strip groups, slots). kLateW
/// as in GEMM1.
/// out != null (direct forwards on sm_90, launched in clusters of (1, top_k)): the weighted top-k
/// reduction is fused (swap_cluster_reduce): out [T, H] BF16 is written instead of y.
template <int kDec, int NB, bool kLateW>
__device__ __forceinline__ void swapab_gemm2_body(LutbW w, const void* __restrict__ ha, const float* __restrict__ hsf,
                                                  long long Ip, Routing r, long long H, float* __restrict__ y,
                                                  unsigned one_token, const float* __restrict__ topk_w,
                                                  uint16_t* __restrict__ out) {
  constexpr long long kEl = 2;  // bytes per activation element (FP16)
  const bool fused = out != nullptr;
  int e;
  SwapTokens<NB> tk;
  float acc[4][NB][4];
  if (!swap_tile<NB>(r, blockIdx.y, e, tk)) {
    if (fused) swap_cluster_reduce<NB>(false, acc, swap_strip_group(1), r, H, topk_w, out);
    return;
  }
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  long long strip[8];
  bool ok[8];
  group_strips<false>(swap_strip_group<false>(1), w.tiles_n, 0, strip, ok);
  const void* arow[NB];
  const float* srow[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int p = tk.pair_g[nb] >= 0 ? tk.pair_g[nb] : tk.first;
    arow[nb] = static_cast<const unsigned char*>(ha) + static_cast<long long>(p) * Ip * kEl;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int pc = tk.pair_c[nb][u] >= 0 ? tk.pair_c[nb][u] : tk.first;
      srow[nb][u] = hsf + static_cast<long long>(pc) * (Ip / 32);
    }
  }
  const int nblocks = (tk.count + 7) / 8;
  long long k0, k1;
  swap_k_range(w.tiles_k, nw, warp, 1, 0, k0, k1, false);
  extern __shared__ __align__(16) unsigned char swap_smem[];
  PdlWaitAndTrigger wait;
  // One-token tiles take the lighter K-loop (CTA-uniform branch; NB = 1 only).
  if (NB == 1 && tk.count == 1)
    swap_warp_gemm<kDec, NB, NB == 1, kLateW>(w, e, strip, ok, arow, srow, nblocks, k0, k1,
                                              swap_smem + warp * SwapRing::kWarpBytes, acc, wait);
  else
    swap_warp_gemm<kDec, NB, false, kLateW>(w, e, strip, ok, arow, srow, nblocks, k0, k1,
                                            swap_smem + warp * SwapRing::kWarpBytes, acc, wait);
  const bool tail = (one_token & kOneTokenTail) && tk.count == 1;  // only column 2t is read below
  bool warp0 = swap_reduce<NB>(swap_smem, acc, tail);
  if (fused) {
    swap_cluster_reduce<NB>(true, acc, swap_strip_group(1), r, H, topk_w, out);
    return;
  }
  if (!warp0) return;
  swap_epilogue2<NB>(tk, nblocks, strip, ok, acc, y, H);
}

/// The GEMM2 kernel (swapab_gemm2_body above).
template <int kDec, int NB, bool kLateW = false>
__global__ void LUTB_SWAPAB_BOUNDS(NB)
    sm80_lutb_moe_swapab_gemm2(LutbW w, const void* __restrict__ ha, const float* __restrict__ hsf, long long Ip,
                               Routing r, long long H, float* __restrict__ y, unsigned one_token,
                               const float* __restrict__ topk_w, uint16_t* __restrict__ out) {
  swapab_gemm2_body<kDec, NB, kLateW>(w, ha, hsf, Ip, r, H, y, one_token, topk_w, out);
}

}  // namespace lutb::cuda::kern
