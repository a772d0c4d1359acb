// The LUT-B tile format (spec section 2): golden packing and dequantisation, round trips, an
// independent bit-stream reference for the index layout, padding, validation errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "lutb/tile.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

using test::f32_hex;
using test::parse_hex_bytes;

// Independent reading of the index layout: the groups of 3 little-endian bytes concatenate into
// one little-endian bit stream, so index f sits at bits 3f..3f+2 of the 1536-bit stream.
int ref_index(const std::uint8_t* packed, int f) {
  int v = 0;
  for (int b = 0; b < 3; ++b) {
    const int bit = 3 * f + b;
    v |= ((packed[bit / 8] >> (bit % 8)) & 1) << b;
  }
  return v;
}

TEST(TileFormat, SizeIs3Point140625BitsPerWeight) {
  EXPECT_EQ(sizeof(TileBlock), 201u);
  EXPECT_DOUBLE_EQ(kBitsPerWeight, 3.140625);
}

TEST(TileFormat, SpecExample) {
  const std::uint8_t idx[8] = {1, 2, 3, 4, 5, 6, 7, 0};
  std::uint8_t out[3];
  pack8(idx, out);
  EXPECT_EQ(out[0], 0xD1);
  EXPECT_EQ(out[1], 0x58);
  EXPECT_EQ(out[2], 0x1F);
  std::uint8_t back[8];
  unpack8(out, back);
  for (int j = 0; j < 8; ++j) EXPECT_EQ(back[j], idx[j]);
}

TEST(GoldenTile, LutbPack) {
  LUTB_GOLDEN_OR_SKIP(g, "lutb_pack.json");
  const auto& cases = g.at("cases");
  ASSERT_GE(cases.size(), 2u);
  for (const auto& c : cases) {
    const auto idx = c.at("indices").get<std::vector<int>>();
    const auto want = parse_hex_bytes(c.at("bytes").get<std::string>());
    std::vector<std::uint8_t> in(idx.begin(), idx.end());
    ASSERT_EQ(want.size() * 8, in.size() * 3);
    std::vector<std::uint8_t> got(want.size());
    if (in.size() == 8) {
      pack8(in.data(), got.data());
    } else {
      ASSERT_EQ(in.size(), 512u);
      pack_tile_indices(in.data(), got.data());
    }
    EXPECT_EQ(got, want) << c.at("bytes").get<std::string>();
    std::vector<std::uint8_t> back(in.size());
    if (in.size() == 8)
      unpack8(want.data(), back.data());
    else
      unpack_tile_indices(want.data(), back.data());
    EXPECT_EQ(back, in);
    for (std::size_t f = 0; f < in.size(); ++f) EXPECT_EQ(ref_index(want.data(), static_cast<int>(f)), in[f]);
  }
}

TEST(GoldenTile, LutbDequant) {
  LUTB_GOLDEN_OR_SKIP(g, "lutb_dequant.json");
  const std::int64_t N = g.at("N").get<std::int64_t>(), K = g.at("K").get<std::int64_t>();
  LutbTensor t(LutbShape{1, N, K, false});
  ASSERT_EQ(g.at("tiles").size(), static_cast<std::size_t>(t.shape.tiles()));
  for (const auto& tile : g.at("tiles")) {
    const std::int64_t i = tile.at("tn").get<std::int64_t>() * t.shape.tiles_k() + tile.at("tk").get<std::int64_t>();
    const auto p = parse_hex_bytes(tile.at("packed").get<std::string>());
    ASSERT_EQ(p.size(), 192u);
    std::memcpy(t.packed.data() + i * kPackedBytes, p.data(), 192);
    const auto cb = tile.at("codebook").get<std::vector<int>>();
    ASSERT_EQ(cb.size(), 8u);
    for (int j = 0; j < 8; ++j) t.codebook[i * 8 + j] = static_cast<std::uint8_t>(cb[j]);
    t.scale[i] = static_cast<std::uint8_t>(tile.at("scale").get<int>());
  }
  const auto& W = g.at("W");
  ASSERT_EQ(W.size(), static_cast<std::size_t>(N * K));
  const std::vector<float> got = dequantize(t.view());
  std::vector<std::uint16_t> bf(got.size());
  dequantize_bf16(t.view(), bf.data());
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float want = f32_hex(W[i].get<std::string>());
    ASSERT_EQ(f32_bits(got[i]), f32_bits(want)) << "element " << i;
    // Scales 3..246: the BF16 dequantisation is exact.
    ASSERT_EQ(static_cast<std::uint32_t>(bf[i]) << 16, f32_bits(want)) << "element " << i;
  }
  // Tile by tile too.
  for (std::int64_t ti = 0; ti < t.shape.tiles(); ++ti) {
    float out[512];
    dequantize_tile(t.view().tile_packed(ti), t.view().tile_codebook(ti), t.view().tile_scale(ti), out);
    const std::int64_t tn = ti / t.shape.tiles_k(), tk = ti % t.shape.tiles_k();
    for (int f = 0; f < 512; ++f)
      ASSERT_EQ(out[f], got[(tn * 8 + f / 64) * K + tk * 64 + f % 64]);
  }
}

