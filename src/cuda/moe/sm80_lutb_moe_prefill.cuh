// src/cuda/moe/sm80_lutb_moe_prefill.cuh: the large-batch (prefill) LUT-B GEMMs with mma.sync
// (sm80_lutb_moe_prefill_gemm1, sm80_lutb_moe_prefill_gemm2, and sm80_lutb_moe_prefill_xa_to_bf16),
// the prefill kernels of every device other than sm_90 (docs/design/cuda-moe.md; launched by
// lutb_moe_prefill.cu).
//
// CTA tile (Cfg below): 256 threads (8 warps, 2 along tokens x 4 along weight rows, warp tile
// 32 x 32), 64 token rows (one token tile of the grouping, one expert) x 128 weight rows (16 LUT-B
// row-strips) x K-tiles of 64 columns (one LUT-B tile column), 2 CTAs per SM.
//
// Per K-tile kt, in shared memory:
//   stage ring (kStages deep, cp.async): A tile [BM rows][64 BF16] (128-byte rows, 16-byte chunk c
//     of row r stored at chunk c ^ (r & 7)) + the 16 strips' raw tiles (192 lane-major index
//     bytes each) + their 16 codebooks (8 bytes each). Scale bytes go through registers.
//   B buffers (double): [128 rows][64 BF16], same swizzle, decoded from the raw tiles.
// Iteration kt: wait for stage kt+1, barrier, issue stage kt+3, decode stage kt+1 into
// B[(kt+1)&1] (each warp two strips: one lane-major tile = one 32-bit and one 16-bit load per lane,
// 4 PRMT selectors, 16 PRMT against the tile's scaled BF16 lo/hi byte tables), then 32 mma per
// warp on A[kt] x B[kt&1] from ldmatrix.x4. One __syncthreads per K-tile.
#pragma once

#include "lutb/cuda/lane_major.hpp"
#include "cuda/e4m3_encode.cuh"
#include "cuda/moe/lutb_moe_device.cuh"

namespace lutb::cuda::kern::prefill {

constexpr int kBN = 128;                // weight rows per CTA
constexpr int kStrips = kBN / 8;        // LUT-B row-strips per CTA
constexpr int kRawPacked = kStrips * 192;
constexpr int kRawBytes = kRawPacked + kStrips * 8;
constexpr int kBBytes = kBN * 128;      // one decoded B K-tile: 128 rows x 64 BF16
constexpr int kTabBytes = kStrips * 16; // per strip 8 lo + 8 hi bytes
// The tensor cores sum into their FP32 accumulator with truncation (products aligned to the largest
// exponent, shifted-out bits dropped), not FP32 round-to-nearest: over a whole K = 7168 that bias
// builds up (measured: rel. L2 2.2e-3 to the reference at the DeepSeek-V3 shape). So each warp
// sums kPromoteTiles K-tiles (128 columns, 8 mma steps) on the tensor cores, then adds that partial
// sum to FP32 registers with ordinary round-to-nearest adds (DeepGEMM's "promotion").
constexpr int kPromoteTiles = 2;

/// CTA tile configuration: BM token rows (= the grouping's tile rows) x 128 weight rows; WM warps
/// along the tokens x 4 along the weight rows (warp tile (BM/WM) x 32); S: cp.async ring depth in
/// K-tiles. Each K-tile's weights are decoded before its mma steps (decoding them between the mma
/// steps, and 128-token tiles, were slower: docs/design/cuda-moe.md "Tried and not kept").
template <int BM, int WM, int S>
struct Cfg {
  static constexpr int kStages = S;
  static constexpr int kBM = BM;
  static constexpr int kWM = WM;
  static constexpr int kWarps = 4 * WM;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kMI = BM / (16 * WM);       // m16 tiles per warp
  static constexpr int kWTM = 16 * kMI;            // warp tile rows
  static constexpr int kSPW = kStrips / kWarps;    // strips each warp decodes
  static constexpr int kAQ = BM * 8 / kThreads;    // A 16-byte chunks per thread per stage
  static constexpr int kABytes = BM * 128;         // one A K-tile: BM rows x 64 BF16
  static constexpr int kStageBytes = kABytes + kRawBytes;
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kBBytes + kTabBytes;
  static constexpr int kMinBlocks = (BM == 64) ? 2 : 1;
  static_assert(kStageBytes % 16 == 0 && kBBytes % 16 == 0, "16-byte aligned smem regions");
  static_assert(kStrips * 13 <= kThreads, "one copy round per stage for the raw tiles");
  static_assert(kAQ * kThreads == BM * 8 && kSPW * kWarps == kStrips && kMI * 16 * WM == BM, "tiling");
};
using Cfg64 = Cfg<64, 2, 4>;

__device__ __forceinline__ void cp16_zfill(unsigned s, const void* g, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp8(unsigned s, const void* g) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(g) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr)
               : "memory");
}

