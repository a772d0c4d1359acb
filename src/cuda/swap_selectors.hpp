// src/cuda/swap_selectors.hpp: the PRMT selectors of the swap-AB decode K-loop
// (kern::swap_warp_gemm, moe_swapab.cuh), in two arithmetic forms that give the same 32-bit words:
// swap_sel_alu (the default: masks and shifts, all on the ALU pipe of sm_90), swap_sel_fma (session
// 17, alu17: multiply forms that the FMA pipe's IMAD / IMAD.HI execute) and swap_sel_imad (the two
// subtractions alone as IMAD). Host and device, so that a
// CPU test (tests/core/swap_selectors_test.cpp) proves the identity on any machine; the GPU test
// MoeDecodePaths*.SelFma* proves the kernels' outputs bit-identical.
//
// Inputs: x = the lane's 4 index bytes and y = its 2 index bytes (zero-extended to 32 bits) of one
// tile and K-tile, in the lane-major layout of lutb/cuda/lane_major.hpp (16 3-bit indices: 12 in
// bits 0..2 of x's 8 and y's 4 nibbles, the other 4 spread over the 12 nibbles' bit 3 and gathered
// by selector 3). Outputs sel[0..3]: prmt.b32 selectors whose nibbles 0..3 (bits 0..15) have
// bit 3 = 0 (default PRMT mode: bits 0..2 pick one of the 8 codebook bytes); bits 16..31 are ignored
// by PRMT but are equal in both forms too.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LUTB_SWAPSEL_HD __host__ __device__ __forceinline__
#else
#define LUTB_SWAPSEL_HD inline
#endif

namespace lutb::cuda::kern {

/// The multipliers of swap_sel_fma. On the GPU they come from constant memory (kSwapSelMulC,
/// moe_swapab.cuh), which ptxas cannot see, so it cannot strength-reduce the multiplications back
/// into shifts and adds on the ALU pipe.
struct SwapSelMul {
  std::uint32_t neg1;    // 0xffffffff = -1: sx * -1 + x = x - sx
  std::uint32_t m16;     // 2^16: mul.hi(v, 2^16) = v >> 16
  std::uint32_t m29_14;  // 2^29 + 2^14: mul.hi(sx, .) = (sx >> 3) + (sx >> 18) (see swap_sel_fma)
  std::uint32_t m31;     // 2^31: mul.hi(v, 2^31) = v >> 1
};
inline constexpr SwapSelMul kSwapSelMul = {0xffffffffu, 1u << 16, (1u << 29) + (1u << 14), 1u << 31};

/// The default form (sessions 9-16): ~8 ALU instructions per (x, y) besides the 4 PRMT.
///   sel0 = x & 0x77777777, sel1 = sel0 >> 16, sel2 = y & 0x7777,
///   sel3 = (sx >> 3) + (sx >> 18) + ((y & 0x8888) >> 1), sx = x & 0x88888888:
/// the spare bit 3 of every nibble: x's low nibbles -> bit 0, x's high nibbles -> bit 1, y's ->
/// bit 2 of selector 3's nibbles. The three terms share no bit (bits 0, 1, 2 mod 4), so + is |.
LUTB_SWAPSEL_HD void swap_sel_alu(std::uint32_t x, std::uint32_t y, std::uint32_t (&sel)[4]) {
  const std::uint32_t xm = x & 0x77777777u;
  sel[0] = xm;
  sel[1] = xm >> 16;
  sel[2] = y & 0x7777u;
  const std::uint32_t sx = x & 0x88888888u;
  sel[3] = (sx >> 3) + (sx >> 18) + ((y & 0x8888u) >> 1);
}

/// mul.hi.u32: the high 32 bits of the 64-bit product (IMAD.HI.U32 on the GPU).
LUTB_SWAPSEL_HD std::uint32_t swap_mulhi(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(a) * b) >> 32);
#endif
}

/// mad.hi.u32: the high 32 bits of a * b, plus c (mod 2^32; PTX ISA, "Integer Arithmetic
/// Instructions: mad"): one IMAD.HI.U32.
LUTB_SWAPSEL_HD std::uint32_t swap_madhi(std::uint32_t a, std::uint32_t b, std::uint32_t c) {
#if defined(__CUDA_ARCH__)
  std::uint32_t d;
  asm("mad.hi.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  return static_cast<std::uint32_t>((static_cast<std::uint64_t>(a) * b) >> 32) + c;
#endif
}

/// The FMA-pipe form: the same 4 words as swap_sel_alu for every x and every y < 2^16, with 2 ALU
/// instructions (the LOP3 of sx, sy) and 5 multiply-adds; m = kSwapSelMul (from an opaque source
/// on the GPU). Proof, with sx = x & 0x88888888 (bits only at positions 3 mod 4) and
/// sy = y & 0x8888 (bits 3, 7, 11, 15):
///   sel0 = sx * -1 + x = x - sx = x & 0x77777777 (sx's bits are a subset of x's: no borrow);
///   sel1 = hi32(sel0 * 2^16) = sel0 >> 16;
///   sel2 = sy * -1 + y = y & 0x7777 (likewise);
///   sel3 = hi32(sx * (2^29 + 2^14)) + hi32(sy * 2^31). The 64-bit product is sx * 2^29 + sx * 2^14.
///     sx * 2^29 = sx << 29: its low word holds sx's bits 0..2, which are 0, so it is
///     (sx >> 3) * 2^32 exactly. sx * 2^14: high word sx >> 18, low word (sx << 14) mod 2^32, which
///     holds sx's bits 3, 7, 11, 15 at 17, 21, 25, 29 only. The low words add to at most
///     2^30 - 1 (no carry into the high word), so hi32 = (sx >> 3) + (sx >> 18) exactly.
///     hi32(sy * 2^31) = sy >> 1. The sum is the default sel3 term for term (same 32-bit adds).
LUTB_SWAPSEL_HD void swap_sel_fma(std::uint32_t x, std::uint32_t y, const SwapSelMul& m, std::uint32_t (&sel)[4]) {
  const std::uint32_t sx = x & 0x88888888u, sy = y & 0x8888u;
  sel[0] = sx * m.neg1 + x;
  sel[1] = swap_mulhi(sel[0], m.m16);
  sel[2] = sy * m.neg1 + y;
  sel[3] = swap_madhi(sx, m.m29_14, swap_mulhi(sy, m.m31));
}

/// The partial form (kDecodeSelImad): only the two subtractions on the FMA pipe (IMAD with the
/// opaque -1 `neg1`, full-rate IMAD rather than IMAD.HI), sel1 and sel3 as in swap_sel_alu:
/// sel0 = sx * -1 + x = x & 0x77777777 and sel2 = y & 0x7777 (swap_sel_fma's proof), so the same words.
LUTB_SWAPSEL_HD void swap_sel_imad(std::uint32_t x, std::uint32_t y, std::uint32_t neg1, std::uint32_t (&sel)[4]) {
  const std::uint32_t sx = x & 0x88888888u, sy = y & 0x8888u;
  sel[0] = sx * neg1 + x;
  sel[1] = sel[0] >> 16;
  sel[2] = sy * neg1 + y;
  sel[3] = (sx >> 3) + (sx >> 18) + (sy >> 1);
}

}  // namespace lutb::cuda::kern
