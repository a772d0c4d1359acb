// src/cuda/moe_swapab_ws_sm90.cuh: warp-specialised swap-AB decode GEMMs for sm_90a
// (WeightDecoder::CvtWs): one PRODUCER warp per CTA streams the weight strips into a shared-memory
// ring with Hopper's bulk copies (cp.async.bulk, 1-D, no tensor map) and mbarriers; the other
// warps (the "math" warps) only read shared memory, decode (the kDecCvt decode of moe_swapab.cuh:
// PRMT codebook lookup + cvt.rn.f16x2.e4m3x2), mma and promote, and hold no copy state.
// Kernel names: sm90_lutb_mxfp8_moe_gemm{1,2}_swapab_ws.
//
// Work split: exactly the default swap-AB kernels' (moe_swapab.cuh): a CTA owns one token tile
// (<= 8*NB pairs of one expert) and one strip group (8 tile row-strips: GEMM1 4 gate + the 4 up
// strips of the same I-columns, GEMM2 8 consecutive-ish strips), its nw math warps split K into the
// same contiguous K-tile ranges (per = ceil(tiles_k / nw)), each warp accumulates its range in the
// same order with the same instructions, and the partial sums are added in warp order at the end.
// So for the same nw the FP32 results are BIT-IDENTICAL to the default kDecCvt kernels (tested);
// the host picks nw with the default's rule (swap_warps in moe_lutb.cu).
//
// Ring: kStages stages; stage s holds, for every math warp w, K-tile k0_w + s of its range (a
// 1632-byte sub-slot: 8 strips x 192 lane-major index bytes, 8 x 8 codebook bytes, 8 FP32 tile
// scales 2^(s_w-127)). Producer (warp nw), per stage: wait "empty" (all math lanes released the
// slot), expect_tx of the index bytes on "full", one 192-byte cp.async.bulk per (warp, present
// strip), one 8-byte cp.async per (warp, strip) for the codebook (zero-filled for a missing strip,
// so its products are zero whatever the stale index bytes are; codebooks are only 8-byte aligned,
// below cp.async.bulk's 16), the tile scales loaded one stage ahead into registers and stored as
// FP32, then every producer lane arrives twice on "full": once through cp.async.mbarrier.arrive
// .noinc (when its cp.async have landed) and once plainly (after its scale stores). Full barrier
// count 64 + the transaction bytes; empty barrier count 32*nw. Warps whose range is shorter than
// warp 0's keep waiting/arriving on the stages they do not use (so phases never run ahead).
//
// Activations and their block scales are NOT staged: the math warps load them from global memory
// (L1/L2 hits: every CTA of a token tile reads the same rows) one K-tile ahead, as the default
// does. Staging them would need up to 16 tokens x Hp x 2 bytes (458 KiB at DeepSeek-V3's H = 7168)
// per CTA, or a per-stage copy as large as the weights' (8 tokens x 128 bytes per K-tile).
//
// Programmatic dependent launch: the producer only reads weights (never the previous kernel's
// output), so it starts streaming at once; the math warps wait (pdl_wait, then pdl_trigger) before
// their first activation load, as in the default kernels.
#pragma once

#include "moe_swapab.cuh"