/// BF16 bits of e4m3(q) * 2^(b-127) (b == 255 -> NaN), as spec 3 / mx_decode, rounded to BF16
/// (exact for b >= 10, docs/design/cuda-moe.md "Prefill").
__device__ __forceinline__ unsigned short scaled_bf16(float e4m3_value, unsigned b) {
  return bf16_from_float(ldexp_ue8m0(e4m3_value, static_cast<std::uint8_t>(b)));
}

/// The weight strips of this CTA: slot sl (0..15) -> global row-strip and validity.
/// GEMM1 (w13 [2I, H]): warp column wn = sl/4 holds I-columns col0 + 16wn .. +15 as gate strips
///   (sl%4 = 0, 1) and the matching up strips (sl%4 = 2, 3), so gate and up of one I-column sit in
///   the same thread's accumulators.
/// GEMM2 (w2 [H, I]): 16 consecutive strips from 16*blockIdx.x.
template <bool kGemm1>
__device__ __forceinline__ void strip_of(int sl, long long tiles_n, long long I, long long& strip, bool& ok) {
  if constexpr (kGemm1) {
    const long long col = 64ll * blockIdx.x + 16 * (sl >> 2) + 8 * (sl & 1);
    ok = col < I;
    strip = ((sl & 2) ? I / 8 : 0) + col / 8;
  } else {
    strip = static_cast<long long>(kStrips) * blockIdx.x + sl;
    ok = strip < tiles_n;
  }
}

/// mma.sync m16n8k16 BF16 with a zero accumulator input (d = a . b).
__device__ __forceinline__ void mma_bf16_zero_c(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f), "f"(0.0f), "f"(0.0f), "f"(0.0f));
}

/// This thread's copy descriptors of cta_gemm's stages (kt = 0). raw: threads 0..191 one 16-byte
/// chunk of a strip's packed tile, 192..207 a strip's codebook (kind 0 none, 1 packed chunk, 2
/// codebook). A: chunk a_chunk = tid & 7 of rows tid/8 + q * kThreads/8, stored at a_dst[q].
template <class C>
struct StageCopies {
  const unsigned char* raw_src = nullptr;
  long long raw_step = 0;
  int raw_dst = 0, raw_kind = 0;
  int a_chunk;
  int a_dst[C::kAQ];
};

/// The copy descriptors of thread tid for the strips of this CTA (expert e).
template <class C, bool kGemm1>
__device__ __forceinline__ void stage_copy_plan(const LutbW& w, long long e, long long I, long long tiles_k, int tid,
                                                StageCopies<C>& c) {
  if (tid < kStrips * 13) {
    const int sl = tid < kStrips * 12 ? tid / 12 : tid - kStrips * 12;
    long long strip;
    bool ok;
    strip_of<kGemm1>(sl, w.tiles_n, I, strip, ok);
    if (ok) {
      const long long tile0 = (e * w.tiles_n + strip) * tiles_k;
      if (tid < kStrips * 12) {
        c.raw_kind = 1;
        c.raw_src = w.packed + tile0 * 192 + (tid % 12) * 16;
        c.raw_step = 192;
        c.raw_dst = C::kABytes + sl * 192 + (tid % 12) * 16;
      } else {
        c.raw_kind = 2;
        c.raw_src = w.codebook + tile0 * 8;
        c.raw_step = 8;
        c.raw_dst = C::kABytes + kRawPacked + sl * 8;
      }
    }
  }
  c.a_chunk = tid & 7;
#pragma unroll
  for (int q = 0; q < C::kAQ; ++q) {
    const int row = (tid >> 3) + (C::kThreads / 8) * q;
    c.a_dst[q] = row * 128 + ((c.a_chunk ^ (row & 7)) << 4);
  }
}

