// src/cuda/e4m3_encode.cuh: the device's FP32 -> E4M3 encode (spec section 1) through the hardware
// conversion, and the MXFP8 element encode built on it.
//
// On sm_89+ `cvt.rn.satfinite.e4m3x2.f32` converts two FP32 values to two E4M3 bytes in one
// instruction (PTX ISA, "cvt": .rn round to nearest even, .satfinite: finite values beyond the
// format's range and +-Inf give +-MAX_NORM = +-448, NaN gives NaN). That is the spec's encode
// (round to nearest, ties to even, saturating finite values and +-Inf to +-448, NaN stays NaN).
// tests/cuda/moe_e4m3_encode_test.cpp checks it on the GPU against the reference
// lutb::e4m3_from_float (include/lutb/numerics.hpp) for all 2^32 FP32 bit patterns: the same byte
// for every non-NaN input (FP32 subnormals, the E4M3 subnormal range, ties, 448 and beyond, +-Inf
// included); for NaN inputs a NaN byte (the hardware writes 0x7F whatever the input's sign, where
// the reference keeps the sign: 0xFF for negative NaNs; both are the spec's NaN). And it checks
// mx_encode_dev against lutb::mx_encode for every scale byte 0..254 and all 2^32 inputs.
//
// Below sm_89 (the sm_80 image) these are the reference functions themselves.
#pragma once

#include <cstdint>

#include "lutb/mxfp8.hpp"
#include "lutb/numerics.hpp"

namespace lutb::cuda::kern {

/// Two FP32 values -> two E4M3 bytes: low byte = e4m3(lo), high byte = e4m3(hi), by the spec's
/// rule (see the file comment). Device only; sm_89+: one cvt.rn.satfinite.e4m3x2.f32.
__device__ __forceinline__ unsigned short e4m3x2_from_f32(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short d;
  // PTX: the first source goes to the upper half of the destination.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return static_cast<unsigned short>(e4m3_from_float(lo) | (e4m3_from_float(hi) << 8));
#endif
}

/// FP32 -> E4M3 byte on the device (sm_89+: the hardware conversion, one instruction). Equal to
/// lutb::e4m3_from_float for every non-NaN input (exhaustive GPU test); a NaN input gives a NaN
/// byte (0x7F on sm_89+, 0x7F | sign below).
__device__ __forceinline__ unsigned char e4m3_from_float_dev(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return static_cast<unsigned char>(e4m3x2_from_f32(x, 0.0f) & 0xffu);
#else
  return e4m3_from_float(x);
#endif
}

/// MXFP8 element byte of x in a block with scale byte b (b != 255): e4m3(x * 2^(127-b)), the
/// scaling by lutb::ldexp_ue8m0 exactly as lutb::mx_encode (include/lutb/mxfp8.hpp), the encode by
/// e4m3_from_float_dev. Equal to lutb::mx_encode(x, b) for every non-NaN x and every b in 0..254
/// (exhaustive GPU test; the kernels call it only for blocks without NaN or Inf, b != 255).
__device__ __forceinline__ unsigned char mx_encode_dev(float x, unsigned char b) {
  return e4m3_from_float_dev(ldexp_ue8m0(x, static_cast<unsigned char>(254 - b)));
}

}  // namespace lutb::cuda::kern
