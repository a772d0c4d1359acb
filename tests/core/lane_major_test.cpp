// The GPU-resident lane-major bit order of a LUT-B tile (lutb/cuda/lane_major.hpp), checked on the
// CPU against an independent bit-stream reading of the checkpoint order and an emulation of PRMT.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>

#include "lutb/cuda/lane_major.hpp"
#include "lutb/tile.hpp"

namespace lutb::cuda {
namespace {

// Independent reading of the checkpoint order: index f at bits 3f..3f+2 of the LE bit stream.
unsigned ref_index(const std::uint8_t* packed, int f) {
  unsigned v = 0;
  for (int b = 0; b < 3; ++b) {
    const int bit = 3 * f + b;
    v |= static_cast<unsigned>((packed[bit / 8] >> (bit % 8)) & 1) << b;
  }
  return v;
}

// PTX prmt.b32 default mode: selector nibble i picks byte (nibble & 7) of {b, a} (a = bytes 0..3),
// replicating its sign bit when nibble bit 3 is set.
std::uint32_t prmt(std::uint32_t a, std::uint32_t b, std::uint32_t sel) {
  const std::uint64_t ab = a | (static_cast<std::uint64_t>(b) << 32);
  std::uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned n = (sel >> (4 * i)) & 0xf;
    unsigned byte = (ab >> (8 * (n & 7))) & 0xff;
    if (n & 8) byte = (byte & 0x80) ? 0xff : 0x00;
    r |= byte << (8 * i);
  }
  return r;
}

std::vector<std::uint8_t> random_tile(std::mt19937& rng) {
  std::vector<std::uint8_t> t(kPackedBytes);
  for (auto& b : t) b = static_cast<std::uint8_t>(rng());
  return t;
}

TEST(LaneMajor, ColumnsOfALanePartitionTheTile) {
  std::set<int> seen;
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 16; ++j) {
      const int c = lane_col(t, j);
      EXPECT_EQ(c / 32, j / 8) << "slots 0..7 in the first MXFP8 block, 8..15 in the second";
      seen.insert(c);
    }
  EXPECT_EQ(seen.size(), 64u);
}

TEST(LaneMajor, RoundTripAndIndexAgreeWithTheBitStream) {
  std::mt19937 rng(7);
  for (int rep = 0; rep < 200; ++rep) {
    const auto in = random_tile(rng);
    std::uint8_t lm[kPackedBytes], back[kPackedBytes];
    tile_to_lane_major(in.data(), lm);
    tile_from_lane_major(lm, back);
    for (int b = 0; b < kPackedBytes; ++b) ASSERT_EQ(back[b], in[b]) << "byte " << b;
    for (int f = 0; f < kTileSize; ++f) {
      ASSERT_EQ(spec_index(in.data(), f), ref_index(in.data(), f));
      ASSERT_EQ(lane_major_index(lm, f / 64, f % 64), ref_index(in.data(), f)) << "f " << f;
    }
  }
}

TEST(LaneMajor, SelectorsLookUpTheCodebookInColumnOrder) {
  // What the device does per lane: load X, Y, build 4 selectors, PRMT against the codebook.
  std::mt19937 rng(11);
  const std::uint8_t cb[8] = {0x01, 0x92, 0x23, 0xB4, 0x45, 0xD6, 0x67, 0x7E};  // sign bits mixed
  const std::uint32_t lo = cb[0] | cb[1] << 8 | cb[2] << 16 | static_cast<std::uint32_t>(cb[3]) << 24;
  const std::uint32_t hi = cb[4] | cb[5] << 8 | cb[6] << 16 | static_cast<std::uint32_t>(cb[7]) << 24;
  for (int rep = 0; rep < 50; ++rep) {
    const auto in = random_tile(rng);
    std::uint8_t lm[kPackedBytes];
    tile_to_lane_major(in.data(), lm);
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      const std::uint32_t x = lm[4 * lane] | lm[4 * lane + 1] << 8 | lm[4 * lane + 2] << 16 |
                              static_cast<std::uint32_t>(lm[4 * lane + 3]) << 24;
      const std::uint32_t y = lm[128 + 2 * lane] | lm[129 + 2 * lane] << 8;
      std::uint32_t s[4];
      lane_selectors(x, y, s);
      for (int q = 0; q < 4; ++q) {
        EXPECT_EQ(s[q] & 0x8888u, 0u) << "bit 3 of a nibble would replicate the sign";
        EXPECT_EQ(s[q] >> 16, 0u);
        const std::uint32_t bytes = prmt(lo, hi, s[q]);
        for (int i = 0; i < 4; ++i) {
          const int c = lane_col(t, 4 * q + i);
          ASSERT_EQ((bytes >> (8 * i)) & 0xff, cb[ref_index(in.data(), g * 64 + c)]) << "lane " << lane << " col " << c;
        }
      }
    }
  }
}

TEST(LaneMajor, KnownWords) {
  // All indices 7: every bit of X and Y is set. Index f = f % 8 in checkpoint order: lane 0 holds
  // columns 0..7 (v = 0..7) and 32..39 (v = 0..7): X = 0x76543210 plus the extra bits of
  // v_12..15 = 4,5,6,7 (bit 0: 0,1,0,1 -> bits 7, 15; bit 1: 0,0,1,1 -> bits 27, 31), Y = 0x3210 plus
  // bit 2 of v_12..15 (all set -> bits 3, 7, 11, 15).
  std::uint8_t idx[kTileSize], packed[kPackedBytes], lm[kPackedBytes];
  for (int f = 0; f < kTileSize; ++f) idx[f] = 7;
  pack_tile_indices(idx, packed);
  tile_to_lane_major(packed, lm);
  for (int b = 0; b < kPackedBytes; ++b) ASSERT_EQ(lm[b], 0xff);
  for (int f = 0; f < kTileSize; ++f) idx[f] = static_cast<std::uint8_t>(f % 8);
  pack_tile_indices(idx, packed);
  tile_to_lane_major(packed, lm);
  const std::uint32_t x = lm[0] | lm[1] << 8 | lm[2] << 16 | static_cast<std::uint32_t>(lm[3]) << 24;
  const std::uint32_t y = lm[128] | lm[129] << 8;
  EXPECT_EQ(x, 0x76543210u | (1u << 7) | (1u << 15) | (1u << 27) | (1u << 31));
  EXPECT_EQ(y, 0x3210u | 0x8888u);
}

}  // namespace
}  // namespace lutb::cuda