/// Issues this thread's copies of K-tile kt (kt < tiles_k) into stage kt % kStages and commits a
/// group (empty past the end). Rows without a pair (arow null) are zero-filled from a_base.
template <class C>
__device__ __forceinline__ void stage_issue(const StageCopies<C>& c, const uint16_t* const (&arow)[C::kAQ],
                                            const uint16_t* a_base, unsigned smem_s, long long kt,
                                            long long tiles_k) {
  if (kt < tiles_k) {
    const unsigned st = smem_s + static_cast<unsigned>(kt % C::kStages) * C::kStageBytes;
#pragma unroll
    for (int q = 0; q < C::kAQ; ++q) {
      const uint16_t* src = arow[q] ? arow[q] + kt * 64 + c.a_chunk * 8 : a_base;
      cp16_zfill(st + c.a_dst[q], src, arow[q] != nullptr);
    }
    if (c.raw_kind == 1) cp16_zfill(st + c.raw_dst, c.raw_src + kt * c.raw_step, true);
    else if (c.raw_kind == 2) cp8(st + c.raw_dst, c.raw_src + kt * c.raw_step);
  }
  cp_commit();
}

/// The decoder role of a warp: it decodes strips kSPW*warp .. +kSPW-1; lanes 0..8*kSPW-1 build their
/// tables (lane: strip tab_s = lane >> 3, entry tab_j = lane & 7) from the codebook byte and the
/// scale byte of sc_ptr (null: invalid strip).
struct DecodeRole {
  unsigned char* tab;  // [strip s][lo/hi][8]
  int tab_s, tab_j;
  const unsigned char* sc_ptr;
};

/// The warp's scaled BF16 lo/hi byte tables of stage st (tile scale byte sw); invalid strips decode
/// to zeros.
template <class C>
__device__ __forceinline__ void decode_table(const DecodeRole& d, const unsigned char* st, int warp, int lane,
                                             unsigned sw) {
  if (lane < 8 * C::kSPW) {
    unsigned short v = 0;  // invalid strips decode to zeros
    if (d.sc_ptr)
      v = scaled_bf16(e4m3_to_float(st[C::kABytes + kRawPacked + (C::kSPW * warp + d.tab_s) * 8 + d.tab_j]), sw);
    d.tab[d.tab_s * 16 + d.tab_j] = static_cast<unsigned char>(v & 0xff);
    d.tab[d.tab_s * 16 + 8 + d.tab_j] = static_cast<unsigned char>(v >> 8);
  }
  __syncwarp();
}

/// Strip s of the warp from stage st into B buffer bdst: 16 PRMT of the lane's lane-major index
/// bytes against the tables, row g, chunks t and 4 + t (swizzled).
template <class C>
__device__ __forceinline__ void decode_strip(const unsigned char* tab, const unsigned char* st, unsigned char* bdst,
                                             int warp, int lane, int s) {
  const int g = lane >> 2, t = lane & 3;
  const int sl = C::kSPW * warp + s;
  const unsigned char* raw = st + C::kABytes + sl * 192;
  const std::uint32_t X = *reinterpret_cast<const std::uint32_t*>(raw + 4 * lane);
  const std::uint32_t Y = *reinterpret_cast<const unsigned short*>(raw + 128 + 2 * lane);
  std::uint32_t sel[4];
  lane_selectors(X, Y, sel);
  const uint2 tl = *reinterpret_cast<const uint2*>(tab + s * 16);
  const uint2 th = *reinterpret_cast<const uint2*>(tab + s * 16 + 8);
  unsigned o[8];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const unsigned lo = __byte_perm(tl.x, tl.y, sel[q]);
    const unsigned hi = __byte_perm(th.x, th.y, sel[q]);
    o[2 * q] = __byte_perm(lo, hi, 0x5140);      // columns 4q' + 0, 1 of the lane's 8
    o[2 * q + 1] = __byte_perm(lo, hi, 0x7362);  // columns 4q' + 2, 3
  }
  // selectors 0, 1: columns 8t .. 8t+7 (chunk t); 2, 3: columns 32 + 8t .. (chunk 4 + t).
  const int row = 8 * sl + g;
  *reinterpret_cast<uint4*>(bdst + row * 128 + ((t ^ g) << 4)) = make_uint4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<uint4*>(bdst + row * 128 + (((4 + t) ^ g) << 4)) = make_uint4(o[4], o[5], o[6], o[7]);
}

