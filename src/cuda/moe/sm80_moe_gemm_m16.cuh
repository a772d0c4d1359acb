// src/cuda/moe/sm80_moe_gemm_m16.cuh: grouped expert GEMM kernels with tokens as the M operand in m16 tiles
// (sm80_moe_gemm_m16_gemm1 with fused SiLU*up and MXFP8 of h, sm80_moe_gemm_m16_gemm2), templated on the weight format (LUT-B packed or BF16) and the token tile (16*MT).
// Instantiated in lutb_moe_forward.cu (expert stacks beyond the swap-AB offsets) and bf16_moe_forward.cu.
#pragma once

#include "cuda/e4m3_encode.cuh"
#include "cuda/moe/lutb_moe_device.cuh"

namespace lutb::cuda::kern {

// ---------------------------------------------------------------------------
// Per-warp cp.async ring of weight K-tiles (kStages deep), so that several K-tiles of every warp
// are in flight while it computes: decode is a stream of weight bytes and lives on bytes in flight.
// ---------------------------------------------------------------------------
template <bool kLutb, int NT>
struct Ring {
  // LUT-B stage: NT strips x 192 packed bytes | NT x 8 codebook bytes | NT x 4-byte scale words.
  // BF16 stage: NT strips x 8 rows x 192 bytes (128 used; the padding spreads rows over the banks).
  static constexpr int kStages = kLutb ? 8 : (NT > 2 ? 2 : 4);
  static constexpr int kCb = NT * 192, kSc = NT * 200;
  static constexpr int kStageBytes = kLutb ? (NT * 204 + 15) / 16 * 16 : NT * 8 * 192;
  static constexpr int kWarpBytes = kStages * kStageBytes;
  // Copies per K-tile: LUT-B 12 x 16 B + 8 B + 4 B per strip; BF16 64 x 16 B per strip.
  static constexpr int kCopies = kLutb ? NT * 14 : NT * 64;
  static constexpr int kRounds = (kCopies + 31) / 32;
};

__device__ __forceinline__ void cp_async16(unsigned s, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async8(unsigned s, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(unsigned s, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }


/// This lane's copy descriptors of warp_gemm's ring (kt = 0), computed once: source, source step
/// per K-tile, smem offset inside a stage, kind (0 none, 1: 16 B, 2: 8 B, 3: scale word).
template <bool kLutb, int NT>
struct RingCopies {
  using R = Ring<kLutb, NT>;
  const unsigned char* src[R::kRounds];
  long long step[R::kRounds];
  int dst[R::kRounds], kind[R::kRounds];
};

/// The copy descriptors of this lane for strips strip[] of expert e (K = 64 * tiles_k columns).
template <bool kLutb, int NT>
__device__ __forceinline__ void m16_copy_plan(const LutbW& w, const uint16_t* __restrict__ wbf16, long long e,
                                              const long long (&strip)[NT], const bool (&strip_ok)[NT], int lane,
                                              long long tiles_k, long long K, RingCopies<kLutb, NT>& c) {
  using R = Ring<kLutb, NT>;
#pragma unroll
  for (int j = 0; j < R::kRounds; ++j) {
    const int q = lane + 32 * j;
    c.kind[j] = 0;
    c.src[j] = nullptr;
    c.step[j] = 0;
    c.dst[j] = 0;
    if (q >= R::kCopies) continue;
    if constexpr (kLutb) {
      int i, k2;
      if (q < 12 * NT) { i = q / 12; k2 = 1; }
      else if (q < 13 * NT) { i = q - 12 * NT; k2 = 2; }
      else { i = q - 13 * NT; k2 = 3; }
      long long tb = 0;
      bool ok = false;
#pragma unroll
      for (int u = 0; u < NT; ++u)
        if (u == i) { tb = (e * w.tiles_n + strip[u]) * tiles_k; ok = strip_ok[u]; }
      if (!ok) continue;
      c.kind[j] = k2;
      if (k2 == 1) { c.src[j] = w.packed + tb * 192 + (q % 12) * 16; c.step[j] = 192; c.dst[j] = i * 192 + (q % 12) * 16; }
      else if (k2 == 2) { c.src[j] = w.codebook + tb * 8; c.step[j] = 8; c.dst[j] = R::kCb + i * 8; }
      else { c.src[j] = w.scale + tb; c.step[j] = 1; c.dst[j] = R::kSc + i * 4; }
    } else {
      const int i = q >> 6, row = (q >> 3) & 7, cc = q & 7;
      long long sn = 0;
      bool ok = false;
#pragma unroll
      for (int u = 0; u < NT; ++u)
        if (u == i) { sn = strip[u]; ok = strip_ok[u]; }
      if (!ok) continue;
      c.kind[j] = 1;
      c.src[j] = reinterpret_cast<const unsigned char*>(wbf16 + ((e * w.tiles_n + sn) * 8 + row) * K + cc * 8);
      c.step[j] = 128;
      c.dst[j] = i * 1536 + row * 192 + cc * 16;
    }
  }
}

/// Issues this lane's copies of K-tile kt (kt < tiles_k) into ring stage kt % kStages and commits a
/// group (empty past the end).
template <bool kLutb, int NT>
__device__ __forceinline__ void m16_issue(const RingCopies<kLutb, NT>& c, long long kt, long long tiles_k,
                                          unsigned ring_s, unsigned long long scale_end) {
  using R = Ring<kLutb, NT>;
  if (kt < tiles_k) {
    const unsigned st = ring_s + static_cast<unsigned>(kt % R::kStages) * R::kStageBytes;
#pragma unroll
    for (int j = 0; j < R::kRounds; ++j) {
      const unsigned char* p = c.src[j] + kt * c.step[j];
      if (c.kind[j] == 1) cp_async16(st + c.dst[j], p);
      else if (c.kind[j] == 2) cp_async8(st + c.dst[j], p);
      else if (c.kind[j] == 3) {
        // The aligned word holding the scale byte (read directly at use when it would pass the end).
        const unsigned long long a = reinterpret_cast<unsigned long long>(p) & ~3ull;
        if (a + 4 <= scale_end) cp_async4(st + c.dst[j], reinterpret_cast<const void*>(a));
      }
    }
  }
  cp_async_commit();
}

/// Activation operand of one K-tile of warp_gemm (prefetched one K-tile ahead when MT <= 2).
template <int MT>
struct M16ATile {
  uint4 r[2][MT][2];
  float sx[2][MT][2];
};

/// Loads the activation operand of K-tile kt (this lane's 8 columns of rows g, g+8 per m16 tile;
/// LUT-B: and the block scales as FP32).
template <bool kLutb, int MT>
__device__ __forceinline__ void m16_load_a_tile(const uint16_t* const (&arow)[MT][2],
                                                const unsigned char* const (&srow)[MT][2], int t, long long kt,
                                                M16ATile<MT>& at) {
#pragma unroll
  for (int blk = 0; blk < 2; ++blk) {
    const long long col = kt * 64 + 32 * blk + 8 * t;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        at.r[blk][m][h] = arow[m][h] ? __ldg(reinterpret_cast<const uint4*>(arow[m][h] + col)) : make_uint4(0, 0, 0, 0);
        if constexpr (kLutb) at.sx[blk][m][h] = srow[m][h] ? ue8m0_f(__ldg(srow[m][h] + kt * 2 + blk)) : 0.0f;
      }
  }
}

/// One warp's share of a grouped GEMM: NT n8 weight strips (rows strip[i]*8..+7 of expert e) times
/// MT m16 token tiles, over K = 64 * tiles_k columns. acc[i][m][4] FP32.
/// LUT-B: A = FP16 E4M3 values + UE8M0 block scales; B decoded from the packed tiles.
/// BF16: A = BF16, B = BF16 rows of the weight matrix. `ring` is this warp's shared memory.
template <bool kLutb, bool kCvt, int NT, int MT>
__device__ __forceinline__ void warp_gemm(const LutbW& w, const uint16_t* __restrict__ wbf16, long long e,
                                          const long long (&strip)[NT], const bool (&strip_ok)[NT],
                                          const uint16_t* const (&arow)[MT][2],
                                          const unsigned char* const (&srow)[MT][2], unsigned char* ring,
                                          float (&acc)[NT][MT][4]) {
  using R = Ring<kLutb, NT>;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][m][r] = 0.0f;

  const long long tiles_k = w.tiles_k;
  const long long K = tiles_k * 64;
  const unsigned ring_s = static_cast<unsigned>(__cvta_generic_to_shared(ring));
  const unsigned long long scale_end = reinterpret_cast<unsigned long long>(w.scale + w.total_tiles);
  RingCopies<kLutb, NT> cp;
  m16_copy_plan<kLutb, NT>(w, wbf16, e, strip, strip_ok, lane, tiles_k, K, cp);

#pragma unroll
  for (int s = 0; s < R::kStages - 1; ++s) m16_issue(cp, s, tiles_k, ring_s, scale_end);
  M16ATile<MT> cur;
  if constexpr (MT <= 2) m16_load_a_tile<kLutb, MT>(arow, srow, t, 0, cur);

  for (long long kt = 0; kt < tiles_k; ++kt) {
    m16_issue(cp, kt + R::kStages - 1, tiles_k, ring_s, scale_end);
    M16ATile<MT> nxt;
    if constexpr (MT <= 2) {
      if (kt + 1 < tiles_k) m16_load_a_tile<kLutb, MT>(arow, srow, t, kt + 1, nxt);
    } else {
      m16_load_a_tile<kLutb, MT>(arow, srow, t, kt, cur);
    }
    cp_async_wait<R::kStages - 1>();
    __syncwarp();
    const unsigned char* st = ring + (kt % R::kStages) * R::kStageBytes;
    // The codebook, scale and fragment steps stay in this body: as separate steps they changed
    // ptxas's register allocation (ptxas -v: up to +4 registers).
    // ---- codebooks and scales of this K-tile
    unsigned cbl[NT], cbh[NT];
    float fw[NT];
    if constexpr (kLutb) {
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const uint2 cb = *reinterpret_cast<const uint2*>(st + R::kCb + i * 8);
        unsigned sw = 127u;
        if (strip_ok[i]) {  // strips past the matrix read nothing (their scale address is out of range)
          const unsigned char* sp = w.scale + (e * w.tiles_n + strip[i]) * tiles_k + kt;
          const unsigned long long a = reinterpret_cast<unsigned long long>(sp);
          if ((a & ~3ull) + 4 <= scale_end)
            sw = (*reinterpret_cast<const unsigned*>(st + R::kSc + i * 4) >> (8 * (a & 3ull))) & 0xffu;
          else
            sw = __ldg(sp);
        }
        cbl[i] = strip_ok[i] ? cb.x : 0u;
        cbh[i] = strip_ok[i] ? cb.y : 0u;
        // FP16 byte-decoded values are 2^-8 times the E4M3 value: fold 2^8 into the tile scale.
        fw[i] = strip_ok[i] ? ue8m0_f(sw) * (kCvt ? 1.0f : 256.0f) : 0.0f;
      }
    }
    // ---- two 32-column blocks
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      unsigned a0[MT][4], a1[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const uint4 r = cur.r[blk][m][0], q = cur.r[blk][m][1];
        // step 0: k-slots (2t,2t+1) <- register 0, (2t+8,2t+9) <- register 1; step 1: registers 2, 3.
        a0[m][0] = r.x; a0[m][1] = q.x; a0[m][2] = r.y; a0[m][3] = q.y;
        a1[m][0] = r.z; a1[m][1] = q.z; a1[m][2] = r.w; a1[m][3] = q.w;
      }
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        unsigned b[4];
        if constexpr (kLutb) {
          // This lane's 8 columns of block blk (row g, columns 32blk + 8t..+7), lane-major order.
          const unsigned x = *reinterpret_cast<const unsigned*>(st + i * 192 + 4 * lane);
          const unsigned y = *reinterpret_cast<const unsigned short*>(st + i * 192 + 128 + 2 * lane);
          unsigned sa, sb;
          if (blk == 0) {
            sa = x & 0x7777u;
            sb = (x >> 16) & 0x7777u;
          } else {
            sa = y & 0x7777u;
            sb = ((x >> 3) & 0x1111u) | ((x >> 18) & 0x2222u) | ((y >> 1) & 0x4444u);
          }
          decode_group<kCvt>(sa, sb, cbl[i], cbh[i], b);
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma16816<false>(c, a0[m], b[0], b[1]);
            mma16816<false>(c, a1[m], b[2], b[3]);
            const float f0 = fw[i] * cur.sx[blk][m][0], f1 = fw[i] * cur.sx[blk][m][1];
            acc[i][m][0] = fmaf(c[0], f0, acc[i][m][0]);
            acc[i][m][1] = fmaf(c[1], f0, acc[i][m][1]);
            acc[i][m][2] = fmaf(c[2], f1, acc[i][m][2]);
            acc[i][m][3] = fmaf(c[3], f1, acc[i][m][3]);
          }
        } else {
          uint4 v = make_uint4(0, 0, 0, 0);
          if (strip_ok[i]) v = *reinterpret_cast<const uint4*>(st + i * 1536 + g * 192 + blk * 64 + t * 16);
          b[0] = v.x; b[1] = v.y; b[2] = v.z; b[3] = v.w;
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma16816<true>(acc[i][m], a0[m], b[0], b[1]);
            mma16816<true>(acc[i][m], a1[m], b[2], b[3]);
          }
        }
      }
    }
    __syncwarp();
    if constexpr (MT <= 2) cur = nxt;
  }
  cp_async_wait<0>();
}