TEST(TileFormat, PackUnpackRoundTripRandom) {
  std::mt19937 rng(11);
  for (int rep = 0; rep < 200; ++rep) {
    std::uint8_t idx[512], packed[192], back[512];
    for (auto& i : idx) i = static_cast<std::uint8_t>(rng() & 7);
    pack_tile_indices(idx, packed);
    unpack_tile_indices(packed, back);
    for (int f = 0; f < 512; ++f) {
      ASSERT_EQ(back[f], idx[f]);
      ASSERT_EQ(ref_index(packed, f), idx[f]);
    }
    // And every byte pattern unpacks to something that packs back to the same bytes.
    for (auto& b : packed) b = static_cast<std::uint8_t>(rng());
    std::uint8_t repacked[192];
    unpack_tile_indices(packed, back);
    pack_tile_indices(back, repacked);
    ASSERT_EQ(std::memcmp(packed, repacked, 192), 0);
  }
}

// A random valid tensor (finite codebooks, scales in 3..246) of the given shape.
LutbTensor random_tensor(const LutbShape& s, std::uint32_t seed) {
  LutbTensor t(s);
  std::mt19937 rng(seed);
  for (auto& b : t.packed) b = static_cast<std::uint8_t>(rng());
  for (auto& b : t.codebook) {
    do b = static_cast<std::uint8_t>(rng());
    while (e4m3_is_nan(b));
  }
  for (auto& b : t.scale) b = static_cast<std::uint8_t>(3 + rng() % 244);
  return t;
}

// Reference dequantisation element by element from the spec formula, in double.
double ref_value(const LutbView& v, std::int64_t e, std::int64_t r, std::int64_t c) {
  const std::int64_t t = (e * v.shape.tiles_n() + r / 8) * v.shape.tiles_k() + c / 64;
  const int f = static_cast<int>((r % 8) * 64 + c % 64);
  const int idx = ref_index(v.tile_packed(t), f);
  return std::ldexp(static_cast<double>(e4m3_to_float(v.tile_codebook(t)[idx])), v.tile_scale(t) - 127);
}

TEST(TileFormat, DequantizeStackWithPaddingMatchesReference) {
  const LutbShape s{3, 13, 100, true};  // N and K both ragged
  ASSERT_EQ(s.padded_rows(), 16);
  ASSERT_EQ(s.padded_cols(), 128);
  ASSERT_EQ(s.tiles(), 3 * 2 * 2);
  ASSERT_TRUE(s.padded());
  const LutbTensor t = random_tensor(s, 5);
  check_sizes(s, t.packed.size(), t.codebook.size(), t.scale.size());
  const std::vector<float> w = dequantize(t.view());
  ASSERT_EQ(w.size(), 3u * 13 * 100);
  std::vector<std::uint16_t> wb(w.size());
  dequantize_bf16(t.view(), wb.data());
  for (std::int64_t e = 0; e < 3; ++e) {
    const std::vector<float> we = dequantize(t.view().expert(e));
    ASSERT_EQ(we.size(), 13u * 100);
    for (std::int64_t r = 0; r < 13; ++r)
      for (std::int64_t c = 0; c < 100; ++c) {
        const std::size_t i = static_cast<std::size_t>((e * 13 + r) * 100 + c);
        ASSERT_EQ(static_cast<double>(w[i]), ref_value(t.view(), e, r, c));
        ASSERT_EQ(we[static_cast<std::size_t>(r * 100 + c)], w[i]);
        ASSERT_EQ(bf16_to_float(wb[i]), w[i]);  // exact for scales 3..246
      }
  }
  EXPECT_THROW(t.view().expert(3), FormatError);
  EXPECT_THROW(t.view().expert(-1), FormatError);
}

TEST(TileFormat, FreshTensorIsZeroWithScaleOne) {
  const LutbTensor t(LutbShape{2, 8, 64, true});
  EXPECT_EQ(t.bytes(), 2u * 201);
  for (auto s : t.scale) EXPECT_EQ(s, kUE8M0One);
  for (float v : dequantize(t.view())) EXPECT_EQ(v, 0.0f);
  EXPECT_THROW(LutbTensor(LutbShape{1, 0, 64, false}), FormatError);
  EXPECT_THROW(LutbTensor(LutbShape{2, 8, 64, false}), FormatError);  // experts > 1 but not stacked
}

