// src/cuda/moe_lutb_prefill_sm90.cuh: sm_90a prefill GEMMs on Hopper's wgmma (session 13), the
// PrefillTile values W64, W64D (FP8), WB64, WB64D, WB64T (BF16 fold) and WS64 (BF16 fold,
// warp-specialised), WB128 and WB128P (BF16 fold, 128 token rows, session 14) of moe_prefill.hpp,
// launched by moe_lutb_prefill.cu. WB64 is the prefill default on sm_90 (helper pf13b): with the BF16
// operands in the 128B-swizzle layout it is 1.18-1.26x M64 on the H200, bit-identical to it. From 512
// pairs per touched expert WB128 (4 warpgroups sharing one decoded B tile, 1 CTA per SM) is: 1.02-1.12x
// WB64 there (helper pf14; WB128P, its pipelined variant, 0.77-0.85x WB128). The FP8 tiles are 1-9 % faster than M64 but outside the tests'
// error bounds: never chosen (docs/perf/moe-gpu-prefill.md, session 13).
// Everything device-side is compiled for sm_90a only (__CUDA_ARCH_FEAT_SM90_ALL; __trap otherwise).
//
// Why FP8: LUT-B weights ARE E4M3 codebook bytes, and the MXFP8 activations are E4M3 bytes with one
// UE8M0 scale per 32 columns. Decoding a tile to the tensor core's operand is therefore a pure byte
// lookup (4 PRMT per lane and tile row, no conversion), and wgmma's FP8 rate is twice BF16's.
//
// CTA of WB128 (Cfg90 BM = 128): 512 threads = 4 warpgroups, warpgroup wg on token rows 64 (wg >> 1)..
// and B rows 64 (wg & 1)..; each warp decodes one strip; otherwise as below.
// CTA of W64/WB64 (256 threads = 2 warpgroups, no producer warp): 64 token rows (one token tile of
// the grouping, one expert) x 128 weight rows (16 LUT-B row-strips; warpgroup wg owns B rows
// 64wg..64wg+63 = strips 8wg..8wg+7) x K-tiles of 64 columns (one LUT-B tile column).
// Shared memory: BF16 operands in wgmma's 128B-swizzle K-major layout (sw128_off: 8-row x 128-byte
// atoms, 16-byte chunk c of row r at chunk c ^ (r & 7); SBO = 1024; atoms 1024-aligned), FP8 operands
// in the no-swizzle K-major layout (core_off: core matrix = 8 rows x 16 bytes, 128 contiguous bytes;
// LBO = 128 = next 16 K-bytes, SBO = 8 rows):
//   stage ring (kStages deep, cp.async): A [64 rows][64 columns] (FP8: 4 KB, BF16: 8 KB) + the 16
//     strips' raw lane-major tiles (192 bytes each) + their codebooks (8 bytes each);
//   B buffers (double): [128 rows][64 columns], decoded from the raw tiles.
// Iteration kt: wait for stage kt+1 (own copies), fence.proxy.async (the generic-proxy writes of
// cp.async and of the decode become visible to wgmma), barrier, issue stage kt+kStages-1; each
// warpgroup issues its wgmmas (FP8: two m64n64k32, one per MXFP8 block, scale-d = 0 into D0 / D1;
// BF16: four m64n64k16 accumulating over kPromoteTiles K-tiles), commits; all warps decode K-tile
// kt+1 into the other B buffer (two strips per warp) while the tensor cores run; wait; promote.
// Bank conflicts (16-byte stores are served per quarter warp): pf13's BF16 tiles used the no-swizzle
// layout, where the A copy (a quarter warp = the 8 chunks of ONE row, 128 bytes apart) was an 8-way
// conflict and the decode's B stores (2 rows x 4 chunks) 4-way; they ran at 0.82-0.88x M64. In the
// SW128 layout both are conflict-free (sw128_off, decode store order): 1.18-1.26x M64 (pf13b).
// The FP8 tiles keep the no-swizzle layout: their A copy (2 rows x 4 chunks per quarter warp) is still
// a 4-way conflict and their 8-byte B stores 2-way (not changed; W64 is outside the error bounds).
//
// Numerics (spec section 4). FP8: the tensor core sums the 32 exact E4M3 x E4M3 products of ONE
// MXFP8 block, and it rounds inside that sum: measured rel. L2 1.2e-3..4.2e-3 to the reference,
// which misses the contract's 1e-3. Each block's partial sum is scaled by the token's block scale
// 2^(b_x-127) and the K-tile's two blocks summed in FP32, then multiplied by the tile scale
// 2^(s_w-127) and added to the FP32 accumulator with round-to-nearest FMAs: the same order of
// operations as the swap-AB decode kernels (moe_swapab.cuh), i.e. DeepGEMM's promotion per 32
// columns instead of per 128. BF16 fold: exactly M64's numerics (both scales folded into exact BF16
// operands, tensor-core sums over 128 columns, FP32 promotion); outputs bit-identical to M64 on
// every test case.
//
// Inputs (moe_prefill.hpp). FP8: GEMM1 reads x as E4M3 bytes xq8 [T, Hp] with FP32 block scales xsf
// [T, Hp/32] (made from xa/xs by xa_to_fp8_kernel); it writes h as E4M3 bytes hq8 [P, Ip] and
// FP32 block scales hsf [P, Ip/32] (zeros / 2^-127 in the padded columns); GEMM2 reads those.
// BF16: as M64 (xa converted in place to BF16 a; h as BF16 mxfp8_qdq(h) in hq).
#pragma once

#include <cuda_fp8.h>

#include "moe_lutb_prefill.cuh"

