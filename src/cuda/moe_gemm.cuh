// src/cuda/moe_gemm.cuh: grouped expert GEMM kernels (GEMM1 with fused SiLU*up and MXFP8 of h,
// GEMM2), templated on the weight format (LUT-B packed or BF16) and the token tile (16*MT).
// Instantiated in moe_lutb.cu and moe_bf16.cu.
#pragma once

#include "moe_kernels.cuh"

namespace lutb::cuda::kern {

// ---------------------------------------------------------------------------
// Per-warp cp.async ring of weight K-tiles (stages of kStages), so that several K-tiles of every warp
// are in flight while it computes: decode is a stream of weight bytes and lives on bytes in flight.
// ---------------------------------------------------------------------------
template <bool kLutb>
struct Ring {
  // LUT-B stage: 2 strips x 192 packed bytes | 2 x 8 codebook bytes | 2 x 4-byte scale words.
  // BF16 stage: 2 strips x 8 rows x 192 bytes (128 used; the padding spreads rows over the banks).
  static constexpr int kStages = kLutb ? 8 : 4;
  static constexpr int kStageBytes = kLutb ? 416 : 2 * 8 * 192;
  static constexpr int kWarpBytes = kStages * kStageBytes;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/// One warp's share of a grouped GEMM: 2 n8 weight strips (rows strip[i]*8..+7 of expert e) times
/// MT m16 token tiles, over K = 64 * tiles_k columns. acc[i][m][4] FP32.
/// LUT-B: A = FP16 E4M3 values + UE8M0 block scales; B decoded from the packed tiles.
/// BF16: A = BF16, B = BF16 rows of the weight matrix. `ring` is this warp's shared memory.
template <bool kLutb, bool kCvt, int MT>
__device__ __forceinline__ void warp_gemm(const LutbW& w, const uint16_t* __restrict__ wbf16, long long e,
                                          const long long (&strip)[2], const bool (&strip_ok)[2],
                                          const uint16_t* const (&arow)[MT][2],
                                          const unsigned char* const (&srow)[MT][2], unsigned char* ring,
                                          float (&acc)[2][MT][4]) {
  using R = Ring<kLutb>;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i][m][r] = 0.0f;

  const long long tiles_k = w.tiles_k;
  const long long K = tiles_k * 64;
  // Tile-row bases (64-bit: an expert stack can pass 2^31 bytes).
  const long long tile0[2] = {(e * w.tiles_n + strip[0]) * tiles_k, (e * w.tiles_n + strip[1]) * tiles_k};
  const unsigned long long scale_end = reinterpret_cast<unsigned long long>(w.scale + w.total_tiles);

  auto issue = [&](long long kt) {
    if (kt < tiles_k) {
      unsigned char* st = ring + (kt % R::kStages) * R::kStageBytes;
      if constexpr (kLutb) {
        // Lanes 0..23: packed 16-byte chunks; 24, 25: codebooks; 26, 27: scale words (strip = bit).
        const int i = lane < 24 ? lane / 12 : (lane - 24) & 1;
        const long long tb = (i ? tile0[1] : tile0[0]) + kt;
        const bool ok = i ? strip_ok[1] : strip_ok[0];
        if (ok) {
          if (lane < 24) {
            const int c = lane % 12;
            cp_async16(st + i * 192 + c * 16, w.packed + tb * 192 + c * 16);
          } else if (lane < 26) {
            cp_async8(st + 384 + i * 8, w.codebook + tb * 8);
          } else if (lane < 28) {
            // The aligned word holding the scale byte (read directly at use when it would pass the end).
            const unsigned long long a = reinterpret_cast<unsigned long long>(w.scale + tb) & ~3ull;
            if (a + 4 <= scale_end) cp_async4(st + 400 + i * 4, reinterpret_cast<const void*>(a));
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int q = lane + 32 * j, i = q >> 6, row = (q >> 3) & 7, c = q & 7;
          if (strip_ok[i])
            cp_async16(st + i * 1536 + row * 192 + c * 16,
                       wbf16 + ((e * w.tiles_n + strip[i]) * 8 + row) * K + kt * 64 + c * 8);
        }
      }
    }
    cp_async_commit();
  };

  // Activation operand of one K-tile (prefetched one K-tile ahead when MT == 1).
  struct ATile {
    uint4 r[2][MT][2];
    unsigned char sb[2][MT][2];
  };
  auto load_a_tile = [&](long long kt, ATile& at) {
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      const long long col = kt * 64 + 32 * blk + 8 * t;
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          at.r[blk][m][h] = arow[m][h] ? __ldg(reinterpret_cast<const uint4*>(arow[m][h] + col)) : make_uint4(0, 0, 0, 0);
          if constexpr (kLutb) at.sb[blk][m][h] = srow[m][h] ? __ldg(srow[m][h] + kt * 2 + blk) : 127;
        }
    }
  };

#pragma unroll
  for (int s = 0; s < R::kStages - 1; ++s) issue(s);
  ATile cur;
  if constexpr (MT == 1) load_a_tile(0, cur);

