// The weighted objective of the DP fitters (FitOptions::column_weights): "optimal" reaches the exact
// minimum of sum d_c (w - w_hat)^2 (brute force over small tiles), "binned-dp" comes close, equal
// weights give the unweighted bytes, and bad weights are refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fit/fit_test_util.hpp"
#include "lutb/fit.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

// sum d_c (x - y)^2 over a tile in flat order, column c = f % 64.
double weighted_error(const float* x, const std::vector<float>& y, const float* cw) {
  double s = 0.0;
  for (int f = 0; f < 512; ++f) {
    const double d = static_cast<double>(x[f]) - y[f];
    s += static_cast<double>(cw[f % 64]) * (d * d);
  }
  return s;
}

// Independent brute force: the distinct values in ascending order with their total weights; every
// partition into at most 8 contiguous runs (an optimal codebook's clusters are contiguous), each
// run taking the E4M3 * 2^(s-127) candidate of least weighted error found by scanning the whole
// grid; minimum over the partitions and over the scale bytes s in [lo, hi].
double brute_force_weighted(const float* x, const float* cw, int lo, int hi) {
  std::vector<std::pair<float, double>> vw;
  for (int f = 0; f < 512; ++f) vw.push_back({x[f] == 0.0f ? 0.0f : x[f], cw[f % 64]});
  std::sort(vw.begin(), vw.end(), [](auto a, auto b) { return a.first < b.first; });
  std::vector<double> u, w;
  for (const auto& [v, wt] : vw) {
    if (!u.empty() && u.back() == v) {
      w.back() += wt;
    } else {
      u.push_back(v);
      w.push_back(wt);
    }
  }
  const int n = static_cast<int>(u.size());
  double best = std::numeric_limits<double>::infinity();
  for (int s = lo; s <= hi; ++s) {
    std::vector<double> grid;
    for (int b = 0; b < 256; ++b)
      if (!e4m3_is_nan(static_cast<std::uint8_t>(b)))
        grid.push_back(std::ldexp(static_cast<double>(e4m3_to_float(static_cast<std::uint8_t>(b))), s - 127));
    // run[i][j]: least error of values i..j-1 sharing one candidate.
    std::vector<std::vector<double>> run(n, std::vector<double>(n + 1, 0.0));
    for (int i = 0; i < n; ++i)
      for (int j = i + 1; j <= n; ++j) {
        double r = std::numeric_limits<double>::infinity();
        for (double c : grid) {
          double e = 0.0;
          for (int t = i; t < j; ++t) e += w[t] * (u[t] - c) * (u[t] - c);
          r = std::min(r, e);
        }
        run[i][j] = r;
      }
    // Enumerate the boundary sets: bit b of mask set = a run ends after value b (b < n - 1).
    for (std::uint32_t mask = 0; mask < (1u << (n - 1)); ++mask) {
      if (__builtin_popcount(mask) > 7) continue;
      double e = 0.0;
      int start = 0;
      for (int b = 0; b < n; ++b)
        if (b == n - 1 || (mask >> b & 1u)) {
          e += run[start][b + 1];
          start = b + 1;
        }
      best = std::min(best, e);
    }
  }
  return best;
}

std::vector<float> column_weights(std::mt19937_64& rng, double spread) {
  std::lognormal_distribution<double> ln(0.0, spread);
  std::vector<float> cw(64);
  for (auto& v : cw) v = static_cast<float>(ln(rng));
  return cw;
}

// A tile of 512 values drawn from `distinct` random values (so a brute force over partitions is small).
std::vector<float> few_valued_tile(std::mt19937_64& rng, int distinct, double sigma) {
  std::normal_distribution<double> n01(0.0, 1.0);
  std::vector<float> vals(distinct);
  for (auto& v : vals) v = static_cast<float>(sigma * n01(rng));
  std::uniform_int_distribution<int> pick(0, distinct - 1);
  std::vector<float> x(512);
  for (int f = 0; f < 512; ++f) x[f] = vals[f < distinct ? f : pick(rng)];
  return x;
}

// Nearest entry on the dequantised values, ties to the lower index (spec 2.1).
void expect_nearest_assignment(const float* x, const TileBlock& b) {
  const std::vector<int> idx = test::decode_indices(b);
  for (int f = 0; f < 512; ++f) {
    double best = std::numeric_limits<double>::infinity();
    int bj = -1;
    for (int j = 0; j < 8; ++j) {
      const double c = std::ldexp(static_cast<double>(e4m3_to_float(b.codebook[j])), b.scale - 127);
      const double d = std::fabs(static_cast<double>(x[f]) - c);
      if (d < best) {
        best = d;
        bj = j;
      }
    }
    const double got = std::ldexp(static_cast<double>(e4m3_to_float(b.codebook[idx[f]])), b.scale - 127);
    ASSERT_EQ(std::fabs(static_cast<double>(x[f]) - got), best) << "f " << f;
    ASSERT_EQ(idx[f], bj) << "f " << f << ": ties go to the lower index";
  }
}

