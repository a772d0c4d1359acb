// ct-lloyd and multistart against a tiny independent re-implementation of spec section 2.1
// (compressed-tensors #801, vLLM #51880), written separately from src/fit/lloyd.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "fit/fit_test_util.hpp"
#include "lutb/fit.hpp"

namespace lutb {
namespace {

using Cb = std::vector<float>;

int nearest(const Cb& c, float x) {  // squared distance, first index on ties
  int b = 0;
  for (int j = 1; j < static_cast<int>(c.size()); ++j) {
    const double dj = (static_cast<double>(x) - c[j]) * (static_cast<double>(x) - c[j]);
    const double db = (static_cast<double>(x) - c[b]) * (static_cast<double>(x) - c[b]);
    if (dj < db) b = j;
  }
  return b;
}

void snap(Cb& c) {
  for (auto& v : c) v = e4m3_to_float(e4m3_from_float(v));
  std::sort(c.begin(), c.end());
}

Cb farthest(const std::vector<float>& x) {
  double m = 0.0;
  for (float v : x) m += v;
  Cb c{static_cast<float>(m / x.size())};
  while (c.size() < 8) {
    double far = -1.0;
    float pick = 0.0f;
    for (float v : x) {
      double d = 1e300;
      for (float cc : c) d = std::min(d, std::fabs(static_cast<double>(v) - cc));
      if (d > far) {
        far = d;
        pick = v;
      }
    }
    c.push_back(pick);
  }
  snap(c);
  return c;
}

void iterate(const std::vector<float>& x, Cb& c, int iters) {
  for (int it = 0; it < iters; ++it) {
    std::vector<double> s(8, 0.0);
    std::vector<int> n(8, 0);
    for (float v : x) {
      const int j = nearest(c, v);
      s[j] += v;
      n[j] += 1;
    }
    for (int j = 0; j < 8; ++j)
      if (n[j]) c[j] = static_cast<float>(s[j] / n[j]);
    snap(c);
  }
}

double err(const std::vector<float>& x, const Cb& c) {
  double e = 0.0;
  for (float v : x) {
    const double d = static_cast<double>(v) - c[nearest(c, v)];
    e += d * d;
  }
  return e;
}

std::vector<std::vector<float>> fixed_tiles() {
  std::mt19937_64 rng(2024);
  std::vector<std::vector<float>> t;
  t.push_back(test::random_tile(rng, test::Dist::kGaussian, 0.02));
  t.push_back(test::random_tile(rng, test::Dist::kStudentT5, 0.5));
  t.push_back(test::random_tile(rng, test::Dist::kLaplace, 3.0));
  std::vector<float> ramp(512);
  for (int i = 0; i < 512; ++i) ramp[i] = (i - 200) * 0.01f;
  t.push_back(ramp);
  return t;
}

TEST(CtLloydReference, MatchesIndependentImplementation) {
  for (const auto& x : fixed_tiles()) {
    Cb c = farthest(x);
    iterate(x, c, 8);
    FitOptions o;
    o.fitter = "ct-lloyd";
    const TileFit f = fit_tile(x.data(), o);
    EXPECT_EQ(f.block.scale, 127);
    EXPECT_EQ(f.sse, err(x, c));
    std::vector<float> ours;
    for (int j = 0; j < 8; ++j) ours.push_back(e4m3_to_float(f.block.codebook[j]));
    Cb uniq = c;
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
    for (std::size_t j = 0; j < 8; ++j) EXPECT_EQ(ours[j], uniq[std::min(j, uniq.size() - 1)]) << j;
  }
}

TEST(MultistartReference, MatchesIndependentImplementation) {
  for (const auto& x : fixed_tiles()) {
    std::vector<float> s = x;
    std::sort(s.begin(), s.end());
    Cb q, l;
    for (int i = 0; i < 8; ++i) {
      const double p = (i + 0.5) / 8.0 * 511.0;
      const int lo = static_cast<int>(p);
      q.push_back(static_cast<float>(s[lo] + (p - lo) * (static_cast<double>(s[lo + 1]) - s[lo])));
      l.push_back(static_cast<float>(s[0] + (static_cast<double>(s[511]) - s[0]) * i / 7.0));
    }
    snap(q);
    snap(l);
    Cb starts[3] = {farthest(x), q, l};
    double best = 1e300;
    for (auto& c : starts) {
      iterate(x, c, 16);
      best = std::min(best, err(x, c));
    }
    FitOptions o;
    o.fitter = "multistart";
    const TileFit f = fit_tile(x.data(), o);
    EXPECT_EQ(f.block.scale, 127);
    EXPECT_EQ(f.sse, best);
  }
}

}  // namespace
}  // namespace lutb
