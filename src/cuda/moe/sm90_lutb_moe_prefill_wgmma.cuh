// src/cuda/moe/sm90_lutb_moe_prefill_wgmma.cuh: the sm_90a prefill GEMMs on Hopper's wgmma
// (sm90_lutb_moe_prefill_wgmma_gemm1, sm90_lutb_moe_prefill_wgmma_gemm2), launched by
// lutb_moe_prefill.cu: BF16 operands with both power-of-two scales folded in (exact), in the
// 128B-swizzle layout, 64 token rows per CTA (Cfg90Bf; from 128 pairs per touched expert the
// register-weight kernels of sm90_lutb_moe_prefill_rs.cuh run instead, heuristics::prefill_kernel).
// Outputs bit-identical to the mma.sync tile of sm80_lutb_moe_prefill.cuh.
// Everything device-side is compiled for sm_90a only (__CUDA_ARCH_FEAT_SM90_ALL; __trap otherwise).
//
// CTA of the 64-row tile (Cfg90<64>, 256 threads = 2 warpgroups): 64 token rows (one token tile of
// the grouping, one expert) x 128 weight rows (16 LUT-B row-strips; warpgroup wg owns B rows
// 64wg..64wg+63 = strips 8wg..8wg+7) x K-tiles of 64 columns (one LUT-B tile column).
// Shared memory: BF16 operands in wgmma's 128B-swizzle K-major layout (sw128_off: 8-row x 128-byte
// atoms, 16-byte chunk c of row r at chunk c ^ (r & 7); SBO = 1024; atoms 1024-aligned):
//   stage ring (kStages deep, cp.async): A [BM rows][64 columns] + the 16 strips' raw lane-major
//     tiles (192 bytes each) + their codebooks (8 bytes each);
//   B buffers (double): [128 rows][64 columns], decoded from the raw tiles.
// Iteration kt: wait for stage kt+1 (own copies), fence.proxy.async (the generic-proxy writes of
// cp.async and of the decode become visible to wgmma), barrier, issue stage kt+kStages-1; each
// warpgroup issues four m64n64k16 wgmmas accumulating over kPromoteTiles K-tiles, commits; all warps
// decode K-tile kt+1 into the other B buffer while the tensor cores run; wait; promote.
// Bank conflicts (16-byte stores are served per quarter warp): in a no-swizzle layout the A copy (a
// quarter warp = the 8 chunks of ONE row, 128 bytes apart) is an 8-way conflict and the decode's B
// stores 4-way (0.82-0.88x the mma.sync tile); in the SW128 layout both are conflict-free (sw128_off,
// decode store order): 1.18-1.26x the mma.sync tile.
//
// Numerics (spec section 4): exactly the mma.sync tile's (both scales folded into exact BF16
// operands, tensor-core sums over 128 columns, FP32 promotion with round-to-nearest adds); outputs
// bit-identical to it on every test case. Inputs and outputs as the mma.sync tile's
// (lutb_moe_launch.hpp launch_lutb_prefill_gemms): xa converted in place to BF16 a; h as BF16
// mxfp8_qdq(h) in hq.
#pragma once


#include "cuda/moe/sm80_lutb_moe_prefill.cuh"

