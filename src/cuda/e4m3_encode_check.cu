// src/cuda/e4m3_encode_check.cu: the exhaustive GPU checks of e4m3_encode_check.hpp (test support:
// no forward calls these).
#include <cstdint>
#include <stdexcept>

#include "cuda/common.cuh"
#include "cuda/e4m3_encode.cuh"
#include "lutb/mxfp8.hpp"
#include "lutb/numerics.hpp"
#include "cuda/e4m3_encode_check.hpp"

namespace lutb::cuda {
namespace {

// Counters in device memory: EncodeCheck's 64-bit fields in order, then the smallest bad case
// (x bits | b << 32, as one 64-bit value for atomicMin).
struct DevCounters {
  unsigned long long cases, mismatches, nan_cases, nan_not_nan, nan_7f, nan_ff, nan_ref_differs, checksum, first_bad;
};

// Each thread takes 2^32 / (gridDim.x * blockDim.x) consecutive x (grid and block powers of two),
// each against every b in [b0, b1] (b0 < 0: the plain encode, one case per x), and adds its counts
// to the global counters once at the end.
__global__ void __launch_bounds__(256) e4m3_encode_check(int b0, int b1, DevCounters* c) {
  const unsigned long long threads = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  const unsigned long long per = (1ull << 32) / threads;
  const unsigned long long tid = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned long long cases = 0, bad = 0, nan = 0, nan_not_nan = 0, n7f = 0, nff = 0, nan_ref = 0, sum = 0;
  unsigned long long first = ~0ull;
  const bool plain = b0 < 0;
  const int lo = plain ? 0 : b0, hi = plain ? 0 : b1;
  for (unsigned long long i = 0; i < per; ++i) {
    const unsigned xb = static_cast<unsigned>(tid * per + i);
    const float x = __uint_as_float(xb);
    const bool is_nan = (xb & 0x7fffffffu) > 0x7f800000u;
    for (int b = lo; b <= hi; ++b) {
      const unsigned char got = plain ? kern::e4m3_from_float_dev(x) : kern::mx_encode_dev(x, static_cast<unsigned char>(b));
      const unsigned char want = plain ? e4m3_from_float(x) : mx_encode(x, static_cast<unsigned char>(b));
      ++cases;
      if (is_nan) {
        ++nan;
        nan_not_nan += e4m3_is_nan(got) ? 0 : 1;
        n7f += got == 0x7f;
        nff += got == 0xff;
        nan_ref += got != want;
      } else {
        sum += detail::encode_checksum_term(xb, static_cast<unsigned>(plain ? 0 : b), got);
        if (got != want) {
          ++bad;
          first = min(first, static_cast<unsigned long long>(xb) | (static_cast<unsigned long long>(b) << 32));
        }
      }
    }
  }
  atomicAdd(&c->cases, cases);
  atomicAdd(&c->mismatches, bad);
  atomicAdd(&c->nan_cases, nan);
  atomicAdd(&c->nan_not_nan, nan_not_nan);
  atomicAdd(&c->nan_7f, n7f);
  atomicAdd(&c->nan_ff, nff);
  atomicAdd(&c->nan_ref_differs, nan_ref);
  atomicAdd(&c->checksum, sum);
  if (bad) atomicMin(&c->first_bad, first);
}

detail::EncodeCheck run_check(int b0, int b1) {
  DevCounters* d = nullptr;
  LUTB_CUDA_CHECK(cudaMalloc(&d, sizeof(DevCounters)));
  DevCounters h{};
  h.first_bad = ~0ull;
  detail::EncodeCheck r;
  try {
    LUTB_CUDA_CHECK(cudaMemcpy(d, &h, sizeof h, cudaMemcpyHostToDevice));
    e4m3_encode_check<<<1 << 14, 256>>>(b0, b1, d);  // 2^22 threads, 2^10 x each
    detail::check_launch("e4m3_encode_check");
    LUTB_CUDA_CHECK(cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost));
  } catch (...) {
    cudaFree(d);
    throw;
  }
  LUTB_CUDA_CHECK(cudaFree(d));
  r.cases = h.cases;
  r.mismatches = h.mismatches;
  r.nan_cases = h.nan_cases;
  r.nan_not_nan = h.nan_not_nan;
  r.nan_7f = h.nan_7f;
  r.nan_ff = h.nan_ff;
  r.nan_ref_differs = h.nan_ref_differs;
  r.checksum = h.checksum;
  r.first_bad_x = static_cast<std::uint32_t>(h.first_bad & 0xffffffffu);
  r.first_bad_b = static_cast<std::uint32_t>(h.first_bad >> 32);
  return r;
}

}  // namespace

namespace detail {

EncodeCheck check_e4m3_encode_exhaustive() { return run_check(-1, -1); }

EncodeCheck check_mx_encode_exhaustive(int b_first, int b_last) {
  if (b_first < 0 || b_last > 254 || b_first > b_last) throw std::invalid_argument("check_mx_encode_exhaustive: b range");
  return run_check(b_first, b_last);
}

}  // namespace detail
}  // namespace lutb::cuda
