// src/cuda/moe_swapab_sm90.cuh: the swap-AB decode GEMMs on Hopper's native FP8 tensor-core
// instruction, wgmma.mma_async.m64n8k32.f32.e4m3.e4m3 with the decoded weights as the REGISTER A
// operand (WeightDecoder::Fp8Wgmma, kern::kDecWg; sm_90a only, the sm_80 image traps). Kernel names:
// sm90_lutb_mxfp8_moe_gemm{1,2}_swapab_wgmma (launch labels in moe_lutb.cu).
//
// Why: the mma.sync decoders of moe_swapab.cuh are bound by the ALU pipe (docs/perf/moe-gpu.md);
// their FP16 path spends 64 of ~193 ALU instructions per warp and K-tile on E4M3 -> FP16x2, and
// sm_90 has no native FP8 mma.sync (ptxas lowers it to the same conversions). wgmma's FP8 path
// takes the E4M3 bytes as they come out of the codebook PRMT.
//
// Work split. A CTA owns the same token tile and 64-row strip group as the mma.sync kernels (same
// grid, same group_strips). Its warps form 1..4 warpgroups that split K (contiguous K-tile
// ranges, reduced in warpgroup order at the end: deterministic). Inside a warpgroup, warp q (0..3)
// holds m16 tile q of the 64 rows (rows g from strip a = 2q, rows g+8 from strip b = 2q+1): the
// register fragment of wgmma's A for m64nNk32 8-bit types is, per warp, the m16n8k32 A fragment,
// i.e. kDecFp8's register quad {strip a cols 8t+0..3, strip b cols 8t+0..3, strip a cols 8t+4..7,
// strip b cols 8t+4..7} (k-slots 4t.., 4t.., 16+4t.., 16+4t..).
//
// B (the tokens, N = 8 per token block) is read by the tensor core from shared memory through a
// matrix descriptor: K-major, no swizzle, one 8x16-byte core matrix per (token block, 16-byte K
// chunk), 128 bytes apart along K (both descriptor strides are 128 bytes and every wgmma has
// N = 8, so the leading/stride byte offsets cannot be confused). The activation bytes (x after
// quantize_x, h after GEMM1) are stored in kern::wg_pos order inside every 32-column block, the
// A fragment's k-slot order, so each K-tile of B is staged with plain 16-byte cp.async copies.
// Per warpgroup a ring of kStages stages holds, per K-tile, B (512 bytes per token block), the 8
// strips' index bytes and codebooks; each warp copies its own two strips and a quarter of B.
// Per K-tile: wait for the own copies, fence.proxy.async (cp.async writes are generic-proxy, the
// wgmma reads are async-proxy), a named barrier of the warpgroup (B is read by all four warps;
// it also frees the slot the next copy overwrites), decode both 32-column blocks (4 PRMT each),
// wgmma.fence, one wgmma per block and token block, commit, wait, promote.
//
// Numerics (spec section 4): every wgmma has scale-d = 0, so its FP32 result is the tensor core's
// sum of exactly one 32-column MXFP8 block of unscaled E4M3 products; it is multiplied by the
// token's power-of-two block scale, summed over the K-tile's two blocks and multiplied by the
// tile scale into the FP32 accumulator, as in the mma.sync decoders. The FP8 tensor core DOES
// round inside the 32-product sum: measured on the H200 (docs/perf/moe-gpu.md, "session 13"), the
// forward's normalised error against the CPU emulation is 0.6-5.1e-3 (the mma.sync decoders: <= 8e-5)
// and grows with K, so this decoder is outside the spec's "FP32 up to summation order".
//
// Measured (H200, 2026-11-30, same run as the default): 1.15-1.73x SLOWER than the default Cvt
// decoder at T = 1..256 on all four benchmark shapes, so it is opt-in (WeightDecoder::Fp8Wgmma),
// not Auto's choice. Likely reasons (no ncu profile was taken): each warp now owns 1024 weights per
// K-tile instead of 4096, so the per-K-tile bookkeeping (copies, scale loads, waits, loop) is paid
// four times as often per weight; every K-tile has a named barrier and an exposed wgmma round trip
// (commit + wait_group 0 before the promotion); and at most 4 warpgroups split K, so the few-CTA,
// long-K GEMMs (Mixtral T = 1: 1.73x slower) run 4x longer dependent chains per warp.
#pragma once