TEST(WeightedFit, OptimalReachesTheBruteForceMinimum) {
  std::mt19937_64 rng(25);
  for (int trial = 0; trial < 24; ++trial) {
    const int distinct = 9 + trial % 4;  // 9..12 values: more than 8 entries, so the fit must merge
    const double sigma = trial % 3 == 0 ? 1e-3 : (trial % 3 == 1 ? 0.05 : 300.0);  // subnormal, normal, saturating
    const std::vector<float> x = few_valued_tile(rng, distinct, sigma);
    const std::vector<float> cw = column_weights(rng, 1.5);
    FitOptions o;
    o.fitter = "optimal";
    o.column_weights = cw.data();
    const TileFit t = fit_tile(x.data(), o);
    const std::vector<float> y = test::decode_block(t.block);
    const double got = weighted_error(x.data(), y, cw.data());
    EXPECT_NEAR(t.weighted_sse, got, 1e-12 * got) << "trial " << trial;
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    const int r = std::max(3, static_cast<int>(ue8m0_rceil(amax)));
    const double bf = brute_force_weighted(x.data(), cw.data(), std::max(3, r - 4), r + 1);
    EXPECT_LE(got, bf * (1.0 + 1e-12)) << "trial " << trial << ": above the brute-force minimum";
    EXPECT_GE(got, bf * (1.0 - 1e-12)) << "trial " << trial << ": below the brute-force minimum";
    expect_nearest_assignment(x.data(), t.block);
    for (int j = 1; j < 8; ++j)
      EXPECT_LE(e4m3_to_float(t.block.codebook[j - 1]), e4m3_to_float(t.block.codebook[j])) << "ascending codebook";
  }
}

TEST(WeightedFit, WeightedOptimumBeatsTheUnweightedFitOnTheWeightedError) {
  std::mt19937_64 rng(7);
  double gain_total = 0.0;
  for (int trial = 0; trial < 16; ++trial) {
    const std::vector<float> x = test::random_tile(rng, test::Dist::kStudentT5);
    const std::vector<float> cw = column_weights(rng, 1.0);
    FitOptions plain;
    plain.fitter = "optimal";
    FitOptions weighted = plain;
    weighted.column_weights = cw.data();
    const TileFit a = fit_tile(x.data(), plain);
    const TileFit b = fit_tile(x.data(), weighted);
    const double ea = weighted_error(x.data(), test::decode_block(a.block), cw.data());
    const double eb = weighted_error(x.data(), test::decode_block(b.block), cw.data());
    EXPECT_LE(eb, ea * (1.0 + 1e-12)) << "trial " << trial;
    EXPECT_GE(b.sse, a.sse * (1.0 - 1e-12)) << "trial " << trial << ": the unweighted optimum is the least plain error";
    gain_total += ea / eb;
  }
  EXPECT_GT(gain_total / 16, 1.05) << "log-normal(0, 1) column weights should pay at least 5 % on average";
}

TEST(WeightedFit, BinnedDpIsCloseToOptimal) {
  std::mt19937_64 rng(11);
  double e_opt = 0.0, e_bin = 0.0;
  for (int trial = 0; trial < 48; ++trial) {
    const std::vector<float> x = test::random_tile(rng, trial % 2 ? test::Dist::kGaussian : test::Dist::kStudentT5);
    const std::vector<float> cw = column_weights(rng, 1.0);
    FitOptions o;
    o.column_weights = cw.data();
    o.fitter = "optimal";
    const TileFit a = fit_tile(x.data(), o);
    o.fitter = "binned-dp";
    const TileFit b = fit_tile(x.data(), o);
    EXPECT_GE(b.weighted_sse, a.weighted_sse * (1.0 - 1e-12)) << "trial " << trial;
    e_opt += a.weighted_sse;
    e_bin += b.weighted_sse;
  }
  // Unweighted, binned-dp is 0.012 dB (0.3 %) above optimal on real tiles (docs/perf/fitting.md).
  EXPECT_LT(10.0 * std::log10(e_bin / e_opt), 0.05) << "binned-dp more than 0.05 dB above optimal";
}