namespace lutb::cuda::kern {

/// Shared-memory layout of the warp-specialised swap-AB CTA.
struct WsRing {
#ifndef LUTB_WS_STAGES
#define LUTB_WS_STAGES 4
#endif
  static constexpr int kStages = LUTB_WS_STAGES;     // a tuning build may override it
  static constexpr int kIdx = 8 * 192;               // [8 strips][192] lane-major index bytes
  static constexpr int kCbOff = kIdx;                // [8][8] codebook bytes
  static constexpr int kScOff = kCbOff + 8 * 8;      // [8] FP32 tile scales
  static constexpr int kSub = kScOff + 8 * 4;        // one math warp's share of a stage
};
static_assert(WsRing::kSub == 1632 && WsRing::kSub % 16 == 0, "sub-slots stay 16-byte aligned (bulk copies)");

/// Dynamic shared memory of a CTA with `nw` math warps: the ring (reused for the warp-order
/// reduction of the partial sums) and 2 * kStages mbarriers.
template <int NB>
constexpr int ws_smem_bytes(int nw) {
  const int ring = nw * WsRing::kStages * WsRing::kSub, red = (nw - 1) * 16 * NB * 32 * 4;
  return (ring > red ? ring : red) + 2 * WsRing::kStages * 8;
}
template <int NB>
constexpr int ws_bar_offset(int nw) {
  return ws_smem_bytes<NB>(nw) - 2 * WsRing::kStages * 8;
}

// ---- mbarrier / bulk-copy primitives (sm_90; never launched elsewhere) --------------------------
__device__ __forceinline__ void ws_mbar_init(unsigned addr, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void ws_mbar_arrive(unsigned addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void ws_mbar_expect_tx(unsigned addr, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(bytes) : "memory");
#else
  (void)addr; (void)bytes;
  __trap();
#endif
}
/// Arrive-on (counted: .noinc) once every cp.async this thread issued before has completed.
__device__ __forceinline__ void ws_cp_async_arrive(unsigned addr) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr) : "memory");
}
/// Spins until the phase of parity `parity` has completed; traps after 10 s (a broken pipeline
/// then fails loudly instead of hanging).
__device__ __forceinline__ void ws_mbar_wait(unsigned addr, unsigned parity) {
  unsigned long long t0 = 0;
  for (unsigned n = 0;; ++n) {
    unsigned ok;
    asm volatile(
        "{\n.reg .pred P1;\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%1], %2;\nselp.u32 %0, 1, 0, P1;\n}\n"
        : "=r"(ok)
        : "r"(addr), "r"(parity)
        : "memory");
    if (ok) return;
    if ((n & 1023u) == 1023u) {
      unsigned long long now;
      asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
      if (t0 == 0) t0 = now;
      else if (now - t0 > 10000000000ull) __trap();
    }
  }
}
/// 1-D bulk copy global -> shared of `bytes` (multiple of 16, both addresses 16-byte aligned),
/// completing `bytes` transactions on the mbarrier at `bar`.
__device__ __forceinline__ void ws_bulk_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
#else
  (void)dst; (void)src; (void)bytes; (void)bar;
  __trap();
#endif
}
__device__ __forceinline__ void ws_fence_barrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void ws_named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