namespace lutb::cuda::kern::prefill90 {

using prefill::kBN;
using prefill::kStrips;

/// The CTA's weight N-block and token-tile slot: grid (N-blocks, slots), or (slots, N-blocks) when
/// C::kTokFast (consecutive CTAs then share the weight N-block: its tiles are read from DRAM once and
/// reused from L2 by the expert's other token tiles running at the same time).
template <class C>
__device__ __forceinline__ int cta_nblock() { return C::kTokFast ? blockIdx.y : blockIdx.x; }
template <class C>
__device__ __forceinline__ int cta_slot() { return C::kTokFast ? blockIdx.x : blockIdx.y; }

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

/// Configuration: kBf16 = false: E4M3 operands, FP8 wgmma (m64n64k32 .e4m3, 2 per K-tile), per-32
/// promotion with the block and tile scales (W64); kBf16 = true: BF16 operands with both scales
/// folded in (exact, as the M64 kernel), BF16 wgmma (m64n64k16, 4 per K-tile, accumulating in the
/// tensor core over kPromoteTiles K-tiles, then promoted with round-to-nearest adds) (WB64).
/// S: cp.async ring depth in K-tiles. kTokFast: grid (slots, N-blocks) instead of (N-blocks, slots).
///   BM: token rows per CTA, 64 or 128 (WB128, session 14): BM/64 x 2 warpgroups, warpgroup wg
///   computes token rows 64 (wg >> 1) .. +63 x B rows 64 (wg & 1) .. +63 from ONE decoded B tile per
///   K-step shared by all of them; each warp decodes 16 / (BM/8) strips (WB64: 2, WB128: 1).
///   kPipe (WB128P): the K-tile pair's first wgmma group is left in flight across the next K-step's
///   barrier (waited only before the promotion after the pair's second group), so the tensor cores
///   work through every other barrier; this needs 3 B buffers and copies issued kStages - 2 K-tiles
///   ahead (the stage and B buffer of the group in flight are not overwritten).
template <bool kBf16_, int S, bool kTokFast_ = false, int BM_ = 64, bool kPipe_ = false>
struct Cfg90 {
  static constexpr bool kPipe = kPipe_;
  static constexpr int kBBufs = kPipe_ ? 3 : 2;          // decoded B buffers
  static constexpr int kLook = kPipe_ ? S - 2 : S - 1;   // K-tiles of copies in flight ahead
  static_assert(!kPipe_ || (kBf16_ && S >= 4), "pipelined: BF16 fold, at least 4 stages");
  static constexpr bool kBf16 = kBf16_;
  static constexpr bool kTokFast = kTokFast_;
  static constexpr int kStages = S;
  static constexpr int kBM = BM_;
  static constexpr int kWarps = BM_ / 8;                       // 64 rows: 8 warps, 128 rows: 16
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSPW = kStrips / kWarps;                // strips each warp decodes
  static constexpr int kMinBlocks = BM_ == 64 ? 2 : 1;
  static constexpr int kRowBytes = kBf16 ? 128 : 64;          // one K-tile row: 64 columns
  static constexpr int kSbo = 8 * kRowBytes;                   // next 8-row core-matrix group / SW128 atom
  /// BF16: 128B-swizzle K-major operands (sw128_off; the 1024-byte atoms need 1024-aligned A and B
  /// tiles, hence the stage size rounded up to 1024). FP8: no-swizzle (core_off<64>).
  static constexpr bool kSw128 = kBf16;
  static constexpr int kABytes = kBM * kRowBytes;
  static constexpr int kAQ = kABytes / 16 / kThreads;          // A 16-byte chunks per thread per stage
  static_assert(BM_ == 64 || (BM_ == 128 && kBf16_), "128 token rows: BF16 fold only (WB128)");
  static_assert(kSPW * kWarps == kStrips && kStrips * 13 <= kThreads, "decode and raw-copy split");
  static constexpr int kRawOff = kABytes;                      // 16 x 192 lane-major index bytes
  static constexpr int kCbOff = kRawOff + kStrips * 192;       // 16 x 8 codebook bytes
  static constexpr int kStageBytes = (kCbOff + kStrips * 8 + (kSw128 ? 1023 : 0)) / (kSw128 ? 1024 : 1) * (kSw128 ? 1024 : 1);
  static constexpr int kBBytes = kBN * kRowBytes;              // one decoded B K-tile
  static constexpr int kTabOff = kStages * kStageBytes + kBBufs * kBBytes;  // BF16: per warp kSPW x 16 table bytes
  static constexpr int kSmemBytes = kTabOff + (kBf16 ? kWarps * 2 * 16 : 0);
  static_assert(kStageBytes % 16 == 0 && kBBytes % 16 == 0 && kAQ * kThreads * 16 == kABytes, "layout");
  static_assert(!kSw128 || (kStageBytes % 1024 == 0 && kBBytes % 2048 == 0 && kRowBytes == 128),
                "SW128: every stage's A tile and each warpgroup's half of a B buffer start 1024-aligned");
};
using Cfg90F8 = Cfg90<false, 4>;   // W64   (75 KB of shared memory with S = 8: W64D)
using Cfg90F8D = Cfg90<false, 8>;  // W64D
using Cfg90Bf = Cfg90<true, 4>;    // WB64  (80.25 KB: stages padded to 12 KB for the SW128 alignment)
using Cfg90BfD = Cfg90<true, 6>;   // WB64D (104.25 KB: still 2 CTAs per SM)
using Cfg90BfT = Cfg90<true, 4, true>;  // WB64T: WB64 with the token-tile slots along grid x
/// WB128 (session 14, pf14): 128 token rows, 512 threads = 4 consumer warpgroups (2 along tokens x 2
/// along weights), one decoded B tile per K-step feeds all four: half WB64's decode work per FLOP.
/// Shared memory 112.5 KB (stages 20 KB: A 16 KB + raw 3.1 KB, padded for SW128), 1 CTA per SM;
/// registers capped at 128 by 512 threads (WB64 uses 115).
using Cfg90Bf128 = Cfg90<true, 4, false, 128>;
static_assert(Cfg90Bf128::kSmemBytes == 4 * 20480 + 2 * 16384 + 512 && Cfg90Bf128::kAQ == 2, "WB128 layout");
/// WB128P: WB128 with the wgmma group of each pair's first K-tile in flight across the next barrier
/// (kPipe); 5 stages (3 K-tiles of copies ahead, as WB128) + 3 B buffers: 148.5 KB, 1 CTA per SM.
using Cfg90Bf128P = Cfg90<true, 5, false, 128, true>;
static_assert(Cfg90Bf128P::kSmemBytes == 5 * 20480 + 3 * 16384 + 512 && Cfg90Bf128P::kLook == 3, "WB128P layout");

/// Byte offset of (row r, byte column c) of a [rows][RB bytes] operand in wgmma's no-swizzle
/// K-major layout: core matrix = 8 rows x 16 bytes (128 contiguous bytes); 16-byte K chunk c/16 at
/// 128 bytes (LBO), 8-row group r/8 at 8*RB bytes (SBO), row r%8 at 16.
template <int RB>
__host__ __device__ constexpr int core_off(int r, int c) {
  return (r >> 3) * (8 * RB) + (c >> 4) * 128 + (r & 7) * 16 + (c & 15);
}

/// Byte offset of (row r, byte column c) of a [rows][128 bytes] operand in wgmma's 128B-swizzle
/// K-major layout (CUTLASS GMMA::Layout_K_SW128_Atom, Swizzle<3,4,3>; the layout M64's ldmatrix
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
/// Operand offset of configuration C: SW128 for BF16, no-swizzle core matrices for FP8.
template <class C>
__host__ __device__ constexpr int op_off(int r, int c) {
  if constexpr (C::kSw128) return sw128_off(r, c);
  else return core_off<C::kRowBytes>(r, c);
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

/// d = A[64 x 32] . B[64 x 32]^T (E4M3, FP32 out; scale-d = 0: the previous d is not added).
__device__ __forceinline__ void wgmma_64x64x32_e4m3(float (&d)[32], unsigned long long da, unsigned long long db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " LUTB_WG_REGS32 ", %32, %33, p, 1, 1;\n}\n"
      : LUTB_WG_D32
      : "l"(da), "l"(db), "r"(0));
}
/// d (+)= A[64 x 16] . B[64 x 16]^T (BF16, FP32 accumulate; acc_in = 0: d is overwritten).
__device__ __forceinline__ void wgmma_64x64x16_bf16(float (&d)[32], unsigned long long da, unsigned long long db,
                                                    int acc_in) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " LUTB_WG_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : LUTB_WG_D32
      : "l"(da), "l"(db), "r"(acc_in));
}