#include "moe_swapab.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LUTB_HAVE_WGMMA 1
#else
#define LUTB_HAVE_WGMMA 0
#endif

namespace lutb::cuda::kern {

/// Per-warpgroup ring stage: B [NB token blocks][4 K-chunks of 16 B][8 rows][16 B], then the 8
/// strips' index bytes [8][192] and codebooks [8][8]; stages 128-byte aligned.
template <int NB>
struct WgRing {
#ifndef LUTB_WG_STAGES
#define LUTB_WG_STAGES 8
#endif
  static constexpr int kStages = LUTB_WG_STAGES;
  static constexpr int kIdx = 512 * NB;
  static constexpr int kCb = kIdx + 8 * 192;
  static constexpr int kStageBytes = (kCb + 64 + 127) / 128 * 128;
  static constexpr int kGroupBytes = kStages * kStageBytes;
};

/// Dynamic shared memory of a CTA of `groups` warpgroups (ring, reused for the reduction).
template <int NB>
constexpr int wg_smem_bytes(int groups) {
  const int ring = groups * WgRing<NB>::kGroupBytes, red = groups * 4 * NB * 4 * 32 * 4;
  return ring > red ? ring : red;
}
constexpr int kWgMaxGroups = 4;
// Resident 512-thread CTAs per SM the compiler must allow with one token block: 2 caps the
// registers at 64 (8 warpgroups per SM, the rule of wg_groups in moe_lutb.cu; ptxas reports 32
// bytes of spill stores, 16 bytes of stack); two token blocks get 1 (at 64 registers they spilled
// ~350 bytes; ~110 registers without). A tuning build may override it.
#ifndef LUTB_WG_MINB
#define LUTB_WG_MINB 2
#endif

__device__ __forceinline__ void wg_fence() {
#if LUTB_HAVE_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#if LUTB_HAVE_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wg_wait() {
#if LUTB_HAVE_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
/// Keeps the compiler from moving reads of a wgmma result above the wait (as CUTLASS's
/// warpgroup_fence_operand).
__device__ __forceinline__ void wg_reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }

/// D = A (registers, m64k32 E4M3, this warp's m16 quad) x B (descriptor, n8k32 E4M3), scale-d = 0.
__device__ __forceinline__ void wgmma_e4m3_n8(float (&d)[4], const unsigned (&a)[4], unsigned long long desc) {
#if LUTB_HAVE_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(0));
#else
  (void)a; (void)desc;
  d[0] = d[1] = d[2] = d[3] = 0.0f;
  __trap();
#endif
}

/// Matrix descriptor (PTX ISA "Matrix Descriptor Format" of wgmma): start address, leading and
/// stride byte offsets (bits 0-13, 16-29, 32-45, each >> 4), no swizzle (bits 62-63 = 0).
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr) {
  return static_cast<unsigned long long>((saddr & 0x3ffffu) >> 4) | (static_cast<unsigned long long>(128 >> 4) << 16) |
         (static_cast<unsigned long long>(128 >> 4) << 32);
}

