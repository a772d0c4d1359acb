// src/cuda/moe/lutb_moe_device.cuh: device helpers of the fused MoE forward (spec section 4), shared
// by the LUT-B kernels and the BF16 baseline (same skeleton, kLutb = false).
//
// Tensor-core mapping (mma.sync.m16n8k16, FP32 accumulators): M = 16 tokens (rows of the expert's
// token list), N = 8 weight rows = exactly one LUT-B tile row-strip, K = 16. So every accumulator
// column shares one tile scale and every accumulator row one MXFP8 block scale: the products of the
// UNSCALED E4M3 values (exact in FP16) are summed per 32-column MXFP8 block by two mma, then that
// partial sum is multiplied by 2^(s_w-127) * 2^(b_x-127) (exact) and added to the FP32 result. The
// values multiplied are exactly spec section 4's; only the FP32 summation order differs.
//
// K permutation: inside every 8 consecutive columns, thread t of a quad holds columns 8t..8t+7 of the
// 32-column block (the lane-major tile order of lutb/cuda/lane_major.hpp gives it their selectors). The weight decoder produces FP16 pairs
// either natural ((0,1),(2,3),...; sm_89+ cvt.rn.f16x2.e4m3x2) or swapped ((0,2),(1,3),...; the
// portable byte trick); activations are stored in the matching order, so A and B agree on every
// k-slot.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "lutb/mxfp8.hpp"
#include "lutb/numerics.hpp"

namespace lutb::cuda::kern {

constexpr int kWarps = 4;  // warps per CTA in the GEMM kernels

/// Weight decoders of the swap-AB kernels (sm80_lutb_moe_swapab.cuh, template parameter kDec): both
/// feed mma.m16n8k16.f16, by the byte trick (any sm_80+) or sm_89+'s cvt (the sm_90a image).
constexpr int kDecByte = 0, kDecCvt = 1;

/// Storage position, inside its group of 8, of logical column c (swap order 0,2,1,3,4,6,5,7).
__host__ __device__ __forceinline__ int perm8(int c, bool swap) {
  return swap ? ((c & 4) | ((c & 1) << 1) | ((c & 2) >> 1)) : c;
}

/// Two E4M3 bytes (low 16 bits) -> FP16x2, exact (sm_89+ hardware conversion), natural order.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2(unsigned short v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
#else
  // Not used on these architectures (the host selects the byte-trick decoder); keep it exact anyway.
  const unsigned y = v;
  const unsigned lo = static_cast<unsigned>(__half_as_ushort(__float2half(e4m3_to_float(y & 0xff))));
  const unsigned hi = static_cast<unsigned>(__half_as_ushort(__float2half(e4m3_to_float(y >> 8))));
  return lo | (hi << 16);
#endif
}

/// 4 E4M3 bytes -> FP16x2 of bytes (0, 1) in lo and of bytes (2, 3) in hi. The register is split
/// with mov.b32 {l, h} so that ptxas reads the high half as an operand (F2FP ... R.H1) instead of
/// shifting it first.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(unsigned p, unsigned& lo, unsigned& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(p));
#else
  lo = e4m3x2_to_f16x2(static_cast<unsigned short>(p & 0xffffu));
  hi = e4m3x2_to_f16x2(static_cast<unsigned short>(p >> 16));
#endif
}

/// PRMT (default mode) with the selector used as given: byte n of the result is byte sel[4n+2:4n]
/// of {b, a}. The caller guarantees that bit 3 of every nibble of sel[15:0] is 0 (bit 3 would ask
/// for sign replication) and that bits 16..31 may hold anything (PRMT reads only sel[15:0]).
/// __byte_perm's contract ignores bit 3, so the compiler clears it with an extra LOP3 per call
/// unless it can prove it zero; the swap-AB decoder's selectors are zero there by construction
/// (sm80_lutb_moe_swapab.cuh), which saves 2 ALU instructions per strip and K-tile (ncu SASS).
__device__ __forceinline__ unsigned prmt_raw(unsigned a, unsigned b, unsigned sel) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

