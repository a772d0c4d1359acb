// tests/fit/encode_tile_test.cpp: fit_detail::encode_tile, the final encoding every fitter shares
// (src/fit/tile_common.cpp): ascending codebook, padding with the largest entry, nearest entry with
// ties to the lower index (spec section 2.1), and its argument bound (at most 8 entries).
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "fit/fit_internal.hpp"
#include "lutb/tile.hpp"

namespace lutb::fit_detail {
namespace {

TEST(EncodeTile, SortsDeduplicatesPadsAndAssignsNearest) {
  // Entries given out of order, with a duplicate and -0: E4M3 0x38 = 1.0, 0x40 = 2.0, 0xb8 = -1.0,
  // 0x80 = -0 (written as +0).
  const std::uint8_t entries[] = {0x40, 0x38, 0xb8, 0x38, 0x80};
  std::vector<float> x(kTileSize, 0.0f);
  x[0] = 1.9f;    // nearest 2.0
  x[1] = -0.6f;   // nearest -1.0 (|-0.6 - -1| = 0.4 < 0.6)
  x[2] = 0.5f;    // tie between 0 and 1.0: the lower index (0)
  x[3] = 1.2f;    // nearest 1.0
  const TileFit t = encode_tile(x.data(), 127, entries, 5);
  const std::uint8_t want_cb[kCodebookSize] = {0xb8, 0x00, 0x38, 0x40, 0x40, 0x40, 0x40, 0x40};
  for (int j = 0; j < kCodebookSize; ++j) EXPECT_EQ(t.block.codebook[j], want_cb[j]) << "entry " << j;
  EXPECT_EQ(t.block.scale, 127);
  float deq[kTileSize];
  dequantize_tile(t.block.packed, t.block.codebook, t.block.scale, deq);
  EXPECT_EQ(deq[0], 2.0f);
  EXPECT_EQ(deq[1], -1.0f);
  EXPECT_EQ(deq[2], 0.0f);
  EXPECT_EQ(deq[3], 1.0f);
  EXPECT_EQ(deq[4], 0.0f);
  const double sse = (1.9 - 2.0) * (1.9 - 2.0) + 0.4 * 0.4 + 0.5 * 0.5 + 0.2 * 0.2;
  EXPECT_NEAR(t.sse, sse, 1e-6);
}

TEST(EncodeTile, RefusesMoreThanEightEntries) {
  std::vector<float> x(kTileSize, 0.0f);
  const std::uint8_t nine[9] = {0x30, 0x31, 0x32, 0x33, 0x34, 0x35, 0x36, 0x37, 0x38};
  EXPECT_THROW(encode_tile(x.data(), 127, nine, 9), std::invalid_argument);
  EXPECT_THROW(encode_tile(x.data(), 127, nine, -1), std::invalid_argument);
  EXPECT_NO_THROW(encode_tile(x.data(), 127, nine, 8));
}

}  // namespace
}  // namespace lutb::fit_detail