/// Decode of K-tile kt (tile scale byte sw) in two parts: the warp's tables, then its strips into
/// B buffer kt & 1.
template <class C>
__device__ __forceinline__ void decode_ktile(const DecodeRole& d, unsigned char* smem, unsigned char* bsm, int warp,
                                             int lane, long long kt, unsigned sw) {
  decode_table<C>(d, smem + (kt % C::kStages) * C::kStageBytes, warp, lane, sw);
#pragma unroll
  for (int s = 0; s < C::kSPW; ++s)
    decode_strip<C>(d.tab, smem + (kt % C::kStages) * C::kStageBytes, bsm + (kt & 1) * kBBytes, warp, lane, s);
}

/// The CTA's GEMM over K = 64 * w.tiles_k: acc[mi][j][4] for token rows kWTM*wm + 16mi + {g, g+8}
/// and weight rows (Bs rows) 32wn + 8j + {2t, 2t+1} (wm = warp % kWM, wn = warp / kWM). a: BF16 rows
/// [*, a_cols]; arow: per A chunk copy q of this thread (row tid/8 + q*kThreads/8) the source row or
/// null (zero fill).
template <class C, bool kGemm1>
__device__ __forceinline__ void cta_gemm(const LutbW& w, long long e, long long I, const uint16_t* const (&arow)[C::kAQ],
                                         const uint16_t* a_base, unsigned char* smem, float (&acc)[C::kMI][4][4]) {
  constexpr int kMI = C::kMI, kSPW = C::kSPW, kStageBytes = C::kStageBytes, kStages = C::kStages;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wm = warp % C::kWM, wn = warp / C::kWM;
  const long long tiles_k = w.tiles_k;
  const unsigned smem_s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  unsigned char* const bsm = smem + kStages * kStageBytes;
  unsigned char* const tab = bsm + 2 * kBBytes + warp * kSPW * 16;  // [strip s][lo/hi][8]
  const unsigned bsm_s = smem_s + kStages * kStageBytes;

  float part[kMI][4][4];  // tensor-core partial sum of the current kPromoteTiles K-tiles
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mi][j][r] = part[mi][j][r] = 0.0f;

  StageCopies<C> cp;
  stage_copy_plan<C, kGemm1>(w, e, I, tiles_k, tid, cp);
  // ---- decoder role: the warp's tables and the scale bytes of its table lanes' strip
  DecodeRole dr;
  dr.tab = tab;
  dr.tab_s = (lane >> 3) % kSPW;
  dr.tab_j = lane & 7;
  dr.sc_ptr = nullptr;
  {
    long long strip;
    bool ok;
    strip_of<kGemm1>(kSPW * warp + dr.tab_s, w.tiles_n, I, strip, ok);
    if (ok) dr.sc_ptr = w.scale + (e * w.tiles_n + strip) * tiles_k;
  }
  auto load_scale = [&](long long kt) -> unsigned { return (dr.sc_ptr && kt < tiles_k) ? __ldg(dr.sc_ptr + kt) : 0u; };

  // ---- ldmatrix lane addresses (row part; the chunk part depends on ks)
  const int lq = lane >> 3, r8 = lane & 7;
  unsigned a_row_off[kMI], b_row_off[2];
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi) a_row_off[mi] = (C::kWTM * wm + 16 * mi + (lq & 1) * 8 + r8) * 128;
#pragma unroll
  for (int jp = 0; jp < 2; ++jp) b_row_off[jp] = (32 * wn + 8 * (2 * jp + (lq >> 1)) + r8) * 128;
  const int a_khalf = lq >> 1, b_khalf = lq & 1;

  // ---- prologue
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) stage_issue<C>(cp, arow, a_base, smem_s, s, tiles_k);
  unsigned sw_next = load_scale(0);
  cp_wait<kStages - 2>();
  __syncthreads();
  decode_ktile<C>(dr, smem, bsm, warp, lane, 0, sw_next);
  sw_next = load_scale(1);

  for (long long kt = 0; kt < tiles_k; ++kt) {
    cp_wait<kStages - 3>();
    __syncthreads();
    stage_issue<C>(cp, arow, a_base, smem_s, kt + kStages - 1, tiles_k);
    const bool more = kt + 1 < tiles_k;
    unsigned sw = 0;
    if (more) {
      sw = sw_next;
      sw_next = load_scale(kt + 2);
      decode_ktile<C>(dr, smem, bsm, warp, lane, kt + 1, sw);
    }
    const bool fresh = kt % kPromoteTiles == 0;
    const unsigned a_s = smem_s + static_cast<unsigned>(kt % kStages) * kStageBytes;
    const unsigned b_s = bsm_s + static_cast<unsigned>(kt & 1) * kBBytes;
    // The ldmatrix / mma steps stay in this body: as a separate step they changed ptxas's register
    // allocation of the sm_80 GEMM1 (127 -> 128 registers).
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      unsigned af[kMI][4], bf[4][2];
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
        ldsm_x4(a_s + a_row_off[mi] + (((2 * ks + a_khalf) ^ r8) << 4), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
#pragma unroll
      for (int jp = 0; jp < 2; ++jp)
        ldsm_x4(b_s + b_row_off[jp] + (((2 * ks + b_khalf) ^ r8) << 4), bf[2 * jp][0], bf[2 * jp][1],
                bf[2 * jp + 1][0], bf[2 * jp + 1][1]);
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (ks == 0 && fresh) mma_bf16_zero_c(part[mi][j], af[mi], bf[j][0], bf[j][1]);
          else mma16816<true>(part[mi][j], af[mi], bf[j][0], bf[j][1]);
        }
    }
    if (kt % kPromoteTiles == kPromoteTiles - 1 || kt + 1 == tiles_k) {
#pragma unroll
      for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[mi][j][r] = __fadd_rn(acc[mi][j][r], part[mi][j][r]);
    }
  }
  cp_wait<0>();
}