/// The producer warp: streams stages 0..nmax-1 (see the file comment).
__device__ __forceinline__ void ws_producer(const LutbW& w, long long e, const long long (&strip)[8],
                                            const bool (&ok)[8], int nw, long long per, unsigned ring_s,
                                            unsigned bar_s) {
  using R = WsRing;
  const int lane = threadIdx.x & 31;
  const long long tiles_k = w.tiles_k;
  const int nmax = static_cast<int>(per);  // warp 0's range (per <= tiles_k)
  // Lane l serves strip i = l & 7 of the math warps w = (l >> 3) + 4j, j = 0..3.
  const int i = lane & 7;
  long long si = 0;
  bool sok = false;
#pragma unroll
  for (int u = 0; u < 8; ++u)
    if (u == i) {
      si = strip[u];
      sok = ok[u];
    }
  // Missing strips use strip 0's tiles (codebook zero-filled, index bytes not copied, scale finite).
  const long long tbase = (e * w.tiles_n + (sok ? si : 0)) * tiles_k;
  int present = 0;
#pragma unroll
  for (int u = 0; u < 8; ++u) present += ok[u] ? 1 : 0;
  const int jn = (nw + 3) / 4;  // j rounds with a warp in them
  auto k0_of = [&](int wj) { return min(tiles_k, per * wj); };
  auto n_of = [&](int wj) {
    const long long k0 = k0_of(wj);
    return static_cast<int>(min(tiles_k, k0 + per) - k0);
  };
  // Tile scales one stage ahead (their load latency overlaps the previous stage's waits).
  auto load_sc = [&](int s, float (&v)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int wj = (lane >> 3) + 4 * j;
      v[j] = 1.0f;
      if (j < jn && wj < nw && s < n_of(wj)) v[j] = ue8m0_f(__ldg(w.scale + tbase + k0_of(wj) + s));
    }
  };
  float sc[4];
  load_sc(0, sc);
  for (int s = 0; s < nmax; ++s) {
    const int slot = s % R::kStages;
    const unsigned full = bar_s + 8u * slot, empty = bar_s + 8u * (R::kStages + slot);
    float nsc[4];
    if (s + 1 < nmax) load_sc(s + 1, nsc);
    if (s >= R::kStages) ws_mbar_wait(empty, static_cast<unsigned>((s / R::kStages - 1) & 1));
    if (lane == 0) {
      // Math warps w < ceil((tiles_k - s) / per) have K-tile s in their range.
      const long long active = min(static_cast<long long>(nw), (tiles_k - s - 1) / per + 1);
      ws_mbar_expect_tx(full, static_cast<unsigned>(active * present * 192));
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int wj = (lane >> 3) + 4 * j;
      if (j < jn && wj < nw && s < n_of(wj)) {
        const long long tile = tbase + k0_of(wj) + s;
        const unsigned dst = ring_s + static_cast<unsigned>((slot * nw + wj) * R::kSub);
        if (sok) ws_bulk_g2s(dst + 192u * i, w.packed + tile * 192, 192u, full);
        cp_async8_zfill(dst + R::kCbOff + 8u * i, w.codebook + tile * 8, sok ? 8u : 0u);
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(dst + R::kScOff + 4u * i), "f"(sc[j]) : "memory");
      }
    }
    ws_cp_async_arrive(full);
    ws_mbar_arrive(full);
    if (s + 1 < nmax)
#pragma unroll
      for (int j = 0; j < 4; ++j) sc[j] = nsc[j];
  }
  cp_async_wait<0>();
}

/// One math warp's K-range [k0, k0 + n) for 8 strips and NB token n-blocks, reading stage
/// sub-slots at `sub0` (sub-slot of stage 0; stage s at sub0 + s * stage_bytes), waiting on
/// full[] and releasing empty[] for all nmax stages. The arithmetic is swap_warp_gemm's kDecCvt
/// path instruction for instruction (bit-identical partial sums).
template <int NB, bool kOne, int kUnroll>
__device__ __forceinline__ void ws_math(const void* const (&arow)[NB], const float* const (&srow)[NB][2],
                                        int nblocks, long long k0, int n, int nmax, const unsigned char* sub0,
                                        int stage_bytes, unsigned bar_s, float (&acc)[4][NB][4]) {
  using R = WsRing;
  const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
  for (int m = 0; m < 4; ++m)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[m][nb][r] = 0.0f;
  struct XTile {
    uint4 v[NB][2];
    float sx[NB][2][2];  // [nb][block][u]
  };
  const unsigned char* abase[NB];
  const float2* sbase[NB][2];
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    abase[nb] = static_cast<const unsigned char*>(arow[nb]) + (k0 * 64 + 8 * t) * 2;
#pragma unroll
    for (int u = 0; u < 2; ++u) sbase[nb][u] = reinterpret_cast<const float2*>(srow[nb][u] + 2 * k0);
  }
  auto load_x = [&](int kk, XTile& x) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      if (nb > 0 && nb >= nblocks) continue;
#pragma unroll
      for (int blk = 0; blk < 2; ++blk)
        x.v[nb][blk] = __ldg(reinterpret_cast<const uint4*>(abase[nb] + kk * 128 + 64 * blk));
#pragma unroll
      for (int u = 0; u < (kOne ? 1 : 2); ++u) {
        const float2 sc = __ldg(sbase[nb][u] + kk);
        x.sx[nb][0][u] = sc.x;
        x.sx[nb][1][u] = sc.y;
      }
    }
  };
  PdlWaitAndTrigger{}();
  XTile cur;
  if (n > 0) load_x(0, cur);
  int slot = 0;
  unsigned parity = 0;
