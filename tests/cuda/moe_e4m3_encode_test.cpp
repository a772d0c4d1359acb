// tests/cuda/moe_e4m3_encode_test.cpp: the device E4M3 encode through the
// hardware conversion cvt.rn.satfinite.e4m3x2.f32 (src/cuda/e4m3_encode.cuh), used by the forward's
// MXFP8 of x and GEMM1's epilogue, against the reference encode of spec section 1
// (lutb::e4m3_from_float, lutb::mx_encode) over ALL 2^32 FP32 bit patterns, and for the MXFP8 encode
// every scale byte 0..254 too; plus the 32-bit prologue arithmetic of the swap-AB GEMMs
// (src/cuda/moe/lutb_moe_swapab_prologue.hpp) against the 64-bit formula (host only). The forward's own bytes are
// checked by the MoE GPU tests (moe_vs_cpu_test.cpp, moe_decode_paths_test.cpp: the CPU emulation
// and the bit-identity tests), unchanged.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>

#include "cuda/e4m3_encode_check.hpp"
#include "cuda/moe/lutb_moe_swapab_prologue.hpp"
#include "lutb/numerics.hpp"

namespace lutb::test {
namespace {

bool gpu_here() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

bool sm89_here() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major * 10 + minor >= 89;
}

constexpr std::uint64_t kAll = 1ull << 32;
constexpr std::uint64_t kNanPatterns = 2ull * ((1ull << 23) - 1);  // exponent 255, mantissa != 0, both signs

void print(const char* what, const cuda::detail::EncodeCheck& r) {
  std::printf("%s: %llu cases, %llu mismatches (non-NaN x), NaN cases %llu: %llu not NaN, %llu -> 0x7F, %llu -> 0xFF, "
              "%llu differ from the reference's 0x7F | sign; checksum %016llx\n",
              what, static_cast<unsigned long long>(r.cases), static_cast<unsigned long long>(r.mismatches),
              static_cast<unsigned long long>(r.nan_cases), static_cast<unsigned long long>(r.nan_not_nan),
              static_cast<unsigned long long>(r.nan_7f), static_cast<unsigned long long>(r.nan_ff),
              static_cast<unsigned long long>(r.nan_ref_differs), static_cast<unsigned long long>(r.checksum));
}

// The device encode equals lutb::e4m3_from_float on every non-NaN FP32 input (FP32 subnormals, the
// E4M3 subnormal range and its ties, the normal range's ties, 448 and everything above, +-Inf) and
// gives a NaN byte for every NaN input (the spec: NaN stays NaN; 0x7F and 0xFF are both NaN). The
// checksum over the non-NaN inputs is recomputed on the CPU from the host's reference, so the
// device-compiled reference is checked against the host's too.
TEST(E4m3EncodeGpu, HardwareEncodeEqualsReferenceOnAllFloats) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device";
  const cuda::detail::EncodeCheck r = cuda::detail::check_e4m3_encode_exhaustive();
  print(sm89_here() ? "e4m3 (cvt.rn.satfinite.e4m3x2.f32)" : "e4m3 (software path)", r);
  EXPECT_EQ(r.cases, kAll);
  EXPECT_EQ(r.mismatches, 0u) << "first mismatch at x bits 0x" << std::hex << r.first_bad_x;
  EXPECT_EQ(r.nan_cases, kNanPatterns);
  EXPECT_EQ(r.nan_not_nan, 0u);
  EXPECT_EQ(r.nan_7f + r.nan_ff, kNanPatterns);
  std::uint64_t cpu = 0;
#pragma omp parallel for reduction(+ : cpu) schedule(static)
  for (std::int64_t hi = 0; hi < (1ll << 16); ++hi) {
    std::uint64_t part = 0;
    for (std::uint32_t lo = 0; lo < (1u << 16); ++lo) {
      const std::uint32_t xb = static_cast<std::uint32_t>(hi << 16) | lo;
      const float x = f32_from_bits(xb);
      if (f32_is_nan(x)) continue;
      part += cuda::detail::encode_checksum_term(xb, 0, e4m3_from_float(x));
    }
    cpu += part;
  }
  EXPECT_EQ(r.checksum, cpu);
}

