// src/cuda/moe/sm90_lutb_moe_prefill_rs.cuh: the sm_90a warp-specialised prefill GEMMs with the
// weights as wgmma's register operand (sm90_lutb_moe_prefill_rs_gemm1, sm90_lutb_moe_prefill_rs_gemm2,
// sm90_lutb_moe_prefill_rs_xa_to_bf16), launched by lutb_moe_prefill.cu when the plan's prefill kernel
// is Sm90WgmmaRs64 / Sm90WgmmaRs128 (heuristics::prefill_kernel; MoeOptions::prefill forces it).
// Everything device-side is compiled for sm_90a only (__CUDA_ARCH_FEAT_SM90_ALL; __trap otherwise).
//
// Swap-AB: the weights are wgmma's M operand from registers (m64nNk16.f32.bf16.bf16, "RS"), the
// tile's tokens its N operand (N = kBN = 64 or 128) from shared memory.
//   CTA: 384 threads = 3 warpgroups. Warpgroup 0 is the producer (setmaxnreg down): its 128 threads
//     gather the tile's token rows (cp.async 16 B, 128B swizzle) and the 16 row-strips' raw LUT-B
//     tiles + codebooks of K-tile kt into ring stage kt % kStages; each thread then arms the stage's
//     full mbarrier with cp.async.mbarrier.arrive.noinc (count 128: it completes when every copy of
//     the stage has landed). Warpgroups 1, 2 are consumers (setmaxnreg up), 64 weight rows each:
//     warp w of consumer warpgroup c owns weight rows 16w..16w+15 of its 64 = two LUT-B row-strips
//     (GEMM1: the gate strip of I-columns 64 nb + 32 c + 8 w .. +7 as rows 0..7 and the matching up
//     strip as rows 8..15, so one thread holds gate and up of the same (column, token)).
//   Register A fragment = mma.sync m16n8k16's A layout per warp, which the lane-major decode gives
//     directly (lutb/cuda/lane_major.hpp): lane (g, t) decodes its 16 indices of row g of each strip
//     with 4 PRMT selectors into the tile's scaled BF16 lo/hi byte tables; step s of the K-tile takes
//     its slots 4s..4s+3. So the k16 step s of K-tile kt multiplies logical k = 16 s + i with the
//     weight column rs_col(16 s + i) of the tile; the activations are stored in that order (every
//     64-column block of a and h permuted by rs_col: sm90_lutb_moe_prefill_rs_xa_to_bf16 for x,
//     GEMM1's epilogue for h), so the products are those of the natural order.
//   Consumer K-step kt: wgmma of K-tile kt (4 x k16, async) from A registers buffer kt & 1; while it
//     runs, wait for stage kt+1, build the scaled tables, decode K-tile kt+1 into the other buffer;
//     after odd kt (and after the last K-tile of an odd tiles_k), wait for the groups and add their
//     tensor-core sum to the FP32 accumulators with round-to-nearest adds (the WB tiles' 128-column
//     promotion, sm80_lutb_moe_prefill.cuh kPromoteTiles). A stage is released (empty mbarrier, one
//     arrive per consumer warp) once the wgmma that read it has completed.
//   Persistent: grid = min(SMs, work items); CTA b takes items b, b + grid, ...; item i = token-tile
//     slot i / nblocks, weight block i % nblocks: CTAs running together share a token tile (read
//     from L2 by all weight blocks) and the expert's weights. The ring runs on across items, so the
//     producer prefetches the next item's first stages during the consumers' epilogue.
//
// Numerics (spec section 4): the WB tiles' operands (both power-of-two scales folded into exact BF16,
// sm80_lutb_moe_prefill.cuh scaled_bf16; exact for scale bytes 3..246 and block scales >= 10), FP32
// accumulation of exact products, 128-column tensor-core partial sums promoted with round-to-nearest
// adds; h = bf16(silu(g) u) and its MXFP8 block as the WB tiles. The 16 columns of one k16 step are
// columns {b..b+3, b+8..b+11, b+16..b+19, b+24..b+27} (b = 4 (s & 1) + 32 (s >> 1)) instead of 16
// consecutive ones, so the tensor core's internal sums group the products differently: equal to the
// WB tiles up to FP32 addition order, not bit for bit.
#pragma once

