// src/cuda/moe_swapab_ws_sm90.cuh: warp-specialised swap-AB decode GEMMs for sm_90a
// (WeightDecoder::CvtWs): one PRODUCER warp per CTA streams the weight strips into a shared-memory
// ring with Hopper's bulk copies (cp.async.bulk, 1-D, no tensor map) and mbarriers; the other
// warps (the "math" warps) only read shared memory, decode (the kDecCvt decode of moe_swapab.cuh:
// PRMT codebook lookup + cvt.rn.f16x2.e4m3x2), mma and promote, and hold no copy state.
// Kernel names: sm90_lutb_mxfp8_moe_gemm{1,2}_swapab_ws.
//
// Work split: the default swap-AB kernels' CTA split (moe_swapab.cuh): a CTA owns one token tile
// (<= 8*NB pairs of one expert) and one strip group (8 tile row-strips: GEMM1 4 gate + the 4 up
// strips of the same I-columns, GEMM2 strips 8G..8G+7), with nw math warps (the host picks nw with
// the default's rule, swap_warps in moe_lutb.cu). Unlike the default, the math warps take the
// K-tiles INTERLEAVED: stage s of the ring holds K-tiles s*nw .. s*nw+nw-1 and math warp w uses
// K-tile s*nw + w, so the index bytes of one strip for a whole stage are ONE contiguous bulk copy
// (nw x 192 bytes; 8 copies per stage). A first version gave every warp a contiguous K range like
// the default (bit-identical to it) and needed one 192-byte copy per (warp, strip): the per-lane
// copies were issued one lane at a time (ptxas wraps cp.async.bulk in an ELECT loop: ~8
// instructions per copy) and the producer warp could not keep up (device run dec14-run1: 1.2-1.9x
// slower than Cvt). Each warp accumulates its K-tiles in order with swap_warp_gemm's per-K-tile
// arithmetic, and the partial sums are added in warp order at the end: fixed order, deterministic,
// FP32 (spec section 4: only the order of the FP32 additions differs from the CPU emulation).
//
// Ring: kStages stages of nw * 1632 bytes: index bytes [8 strips][nw][192], codebooks [nw][8][8],
// FP32 tile scales 2^(s_w-127) [nw][8]. Producer (warp nw), per stage: wait "empty" (all math
// lanes released the slot), expect_tx of the index bytes on "full", one cp.async.bulk per present
// strip (lanes 0..7), one 8-byte cp.async per (K-tile, strip) for the codebook (zero-filled for a
// missing strip, so its products are zero whatever the stale index bytes are; codebooks are only
// 8-byte aligned, below cp.async.bulk's 16), the tile scales (loaded kStages stages ahead into a
// register ring) stored as FP32, then every producer lane arrives twice on "full": once through
// cp.async.mbarrier.arrive.noinc (when its cp.async have landed) and once plainly (after its scale
// stores). Full barrier count 64 + the transaction bytes; empty barrier count 32*nw. Warps without
// a K-tile in the last stage still wait/arrive on it (so phases never run ahead).
//
// Activations and their block scales are NOT staged: the math warps load them from global memory
// (L1/L2 hits: every CTA of a token tile reads the same rows) one K-tile ahead, as the default
// does. Staging them would need up to 16 tokens x Hp x 2 bytes (458 KiB at DeepSeek-V3's H = 7168)
// per CTA, or a per-stage copy as large as the weights' (8 tokens x 128 bytes per K-tile).
//
// Programmatic dependent launch: the producer only reads weights (never the previous kernel's
// output), so it starts streaming at once; the math warps wait (pdl_wait, then pdl_trigger) before
// their first activation load, as in the default kernels.
//
// Speed (H200, device run dec14-run2): 0.70-1.10x the default kDecCvt kernels at T = 1..64 on the
// four benchmark shapes, so the heuristic never picks these kernels (docs/perf/moe-gpu.md,
// "Session 14: warp-specialised TMA decode (dec14)", has the figures and what is left to try).
#pragma once

