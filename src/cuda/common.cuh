// src/cuda/common.cuh: error checking and small device helpers shared by the CUDA sources.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace lutb::cuda::detail {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string("lutb::cuda: ") + what + ": " + cudaGetErrorString(e));
}
/// Checks the launch just made (configuration errors); asynchronous faults surface at the next sync.
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

}  // namespace lutb::cuda::detail

#define LUTB_CUDA_CHECK(expr) ::lutb::cuda::detail::check((expr), #expr)