#include <type_traits>

#include "cuda/moe/sm90_lutb_moe_prefill_wgmma.cuh"

namespace lutb::cuda::kern::prefill90rs {

/// Column (0..63) of a K-tile that logical position L (0..63: k16 step L / 16, k L % 16) multiplies
/// (the lane-major slots of the A fragment: k 2t + u <- slot 4s + u, k 8 + 2t + u <- slot 4s + 2 + u).
__host__ __device__ constexpr int rs_col(int L) {
  const int s = L >> 4, k = L & 15, t = (k & 7) >> 1, j = 4 * s + 2 * (k >> 3) + (k & 1);
  return lane_col(t, j);
}
/// Inverse of rs_col: the logical position of column c.
__host__ __device__ constexpr int rs_pos(int c) {
  const int half = c >> 5, t = (c & 31) >> 3, jj = c & 7, s = (jj >> 2) + 2 * half, r = jj & 3;
  return 16 * s + 8 * (r >> 1) + 2 * t + (r & 1);
}
namespace detail_check {
constexpr bool rs_perm_ok() {
  for (int L = 0; L < 64; ++L)
    if (rs_pos(rs_col(L)) != L || rs_col(L) < 0 || rs_col(L) > 63) return false;
  // A 32-column MXFP8 block stays in its half (GEMM1's epilogue writes each block's 64 bytes).
  for (int c = 0; c < 64; ++c)
    if ((rs_pos(c) >> 5) != (c >> 5)) return false;
  return true;
}
}  // namespace detail_check
static_assert(detail_check::rs_perm_ok() && rs_col(0) == 0 && rs_col(1) == 1 && rs_col(2) == 8 && rs_col(8) == 2 &&
                  rs_col(16) == 4 && rs_col(32) == 32,
              "rs_col / rs_pos: a permutation of each 64-column block, blocks of 32 kept");

/// Configuration of the kernels with kBN token rows per tile (the grouping's tile rows).
template <int BN_>
struct CfgRs {
  static constexpr int kBN = BN_;
  static constexpr int kThreads = 384;                         // producer + 2 consumer warpgroups
  static constexpr int kStrips = 16;                           // 128 weight rows
  static constexpr int kStages = BN_ == 64 ? 8 : 6;
  static constexpr int kTokBytes = BN_ * 128;                  // [kBN rows][64 BF16], SW128
  static constexpr int kRawOff = kTokBytes;                    // 16 x 192 lane-major index bytes
  static constexpr int kCbOff = kRawOff + kStrips * 192;       // 16 x 8 codebook bytes
  static constexpr int kStageBytes = (kCbOff + kStrips * 8 + 1023) / 1024 * 1024;
  static constexpr int kHRow = 34;                             // h staging row: 32 BF16 + 2 (banks)
  static constexpr int kEpiOff = kStages * kStageBytes;        // per consumer warpgroup [kBN][kHRow] BF16
  static constexpr int kEpiBytes = 2 * BN_ * kHRow * 2;
  static constexpr int kTabOff = kEpiOff + kEpiBytes;          // per consumer warp 2 x [2 strips][lo 8, hi 8]
  static constexpr int kBarOff = (kTabOff + 8 * 64 + 7) / 8 * 8;
  static constexpr int kSmemBytes = kBarOff + 2 * kStages * 8;
  static constexpr int kTokChunks = BN_ * 8 / 128;             // 16-byte token chunks per producer thread
  // setmaxnreg.inc waits until the registers it asks for are free: the two roles' totals must fit
  // in what the launch allocated (384 threads x 168, __launch_bounds__(384, 1)), or the consumers
  // would wait for ever. The producer's few spills sit outside the consumers' mainloop.
  static constexpr int kLaunchRegs = 168;
  static constexpr int kProducerRegs = 56, kConsumerRegs = 224;
  static_assert(BN_ == 64 || BN_ == 128, "64 or 128 token rows");
  static_assert(kStageBytes % 1024 == 0 && kTokBytes % 1024 == 0, "SW128 atoms 1024-aligned");
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * kLaunchRegs, "the launch's registers");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
};
using CfgRs64 = CfgRs<64>;
using CfgRs128 = CfgRs<128>;