// The MXFP8 element encode of the forward (scaling by 2^(127-b), then the encode) equals
// lutb::mx_encode for every scale byte b = 0..254 and every non-NaN FP32 x: the scaling is the same
// code (lutb::ldexp_ue8m0), so this re-checks the encode on the values the scaling produces
// (2^32 x 255 cases; the kernels call it only for blocks without NaN / Inf, b != 255).
TEST(E4m3EncodeGpu, MxEncodeEqualsReferenceForEveryScaleOnAllFloats) {
  if (!gpu_here()) GTEST_SKIP() << "no CUDA device";
  const cuda::detail::EncodeCheck r = cuda::detail::check_mx_encode_exhaustive(0, 254);
  print("mx_encode, b = 0..254", r);
  EXPECT_EQ(r.cases, kAll * 255);
  EXPECT_EQ(r.mismatches, 0u) << "first mismatch at x bits 0x" << std::hex << r.first_bad_x << std::dec << ", b "
                              << r.first_bad_b;
  EXPECT_EQ(r.nan_cases, kNanPatterns * 255);
  EXPECT_EQ(r.nan_not_nan, 0u);
}

// The 32-bit K range of a warp equals the 64-bit formula on the bounds' corners
// (tiles_k up to kSwapMaxTilesK = 2^30, W = warps x split up to 128, every warp and part) and on
// random inputs; the ranges tile [0, tiles_k) in (part, warp) order without gaps or overlaps.
TEST(SwapPrologue, KRangeEquals64BitFormula) {
  using cuda::kern::kSwapMaxTilesK;
  auto check = [](long long tiles_k, int nw, int ksplit) {
    long long next = 0;
    for (int part = 0; part < ksplit; ++part)
      for (int warp = 0; warp < nw; ++warp) {
        unsigned a = 0, b = 0;
        long long k0 = 0, k1 = 0;
        cuda::kern::swap_k_range32(static_cast<unsigned>(tiles_k), nw, warp, ksplit, part, a, b);
        cuda::kern::swap_k_range64(tiles_k, nw, warp, ksplit, part, k0, k1);
        ASSERT_EQ(static_cast<long long>(a), k0) << tiles_k << " " << nw << " " << ksplit << " " << part << " " << warp;
        ASSERT_EQ(static_cast<long long>(b), k1) << tiles_k << " " << nw << " " << ksplit << " " << part << " " << warp;
        ASSERT_EQ(k0, std::min(next, tiles_k));
        ASSERT_LE(k0, k1);
        next = k1 > next ? k1 : next;
      }
    ASSERT_EQ(next, tiles_k);
  };
  const long long sizes[] = {0, 1, 2, 3, 4, 7, 32, 33, 112, 127, 128, 129, 224, 1000003, (1ll << 29) + 1,
                             kSwapMaxTilesK - 1, kSwapMaxTilesK};
  for (long long tk : sizes)
    for (int nw : {1, 2, 3, 4, 8, 16})
      for (int ks : {1, 2, 3, 4, 8}) check(tk, nw, ks);
  std::mt19937_64 rng(18);
  for (int i = 0; i < 2000; ++i)
    check(static_cast<long long>(rng() % (kSwapMaxTilesK + 1)), 1 + static_cast<int>(rng() % 16),
          1 + static_cast<int>(rng() % 8));
}

// The token of a pair in unsigned arithmetic equals the signed quotient for every pair index of a
// forward (p >= 0) and top_k 1..32, at the int range's end too.
TEST(SwapPrologue, PairTokenEqualsSignedQuotient) {
  for (int k = 1; k <= 32; ++k) {
    for (int p = 0; p < 4096; ++p) ASSERT_EQ(static_cast<int>(cuda::kern::swap_pair_token(p, k)), p / k) << p << " " << k;
    for (int p : {0x7fffffff, 0x7ffffffe, 0x40000000, 0x3fffffff})
      ASSERT_EQ(static_cast<int>(cuda::kern::swap_pair_token(p, k)), p / k) << p << " " << k;
  }
}

}  // namespace
}  // namespace lutb::test
