// src/cuda/e4m3_encode_check.hpp: exhaustive GPU checks of the device E4M3 / MXFP8 encode
// (src/cuda/e4m3_encode.cuh) against the reference (include/lutb/numerics.hpp, mxfp8.hpp), for
// tests/cuda/moe_e4m3_encode_test.cpp. Plain C++ (no CUDA types).
#pragma once

#include <cstdint>

namespace lutb::cuda::detail {

/// Result of one exhaustive comparison over all 2^32 FP32 bit patterns x (and, for the MXFP8
/// check, every scale byte b in 0..254: 2^32 x 255 cases).
struct EncodeCheck {
  std::uint64_t cases = 0;           // comparisons made
  std::uint64_t mismatches = 0;      // non-NaN x whose byte differs from the reference's
  std::uint64_t nan_cases = 0;       // comparisons with a NaN x
  std::uint64_t nan_not_nan = 0;     // of those, outputs that are not a NaN byte (0x7F / 0xFF)
  std::uint64_t nan_7f = 0;          // of those, outputs 0x7F
  std::uint64_t nan_ff = 0;          // of those, outputs 0xFF
  std::uint64_t nan_ref_differs = 0; // of those, outputs != the reference's byte (0x7F | sign)
  std::uint32_t first_bad_x = 0;     // bits of the smallest mismatching x (valid when mismatches > 0)
  std::uint32_t first_bad_b = 0;     // its scale byte (MXFP8 check)
  std::uint64_t checksum = 0;        // encode_checksum_term summed over the non-NaN cases, mod 2^64
};

/// The checksum's term of one case: (byte + 1) * ((x's bits * 2654435761 mod 2^32) + b), in 64 bits
/// (host and device: the test recomputes the plain encode's sum on the CPU from the reference).
constexpr std::uint64_t encode_checksum_term(std::uint32_t xbits, std::uint32_t b, std::uint32_t byte) {
  return static_cast<std::uint64_t>(byte + 1u) * (static_cast<std::uint64_t>(xbits * 2654435761u) + b);
}

/// kern::e4m3_from_float_dev(x) against lutb::e4m3_from_float(x) for every FP32 bit pattern x,
/// on the current device. Throws std::runtime_error on a CUDA error.
EncodeCheck check_e4m3_encode_exhaustive();

/// kern::mx_encode_dev(x, b) against lutb::mx_encode(x, b) for every FP32 bit pattern x and every
/// scale byte b in [b_first, b_last] (0 <= b_first <= b_last <= 254), on the current device.
EncodeCheck check_mx_encode_exhaustive(int b_first, int b_last);

}  // namespace lutb::cuda::detail