__device__ __forceinline__ void wg_bar(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
#if LUTB_HAVE_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/// Pair of B row n (0..8*NB-1) of token tile `slot`, or -1 (the row is zero-filled).
__device__ __forceinline__ int wg_tile_pair(const Routing& r, int slot, int n) {
  if (r.direct_pairs > 0) return n == 0 ? slot : -1;
  return n < r.tile_count[slot] ? r.sorted[r.tile_start[slot] + n] : -1;
}

/// One warp's share of its warpgroup's K-range [k0, k1): acc[nb][4] = its m16 tile (rows g of
/// strip 2q, g+8 of strip 2q+1) x token block nb, mma.sync m16n8 accumulator layout.
/// row_of(n): global address of token row n's activation bytes (K-tile 0), or nullptr (no token).
/// srow[nb][u]: FP32 block-scale row of the token of accumulator column 2t+u of block nb.
template <int NB, class RowOf, class BeforeWait>
__device__ __forceinline__ void wg_warp_gemm(const LutbW& w, long long e, const long long (&strip)[8],
                                             const bool (&ok)[8], RowOf&& row_of, const float* const (&srow)[NB][2],
                                             int nblocks, long long k0, long long k1, unsigned char* ring,
                                             int bar_id, float (&acc)[NB][4], BeforeWait&& before_wait) {
  using R = WgRing<NB>;
  const int lane = threadIdx.x & 31, q = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int r = 0; r < 4; ++r) acc[nb][r] = 0.0f;
  if (k0 >= k1) {  // uniform in the warpgroup
    before_wait();
    return;
  }
  const long long tiles_k = w.tiles_k;
  const int n = static_cast<int>(k1 - k0);
  const unsigned ring_s = static_cast<unsigned>(__cvta_generic_to_shared(ring));
  const long long tile0 = e * w.tiles_n * tiles_k + k0;
  const int ia = 2 * q, ib = 2 * q + 1;  // this warp's strips
  // strip[] / ok[] by a select over constant indices (q is not a compile-time constant: an indexed
  // read would put the arrays in local memory).
  long long sa = 0, sb = 0;
  bool oka = false, okb = false;
#pragma unroll
  for (int m = 0; m < 4; ++m)
    if (m == q) {
      oka = ok[2 * m];
      okb = ok[2 * m + 1];
      sa = oka ? strip[2 * m] : 0;
      sb = okb ? strip[2 * m + 1] : 0;
    }
  // This lane's copies per K-tile (all 16 bytes but the codebooks):
  //   A (all lanes): lanes 0..23 index chunk lane % 12 of strip ia / ib; lanes 24..31 B chunk lane-24;
  //   B (NB = 2, lanes 0..7): B chunk 8 + lane;   C (lanes 8, 9): the codebook of strip ia / ib.
  // B chunk c of warp q: global chunk qq = 8*NB*q + c = (token row qq/4, K-chunk qq%4).
  auto b_chunk = [&](int c, const unsigned char*& src, unsigned& dst, unsigned& bytes) {
    const int qq = 8 * NB * q + c, row = qq >> 2, kc = qq & 3;
    const unsigned char* p = row_of(row);
    bytes = p ? 16u : 0u;
    src = (p ? p : row_of(0)) + k0 * 64 + kc * 16;
    dst = static_cast<unsigned>((row >> 3) * 512 + kc * 128 + (row & 7) * 16);
  };
  const unsigned char* srcA;
  unsigned dstA, bytesA;
  long long stepA;
  if (lane < 24) {
    const int i = lane < 12 ? ia : ib;
    const bool sok = lane < 12 ? oka : okb;
    srcA = w.packed + (tile0 + (lane < 12 ? sa : sb) * tiles_k) * 192 + (lane % 12) * 16;
    dstA = static_cast<unsigned>(R::kIdx + i * 192 + (lane % 12) * 16);
    bytesA = sok ? 16u : 0u;
    stepA = 192;
  } else {
    b_chunk(lane - 24, srcA, dstA, bytesA);
    stepA = 64;
  }
  const unsigned char* srcB = w.packed;  // not read unless b_lane
  unsigned dstB = 0, bytesB = 0;
  if (NB == 2 && lane < 8) b_chunk(8 + lane, srcB, dstB, bytesB);
  const bool c_lane = lane == 8 || lane == 9;
  const int ic = lane == 8 ? ia : ib;
  const unsigned char* srcC = w.codebook + (tile0 + (lane == 8 ? sa : sb) * tiles_k) * 8;
  const unsigned dstC = static_cast<unsigned>(R::kCb + 8 * ic);
  const unsigned bytesC = (lane == 8 ? oka : okb) ? 8u : 0u;
  const bool b_lane = NB == 2 && lane < 8;

  auto issue = [&](int kk, unsigned slot_addr) {
    if (kk < n) {
      cp_async16_zfill(slot_addr + dstA, srcA, bytesA);
      srcA += stepA;
      if (b_lane) {
        cp_async16_zfill(slot_addr + dstB, srcB, bytesB);
        srcB += 64;
      }
      if (c_lane) {
        cp_async8_zfill(slot_addr + dstC, srcC, bytesC);
        srcC += 8;
      }
    }
    cp_async_commit();
  };

  // Tile scales of strips ia, ib (missing strips read strip 0's: their codebooks are zero) and the
  // block scales of tokens 2t, 2t+1, one K-tile ahead.
  const unsigned char* scpa = w.scale + tile0 + sa * tiles_k;
  const unsigned char* scpb = w.scale + tile0 + sb * tiles_k;
  const float2* sbase[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int u = 0; u < 2; ++u) sbase[nb][u] = reinterpret_cast<const float2*>(srow[nb][u] + 2 * k0);
  struct Sc {
    float fa, fb;
    float sx[NB][2][2];  // [nb][block][u]
  };
  auto load_w = [&](int kk, Sc& s) {
    s.fa = kUe8m0.v[__ldg(scpa + kk)];
    s.fb = kUe8m0.v[__ldg(scpb + kk)];
  };
  auto load_x = [&](int kk, Sc& s) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      if (nb > 0 && nb >= nblocks) continue;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float2 v = __ldg(sbase[nb][u] + kk);
        s.sx[nb][0][u] = v.x;
        s.sx[nb][1][u] = v.y;
      }
    }
  };

  // Prologue: the first stages' weights before the PDL wait, their B (written by the previous
  // kernel) after it. Group 0 then holds all prologue weight copies and stage 0's B, group s the B
  // of stage s: waiting for group kk still covers all of K-tile kk (groups complete in order).
