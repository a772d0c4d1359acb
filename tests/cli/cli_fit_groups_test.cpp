// src/cli/fit_groups.hpp (lutb quantize --device cuda fits a stack in groups of whole experts and
// polls Ctrl-C between them), checked with the CPU fitter as the per-group fit: the grouped result
// must be the whole-tensor fit byte for byte, errors must name the expert of the whole stack exactly
// as lutb::quantize does, and a set flag must stop between groups.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/fit_groups.hpp"
#include "lutb/fit.hpp"
#include "lutb/numerics.hpp"

namespace lutb {
namespace {

std::vector<std::uint16_t> random_stack(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<std::uint16_t> w(static_cast<std::size_t>(n));
  for (auto& v : w) v = bf16_from_float(nd(rng));
  return w;
}

auto cpu_part(const std::string& name) {
  return [name](const void* p, DType d, const LutbShape& s, LutbTensor& o) { return quantize(p, d, s, o, FitOptions{}, name); };
}

TEST(CliFitGroups, GroupedFitIsTheWholeFitByteForByte) {
  const LutbShape shape{5, 20, 100, true};  // padded to 24 x 128: overhanging tiles in every expert
  const auto w = random_stack(shape.experts * shape.rows * shape.cols, 7);
  LutbTensor whole;
  const FitStats ws = quantize(w.data(), DType::BF16, shape, whole, FitOptions{}, "w13");
  for (const std::int64_t gw : {std::int64_t{1}, std::int64_t{2 * 20 * 100}, std::int64_t{3 * 20 * 100 + 5}, std::int64_t{1} << 28}) {
    SCOPED_TRACE(gw);
    LutbTensor g;
    int calls = 0;
    auto part = [&](const void* p, DType d, const LutbShape& s, LutbTensor& o) {
      ++calls;
      return quantize(p, d, s, o, FitOptions{}, "w13");
    };
    const FitStats gs = cli::fit_in_expert_groups(w.data(), DType::BF16, shape, g, "w13", nullptr, gw, part);
    const std::int64_t group = std::max<std::int64_t>(1, std::min<std::int64_t>(5, gw / 2000));
    EXPECT_EQ(calls, (5 + group - 1) / group);
    EXPECT_EQ(g.shape.experts, 5);
    EXPECT_TRUE(g.packed == whole.packed);
    EXPECT_TRUE(g.codebook == whole.codebook);
    EXPECT_TRUE(g.scale == whole.scale);
    EXPECT_EQ(gs.tiles, ws.tiles);
    EXPECT_NEAR(gs.sse, ws.sse, 1e-12 * ws.sse);
    EXPECT_NEAR(gs.sum_sq, ws.sum_sq, 1e-12 * ws.sum_sq);
  }
}

TEST(CliFitGroups, UnstackedTensorIsOneCall) {
  const LutbShape shape{1, 16, 64, false};
  const auto w = random_stack(16 * 64, 3);
  LutbTensor a, b;
  (void)quantize(w.data(), DType::BF16, shape, a, FitOptions{}, "x");
  int calls = 0;
  (void)cli::fit_in_expert_groups(w.data(), DType::BF16, shape, b, "x", nullptr, 1,
                                  [&](const void* p, DType d, const LutbShape& s, LutbTensor& o) {
                                    ++calls;
                                    return quantize(p, d, s, o, FitOptions{}, "x");
                                  });
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(a.packed == b.packed && a.codebook == b.codebook && a.scale == b.scale);
}

TEST(CliFitGroups, ErrorNamesTheExpertOfTheWholeStack) {
  const LutbShape shape{5, 16, 64, true};
  auto w = random_stack(5 * 16 * 64, 11);
  w[static_cast<std::size_t>(3 * 16 * 64 + 9 * 64 + 17)] = 0x7fc0;  // NaN: expert 3, row 9, col 17
  std::string whole_msg, group_msg;
  LutbTensor a, b;
  try {
    (void)quantize(w.data(), DType::BF16, shape, a, FitOptions{}, "w2");
  } catch (const std::invalid_argument& e) {
    whole_msg = e.what();
  }
  try {
    (void)cli::fit_in_expert_groups(w.data(), DType::BF16, shape, b, "w2", nullptr, 2 * 16 * 64, cpu_part("w2"));
  } catch (const std::invalid_argument& e) {
    group_msg = e.what();
  }
  ASSERT_NE(whole_msg.find("expert 3"), std::string::npos) << whole_msg;
  EXPECT_EQ(group_msg, whole_msg);
  EXPECT_TRUE(b.packed.empty());
}

TEST(CliFitGroups, InterruptStopsBetweenGroups) {
  const LutbShape shape{5, 16, 64, true};
  const auto w = random_stack(5 * 16 * 64, 5);
  InterruptFlag flag{0};
  int calls = 0;
  LutbTensor out;
  try {
    (void)cli::fit_in_expert_groups(w.data(), DType::BF16, shape, out, "w13", &flag, 2 * 16 * 64,
                                    [&](const void* p, DType d, const LutbShape& s, LutbTensor& o) {
                                      ++calls;
                                      flag.store(2);  // SIGINT arrives during the first group
                                      return quantize(p, d, s, o, FitOptions{}, "w13");
                                    });
    FAIL() << "not interrupted";
  } catch (const Interrupted& e) {
    EXPECT_EQ(e.signal, 2);
    EXPECT_EQ(e.tiles_done, 2 * shape.tiles_per_expert());
    EXPECT_EQ(e.tiles_total, shape.tiles());
    EXPECT_NE(std::string(e.what()).find("quantize: tensor w13: interrupted (flag 2) after 4 of 10 tiles"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(out.packed.empty());
}

}  // namespace
}  // namespace lutb
