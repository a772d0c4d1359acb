// Golden optima (../shared/golden/lutb_optimal.json, spec section 2.1): "optimal" reaches the listed
// minimum at every listed scale when forced, its free choice is never worse than the best listed,
// its codebook matches, and no other fitter goes below the optimum.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "fit/fit_test_util.hpp"
#include "lutb/fit.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

struct GoldenCase {
  std::string label;
  std::vector<float> x;
  double sum_sq = 0.0;
  double best = 0.0;
};

std::vector<GoldenCase> load_cases(const nlohmann::json& g) {
  std::vector<GoldenCase> out;
  for (const auto& c : g.at("cases")) {
    GoldenCase gc;
    gc.label = c.at("label").get<std::string>();
    for (const auto& h : c.at("values")) gc.x.push_back(test::f32_hex(h.get<std::string>()));
    gc.sum_sq = c.at("sum_sq").get<double>();
    gc.best = c.at("optimal_sse_over_listed_scales").get<double>();
    out.push_back(std::move(gc));
  }
  return out;
}

// 1e-9 relative, with an absolute floor far below any representable error of these tiles.
double tol(double v, double sum_sq) { return 1e-9 * v + 1e-15 * sum_sq; }

TEST(FitGolden, OptimalReachesEveryListedScale) {
  LUTB_GOLDEN_OR_SKIP(g, "lutb_optimal.json");
  int checked = 0;
  for (const auto& c : g.at("cases")) {
    std::vector<float> x;
    for (const auto& h : c.at("values")) x.push_back(test::f32_hex(h.get<std::string>()));
    ASSERT_EQ(x.size(), 512u);
    const double sum_sq = c.at("sum_sq").get<double>();
    for (const auto& [sk, want] : c.at("optimal_by_scale").items()) {
      const int s = std::stoi(sk);
      FitOptions opt;
      opt.fitter = "optimal";
      opt.forced_scale = s;
      const TileFit f = fit_tile(x.data(), opt);
      const double gold = want.at("sse").get<double>();
      SCOPED_TRACE(c.at("label").get<std::string>() + " scale " + sk);
      EXPECT_EQ(f.block.scale, s);
      EXPECT_NEAR(f.sse, gold, tol(gold, sum_sq));
      EXPECT_NEAR(f.sum_sq, sum_sq, 1e-12 * sum_sq);
      // The reported error is the error of the decoded tile.
      EXPECT_EQ(f.sse, test::sse_of(x.data(), test::decode_block(f.block)));
      // Codebook: the distinct dequantised entries equal the golden ones.
      std::set<double> ours;
      for (int j = 0; j < 8; ++j) ours.insert(std::ldexp(static_cast<double>(e4m3_to_float(f.block.codebook[j])), s - 127));
      std::set<double> gold_cb;
      for (const auto& v : want.at("codebook")) gold_cb.insert(std::stod(v.get<std::string>()));
      EXPECT_EQ(ours, gold_cb);
      // Ascending codebook.
      for (int j = 1; j < 8; ++j) EXPECT_LE(e4m3_to_float(f.block.codebook[j - 1]), e4m3_to_float(f.block.codebook[j]));
      ++checked;
    }
  }
  EXPECT_GE(checked, 60);
}

TEST(FitGolden, FreeChoiceNeverWorseThanBestListed) {
  LUTB_GOLDEN_OR_SKIP(g, "lutb_optimal.json");
  for (const auto& c : load_cases(g)) {
    SCOPED_TRACE(c.label);
    FitOptions opt;
    opt.fitter = "optimal";
    const TileFit f = fit_tile(c.x.data(), opt);
    EXPECT_LE(f.sse, c.best + tol(c.best, c.sum_sq));
    EXPECT_GE(f.block.scale, 3);
    EXPECT_LE(f.block.scale, 246);
    EXPECT_EQ(f.sse, test::sse_of(c.x.data(), test::decode_block(f.block)));
  }
}

TEST(FitGolden, NoFitterBelowTheOptimum) {
  LUTB_GOLDEN_OR_SKIP(g, "lutb_optimal.json");
  for (const auto& c : load_cases(g)) {
    FitOptions o;
    o.fitter = "optimal";
    const double opt_sse = fit_tile(c.x.data(), o).sse;
    for (const auto& name : fitter_names()) {
      SCOPED_TRACE(c.label + " / " + name);
      FitOptions fo;
      fo.fitter = name;
      const TileFit f = fit_tile(c.x.data(), fo);
      EXPECT_GE(f.sse, opt_sse - tol(opt_sse, c.sum_sq));
      EXPECT_EQ(f.sse, test::sse_of(c.x.data(), test::decode_block(f.block)));
    }
  }
}

TEST(FitGolden, DefaultFitterAtForcedScalesNotBelowOptimum) {
  LUTB_GOLDEN_OR_SKIP(g, "lutb_optimal.json");
  for (const auto& c : g.at("cases")) {
    std::vector<float> x;
    for (const auto& h : c.at("values")) x.push_back(test::f32_hex(h.get<std::string>()));
    const double sum_sq = c.at("sum_sq").get<double>();
    for (const auto& [sk, want] : c.at("optimal_by_scale").items()) {
      FitOptions opt;
      opt.forced_scale = std::stoi(sk);
      const double gold = want.at("sse").get<double>();
      const TileFit f = fit_tile(x.data(), opt);
      EXPECT_GE(f.sse, gold - tol(gold, sum_sq)) << c.at("label").get<std::string>() << " scale " << sk;
    }
  }
}

}  // namespace
}  // namespace lutb
