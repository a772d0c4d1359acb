// src/cuda/swap_selectors.hpp: the PRMT selectors of the swap-AB decode K-loop
// (kern::swap_warp_gemm, moe_swapab.cuh), in two arithmetic forms that give the same 32-bit words:
// swap_sel_alu (the default: masks and shifts, all on the ALU pipe of sm_90) and swap_sel_imad
// (session 17, alu17; kDecodeSelImad, include/lutb/cuda/moe.hpp: the two subtractions as IMAD on the
// FMA pipe). Host and device, so that a CPU test (tests/core/swap_selectors_test.cpp) checks the
// identity and the selectors' definition on any machine; the GPU test
// MoeDecodePaths.SelImadBitIdenticalToDefault checks the kernels' outputs bit for bit.
// A third form measured in session 17 (everything but two LOP3 as IMAD / IMAD.HI, 0.93-1.00x) is
// described in docs/perf/moe-gpu.md "Session 17" and was not kept.
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

/// -1 as the multiplier of swap_sel_imad. On the GPU it comes from constant memory (kSwapSelNeg1C,
/// moe_swapab.cuh), which ptxas cannot see, so it cannot turn the multiply-add back into an IADD3 /
/// LOP3 on the ALU pipe.
inline constexpr std::uint32_t kSwapSelNeg1 = 0xffffffffu;

/// The default form (sessions 9-16): ~8 ALU instructions per (x, y) besides the 4 PRMT.
///   sel0 = x & 0x77777777, sel1 = sel0 >> 16, sel2 = y & 0x7777,
///   sel3 = (sx >> 3) + (sx >> 18) + ((y & 0x8888) >> 1), sx = x & 0x88888888:
/// the spare bit 3 of every nibble: x's low nibbles -> bit 0, x's high nibbles -> bit 1, y's ->
/// bit 2 of selector 3's nibbles. The three terms share no bit (bits 0, 1, 2 mod 4), so + is | and
/// lets ptxas fuse the shifts into LEA.HI / IADD3.
LUTB_SWAPSEL_HD void swap_sel_alu(std::uint32_t x, std::uint32_t y, std::uint32_t (&sel)[4]) {
  const std::uint32_t xm = x & 0x77777777u;
  sel[0] = xm;
  sel[1] = xm >> 16;
  sel[2] = y & 0x7777u;
  const std::uint32_t sx = x & 0x88888888u;
  sel[3] = (sx >> 3) + (sx >> 18) + ((y & 0x8888u) >> 1);
}

/// The IMAD form: the same 4 words as swap_sel_alu for every x and every y (neg1 = kSwapSelNeg1).
/// sx = x & 0x88888888 and sy = y & 0x8888 are needed for sel3 anyway; then
///   sel0 = sx * -1 + x = x - sx = x & 0x77777777 (sx's bits are a subset of x's: no borrow),
///   sel2 = sy * -1 + y = y & 0x7777 (likewise),
/// two IMAD on the FMA pipe instead of two LOP3 on the ALU pipe (SASS per K-tile of the one-token
/// loop: ALU 183 -> 167, IMAD 14 -> 30, same total); sel1 and sel3 as in swap_sel_alu.
LUTB_SWAPSEL_HD void swap_sel_imad(std::uint32_t x, std::uint32_t y, std::uint32_t neg1, std::uint32_t (&sel)[4]) {
  const std::uint32_t sx = x & 0x88888888u, sy = y & 0x8888u;
  sel[0] = sx * neg1 + x;
  sel[1] = sel[0] >> 16;
  sel[2] = sy * neg1 + y;
  sel[3] = (sx >> 3) + (sx >> 18) + (sy >> 1);
}

}  // namespace lutb::cuda::kern