/// The arguments both GEMMs share.
struct RsArgs {
  LutbW w;
  const unsigned char* act;  // BF16 rows, each 64-column block in rs_col order
  long long act_row_bytes;   // bytes between two activation rows
  bool act_by_token;         // row = pair / top_k (GEMM1: x) or pair (GEMM2: h)
  Routing r;
  long long I;               // GEMM1: intermediate size (strip map); GEMM2: unused
  int nblocks;               // weight blocks of 128 rows
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LUTB_PREFILL_RS_SM90 1
#endif

#ifdef LUTB_PREFILL_RS_SM90
using prefill90::sw128_off;

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra LAB_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
/// Arrives on bar when all of this thread's earlier cp.async have completed (no pending-count increment).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

#define LUTB_RS_D32(o)                                                                                            \
  "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), \
      "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), "+f"(d[o + 12]),          \
      "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15]), "+f"(d[o + 16]), "+f"(d[o + 17]), "+f"(d[o + 18]),       \
      "+f"(d[o + 19]), "+f"(d[o + 20]), "+f"(d[o + 21]), "+f"(d[o + 22]), "+f"(d[o + 23]), "+f"(d[o + 24]),       \
      "+f"(d[o + 25]), "+f"(d[o + 26]), "+f"(d[o + 27]), "+f"(d[o + 28]), "+f"(d[o + 29]), "+f"(d[o + 30]),       \
      "+f"(d[o + 31])

/// d (+)= A[64 x 16] (registers a[4S..4S+3], mma.sync A layout per warp) . B[N x 16]^T (shared memory,
/// descriptor db, K-major); scale_d = 0: d is overwritten.
template <int S>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const unsigned (&a)[16], unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,"
      "%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : LUTB_RS_D32(0)
      : "r"(a[4 * S]), "r"(a[4 * S + 1]), "r"(a[4 * S + 2]), "r"(a[4 * S + 3]), "l"(db), "r"(scale_d));
}
template <int S>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const unsigned (&a)[16], unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,"
      "%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,"
      "%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
      : LUTB_RS_D32(0), LUTB_RS_D32(32)
      : "r"(a[4 * S]), "r"(a[4 * S + 1]), "r"(a[4 * S + 2]), "r"(a[4 * S + 3]), "l"(db), "r"(scale_d));
}
#undef LUTB_RS_D32