#pragma unroll
  for (int s = 0; s < R::kStages - 1; ++s) {
    if (s < n) {
      const unsigned sl = ring_s + s * R::kStageBytes;
      if (lane < 24) cp_async16_zfill(sl + dstA, srcA + s * stepA, bytesA);
      if (c_lane) cp_async8_zfill(sl + dstC, srcC + 8 * s, bytesC);
    }
  }
  Sc cur;
  load_w(0, cur);
  before_wait();
#pragma unroll
  for (int s = 0; s < R::kStages - 1; ++s) {
    if (s < n) {
      const unsigned sl = ring_s + s * R::kStageBytes;
      if (lane >= 24) cp_async16_zfill(sl + dstA, srcA + s * stepA, bytesA);
      if (b_lane) cp_async16_zfill(sl + dstB, srcB + 64 * s, bytesB);
    }
    cp_async_commit();
  }
  srcA += (R::kStages - 1) * stepA;
  srcB += 64 * (R::kStages - 1);
  srcC += 8 * (R::kStages - 1);
  load_x(0, cur);
  const unsigned long long desc0 = wg_desc(ring_s);
  float d[2][NB][4];
#pragma unroll
  for (int b = 0; b < 2; ++b)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int r = 0; r < 4; ++r) d[b][nb][r] = 0.0f;
  int slot = 0;