/// Pair index of token row `row` (0..63) of this CTA's tile, or -1.
__device__ __forceinline__ int pair_of(const Routing& r, int start, int count, int row) {
  return row < count ? r.sorted[start + row] : -1;
}

/// xa (FP16 E4M3 values, natural column order) with block scales xs -> BF16 mxfp8_qdq(x), in place.
/// n8 = T * Hp / 8 groups of 8 values.
__global__ void __launch_bounds__(256)
    sm80_lutb_moe_prefill_xa_to_bf16(uint16_t* __restrict__ xa, const unsigned char* __restrict__ xs, long long n8, long long Hp) {
  pdl_wait();  // xa, xs come from the MXFP8 of x (PDL rules: lutb_moe_device.cuh)
  pdl_trigger();
  const long long i = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= n8) return;
  const long long e0 = i * 8, tok = e0 / Hp, col = e0 - tok * Hp;
  const unsigned b = xs[tok * (Hp / 32) + col / 32];
  uint4 v = reinterpret_cast<const uint4*>(xa)[i];
  unsigned* u = reinterpret_cast<unsigned*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float f0 = __half2float(__ushort_as_half(static_cast<unsigned short>(u[k] & 0xffffu)));
    const float f1 = __half2float(__ushort_as_half(static_cast<unsigned short>(u[k] >> 16)));
    u[k] = static_cast<unsigned>(scaled_bf16(f0, b)) | (static_cast<unsigned>(scaled_bf16(f1, b)) << 16);
  }
  reinterpret_cast<uint4*>(xa)[i] = v;
}