/// The CTA's GEMM over K = 64 * w.tiles_k. acc[4j + 2h + c] (wgmma D layout): token row
/// 16*(warp%4) + g + 8h, B row 64*wg + 8j + 2t + c (wg = warp/4; B row 8*slot + i = row i of strip
/// slot). arow[q]: this thread's A copy q source row (row (tid + 256q)/(RB/16)) or null (zero fill).
/// FP8 only: srow[h]: FP32 block-scale row of the thread's token row h, or null (no token).
template <class C, bool kGemm1>
__device__ __forceinline__ void cta_gemm90(const LutbW& w, long long e, long long I,
                                           const unsigned char* const (&arow)[C::kAQ], const unsigned char* a_base,
                                           const float* const (&srow)[2], unsigned char* smem, float (&acc)[32]) {
  constexpr int kStages = C::kStages, kStageBytes = C::kStageBytes, kBBytes = C::kBBytes, RB = C::kRowBytes;
  constexpr int kChunks = RB / 16;  // A 16-byte chunks per row and K-tile
  constexpr int kThreads = C::kThreads, kSPW = C::kSPW;
  // warpgroup wg: token rows 64 wm.., B rows 64 wn.. (WB64: wm = 0, wn = wg)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2, wn = wg & 1, wm = wg >> 1;
  const int nb = cta_nblock<C>();
  const long long tiles_k = w.tiles_k;
  const unsigned smem_s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned bsm_s = smem_s + kStages * kStageBytes;
  unsigned char* const bsm = smem + kStages * kStageBytes;

  // ---- copy descriptors: A chunks (row (tid + 256q) / kChunks, chunk (tid % kChunks)); raw:
  // threads 0..191 one 16-byte chunk of a strip's tile, 192..207 a strip's codebook.
  int a_dst[C::kAQ];
#pragma unroll
  for (int q = 0; q < C::kAQ; ++q) a_dst[q] = op_off<C>((tid + kThreads * q) / kChunks, (tid % kChunks) * 16);
  const unsigned char* raw_src = nullptr;
  long long raw_step = 0;
  int raw_dst = 0, raw_kind = 0;
  if (tid < kStrips * 13) {
    const int sl = tid < kStrips * 12 ? tid / 12 : tid - kStrips * 12;
    long long strip;
    bool ok;
    strip_of<kGemm1>(sl, nb, w.tiles_n, I, strip, ok);
    if (ok) {
      const long long tile0 = (e * w.tiles_n + strip) * tiles_k;
      if (tid < kStrips * 12) {
        raw_kind = 1;
        raw_src = w.packed + tile0 * 192 + (tid % 12) * 16;
        raw_step = 192;
        raw_dst = C::kRawOff + sl * 192 + (tid % 12) * 16;
      } else {
        raw_kind = 2;
        raw_src = w.codebook + tile0 * 8;
        raw_step = 8;
        raw_dst = C::kCbOff + sl * 8;
      }
    }
  }
  auto issue = [&](long long kt) {
    if (kt < tiles_k) {
      const unsigned st = smem_s + static_cast<unsigned>(kt % kStages) * kStageBytes;
#pragma unroll
      for (int q = 0; q < C::kAQ; ++q)
        prefill::cp16_zfill(st + a_dst[q], arow[q] ? arow[q] + kt * RB + (tid % kChunks) * 16 : a_base,
                            arow[q] != nullptr);
      if (raw_kind == 1) prefill::cp16_zfill(st + raw_dst, raw_src + kt * raw_step, true);
      else if (raw_kind == 2) prefill::cp8(st + raw_dst, raw_src + kt * raw_step);
    }
    prefill::cp_commit();
  };

  // ---- decode: warp decodes slots kSPW*warp .. +kSPW-1 (WB64: its own warpgroup's B rows; WB128: one
  // strip each, the B tile is shared by the two token-half warpgroups); lane L = 4g + t:
  // row g, columns 8t..8t+7 and 32+8t..32+8t+7 (lutb/cuda/lane_major.hpp). Invalid strips decode to
  // zeros (zero codebook / table, whatever stale index bytes the stage holds).
  const int g = lane >> 2, t = lane & 3;
  bool dec_ok[kSPW];
#pragma unroll
  for (int s = 0; s < kSPW; ++s) {
    long long strip;
    strip_of<kGemm1>(kSPW * warp + s, nb, w.tiles_n, I, strip, dec_ok[s]);
  }
  // BF16: lanes 0..8*kSPW-1 build the scaled BF16 lo/hi byte tables (lane: strip s = lane >> 3, entry
  // lane & 7) from the codebook byte and the tile's scale byte (loaded one K-tile ahead).
  const unsigned char* tsc_ptr = nullptr;
  if constexpr (C::kBf16) {
    long long strip;
    bool ok;
    strip_of<kGemm1>(kSPW * warp + ((lane >> 3) % kSPW), nb, w.tiles_n, I, strip, ok);
    if (ok && lane < 8 * kSPW) tsc_ptr = w.scale + (e * w.tiles_n + strip) * tiles_k;
  }
  unsigned char* const tab = smem + C::kTabOff + warp * 32;
  auto load_tsc = [&](long long kt) -> unsigned { return (tsc_ptr && kt < tiles_k) ? __ldg(tsc_ptr + kt) : 0u; };
  auto decode = [&](long long kt, unsigned tsc) {
    const unsigned char* st = smem + (kt % kStages) * kStageBytes;
    unsigned char* bdst = bsm + (kt % C::kBBufs) * kBBytes;
    if constexpr (C::kBf16) {
      if (lane < 8 * kSPW) {
        const int s = lane >> 3, j = lane & 7;
        unsigned short v = 0;
        if (tsc_ptr) v = prefill::scaled_bf16(e4m3_to_float(st[C::kCbOff + (kSPW * warp + s) * 8 + j]), tsc);
        tab[s * 16 + j] = static_cast<unsigned char>(v & 0xff);
        tab[s * 16 + 8 + j] = static_cast<unsigned char>(v >> 8);
      }
      __syncwarp();
    }
#pragma unroll
    for (int s = 0; s < kSPW; ++s) {
      const int sl = kSPW * warp + s;
      const unsigned char* raw = st + C::kRawOff + sl * 192;
      const std::uint32_t X = *reinterpret_cast<const std::uint32_t*>(raw + 4 * lane);
      const std::uint32_t Y = *reinterpret_cast<const unsigned short*>(raw + 128 + 2 * lane);
      std::uint32_t sel[4];
      lane_selectors(X, Y, sel);
      if constexpr (C::kBf16) {
        // Store order (SW128): the lane holds row g, chunks t (selectors 0, 1) and 4 + t (2, 3). Lanes
        // with odd g store chunk 4 + t first (selector pairs swapped): a quarter warp (g = 2i, 2i+1,
        // t = 0..3) then writes physical chunks {t ^ 2i} and {(4 + t) ^ (2i+1)}, one of them
        // {0..3} and the other {4..7}: 8 different bank groups per store, conflict-free (without
        // the swap, {t ^ 2i} and {t ^ (2i+1)} overlap: 2-way, as in M64's decode).
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
        *reinterpret_cast<uint4*>(bdst + op_off<C>(8 * sl + g, 16 * (t + (odd ? 4 : 0)))) =
            make_uint4(o[0], o[1], o[2], o[3]);
        *reinterpret_cast<uint4*>(bdst + op_off<C>(8 * sl + g, 16 * (t + (odd ? 0 : 4)))) =
            make_uint4(o[4], o[5], o[6], o[7]);
      } else {
        uint2 cb = *reinterpret_cast<const uint2*>(st + C::kCbOff + sl * 8);
        if (!dec_ok[s]) cb = make_uint2(0u, 0u);
        const int d0 = op_off<C>(8 * sl + g, 8 * t);
        *reinterpret_cast<uint2*>(bdst + d0) =
            make_uint2(__byte_perm(cb.x, cb.y, sel[0]), __byte_perm(cb.x, cb.y, sel[1]));
        *reinterpret_cast<uint2*>(bdst + d0 + 2 * 128) =  // columns 32 + 8t..: 2 K chunks further
            make_uint2(__byte_perm(cb.x, cb.y, sel[2]), __byte_perm(cb.x, cb.y, sel[3]));
      }
    }
    if constexpr (C::kBf16) __syncwarp();  // the table is rewritten by the next decode
  };

  // ---- FP8 promotion scales: tile scales (lane i = lane & 7 loads slot 8wg + i's byte; broadcast by
  // shuffles) and the token rows' FP32 block scales, both one K-tile ahead.
  const unsigned char* sc_ptr = nullptr;
  if constexpr (!C::kBf16) {
    long long strip;
    bool ok;
    strip_of<kGemm1>(8 * wn + (lane & 7), nb, w.tiles_n, I, strip, ok);
    if (ok) sc_ptr = w.scale + (e * w.tiles_n + strip) * tiles_k;
  }
  auto load_sw = [&](long long kt) -> unsigned { return (sc_ptr && kt < tiles_k) ? __ldg(sc_ptr + kt) : 256u; };
  auto load_sa = [&](long long kt, float2 (&sa)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      sa[h] = (srow[h] && kt < tiles_k) ? __ldg(reinterpret_cast<const float2*>(srow[h]) + kt) : make_float2(0.f, 0.f);
  };

#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
  float d0[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d0[i] = 0.0f;
  float d1[C::kBf16 ? 1 : 32];
  if constexpr (!C::kBf16) {
#pragma unroll
    for (int i = 0; i < 32; ++i) d1[i] = 0.0f;
  }

  const unsigned long long da0 = smem_desc<C::kSbo, C::kSw128>(smem_s + wm * (64 * RB)),
                           db0 = smem_desc<C::kSbo, C::kSw128>(bsm_s + wn * (kBBytes / 2));
  if (C::kSw128 && (smem_s & 1023u)) __trap();  // the SW128 atoms need a 1024-aligned dynamic smem base

  // ---- prologue
#pragma unroll
  for (int s = 0; s < C::kLook; ++s) issue(s);
  unsigned sw_next = 256u, tsc_next = 0u;
  float2 sa_next[2] = {make_float2(0.f, 0.f), make_float2(0.f, 0.f)};
  if constexpr (C::kBf16) {
    tsc_next = load_tsc(0);
  } else {
    sw_next = load_sw(0);
    load_sa(0, sa_next);
  }
  prefill::cp_wait<C::kLook - 1>();
  __syncthreads();
  if constexpr (C::kBf16) {
    decode(0, tsc_next);
    tsc_next = load_tsc(1);
  } else {
    decode(0, 0u);
  }

  for (long long kt = 0; kt < tiles_k; ++kt) {
    prefill::cp_wait<C::kLook - 2>();  // stage kt+1 landed (own copies)
    fence_async_smem();
    __syncthreads();
    // stage (kt + kLook) % kStages: WB64/WB128 the one read by K-tile kt-1 (waited), WB128P kt-2
    // (kt-1's group may still be in flight)
    issue(kt + C::kLook);
    // descriptors advance in 16-byte units: stage kt's A, buffer kt&1's B; +256 bytes = 2 K chunks
    const unsigned long long da = da0 + static_cast<unsigned long long>((kt % kStages) * kStageBytes >> 4);
    const unsigned long long db = db0 + static_cast<unsigned long long>((kt % C::kBBufs) * kBBytes >> 4);
    if constexpr (C::kBf16) {
      const bool fresh = kt % prefill::kPromoteTiles == 0;
      const unsigned tsc = tsc_next;
      tsc_next = load_tsc(kt + 2);
      reg_fence(d0);
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
        wgmma_64x64x16_bf16(d0, da + kstep_desc<C::kSw128>(ks), db + kstep_desc<C::kSw128>(ks),
                            (ks == 0 && fresh) ? 0 : 1);
      wg_commit();
      if (kt + 1 < tiles_k) decode(kt + 1, tsc);  // into B[(kt+1) % kBBufs]: not read by a group in flight
      const bool promote = kt % prefill::kPromoteTiles == prefill::kPromoteTiles - 1 || kt + 1 == tiles_k;
      // kPipe: the pair's first group stays in flight; the next group accumulates into the same d0
      // (same-shape wgmma chains on one accumulator are ordered by the hardware, PTX ISA wgmma.fence).
      if (!C::kPipe || promote) {
        wg_wait0();
        reg_fence(d0);
      }
      if (promote) {
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = __fadd_rn(acc[i], d0[i]);
      }
    } else {
      const unsigned sw_b = sw_next;
      const float2 sa0 = sa_next[0], sa1 = sa_next[1];
      sw_next = load_sw(kt + 1);
      load_sa(kt + 1, sa_next);
      reg_fence(d0);
      reg_fence(d1);
      wg_fence();
      wgmma_64x64x32_e4m3(d0, da, db);
      wgmma_64x64x32_e4m3(d1, da + 16, db + 16);
      wg_commit();
      if (kt + 1 < tiles_k) decode(kt + 1, 0u);
      const float swf = sw_b == 256u ? 0.0f : ue8m0_f(sw_b);
      wg_wait0();
      reg_fence(d0);
      reg_fence(d1);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float sj = __shfl_sync(0xffffffffu, swf, j);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 sa = (r >> 1) ? sa1 : sa0;
          float v = d0[4 * j + r] * sa.x;
          v = fmaf(d1[4 * j + r], sa.y, v);
          acc[4 * j + r] = fmaf(v, sj, acc[4 * j + r]);
        }
      }
    }
  }
  prefill::cp_wait<0>();
}
#endif  // LUTB_PREFILL_SM90

