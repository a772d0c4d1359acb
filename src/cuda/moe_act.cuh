// src/cuda/moe_act.cuh: GEMM1's SiLU*up / MXFP8-of-h epilogue as its own small kernel between the
// swap-AB GEMM1 and GEMM2 (session 18, act18; set_decode_paths kDecodeActKernel, moe.hpp).
//
// Why: at one-token decode tiles GEMM1's tail (the cluster split-K combine: two cluster barriers;
// then warp 0's epilogue: SiLU*up, BF16, amax shuffles, UE8M0 scale, E4M3 encode, stores) is a
// single warp's latency chain of 2-5 us per CTA (docs/perf/moe-gpu.md "Session 17", small17) while
// the CTA's other warps idle. With kGemm1Partials set, GEMM1 stops after its cross-warp reduction
// (swap_reduce) and stores each CTA's FP32 gate / up sums, per split rank, to a workspace; this
// kernel then does the epilogue with 4 threads per MXFP8 block of h (8 I-columns each, amax over
// its own 8 values and 2 shuffles), adding the split ranks' sums in rank order first as
// swap_cluster_combine does. The same FP32 / BF16 / E4M3 operations on the same values in the same
// order as swap_epilogue1 (moe_swapab.cuh): bit-identical hq / hsf.
#pragma once

#include "moe_swapab.cuh"

namespace lutb::cuda::kern {

/// Threads per CTA of swap_act_kernel.
constexpr int kActThreads = 128;

/// The activation kernel. Thread i (of P Ip / 8) handles pair p = i / (Ip / 8), MXFP8 block
/// G = (i / 4) % (Ip / 32) and its I-columns 32 G + 8 m + j (m = i % 4, j = 0..7); the 4 threads of
/// one block are 4 consecutive lanes. Inputs: `part` (act_part_row layout, ksplit ranks; written by
/// the previous kernel, GEMM1: read after the PDL wait), the caller's expert ids `ids` [P] (pairs of
/// an id outside [0, E) have no GEMM1 sums and are skipped, as GEMM1 / GEMM2 skip them). Outputs as
/// swap_epilogue1: hq [P, Ip] in the decoder's activation form (kDecFp8: E4M3 bytes, natural order;
/// kDecCvt: FP16 values, natural order; kDecByte: FP16 values, perm8 swap order) and hsf [P, Ip/32]
/// FP32 2^(b-127). Padding I-columns (I..Ip-1) are written as zeros (GEMM2 reads all Ip columns).
/// PDL: waits for GEMM1, then triggers at once, so that GEMM2's CTAs start their weight prologue
/// while this kernel runs (the rule of moe_kernels.cuh: trigger only after the wait).
template <int kDec>
__global__ void __launch_bounds__(kActThreads)
    swap_act_kernel(const float* __restrict__ part, int ksplit, const int* __restrict__ ids, int E, long long P,
                    long long I, long long Ip, void* __restrict__ hq, float* __restrict__ hsf) {
  pdl_wait();
  pdl_trigger();
  const long long i = static_cast<long long>(blockIdx.x) * kActThreads + threadIdx.x;
  const long long per_pair = Ip / 8, blocks = Ip / 32;
  const bool live = i < P * per_pair;  // uniform over the 4 lanes of a block (P Ip / 8 is a multiple of 8)
  const long long p = live ? i / per_pair : 0;
  const long long G = (i % per_pair) >> 2;
  const int m = static_cast<int>(i & 3);
  const int e = live ? ids[p] : -1;
  const bool have = e >= 0 && e < E;  // uniform over the block's 4 lanes (same pair)
  const long long c0 = 32 * G + 8 * m;
  float gs[8], us[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) gs[j] = us[j] = 0.0f;
  if (have) {
    // swap_cluster_combine's order: rank 0's sums, then += rank 1, 2, ... in turn.
    for (int q = 0; q < ksplit; ++q) {
      const float* row = part + act_part_row(p, ksplit, q, Ip) + c0;
      const float4 g0 = *reinterpret_cast<const float4*>(row), g1 = *reinterpret_cast<const float4*>(row + 4);
      const float4 u0 = *reinterpret_cast<const float4*>(row + Ip), u1 = *reinterpret_cast<const float4*>(row + Ip + 4);
      const float gv[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      const float uv[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        gs[j] = q == 0 ? gv[j] : gs[j] + gv[j];
        us[j] = q == 0 ? uv[j] : us[j] + uv[j];
      }
    }
  }
  // swap_epilogue1's operations, per column (ok[2m] there: the 8-column group's strip < I / 8,
  // i.e. the column < I, I a multiple of 8).
  float hv[8];
  float a = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float gg = gs[j], uu = us[j];
    const float v = c0 + j < I ? (gg / (1.0f + expf(-gg))) * uu : 0.0f;
    hv[j] = bf16_round(v);
    a = fmaxf(a, fabsf(hv[j]));
    if (!isfinite(hv[j])) a = INFINITY;
  }
  a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
  a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
  if (!have) return;
  const unsigned char b = mx_block_scale(a, MxScaleRule::Rceil);
  unsigned char q8[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) q8[j] = (b == 255) ? 0 : mx_encode(hv[j], b);
  const long long at = p * Ip + c0;
  if constexpr (kDec == kDecFp8) {
    uint2 v;
    v.x = q8[0] | q8[1] << 8 | q8[2] << 16 | static_cast<unsigned>(q8[3]) << 24;
    v.y = q8[4] | q8[5] << 8 | q8[6] << 16 | static_cast<unsigned>(q8[7]) << 24;
    *reinterpret_cast<uint2*>(static_cast<unsigned char*>(hq) + at) = v;
  } else {
    uint16_t h[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      // swap_epilogue1's value: the exact FP16 of the E4M3 element, at position perm8(j).
      const uint16_t f = kDec == kDecCvt ? static_cast<uint16_t>(e4m3x2_to_f16x2(q8[j]) & 0xffffu)
                                         : __half_as_ushort(__float2half_rn(e4m3_to_float(q8[j])));
      h[perm8(j, kDec == kDecByte)] = f;
    }
    uint4 v;
    v.x = h[0] | static_cast<unsigned>(h[1]) << 16;
    v.y = h[2] | static_cast<unsigned>(h[3]) << 16;
    v.z = h[4] | static_cast<unsigned>(h[5]) << 16;
    v.w = h[6] | static_cast<unsigned>(h[7]) << 16;
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(hq) + at) = v;
  }
  if (m == 0) hsf[p * blocks + G] = ue8m0_f(b);
}

}  // namespace lutb::cuda::kern
