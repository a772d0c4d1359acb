// The LUT-B tile format (spec section 2): index packing, validation, dequantisation, padding.
#include "lutb/tile.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include <fmt/format.h>

namespace lutb {

// ---------------------------------------------------------------------------
// Index packing
// ---------------------------------------------------------------------------
void pack_tile_indices(const std::uint8_t* indices512, std::uint8_t* packed192) {
  for (int g = 0; g < kTileSize / 8; ++g) pack8(indices512 + 8 * g, packed192 + 3 * g);
}

void unpack_tile_indices(const std::uint8_t* packed192, std::uint8_t* indices512) {
  for (int g = 0; g < kTileSize / 8; ++g) unpack8(packed192 + 3 * g, indices512 + 8 * g);
}

// ---------------------------------------------------------------------------
// Shapes and views
// ---------------------------------------------------------------------------
namespace {

struct TileCoord {
  std::int64_t expert, tn, tk;
};

TileCoord coord_of(const LutbShape& s, std::int64_t t) {
  const std::int64_t per = s.tiles_per_expert();
  const std::int64_t e = per ? t / per : 0;
  const std::int64_t r = per ? t % per : 0;
  const std::int64_t tk_n = s.tiles_k();
  return {e, tk_n ? r / tk_n : 0, tk_n ? r % tk_n : 0};
}

std::string tile_name(const LutbShape& s, std::int64_t t) {
  const TileCoord c = coord_of(s, t);
  if (s.stacked) return fmt::format("tile (expert {}, tn {}, tk {})", c.expert, c.tn, c.tk);
  return fmt::format("tile (tn {}, tk {})", c.tn, c.tk);
}

std::string shape_str(const LutbShape& s) {
  if (s.stacked) return fmt::format("[{}, {}, {}]", s.experts, s.rows, s.cols);
  return fmt::format("[{}, {}]", s.rows, s.cols);
}

void check_shape(const LutbShape& s, const std::string& what) {
  if (s.experts < 1 || s.rows < 1 || s.cols < 1 || (!s.stacked && s.experts != 1))
    throw FormatError(fmt::format("{}: invalid LUT-B shape {} (experts {}, stacked {})", what, shape_str(s),
                                  s.experts, s.stacked));
  // The padded sizes and the byte counts must fit 64 bits: otherwise [2^40, 2^40] wraps to 0 tiles
  // (signed overflow, undefined behaviour) and would pass LutbTensor, check_sizes and validate as an
  // empty tensor.
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  std::int64_t bytes = 0;
  const bool overflow = s.rows > kMax - (kTileRows - 1) || s.cols > kMax - (kTileCols - 1) ||
                        __builtin_mul_overflow(s.tiles_n(), s.tiles_k(), &bytes) ||
                        __builtin_mul_overflow(bytes, s.experts, &bytes) ||
                        __builtin_mul_overflow(bytes, static_cast<std::int64_t>(kPackedBytes), &bytes);
  if (overflow)
    throw FormatError(fmt::format("{}: LUT-B shape {} is too large: its packed bytes overflow 64-bit sizes", what,
                                  shape_str(s)));
}

// Per-tile lookup table: the 8 codebook entries times 2^(scale-127), exact in FP32 (the product of
// an E4M3 value and a power of two with the exponent range of UE8M0 0..254 is representable, or
// overflows to +-Inf for scales above 246 and the largest entries; ldexp_ue8m0 is exact).
inline void tile_lut(const std::uint8_t* codebook8, std::uint8_t scale, float lut[8]) {
  for (int j = 0; j < kCodebookSize; ++j) lut[j] = ldexp_ue8m0(e4m3_to_float(codebook8[j]), scale);
}

// Unchecked decode of one tile into 512 FP32 values (flat order) from its lookup table.
inline void decode_tile(const std::uint8_t* packed192, const float lut[8], float* out512) {
  for (int g = 0; g < kTileSize / 8; ++g) {
    const std::uint8_t* p = packed192 + 3 * g;
    const std::uint32_t w = p[0] | (static_cast<std::uint32_t>(p[1]) << 8) | (static_cast<std::uint32_t>(p[2]) << 16);
    float* o = out512 + 8 * g;
    for (int j = 0; j < 8; ++j) o[j] = lut[(w >> (3 * j)) & 7u];
  }
}

// Throws FormatError when the tile's scale is 255 or a codebook entry is NaN.
void check_tile(const std::uint8_t* codebook8, std::uint8_t scale, const std::string& what,
                const std::string& where) {
  if (scale == kUE8M0NaN)
    throw FormatError(fmt::format("{}: {} has scale byte 255 (UE8M0 NaN), which is invalid", what, where));
  for (int j = 0; j < kCodebookSize; ++j)
    if (e4m3_is_nan(codebook8[j]))
      throw FormatError(fmt::format("{}: {} has a NaN codebook entry (index {}, byte 0x{:02X})", what, where, j,
                                    codebook8[j]));
}

}  // namespace

LutbView LutbView::expert(std::int64_t e) const {
  if (e < 0 || e >= shape.experts)
    throw FormatError(fmt::format("LUT-B view: expert {} out of range (the stack has {} experts)", e, shape.experts));
  LutbView v = *this;
  v.shape.experts = 1;
  v.shape.stacked = false;
  const std::int64_t off = e * shape.tiles_per_expert();
  v.packed = packed + off * kPackedBytes;
  v.codebook = codebook + off * kCodebookSize;
  v.scale = scale + off;
  return v;
}

LutbTensor::LutbTensor(const LutbShape& s) : shape(s) {
  check_shape(s, "LutbTensor");
  const auto t = static_cast<std::size_t>(s.tiles());
  packed.assign(t * kPackedBytes, 0);
  codebook.assign(t * kCodebookSize, 0);
  scale.assign(t, kUE8M0One);
}

void validate(const LutbView& w, const std::string& what) {
  check_shape(w.shape, what);
  if (!w.packed || !w.codebook || !w.scale) throw FormatError(fmt::format("{}: null data pointer", what));
  const std::int64_t n = w.shape.tiles();
  for (std::int64_t t = 0; t < n; ++t) {
    const std::uint8_t s = w.scale[t];
    const std::uint8_t* cb = w.codebook + t * kCodebookSize;
    bool bad = s == kUE8M0NaN;
    for (int j = 0; j < kCodebookSize; ++j) bad |= e4m3_is_nan(cb[j]);
    if (bad) check_tile(cb, s, what, tile_name(w.shape, t));
  }
}

void check_sizes(const LutbShape& shape, std::size_t packed_bytes, std::size_t codebook_bytes,
                 std::size_t scale_bytes, const std::string& what) {
  check_shape(shape, what);
  const auto t = static_cast<std::size_t>(shape.tiles());
  const auto check = [&](const char* field, std::size_t per_tile, std::size_t actual) {
    if (actual != t * per_tile)
      throw FormatError(fmt::format("{}: {} has {} bytes, expected {} ({} tiles x {} bytes) for logical shape {} "
                                    "(padded [{}, {}])",
                                    what, field, actual, t * per_tile, t, per_tile, shape_str(shape),
                                    shape.padded_rows(), shape.padded_cols()));
  };
  check("packed", kPackedBytes, packed_bytes);
  check("codebook", kCodebookSize, codebook_bytes);
  check("scale", 1, scale_bytes);
}

// ---------------------------------------------------------------------------
// Dequantisation
// ---------------------------------------------------------------------------
void dequantize_tile(const std::uint8_t* packed192, const std::uint8_t* codebook8, std::uint8_t scale,
                     float* out512) {
  check_tile(codebook8, scale, "LUT-B tile", "the tile");
  float lut[8];
  tile_lut(codebook8, scale, lut);
  decode_tile(packed192, lut, out512);
}

namespace {
// Shared walk over tiles: calls emit(expert, row0, col0, rows_valid, cols_valid, tile512) per tile.
template <class Emit>
void for_each_decoded_tile(const LutbView& w, Emit&& emit) {
  const LutbShape& s = w.shape;
  const std::int64_t tn_n = s.tiles_n(), tk_n = s.tiles_k();
  alignas(64) float tile[kTileSize];
  std::int64_t t = 0;
  for (std::int64_t e = 0; e < s.experts; ++e)
    for (std::int64_t tn = 0; tn < tn_n; ++tn)
      for (std::int64_t tk = 0; tk < tk_n; ++tk, ++t) {
        float lut[8];
        tile_lut(w.tile_codebook(t), w.tile_scale(t), lut);
        decode_tile(w.tile_packed(t), lut, tile);
        const std::int64_t r0 = tn * kTileRows, c0 = tk * kTileCols;
        emit(e, r0, c0, std::min<std::int64_t>(kTileRows, s.rows - r0), std::min<std::int64_t>(kTileCols, s.cols - c0),
             static_cast<const float*>(tile));
      }
}
}  // namespace

void dequantize(const LutbView& w, float* out) {
  validate(w);
  const std::int64_t rows = w.shape.rows, cols = w.shape.cols;
  for_each_decoded_tile(w, [&](std::int64_t e, std::int64_t r0, std::int64_t c0, std::int64_t nr, std::int64_t nc,
                               const float* tile) {
    float* base = out + (e * rows + r0) * cols + c0;
    for (std::int64_t r = 0; r < nr; ++r)
      std::memcpy(base + r * cols, tile + r * kTileCols, static_cast<std::size_t>(nc) * sizeof(float));
  });
}

std::vector<float> dequantize(const LutbView& w) {
  check_shape(w.shape, "LUT-B tensor");
  std::vector<float> out(static_cast<std::size_t>(w.shape.experts * w.shape.rows * w.shape.cols));
  dequantize(w, out.data());
  return out;
}

void dequantize_bf16(const LutbView& w, std::uint16_t* out) {
  validate(w);
  const std::int64_t rows = w.shape.rows, cols = w.shape.cols;
  for_each_decoded_tile(w, [&](std::int64_t e, std::int64_t r0, std::int64_t c0, std::int64_t nr, std::int64_t nc,
                               const float* tile) {
    std::uint16_t* base = out + (e * rows + r0) * cols + c0;
    for (std::int64_t r = 0; r < nr; ++r) bf16_from_float_n(tile + r * kTileCols, base + r * cols, static_cast<std::size_t>(nc));
  });
}

// ---------------------------------------------------------------------------
// Padding helpers
// ---------------------------------------------------------------------------
void pad_to_tiles(const float* src, std::int64_t rows, std::int64_t cols, float* dst) {
  const LutbShape s{1, rows, cols, false};
  const std::int64_t pr = s.padded_rows(), pc = s.padded_cols();
  for (std::int64_t r = 0; r < pr; ++r) {
    float* d = dst + r * pc;
    if (r < rows) {
      std::memcpy(d, src + r * cols, static_cast<std::size_t>(cols) * sizeof(float));
      std::fill(d + cols, d + pc, 0.0f);
    } else {
      std::fill(d, d + pc, 0.0f);
    }
  }
}

namespace {
template <class T, class Conv>
void gather_tile_impl(const T* src, std::int64_t rows, std::int64_t cols, std::int64_t tn, std::int64_t tk,
                      float* out512, Conv conv) {
  const std::int64_t r0 = tn * kTileRows, c0 = tk * kTileCols;
  const std::int64_t nc = std::clamp<std::int64_t>(cols - c0, 0, kTileCols);
  for (int r = 0; r < kTileRows; ++r) {
    float* o = out512 + r * kTileCols;
    if (r0 + r < rows && nc > 0) {
      conv(src + (r0 + r) * cols + c0, o, static_cast<std::size_t>(nc));
      std::fill(o + nc, o + kTileCols, 0.0f);
    } else {
      std::fill(o, o + kTileCols, 0.0f);
    }
  }
}
}  // namespace

void gather_tile(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t tn, std::int64_t tk,
                 float* out512) {
  gather_tile_impl(src, rows, cols, tn, tk, out512,
                   [](const float* s, float* o, std::size_t n) { std::memcpy(o, s, n * sizeof(float)); });
}

void gather_tile_bf16(const std::uint16_t* src, std::int64_t rows, std::int64_t cols, std::int64_t tn,
                      std::int64_t tk, float* out512) {
  gather_tile_impl(src, rows, cols, tn, tk, out512,
                   [](const std::uint16_t* s, float* o, std::size_t n) { bf16_to_float_n(s, o, n); });
}

}  // namespace lutb
