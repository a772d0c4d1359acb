// src/cuda/moe/lutb_moe_swapab_prologue.hpp: the integer arithmetic of the swap-AB decode GEMMs' prologue
// (sm80_lutb_moe_swapab.cuh), host and device, in 32 bits: the K-tile range of a
// warp and the token of a pair. Host-testable (tests/cuda/moe_e4m3_encode_test.cpp).
//
// Why 32 bits suffice (all operands are non-negative):
//   tiles_k  K-tiles of one row strip of one expert (201 bytes each, all in GPU memory): below
//            kSwapMaxTilesK = 2^30 on any GPU (2^30 tiles are 216 GB; an H200 has 141 GB); the host
//            refuses larger (launch_swapab, lutb_moe_forward.cu).
//   nw, ksplit, part, warp  at most 16 warps, 8 cluster CTAs: W = nw * ksplit <= 128 (<= 2^16 taken), gw < W.
//   per = ceil(tiles_k / W) <= tiles_k; per * gw < per * W < tiles_k + W <= 2^30 + 2^16; k0 + per
//            <= 2^31: no unsigned wrap-around anywhere.
//   pairs    p = t * top_k + j < T * top_k: the routing's int arrays index pairs with int.
// The results are the same numbers as the 64-bit formulas for every such input
// (SwapPrologue.KRangeEquals64BitFormula checks the bounds' corners and random inputs).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LUTB_SWAP_HD __host__ __device__ __forceinline__
#else
#define LUTB_SWAP_HD inline
#endif

namespace lutb::cuda::kern {

/// Largest tiles_k the 32-bit K range takes (2^30: 2^30 K-tiles of one strip are 201 GiB).
inline constexpr long long kSwapMaxTilesK = 1ll << 30;

/// K-tile range [k0, k1) of warp `warp` of `nw` in share `part` of `ksplit` (the CTA's K split
/// across warps, times the cluster's split across CTAs): contiguous, in (part, warp) order, each of
/// per = ceil(tiles_k / (nw * ksplit)) K-tiles, clipped to tiles_k. 0 <= tiles_k <= kSwapMaxTilesK,
/// 1 <= nw * ksplit <= 2^16, 0 <= warp < nw, 0 <= part < ksplit. 32-bit unsigned arithmetic (one
/// 32-bit division); the same numbers as the 64-bit formula (see the file comment).
LUTB_SWAP_HD void swap_k_range32(unsigned tiles_k, unsigned nw, unsigned warp, unsigned ksplit, unsigned part,
                                 unsigned& k0, unsigned& k1) {
  const unsigned W = nw * ksplit, gw = part * nw + warp;
  const unsigned per = (tiles_k + W - 1u) / W;
  const unsigned a = per * gw;
  k0 = a < tiles_k ? a : tiles_k;
  const unsigned b = k0 + per;
  k1 = b < tiles_k ? b : tiles_k;
}

/// Token of pair p = t * top_k + j: p / top_k for p >= 0, top_k >= 1, in 32-bit unsigned arithmetic
/// (cheaper than the signed division; the same quotient for non-negative operands).
LUTB_SWAP_HD unsigned swap_pair_token(int p, int top_k) {
  return static_cast<unsigned>(p) / static_cast<unsigned>(top_k);
}

/// The same range in 64-bit signed arithmetic (the reference).
LUTB_SWAP_HD void swap_k_range64(long long tiles_k, int nw, int warp, int ksplit, int part, long long& k0,
                                 long long& k1) {
  const long long W = static_cast<long long>(nw) * ksplit, gw = static_cast<long long>(part) * nw + warp;
  const long long per = (tiles_k + W - 1) / W;
  k0 = per * gw < tiles_k ? per * gw : tiles_k;
  k1 = k0 + per < tiles_k ? k0 + per : tiles_k;
}

}  // namespace lutb::cuda::kern