#ifdef LUTB_PREFILL_SM90
/// GEMM1 epilogue of one consumer warpgroup wg (B rows 64wg..64wg+63 = slots 8wg..8wg+7 of N-block nb):
/// h = bf16(silu(gate) * up) -> MXFP8 (block amax over the 4 lanes of a row) -> hq (BF16 mxfp8_qdq(h)
/// when kBf16, else E4M3 bytes + FP32 scales in hsf). prow[h]: pair of the thread's token row h or -1.
template <bool kBf16>
__device__ __forceinline__ void epilogue_gemm1(const float (&acc)[32], int nb, int wg, const int (&prow)[2], int t,
                                               long long I, long long Ip, unsigned char* __restrict__ hq,
                                               float* __restrict__ hsf) {
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
      if constexpr (kBf16) {
        unsigned pk = 0;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float v = b == 255 ? __int_as_float(0x7fc00000) : mx_decode(mx_encode_dev(hv[q][c], b), b);
          pk |= static_cast<unsigned>(bf16_from_float(v)) << (16 * c);
        }
        *reinterpret_cast<unsigned*>(hq + (static_cast<long long>(p) * Ip + col) * 2) = pk;
      } else {
        unsigned pk = 0;
#pragma unroll
        for (int c = 0; c < 2; ++c) pk |= static_cast<unsigned>(b == 255 ? 0 : mx_encode_dev(hv[q][c], b)) << (8 * c);
        *reinterpret_cast<unsigned short*>(hq + static_cast<long long>(p) * Ip + col) = static_cast<unsigned short>(pk);
      }
    }
    if (!kBf16 && t == 0) hsf[static_cast<long long>(p) * (Ip / 32) + c0 / 32] = ue8m0_f(b);
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

