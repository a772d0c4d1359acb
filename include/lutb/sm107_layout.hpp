// lutb/sm107_layout.hpp: the native (Rubin, compute capability 10.7) LUT-B weight layout.
//
// THIS HEADER IS THE ONE PLACE THAT HOLDS EVERY ASSUMPTION ABOUT THE sm_107 LAYOUT (spec 6.1).
//
// Public (relayed from PTX ISA 9.4 "Decompression of input matrices", tcgen05 .decompress_b):
//   P1  B (the weights) is read from shared memory as packed 3-bit indices; per-tile codebooks are
//       metadata in tensor memory, copied there with tcgen05.cp.
//   P2  In global memory the codebooks are stored 128-byte aligned in groups of 16 (16 x 8 bytes),
//       one group covering an N 64 x K 128 region (= 8 x 2 LUT-B tiles of 8 x 64).
//   P3  Packed B holds, per N column (one output feature n), 48 bytes for every 128 K
//       (128 indices x 3 bits).
//
// Assumptions (not public; this project decides them here and nowhere else):
//   A1  Region order: expert outermost, then N region (64 rows) outer, K region (128 columns) inner
//       -- the same N-outer / K-inner order as LUT-B tiles (spec 2).
//   A2  Codebook order inside a group of 16: slot = tn_local * 2 + tk_local, tn_local = 0..7 the
//       8-row tile inside the region, tk_local = 0..1 the 64-column tile. Entries in stored order.
//   A3  Packed B of a region: 64 records of 48 bytes, one per N column n_local = 0..63 ascending.
//       A record holds the region's 128 K indices in ascending k, 8 consecutive k per 3 bytes, as the
//       little-endian 24-bit word b0 | b1<<8 | b2<<16 with index j at bits 3j..3j+2 (the bit order
//       of spec 2's tile packing; the native bit order is not public). Region = 3072 bytes.
//   A4  Scales (one UE8M0 per 8 x 64 tile) are a separate byte array in the codebook slot order, 16
//       bytes per region (where the hardware takes them is not public).
//   A5  Shapes are padded to N % 64 == 0 and K % 128 == 0 with zero tiles (indices 0, codebook
//       +0, scale 127); from_sm107 drops them again. The native kernel itself needs H and I to be
//       multiples of 128 (the seed's LUT_B_SM107_TILE_K / _N), which LutBOnlineMoEMethod checks.
//   A6  The three arrays (packed, codebooks, scales) each start 128-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <vector>

#include "lutb/tile.hpp"

namespace lutb::sm107 {

inline constexpr int kRegionN = 64;                 // P2
inline constexpr int kRegionK = 128;                // P2
inline constexpr int kCodebooksPerGroup = 16;       // P2: 8 x 2 tiles
inline constexpr int kCodebookGroupBytes = 128;     // P2: 16 x 8 bytes
inline constexpr int kAlignment = 128;              // P2, A6
inline constexpr int kColumnBytes = 48;             // P3: 128 x 3 bits
inline constexpr int kRegionPackedBytes = kRegionN * kColumnBytes;  // A3: 3072
static_assert(kCodebooksPerGroup * kCodebookSize == kCodebookGroupBytes);
static_assert((kRegionN / kTileRows) * (kRegionK / kTileCols) == kCodebooksPerGroup);
static_assert(kRegionK * 3 / 8 == kColumnBytes);

/// Minimal allocator giving kAlignment-aligned storage (A6).
template <class T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <class U> AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(std::size_t n) {
    const std::size_t bytes = (n * sizeof(T) + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, bytes == 0 ? kAlignment : bytes);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <class U> bool operator==(const AlignedAllocator<U>&) const { return true; }
};
using AlignedBytes = std::vector<std::uint8_t, AlignedAllocator<std::uint8_t>>;

/// A weight (or expert stack) in the native layout.
struct Sm107Tensor {
  LutbShape shape;             // logical shape (as the LUT-B source)
  std::int64_t regions_n = 0;  // ceil(rows / 64)
  std::int64_t regions_k = 0;  // ceil(cols / 128)
  AlignedBytes packed;         // [E, regions_n, regions_k, 64, 48]
  AlignedBytes codebooks;      // [E, regions_n, regions_k, 16, 8]
  AlignedBytes scales;         // [E, regions_n, regions_k, 16]

  std::int64_t regions_per_expert() const { return regions_n * regions_k; }
  std::size_t bytes() const { return packed.size() + codebooks.size() + scales.size(); }
};

/// Converts a LUT-B tensor (spec 2 tile order) to the native layout (A1..A6). Validates the source
/// (FormatError on scale 255 / NaN codebook entries).
Sm107Tensor to_sm107(const LutbView& w);
/// Converts back; exact inverse of to_sm107 on valid data (padding tiles dropped).
LutbTensor from_sm107(const Sm107Tensor& w);
/// Converts one expert e of a native stack back to a 2-D LUT-B tensor (shape.stacked = false).
LutbTensor expert_from_sm107(const Sm107Tensor& w, std::int64_t e);

}  // namespace lutb::sm107