namespace lutb::cuda::kern::prefill90 {

using prefill::kBN;
using prefill::kStrips;

/// prefill::strip_of for N-block nb (slot sl 0..15 of the CTA -> global row-strip and validity).
template <bool kGemm1>
__device__ __forceinline__ void strip_of(int sl, int nb, long long tiles_n, long long I, long long& strip, bool& ok) {
  if constexpr (kGemm1) {
    const long long col = 64ll * nb + 16 * (sl >> 2) + 8 * (sl & 1);
    ok = col < I;
    strip = ((sl & 2) ? I / 8 : 0) + col / 8;
  } else {
    strip = static_cast<long long>(kStrips) * nb + sl;
    ok = strip < tiles_n;
  }
}

constexpr int kThreads = 256;
constexpr int kBM = 64;

/// Configuration: BF16 operands with both scales folded in (exact, as the mma.sync tile), BF16 wgmma
/// (m64n64k16, 4 per K-tile, accumulating in the tensor core over kPromoteTiles K-tiles, then
/// promoted with round-to-nearest adds); a 4-deep cp.async ring with copies issued 3 K-tiles ahead;
/// 2 decoded B buffers. BM: token rows per CTA; 64 is the one instantiation (a 128-row one, 1 CTA
/// per SM, lost to the register-weight kernels: docs/design/cuda-moe.md, tried and not kept), the
/// layout is written for either: BM/64 x 2 warpgroups, warpgroup wg
/// computes token rows 64 (wg >> 1) .. +63 x B rows 64 (wg & 1) .. +63 from ONE decoded B tile per
/// K-step shared by all of them; each warp decodes 16 / (BM/8) strips (64 rows: 2, 128 rows: 1).
template <int BM_>
struct Cfg90 {
  static constexpr int kStages = 4;
  static constexpr int kBBufs = 2;                             // decoded B buffers
  static constexpr int kLook = kStages - 1;                    // K-tiles of copies in flight ahead
  static constexpr int kBM = BM_;
  static constexpr int kWarps = BM_ / 8;                       // 64 rows: 8 warps, 128 rows: 16
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSPW = kStrips / kWarps;                // strips each warp decodes
  static constexpr int kMinBlocks = BM_ == 64 ? 2 : 1;
  static constexpr int kRowBytes = 128;                        // one K-tile row: 64 BF16 columns
  static constexpr int kSbo = 8 * kRowBytes;                   // the next SW128 atom
  static constexpr int kABytes = kBM * kRowBytes;
  static constexpr int kAQ = kABytes / 16 / kThreads;          // A 16-byte chunks per thread per stage
  static_assert(BM_ == 64 || BM_ == 128, "64 or 128 token rows");
  static_assert(kSPW * kWarps == kStrips && kStrips * 13 <= kThreads, "decode and raw-copy split");
  static constexpr int kRawOff = kABytes;                      // 16 x 192 lane-major index bytes
  static constexpr int kCbOff = kRawOff + kStrips * 192;       // 16 x 8 codebook bytes
  /// The 1024-byte SW128 atoms need 1024-aligned A and B tiles, hence the stage size rounded up.
  static constexpr int kStageBytes = (kCbOff + kStrips * 8 + 1023) / 1024 * 1024;
  static constexpr int kBBytes = kBN * kRowBytes;              // one decoded B K-tile
  static constexpr int kTabOff = kStages * kStageBytes + kBBufs * kBBytes;  // per warp kSPW x 16 table bytes
  static constexpr int kSmemBytes = kTabOff + kWarps * 2 * 16;
  static_assert(kStageBytes % 1024 == 0 && kBBytes % 2048 == 0 && kAQ * kThreads * 16 == kABytes,
                "SW128: every stage's A tile and each warpgroup's half of a B buffer start 1024-aligned");
};
/// 64 token rows, 2 CTAs per SM (80.25 KB: stages padded to 12 KB for the SW128 alignment).
using Cfg90Bf = Cfg90<64>;

/// Byte offset of (row r, byte column c) of a [rows][128 bytes] operand in wgmma's 128B-swizzle
/// K-major layout (CUTLASS GMMA::Layout_K_SW128_Atom, Swizzle<3,4,3>; the layout the mma.sync tile's ldmatrix
/// already reads): an atom is 8 rows x 128 bytes = 1024 contiguous bytes, row r at 128 r, and its
/// 16-byte chunk c/16 stored at chunk (c/16) ^ (r & 7). The hardware applies the XOR to address bits
/// [4:7) from bits [7:10) of the ABSOLUTE shared address, so an atom must start 1024-aligned (the
/// descriptor's base offset is 0).
///   Why: a 16-byte store is served per quarter warp (8 lanes, 128 bytes); it is conflict-free when
///   the 8 lanes hit 8 different 16-byte bank groups = address bits [4:7). In the no-swizzle layout a
///   row's 8 chunks are 128 bytes apart (all the same bank group: the A copy, 8 lanes = one row, was
///   an 8-way conflict; the decode, 8 lanes = 2 rows x 4 chunks, 4-way). Here the 8 chunks of a row
///   are 8 different bank groups (A copy: conflict-free), and see the decode for its store order.
__host__ __device__ constexpr int sw128_off(int r, int c) {
  return r * 128 + ((((c >> 4) ^ r) & 7) << 4) + (c & 15);
}
static_assert(sw128_off(0, 16) == 16 && sw128_off(1, 0) == 128 + 16 && sw128_off(7, 112) == 7 * 128 &&
                  sw128_off(9, 33) == 9 * 128 + 3 * 16 + 1,
              "SW128 offsets");

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LUTB_PREFILL_SM90 1
#endif

#ifdef LUTB_PREFILL_SM90
/// wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): bits [0,14) start
/// address >> 4, [16,30) leading-dimension byte offset >> 4, [32,46) stride-dimension byte offset
/// >> 4, [49,52) base offset, [62,64) layout (0 no swizzle, 1 128B, 2 64B, 3 32B swizzle).
///   no swizzle (kSw = false): LBO 128 = the next 16-byte K chunk, SBO = the next 8-row group.
///   128B swizzle (kSw = true): layout 1, SBO = 1024 = the next 8-row atom, LBO unused for K-major
///   when one instruction's K (here 32 bytes) lies inside the 128-byte swizzle width (DeepGEMM's
///   make_smem_desc sets 0, as here), base offset 0 (atoms 1024-aligned). The k16 step ks of a
///   K-tile advances the start address by 32 ks bytes INSIDE the atom (as DeepGEMM's K loop does):
///   the hardware forms start + 128 r + 16 j and then XORs bits [4:7) with bits [7:10), which is
///   exactly sw128_off(r, 32 ks + 16 j).
template <int SBO, bool kSw = false>
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
  static_assert(!kSw || SBO == 1024, "SW128 K-major: SBO = one 8 x 128-byte atom");
  return static_cast<unsigned long long>((addr & 0x3FFFF) >> 4) |
         (static_cast<unsigned long long>(kSw ? 0 : 128 >> 4) << 16) |
         (static_cast<unsigned long long>(SBO >> 4) << 32) | (static_cast<unsigned long long>(kSw ? 1 : 0) << 62);
}
/// Descriptor step of k16 step ks inside a K-tile (16-byte units): no swizzle 2 chunks x LBO 128 =
/// 256 bytes; SW128 32 bytes.
template <bool kSw>
constexpr unsigned long long kstep_desc(int ks) { return kSw ? 2ull * ks : 16ull * ks; }
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
/// Keeps the compiler from moving accesses of accumulator registers across wgmma issue / wait.
__device__ __forceinline__ void reg_fence(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#define LUTB_WG_D32                                                                                               \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),   \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),    \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),   \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define LUTB_WG_REGS32 \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"

/// d (+)= A[64 x 16] . B[64 x 16]^T (BF16, FP32 accumulate; acc_in = 0: d is overwritten).
__device__ __forceinline__ void wgmma_64x64x16_bf16(float (&d)[32], unsigned long long da, unsigned long long db,
                                                    int acc_in) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " LUTB_WG_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : LUTB_WG_D32
      : "l"(da), "l"(db), "r"(acc_in));
}

