// lutb/tile.hpp: the LUT-B weight format (spec section 2).
//
// A weight W[N, K] (PyTorch layout: N output features, K the reduction axis) is cut into tiles of
// 8 rows x 64 columns. Tile (tn, tk) covers rows 8*tn..8*tn+7 and columns 64*tk..64*tk+63; tiles
// are stored tn outer, tk inner, and expert stacks W[E, N, K] add an outer expert dimension.
// Each tile is
//   packed   192 bytes: 512 3-bit indices, flat position f = r*64 + c, groups of 8 consecutive f in
//            3 bytes, index j of a group at bits 3j..3j+2 of the little-endian 24-bit word
//   codebook 8 E4M3 bytes (fitters write them ascending; readers honour any order)
//   scale    1 UE8M0 byte s; the value is w = e4m3(codebook[index]) * 2^(s-127); 255 is invalid
// = 201 bytes per 512 weights = 3.140625 bits per weight.
// Shapes that are not multiples of the tile are zero-padded to N % 8 == 0 and K % 64 == 0; the
// logical shape is kept beside the data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "lutb/numerics.hpp"

namespace lutb {

inline constexpr int kTileRows = 8;          // N extent of a tile
inline constexpr int kTileCols = 64;         // K extent of a tile
inline constexpr int kTileSize = 512;        // weights per tile
inline constexpr int kPackedBytes = 192;     // 512 * 3 bits / 8
inline constexpr int kCodebookSize = 8;      // entries per tile codebook
inline constexpr double kBitsPerWeight = (kPackedBytes + kCodebookSize + 1) * 8.0 / kTileSize;  // 3.140625

/// One tile as stored in a flat array-of-structs (used by fitters' outputs and tests; the
/// checkpoint stores the three fields as three separate tensors, see LutbTensor).
struct TileBlock {
  std::uint8_t packed[kPackedBytes];    // 3-bit indices, spec 2 bit order
  std::uint8_t codebook[kCodebookSize]; // E4M3 bytes
  std::uint8_t scale;                   // UE8M0 byte
};
static_assert(sizeof(TileBlock) == 201, "LUT-B tile is 201 bytes: 3.140625 bits per weight");

/// Error for malformed LUT-B data (scale 255, NaN codebook entry, wrong buffer sizes, ...).
struct FormatError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------
// Index packing (spec section 2, "Indices")
// ---------------------------------------------------------------------------
/// Packs 8 3-bit indices (each 0..7) into 3 bytes: word = b0 | b1<<8 | b2<<16, index j at bits 3j.
/// Example: {1,2,3,4,5,6,7,0} -> D1 58 1F.
LUTB_HD constexpr void pack8(const std::uint8_t idx[8], std::uint8_t out[3]) {
  std::uint32_t w = 0;
  for (int j = 0; j < 8; ++j) w |= static_cast<std::uint32_t>(idx[j] & 7u) << (3 * j);
  out[0] = static_cast<std::uint8_t>(w);
  out[1] = static_cast<std::uint8_t>(w >> 8);
  out[2] = static_cast<std::uint8_t>(w >> 16);
}
/// Inverse of pack8.
LUTB_HD constexpr void unpack8(const std::uint8_t in[3], std::uint8_t idx[8]) {
  const std::uint32_t w = in[0] | (static_cast<std::uint32_t>(in[1]) << 8) | (static_cast<std::uint32_t>(in[2]) << 16);
  for (int j = 0; j < 8; ++j) idx[j] = static_cast<std::uint8_t>((w >> (3 * j)) & 7u);
}
/// Packs 512 indices (flat tile order f = r*64 + c) into 192 bytes (spec 2). Only the low 3 bits
/// of each index are used (callers pass 0..7). Equivalently, index f occupies bits 3f..3f+2 of the
/// 1536-bit little-endian stream the 192 bytes form.
void pack_tile_indices(const std::uint8_t* indices512, std::uint8_t* packed192);
/// Unpacks 192 bytes into 512 indices 0..7 (flat tile order). Every byte pattern is valid.
void unpack_tile_indices(const std::uint8_t* packed192, std::uint8_t* indices512);

// ---------------------------------------------------------------------------
// Shapes and tensors
// ---------------------------------------------------------------------------
/// Logical and padded shape of a LUT-B weight or expert stack.
struct LutbShape {
  std::int64_t experts = 1;  // leading expert dimension (1 for a plain 2-D weight)
  std::int64_t rows = 0;     // N, logical (unpadded)
  std::int64_t cols = 0;     // K, logical (unpadded)
  bool stacked = false;      // true when the tensor has an expert dimension ([E, N, K])