/// xa (FP16 E4M3 values, natural column order) + xs (UE8M0) -> xq8 (E4M3 bytes) + xsf (FP32
/// 2^(b-127)). n8 = T * Hp / 8 groups of 8 values; the scales by the first thread of each block.
__global__ void __launch_bounds__(256)
    xa_to_fp8_kernel(const uint16_t* __restrict__ xa, const unsigned char* __restrict__ xs,
                     unsigned char* __restrict__ xq8, float* __restrict__ xsf, long long n8) {
  pdl_wait();  // xa, xs come from the MXFP8 of x (PDL rules: moe_kernels.cuh)
  pdl_trigger();
  const long long i = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= n8) return;
  const uint4 v = reinterpret_cast<const uint4*>(xa)[i];
  const unsigned u[4] = {v.x, v.y, v.z, v.w};
  unsigned o[2] = {0u, 0u};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    __half2_raw h2;
    h2.x = static_cast<unsigned short>(u[k] & 0xffffu);
    h2.y = static_cast<unsigned short>(u[k] >> 16);
    // Exact: the FP16 values are E4M3 values (quantize_x).
    const unsigned p = __nv_cvt_halfraw2_to_fp8x2(h2, __NV_SATFINITE, __NV_E4M3);
    o[k >> 1] |= (p & 0xffffu) << (16 * (k & 1));
  }
  reinterpret_cast<uint2*>(xq8)[i] = make_uint2(o[0], o[1]);
  if ((i & 3) == 0) xsf[i >> 2] = ue8m0_f(xs[i >> 2]);  // 32 values = 4 groups of 8 per block scale
}