/// This thread's copy descriptors of cta_gemm90's stages (kt = 0): A chunks (row (tid + 256q) /
/// kChunks, chunk (tid % kChunks)) at a_dst[q]; raw: threads 0..191 one 16-byte chunk of a strip's
/// tile, 192..207 a strip's codebook (kind 0 none, 1 packed chunk, 2 codebook).
template <class C>
struct Sw128Copies {
  int a_dst[C::kAQ];
  const unsigned char* raw_src = nullptr;
  long long raw_step = 0;
  int raw_dst = 0, raw_kind = 0;
};

/// The copy descriptors of thread tid for the strips of N-block nb (expert e).
template <class C, bool kGemm1>
__device__ __forceinline__ void plan_stage_copies(const LutbW& w, long long e, long long I, int nb, long long tiles_k,
                                                  int tid, Sw128Copies<C>& c) {
  constexpr int kChunks = C::kRowBytes / 16;  // A 16-byte chunks per row and K-tile
#pragma unroll
  for (int q = 0; q < C::kAQ; ++q) c.a_dst[q] = sw128_off((tid + C::kThreads * q) / kChunks, (tid % kChunks) * 16);
  if (tid < kStrips * 13) {
    const int sl = tid < kStrips * 12 ? tid / 12 : tid - kStrips * 12;
    long long strip;
    bool ok;
    strip_of<kGemm1>(sl, nb, w.tiles_n, I, strip, ok);
    if (ok) {
      const long long tile0 = (e * w.tiles_n + strip) * tiles_k;
      if (tid < kStrips * 12) {
        c.raw_kind = 1;
        c.raw_src = w.packed + tile0 * 192 + (tid % 12) * 16;
        c.raw_step = 192;
        c.raw_dst = C::kRawOff + sl * 192 + (tid % 12) * 16;
      } else {
        c.raw_kind = 2;
        c.raw_src = w.codebook + tile0 * 8;
        c.raw_step = 8;
        c.raw_dst = C::kCbOff + sl * 8;
      }
    }
  }
}