/// Resolves the rows of this CTA's token tile: pair indices (or -1) of rows g, g+8 of each m16.
template <int MT>
__device__ __forceinline__ bool tile_rows(const Routing& r, int slot, int& expert, int (&pair)[MT][2]) {
  if (slot >= *r.num_tiles) return false;
  expert = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    pair[m][0] = (16 * m + g < count) ? r.sorted[start + 16 * m + g] : -1;
    pair[m][1] = (16 * m + g + 8 < count) ? r.sorted[start + 16 * m + g + 8] : -1;
  }
  return true;
}

/// I-columns covered by one CTA of GEMM1: kWarps warps x NT/2 gate strips x 8.
template <int NT>
constexpr int gemm1_cols() { return kWarps * 4 * NT; }

/// GEMM1 + SiLU*up (+ MXFP8 of h along I for LUT-B). CTA: 4 warps; warp w owns the NT/2 gate strips
/// and the NT/2 matching up strips of I-columns [cols*bx + 4*NT*w, +4*NT). The 32-column MXFP8 blocks
/// of h are shared by 8/NT warps (amax through shared memory). Token tile blockIdx.y.
/// LUT-B output: hq [P, Ip] FP16 E4M3 values in the decoder's column order, hs [P, Ip/32] UE8M0.
/// BF16 output: hq [P, Ip] BF16 bits of bf16(silu(g)*u), natural order.
template <bool kLutb, bool kCvt, int NT, int MT>
__global__ void __launch_bounds__(kWarps * 32)
    sm80_moe_gemm_m16_gemm1(LutbW w, const uint16_t* __restrict__ wbf16, const uint16_t* __restrict__ xa,
                     const unsigned char* __restrict__ xs, long long a_cols, Routing r, long long I, long long Ip,
                     uint16_t* __restrict__ hq, unsigned char* __restrict__ hs) {
  constexpr int G = NT / 2;                 // gate strips per warp
  constexpr int kWarpsPerBlock = 8 / NT;    // warps sharing one 32-column MXFP8 block
  pdl_wait();  // the routing and x come from the kernels before
  pdl_trigger();
  int e, pair[MT][2];
  if (!tile_rows<MT>(r, blockIdx.y, e, pair)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long col0 = static_cast<long long>(gemm1_cols<NT>()) * blockIdx.x + 4 * NT * warp;  // first I-column
  long long strip[NT];
  bool strip_ok[NT];
#pragma unroll
  for (int s = 0; s < G; ++s) {
    strip[s] = col0 / 8 + s;
    strip[G + s] = I / 8 + col0 / 8 + s;
    strip_ok[s] = strip_ok[G + s] = col0 + 8 * s < I;
  }
  const uint16_t* arow[MT][2];
  const unsigned char* srow[MT][2];
  const long long sblocks = a_cols / 32;
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int p = pair[m][h];
      const long long tok = p >= 0 ? p / r.top_k : 0;
      arow[m][h] = p >= 0 ? xa + tok * a_cols : nullptr;
      srow[m][h] = (kLutb && p >= 0) ? xs + tok * sblocks : nullptr;
    }
  extern __shared__ __align__(16) unsigned char ring_smem[];
  float acc[NT][MT][4];
  warp_gemm<kLutb, kCvt, NT, MT>(w, wbf16, e, strip, strip_ok, arow, srow,
                                 ring_smem + warp * Ring<kLutb, NT>::kWarpBytes, acc);

  // h = bf16(silu(g) * u): accumulator (s, m, half h, c) is token row 16m+8h+g, I-column col0+8s+2t+c.
  float hv[G][MT][2][2];
#pragma unroll
  for (int s = 0; s < G; ++s)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float gg = acc[s][m][2 * h + c], uu = acc[G + s][m][2 * h + c];
          const float v = strip_ok[s] ? (gg / (1.0f + expf(-gg))) * uu : 0.0f;
          hv[s][m][h][c] = bf16_round(v);
        }
  if constexpr (!kLutb) {
#pragma unroll
    for (int s = 0; s < G; ++s)
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int p = pair[m][h];
          if (p < 0) continue;
          const unsigned v = static_cast<unsigned>(bf16_from_float(hv[s][m][h][0])) |
                             (static_cast<unsigned>(bf16_from_float(hv[s][m][h][1])) << 16);
          *reinterpret_cast<unsigned*>(hq + static_cast<long long>(p) * Ip + col0 + 8 * s + 2 * t) = v;
        }
  } else {
    // MXFP8 along I: a 32-column block is kWarpsPerBlock warps x 4*NT columns.
    __shared__ float amax_s[kWarps][16 * MT];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float a = 0.0f;
#pragma unroll
        for (int s = 0; s < G; ++s) {
          a = fmaxf(a, fmaxf(fabsf(hv[s][m][h][0]), fabsf(hv[s][m][h][1])));
          if (!isfinite(hv[s][m][h][0]) || !isfinite(hv[s][m][h][1])) a = INFINITY;
        }
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
        if (t == 0) amax_s[warp][16 * m + 8 * h + g] = a;
      }
    __syncthreads();
    const int w0 = warp / kWarpsPerBlock * kWarpsPerBlock;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = pair[m][h];
        const int row = 16 * m + 8 * h + g;
        float a = 0.0f;