/// Decodes 8 indices given as two PRMT selectors (lane-major order, lutb/cuda/lane_major.hpp: sa =
/// columns +0..3, sb = +4..7 of the lane's 8 columns of one MXFP8 block) against codebook bytes
/// cb_lo (entries 0..3) and cb_hi (4..7) into four FP16x2 registers.
/// kCvt: natural pairs (0,1)(2,3)(4,5)(6,7), true E4M3 values.
/// !kCvt: swapped pairs (0,2)(1,3)(4,6)(5,7), values times 2^-8 (FP16 bits = sign<<15 | (b&0x7f)<<7,
///        exact for normals and subnormals alike).
template <bool kCvt>
__device__ __forceinline__ void decode_group(unsigned sa, unsigned sb, unsigned cb_lo, unsigned cb_hi,
                                             unsigned (&b)[4]) {
  const unsigned y1 = __byte_perm(cb_lo, cb_hi, sa);
  const unsigned y2 = __byte_perm(cb_lo, cb_hi, sb);
  if constexpr (kCvt) {
    e4m3x4_to_f16x2x2(y1, b[0], b[1]);
    e4m3x4_to_f16x2x2(y2, b[2], b[3]);
  } else {
    // bytes 0 and 2 -> (lane0, lane1) of one register; bytes 1 and 3 -> the other.
    b[0] = ((y1 << 8) & 0x80008000u) | ((y1 << 7) & 0x3f803f80u);
    b[1] = (y1 & 0x80008000u) | ((y1 >> 1) & 0x3f803f80u);
    b[2] = ((y2 << 8) & 0x80008000u) | ((y2 << 7) & 0x3f803f80u);
    b[3] = (y2 & 0x80008000u) | ((y2 >> 1) & 0x3f803f80u);
  }
}

template <bool kBf16>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// 2^(b-127) as FP32 (b = 255 -> NaN), times 2^extra (extra in 0..8, b + extra <= 254 for valid b).
__device__ __forceinline__ float ue8m0_scale(unsigned b, int extra) {
  if (b == 255u) return __int_as_float(0x7fc00000);
  if (b + extra == 0u) return __int_as_float(0x00400000);
  return __int_as_float(static_cast<int>((b + extra) << 23));
}

/// 2^(b-127) without branches (b = 255 -> NaN, b = 0 -> 2^-127).
__device__ __forceinline__ float ue8m0_f(unsigned b) {
  const float f = __int_as_float(static_cast<int>(b << 23));
  return b == 255u ? __int_as_float(0x7fc00000) : (b == 0u ? __int_as_float(0x00400000) : f);
}

// ---------------------------------------------------------------------------
// Programmatic dependent launch (PDL, sm_90+; CUDA programming guide, "Programmatic Dependent
// Launch and Synchronization"). The forward launches every kernel after the first with
// cudaLaunchAttributeProgrammaticStreamSerialization (lutb_moe_launch.hpp launch_kernel), so a kernel
// may start while its predecessor finishes. Rules every forward kernel follows:
//  - pdl_wait() before reading anything the PREVIOUS kernel writes (it returns once that grid has
//    completed and its memory is visible; a no-op when the launch had no programmatic dependency);
//  - pdl_trigger() only AFTER its own pdl_wait(), so that when a kernel starts, the kernel two
//    launches back has completed: the swap-AB GEMMs read the routing (written by the grouping two
//    launches back) and prefetch weights before their wait.
// Both compile to nothing below sm_90.
// ---------------------------------------------------------------------------
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
struct PdlWaitAndTrigger {
  __device__ __forceinline__ void operator()() const {
    pdl_wait();
    pdl_trigger();
  }
};

// ---------------------------------------------------------------------------
// Work description shared by the kernels
// ---------------------------------------------------------------------------
struct Routing {
  const int* ids;          // [T*k] expert of pair p = t*k + j
  const float* weights;    // [T*k]
  const int* sorted;       // [T*k] pair indices grouped by expert (valid ones first)
  const int* tile_expert;  // [max_tiles] expert of token tile
  const int* tile_start;   // [max_tiles] first position in `sorted`
  const int* tile_count;   // [max_tiles] rows in the tile (1..16*MT)
  const int* num_tiles;    // [1]
  int top_k;
  // Ungrouped single-token forward (swap-AB decode, T = 1 only): when > 0, the grouping kernel did
  // not run and token tile slot j (< direct_pairs = k) is pair j alone, expert ids[j] (skipped when
  // out of range [0, direct_experts)); sorted/tile_* are not read.
  int direct_pairs = 0;
  int direct_experts = 0;
};

struct LutbW {
  const unsigned char* packed;
  const unsigned char* codebook;
  const unsigned char* scale;
  long long tiles_n, tiles_k;  // per expert
  long long total_tiles;      // of the whole stack (bounds of the scale array)
};

}  // namespace lutb::cuda::kern