TEST(TileFormat, ValidateNamesTheTileAndReason) {
  LutbTensor t = random_tensor(LutbShape{4, 24, 192, true}, 8);  // 3 x 3 tiles per expert
  validate(t.view());
  // Scale 255 at expert 2, tn 1, tk 2.
  const std::int64_t bad = (2 * 3 + 1) * 3 + 2;
  t.scale[bad] = 255;
  try {
    validate(t.view(), "layers.0.w13");
    FAIL() << "no error";
  } catch (const FormatError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("layers.0.w13"), std::string::npos) << m;
    EXPECT_NE(m.find("expert 2, tn 1, tk 2"), std::string::npos) << m;
    EXPECT_NE(m.find("scale byte 255"), std::string::npos) << m;
  }
  EXPECT_THROW(dequantize(t.view()), FormatError);
  std::vector<std::uint16_t> bf(4 * 24 * 192);
  EXPECT_THROW(dequantize_bf16(t.view(), bf.data()), FormatError);
  t.scale[bad] = 127;
  // NaN codebook entries, both NaN bytes, at expert 0, tn 2, tk 0, entry 5.
  for (std::uint8_t nan : {std::uint8_t{0x7F}, std::uint8_t{0xFF}}) {
    t.codebook[(2 * 3 + 0) * 8 + 5] = nan;
    try {
      validate(t.view());
      FAIL() << "no error";
    } catch (const FormatError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("expert 0, tn 2, tk 0"), std::string::npos) << m;
      EXPECT_NE(m.find("NaN codebook entry (index 5"), std::string::npos) << m;
    }
    float out[512];
    EXPECT_THROW(dequantize_tile(t.view().tile_packed(6), t.view().tile_codebook(6), 127, out), FormatError);
  }
  EXPECT_THROW(dequantize_tile(t.view().tile_packed(0), t.view().tile_codebook(0), 255, nullptr), FormatError);
}

TEST(TileFormat, CheckSizesNamesExpectedAndActual) {
  const LutbShape s{2, 10, 70, true};  // padded 16 x 128: 2 x 2 tiles per expert, 8 tiles
  check_sizes(s, 8 * 192, 8 * 8, 8);
  try {
    check_sizes(s, 8 * 192, 8 * 8 - 1, 8, "w2");
    FAIL();
  } catch (const FormatError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("w2: codebook has 63 bytes, expected 64"), std::string::npos) << m;
  }
  EXPECT_THROW(check_sizes(s, 7 * 192, 64, 8), FormatError);
  EXPECT_THROW(check_sizes(s, 8 * 192, 64, 9), FormatError);
}

TEST(TileFormat, ReadersHonourAnyCodebookOrder) {
  LutbTensor t(LutbShape{1, 8, 64, false});
  std::uint8_t idx[512];
  for (int f = 0; f < 512; ++f) idx[f] = static_cast<std::uint8_t>(f % 8);
  pack_tile_indices(idx, t.packed.data());
  const std::uint8_t cb[8] = {0x38, 0xB8, 0x00, 0x7E, 0x01, 0x40, 0xC0, 0x30};  // unsorted
  std::memcpy(t.codebook.data(), cb, 8);
  t.scale[0] = 128;
  const auto w = dequantize(t.view());
  for (int f = 0; f < 512; ++f) EXPECT_EQ(w[f], 2.0f * e4m3_to_float(cb[f % 8]));
}

TEST(TilePadding, PadAndGather) {
  const std::int64_t rows = 11, cols = 70;
  std::vector<float> src(rows * cols);
  std::vector<std::uint16_t> src_bf(src.size());
  for (std::size_t i = 0; i < src.size(); ++i) {
    src[i] = bf16_round(static_cast<float>(i) * 0.25f - 7.0f);
    src_bf[i] = bf16_from_float(src[i]);
  }
  std::vector<float> padded(16 * 128, -1.0f);
  pad_to_tiles(src.data(), rows, cols, padded.data());
  for (std::int64_t r = 0; r < 16; ++r)
    for (std::int64_t c = 0; c < 128; ++c)
      ASSERT_EQ(padded[r * 128 + c], (r < rows && c < cols) ? src[r * cols + c] : 0.0f) << r << "," << c;
  for (std::int64_t tn = 0; tn < 2; ++tn)
    for (std::int64_t tk = 0; tk < 2; ++tk) {
      float a[512], b[512];
      gather_tile(src.data(), rows, cols, tn, tk, a);
      gather_tile_bf16(src_bf.data(), rows, cols, tn, tk, b);
      for (int f = 0; f < 512; ++f) {
        const float want = padded[(tn * 8 + f / 64) * 128 + tk * 64 + f % 64];
        ASSERT_EQ(a[f], want);
        ASSERT_EQ(b[f], want);
      }
    }
}

}  // namespace
}  // namespace lutb
