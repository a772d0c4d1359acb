// tests/fit/fit_scalar_fast_test.cpp: src/fit/fit_scalar_fast.hpp (the GPU fitter's cheaper run-cost
// arithmetic, __host__ __device__, the very code the kernel runs) against src/fit/fit_scalar.hpp
// (the CPU fitter's), bit for bit:
//  - the table of RN(1/c) for every count c = 1..512;
//  - div_by_count(a, c, RN(1/c)) == a / c for EVERY count, on random doubles of every binade and
//    sign, the special values, exact quotients and their neighbours, doubles next to c times a
//    rounding midpoint (the hardest cases for a correction step), every multiple k * 2^-1074 for
//    k < 4096 (subnormal quotients, where exact ties exist) and the guard's edges;
//  - e4m3_nearest_fast == e4m3_nearest exhaustively over the high words of |mu| in [2^-15, 2^10]
//    (both signs, low words 0, 1, 2^31, 2^32 - 1 and a random one), sampled over all other high
//    words; LUTB_EXHAUSTIVE_E4M3=1 runs every high word (2^32, ~1 min);
//  - run_cost_div / run_cost_fast == run_cost and div_by_count == "/" on every (i, j) pair of the
//    DP's own sums (build_sorted's prefix sums scaled as dp.cpp scales them) of random Gaussian,
//    Student-t, Laplace and edge tiles (float subnormals, forced scales 3 and 246, zeros, constants).
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "fit/fit_internal.hpp"
#include "fit/fit_scalar.hpp"
#include "fit/fit_scalar_fast.hpp"
#include "lutb/numerics.hpp"