template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N>
__device__ __forceinline__ void reg_fence_u(unsigned (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

/// Slot sl (0..15) of weight block nb -> global row-strip and validity. Slot 2q + h belongs to
/// consumer warp q (warpgroup q / 4, warp q % 4), rows 8h..8h+7 of its 16.
///   GEMM1: gate (h = 0) / up (h = 1) strip of I-columns 64 nb + 8 q .. +7.
///   GEMM2: strip 16 nb + sl.
template <bool kGemm1>
__device__ __forceinline__ void rs_strip(int sl, int nb, long long tiles_n, long long I, long long& strip, bool& ok) {
  if constexpr (kGemm1) {
    const long long col = 64ll * nb + 8 * (sl >> 1);
    ok = col < I;
    strip = ((sl & 1) ? I / 8 : 0) + col / 8;
  } else {
    strip = 16ll * nb + sl;
    ok = strip < tiles_n;
  }
}

/// Producer warpgroup (128 threads, ptid = 0..127): fills the ring for every work item of the CTA.
template <class C, bool kGemm1>
__device__ __forceinline__ void rs_producer(const RsArgs& a, unsigned char* smem, int ptid) {
  const unsigned smem_s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned full0 = smem_s + C::kBarOff, empty0 = full0 + 8 * C::kStages;
  const long long tiles_k = a.w.tiles_k;
  const int items = *a.r.num_tiles * a.nblocks;
  const int chunk = ptid & 7;
  int tok_dst[C::kTokChunks];
#pragma unroll
  for (int q = 0; q < C::kTokChunks; ++q) tok_dst[q] = sw128_off((ptid >> 3) + 16 * q, 16 * chunk);
  unsigned it = 0;  // K-tiles issued by this CTA so far (ring position)
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int slot = item / a.nblocks, nb = item - slot * a.nblocks;
    const long long e = a.r.tile_expert[slot];
    const int start = a.r.tile_start[slot], count = a.r.tile_count[slot];
    const unsigned char* tok_src[C::kTokChunks];
#pragma unroll
    for (int q = 0; q < C::kTokChunks; ++q) {
      const int p = prefill::pair_of(a.r, start, count, (ptid >> 3) + 16 * q);
      tok_src[q] = p < 0 ? nullptr
                         : a.act + static_cast<long long>(a.act_by_token ? p / a.r.top_k : p) * a.act_row_bytes +
                               16 * chunk;
    }
    // Raw jobs j = ptid and ptid + 128 (< 208): 16-byte chunk j % 12 of slot j / 12's packed tile,
    // or (j >= 192) slot j - 192's codebook.
    const unsigned char* raw_src[2] = {nullptr, nullptr};
    int raw_dst[2] = {0, 0};
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int j = ptid + 128 * u;
      if (j >= 208) continue;
      const int sl = j < 192 ? j / 12 : j - 192;
      long long strip;
      bool ok;
      rs_strip<kGemm1>(sl, nb, a.w.tiles_n, a.I, strip, ok);
      if (!ok) continue;
      const long long tile0 = (e * a.w.tiles_n + strip) * tiles_k;
      if (j < 192) {
        raw_src[u] = a.w.packed + tile0 * 192 + (j % 12) * 16;
        raw_dst[u] = C::kRawOff + sl * 192 + (j % 12) * 16;
      } else {
        raw_src[u] = a.w.codebook + tile0 * 8;
        raw_dst[u] = C::kCbOff + sl * 8;
      }
    }
    for (long long kt = 0; kt < tiles_k; ++kt, ++it) {
      const unsigned stage = it % C::kStages;
      mbar_wait(empty0 + 8 * stage, ((it / C::kStages) & 1) ^ 1);  // a fresh barrier passes parity 1
      const unsigned st = smem_s + stage * C::kStageBytes;
#pragma unroll
      for (int q = 0; q < C::kTokChunks; ++q)
        prefill::cp16_zfill(st + tok_dst[q], tok_src[q] ? tok_src[q] + kt * 128 : a.act, tok_src[q] != nullptr);
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (!raw_src[u]) continue;
        if (ptid + 128 * u < 192) prefill::cp16_zfill(st + raw_dst[u], raw_src[u] + kt * 192, true);
        else prefill::cp8(st + raw_dst[u], raw_src[u] + kt * 8);
      }
      cp_async_mbar_arrive(full0 + 8 * stage);
    }
  }
  prefill::cp_wait<0>();
}

/// Consumer warp's tables for one K-tile (lanes 0..15: strip h = lane >> 3, entry lane & 7) into
/// table buffer tb (32 bytes), from the stage's codebook bytes and the tile scale byte tsc.
template <class C>
__device__ __forceinline__ void rs_tables(const unsigned char* st, unsigned char* tb, int q, int lane, bool valid,
                                          unsigned tsc) {
  if (lane < 16) {
    const int h = lane >> 3, j = lane & 7;
    unsigned short v = 0;  // invalid strips decode to zeros
    if (valid) v = prefill::scaled_bf16(e4m3_to_float(st[C::kCbOff + (2 * q + h) * 8 + j]), tsc);
    tb[h * 16 + j] = static_cast<unsigned char>(v & 0xff);
    tb[h * 16 + 8 + j] = static_cast<unsigned char>(v >> 8);
  }
  __syncwarp();
}