#include "moe_swapab.cuh"

namespace lutb::cuda::kern {

/// Shared-memory layout of the warp-specialised swap-AB CTA.
struct WsRing {
  static constexpr int kStages = 4;  // the producer's scale-byte ring is unrolled for 4
  // Bytes per math warp per stage (one K-tile): 8 strips x (192 index + 8 codebook bytes + one
  // FP32 scale); a stage of nw math warps is nw * kSub bytes (layout: ws_cb_off, ws_sc_off).
  static constexpr int kSub = 8 * (192 + 8 + 4);
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

/// Byte offsets inside one stage of a CTA with nw math warps (stage s = K-tiles s*nw .. s*nw+nw-1,
/// K-tile s*nw + w for math warp w): index bytes [8 strips][nw][192] (one bulk copy per strip),
/// codebooks [nw][8 strips][8], FP32 tile scales [nw][8 strips].
__host__ __device__ constexpr int ws_cb_off(int nw) { return 8 * nw * 192; }
__host__ __device__ constexpr int ws_sc_off(int nw) { return 8 * nw * 200; }

/// The producer warp: streams stages 0..nst-1 (see the file comment).
__device__ __forceinline__ void ws_producer(const LutbW& w, long long e, const long long (&strip)[8],
                                            const bool (&ok)[8], int nw, int nst, unsigned ring_s,
                                            unsigned bar_s) {
  using R = WsRing;
  const int lane = threadIdx.x & 31;
  const long long tiles_k = w.tiles_k;
  const int stage_bytes = nw * R::kSub, cb_off = ws_cb_off(nw), sc_off = ws_sc_off(nw);
  // Lane l serves strip i = l & 7: the bulk copy of its index bytes (lanes 0..7), and the codebooks
  // and scales of the stage's K-tiles c = (l >> 3) + 4j, j = 0..3 (c < nw).
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
  const int jn = (nw + 3) / 4;  // j rounds with a K-tile in them
  // K-tiles of stage s: min(nw, tiles_k - s*nw) (only the last stage can be short).
  auto count = [&](int s) { return static_cast<int>(min(static_cast<long long>(nw), tiles_k - static_cast<long long>(s) * nw)); };
  // Tile scales kStages stages ahead in a register ring (the loop is unrolled by kStages so that the
  // ring is indexed statically), as raw bytes converted only when stored: a load consumed one stage
  // later made every producer iteration wait a global-load latency.
  auto load_sc = [&](int s, unsigned (&v)[4]) {
    const int cnt = s < nst ? count(s) : 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = (lane >> 3) + 4 * j;
      v[j] = 127u;
      if (j < jn && c < cnt) v[j] = __ldg(w.scale + tbase + static_cast<long long>(s) * nw + c);
    }
  };
  static_assert(R::kStages == 4, "the scale ring below is unrolled for 4 stages");
  unsigned sc0[4], sc1[4], sc2[4], sc3[4];
  load_sc(0, sc0);
  load_sc(1, sc1);
  load_sc(2, sc2);
  load_sc(3, sc3);
  // Stage s (slot s % kStages, whose scales are in `sc`); then `sc` takes stage s + kStages's.
  auto stage = [&](int s, unsigned (&sc)[4]) {
    const int slot = s % R::kStages, cnt = count(s);
    const unsigned full = bar_s + 8u * slot, empty = bar_s + 8u * (R::kStages + slot);
    const long long kb = static_cast<long long>(s) * nw;  // first K-tile of the stage
    if (s >= R::kStages) ws_mbar_wait(empty, static_cast<unsigned>((s / R::kStages - 1) & 1));
    if (lane == 0) ws_mbar_expect_tx(full, static_cast<unsigned>(present * cnt * 192));
    __syncwarp();
    const unsigned st = ring_s + static_cast<unsigned>(slot * stage_bytes);
    if (lane < 8 && sok)
      ws_bulk_g2s(st + static_cast<unsigned>(i * nw * 192), w.packed + (tbase + kb) * 192,
                  static_cast<unsigned>(cnt * 192), full);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c = (lane >> 3) + 4 * j;
      if (j < jn && c < cnt) {
        cp_async8_zfill(st + static_cast<unsigned>(cb_off + (c * 8 + i) * 8), w.codebook + (tbase + kb + c) * 8,
                        sok ? 8u : 0u);
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(st + static_cast<unsigned>(sc_off + (c * 8 + i) * 4)),
                     "f"(ue8m0_f(sc[j]))
                     : "memory");
      }
    }
    ws_cp_async_arrive(full);
    ws_mbar_arrive(full);
    load_sc(s + R::kStages, sc);
  };
  for (int s = 0; s < nst; s += R::kStages) {
    stage(s, sc0);
    if (s + 1 < nst) stage(s + 1, sc1);
    if (s + 2 < nst) stage(s + 2, sc2);
    if (s + 3 < nst) stage(s + 3, sc3);
  }
  cp_async_wait<0>();
}