/// GEMM1 + SiLU*up + MXFP8 of h. grid (Ip/64, token-tile slots). a = xa as BF16 [T, Hp];
/// hq [P, Ip] receives BF16 mxfp8_qdq(bf16(silu(g) * u)) (zeros in the padded columns I..Ip-1).
template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    sm80_lutb_moe_prefill_gemm1(LutbW w, const uint16_t* __restrict__ a, long long Hp, Routing r, long long I, long long Ip,
                         uint16_t* __restrict__ hq) {
  constexpr int kMI = C::kMI;
  pdl_wait();
  pdl_trigger();
  if (static_cast<int>(blockIdx.y) >= *r.num_tiles) return;
  const int slot = blockIdx.y;
  const long long e = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wm = warp % C::kWM, wn = warp / C::kWM;
  const int g = lane >> 2, t = lane & 3;
  const uint16_t* arow[C::kAQ];
#pragma unroll
  for (int q = 0; q < C::kAQ; ++q) {
    const int p = pair_of(r, start, count, (tid >> 3) + (C::kThreads / 8) * q);
    arow[q] = p >= 0 ? a + static_cast<long long>(p / r.top_k) * Hp : nullptr;
  }
  extern __shared__ __align__(16) unsigned char smem[];
  float acc[kMI][4][4];
  cta_gemm<C, true>(w, e, I, arow, a, smem, acc);

  // h = bf16(silu(g) * u); accumulator (mi, j, 2h + c): token row kWTM*wm + 16mi + 8h + g,
  // I-column col0 + 16wn + 8j + 2t + c (j = 0, 1: gate; j + 2: up).
  const long long col0 = 64ll * blockIdx.x + 16 * wn;
  float hv[kMI][2][2][2];  // [mi][h][j][c]
  float amax[kMI][2];
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float am = 0.0f;
      bool bad = false;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float gg = acc[mi][j][2 * h + c], uu = acc[mi][j + 2][2 * h + c];
          const bool ok = col0 + 8 * j + 2 * t + c < I;
          const float v = ok ? bf16_round((gg / (1.0f + expf(-gg))) * uu) : 0.0f;
          hv[mi][h][j][c] = v;
          am = fmaxf(am, fabsf(v));
          bad = bad || !isfinite(v);
        }
      if (bad) am = INFINITY;
      am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
      am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
      amax[mi][h] = am;
    }
  // A 32-column MXFP8 block of h = warps wn and wn ^ 1 (16 columns each).
  __shared__ float amax_s[4][C::kBM];
  if (t == 0) {
#pragma unroll
    for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) amax_s[wn][C::kWTM * wm + 16 * mi + 8 * h + g] = amax[mi][h];
  }
  __syncthreads();
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = C::kWTM * wm + 16 * mi + 8 * h + g;
      const int p = pair_of(r, start, count, row);
      if (p < 0) continue;
      const unsigned char b = mx_block_scale(fmaxf(amax_s[wn][row], amax_s[wn ^ 1][row]), MxScaleRule::Rceil);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        unsigned pk = 0;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float q = b == 255 ? __int_as_float(0x7fc00000) : mx_decode(mx_encode_dev(hv[mi][h][j][c], b), b);
          pk |= static_cast<unsigned>(bf16_from_float(q)) << (16 * c);
        }
        *reinterpret_cast<unsigned*>(hq + static_cast<long long>(p) * Ip + col0 + 8 * j + 2 * t) = pk;
      }
    }
}

/// GEMM2: y[p, n] = h[p] . w2[e, n] (FP32) for n < H. grid (ceil(H/8 / 16), token-tile slots).
template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    sm80_lutb_moe_prefill_gemm2(LutbW w, const uint16_t* __restrict__ hq, long long Ip, Routing r, long long H,
                         float* __restrict__ y) {
  constexpr int kMI = C::kMI;
  pdl_wait();
  pdl_trigger();
  if (static_cast<int>(blockIdx.y) >= *r.num_tiles) return;
  const int slot = blockIdx.y;
  const long long e = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wm = warp % C::kWM, wn = warp / C::kWM;
  const int g = lane >> 2, t = lane & 3;
  const uint16_t* arow[C::kAQ];
#pragma unroll
  for (int q = 0; q < C::kAQ; ++q) {
    const int p = pair_of(r, start, count, (tid >> 3) + (C::kThreads / 8) * q);
    arow[q] = p >= 0 ? hq + static_cast<long long>(p) * Ip : nullptr;
  }
  extern __shared__ __align__(16) unsigned char smem[];
  float acc[kMI][4][4];
  cta_gemm<C, false>(w, e, 0, arow, hq, smem, acc);
  const long long n0 = static_cast<long long>(kBN) * blockIdx.x + 32 * wn + 2 * t;
#pragma unroll
  for (int mi = 0; mi < kMI; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int p = pair_of(r, start, count, C::kWTM * wm + 16 * mi + 8 * h + g);
      if (p < 0) continue;
      float* dst = y + static_cast<long long>(p) * H;
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const long long n = n0 + 8 * j + c;
          if (n < H) dst[n] = acc[mi][j][2 * h + c];
        }
    }
}

}  // namespace lutb::cuda::kern::prefill
