// src/cuda/moe_gemm.cuh: grouped expert GEMM kernels (GEMM1 with fused SiLU*up and MXFP8 of h,
// GEMM2), templated on the weight format (LUT-B packed or BF16) and the token tile (16*MT).
// Instantiated in moe_lutb.cu and moe_bf16.cu.
#pragma once

#include "moe_kernels.cuh"

namespace lutb::cuda::kern {

/// Activation operand of one m16 token tile for one 32-column block: 2 k16 steps x 4 registers.
/// rowg / rowg8: element pointers (FP16 or BF16) of tokens g and g+8 at the block's start + 8t, or
/// null for rows past the tile's count (zeros).
__device__ __forceinline__ void load_a(const uint16_t* rowg, const uint16_t* rowg8, unsigned (&a0)[4],
                                       unsigned (&a1)[4]) {
  uint4 r = make_uint4(0, 0, 0, 0), s = make_uint4(0, 0, 0, 0);
  if (rowg) r = __ldg(reinterpret_cast<const uint4*>(rowg));
  if (rowg8) s = __ldg(reinterpret_cast<const uint4*>(rowg8));
  // step 0: k-slots (2t,2t+1) <- register 0, (2t+8,2t+9) <- register 1; step 1: registers 2, 3.
  a0[0] = r.x; a0[1] = s.x; a0[2] = r.y; a0[3] = s.y;
  a1[0] = r.z; a1[1] = s.z; a1[2] = r.w; a1[3] = s.w;
}

/// One warp's share of a grouped GEMM: NT n8 weight strips (rows strip[i]*8..+7 of expert e) times
/// MT m16 token tiles, over K = 64 * tiles_k columns. acc[i][m][4] FP32.
/// LUT-B: A = FP16 E4M3 values + UE8M0 block scales; B decoded from the packed tiles.
/// BF16: A = BF16, B = BF16 rows of the weight matrix.
template <bool kLutb, bool kCvt, int NT, int MT>
__device__ __forceinline__ void warp_gemm(const LutbW& w, const uint16_t* __restrict__ wbf16, long long e,
                                          const long long (&strip)[NT], const bool (&strip_ok)[NT],
                                          const uint16_t* const (&arow)[MT][2],
                                          const unsigned char* const (&srow)[MT][2], long long a_cols,
                                          float (&acc)[NT][MT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][m][r] = 0.0f;

  const long long tiles_k = w.tiles_k;
  // Byte offset inside a tile of this thread's group in block 0: row g (24 bytes), group t (3 bytes).
  const int grp_off = 24 * g + 3 * t;
  const int lo_off = grp_off & ~3, hi_off = (t == 1 || t == 2) ? lo_off + 4 : lo_off;
  const int shift = (3 * t & 3) * 8;

  for (long long kt = 0; kt < tiles_k; ++kt) {
    // ---- load weights of the NT strips for this 64-column tile (both 32-blocks)
    unsigned wl[NT][2], wh[NT][2], cbl[NT], cbh[NT], sw[NT];
    uint4 wb[NT][2];
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      if constexpr (kLutb) {
        if (strip_ok[i]) {
          const long long tile = (e * w.tiles_n + strip[i]) * tiles_k + kt;  // 64-bit: can pass 2^31
          const unsigned char* p = w.packed + tile * 192;
#pragma unroll
          for (int blk = 0; blk < 2; ++blk) {
            wl[i][blk] = __ldg(reinterpret_cast<const unsigned*>(p + lo_off + 12 * blk));
            wh[i][blk] = __ldg(reinterpret_cast<const unsigned*>(p + hi_off + 12 * blk));
          }
          const uint2 cb = __ldg(reinterpret_cast<const uint2*>(w.codebook + tile * 8));
          cbl[i] = cb.x;
          cbh[i] = cb.y;
          sw[i] = __ldg(w.scale + tile);
        } else {
          wl[i][0] = wl[i][1] = wh[i][0] = wh[i][1] = 0u;
          cbl[i] = cbh[i] = 0u;  // E4M3 +0
          sw[i] = 127u;
        }
      } else {
        if (strip_ok[i]) {
          const long long K = tiles_k * 64;
          const uint16_t* p = wbf16 + ((e * w.tiles_n + strip[i]) * 8 + g) * K + kt * 64 + 8 * t;
          wb[i][0] = __ldg(reinterpret_cast<const uint4*>(p));
          wb[i][1] = __ldg(reinterpret_cast<const uint4*>(p + 32));
        } else {
          wb[i][0] = wb[i][1] = make_uint4(0, 0, 0, 0);
        }
      }
    }
    // ---- two 32-column blocks
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      unsigned a0[MT][4], a1[MT][4];
      float sx[MT][2];
      const long long col = kt * 64 + 32 * blk + 8 * t;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        load_a(arow[m][0] ? arow[m][0] + col : nullptr, arow[m][1] ? arow[m][1] + col : nullptr, a0[m], a1[m]);
        if constexpr (kLutb) {
          const long long sb = kt * 2 + blk;
          sx[m][0] = srow[m][0] ? ue8m0_scale(__ldg(srow[m][0] + sb), 0) : 0.0f;
          sx[m][1] = srow[m][1] ? ue8m0_scale(__ldg(srow[m][1] + sb), 0) : 0.0f;
        }
      }
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        unsigned b[4];
        if constexpr (kLutb) {
          const unsigned g24 = __funnelshift_r(wl[i][blk], wh[i][blk], shift);
          decode_group<kCvt>(g24, cbl[i], cbh[i], b);
          const float fw = ue8m0_scale(sw[i], kCvt ? 0 : 8);
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma16816<false>(c, a0[m], b[0], b[1]);
            mma16816<false>(c, a1[m], b[2], b[3]);
            const float f0 = fw * sx[m][0], f1 = fw * sx[m][1];
            acc[i][m][0] = fmaf(c[0], f0, acc[i][m][0]);
            acc[i][m][1] = fmaf(c[1], f0, acc[i][m][1]);
            acc[i][m][2] = fmaf(c[2], f1, acc[i][m][2]);
            acc[i][m][3] = fmaf(c[3], f1, acc[i][m][3]);
          }
        } else {
          b[0] = wb[i][blk].x; b[1] = wb[i][blk].y; b[2] = wb[i][blk].z; b[3] = wb[i][blk].w;
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma16816<true>(acc[i][m], a0[m], b[0], b[1]);
            mma16816<true>(acc[i][m], a1[m], b[2], b[3]);
          }
        }
      }
    }
  }
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