/// Issues this thread's copies of K-tile kt (kt < tiles_k) into stage kt % kStages and commits a
/// group (empty past the end). Rows without a pair (arow null) are zero-filled from a_base.
template <class C>
__device__ __forceinline__ void issue_stage_copies(const Sw128Copies<C>& c, const unsigned char* const (&arow)[C::kAQ],
                                                   const unsigned char* a_base, unsigned smem_s, int tid,
                                                   long long kt, long long tiles_k) {
  constexpr int RB = C::kRowBytes, kChunks = RB / 16;
  if (kt < tiles_k) {
    const unsigned st = smem_s + static_cast<unsigned>(kt % C::kStages) * C::kStageBytes;
#pragma unroll
    for (int q = 0; q < C::kAQ; ++q)
      prefill::cp16_zfill(st + c.a_dst[q], arow[q] ? arow[q] + kt * RB + (tid % kChunks) * 16 : a_base,
                          arow[q] != nullptr);
    if (c.raw_kind == 1) prefill::cp16_zfill(st + c.raw_dst, c.raw_src + kt * c.raw_step, true);
    else if (c.raw_kind == 2) prefill::cp8(st + c.raw_dst, c.raw_src + kt * c.raw_step);
  }
  prefill::cp_commit();
}

/// Decode of K-tile kt: warp decodes slots kSPW*warp .. +kSPW-1 (64 rows: its own warpgroup's B
/// rows; 128: one strip each, the B tile is shared by the two token-half warpgroups) into B buffer
/// kt % kBBufs. Lanes 0..8*kSPW-1 first build the scaled BF16 lo/hi byte tables (lane: strip s =
/// lane >> 3, entry lane & 7) from the codebook byte and the tile's scale byte tsc. Invalid strips
/// (tsc_ptr null) decode to zeros (zero table, whatever stale index bytes the stage holds).
/// g = lane >> 2, t = lane & 3 come from the caller: computed here, they changed ptxas's register
/// allocation of the wgmma kernels (112 -> 110, 118 -> 114 registers).
template <class C>
__device__ __forceinline__ void decode_ktile_sw128(unsigned char* smem, unsigned char* bsm, unsigned char* tab,
                                                   const unsigned char* tsc_ptr, int warp, int lane, int g, int t,
                                                   long long kt, unsigned tsc) {
  constexpr int kSPW = C::kSPW;
  const unsigned char* st = smem + (kt % C::kStages) * C::kStageBytes;
  unsigned char* bdst = bsm + (kt % C::kBBufs) * C::kBBytes;
  if (lane < 8 * kSPW) {
    const int s = lane >> 3, j = lane & 7;
    unsigned short v = 0;
    if (tsc_ptr) v = prefill::scaled_bf16(e4m3_to_float(st[C::kCbOff + (kSPW * warp + s) * 8 + j]), tsc);
    tab[s * 16 + j] = static_cast<unsigned char>(v & 0xff);
    tab[s * 16 + 8 + j] = static_cast<unsigned char>(v >> 8);
  }
  __syncwarp();
#pragma unroll
  for (int s = 0; s < kSPW; ++s) {
    const int sl = kSPW * warp + s;
    const unsigned char* raw = st + C::kRawOff + sl * 192;
    const std::uint32_t X = *reinterpret_cast<const std::uint32_t*>(raw + 4 * lane);
    const std::uint32_t Y = *reinterpret_cast<const unsigned short*>(raw + 128 + 2 * lane);
    std::uint32_t sel[4];
    lane_selectors(X, Y, sel);
    {
      // Store order (SW128): the lane holds row g, chunks t (selectors 0, 1) and 4 + t (2, 3). Lanes
      // with odd g store chunk 4 + t first (selector pairs swapped): a quarter warp (g = 2i, 2i+1,
      // t = 0..3) then writes physical chunks {t ^ 2i} and {(4 + t) ^ (2i+1)}, one of them
      // {0..3} and the other {4..7}: 8 different bank groups per store, conflict-free (without
      // the swap, {t ^ 2i} and {t ^ (2i+1)} overlap: 2-way, as in the mma.sync tile's decode).
      const bool odd = g & 1;
      if (odd) {
        const std::uint32_t s0 = sel[0], s1 = sel[1];
        sel[0] = sel[2];
        sel[1] = sel[3];
        sel[2] = s0;
        sel[3] = s1;
      }
      const uint2 tl = *reinterpret_cast<const uint2*>(tab + s * 16);
      const uint2 th = *reinterpret_cast<const uint2*>(tab + s * 16 + 8);
      unsigned o[8];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const unsigned lo = __byte_perm(tl.x, tl.y, sel[q]);
        const unsigned hi = __byte_perm(th.x, th.y, sel[q]);
        o[2 * q] = __byte_perm(lo, hi, 0x5140);      // columns 4q' + 0, 1
        o[2 * q + 1] = __byte_perm(lo, hi, 0x7362);  // columns 4q' + 2, 3
      }
      // columns 8t..8t+7 = bytes 16t.. (chunk t), columns 32 + 8t.. = chunk 4 + t; odd g: swapped
      *reinterpret_cast<uint4*>(bdst + sw128_off(8 * sl + g, 16 * (t + (odd ? 4 : 0)))) =
          make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4*>(bdst + sw128_off(8 * sl + g, 16 * (t + (odd ? 0 : 4)))) =
          make_uint4(o[4], o[5], o[6], o[7]);
    }
  }
  __syncwarp();  // the table is rewritten by the next decode
}

