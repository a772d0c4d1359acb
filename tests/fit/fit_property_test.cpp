// Property tests of the fitters on random and special tiles (spec section 2.1).
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

namespace lutb {
namespace {

using test::Dist;

// Independent exact DP without the divide-and-conquer speed-up and without de-duplication:
// O(8 n^2) over the 512 sorted values, candidates found by scanning the whole E4M3 grid.
double brute_force_optimum(std::vector<float> x, int s) {
  std::sort(x.begin(), x.end());
  std::vector<double> grid;
  for (int b = 0; b < 256; ++b)
    if (!e4m3_is_nan(static_cast<std::uint8_t>(b)))
      grid.push_back(std::ldexp(static_cast<double>(e4m3_to_float(static_cast<std::uint8_t>(b))), s - 127));
  const int n = 512;
  std::vector<double> p1(n + 1, 0.0), p2(n + 1, 0.0);
  for (int i = 0; i < n; ++i) {
    p1[i + 1] = p1[i] + x[i];
    p2[i + 1] = p2[i] + static_cast<double>(x[i]) * x[i];
  }
  // Candidates: the two grid neighbours of the segment mean (the cost is a parabola in c).
  std::sort(grid.begin(), grid.end());
  auto cost_fast = [&](int i, int j) {
    const double a = p1[j] - p1[i], b = p2[j] - p2[i];
    const int c = j - i;
    const double m = a / c;
    auto it = std::lower_bound(grid.begin(), grid.end(), m);
    double best = std::numeric_limits<double>::infinity();
    for (auto jt : {it, it == grid.begin() ? it : it - 1})
      if (jt != grid.end()) best = std::min(best, b - 2 * *jt * a + c * *jt * *jt);
    return best;
  };
  std::vector<double> prev(n + 1), cur(n + 1);
  for (int j = 1; j <= n; ++j) prev[j] = cost_fast(0, j);
  for (int k = 2; k <= 8; ++k) {
    for (int j = k; j <= n; ++j) {
      double best = std::numeric_limits<double>::infinity();
      for (int i = k - 1; i < j; ++i) best = std::min(best, prev[i] + cost_fast(i, j));
      cur[j] = best;
    }
    std::swap(prev, cur);
  }
  return prev[n];
}

TEST(FitProperty, OptimalMatchesBruteForceDp) {
  std::mt19937_64 rng(7);
  for (int rep = 0; rep < 6; ++rep) {
    auto x = test::random_tile(rng, static_cast<Dist>(rep % 3));
    if (rep >= 3)  // BF16 values: many duplicates, as in real checkpoints
      for (auto& v : x) v = bf16_round(v);
    float amax = 0.0f;
    for (float v : x) amax = std::max(amax, std::fabs(v));
    const int s = ue8m0_rceil(amax);
    for (int sc : {s - 1, s}) {
      FitOptions o;
      o.fitter = "optimal";
      o.forced_scale = sc;
      const double got = fit_tile(x.data(), o).sse;
      const double want = brute_force_optimum(x, sc);
      EXPECT_NEAR(got, want, 1e-9 * want) << "scale " << sc;
    }
  }
}

TEST(FitProperty, ReportedErrorIsDecodedErrorAndAssignmentIsNearest) {
  std::mt19937_64 rng(11);
  for (const auto& name : fitter_names()) {
    for (int rep = 0; rep < 6; ++rep) {
      const auto x = test::random_tile(rng, static_cast<Dist>(rep % 3), rep < 3 ? 0.02 : 3.0);
      FitOptions o;
      o.fitter = name;
      const TileFit f = fit_tile(x.data(), o);
      SCOPED_TRACE(name + " rep " + std::to_string(rep));
      const auto y = test::decode_block(f.block);
      EXPECT_EQ(f.sse, test::sse_of(x.data(), y));
      float lib[512];  // the library's decoder (src/core) agrees with the test's
      dequantize_tile(f.block.packed, f.block.codebook, f.block.scale, lib);
      EXPECT_TRUE(std::equal(lib, lib + 512, y.begin()));
      double ss = 0.0;
      for (float v : x) ss += static_cast<double>(v) * v;
      EXPECT_EQ(f.sum_sq, ss);
      // Ascending codebook, scale in range, nearest entry with ties to the lower index.
      double cb[8];
      for (int j = 0; j < 8; ++j) cb[j] = std::ldexp(static_cast<double>(e4m3_to_float(f.block.codebook[j])), f.block.scale - 127);
      for (int j = 1; j < 8; ++j) EXPECT_LE(cb[j - 1], cb[j]);
      EXPECT_GE(f.block.scale, 3);
      EXPECT_LE(f.block.scale, 246);
      const auto idx = test::decode_indices(f.block);
      for (int i = 0; i < 512; ++i) {
        const double d = std::fabs(x[i] - cb[idx[i]]);
        for (int j = 0; j < 8; ++j) {
          const double dj = std::fabs(x[i] - cb[j]);
          if (j < idx[i]) EXPECT_GT(dj, d) << "position " << i;
          else EXPECT_GE(dj, d) << "position " << i;
        }
      }
    }
  }
}

TEST(FitProperty, OptimalNeverWorseThanOtherFitters) {
  std::mt19937_64 rng(13);
  for (int rep = 0; rep < 9; ++rep) {
    const auto x = test::random_tile(rng, static_cast<Dist>(rep % 3));
    FitOptions o;
    o.fitter = "optimal";
    const double opt = fit_tile(x.data(), o).sse;
    for (const auto& name : fitter_names()) {
      FitOptions fo;
      fo.fitter = name;
      EXPECT_GE(fit_tile(x.data(), fo).sse, opt * (1 - 1e-12)) << name;
    }
  }
}

TEST(FitProperty, ConstantAndZeroTilesAreExact) {
  for (const auto& name : fitter_names()) {
    std::vector<float> zero(512, 0.0f);
    FitOptions o;
    o.fitter = name;
    const TileFit z = fit_tile(zero.data(), o);
    EXPECT_EQ(z.sse, 0.0) << name;
    EXPECT_EQ(z.block.scale, 127) << name;
    for (int j = 0; j < 8; ++j) EXPECT_EQ(z.block.codebook[j], 0x00) << name;
    std::vector<float> neg0(512, -0.0f);
    EXPECT_EQ(fit_tile(neg0.data(), o).sse, 0.0) << name;
    // A constant representable at scale 127 is exact for every fitter.
    std::vector<float> c(512, -0.375f);
    const TileFit t = fit_tile(c.data(), o);
    EXPECT_EQ(t.sse, 0.0) << name;
    for (int j = 0; j < 8; ++j) EXPECT_EQ(t.block.codebook[j], t.block.codebook[0]) << name;
  }
  // Constants needing a scale (tiny or large) are exact for the scaled fitters, as are 8 levels.
  for (const char* name : {"optimal", "binned-dp"}) {
    for (int e : {-100, -8, 70}) {
      std::vector<float> c(512, std::ldexp(1.625f, e));
      FitOptions o;
      o.fitter = name;
      EXPECT_EQ(fit_tile(c.data(), o).sse, 0.0) << name << " 2^" << e;
    }
    std::vector<float> lv(512);
    const float levels[8] = {-0.5f, -0.25f, -0.125f, 0.0f, 0.0625f, 0.125f, 0.25f, 0.75f};
    for (int i = 0; i < 512; ++i) lv[i] = levels[(i * 5) % 8] * 0.0009765625f;
    FitOptions o;
    o.fitter = name;
    EXPECT_EQ(fit_tile(lv.data(), o).sse, 0.0) << name;
  }
}

TEST(FitProperty, TinyTilesUseScale3AndHugeTilesAreRejected) {
  std::vector<float> tiny(512, 0.0f);
  tiny[5] = 1e-40f;  // FP32 subnormal: rceil below 3
  FitOptions o;
  o.fitter = "optimal";
  EXPECT_EQ(fit_tile(tiny.data(), o).block.scale, 3);
  std::vector<float> huge(512, 1.0f);
  huge[100] = 3.0e38f;  // needs scale byte 247
  for (const auto& name : fitter_names()) {
    FitOptions fo;
    fo.fitter = name;
    EXPECT_THROW(fit_tile(huge.data(), fo), std::invalid_argument) << name;
  }
  FitOptions bad;
  bad.forced_scale = 2;
  EXPECT_THROW(fit_tile(tiny.data(), bad), std::invalid_argument);
}

TEST(FitProperty, NonFiniteValuesNameTheTile) {
  std::vector<float> x(512, 0.01f);
  x[3 * 64 + 7] = std::numeric_limits<float>::quiet_NaN();
  try {
    fit_tile(x.data());
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("NaN at tile row 3 col 7"), std::string::npos) << e.what();
  }
  // Bulk: expert 1, row 13, col 70 of a [2, 20, 130] stack -> tile (1, 1).
  const LutbShape shape{2, 20, 130, true};
  std::vector<float> w(2 * 20 * 130, 0.02f);
  w[20 * 130 + 13 * 130 + 70] = -std::numeric_limits<float>::infinity();
  w[20 * 130 + 19 * 130 + 129] = std::numeric_limits<float>::infinity();  // later tile: not reported
  for (int threads : {1, 2}) {
    FitOptions o;
    o.threads = threads;
    try {
      quantize(w.data(), shape, o, nullptr, "model.layers.0.mlp.experts.w13");
      FAIL() << "no throw";
    } catch (const std::invalid_argument& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("model.layers.0.mlp.experts.w13"), std::string::npos) << m;
      EXPECT_NE(m.find("expert 1"), std::string::npos) << m;
      EXPECT_NE(m.find("tile (1, 1)"), std::string::npos) << m;
      EXPECT_NE(m.find("-Inf at row 13 col 70"), std::string::npos) << m;
    }
  }
}

