// Golden vectors for the scalar number formats (../shared/golden, spec section 1): every case must
// pass exactly; the bulk conversions are held to the same vectors.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "lutb/numerics.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

using test::f32_hex;
using test::parse_hex;

// "nan", "-0.0", "0.001953125", "-448.0" -> float (exact: every E4M3 value is a short decimal).
float parse_value(const std::string& s) {
  if (s == "nan") return std::nanf("");
  return std::stof(s);
}

TEST(GoldenNumerics, E4M3DecodeEveryByte) {
  LUTB_GOLDEN_OR_SKIP(g, "e4m3_decode.json");
  const auto& cases = g.at("cases");
  ASSERT_EQ(cases.size(), 256u);
  std::vector<std::uint8_t> bytes;
  std::vector<float> expect;
  for (const auto& c : cases) {
    const auto b = c.at(0).get<int>();
    const float want = parse_value(c.at(1).get<std::string>());
    const float got = e4m3_to_float(static_cast<std::uint8_t>(b));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "byte " << b;
      EXPECT_TRUE(e4m3_is_nan(static_cast<std::uint8_t>(b)));
    } else {
      EXPECT_EQ(f32_bits(got), f32_bits(want)) << "byte " << b << " want " << want << " got " << got;
      EXPECT_FALSE(e4m3_is_nan(static_cast<std::uint8_t>(b)));
    }
    bytes.push_back(static_cast<std::uint8_t>(b));
    expect.push_back(want);
  }
  std::vector<float> bulk(bytes.size());
  e4m3_to_float_n(bytes.data(), bulk.data(), bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (std::isnan(expect[i]))
      EXPECT_TRUE(std::isnan(bulk[i])) << "bulk byte " << int(bytes[i]);
    else
      EXPECT_EQ(f32_bits(bulk[i]), f32_bits(expect[i])) << "bulk byte " << int(bytes[i]);
  }
}

TEST(GoldenNumerics, E4M3Encode) {
  LUTB_GOLDEN_OR_SKIP(g, "e4m3_encode.json");
  const auto& cases = g.at("cases");
  ASSERT_GT(cases.size(), 1000u);
  std::vector<float> in;
  std::vector<int> want;
  for (const auto& c : cases) {
    in.push_back(f32_hex(c.at(0).get<std::string>()));
    want.push_back(c.at(1).get<int>());
  }
  std::vector<std::uint8_t> bulk(in.size());
  e4m3_from_float_n(in.data(), bulk.data(), in.size());
  int checked = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint8_t got = e4m3_from_float(in[i]);
    if (std::isnan(in[i])) {  // the note accepts either NaN byte with any sign
      EXPECT_TRUE(e4m3_is_nan(got)) << cases[i].dump();
      EXPECT_TRUE(e4m3_is_nan(bulk[i])) << cases[i].dump();
    } else {
      EXPECT_EQ(int(got), want[i]) << "input " << cases[i].at(0).get<std::string>();
      EXPECT_EQ(int(bulk[i]), want[i]) << "bulk, input " << cases[i].at(0).get<std::string>();
    }
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(cases.size()));
}

TEST(GoldenNumerics, BF16Round) {
  LUTB_GOLDEN_OR_SKIP(g, "bf16_round.json");
  const auto& cases = g.at("cases");
  ASSERT_GT(cases.size(), 100u);
  std::vector<float> in;
  std::vector<std::uint16_t> want;
  for (const auto& c : cases) {
    in.push_back(f32_hex(c.at(0).get<std::string>()));
    want.push_back(static_cast<std::uint16_t>(parse_hex(c.at(1).get<std::string>())));
  }
  std::vector<std::uint16_t> bulk(in.size());
  bf16_from_float_n(in.data(), bulk.data(), in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint16_t got = bf16_from_float(in[i]);
    if (std::isnan(in[i])) {
      EXPECT_TRUE(std::isnan(bf16_to_float(got))) << cases[i].dump();
      EXPECT_TRUE(std::isnan(bf16_to_float(bulk[i]))) << cases[i].dump();
    } else {
      EXPECT_EQ(got, want[i]) << "input " << cases[i].at(0).get<std::string>();
      EXPECT_EQ(bulk[i], want[i]) << "bulk, input " << cases[i].at(0).get<std::string>();
      EXPECT_EQ(f32_bits(bf16_round(in[i])), static_cast<std::uint32_t>(want[i]) << 16);
    }
  }
}

}  // namespace
}  // namespace lutb