/// Math warp `warp`'s K-tiles warp, warp + nw, ... (n of them: stages 0..n-1) for 8 strips and NB
/// token n-blocks, waiting on full[] and releasing empty[] for all nst stages. The per-K-tile
/// arithmetic is swap_warp_gemm's kDecCvt path instruction for instruction.
template <int NB, bool kOne>
__device__ __forceinline__ void ws_math(const void* const (&arow)[NB], const float* const (&srow)[NB][2],
                                        int nblocks, int warp, int nw, int n, int nst, const unsigned char* ring,
                                        unsigned bar_s, float (&acc)[4][NB][4]) {
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
    abase[nb] = static_cast<const unsigned char*>(arow[nb]) + (static_cast<long long>(warp) * 64 + 8 * t) * 2;
#pragma unroll
    for (int u = 0; u < 2; ++u) sbase[nb][u] = reinterpret_cast<const float2*>(srow[nb][u] + 2 * warp);
  }
  const long long astep = static_cast<long long>(nw) * 128;  // bytes of activations per stage
  auto load_x = [&](int s, XTile& x) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      if (nb > 0 && nb >= nblocks) continue;
#pragma unroll
      for (int blk = 0; blk < 2; ++blk)
        x.v[nb][blk] = __ldg(reinterpret_cast<const uint4*>(abase[nb] + s * astep + 64 * blk));
#pragma unroll
      for (int u = 0; u < (kOne ? 1 : 2); ++u) {
        const float2 sc = __ldg(sbase[nb][u] + static_cast<long long>(s) * nw);
        x.sx[nb][0][u] = sc.x;
        x.sx[nb][1][u] = sc.y;
      }
    }
  };
  const int stage_bytes = nw * R::kSub, istride = nw * 192;
  const unsigned char* idx0 = ring + warp * 192;                      // strip i at + i * istride
  const unsigned char* cb0 = ring + ws_cb_off(nw) + warp * 64;        // [8][8]
  const unsigned char* sc0 = ring + ws_sc_off(nw) + warp * 32;        // [8] FP32
  PdlWaitAndTrigger{}();
  XTile cur;
  if (n > 0) load_x(0, cur);
  int slot = 0;
  unsigned parity = 0;
