// lutb/cuda/lane_major.hpp: the GPU-resident bit order of a LUT-B tile's 192 index bytes.
//
// The checkpoint stores a tile's 512 3-bit indices in flat order (spec section 2.2: index f =
// r*64 + c at bits 3f..3f+2). The GPU kernels read them in "lane-major" order instead: the same
// 192 bytes per tile (same tile order, same codebook and scale arrays, 3.140625 bits per weight),
// with the bits of each tile permuted so that every lane of a warp loads its own 16 indices with
// one 32-bit and one 16-bit load and turns them into four PRMT selectors with about 9 integer
// instructions (the flat order needs about 26). The permutation is a bijection inside each tile,
// so it is done in place at load time (to_lane_major in lutb/cuda/moe.hpp) and needs no memory.
//
// Lane L = 4g + t (g = 0..7, t = 0..3: the groupID / thread-in-group of mma.sync.m16n8k16) owns
// row g of the tile and the 16 columns lane_col(t, j), j = 0..15: columns 8t..8t+7 of each of the
// two 32-column halves (the MXFP8 blocks). With v_j = index(row g, lane_col(t, j)):
//   X = bytes 4L..4L+3 (little endian): nibble k (k = 0..7) bits 0..2 = v_k;
//       bit 4k+3 (k = 0..3) = bit 0 of v_{12+k}; bit 4(k+4)+3 = bit 1 of v_{12+k};
//   Y = bytes 128+2L..129+2L (little endian): nibble k (k = 0..3) bits 0..2 = v_{8+k};
//       bit 4k+3 = bit 2 of v_{12+k}.
// The PRMT selectors (nibble k bits 0..2 = an index, bit 3 zero, as PRMT's default mode needs):
//   S0 = X & 0x7777                  -> v_0..v_3     (columns 8t+0..3)
//   S1 = (X >> 16) & 0x7777          -> v_4..v_7     (columns 8t+4..7)
//   S2 = Y & 0x7777                  -> v_8..v_11    (columns 32+8t+0..3)
//   S3 = ((X >> 3) & 0x1111) | ((X >> 18) & 0x2222) | ((Y >> 1) & 0x4444)  -> v_12..v_15
// prmt(cb_lo, cb_hi, S) then yields the four codebook bytes in column order, so the pairs
// (columns 2u, 2u+1) land in the halves of one register: the mma operand order of lutb's kernels
// (k-slots 2t, 2t+1 <- columns 4s+0,1 and 2t+8, 2t+9 <- columns 4s+2,3 of the lane's step s).
#pragma once

#include <cstdint>

#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"

namespace lutb::cuda {

/// Column (0..63) of the tile held in slot j (0..15) by a lane with thread-in-group t (0..3).
LUTB_HD constexpr int lane_col(int t, int j) { return j < 8 ? 8 * t + j : 32 + 8 * t + (j - 8); }

/// Index at flat position f (0..511) of a tile in checkpoint (spec) order.
LUTB_HD constexpr unsigned spec_index(const std::uint8_t* packed192, int f) {
  const int bit = 3 * f, byte = bit >> 3, sh = bit & 7;
  unsigned w = packed192[byte];
  if (byte + 1 < kPackedBytes) w |= static_cast<unsigned>(packed192[byte + 1]) << 8;
  return (w >> sh) & 7u;
}

/// The X and Y words of lane L (0..31) from the lane's 16 indices v[0..15] (each 0..7).
LUTB_HD constexpr void lane_words(const unsigned (&v)[16], std::uint32_t& x, std::uint32_t& y) {
  x = 0;
  y = 0;
  for (int k = 0; k < 8; ++k) x |= (v[k] & 7u) << (4 * k);
  for (int k = 0; k < 4; ++k) {
    y |= (v[8 + k] & 7u) << (4 * k);
    x |= (v[12 + k] & 1u) << (4 * k + 3);
    x |= ((v[12 + k] >> 1) & 1u) << (4 * (k + 4) + 3);
    y |= ((v[12 + k] >> 2) & 1u) << (4 * k + 3);
  }
}

/// The four PRMT selectors of a lane from its X and Y words (see the file comment).
LUTB_HD constexpr void lane_selectors(std::uint32_t x, std::uint32_t y, std::uint32_t (&s)[4]) {
  s[0] = x & 0x7777u;
  s[1] = (x >> 16) & 0x7777u;
  s[2] = y & 0x7777u;
  s[3] = ((x >> 3) & 0x1111u) | ((x >> 18) & 0x2222u) | ((y >> 1) & 0x4444u);
}

/// Permutes one tile's 192 index bytes from checkpoint order (`in`) to lane-major order (`out`).
/// `in` and `out` must not overlap.
LUTB_HD constexpr void tile_to_lane_major(const std::uint8_t* in, std::uint8_t* out) {
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    unsigned v[16] = {};
    for (int j = 0; j < 16; ++j) v[j] = spec_index(in, g * 64 + lane_col(t, j));
    std::uint32_t x = 0, y = 0;
    lane_words(v, x, y);
    for (int b = 0; b < 4; ++b) out[4 * lane + b] = static_cast<std::uint8_t>(x >> (8 * b));
    out[128 + 2 * lane] = static_cast<std::uint8_t>(y);
    out[129 + 2 * lane] = static_cast<std::uint8_t>(y >> 8);
  }
}

/// Index (0..7) at row r (0..7), column c (0..63) of a tile stored in lane-major order.
LUTB_HD constexpr unsigned lane_major_index(const std::uint8_t* lm192, int r, int c) {
  const int half = c >> 5, t = (c & 31) >> 3, j = (c & 7) + 8 * half;
  const int lane = 4 * r + t;
  const std::uint32_t x = lm192[4 * lane] | (static_cast<std::uint32_t>(lm192[4 * lane + 1]) << 8) |
                          (static_cast<std::uint32_t>(lm192[4 * lane + 2]) << 16) |
                          (static_cast<std::uint32_t>(lm192[4 * lane + 3]) << 24);
  const std::uint32_t y = lm192[128 + 2 * lane] | (static_cast<std::uint32_t>(lm192[129 + 2 * lane]) << 8);
  std::uint32_t s[4] = {};
  lane_selectors(x, y, s);
  return (s[j >> 2] >> (4 * (j & 3))) & 7u;
}

/// Inverse of tile_to_lane_major (`in` lane-major, `out` checkpoint order; no overlap).
LUTB_HD constexpr void tile_from_lane_major(const std::uint8_t* in, std::uint8_t* out) {
  for (int b = 0; b < kPackedBytes; ++b) out[b] = 0;
  for (int f = 0; f < kTileSize; ++f) {
    const unsigned v = lane_major_index(in, f >> 6, f & 63);
    const int bit = 3 * f, byte = bit >> 3, sh = bit & 7;
    const unsigned w = v << sh;
    out[byte] = static_cast<std::uint8_t>(out[byte] | (w & 0xffu));
    if (w >> 8) out[byte + 1] = static_cast<std::uint8_t>(out[byte + 1] | (w >> 8));
  }
}

}  // namespace lutb::cuda