// A magnitude needing a scale byte above 246 is printed as the shortest decimal that reads back as the
// value (the GPU fitter's message is the same), not std::to_string's 39 digits and ".000000".
TEST(FitProperty, TooLargeMagnitudeIsReadable) {
  std::vector<float> x(512, 0.01f);
  x[2 * 64 + 5] = -3.3e38f;
  try {
    fit_tile(x.data());
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "fit_tile: magnitude 3.3e+38 needs a scale byte above 246 (spec section 2)");
  }
  const LutbShape shape{1, 16, 128, false};
  std::vector<float> w(16 * 128, 0.02f);
  w[9 * 128 + 70] = std::numeric_limits<float>::max();
  LutbTensor out;
  try {
    quantize(w.data(), DType::F32, shape, out, {}, "w");
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "quantize: tensor w, tile (1, 1): magnitude 3.4028235e+38 needs a scale byte above 246 (spec section 2)");
  }
}

TEST(FitProperty, BulkIsDeterministicAcrossThreadsAndMatchesFitTile) {
  std::mt19937_64 rng(17);
  const LutbShape shape{3, 20, 150, true};  // padded: 24 x 192, 3 x 3 tiles per expert
  std::vector<std::uint16_t> bf(3 * 20 * 150);
  std::normal_distribution<float> n(0.0f, 0.03f);
  for (auto& v : bf) v = bf16_from_float(n(rng));
  for (const auto& name : fitter_names()) {
    LutbTensor a, b;
    FitOptions o1, o2;
    o1.fitter = o2.fitter = name;
    o1.threads = 1;
    o2.threads = 2;
    const FitStats s1 = quantize(bf.data(), DType::BF16, shape, a, o1, "w");
    const FitStats s2 = quantize(bf.data(), DType::BF16, shape, b, o2, "w");
    EXPECT_EQ(a.packed, b.packed) << name;
    EXPECT_EQ(a.codebook, b.codebook) << name;
    EXPECT_EQ(a.scale, b.scale) << name;
    EXPECT_EQ(s1.sse, s2.sse) << name;
    EXPECT_EQ(s1.tiles, 27);
    ASSERT_EQ(a.packed.size(), 27u * 192);
    // Tile (e=2, tn=2, tk=2) equals fit_tile on the zero-padded gathered values.
    float x[512];
    for (int r = 0; r < 8; ++r)
      for (int c = 0; c < 64; ++c) {
        const int row = 16 + r, col = 128 + c;
        x[r * 64 + c] = (row < 20 && col < 150) ? bf16_to_float(bf[2 * 20 * 150 + row * 150 + col]) : 0.0f;
      }
    const TileFit f = fit_tile(x, o1);
    const std::size_t t = 2 * 9 + 2 * 3 + 2;
    EXPECT_TRUE(std::equal(f.block.packed, f.block.packed + 192, a.packed.begin() + t * 192)) << name;
    EXPECT_TRUE(std::equal(f.block.codebook, f.block.codebook + 8, a.codebook.begin() + t * 8)) << name;
    EXPECT_EQ(f.block.scale, a.scale[t]) << name;
  }
}