#pragma unroll 2
  for (int kk = 0; kk < n; ++kk) {
    Sc nxt;
    const int kn = kk + 1 < n ? kk + 1 : kk;
    load_w(kn, nxt);
    load_x(kn, nxt);
    cp_async_wait<R::kStages - 2>();
    fence_proxy_async();
    wg_bar(bar_id);  // B of K-tile kk complete; every warp is done with K-tile kk-1's slot
    issue(kk + R::kStages - 1, ring_s + (slot == 0 ? R::kStages - 1 : slot - 1) * R::kStageBytes);
    const unsigned char* st = ring + slot * R::kStageBytes;
    const uint4 cb = *reinterpret_cast<const uint4*>(st + R::kCb + 16 * q);
    unsigned sel[2][4];
#pragma unroll
    for (int ab = 0; ab < 2; ++ab) {
      const int i = 2 * q + ab;
      const unsigned x = *reinterpret_cast<const unsigned*>(st + R::kIdx + i * 192 + 4 * lane);
      const unsigned y = *reinterpret_cast<const unsigned short*>(st + R::kIdx + i * 192 + 128 + 2 * lane);
      const unsigned xm = x & 0x77777777u;  // as swap_warp_gemm (moe_swapab.cuh)
      sel[ab][0] = xm;
      sel[ab][1] = xm >> 16;
      sel[ab][2] = y & 0x7777u;
      const unsigned sx = x & 0x88888888u;
      sel[ab][3] = (sx >> 3) + (sx >> 18) + ((y & 0x8888u) >> 1);
    }
    unsigned a[2][4];
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      a[blk][0] = prmt_raw(cb.x, cb.y, sel[0][2 * blk]);
      a[blk][1] = prmt_raw(cb.z, cb.w, sel[1][2 * blk]);
      a[blk][2] = prmt_raw(cb.x, cb.y, sel[0][2 * blk + 1]);
      a[blk][3] = prmt_raw(cb.z, cb.w, sel[1][2 * blk + 1]);
    }
    const unsigned long long desc = desc0 + static_cast<unsigned>((slot * R::kStageBytes) >> 4);
    wg_fence();
    // Every token block, also an empty second one (zero rows): a branch between the wgmma would
    // make ptxas insert warpgroup.arrive (NB = 2 runs only at > 10 tokens per expert, where the
    // second block is mostly full).
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) wgmma_e4m3_n8(d[blk][nb], a[blk], desc + ((nb * 512 + blk * 256) >> 4));
    }
    wg_commit();
    wg_wait<0>();
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      if (nb > 0 && nb >= nblocks) continue;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        wg_reg_fence(d[0][nb][r]);
        wg_reg_fence(d[1][nb][r]);
        const int u = r & 1;
        // Exact: the 32-column partial sums times the power-of-two block scales, then the tile scale.
        const float part = fmaf(d[1][nb][r], cur.sx[nb][1][u], d[0][nb][r] * cur.sx[nb][0][u]);
        acc[nb][r] = fmaf(part, r < 2 ? cur.fa : cur.fb, acc[nb][r]);
      }
    }
    cur = nxt;
    slot = slot == R::kStages - 1 ? 0 : slot + 1;
  }
  cp_async_wait<0>();
}

/// Adds the warpgroups' partial sums in warpgroup order; warp 0 gets the CTA's 4 m16 tiles in
/// the mma.sync layout of the other swap-AB kernels (acc4[m][nb][r]). Returns true in warp 0.
template <int NB>
__device__ __forceinline__ bool wg_reduce(unsigned char* smem, const float (&acc)[NB][4], float (&acc4)[4][NB][4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, groups = blockDim.x >> 7;
  __syncthreads();  // every ring drained (wg_warp_gemm ends with cp.async.wait_group 0)
  float* red = reinterpret_cast<float*>(smem);
  // red[(((group * 4 + q) * NB + nb) * 4 + r) * 32 + lane]; warp = 4 * group + q
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int r = 0; r < 4; ++r) red[((warp * NB + nb) * 4 + r) * 32 + lane] = acc[nb][r];
  __syncthreads();
  if (warp > 0) return false;
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float s = red[((m * NB + nb) * 4 + r) * 32 + lane];
        for (int u = 1; u < groups; ++u) s += red[(((4 * u + m) * NB + nb) * 4 + r) * 32 + lane];
        acc4[m][nb][r] = s;
      }
  return true;
}

