// src/cuda/moe/sm80_lutb_moe_swapab_act.cuh: GEMM1's SiLU*up / MXFP8-of-h epilogue as its own small
// kernel between the swap-AB GEMM1 and GEMM2 (heuristics::decode_act_kernel).
//
// Why: at small decode tiles GEMM1's tail (the cluster split-K combine: two cluster barriers; then
// warp 0's epilogue: SiLU*up, BF16, amax shuffles, UE8M0 scale, E4M3 encode, stores) is a single
// warp's latency chain of 2-5 us per CTA while the CTA's other warps idle. With kGemm1Partials set,
// GEMM1 stops after its cross-warp reduction (swap_reduce) and stores each CTA's FP32 gate / up
// sums, per split rank, to a workspace; this kernel then does the epilogue with one warp per MXFP8
// block of h (one I-column per lane, the amax over the warp), adding the split ranks' sums in rank
// order first as swap_cluster_combine does. The same FP32 / BF16 / E4M3 operations on the same
// values in the same order as swap_epilogue1 (sm80_lutb_moe_swapab.cuh): bit-identical hq / hsf.
#pragma once

#include "cuda/moe/sm80_lutb_moe_swapab.cuh"

namespace lutb::cuda::kern {

/// Threads per CTA of sm80_lutb_moe_swapab_act.
constexpr int kActThreads = 128;

/// The activation kernel. One warp per MXFP8 block of h: thread i (of P Ip) handles pair
/// p = i / Ip and I-column c = i % Ip; warp w's 32 lanes are block G = c / 32 of one pair (Ip is a
/// multiple of 64), lane j = column 32 G + j: one column per lane makes each lane's chain one
/// step and the amax 5 shuffles (8 columns per thread took ~1.5 us at Qwen3-30B T = 1). Inputs: `part` (act_part_row layout, ksplit ranks; written by the previous kernel,
/// GEMM1: read after the PDL wait), the caller's expert ids `ids` [P] (pairs of an id outside
/// [0, E) have no GEMM1 sums and are skipped, as GEMM1 / GEMM2 skip them). Outputs as
/// swap_epilogue1: hq [P, Ip] in the decoder's activation form (kDecCvt: FP16 values, natural order; kDecByte: FP16 values, perm8 swap order within each group of
/// 8) and hsf [P, Ip/32] FP32 2^(b-127). Padding I-columns (I..Ip-1) are written as zeros (GEMM2
/// reads all Ip columns). The amax is the same value as swap_epilogue1's (max of |h| over the
/// block, +inf when any h is not finite: order-free). PDL: waits for GEMM1, then triggers at once,
/// so that GEMM2's CTAs start their weight prologue while this kernel runs (the rule of
/// lutb_moe_device.cuh: trigger only after the wait).
template <int kDec>
__global__ void __launch_bounds__(kActThreads)
    sm80_lutb_moe_swapab_act(const float* __restrict__ part, int ksplit, const int* __restrict__ ids, int E, long long P,
                    long long I, long long Ip, void* __restrict__ hq, float* __restrict__ hsf) {
  pdl_wait();
  pdl_trigger();
  const long long i = static_cast<long long>(blockIdx.x) * kActThreads + threadIdx.x;
  if (i >= P * Ip) return;  // whole warps (P Ip is a multiple of 64)
  const long long p = i / Ip, c = i - p * Ip;
  const int e = ids[p];
  if (e < 0 || e >= E) return;  // warp-uniform (one pair per warp)
  // swap_cluster_combine's order: rank 0's sums, then += rank 1, 2, ... in turn.
  const float* row = part + act_part_row(p, ksplit, 0, Ip) + c;
  float gg = row[0], uu = row[Ip];
  for (int q = 1; q < ksplit; ++q) {
    row += 2 * Ip;
    gg += row[0];
    uu += row[Ip];
  }
  // swap_epilogue1's operations (ok[2m] there: the 8-column group's strip < I / 8, i.e. c < I, I a
  // multiple of 8).
  const float v = c < I ? (gg / (1.0f + expf(-gg))) * uu : 0.0f;
  const float hv = bf16_round(v);
  float a = isfinite(hv) ? fabsf(hv) : INFINITY;
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  const unsigned char b = mx_block_scale(a, MxScaleRule::Rceil);
  // mx_encode_dev: the hardware E4M3 conversion, the same bytes as mx_encode (e4m3_encode.cuh).
  const unsigned char q8 = (b == 255) ? 0 : mx_encode_dev(hv, b);
  const int j = static_cast<int>(c & 31);
  // swap_epilogue1's value: the exact FP16 of the E4M3 element, at position perm8 in its group of 8.
  const uint16_t f = kDec == kDecCvt ? static_cast<uint16_t>(e4m3x2_to_f16x2(q8) & 0xffffu)
                                     : __half_as_ushort(__float2half_rn(e4m3_to_float(q8)));
  static_cast<uint16_t*>(hq)[i - (j & 7) + perm8(j & 7, kDec == kDecByte)] = f;
  if (j == 0) hsf[p * (Ip / 32) + c / 32] = ue8m0_f(b);
}

}  // namespace lutb::cuda::kern
