// MXFP8 (spec section 3): golden blocks for both scale rules, an independent double reference for
// quantise-dequantise, ragged K, NaN/Inf blocks, BF16 input.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "lutb/mxfp8.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

using test::f32_hex;

TEST(GoldenMxfp8, Blocks) {
  LUTB_GOLDEN_OR_SKIP(g, "mxfp8_blocks.json");
  const auto& cases = g.at("cases");
  ASSERT_GT(cases.size(), 10u);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.at("label").get<std::string>());
    std::vector<float> x;
    for (const auto& h : c.at("input")) x.push_back(f32_hex(h.get<std::string>()));
    ASSERT_EQ(x.size(), 32u);
    for (auto [key, rule] : {std::pair{"rceil", MxScaleRule::Rceil}, std::pair{"floor", MxScaleRule::Floor}}) {
      SCOPED_TRACE(key);
      const auto& want = c.at(key);
      std::uint8_t elems[32], scale = 0;
      mxfp8_quantize_block(x.data(), 32, elems, &scale, rule);
      ASSERT_EQ(int(scale), want.at("scale").get<int>());
      if (scale == 255) {
        // Elements are not checked by the golden file; the block decodes to NaN.
        for (int i = 0; i < 32; ++i) EXPECT_TRUE(std::isnan(mx_decode(elems[i], scale)));
        continue;
      }
      const auto we = want.at("elements").get<std::vector<int>>();
      for (int i = 0; i < 32; ++i) EXPECT_EQ(int(elems[i]), we[i]) << "element " << i;
      // The rows API gives the same bytes.
      std::uint8_t re[32], rs = 0;
      mxfp8_quantize_rows(x.data(), 1, 32, re, &rs, rule);
      EXPECT_EQ(rs, scale);
      for (int i = 0; i < 32; ++i) EXPECT_EQ(re[i], elems[i]);
    }
  }
}

// Independent qdq of one block in double: scale from the definition, element by brute force.
void ref_qdq_block(const float* x, int n, MxScaleRule rule, double* out) {
  double amax = 0;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    finite &= std::isfinite(x[i]);
    amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
  }
  if (!finite) {
    for (int i = 0; i < n; ++i) out[i] = NAN;
    return;
  }
  int b = 127;
  if (amax > 0) {
    if (rule == MxScaleRule::Rceil) {
      b = 0;
      while (b < 254 && amax > std::ldexp(448.0, b - 127)) ++b;
    } else {
      int e = -200;
      while (std::ldexp(1.0, e + 1) <= amax) ++e;
      b = std::clamp(e - 8 + 127, 0, 254);
    }
  }
  for (int i = 0; i < n; ++i) {
    const double y = std::ldexp(static_cast<double>(x[i]), 127 - b);
    // Nearest E4M3 value (ties to even mantissa), saturating.
    double best = 0, best_d = INFINITY;
    int best_byte = 0;
    for (int q = 0; q <= 0x7e; ++q) {
      const double v = e4m3_to_float(static_cast<std::uint8_t>(q));
      const double d = std::fabs(v - std::fabs(y));
      if (d < best_d || (d == best_d && (q & 1) == 0 && (best_byte & 1) == 1)) {
        best_d = d;
        best = v;
        best_byte = q;
      }
    }
    out[i] = std::ldexp(std::signbit(y) ? -best : best, b - 127);
  }
}

