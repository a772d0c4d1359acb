// Shapes whose LUT-B byte counts overflow 64 bits, given to the public API, are refused naming the
// shape: [2^40, 2^40] must not wrap shape.tiles() to 0 (signed overflow) and pass as an empty tensor.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "lutb/fit.hpp"
#include "lutb/tile.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

using test::error_of;
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

LutbShape shape(std::int64_t e, std::int64_t n, std::int64_t k) {
  LutbShape s;
  s.experts = e;
  s.rows = n;
  s.cols = k;
  s.stacked = e != 1;
  return s;
}

TEST(LutbShapeOverflow, ByteCountsBeyond64BitsAreRefused) {
  const LutbShape huge = shape(1, std::int64_t{1} << 40, std::int64_t{1} << 40);
  EXPECT_EQ(error_of<FormatError>([&] { LutbTensor t(huge); }),
            "LutbTensor: LUT-B shape [1099511627776, 1099511627776] is too large: its packed bytes overflow 64-bit "
            "sizes");
  EXPECT_EQ(error_of<FormatError>([&] { check_sizes(huge, 0, 0, 0, "w13"); }),
            "w13: LUT-B shape [1099511627776, 1099511627776] is too large: its packed bytes overflow 64-bit sizes");
  std::vector<std::uint8_t> b(kPackedBytes);
  EXPECT_EQ(error_of<FormatError>([&] { validate(LutbView{huge, b.data(), b.data(), b.data()}, "w2"); }),
            "w2: LUT-B shape [1099511627776, 1099511627776] is too large: its packed bytes overflow 64-bit sizes");
  // rows + 7 itself overflows (padded_rows).
  EXPECT_EQ(error_of<FormatError>([&] { check_sizes(shape(1, kMax, 64), 0, 0, 0, "w"); }),
            "w: LUT-B shape [9223372036854775807, 64] is too large: its packed bytes overflow 64-bit sizes");
  // The largest shapes that fit are still accepted by the size check (no allocation).
  const LutbShape big = shape(1, std::int64_t{1} << 20, std::int64_t{1} << 20);
  const auto tiles = static_cast<std::size_t>(big.tiles());
  EXPECT_NO_THROW(check_sizes(big, tiles * kPackedBytes, tiles * kCodebookSize, tiles, "w"));

  std::vector<float> x(kTileSize, 1.0f);
  LutbTensor out;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize(x.data(), DType::F32, huge, out, {}, "blk.w"); }),
            "quantize: tensor blk.w has shape [1, 1099511627776, 1099511627776], too large: its packed bytes overflow "
            "64-bit sizes");
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize(x.data(), DType::F32, shape(kMax, 8, 64), out, {}, "e"); }),
            "quantize: tensor e has shape [9223372036854775807, 8, 64], too large: its packed bytes overflow 64-bit "
            "sizes");
  // A real one-tile weight still quantises.
  EXPECT_NO_THROW(quantize(x.data(), DType::F32, shape(1, 8, 64), out, {}, "ok"));
  EXPECT_EQ(out.packed.size(), static_cast<std::size_t>(kPackedBytes));
}

}  // namespace
}  // namespace lutb