TEST(FitProperty, SourceTypesAgree) {
  // BF16 and F16 sources equal the FP32 source of the same (exactly converted) values.
  std::mt19937_64 rng(19);
  const LutbShape shape{1, 16, 64, false};
  std::vector<float> f32(16 * 64);
  std::vector<std::uint16_t> f16(16 * 64);
  std::normal_distribution<float> n(0.0f, 0.05f);
  for (std::size_t i = 0; i < f32.size(); ++i) {
    f16[i] = fp16_from_float(n(rng));
    f32[i] = fp16_to_float(f16[i]);
  }
  LutbTensor a, b;
  quantize(f32.data(), DType::F32, shape, a);
  quantize(f16.data(), DType::F16, shape, b);
  EXPECT_EQ(a.packed, b.packed);
  EXPECT_EQ(a.codebook, b.codebook);
  EXPECT_EQ(a.scale, b.scale);
  LutbTensor c;
  EXPECT_THROW(quantize(f32.data(), DType::I32, shape, c), std::invalid_argument);
}

TEST(FitProperty, FitterNames) {
  const auto names = fitter_names();
  ASSERT_EQ(names.size(), 4u);
  EXPECT_EQ(names[0], default_fitter());
  EXPECT_NO_THROW(check_fitter_name("optimal"));
  try {
    check_fitter_name("kmeans");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("kmeans"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("ct-lloyd"), std::string::npos);
  }
  FitOptions o;
  o.fitter = "ct-lloyd";
  o.forced_scale = 120;
  std::vector<float> x(512, 0.1f);
  EXPECT_THROW(fit_tile(x.data(), o), std::invalid_argument);
}

TEST(FitStatsTest, Sqnr) {
  FitStats s;
  s.sum_sq = 100.0;
  s.sse = 1.0;
  EXPECT_DOUBLE_EQ(s.sqnr_db(), 20.0);
  s.sse = 0.0;
  EXPECT_TRUE(std::isinf(s.sqnr_db()));
}

TEST(FitStatsTest, OfTilesSumsInTileOrder) {
  // 1 + 1e-16 + 1e-16 in that order rounds back to 1 at each step; the stats keep tile order.
  const FitStats s = FitStats::of_tiles({1.0, 1e-16, 1e-16}, {4.0, 5.0, 6.0});
  EXPECT_EQ(s.tiles, 3);
  EXPECT_EQ(s.sse, 1.0);
  EXPECT_EQ(s.sum_sq, 15.0);
  EXPECT_EQ(FitStats::of_tiles({}, {}).tiles, 0);
  try {
    (void)FitStats::of_tiles({1.0}, {});
    FAIL() << "sizes differ";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("1 sse entries but 0 sum_sq"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lutb