#pragma unroll kUnroll
  for (int kk = 0; kk < n; ++kk) {
    XTile nxt;
    const int kn = kk + 1 < n ? kk + 1 : kk;
    load_x(kn, nxt);
    ws_mbar_wait(bar_s + 8u * slot, parity);
    const unsigned char* st = sub0 + slot * stage_bytes;
    const float4 fw0 = *reinterpret_cast<const float4*>(st + R::kScOff);
    const float4 fw1 = *reinterpret_cast<const float4*>(st + R::kScOff + 16);
    const float fw[8] = {fw0.x, fw0.y, fw0.z, fw0.w, fw1.x, fw1.y, fw1.z, fw1.w};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const uint4 cb = *reinterpret_cast<const uint4*>(st + R::kCbOff + 16 * m);
      unsigned sel[2][4];
#pragma unroll
      for (int ab = 0; ab < 2; ++ab) {
        const int i = 2 * m + ab;
        const unsigned x = *reinterpret_cast<const unsigned*>(st + i * 192 + 4 * lane);
        const unsigned y = *reinterpret_cast<const unsigned short*>(st + i * 192 + 128 + 2 * lane);
        const unsigned xm = x & 0x77777777u;
        sel[ab][0] = xm;
        sel[ab][1] = xm >> 16;
        sel[ab][2] = y & 0x7777u;
        const unsigned sx = x & 0x88888888u;
        sel[ab][3] = (sx >> 3) + (sx >> 18) + ((y & 0x8888u) >> 1);
      }
      float part[NB][4];
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        unsigned a0[4], a1[4];
        unsigned pa = prmt_raw(cb.x, cb.y, sel[0][2 * blk]), pb = prmt_raw(cb.z, cb.w, sel[1][2 * blk]);
        bytes_to_f16<true>(pa, a0[0], a0[2]);
        bytes_to_f16<true>(pb, a0[1], a0[3]);
        pa = prmt_raw(cb.x, cb.y, sel[0][2 * blk + 1]);
        pb = prmt_raw(cb.z, cb.w, sel[1][2 * blk + 1]);
        bytes_to_f16<true>(pa, a1[0], a1[2]);
        bytes_to_f16<true>(pb, a1[1], a1[3]);
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          if (nb > 0 && nb >= nblocks) continue;
          const uint4 xv = cur.v[nb][blk];
          float c[4];
          mma_f16_zero(c, a0, xv.x, xv.y);
          mma16816<false>(c, a1, xv.z, xv.w);
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
      const float fa = fw[2 * m], fb = fw[2 * m + 1];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        if (nb > 0 && nb >= nblocks) continue;
        acc[m][nb][0] = fmaf(part[nb][0], fa, acc[m][nb][0]);
        acc[m][nb][2] = fmaf(part[nb][2], fb, acc[m][nb][2]);
        if constexpr (!kOne) {
          acc[m][nb][1] = fmaf(part[nb][1], fa, acc[m][nb][1]);
          acc[m][nb][3] = fmaf(part[nb][3], fb, acc[m][nb][3]);
        }
      }
    }
    ws_mbar_arrive(bar_s + 8u * (R::kStages + slot));  // this lane is done with the slot
    cur = nxt;
    if (++slot == R::kStages) {
      slot = 0;
      parity ^= 1u;
    }
  }
  // Stages past this warp's range: keep the phases in step (wait for the stage, release it).
  for (int kk = n; kk < nmax; ++kk) {
    ws_mbar_wait(bar_s + 8u * slot, parity);
    ws_mbar_arrive(bar_s + 8u * (R::kStages + slot));
    if (++slot == R::kStages) {
      slot = 0;
      parity ^= 1u;
    }
  }
}