/// GEMM1 + SiLU*up + MXFP8 of h. grid (Ip/64, token-tile slots), swapped when C::kTokFast.
///   FP8 (W64):   a = x as E4M3 bytes [T, Hp] with FP32 block scales asf [T, Hp/32]; hq [P, Ip] receives
///                h's E4M3 bytes and hsf [P, Ip/32] its FP32 block scales (2^(b-127), NaN for b = 255).
///   BF16 (WB64): a = mxfp8_qdq(x) as BF16 [T, Hp] (asf unused); hq [P, Ip] receives BF16
///                mxfp8_qdq(bf16(silu(g) * u)) (NaN for b = 255), hsf unused (as the M64 kernel).
/// Padded columns I..Ip-1 get zeros.
template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    wgmma_gemm1_kernel(LutbW w, const unsigned char* __restrict__ a, const float* __restrict__ asf, long long Hp,
                       Routing r, long long I, long long Ip, unsigned char* __restrict__ hq, float* __restrict__ hsf) {
#ifdef LUTB_PREFILL_SM90
  constexpr int EB = C::kBf16 ? 2 : 1;  // operand bytes
  pdl_wait();
  pdl_trigger();
  const int slot = cta_slot<C>();
  if (slot >= *r.num_tiles) return;
  const long long e = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2, wq = warp & 3;
  const int wn = wg & 1, wm = wg >> 1;  // B rows 64 wn.., token rows 64 wm.. (WB64: wm = 0)
  const int g = lane >> 2, t = lane & 3;
  const unsigned char* arow[C::kAQ];
#pragma unroll
  for (int q = 0; q < C::kAQ; ++q) {
    const int pa = prefill::pair_of(r, start, count, (tid + C::kThreads * q) / (C::kRowBytes / 16));
    arow[q] = pa >= 0 ? a + static_cast<long long>(pa / r.top_k) * Hp * EB : nullptr;
  }
  int prow[2];
  const float* srow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    prow[h] = prefill::pair_of(r, start, count, 64 * wm + 16 * wq + g + 8 * h);
    srow[h] = (!C::kBf16 && prow[h] >= 0) ? asf + static_cast<long long>(prow[h] / r.top_k) * (Hp / 32) : nullptr;
  }
  extern __shared__ __align__(1024) unsigned char smem[];
  float acc[32];
  cta_gemm90<C, true>(w, e, I, arow, a, srow, smem, acc);

  epilogue_gemm1<C::kBf16>(acc, cta_nblock<C>(), wn, prow, t, I, Ip, hq, hsf);
#else
  __trap();  // sm_90a only (launch_lutb_prefill_gemms refuses other devices)
#endif
}

/// GEMM2: y[p, n] = h[p] . w2[e, n] (FP32) for n < H. grid (ceil(H/8 / 16), token-tile slots), swapped
/// when C::kTokFast. hq/hsf as GEMM1 wrote them.
template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    wgmma_gemm2_kernel(LutbW w, const unsigned char* __restrict__ hq, const float* __restrict__ hsf, long long Ip,
                       Routing r, long long H, float* __restrict__ y) {
#ifdef LUTB_PREFILL_SM90
  constexpr int EB = C::kBf16 ? 2 : 1;
  pdl_wait();
  pdl_trigger();
  const int slot = cta_slot<C>();
  if (slot >= *r.num_tiles) return;
  const long long e = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, wg = warp >> 2, wq = warp & 3;
  const int wn = wg & 1, wm = wg >> 1;  // B rows 64 wn.., token rows 64 wm.. (WB64: wm = 0)
  const int g = lane >> 2, t = lane & 3;
  const unsigned char* arow[C::kAQ];
#pragma unroll
  for (int q = 0; q < C::kAQ; ++q) {
    const int pa = prefill::pair_of(r, start, count, (tid + C::kThreads * q) / (C::kRowBytes / 16));
    arow[q] = pa >= 0 ? hq + static_cast<long long>(pa) * Ip * EB : nullptr;
  }
  int prow[2];
  const float* srow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    prow[h] = prefill::pair_of(r, start, count, 64 * wm + 16 * wq + g + 8 * h);
    srow[h] = (!C::kBf16 && prow[h] >= 0) ? hsf + static_cast<long long>(prow[h]) * (Ip / 32) : nullptr;
  }
  extern __shared__ __align__(1024) unsigned char smem[];
  float acc[32];
  cta_gemm90<C, false>(w, e, 0, arow, hq, srow, smem, acc);
  epilogue_gemm2(acc, cta_nblock<C>(), wn, prow, t, H, y);
#else
  __trap();
#endif
}

// ===========================================================================================
// Warp-specialised BF16-fold variant (PrefillTile::WS64): 384 threads = warpgroup 0 the producer
// (cp.async of the A rows and raw tiles kLook K-tiles ahead, decode into B, mbarrier "full"),
// warpgroups 1, 2 the consumers (wait "full", 4 BF16 wgmma m64n64k16, wait, arrive "empty", promote
// every kPromoteTiles K-tiles). No CTA-wide barrier in the K loop: the producer runs ahead by the
// ring depth and the consumers only wait for data.
// Shared memory: A ring [kSA][64 rows x 128 B], raw ring [kSA][3200 B], B ring [2][128 rows x 128 B],
// per-producer-warp tables, mbarriers full[kSA], empty[kSA].
// ===========================================================================================
struct CfgWS {
  static constexpr int kThreads = 384;
  static constexpr int kSA = 6;    // A / raw ring depth (K-tiles)
  static constexpr int kLook = 4;  // producer: copies issued kLook K-tiles before their decode (<= kSA - 2)
  static constexpr int kRowBytes = 128;
  static constexpr int kABytes = kBM * kRowBytes;       // 8 KB
  static constexpr int kBBytes = kBN * kRowBytes;       // 16 KB
  static constexpr int kRawBytes = kStrips * 200;       // 16 x (192 index + 8 codebook bytes)
  static constexpr int kAOff = 0;
  static constexpr int kBOff = kAOff + kSA * kABytes;
  static constexpr int kRawOff = kBOff + 2 * kBBytes;
  static constexpr int kTabOff = kRawOff + kSA * kRawBytes;
  static constexpr int kBarOff = kTabOff + 4 * 4 * 16;  // 4 producer warps x 4 strips x 16 bytes
  static constexpr int kSmemBytes = kBarOff + 2 * kSA * 8;
  static_assert(kLook <= kSA - 2, "raw-slot reuse and a consumer stage need kLook <= kSA - 2");
  static_assert(kBarOff % 8 == 0 && kRawBytes % 16 == 0, "alignment");
  static_assert(kAOff % 1024 == 0 && kABytes % 1024 == 0 && kBOff % 1024 == 0 && kBBytes % 2048 == 0,
                "SW128 atoms 1024-aligned (A stages, each consumer's half of a B buffer)");
};

#ifdef LUTB_PREFILL_SM90
__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned addr) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}
/// Waits for the completion of the phase with parity `parity`; traps after 10 s (a broken pipeline
/// then fails loudly instead of hanging; legitimate waits are microseconds, also under a sanitizer).
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned parity) {
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
__device__ __forceinline__ void named_bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }

/// Producer warpgroup of the WS CTA (tid 0..127): see CfgWS.
template <bool kGemm1>
__device__ __forceinline__ void ws_producer(const LutbW& w, long long e, long long I, int nb,
                                            const unsigned char* const (&arow)[4], const unsigned char* a_base,
                                            unsigned char* smem, unsigned smem_s) {
  using C = CfgWS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long tiles_k = w.tiles_k;
  // copies: A chunks q = 0..3 (row (tid + 128q) / 8, chunk tid % 8); raw copy indices ci = tid and
  // tid + 128 (< 208): ci < 192 -> strip ci / 12, 16-byte chunk ci % 12; else codebook of strip ci - 192.
  int a_dst[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) a_dst[q] = sw128_off((tid + 128 * q) >> 3, (tid & 7) * 16);  // conflict-free
  const unsigned char* raw_src[2] = {nullptr, nullptr};
  int raw_dst[2] = {0, 0}, raw_kind[2] = {0, 0};
  long long raw_step[2] = {0, 0};
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int ci = tid + 128 * u;
    if (ci >= kStrips * 13) continue;
    const int sl = ci < kStrips * 12 ? ci / 12 : ci - kStrips * 12;
    long long strip;
    bool ok;
    strip_of<kGemm1>(sl, nb, w.tiles_n, I, strip, ok);
    if (!ok) continue;
    const long long tile0 = (e * w.tiles_n + strip) * tiles_k;
    if (ci < kStrips * 12) {
      raw_kind[u] = 1;
      raw_src[u] = w.packed + tile0 * 192 + (ci % 12) * 16;
      raw_step[u] = 192;
      raw_dst[u] = sl * 192 + (ci % 12) * 16;
    } else {
      raw_kind[u] = 2;
      raw_src[u] = w.codebook + tile0 * 8;
      raw_step[u] = 8;
      raw_dst[u] = kStrips * 192 + sl * 8;
    }
  }
  const unsigned full0 = smem_s + C::kBarOff, empty0 = full0 + 8 * C::kSA;
  auto issue = [&](long long kt) {
    const int sa = static_cast<int>(kt % C::kSA);
    if (kt >= C::kSA) mbar_wait(empty0 + 8 * sa, static_cast<unsigned>((kt / C::kSA - 1) & 1));
    const unsigned ast = smem_s + C::kAOff + sa * C::kABytes;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      prefill::cp16_zfill(ast + a_dst[q], arow[q] ? arow[q] + kt * 128 + (tid & 7) * 16 : a_base, arow[q] != nullptr);
    const unsigned rst = smem_s + C::kRawOff + sa * C::kRawBytes;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (raw_kind[u] == 1) prefill::cp16_zfill(rst + raw_dst[u], raw_src[u] + kt * raw_step[u], true);
      else if (raw_kind[u] == 2) prefill::cp8(rst + raw_dst[u], raw_src[u] + kt * raw_step[u]);
    }
  };
  // decode: warp decodes slots 4*warp .. 4*warp+3; table lane: strip 4*warp + (lane >> 3), entry lane & 7.
  const unsigned char* tsc_ptr = nullptr;
  bool tab_ok;
  {
    long long strip;
    strip_of<kGemm1>(4 * warp + (lane >> 3), nb, w.tiles_n, I, strip, tab_ok);
    if (tab_ok) tsc_ptr = w.scale + (e * w.tiles_n + strip) * tiles_k;
  }
  auto load_tsc = [&](long long kt) -> unsigned { return (tsc_ptr && kt < tiles_k) ? __ldg(tsc_ptr + kt) : 0u; };
  unsigned char* const tab = smem + C::kTabOff + warp * 64;
  const int g = lane >> 2;
  auto decode = [&](long long kd, unsigned tsc) {
    const int sa = static_cast<int>(kd % C::kSA);
    const unsigned char* raw = smem + C::kRawOff + sa * C::kRawBytes;
    {
      const int s = lane >> 3, j = lane & 7;
      unsigned short v = 0;  // invalid strips decode to zeros
      if (tsc_ptr) v = prefill::scaled_bf16(e4m3_to_float(raw[kStrips * 192 + (4 * warp + s) * 8 + j]), tsc);
      tab[s * 16 + j] = static_cast<unsigned char>(v & 0xff);
      tab[s * 16 + 8 + j] = static_cast<unsigned char>(v >> 8);
    }
    __syncwarp();
    unsigned char* bdst = smem + C::kBOff + static_cast<int>(kd & 1) * C::kBBytes;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int sl = 4 * warp + s;
      const unsigned char* rt = raw + sl * 192;
      const std::uint32_t X = *reinterpret_cast<const std::uint32_t*>(rt + 4 * lane);
      const std::uint32_t Y = *reinterpret_cast<const unsigned short*>(rt + 128 + 2 * lane);
      std::uint32_t sel[4];
      lane_selectors(X, Y, sel);
      const bool odd = g & 1;  // store order as cta_gemm90's decode: conflict-free in SW128
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
        o[2 * q] = __byte_perm(lo, hi, 0x5140);
        o[2 * q + 1] = __byte_perm(lo, hi, 0x7362);
      }
      const int t = lane & 3;
      *reinterpret_cast<uint4*>(bdst + sw128_off(8 * sl + g, 16 * (t + (odd ? 4 : 0)))) =
          make_uint4(o[0], o[1], o[2], o[3]);
      *reinterpret_cast<uint4*>(bdst + sw128_off(8 * sl + g, 16 * (t + (odd ? 0 : 4)))) =
          make_uint4(o[4], o[5], o[6], o[7]);
    }
    __syncwarp();  // the table is rewritten by the next decode
  };

  unsigned tsc0 = load_tsc(0), tsc1 = load_tsc(1);
  for (long long kt = 0; kt < tiles_k + C::kLook; ++kt) {
    if (kt < tiles_k) issue(kt);
    prefill::cp_commit();  // one group per iteration (possibly empty): group kd is complete below
    const long long kd = kt - C::kLook;
    if (kd >= 0) {
      prefill::cp_wait<C::kLook>();
      named_bar_sync(1, 128);  // every producer's copies of K-tile kd have landed
      // B buffer kd & 1 was read by the consumers' K-tile kd - 2: wait for its release.
      if (kd >= 2) {
        const long long ko = kd - 2;
        mbar_wait(empty0 + 8 * static_cast<int>(ko % C::kSA), static_cast<unsigned>((ko / C::kSA) & 1));
      }
      decode(kd, tsc0);
      tsc0 = tsc1;
      tsc1 = load_tsc(kd + 2);
      fence_async_smem();  // this thread's cp.async A data and decoded B -> visible to wgmma
      mbar_arrive(full0 + 8 * static_cast<int>(kd % C::kSA));
    }
  }
  prefill::cp_wait<0>();
}