TEST(Mxfp8, QdqRowsMatchesDoubleReferenceWithRaggedK) {
  std::mt19937 rng(17);
  const std::int64_t rows = 5, cols = 77;  // 3 blocks, the last of 13 values
  std::vector<float> x(rows * cols);
  for (auto rule : {MxScaleRule::Rceil, MxScaleRule::Floor}) {
    for (int rep = 0; rep < 20; ++rep) {
      std::normal_distribution<float> nd(0.0f, std::exp2(static_cast<float>(rng() % 60) - 30.0f));
      for (auto& v : x) v = nd(rng);
      x[3] = 0.0f;
      std::vector<float> out(x.size());
      mxfp8_qdq_rows(x.data(), rows, cols, out.data(), rule);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c0 = 0; c0 < cols; c0 += 32) {
          const int n = static_cast<int>(std::min<std::int64_t>(32, cols - c0));
          double ref[32];
          ref_qdq_block(x.data() + r * cols + c0, n, rule, ref);
          for (int i = 0; i < n; ++i) ASSERT_EQ(static_cast<double>(out[r * cols + c0 + i]), ref[i]) << r << "," << c0 + i;
        }
      // In place gives the same.
      std::vector<float> inplace = x;
      mxfp8_qdq_rows(inplace.data(), rows, cols, inplace.data(), rule);
      ASSERT_EQ(inplace, out);
      // Quantise + dequantise through the stored form gives the same, with zero padding.
      std::vector<std::uint8_t> elems(rows * 96, 0xAA), scales(rows * 3);
      mxfp8_quantize_rows(x.data(), rows, cols, elems.data(), scales.data(), rule);
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = cols; c < 96; ++c) ASSERT_EQ(elems[r * 96 + c], 0) << "padding must encode 0";
      std::vector<float> deq(x.size());
      mxfp8_dequantize_rows(elems.data(), scales.data(), rows, cols, deq.data());
      ASSERT_EQ(deq, out);
      // BF16 input.
      std::vector<std::uint16_t> xb(x.size());
      std::vector<float> xr(x.size()), ob(x.size()), orf(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        xb[i] = bf16_from_float(x[i]);
        xr[i] = bf16_to_float(xb[i]);
      }
      mxfp8_qdq_rows_bf16(xb.data(), rows, cols, ob.data(), rule);
      mxfp8_qdq_rows(xr.data(), rows, cols, orf.data(), rule);
      ASSERT_EQ(ob, orf);
    }
  }
}

TEST(Mxfp8, SpecialBlocks) {
  std::uint8_t e[32], s = 0;
  std::vector<float> x(32, 0.0f);
  mxfp8_quantize_block(x.data(), 32, e, &s);
  EXPECT_EQ(s, 127);  // amax 0
  for (auto b : e) EXPECT_EQ(b, 0);
  x[7] = INFINITY;
  mxfp8_quantize_block(x.data(), 32, e, &s);
  EXPECT_EQ(s, 255);
  x[7] = -NAN;
  mxfp8_quantize_block(x.data(), 32, e, &s, MxScaleRule::Floor);
  EXPECT_EQ(s, 255);
  EXPECT_TRUE(std::isnan(mx_decode(0x38, 255)));
  // A partial block: missing values are zero padding and do not affect the scale.
  x.assign(32, 1e30f);
  x[0] = 3.0f;
  mxfp8_quantize_block(x.data(), 1, e, &s);
  EXPECT_EQ(s, 127 - 7);  // smallest b with 3 <= 448 * 2^(b-127): 2^-7 * 448 = 3.5
  EXPECT_EQ(mx_decode(e[0], s), 3.0f);
  for (int i = 1; i < 32; ++i) EXPECT_EQ(e[i], 0);
  // Floor rule saturates: amax 460 gets b = 127 (floor(log2 460) - 8 = 0), 460 -> 448.
  x.assign(32, 0.0f);
  x[0] = 460.0f;
  mxfp8_quantize_block(x.data(), 32, e, &s, MxScaleRule::Floor);
  EXPECT_EQ(s, 127);
  EXPECT_EQ(e[0], 0x7e);
  mxfp8_quantize_block(x.data(), 32, e, &s, MxScaleRule::Rceil);
  EXPECT_EQ(s, 128);
  EXPECT_EQ(mx_decode(e[0], s), 448.0f);  // 460/2 = 230 rounds to 224
  // A NaN row poisons only its own block.
  std::vector<float> row(64, 1.0f), out(64);
  row[40] = NAN;
  mxfp8_qdq_rows(row.data(), 1, 64, out.data());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[i], 1.0f);
  for (int i = 32; i < 64; ++i) EXPECT_TRUE(std::isnan(out[i]));
}

}  // namespace
}  // namespace lutb