/// The warp's A fragments of one K-tile: a[4s + 0..3] = step s's (row g, k 2t..), (row g + 8, k 2t..),
/// (row g, k 2t + 8..), (row g + 8, k 2t + 8..); rows 0..7 = slot 2q, rows 8..15 = slot 2q + 1.
template <class C>
__device__ __forceinline__ void rs_decode(const unsigned char* st, const unsigned char* tb, int q, int lane,
                                          unsigned (&a)[16]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const unsigned char* raw = st + C::kRawOff + (2 * q + h) * 192;
    const std::uint32_t X = *reinterpret_cast<const std::uint32_t*>(raw + 4 * lane);
    const std::uint32_t Y = *reinterpret_cast<const unsigned short*>(raw + 128 + 2 * lane);
    std::uint32_t sel[4];
    lane_selectors(X, Y, sel);
    const uint2 tl = *reinterpret_cast<const uint2*>(tb + h * 16);
    const uint2 th = *reinterpret_cast<const uint2*>(tb + h * 16 + 8);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const unsigned lo = __byte_perm(tl.x, tl.y, sel[s]);
      const unsigned hi = __byte_perm(th.x, th.y, sel[s]);
      a[4 * s + h] = __byte_perm(lo, hi, 0x5140);      // slots 4s, 4s+1 -> k 2t, 2t+1
      a[4 * s + 2 + h] = __byte_perm(lo, hi, 0x7362);  // slots 4s+2, 4s+3 -> k 2t+8, 2t+9
    }
  }
}

/// Consumer mainloop of one work item: acc[4j + 2h + c] = weight row 16 w + 8 h + g of the
/// warpgroup's 64, token row 8 j + 2 t + c (wgmma D layout), summed over K = 64 tiles_k.
/// it: ring position (K-tiles consumed so far), advanced by tiles_k.
///
/// The loop runs over pairs of K-tiles (one 128-column promotion each) and drains the wgmma groups
/// before every path leaves it, so ptxas can see that no register it reads or writes outside a
/// wgmma is still in flight (else it serialises with an injected warpgroup.wait, C7517):
///   d: read only after wait_group 0 (promotion), written only by wgmma;
///   A buffer a0 is decoded only while no group or only the group of a1 is in flight, a1 only when
///   none is; reg_fence keeps the compiler from moving those accesses across the wgmma fence/wait.
template <class C, int NACC>
__device__ __forceinline__ void rs_mainloop(unsigned char* smem, unsigned char* tabw, int q, int lane, bool valid,
                                            const unsigned char* tsc_ptr, long long tiles_k, unsigned& it,
                                            float (&acc)[NACC]) {
  const unsigned smem_s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const unsigned full0 = smem_s + C::kBarOff, empty0 = full0 + 8 * C::kStages;
  const unsigned long long db0 = prefill90::smem_desc<1024, true>(smem_s);
  auto load_tsc = [&](long long kt) -> unsigned { return (tsc_ptr && kt < tiles_k) ? __ldg(tsc_ptr + kt) : 0u; };
  auto stage_of = [&](long long kt) -> unsigned { return (it + static_cast<unsigned>(kt)) % C::kStages; };
  auto release = [&](long long kt) {
    if (lane == 0) mbar_arrive(empty0 + 8 * stage_of(kt));
  };
  unsigned tsc_cur = load_tsc(0), tsc_next = load_tsc(1);  // scale bytes of the next two K-tiles to decode
  // K-tile kt (< tiles_k) into A buffer a: wait for its stage, build the scaled tables (buffer kt & 1:
  // lanes that still read the other buffer's tables never race the writes), decode.
  auto decode = [&](long long kt, unsigned(&a)[16]) {
    const unsigned pos = it + static_cast<unsigned>(kt);
    mbar_wait(full0 + 8 * (pos % C::kStages), (pos / C::kStages) & 1);
    prefill90::fence_async_smem();  // the cp.async (generic proxy) writes, seen by wgmma (async proxy)
    const unsigned char* st = smem + (pos % C::kStages) * C::kStageBytes;
    unsigned char* tb = tabw + 32 * (kt & 1);
    rs_tables<C>(st, tb, q, lane, valid, tsc_cur);
    rs_decode<C>(st, tb, q, lane, a);
    tsc_cur = tsc_next;
    tsc_next = load_tsc(kt + 2);
    reg_fence_u(a);
  };
  float d[NACC];
  // The four k16 steps of K-tile kt from A buffer a as one wgmma group; fresh: the first overwrites d.
  auto issue = [&](long long kt, const unsigned(&a)[16], bool fresh) {
    const unsigned long long db = db0 + ((stage_of(kt) * C::kStageBytes) >> 4);
    prefill90::wg_fence();
    wgmma_rs<0>(d, a, db, fresh ? 0 : 1);
    wgmma_rs<1>(d, a, db + 2, 1);
    wgmma_rs<2>(d, a, db + 4, 1);
    wgmma_rs<3>(d, a, db + 6, 1);
    prefill90::wg_commit();
  };
  auto promote = [&] {
    reg_fence(d);
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = __fadd_rn(acc[i], d[i]);
  };
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < NACC; ++i) d[i] = 0.0f;
  unsigned a0[16], a1[16];

  if (tiles_k > 0) decode(0, a0);  // no K-tile: the producer fills no stage to wait for
  long long kt = 0;
  for (; kt + 2 <= tiles_k; kt += 2) {
    // In: a0 = K-tile kt, no group in flight.
    reg_fence(d);
    issue(kt, a0, true);
    decode(kt + 1, a1);  // while K-tile kt runs
    issue(kt + 1, a1, false);
    wg_wait<1>();  // K-tile kt done: its stage and a0 are free
    release(kt);
    if (kt + 2 < tiles_k) decode(kt + 2, a0);  // while K-tile kt+1 runs
    wg_wait<0>();
    release(kt + 1);
    promote();
  }
  if (kt < tiles_k) {  // odd tiles_k: the last K-tile (in a0) is a 64-column promotion of its own
    reg_fence(d);
    issue(kt, a0, true);
    wg_wait<0>();
    release(kt);
    promote();
  }
  it += static_cast<unsigned>(tiles_k);
}
#endif  // LUTB_PREFILL_RS_SM90