/// Issues the 4 wgmma of one K-tile (A and B descriptors da, db) into d0 and commits them (fresh:
/// the first overwrites d0, the start of a promotion group).
__device__ __forceinline__ void issue_ktile_wgmma(float (&d0)[32], unsigned long long da, unsigned long long db,
                                                  bool fresh) {
  reg_fence(d0);
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    wgmma_64x64x16_bf16(d0, da + kstep_desc<true>(ks), db + kstep_desc<true>(ks), (ks == 0 && fresh) ? 0 : 1);
  wg_commit();
}

/// The CTA's GEMM over K = 64 * w.tiles_k. acc[4j + 2h + c] (wgmma D layout): token row
/// 16*(warp%4) + g + 8h, B row 64*wg + 8j + 2t + c (wg = warp/4; B row 8*slot + i = row i of strip
/// slot). arow[q]: this thread's A copy q source row (row (tid + 256q)/(RB/16)) or null (zero fill).
template <class C, bool kGemm1>
__device__ __forceinline__ void cta_gemm90(const LutbW& w, long long e, long long I,
                                           const unsigned char* const (&arow)[C::kAQ], const unsigned char* a_base,
                                           unsigned char* smem, float (&acc)[32]) {
  constexpr int kStages = C::kStages, kStageBytes = C::kStageBytes, kBBytes = C::kBBytes, RB = C::kRowBytes;
  constexpr int kSPW = C::kSPW;
  // warpgroup wg: token rows 64 wm.., B rows 64 wn.. (64-row tile: wm = 0, wn = wg)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2, wn = wg & 1, wm = wg >> 1;
  const int nb = blockIdx.x;
  const long long tiles_k = w.tiles_k;
  const unsigned smem_s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned bsm_s = smem_s + kStages * kStageBytes;
  unsigned char* const bsm = smem + kStages * kStageBytes;

  Sw128Copies<C> cp;
  plan_stage_copies<C, kGemm1>(w, e, I, nb, tiles_k, tid, cp);
  const int g = lane >> 2, t = lane & 3;
  // The table lanes' tile scale bytes (loaded one K-tile ahead).
  const unsigned char* tsc_ptr = nullptr;
  {
    long long strip;
    bool ok;
    strip_of<kGemm1>(kSPW * warp + ((lane >> 3) % kSPW), nb, w.tiles_n, I, strip, ok);
    if (ok && lane < 8 * kSPW) tsc_ptr = w.scale + (e * w.tiles_n + strip) * tiles_k;
  }
  unsigned char* const tab = smem + C::kTabOff + warp * 32;
  auto load_tsc = [&](long long kt) -> unsigned { return (tsc_ptr && kt < tiles_k) ? __ldg(tsc_ptr + kt) : 0u; };

#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
  float d0[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d0[i] = 0.0f;

  const unsigned long long da0 = smem_desc<C::kSbo, true>(smem_s + wm * (64 * RB)),
                           db0 = smem_desc<C::kSbo, true>(bsm_s + wn * (kBBytes / 2));
  if (smem_s & 1023u) __trap();  // the SW128 atoms need a 1024-aligned dynamic smem base

  // ---- prologue
#pragma unroll
  for (int s = 0; s < C::kLook; ++s) issue_stage_copies<C>(cp, arow, a_base, smem_s, tid, s, tiles_k);
  unsigned tsc_next = load_tsc(0);
  prefill::cp_wait<C::kLook - 1>();
  __syncthreads();
  decode_ktile_sw128<C>(smem, bsm, tab, tsc_ptr, warp, lane, g, t, 0, tsc_next);
  tsc_next = load_tsc(1);

  for (long long kt = 0; kt < tiles_k; ++kt) {
    prefill::cp_wait<C::kLook - 2>();  // stage kt+1 landed (own copies)
    fence_async_smem();
    __syncthreads();
    // stage (kt + kLook) % kStages: the one read by K-tile kt-1 (waited)
    issue_stage_copies<C>(cp, arow, a_base, smem_s, tid, kt + C::kLook, tiles_k);
    // descriptors advance in 16-byte units: stage kt's A, buffer kt&1's B; +256 bytes = 2 K chunks
    const unsigned long long da = da0 + static_cast<unsigned long long>((kt % kStages) * kStageBytes >> 4);
    const unsigned long long db = db0 + static_cast<unsigned long long>((kt % C::kBBufs) * kBBytes >> 4);
    {
      const bool fresh = kt % prefill::kPromoteTiles == 0;
      const unsigned tsc = tsc_next;
      tsc_next = load_tsc(kt + 2);
      issue_ktile_wgmma(d0, da, db, fresh);
      // into B[(kt+1) % kBBufs]: not read by a group in flight
      if (kt + 1 < tiles_k) decode_ktile_sw128<C>(smem, bsm, tab, tsc_ptr, warp, lane, g, t, kt + 1, tsc);
      const bool promote = kt % prefill::kPromoteTiles == prefill::kPromoteTiles - 1 || kt + 1 == tiles_k;
      wg_wait0();
      reg_fence(d0);
      if (promote) {
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = __fadd_rn(acc[i], d0[i]);
      }
    }
  }
  prefill::cp_wait<0>();
}
#endif  // LUTB_PREFILL_SM90

#ifdef LUTB_PREFILL_SM90
/// GEMM1 epilogue of one consumer warpgroup wg (B rows 64wg..64wg+63 = slots 8wg..8wg+7 of N-block nb):
/// h = bf16(silu(gate) * up) -> MXFP8 (block amax over the 4 lanes of a row) -> hq (BF16 mxfp8_qdq(h)).
/// prow[h]: pair of the thread's token row h or -1.
__device__ __forceinline__ void epilogue_gemm1(const float (&acc)[32], int nb, int wg, const int (&prow)[2], int t,
                                               long long I, long long Ip, unsigned char* __restrict__ hq) {
  // Slot 8wg + j (prefill::strip_of): j = 0, 1 gate / 2, 3 up of I-columns c0 + 0..15, j = 4..7 the
  // same for c0 + 16..31, c0 = 64 bx + 32 wg: the thread's 8 columns per row lie in ONE MXFP8 block
  // of h (32 columns, the 4 lanes t of a row).
  const long long c0 = 64ll * nb + 32 * wg;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float hv[4][2];
    float am = 0.0f;
    bool bad = false;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // q -> gate j = (q & 1) + 4 (q >> 1)
      const int j = (q & 1) + 4 * (q >> 1);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float gg = acc[4 * j + 2 * h + c], uu = acc[4 * (j + 2) + 2 * h + c];
        const bool ok = c0 + 16 * (q >> 1) + 8 * (q & 1) + 2 * t + c < I;
        const float v = ok ? bf16_round((gg / (1.0f + expf(-gg))) * uu) : 0.0f;
        hv[q][c] = v;
        am = fmaxf(am, fabsf(v));
        bad = bad || !isfinite(v);
      }
    }
    if (bad) am = INFINITY;
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
    am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 2));
    const int p = prow[h];
    if (p < 0) continue;
    const unsigned char b = mx_block_scale(am, MxScaleRule::Rceil);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const long long col = c0 + 16 * (q >> 1) + 8 * (q & 1) + 2 * t;
      unsigned pk = 0;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float v = b == 255 ? __int_as_float(0x7fc00000) : mx_decode(mx_encode_dev(hv[q][c], b), b);
        pk |= static_cast<unsigned>(bf16_from_float(v)) << (16 * c);
      }
      *reinterpret_cast<unsigned*>(hq + (static_cast<long long>(p) * Ip + col) * 2) = pk;
    }
  }
}