  for (long long kt = 0; kt < tiles_k; ++kt) {
    issue(kt + R::kStages - 1);
    ATile nxt;
    if constexpr (MT == 1) {
      if (kt + 1 < tiles_k) load_a_tile(kt + 1, nxt);
    } else {
      load_a_tile(kt, cur);
    }
    cp_async_wait<R::kStages - 1>();
    __syncwarp();
    const unsigned char* st = ring + (kt % R::kStages) * R::kStageBytes;
    // ---- weights of this K-tile from the ring
    unsigned cbl[2], cbh[2], sw[2];
    if constexpr (kLutb) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (strip_ok[i]) {
          const uint2 cb = *reinterpret_cast<const uint2*>(st + 384 + i * 8);
          cbl[i] = cb.x;
          cbh[i] = cb.y;
          const unsigned char* sp = w.scale + tile0[i] + kt;
          const unsigned long long a = reinterpret_cast<unsigned long long>(sp);
          if ((a & ~3ull) + 4 <= scale_end) {
            const unsigned word = *reinterpret_cast<const unsigned*>(st + 400 + i * 4);
            sw[i] = (word >> (8 * (a & 3ull))) & 0xffu;
          } else {
            sw[i] = __ldg(sp);
          }
        } else {
          cbl[i] = cbh[i] = 0u;
          sw[i] = 127u;
        }
      }
    }
    // ---- two 32-column blocks
#pragma unroll
    for (int blk = 0; blk < 2; ++blk) {
      unsigned a0[MT][4], a1[MT][4];
      float sx[MT][2];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const uint4 r = cur.r[blk][m][0], q = cur.r[blk][m][1];
        // step 0: k-slots (2t,2t+1) <- register 0, (2t+8,2t+9) <- register 1; step 1: registers 2, 3.
        a0[m][0] = r.x; a0[m][1] = q.x; a0[m][2] = r.y; a0[m][3] = q.y;
        a1[m][0] = r.z; a1[m][1] = q.z; a1[m][2] = r.w; a1[m][3] = q.w;
        if constexpr (kLutb) {
          sx[m][0] = ue8m0_scale(cur.sb[blk][m][0], 0);
          sx[m][1] = ue8m0_scale(cur.sb[blk][m][1], 0);
        }
      }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        unsigned b[4];
        if constexpr (kLutb) {
          // This thread's group: row g, group t of block blk = bytes 24g + 12blk + 3t .. +2.
          const unsigned char* rowp = st + i * 192 + 24 * g + 12 * blk;
          const int lo = (3 * t) >> 2;
          const unsigned wl = *reinterpret_cast<const unsigned*>(rowp + 4 * lo);
          const unsigned wh = *reinterpret_cast<const unsigned*>(rowp + 4 * (t == 3 ? lo : lo + 1));
          const unsigned g24 = __funnelshift_r(wl, wh, (3 * t & 3) * 8);
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
    if constexpr (MT == 1) cur = nxt;
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
  extern __shared__ __align__(16) unsigned char ring_smem[];
  float acc[2][MT][4];
  warp_gemm<kLutb, kCvt, MT>(w, wbf16, e, strip, strip_ok, arow, srow, ring_smem + warp * Ring<kLutb>::kWarpBytes, acc);

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
  const int warp = threadIdx.x >> 5, t = threadIdx.x & 3;
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
  extern __shared__ __align__(16) unsigned char ring_smem[];
  float acc[2][MT][4];
  warp_gemm<kLutb, kCvt, MT>(w, wbf16, e, strip, strip_ok, arow, srow, ring_smem + warp * Ring<kLutb>::kWarpBytes, acc);
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