/// The partial sums of the nw math warps added in warp order into warp 0's acc (swap_reduce's
/// order), through the ring memory (free: every stage has been consumed). Returns true in warp 0.
template <int NB>
__device__ __forceinline__ bool ws_reduce(unsigned char* smem, int nw, float (&acc)[4][NB][4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (nw == 1) return true;
  ws_named_sync(1, 32 * nw);
  float* red = reinterpret_cast<float*>(smem);
  constexpr int kPer = 16 * NB;
  if (warp > 0) {
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) red[((warp - 1) * kPer + (m * NB + nb) * 4 + r) * 32 + lane] = acc[m][nb][r];
  }
  ws_named_sync(1, 32 * nw);
  if (warp > 0) return false;
  for (int u = 1; u < nw; ++u)
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[m][nb][r] += red[((u - 1) * kPer + (m * NB + nb) * 4 + r) * 32 + lane];
  return true;
}

/// Most math warps per CTA (the default's swap_max_warps).
constexpr int ws_max_warps(int nb) { return swap_max_warps(nb); }

/// Register configurations (the knob that sets the warps per SM), chosen at run time by
/// LUTB_WS_REGS = 72 / 88 / 120 (for benchmarking; default kWsCfgDefault). Registers per thread for
/// one token block (two blocks in brackets) and the unroll of the K-loop:
///   kWs72:  72 (128), unrolled once: ~28 warps per SM; ptxas spills ~30-70 bytes (two blocks ~24);
///   kWs88:  88 (160), unrolled twice (cur/nxt alternate registers): ~23 warps per SM, ~40 bytes (two blocks ~50);
///   kWs120: 120 (192), unrolled twice: 16 warps per SM as the default kernels, no spill (120, not
///           128: a CTA of 16 math warps + the producer must fit 65536 registers).
constexpr int kWs72 = 0, kWs88 = 1, kWs120 = 2;
constexpr int kWsCfgDefault = kWs72;
constexpr int ws_regs(int nb, int cfg) {
  return nb == 1 ? (cfg == kWs72 ? 72 : cfg == kWs88 ? 88 : 120) : (cfg == kWs72 ? 128 : cfg == kWs88 ? 160 : 192);
}
constexpr int ws_unroll(int cfg) { return cfg == kWs72 ? 1 : 2; }