/// The common kernel body: roles, barriers, work loop; Epi(acc, slot, nb, start, count) per item.
template <class C, bool kGemm1, class Epi>
__device__ __forceinline__ void rs_kernel_body(const RsArgs& a, unsigned char* smem, Epi&& epi) {
#ifdef LUTB_PREFILL_RS_SM90
  const int tid = threadIdx.x, wg = tid >> 7;
  const unsigned smem_s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (smem_s & 1023u) __trap();  // the SW128 atoms need a 1024-aligned dynamic smem base
  if (tid == 0) {
    for (int s = 0; s < C::kStages; ++s) {
      mbar_init(smem_s + C::kBarOff + 8 * s, 128);                 // full: the producer threads
      mbar_init(smem_s + C::kBarOff + 8 * (C::kStages + s), 8);    // empty: the consumer warps
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wg == 0) {
    setmaxnreg_dec<C::kProducerRegs>();
    rs_producer<C, kGemm1>(a, smem, tid);
    return;
  }
  setmaxnreg_inc<C::kConsumerRegs>();
  const int cw = (tid - 128) >> 5, lane = tid & 31;  // consumer warp 0..7 = slot pair q
  unsigned char* const tabw = smem + C::kTabOff + cw * 64;
  const long long tiles_k = a.w.tiles_k;
  const int items = *a.r.num_tiles * a.nblocks;
  unsigned it = 0;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int slot = item / a.nblocks, nb = item - slot * a.nblocks;
    const long long e = a.r.tile_expert[slot];
    // The table lanes' strip (lane >> 3 of the warp's two) and its scale bytes.
    long long strip;
    bool valid;
    rs_strip<kGemm1>(2 * cw + ((lane >> 3) & 1), nb, a.w.tiles_n, a.I, strip, valid);
    const unsigned char* tsc_ptr = (valid && lane < 16) ? a.w.scale + (e * a.w.tiles_n + strip) * tiles_k : nullptr;
    float acc[C::kBN / 2];
    rs_mainloop<C>(smem, tabw, cw, lane, valid, tsc_ptr, tiles_k, it, acc);
    epi(acc, slot, nb);
  }
#else
  (void)a;
  (void)smem;
  (void)epi;
  __trap();  // sm_90a only (launch_lutb_prefill_gemms refuses other devices)
#endif
}