/// GEMM2 epilogue of consumer warpgroup wg: y[p, n] = acc for the thread's token rows and n < H.
__device__ __forceinline__ void epilogue_gemm2(const float (&acc)[32], int nb, int wg, const int (&prow)[2], int t,
                                               long long H, float* __restrict__ y) {
  const long long n0 = static_cast<long long>(kBN) * nb + 64 * wg + 2 * t;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int p = prow[h];
    if (p < 0) continue;
    float* dst = y + static_cast<long long>(p) * H;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const long long n = n0 + 8 * j + c;
        if (n < H) dst[n] = acc[4 * j + 2 * h + c];
      }
  }
}
#endif  // LUTB_PREFILL_SM90

/// GEMM1 + SiLU*up + MXFP8 of h. grid (Ip/64, token-tile slots). a = mxfp8_qdq(x) as BF16 [T, Hp];
/// hq [P, Ip] receives BF16 mxfp8_qdq(bf16(silu(g) * u)) (NaN for b = 255), as the mma.sync tile.
/// Padded columns I..Ip-1 get zeros.
template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    sm90_lutb_moe_prefill_wgmma_gemm1(LutbW w, const unsigned char* __restrict__ a, long long Hp, Routing r,
                                      long long I, long long Ip, unsigned char* __restrict__ hq) {
#ifdef LUTB_PREFILL_SM90
  constexpr int EB = 2;  // operand bytes (BF16)
  pdl_wait();
  pdl_trigger();
  const int slot = blockIdx.y;
  if (slot >= *r.num_tiles) return;
  const long long e = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2, wq = warp & 3;
  const int wn = wg & 1, wm = wg >> 1;  // B rows 64 wn.., token rows 64 wm.. (64-row tile: wm = 0)
  const int g = lane >> 2, t = lane & 3;
  const unsigned char* arow[C::kAQ];
#pragma unroll
  for (int q = 0; q < C::kAQ; ++q) {
    const int pa = prefill::pair_of(r, start, count, (tid + C::kThreads * q) / (C::kRowBytes / 16));
    arow[q] = pa >= 0 ? a + static_cast<long long>(pa / r.top_k) * Hp * EB : nullptr;
  }
  int prow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) prow[h] = prefill::pair_of(r, start, count, 64 * wm + 16 * wq + g + 8 * h);
  extern __shared__ __align__(1024) unsigned char smem[];
  float acc[32];
  cta_gemm90<C, true>(w, e, I, arow, a, smem, acc);
  epilogue_gemm1(acc, blockIdx.x, wn, prow, t, I, Ip, hq);