/// GEMM1 + SiLU*up (+ MXFP8 of h along I for LUT-B). CTA: 4 warps x 8 I-columns = one 32-column
/// MXFP8 block of h (blockIdx.x), token tile blockIdx.y. Warp w: gate strip 4*bx+w, up strip I/8+4*bx+w.
/// LUT-B output: hq [P, Ip] FP16 E4M3 values in the decoder's column order, hs [P, Ip/32] UE8M0.
/// BF16 output: hq [P, Ip] BF16 bits of bf16(silu(g)*u), natural order.
template <bool kLutb, bool kCvt, int MT>
__global__ void __launch_bounds__(kWarps * 32)
    moe_gemm1_kernel(LutbW w, const uint16_t* __restrict__ wbf16, const uint16_t* __restrict__ xa,
                     const unsigned char* __restrict__ xs, long long a_cols, Routing r, long long I, long long Ip,
                     uint16_t* __restrict__ hq, unsigned char* __restrict__ hs) {
  int e, pair[MT][2];
  if (!tile_rows<MT>(r, blockIdx.y, e, pair)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long gate_strip = 4ll * blockIdx.x + warp;
  const bool ok = gate_strip * 8 < I;
  const long long strip[2] = {gate_strip, I / 8 + gate_strip};
  const bool strip_ok[2] = {ok, ok};
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
  float acc[2][MT][4];
  warp_gemm<kLutb, kCvt, 2, MT>(w, wbf16, e, strip, strip_ok, arow, srow, a_cols, acc);

  // h = bf16(silu(g) * u): accumulator (m, half h, c) is token row 16m+g+8h, I-column 8*strip+2t+c.
  float hv[MT][2][2];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float gg = acc[0][m][2 * h + c], uu = acc[1][m][2 * h + c];
        const float v = ok ? (gg / (1.0f + expf(-gg))) * uu : 0.0f;
        hv[m][h][c] = bf16_round(v);
      }
  const long long col0 = 8 * gate_strip;  // first I-column of this warp (multiple of 8)
  if constexpr (!kLutb) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = pair[m][h];
        if (p < 0) continue;
        const unsigned v = static_cast<unsigned>(bf16_from_float(hv[m][h][0])) |
                           (static_cast<unsigned>(bf16_from_float(hv[m][h][1])) << 16);
        *reinterpret_cast<unsigned*>(hq + static_cast<long long>(p) * Ip + col0 + 2 * t) = v;
      }
  } else {
    // MXFP8 along I: the 32-column block is this CTA's 4 warps x 8 columns.
    __shared__ float amax_s[kWarps][16 * MT];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float a = fmaxf(fabsf(hv[m][h][0]), fabsf(hv[m][h][1]));
        if (!isfinite(hv[m][h][0]) || !isfinite(hv[m][h][1])) a = INFINITY;
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
        if (t == 0) amax_s[warp][16 * m + 8 * h + g] = a;
      }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int p = pair[m][h];
        const int row = 16 * m + 8 * h + g;
        const float a = fmaxf(fmaxf(amax_s[0][row], amax_s[1][row]), fmaxf(amax_s[2][row], amax_s[3][row]));
        const unsigned char b = mx_block_scale(a, MxScaleRule::Rceil);
        if (p < 0) continue;
        uint16_t* dst = hq + static_cast<long long>(p) * Ip + col0;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float q = (b == 255) ? 0.0f : e4m3_to_float(mx_encode(hv[m][h][c], b));
          dst[perm8(2 * t + c, !kCvt)] = __half_as_ushort(__float2half_rn(q));
        }
        if (warp == 0 && t == 0) hs[static_cast<long long>(p) * (Ip / 32) + blockIdx.x] = b;
      }
  }
}

/// GEMM2: y[p, n] = h[p] . w2[e, n]^T in FP32 for n < H. CTA: 4 warps x 2 strips = 64 output rows
/// (blockIdx.x), token tile blockIdx.y.
template <bool kLutb, bool kCvt, int MT>
__global__ void __launch_bounds__(kWarps * 32)
    moe_gemm2_kernel(LutbW w, const uint16_t* __restrict__ wbf16, const uint16_t* __restrict__ ha,
                     const unsigned char* __restrict__ hs, long long Ip, Routing r, long long H,
                     float* __restrict__ y) {
  int e, pair[MT][2];
  if (!tile_rows<MT>(r, blockIdx.y, e, pair)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  long long strip[2];
  bool strip_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    strip[i] = 8ll * blockIdx.x + 2 * warp + i;
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
  float acc[2][MT][4];
  warp_gemm<kLutb, kCvt, 2, MT>(w, wbf16, e, strip, strip_ok, arow, srow, Ip, acc);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
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