/// a = mxfp8_qdq(x) as BF16 in rs_col order, in place over xa (FP16 E4M3 values in natural column
/// order, block scales xs): one thread per 64-column block of one token. n64 = T * Hp / 64.
__global__ void __launch_bounds__(256)
    sm90_lutb_moe_prefill_rs_xa_to_bf16(uint16_t* __restrict__ xa, const unsigned char* __restrict__ xs,
                                        long long n64, long long Hp) {
  pdl_wait();  // xa, xs come from the MXFP8 of x (PDL rules: lutb_moe_device.cuh)
  pdl_trigger();
  const long long i = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
  if (i >= n64) return;
  const long long tok = (i * 64) / Hp, col0 = i * 64 - tok * Hp;
  const unsigned b0 = xs[tok * (Hp / 32) + col0 / 32], b1 = xs[tok * (Hp / 32) + col0 / 32 + 1];
  uint4* p = reinterpret_cast<uint4*>(xa) + i * 8;
  unsigned short v[64];
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const uint4 u = p[q];
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[8 * q + 2 * k] = static_cast<unsigned short>(w[k] & 0xffffu);
      v[8 * q + 2 * k + 1] = static_cast<unsigned short>(w[k] >> 16);
    }
  }
  unsigned o[32];
#pragma unroll
  for (int m = 0; m < 32; ++m) {
    unsigned pk = 0;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = rs_col(2 * m + u);
      const float f = __half2float(__ushort_as_half(v[c]));
      pk |= static_cast<unsigned>(prefill::scaled_bf16(f, c < 32 ? b0 : b1)) << (16 * u);
    }
    o[m] = pk;
  }
#pragma unroll
  for (int q = 0; q < 8; ++q) p[q] = make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
}

/// GEMM1 + SiLU*up + MXFP8 of h. Persistent grid; items = token-tile slots x Ip / 64 weight blocks.
/// a: BF16 mxfp8_qdq(x) [T, Hp] in rs_col order; hq [P, Ip]: BF16 mxfp8_qdq(bf16(silu(g) u)) in
/// rs_col order (NaN for b = 255), zeros in the padded columns I..Ip-1.
template <class C>
__global__ void __launch_bounds__(C::kThreads, 1)
    sm90_lutb_moe_prefill_rs_gemm1(LutbW w, const unsigned char* __restrict__ a, long long Hp, Routing r, long long I,
                                   long long Ip, unsigned char* __restrict__ hq) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ __align__(1024) unsigned char smem[];
  const RsArgs args{w, a, Hp * 2, true, r, I, static_cast<int>(Ip / 64)};