#pragma unroll
        for (int u = 0; u < kWarpsPerBlock; ++u) a = fmaxf(a, amax_s[w0 + u][row]);
        const unsigned char b = mx_block_scale(a, MxScaleRule::Rceil);
        if (p < 0) continue;
#pragma unroll
        for (int s = 0; s < G; ++s) {
          uint16_t* dst = hq + static_cast<long long>(p) * Ip + col0 + 8 * s;
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const float q = (b == 255) ? 0.0f : e4m3_to_float(mx_encode_dev(hv[s][m][h][c], b));
            dst[perm8(2 * t + c, !kCvt)] = __half_as_ushort(__float2half_rn(q));
          }
        }
        if (warp == w0 && t == 0) hs[static_cast<long long>(p) * (Ip / 32) + col0 / 32] = b;
      }
  }
}

/// GEMM2: y[p, n] = h[p] . w2[e, n]^T in FP32 for n < H. CTA: 4 warps x NT strips = 32*NT output
/// rows (blockIdx.x), token tile blockIdx.y.
template <bool kLutb, bool kCvt, int NT, int MT>
__global__ void __launch_bounds__(kWarps * 32)
    sm80_moe_gemm_m16_gemm2(LutbW w, const uint16_t* __restrict__ wbf16, const uint16_t* __restrict__ ha,
                     const unsigned char* __restrict__ hs, long long Ip, Routing r, long long H,
                     float* __restrict__ y) {
  pdl_wait();  // h comes from GEMM1
  pdl_trigger();
  int e, pair[MT][2];
  if (!tile_rows<MT>(r, blockIdx.y, e, pair)) return;
  const int warp = threadIdx.x >> 5, t = threadIdx.x & 3;
  long long strip[NT];
  bool strip_ok[NT];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    strip[i] = static_cast<long long>(kWarps * NT) * blockIdx.x + NT * warp + i;
    strip_ok[i] = strip[i] < w.tiles_n;
  }
  const uint16_t* arow[MT][2];
  const unsigned char* srow[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int p = pair[m][h];
      arow[m][h] = p >= 0 ? ha + static_cast<long long>(p) * Ip : nullptr;
      srow[m][h] = (kLutb && p >= 0) ? hs + static_cast<long long>(p) * (Ip / 32) : nullptr;
    }
  extern __shared__ __align__(16) unsigned char ring_smem[];
  float acc[NT][MT][4];
  warp_gemm<kLutb, kCvt, NT, MT>(w, wbf16, e, strip, strip_ok, arow, srow,
                                 ring_smem + warp * Ring<kLutb, NT>::kWarpBytes, acc);
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const long long n = strip[i] * 8 + 2 * t;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = pair[m][h];
        if (p < 0 || !strip_ok[i]) continue;
        float* dst = y + static_cast<long long>(p) * H + n;
        if (n + 1 < H) {
          dst[0] = acc[i][m][2 * h];
          dst[1] = acc[i][m][2 * h + 1];
        } else if (n < H) {
          dst[0] = acc[i][m][2 * h];
        }
      }
  }
}

}  // namespace lutb::cuda::kern