#pragma unroll 1
  for (int s = 0; s < n; ++s) {
    XTile nxt;
    const int sn = s + 1 < n ? s + 1 : s;
    load_x(sn, nxt);
    ws_mbar_wait(bar_s + 8u * slot, parity);
    const int so = slot * stage_bytes;
    const float4 fw0 = *reinterpret_cast<const float4*>(sc0 + so);
    const float4 fw1 = *reinterpret_cast<const float4*>(sc0 + so + 16);
    const float fw[8] = {fw0.x, fw0.y, fw0.z, fw0.w, fw1.x, fw1.y, fw1.z, fw1.w};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const uint4 cb = *reinterpret_cast<const uint4*>(cb0 + so + 16 * m);
      unsigned sel[2][4];
#pragma unroll
      for (int ab = 0; ab < 2; ++ab) {
        const unsigned char* st = idx0 + so + (2 * m + ab) * istride;
        const unsigned x = *reinterpret_cast<const unsigned*>(st + 4 * lane);
        const unsigned y = *reinterpret_cast<const unsigned short*>(st + 128 + 2 * lane);
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
  // Stages past this warp's K-tiles (only the last can be): keep the phases in step.
  for (int s = n; s < nst; ++s) {
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

/// Registers per thread (__maxnreg__): the knob that sets the warps per SM. One token block: 72
/// with the K-loop not unrolled (~28 warps per SM; ptxas keeps one or two spill loads per K-tile,
/// L1 hits); two token blocks (9-warp CTAs at most): 128. Measured on the H200 (device run
/// dec14-run2): 88 registers with the loop unrolled twice (~23 warps per SM, fewer spills) was
/// 3-14 % slower than 72 on 15 of 16 points, and a 17-warp CTA cannot use more than 96 registers
/// (5 of its warps share one of the SM's four 16384-register quarters: a 120-register build failed
/// to launch, "too many resources requested", dec14-run1).
constexpr int ws_regs(int nb) { return nb == 1 ? 72 : 128; }

/// Body shared by both GEMMs: blockDim.x = 32 * (nw + 1), warp nw the producer.
template <int NB, bool kGemm1>
__device__ __forceinline__ void ws_gemm(const LutbW& w, const void* xa, const float* xsf, long long a_cols,
                                        const Routing& r, long long I, long long Ip, void* hq, float* hsf, float* y,
                                        long long H, bool one_token_loop) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  int e;
  SwapTokens<NB> tk;
  if (!swap_tile<NB>(r, blockIdx.y, e, tk)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x >> 5) - 1;
  const int nst = static_cast<int>((w.tiles_k + nw - 1) / nw);  // stages (K-tiles of warp 0)
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
    ws_producer(w, e, strip, ok, nw, nst, ring_s, bar_s);
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
  // Math warp `warp` takes K-tiles warp, warp + nw, ... (n of them).
  const int n = static_cast<int>((w.tiles_k - warp + nw - 1) / nw);
  float acc[4][NB][4];
  if (NB == 1 && one_token_loop && tk.count == 1)
    ws_math<NB, NB == 1>(arow, srow, nblocks, warp, nw, n, nst, ws_smem, bar_s, acc);
  else
    ws_math<NB, false>(arow, srow, nblocks, warp, nw, n, nst, ws_smem, bar_s, acc);
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
template <int NB>
__global__ void __launch_bounds__(32 * (ws_max_warps(NB) + 1)) __maxnreg__(ws_regs(NB))
    sm90_lutb_mxfp8_moe_gemm1_swapab_ws(LutbW w, const void* __restrict__ xa, const float* __restrict__ xsf,
                                        long long a_cols, Routing r, long long I, long long Ip, void* __restrict__ hq,
                                        float* __restrict__ hsf, bool one_token_loop) {
  ws_gemm<NB, true>(w, xa, xsf, a_cols, r, I, Ip, hq, hsf, nullptr, 0, one_token_loop);
}

/// GEMM2: y[p, n] = h[p] . w2[e, n]^T (FP32). Grid (ceil(tiles_n/8) strip groups, slots).
template <int NB>
__global__ void __launch_bounds__(32 * (ws_max_warps(NB) + 1)) __maxnreg__(ws_regs(NB))
    sm90_lutb_mxfp8_moe_gemm2_swapab_ws(LutbW w, const void* __restrict__ ha, const float* __restrict__ hsf,
                                        long long Ip, Routing r, long long H, float* __restrict__ y,
                                        bool one_token_loop) {
  ws_gemm<NB, false>(w, ha, hsf, Ip, r, 0, Ip, nullptr, nullptr, y, H, one_token_loop);
}

}  // namespace lutb::cuda::kern