#ifdef LUTB_PREFILL_RS_SM90
  auto epi = [&](const float(&acc)[C::kBN / 2], int slot, int nb) {
    const int tid = threadIdx.x, cg = (tid >> 7) - 1, tw = tid & 127, cw = tw >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int start = r.tile_start[slot], count = r.tile_count[slot];
    unsigned short* hs = reinterpret_cast<unsigned short*>(smem + C::kEpiOff) + cg * C::kBN * C::kHRow;
    const long long c0 = 64ll * nb + 32 * cg;  // the warpgroup's MXFP8 block of h: columns c0 .. c0+31
    named_barrier(1 + cg, 128);                // the previous item's reads of hs are done
    // Thread: column c0 + 8 cw + g (gate row g, up row g + 8), tokens 8 j + 2 t + c.
    const bool ok = c0 + 8 * cw + g < I;
#pragma unroll
    for (int j = 0; j < C::kBN / 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float gg = acc[4 * j + c], uu = acc[4 * j + 2 + c];
        const float v = ok ? bf16_round((gg / (1.0f + expf(-gg))) * uu) : 0.0f;
        hs[(8 * j + 2 * t + c) * C::kHRow + 8 * cw + g] = bf16_from_float(v);
      }
    named_barrier(1 + cg, 128);
    // Token n, positions L = 32 kPer x part .. of the block (rs_pos order): its MXFP8 block amax
    // (64 rows: two threads per token, combined by one shuffle), then the quantized values.
    constexpr int kTPT = 128 / C::kBN, kPer = 32 / kTPT;  // threads per token, positions per thread
    const int n = tw / kTPT, part = tw % kTPT;
    float v[kPer];
    float am = 0.0f;
    bool bad = false;
#pragma unroll
    for (int m = 0; m < kPer; ++m) {
      const int L = kPer * part + m;  // 0..31
      const int i = rs_col(L);        // column of the block (rs_col maps 0..31 onto 0..31)
      v[m] = bf16_to_float(hs[n * C::kHRow + i]);
      am = fmaxf(am, fabsf(v[m]));
      bad = bad || !isfinite(v[m]);
    }
    if (bad) am = INFINITY;
    if constexpr (kTPT == 2) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, 1));
    const int p = prefill::pair_of(r, start, count, n);
    if (p < 0) return;
    const unsigned char b = mx_block_scale(am, MxScaleRule::Rceil);
    unsigned o[kPer / 2];
#pragma unroll
    for (int m = 0; m < kPer / 2; ++m) {
      unsigned pk = 0;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float qv = b == 255 ? __int_as_float(0x7fc00000) : mx_decode(mx_encode_dev(v[2 * m + u], b), b);
        pk |= static_cast<unsigned>(bf16_from_float(qv)) << (16 * u);
      }
      o[m] = pk;
    }
    uint4* dst = reinterpret_cast<uint4*>(hq + (static_cast<long long>(p) * Ip + c0 + kPer * part) * 2);
#pragma unroll
    for (int m = 0; m < kPer / 8; ++m) dst[m] = make_uint4(o[4 * m], o[4 * m + 1], o[4 * m + 2], o[4 * m + 3]);
  };
  rs_kernel_body<C, true>(args, smem, epi);
#else
  (void)args;
  __trap();
#endif
}

/// GEMM2: y[p, n] = h[p] . w2[e, n] (FP32) for n < H. Persistent grid; items = token-tile slots x
/// ceil(H / 128) weight blocks. hq as GEMM1 wrote it (rs_col order).
template <class C>
__global__ void __launch_bounds__(C::kThreads, 1)
    sm90_lutb_moe_prefill_rs_gemm2(LutbW w, const unsigned char* __restrict__ hq, long long Ip, Routing r, long long H,
                                   float* __restrict__ y) {
  pdl_wait();
  pdl_trigger();
  extern __shared__ __align__(1024) unsigned char smem[];
  const RsArgs args{w, hq, Ip * 2, false, r, 0, static_cast<int>((w.tiles_n + 15) / 16)};
#ifdef LUTB_PREFILL_RS_SM90
  auto epi = [&](const float(&acc)[C::kBN / 2], int slot, int nb) {
    const int tid = threadIdx.x, cg = (tid >> 7) - 1, cw = (tid & 127) >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int start = r.tile_start[slot], count = r.tile_count[slot];
    const long long n0 = 128ll * nb + 64 * cg + 16 * cw + g;
#pragma unroll
    for (int j = 0; j < C::kBN / 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int p = prefill::pair_of(r, start, count, 8 * j + 2 * t + c);
        if (p < 0) continue;
        float* dst = y + static_cast<long long>(p) * H;
#pragma unroll
        for (int h = 0; h < 2; ++h)
          if (n0 + 8 * h < H) dst[n0 + 8 * h] = acc[4 * j + 2 * h + c];
      }
  };
  rs_kernel_body<C, false>(args, smem, epi);
#else
  (void)args;
  __trap();
#endif
}

}  // namespace lutb::cuda::kern::prefill90rs