/// GEMM1 + SiLU*up + MXFP8 of h (wgmma). Grid as swapab_gemm1_kernel; blockDim.x = 128 * groups.
/// xa: [T, a_cols] E4M3 bytes in wg_pos order; hq: [P, Ip] E4M3 bytes in wg_pos order.
template <int NB>
__global__ void __launch_bounds__(128 * kWgMaxGroups, NB == 1 ? LUTB_WG_MINB : 1)
    swapab_wg_gemm1_kernel(LutbW w, const unsigned char* __restrict__ xa, const float* __restrict__ xsf,
                           long long a_cols, Routing r, long long I, long long Ip, unsigned char* __restrict__ hq,
                           float* __restrict__ hsf) {
#if LUTB_HAVE_WGMMA
  int e;
  SwapTokens<NB> tk;
  if (!swap_tile<NB>(r, blockIdx.y, e, tk)) return;
  const int warp = threadIdx.x >> 5, group = warp >> 2, groups = blockDim.x >> 7;
  const long long G = blockIdx.x;
  long long strip[8];
  bool ok[8];
  group_strips<true>(G, w.tiles_n, I / 8, strip, ok);
  const float* srow[NB][2];
  const long long sblocks = a_cols / 32;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int pc = tk.pair_c[nb][u] >= 0 ? tk.pair_c[nb][u] : tk.first;
      srow[nb][u] = xsf + static_cast<long long>(pc / r.top_k) * sblocks;
    }
  const int slot = blockIdx.y;
  auto row_of = [&](int n) -> const unsigned char* {
    const int p = wg_tile_pair(r, slot, n);
    return p >= 0 ? xa + static_cast<long long>(p / r.top_k) * a_cols : nullptr;
  };
  const int nblocks = (tk.count + 7) / 8;
  const long long per = (w.tiles_k + groups - 1) / groups;
  const long long k0 = min(w.tiles_k, per * group), k1 = min(w.tiles_k, k0 + per);
  extern __shared__ __align__(128) unsigned char wg_smem[];
  float acc[NB][4];
  wg_warp_gemm<NB>(w, e, strip, ok, row_of, srow, nblocks, k0, k1, wg_smem + group * WgRing<NB>::kGroupBytes,
                   1 + group, acc, PdlWaitAndTrigger{});
  float acc4[4][NB][4];
  if (!wg_reduce<NB>(wg_smem, acc, acc4)) return;
  swap_epilogue1<kDecWg, NB>(tk, nblocks, ok, acc4, G, Ip, hq, hsf);
#else
  (void)w; (void)xa; (void)xsf; (void)a_cols; (void)r; (void)I; (void)Ip; (void)hq; (void)hsf;
  __trap();
#endif
}

/// GEMM2 (wgmma): y[p, n] = h[p] . w2[e, n]^T (FP32). Grid as swapab_gemm2_kernel.
template <int NB>
__global__ void __launch_bounds__(128 * kWgMaxGroups, NB == 1 ? LUTB_WG_MINB : 1)
    swapab_wg_gemm2_kernel(LutbW w, const unsigned char* __restrict__ ha, const float* __restrict__ hsf, long long Ip,
                           Routing r, long long H, float* __restrict__ y) {
#if LUTB_HAVE_WGMMA
  int e;
  SwapTokens<NB> tk;
  if (!swap_tile<NB>(r, blockIdx.y, e, tk)) return;
  const int warp = threadIdx.x >> 5, group = warp >> 2, groups = blockDim.x >> 7;
  const long long G = blockIdx.x;
  long long strip[8];
  bool ok[8];
  group_strips<false>(G, w.tiles_n, 0, strip, ok);
  const float* srow[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int pc = tk.pair_c[nb][u] >= 0 ? tk.pair_c[nb][u] : tk.first;
      srow[nb][u] = hsf + static_cast<long long>(pc) * (Ip / 32);
    }
  const int slot = blockIdx.y;
  auto row_of = [&](int n) -> const unsigned char* {
    const int p = wg_tile_pair(r, slot, n);
    return p >= 0 ? ha + static_cast<long long>(p) * Ip : nullptr;
  };
  const int nblocks = (tk.count + 7) / 8;
  const long long per = (w.tiles_k + groups - 1) / groups;
  const long long k0 = min(w.tiles_k, per * group), k1 = min(w.tiles_k, k0 + per);
  extern __shared__ __align__(128) unsigned char wg_smem[];
  float acc[NB][4];
  wg_warp_gemm<NB>(w, e, strip, ok, row_of, srow, nblocks, k0, k1, wg_smem + group * WgRing<NB>::kGroupBytes,
                   1 + group, acc, PdlWaitAndTrigger{});
  float acc4[4][NB][4];
  if (!wg_reduce<NB>(wg_smem, acc, acc4)) return;
  swap_epilogue2<NB>(tk, nblocks, strip, ok, acc4, y, H);
#else
  (void)w; (void)ha; (void)hsf; (void)Ip; (void)r; (void)H; (void)y;
  __trap();
#endif
}

}  // namespace lutb::cuda::kern