  std::int64_t padded_rows() const { return (rows + kTileRows - 1) / kTileRows * kTileRows; }
  std::int64_t padded_cols() const { return (cols + kTileCols - 1) / kTileCols * kTileCols; }
  std::int64_t tiles_n() const { return padded_rows() / kTileRows; }
  std::int64_t tiles_k() const { return padded_cols() / kTileCols; }
  std::int64_t tiles_per_expert() const { return tiles_n() * tiles_k(); }
  std::int64_t tiles() const { return experts * tiles_per_expert(); }
  bool padded() const { return rows != padded_rows() || cols != padded_cols(); }
};

/// Non-owning view of a LUT-B tensor: three arrays laid out as the checkpoint stores them
///   packed   [E, N/8, K/64, 192] u8
///   codebook [E, N/8, K/64, 8]   E4M3 bytes
///   scale    [E, N/8, K/64]      UE8M0 bytes
/// (E omitted when !shape.stacked). The arrays may live in a memory-mapped file.
struct LutbView {
  LutbShape shape;
  const std::uint8_t* packed = nullptr;
  const std::uint8_t* codebook = nullptr;
  const std::uint8_t* scale = nullptr;

  /// Pointers to tile t (0 <= t < shape.tiles()).
  const std::uint8_t* tile_packed(std::int64_t t) const { return packed + t * kPackedBytes; }
  const std::uint8_t* tile_codebook(std::int64_t t) const { return codebook + t * kCodebookSize; }
  std::uint8_t tile_scale(std::int64_t t) const { return scale[t]; }
  /// View of expert e (0 <= e < shape.experts) of a stack, as a 2-D weight (experts 1, not
  /// stacked), pointing into the same arrays. Throws FormatError when e is out of range.
  LutbView expert(std::int64_t e) const;
};

/// Owning LUT-B tensor (same layout as LutbView).
struct LutbTensor {
  LutbShape shape;
  std::vector<std::uint8_t> packed;
  std::vector<std::uint8_t> codebook;
  std::vector<std::uint8_t> scale;

  LutbTensor() = default;
  /// Allocates zeroed storage for `shape` (indices 0, codebooks +0, scales 127): a valid all-zero
  /// weight. Throws FormatError for a shape with experts, rows or cols < 1, or experts > 1 without
  /// `stacked`.
  explicit LutbTensor(const LutbShape& shape);
  LutbView view() const { return {shape, packed.data(), codebook.data(), scale.data()}; }
  std::size_t bytes() const { return packed.size() + codebook.size() + scale.size(); }
};

/// Checks a view for invalid data: any scale byte 255, any NaN codebook byte (0x7F/0xFF), an
/// invalid shape or a null pointer. Throws FormatError naming `what`, the first bad tile as
/// "tile (expert e, tn i, tk j)" (or "tile (tn i, tk j)" when not stacked) and the reason. Every
/// other byte pattern is valid LUT-B data.
void validate(const LutbView& w, const std::string& what = "LUT-B tensor");

/// Checks that three buffers of the given byte sizes match `shape` (tiles() x 192, x 8, x 1); throws
/// FormatError naming `what`, the field, and the expected and actual sizes, e.g.
/// "w2: codebook has 63 bytes, expected 64 (8 tiles x 8 bytes) for logical shape ..."
void check_sizes(const LutbShape& shape, std::size_t packed_bytes, std::size_t codebook_bytes,
                 std::size_t scale_bytes, const std::string& what = "LUT-B tensor");

// ---------------------------------------------------------------------------
// Dequantisation. Values are w = e4m3(codebook[index]) * 2^(scale-127) computed exactly in FP32
// (every scale byte 0..254 gives the exact product, except that scales above 246 with large entries
// overflow to +-Inf). For scale bytes 3..246 every value is also exact in BF16 (spec 2).
// ---------------------------------------------------------------------------
/// Dequantises one tile to 512 FP32 values in flat tile order (r*64 + c). Throws FormatError on
/// scale 255 or a NaN codebook entry (before writing anything).
void dequantize_tile(const std::uint8_t* packed192, const std::uint8_t* codebook8, std::uint8_t scale,
                     float* out512);

/// Dequantises a 2-D weight or an expert stack to its logical shape, row-major FP32
/// out[E][rows][cols] (E = 1 when not stacked). Padding is dropped. Validates the whole view first
/// (throws FormatError as validate(), before writing anything).
void dequantize(const LutbView& w, float* out);
std::vector<float> dequantize(const LutbView& w);
/// Same, to BF16 bits out[E][rows][cols]: exact for scales 3..246; other scales round to nearest
/// even (bf16_from_float).
void dequantize_bf16(const LutbView& w, std::uint16_t* out);

// ---------------------------------------------------------------------------
// Padding helpers
// ---------------------------------------------------------------------------
/// Copies a logical row-major matrix src[rows][cols] (FP32) into dst[padded_rows][padded_cols]
/// (rows rounded up to 8, cols to 64) with zeros in the padding. dst must hold
/// padded_rows*padded_cols floats and not overlap src.
void pad_to_tiles(const float* src, std::int64_t rows, std::int64_t cols, float* dst);
/// Gathers tile (tn, tk) of a row-major FP32 matrix src[rows][cols] into 512 values in flat tile
/// order, zero-filling positions outside the logical shape (the seed's `_zero_padding`). Any
/// tn, tk >= 0 is accepted (a tile wholly outside gives zeros); only in-shape elements are read.
void gather_tile(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t tn,
                 std::int64_t tk, float* out512);
/// Same for a BF16 source (bits), converted exactly to FP32.
void gather_tile_bf16(const std::uint16_t* src, std::int64_t rows, std::int64_t cols, std::int64_t tn,
                      std::int64_t tk, float* out512);

}  // namespace lutb