namespace lutb {
namespace {

using fit_detail::div_by_count;
using fit_detail::e4m3_nearest;
using fit_detail::e4m3_nearest_fast;
using fit_detail::kCountRecip;
using fit_detail::kMaxCount;

std::uint64_t bits(double x) { return __builtin_bit_cast(std::uint64_t, x); }
double from_bits(std::uint64_t b) { return __builtin_bit_cast(double, b); }
double next_up(double x, int k) {  // k steps towards +inf (k may be negative)
  for (; k > 0; --k) x = std::nextafter(x, INFINITY);
  for (; k < 0; ++k) x = std::nextafter(x, -INFINITY);
  return x;
}

// Counts mismatches; reports the first few.
struct DivChecker {
  long long checked = 0, bad = 0;
  void check(double a, int c) {
    const double want = a / static_cast<double>(c);
    const double got = div_by_count(a, kCountRecip[c].c, kCountRecip[c].y);
    ++checked;
    if (bits(got) != bits(want)) {
      if (bad < 5)
        ADD_FAILURE() << "div_by_count(" << std::hexfloat << a << ", " << std::dec << c << ") = " << std::hexfloat
                      << got << ", IEEE " << want;
      ++bad;
    }
  }
};

TEST(FitScalarFast, ReciprocalTableIsCorrectlyRounded) {
  EXPECT_EQ(kCountRecip[0].c, 0.0);
  for (int c = 1; c <= kMaxCount; ++c) {
    const volatile double cv = c;  // division at run time, IEEE round to nearest even
    EXPECT_EQ(bits(kCountRecip[c].c), bits(static_cast<double>(c))) << c;
    EXPECT_EQ(bits(kCountRecip[c].y), bits(1.0 / cv)) << c;
  }
}

TEST(FitScalarFast, DivByCountEqualsIeeeDivisionForEveryCount) {
  static_assert(LDBL_MANT_DIG >= 64, "the midpoint cases need long double with a 64-bit significand");
  std::mt19937_64 rng(20261130);
  DivChecker dc;
  const double specials[] = {0.0,
                             -0.0,
                             INFINITY,
                             -INFINITY,
                             DBL_MAX,
                             -DBL_MAX,
                             DBL_MIN,
                             -DBL_MIN,
                             from_bits(1),
                             from_bits(0x000fffffffffffffull),
                             0x1p-1000,
                             -0x1p-1000,
                             next_up(0x1p-1000, -1),
                             next_up(0x1p-1000, 1),
                             0x1p1017,
                             next_up(0x1p1017, -1),
                             next_up(0x1p1017, 1),
                             0x1.00001p1017,
                             0x1p1018,
                             1.0,
                             -1.0,
                             448.0,
                             512.0,
                             0x1p-268,
                             3.0 * 0x1p-268};
  for (int c = 1; c <= kMaxCount; ++c) {
    const double cd = c;
    for (double a : specials) dc.check(a, c);
    // Random bit patterns: every binade (uniform exponent), both signs; NaNs included (the IEEE
    // division and the fallback are the same operation, so even the NaN payloads agree).
    for (int r = 0; r < 20000; ++r) dc.check(from_bits(rng()), c);
    // Random values of the DP's magnitudes (scaled units: 2^-30 .. 2^18).
    std::uniform_real_distribution<double> ex(-30.0, 18.0);
    for (int r = 0; r < 5000; ++r) {
      const double a = std::exp2(ex(rng)) * (rng() & 1 ? 1.0 : -1.0);
      dc.check(a, c);
    }
    // Exact quotients a = c * q (q with at most 44 significant bits, so the product is exact) and
    // their neighbours; across binades incl. the subnormal range.
    for (int r = 0; r < 3000; ++r) {
      const int e = static_cast<int>(rng() % 2080) - 1070;
      const double q = std::ldexp(static_cast<double>((rng() >> 20) | (1ull << 43)), e - 43);
      const double a = cd * q;
      for (int k = -3; k <= 3; ++k) dc.check(next_up(a, k), c);
      dc.check(-a, c);
    }
    // Doubles next to c * mu for a rounding midpoint mu = q + ulp(q)/2 (54 significant bits; c * mu
    // has at most 63 and is exact in long double): the quotient is then within a few ulp/c of a
    // rounding boundary, the correction step's hardest case.
    for (int r = 0; r < 3000; ++r) {
      const int e = static_cast<int>(rng() % 200) - 100;
      const double q = std::ldexp(static_cast<double>((rng() >> 11) | (1ull << 52)), e - 52);
      const long double mu = static_cast<long double>(q) + std::ldexp(1.0L, e - 53);
      const long double exact = mu * static_cast<long double>(c);
      const double a0 = static_cast<double>(exact);
      for (int k = -2; k <= 2; ++k) {
        dc.check(next_up(a0, k), c);
        dc.check(-next_up(a0, k), c);
      }
    }
    // Every k * 2^-1074 for k < 4096: subnormal quotients, exact ties (even c), the fallback.
    for (int k = 0; k < 4096; ++k) dc.check(from_bits(static_cast<std::uint64_t>(k)), c);
  }
  EXPECT_EQ(dc.bad, 0) << "of " << dc.checked;
  EXPECT_GT(dc.checked, 30'000'000);
}

// e4m3_nearest_fast vs e4m3_nearest for a high word and a set of low words, both signs.
long long e4m3_check_hi(std::uint32_t hi, const std::uint32_t* los, int nlo, long long& bad) {
  long long n = 0;
  for (int s = 0; s < 2; ++s)
    for (int l = 0; l < nlo; ++l) {
      const double mu = from_bits((static_cast<std::uint64_t>(hi ^ (s ? 0x80000000u : 0u)) << 32) | los[l]);
      const double want = e4m3_nearest(mu), got = e4m3_nearest_fast(mu);
      ++n;
      if (bits(want) != bits(got)) {
        if (bad < 5)
          ADD_FAILURE() << "e4m3_nearest_fast(" << std::hexfloat << mu << ") = " << got << ", e4m3_nearest " << want;
        ++bad;
      }
    }
  return n;
}

TEST(FitScalarFast, E4m3NearestFastEqualsE4m3Nearest) {
  std::mt19937_64 rng(7);
  long long bad = 0, n = 0;
  const bool full = std::getenv("LUTB_EXHAUSTIVE_E4M3") != nullptr;
  // Exhaustive over the high words of [2^-15, 2^10] (every E4M3 value, both roundings, the
  // subnormal branch, the ties, the saturation at 448), and (full) over all of them.
  const std::uint32_t lo_hi = full ? 0u : 0x3f000000u, hi_hi = full ? 0x7fffffffu : 0x40900000u;
  for (std::uint64_t hi = lo_hi; hi <= hi_hi; ++hi) {
    const std::uint32_t los[5] = {0u, 1u, 0x80000000u, 0xffffffffu, static_cast<std::uint32_t>(rng())};
    n += e4m3_check_hi(static_cast<std::uint32_t>(hi), los, 5, bad);
  }
  // Sampled elsewhere: every 4093rd high word over the whole range.
  for (std::uint64_t hi = 0; hi <= 0x7fffffffu; hi += 4093) {
    const std::uint32_t los[3] = {0u, 0xffffffffu, static_cast<std::uint32_t>(rng())};
    n += e4m3_check_hi(static_cast<std::uint32_t>(hi), los, 3, bad);
  }
  // The E4M3 grid itself, its midpoints and their neighbours.
  for (int b = 0; b < 256; ++b) {
    if (e4m3_is_nan(static_cast<std::uint8_t>(b))) continue;
    const double v = e4m3_to_float(static_cast<std::uint8_t>(b));
    for (int k = -2; k <= 2; ++k) {
      const std::uint64_t vb = bits(next_up(v, k));
      const std::uint32_t los[1] = {static_cast<std::uint32_t>(vb)};
      n += e4m3_check_hi(static_cast<std::uint32_t>(vb >> 32) & 0x7fffffffu, los, 1, bad);
    }
  }
  EXPECT_EQ(bad, 0) << "of " << n;
}

// The DP's own sums: build_sorted's prefix sums of a tile scaled as dp.cpp scales them; every pair
// i < j of distinct-value positions, i.e. every run any DP layer or the refinement can evaluate.
struct PairStats {
  long long pairs = 0, bad_div = 0, bad_cost_div = 0, bad_cost_fast = 0, fallback = 0, fallback_nonzero = 0;
};

void check_tile_pairs(const std::vector<float>& x, int scale, PairStats& ps) {
  fit_detail::SortedTile st;
  fit_detail::build_sorted(x.data(), st);
  const double inv = fit_detail::pow2(127 - scale), inv2 = inv * inv;
  std::vector<double> cd(st.n + 1), s1(st.n + 1), s2(st.n + 1);
  for (int i = 0; i <= st.n; ++i) {
    cd[i] = static_cast<double>(st.cnt[i]);
    s1[i] = st.p1[i] * inv;
    s2[i] = st.p2[i] * inv2;
    // The GPU kernel scales the prefix sums in place, once per scale and from one scale to the
    // next (src/cuda/fit/sm80_lutb_fit_warp.cuh, prescale): exact because every product stays normal.
    for (const double v : {s1[i], s2[i]}) {
      ASSERT_TRUE(v == 0.0 || (std::fabs(v) >= DBL_MIN && std::fabs(v) <= 0x1p600)) << std::hexfloat << v;
    }
    const double f = fit_detail::pow2(1), step1 = (st.p1[i] * (inv * 2.0)) * (1.0 / f);
    ASSERT_EQ(bits(step1), bits(s1[i]));
  }
  for (int j = 1; j <= st.n; ++j)
    for (int i = 0; i < j; ++i) {
      const double cc = cd[j] - cd[i], a = s1[j] - s1[i], b = s2[j] - s2[i];
      const int c = st.cnt[j] - st.cnt[i];
      ASSERT_EQ(bits(kCountRecip[c].c), bits(cc));
      const double y = kCountRecip[c].y;
      ++ps.pairs;
      if (!(std::fabs(a) >= 0x1p-1000)) {
        ++ps.fallback;
        if (a != 0.0) ++ps.fallback_nonzero;
      }
      if (bits(div_by_count(a, cc, y)) != bits(a / cc)) ++ps.bad_div;
      const double want = fit_detail::run_cost(cc, a, b);
      if (bits(fit_detail::run_cost_div(cc, y, a, b)) != bits(want)) ++ps.bad_cost_div;
      if (bits(fit_detail::run_cost_fast(cc, y, a, b)) != bits(want)) {
        if (ps.bad_cost_fast < 3)
          ADD_FAILURE() << "run_cost_fast(" << cc << ", " << std::hexfloat << a << ", " << b << ") != run_cost";
        ++ps.bad_cost_fast;
      }
    }
}

TEST(FitScalarFast, RunCostFastEqualsRunCostOnTheDpSums) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::student_t_distribution<float> st3(3.0f);
  std::exponential_distribution<float> ex(1.0f);
  PairStats ps;
  auto bf16 = [](float v) { return bf16_to_float(bf16_from_float(v)); };
  auto run = [&](const std::vector<float>& x, bool forced) {
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    const int rc = amax == 0.0f ? 127 : std::max(fit_detail::rceil_scale(amax), 3);
    if (rc <= 246) {
      check_tile_pairs(x, rc, ps);
      if (rc > 3) check_tile_pairs(x, rc - 1, ps);  // optimal's second scale
    }
    if (forced) {
      check_tile_pairs(x, 3, ps);
      check_tile_pairs(x, 246, ps);
    }
  };
  std::vector<float> x(kTileSize);
  for (int t = 0; t < 36; ++t) {  // random tiles, BF16 and FP32, sigma 0.02 and 1
    const float sigma = t % 4 < 2 ? 0.02f : 1.0f;
    for (auto& v : x) {
      float r = t % 3 == 0 ? g(rng) : t % 3 == 1 ? st3(rng) : ex(rng) * (rng() & 1 ? 1.0f : -1.0f);
      v = sigma * r;
      if (t % 2 == 0) v = bf16(v);
    }
    run(x, t % 6 == 0);
  }
  // Edge tiles: float subnormals and tiny magnitudes (forced scales 3 and 246: sums down to 2^-268),
  // zeros with a few values, +0/-0, constants, sparse tiles with cancelling sums.
  std::uniform_real_distribution<float> ue(-148.0f, -120.0f);
  for (auto& v : x) v = std::exp2(ue(rng)) * (rng() & 1 ? 1.0f : -1.0f);
  run(x, true);
  for (int i = 0; i < kTileSize; ++i) x[i] = __builtin_bit_cast(float, static_cast<std::uint32_t>(1 + i % 37)) * (i % 2 ? 1.0f : -1.0f);
  run(x, true);
  std::fill(x.begin(), x.end(), 0.0f);
  x[3] = 1e-3f;
  x[100] = -1e-3f;
  x[200] = -0.0f;
  x[300] = 2.5f;
  run(x, true);
  for (int i = 0; i < kTileSize; ++i) x[i] = (i % 5 == 0) ? static_cast<float>((i % 7) - 3) * 0.125f : 0.0f;
  run(x, true);
  std::fill(x.begin(), x.end(), 0.0137f);
  run(x, true);
  for (int i = 0; i < kTileSize; ++i) x[i] = static_cast<float>(i - 255) * 0x1p-10f;  // 512 distinct, symmetric
  run(x, true);
  EXPECT_EQ(ps.bad_div, 0);
  EXPECT_EQ(ps.bad_cost_div, 0);
  EXPECT_EQ(ps.bad_cost_fast, 0);
  EXPECT_GT(ps.pairs, 3'000'000);
  EXPECT_EQ(ps.fallback_nonzero, 0) << "the DP's nonzero sums are >= 2^-268 in magnitude";
  std::printf("DP pairs checked: %lld (IEEE-division fallback: %lld)\n", ps.pairs, ps.fallback);
}

}  // namespace
}  // namespace lutb