#else
  __trap();  // sm_90a only (launch_lutb_prefill_gemms refuses other devices)
#endif
}

/// GEMM2: y[p, n] = h[p] . w2[e, n] (FP32) for n < H. grid (ceil(H/8 / 16), token-tile slots). hq as
/// GEMM1 wrote it.
template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    sm90_lutb_moe_prefill_wgmma_gemm2(LutbW w, const unsigned char* __restrict__ hq, long long Ip, Routing r,
                                      long long H, float* __restrict__ y) {
#ifdef LUTB_PREFILL_SM90
  constexpr int EB = 2;  // operand bytes (BF16)
  pdl_wait();
  pdl_trigger();
  const int slot = blockIdx.y;
  if (slot >= *r.num_tiles) return;
  const long long e = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2, wq = warp & 3;
  const int wn = wg & 1, wm = wg >> 1;  // B rows 64 wn.., token rows 64 wm.. (64-row tile: wm = 0)
  const int g = lane >> 2, t = lane & 3;
  const unsigned char* arow[C::kAQ];
#pragma unroll
  for (int q = 0; q < C::kAQ; ++q) {
    const int pa = prefill::pair_of(r, start, count, (tid + C::kThreads * q) / (C::kRowBytes / 16));
    arow[q] = pa >= 0 ? hq + static_cast<long long>(pa) * Ip * EB : nullptr;
  }
  int prow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) prow[h] = prefill::pair_of(r, start, count, 64 * wm + 16 * wq + g + 8 * h);
  extern __shared__ __align__(1024) unsigned char smem[];
  float acc[32];
  cta_gemm90<C, false>(w, e, 0, arow, hq, smem, acc);
  epilogue_gemm2(acc, blockIdx.x, wn, prow, t, H, y);
#else
  __trap();
#endif
}

}  // namespace lutb::cuda::kern::prefill90