TEST(WeightedFit, EqualWeightsGiveTheUnweightedBytes) {
  std::mt19937_64 rng(3);
  const LutbShape shape{3, 24, 130, true};  // 3 experts, 24 x 130: column padding in the last tile
  std::vector<float> w(static_cast<std::size_t>(3 * 24 * 130));
  std::normal_distribution<double> n01(0.0, 0.02);
  for (auto& v : w) v = static_cast<float>(n01(rng));
  for (const char* fitter : {"binned-dp", "optimal"}) {
    FitOptions o;
    o.fitter = fitter;
    o.threads = 1;
    FitStats plain_stats;
    const LutbTensor plain = quantize(w.data(), shape, o, &plain_stats);
    for (float c : {1.0f, 0.37f, 1e-20f, 3e10f}) {
      std::vector<float> cw(static_cast<std::size_t>(3 * 130), c);
      for (int e = 0; e < 3; ++e)  // a different constant per expert is still constant per tile
        for (int k = 0; k < 130; ++k) cw[static_cast<std::size_t>(e * 130 + k)] = c * static_cast<float>(e + 1);
      o.column_weights = cw.data();
      FitStats st;
      const LutbTensor t = quantize(w.data(), shape, o, &st);
      EXPECT_EQ(t.packed, plain.packed) << fitter << " weight " << c;
      EXPECT_EQ(t.codebook, plain.codebook) << fitter << " weight " << c;
      EXPECT_EQ(t.scale, plain.scale) << fitter << " weight " << c;
      EXPECT_EQ(st.sse, plain_stats.sse);
      o.column_weights = nullptr;
    }
  }
}

TEST(WeightedFit, StackedWeightsSelectEachExpertsRow) {
  // quantize() of a stack with per-expert weights equals fit_tile() of each tile with that expert's
  // 64 columns, and does not depend on the thread count.
  std::mt19937_64 rng(5);
  const LutbShape shape{2, 8, 128, true};
  std::vector<float> w(static_cast<std::size_t>(2 * 8 * 128));
  std::normal_distribution<double> n01(0.0, 0.02);
  for (auto& v : w) v = static_cast<float>(n01(rng));
  std::vector<float> cw(2 * 128);
  std::lognormal_distribution<double> ln(0.0, 1.0);
  for (auto& v : cw) v = static_cast<float>(ln(rng));
  FitOptions o;
  o.column_weights = cw.data();
  o.threads = 1;
  const LutbTensor t1 = quantize(w.data(), shape, o);
  o.threads = 2;
  const LutbTensor t2 = quantize(w.data(), shape, o);
  EXPECT_EQ(t1.packed, t2.packed);
  EXPECT_EQ(t1.codebook, t2.codebook);
  for (int e = 0; e < 2; ++e)
    for (int tk = 0; tk < 2; ++tk) {
      float tile[512];
      for (int r = 0; r < 8; ++r)
        for (int c = 0; c < 64; ++c) tile[r * 64 + c] = w[static_cast<std::size_t>(e * 8 * 128 + r * 128 + tk * 64 + c)];
      FitOptions ot;
      ot.column_weights = cw.data() + e * 128 + tk * 64;
      const TileFit f = fit_tile(tile, ot);
      const std::size_t t = static_cast<std::size_t>(e * 2 + tk);
      EXPECT_TRUE(std::equal(f.block.packed, f.block.packed + 192, t1.packed.begin() + t * 192)) << e << " " << tk;
      EXPECT_TRUE(std::equal(f.block.codebook, f.block.codebook + 8, t1.codebook.begin() + t * 8));
      EXPECT_EQ(f.block.scale, t1.scale[t]);
    }
}

TEST(WeightedFit, BadWeightsAreRefusedByName) {
  const LutbShape shape{2, 8, 64, true};
  std::vector<float> w(2 * 8 * 64, 0.01f);
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    std::vector<float> cw(2 * 64, 1.0f);
    cw[64 + 5] = bad;
    FitOptions o;
    o.column_weights = cw.data();
    LutbTensor out;
    const std::string msg =
        test::error_of<std::invalid_argument>([&] { quantize(w.data(), DType::F32, shape, out, o, "experts.w2"); });
    EXPECT_NE(msg.find("quantize: tensor experts.w2, expert 1: column weight 5 is "), std::string::npos) << msg;
    EXPECT_NE(msg.find("must be finite and > 0"), std::string::npos) << msg;
    EXPECT_TRUE(out.packed.empty());
  }
  std::vector<float> cw(64, 1.0f);
  FitOptions o;
  o.column_weights = cw.data();
  o.fitter = "ct-lloyd";
  const std::string msg = test::error_of<std::invalid_argument>([&] { fit_tile(w.data(), o); });
  EXPECT_NE(msg.find("'ct-lloyd' has no weighted objective"), std::string::npos) << msg;
}

}  // namespace
}  // namespace lutb
