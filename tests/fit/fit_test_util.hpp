// tests/fit/fit_test_util.hpp: independent helpers for the fitter tests (no library code used for
// decoding, so the tests check the library against a second implementation).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"

namespace lutb::test {

/// Decodes a tile with plain arithmetic: index j of group g at bits 3j of the 24-bit LE word.
inline std::vector<float> decode_block(const TileBlock& b) {
  std::vector<float> out(512);
  for (int g = 0; g < 64; ++g) {
    const std::uint32_t w = b.packed[3 * g] | (b.packed[3 * g + 1] << 8) | (b.packed[3 * g + 2] << 16);
    for (int j = 0; j < 8; ++j) {
      const int idx = (w >> (3 * j)) & 7;
      out[8 * g + j] = static_cast<float>(std::ldexp(static_cast<double>(e4m3_to_float(b.codebook[idx])),
                                                     static_cast<int>(b.scale) - 127));
    }
  }
  return out;
}

inline std::vector<int> decode_indices(const TileBlock& b) {
  std::vector<int> out(512);
  for (int g = 0; g < 64; ++g) {
    const std::uint32_t w = b.packed[3 * g] | (b.packed[3 * g + 1] << 8) | (b.packed[3 * g + 2] << 16);
    for (int j = 0; j < 8; ++j) out[8 * g + j] = (w >> (3 * j)) & 7;
  }
  return out;
}

inline double sse_of(const float* x, const std::vector<float>& y) {
  double s = 0.0;
  for (int i = 0; i < 512; ++i) {
    const double d = static_cast<double>(x[i]) - y[i];
    s += d * d;
  }
  return s;
}

enum class Dist { kGaussian, kStudentT5, kLaplace };

inline std::vector<float> random_tile(std::mt19937_64& rng, Dist d, double sigma = 0.02) {
  std::vector<float> x(512);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::student_t_distribution<double> t5(5.0);
  std::exponential_distribution<double> ex(1.0);
  std::bernoulli_distribution coin(0.5);
  for (auto& v : x) {
    double z = 0.0;
    switch (d) {
      case Dist::kGaussian: z = n01(rng); break;
      case Dist::kStudentT5: z = t5(rng); break;
      case Dist::kLaplace: z = ex(rng) * (coin(rng) ? 1.0 : -1.0); break;
    }
    v = static_cast<float>(z * sigma);
  }
  return x;
}

}  // namespace lutb::test