/// Body shared by both GEMMs: blockDim.x = 32 * (nw + 1), warp nw the producer.
template <int NB, bool kGemm1, int kCfg>
__device__ __forceinline__ void ws_gemm(const LutbW& w, const void* xa, const float* xsf, long long a_cols,
                                        const Routing& r, long long I, long long Ip, void* hq, float* hsf, float* y,
                                        long long H, bool one_token_loop) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  int e;
  SwapTokens<NB> tk;
  if (!swap_tile<NB>(r, blockIdx.y, e, tk)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x >> 5) - 1;
  const long long per = (w.tiles_k + nw - 1) / nw;
  extern __shared__ __align__(128) unsigned char ws_smem[];
  const unsigned ring_s = static_cast<unsigned>(__cvta_generic_to_shared(ws_smem));
  const unsigned bar_s = ring_s + static_cast<unsigned>(ws_bar_offset<NB>(nw));
  if (threadIdx.x == 0) {
    for (int s = 0; s < WsRing::kStages; ++s) {
      ws_mbar_init(bar_s + 8u * s, 64u);
      ws_mbar_init(bar_s + 8u * (WsRing::kStages + s), 32u * nw);
    }
    ws_fence_barrier_init();
  }
  __syncthreads();
  if (warp == nw) {
    long long strip[8];
    bool ok[8];
    group_strips<kGemm1>(blockIdx.x, w.tiles_n, I / 8, strip, ok);
    ws_producer(w, e, strip, ok, nw, per, ring_s, bar_s);
    return;
  }
  (void)lane;
  const void* arow[NB];
  const float* srow[NB][2];
  const long long sblocks = a_cols / 32;
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const int p = tk.pair_g[nb] >= 0 ? tk.pair_g[nb] : tk.first;
    const long long arow_i = kGemm1 ? p / r.top_k : p;
    arow[nb] = static_cast<const unsigned char*>(xa) + arow_i * a_cols * 2;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int pc = tk.pair_c[nb][u] >= 0 ? tk.pair_c[nb][u] : tk.first;
      const long long srow_i = kGemm1 ? pc / r.top_k : pc;
      srow[nb][u] = xsf + srow_i * sblocks;
    }
  }
  const int nblocks = (tk.count + 7) / 8;
  const long long k0 = min(w.tiles_k, per * warp), k1 = min(w.tiles_k, k0 + per);
  const int n = static_cast<int>(k1 - k0), nmax = static_cast<int>(per);
  const unsigned char* sub0 = ws_smem + warp * WsRing::kSub;
  const int stage_bytes = nw * WsRing::kSub;
  float acc[4][NB][4];
  if (NB == 1 && one_token_loop && tk.count == 1)
    ws_math<NB, NB == 1, ws_unroll(kCfg)>(arow, srow, nblocks, k0, n, nmax, sub0, stage_bytes, bar_s, acc);
  else
    ws_math<NB, false, ws_unroll(kCfg)>(arow, srow, nblocks, k0, n, nmax, sub0, stage_bytes, bar_s, acc);
  if (!ws_reduce<NB>(ws_smem, nw, acc)) return;
  // The epilogue's token rows and strips are recomputed here rather than kept live across the
  // K-loop (registers: the math warps' cap is what sets the warps per SM).
  if (!swap_tile<NB>(r, blockIdx.y, e, tk)) return;
  const long long G = blockIdx.x;
  long long strip[8];
  bool ok[8];
  group_strips<kGemm1>(G, w.tiles_n, I / 8, strip, ok);
  if constexpr (kGemm1) swap_epilogue1<kDecCvt, NB>(tk, nblocks, ok, acc, G, Ip, hq, hsf);
  else swap_epilogue2<NB>(tk, nblocks, strip, ok, acc, y, H);
#else
  (void)w; (void)xa; (void)xsf; (void)a_cols; (void)r; (void)I; (void)Ip; (void)hq; (void)hsf; (void)y; (void)H;
  (void)one_token_loop;
  __trap();
#endif
}

/// GEMM1 + SiLU*up + MXFP8 of h (the kDecCvt forms: xa [T, Hp] FP16 E4M3 values in natural column
/// order, xsf [T, Hp/32] FP32 block scales; hq [P, Ip] FP16 values, hsf [P, Ip/32]).
/// Grid (Ip/32 strip groups, token tile slots); blockDim.x = 32 * (nw + 1).
template <int NB, int kRegs>
__global__ void __launch_bounds__(32 * (ws_max_warps(NB) + 1)) __maxnreg__(ws_regs(NB, kRegs))
    sm90_lutb_mxfp8_moe_gemm1_swapab_ws(LutbW w, const void* __restrict__ xa, const float* __restrict__ xsf,
                                        long long a_cols, Routing r, long long I, long long Ip, void* __restrict__ hq,
                                        float* __restrict__ hsf, bool one_token_loop) {
  ws_gemm<NB, true, kRegs>(w, xa, xsf, a_cols, r, I, Ip, hq, hsf, nullptr, 0, one_token_loop);
}

/// GEMM2: y[p, n] = h[p] . w2[e, n]^T (FP32). Grid (ceil(tiles_n/8) strip groups, slots).
template <int NB, int kRegs>
__global__ void __launch_bounds__(32 * (ws_max_warps(NB) + 1)) __maxnreg__(ws_regs(NB, kRegs))
    sm90_lutb_mxfp8_moe_gemm2_swapab_ws(LutbW w, const void* __restrict__ ha, const float* __restrict__ hsf,
                                        long long Ip, Routing r, long long H, float* __restrict__ y,
                                        bool one_token_loop) {
  ws_gemm<NB, false, kRegs>(w, ha, hsf, Ip, r, 0, Ip, nullptr, nullptr, y, H, one_token_loop);
}

}  // namespace lutb::cuda::kern