/// Consumer warpgroup cw (0, 1) of the WS CTA: acc as cta_gemm90 (B rows 64cw..64cw+63).
__device__ __forceinline__ void ws_consumer(long long tiles_k, int cw, unsigned smem_s, float (&acc)[32]) {
  using C = CfgWS;
  const unsigned full0 = smem_s + C::kBarOff, empty0 = full0 + 8 * C::kSA;
  const unsigned long long da0 = smem_desc<8 * C::kRowBytes, true>(smem_s + C::kAOff),
                           db0 = smem_desc<8 * C::kRowBytes, true>(smem_s + C::kBOff + cw * (C::kBBytes / 2));
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  for (long long kt = 0; kt < tiles_k; ++kt) {
    const int sa = static_cast<int>(kt % C::kSA);
    mbar_wait(full0 + 8 * sa, static_cast<unsigned>((kt / C::kSA) & 1));
    const unsigned long long da = da0 + static_cast<unsigned long long>((sa * C::kABytes) >> 4);
    const unsigned long long db = db0 + static_cast<unsigned long long>((static_cast<int>(kt & 1) * C::kBBytes) >> 4);
    const bool fresh = kt % prefill::kPromoteTiles == 0;
    reg_fence(d);
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      wgmma_64x64x16_bf16(d, da + kstep_desc<true>(ks), db + kstep_desc<true>(ks), (ks == 0 && fresh) ? 0 : 1);
    wg_commit();
    wg_wait0();
    reg_fence(d);
    mbar_arrive(empty0 + 8 * sa);
    if (kt % prefill::kPromoteTiles == prefill::kPromoteTiles - 1 || kt + 1 == tiles_k) {
#pragma unroll
      for (int i = 0; i < 32; ++i) acc[i] = __fadd_rn(acc[i], d[i]);
    }
  }
}

/// Shared prologue of the WS kernels: barrier init (thread 0), then the role split.
__device__ __forceinline__ void ws_init(unsigned smem_s) {
  using C = CfgWS;
  if (smem_s & 1023u) __trap();  // the SW128 atoms need a 1024-aligned dynamic smem base
  if (threadIdx.x == 0) {
    for (int i = 0; i < C::kSA; ++i) {
      mbar_init(smem_s + C::kBarOff + 8 * i, 128);                // full: the 128 producer threads
      mbar_init(smem_s + C::kBarOff + 8 * (C::kSA + i), 256);     // empty: the 256 consumer threads
    }
  }
  __syncthreads();
}
#endif  // LUTB_PREFILL_SM90

/// WS GEMM1 (BF16 fold): as wgmma_gemm1_kernel<Cfg90Bf> (a = BF16 mxfp8_qdq(x), hq BF16), grid (Ip/64, slots).
__global__ void __launch_bounds__(CfgWS::kThreads, 2)
    ws_gemm1_kernel(LutbW w, const unsigned char* __restrict__ a, long long Hp, Routing r, long long I, long long Ip,
                    unsigned char* __restrict__ hq) {
#ifdef LUTB_PREFILL_SM90
  pdl_wait();
  pdl_trigger();
  const int slot = blockIdx.y, nb = blockIdx.x;
  if (slot >= *r.num_tiles) return;
  const long long e = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  extern __shared__ __align__(1024) unsigned char smem[];
  const unsigned smem_s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  ws_init(smem_s);
  const int tid = threadIdx.x;
  if (tid < 128) {
    const unsigned char* arow[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int pa = prefill::pair_of(r, start, count, (tid + 128 * q) >> 3);
      arow[q] = pa >= 0 ? a + static_cast<long long>(pa / r.top_k) * Hp * 2 : nullptr;
    }
    ws_producer<true>(w, e, I, nb, arow, a, smem, smem_s);
  } else {
    const int ct = tid - 128, cw = ct >> 7, wq = (ct >> 5) & 3, lane = ct & 31;
    float acc[32];
    ws_consumer(w.tiles_k, cw, smem_s, acc);
    int prow[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) prow[h] = prefill::pair_of(r, start, count, 16 * wq + (lane >> 2) + 8 * h);
    epilogue_gemm1<true>(acc, nb, cw, prow, lane & 3, I, Ip, hq, nullptr);
  }
#else
  __trap();
#endif
}

/// WS GEMM2 (BF16 fold): as wgmma_gemm2_kernel<Cfg90Bf>, grid (ceil(H/8 / 16), slots).
__global__ void __launch_bounds__(CfgWS::kThreads, 2)
    ws_gemm2_kernel(LutbW w, const unsigned char* __restrict__ hq, long long Ip, Routing r, long long H,
                    float* __restrict__ y) {
#ifdef LUTB_PREFILL_SM90
  pdl_wait();
  pdl_trigger();
  const int slot = blockIdx.y, nb = blockIdx.x;
  if (slot >= *r.num_tiles) return;
  const long long e = r.tile_expert[slot];
  const int start = r.tile_start[slot], count = r.tile_count[slot];
  extern __shared__ __align__(1024) unsigned char smem[];
  const unsigned smem_s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  ws_init(smem_s);
  const int tid = threadIdx.x;
  if (tid < 128) {
    const unsigned char* arow[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int pa = prefill::pair_of(r, start, count, (tid + 128 * q) >> 3);
      arow[q] = pa >= 0 ? hq + static_cast<long long>(pa) * Ip * 2 : nullptr;
    }
    ws_producer<false>(w, e, 0, nb, arow, hq, smem, smem_s);
  } else {
    const int ct = tid - 128, cw = ct >> 7, wq = (ct >> 5) & 3, lane = ct & 31;
    float acc[32];
    ws_consumer(w.tiles_k, cw, smem_s, acc);
    int prow[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) prow[h] = prefill::pair_of(r, start, count, 16 * wq + (lane >> 2) + 8 * h);
    epilogue_gemm2(acc, nb, cw, prow, lane & 3, H, y);
  }
#else
  __trap();
#endif
}

}  // namespace lutb::cuda::kern::prefill90
