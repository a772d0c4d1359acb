// Conversion between the LUT-B tile order (spec 2) and the sm_107 native layout. Every assumption
// is stated (A1..A6) in include/lutb/sm107_layout.hpp; this file only follows them.
#include "lutb/sm107_layout.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace lutb::sm107 {

namespace {
constexpr int kTilesPerRegionN = kRegionN / kTileRows;  // 8
constexpr int kTilesPerRegionK = kRegionK / kTileCols;  // 2
constexpr int kRowBytes = kTileCols * 3 / 8;            // 24 bytes of indices per tile row
static_assert(kTilesPerRegionK * kRowBytes == kColumnBytes);

struct Geometry {
  std::int64_t experts, tiles_n, tiles_k, regions_n, regions_k;
  explicit Geometry(const LutbShape& s)
      : experts(s.experts),
        tiles_n(s.tiles_n()),
        tiles_k(s.tiles_k()),
        regions_n((s.tiles_n() + kTilesPerRegionN - 1) / kTilesPerRegionN),
        regions_k((s.tiles_k() + kTilesPerRegionK - 1) / kTilesPerRegionK) {}
  std::int64_t region(std::int64_t e, std::int64_t rn, std::int64_t rk) const {  // A1
    return (e * regions_n + rn) * regions_k + rk;
  }
};

// Visits every (region, slot) with the LUT-B tile it holds (or -1 for a padding tile, A5).
template <class F>
void for_each_slot(const Geometry& g, std::int64_t e_begin, std::int64_t e_end, F&& f) {
  for (std::int64_t e = e_begin; e < e_end; ++e)
    for (std::int64_t rn = 0; rn < g.regions_n; ++rn)
      for (std::int64_t rk = 0; rk < g.regions_k; ++rk) {
        const std::int64_t reg = g.region(e, rn, rk);
        for (int tnl = 0; tnl < kTilesPerRegionN; ++tnl)
          for (int tkl = 0; tkl < kTilesPerRegionK; ++tkl) {
            const int slot = tnl * kTilesPerRegionK + tkl;  // A2
            const std::int64_t tn = rn * kTilesPerRegionN + tnl, tk = rk * kTilesPerRegionK + tkl;
            const std::int64_t tile =
                (tn < g.tiles_n && tk < g.tiles_k) ? (e * g.tiles_n + tn) * g.tiles_k + tk : -1;
            f(reg, tnl, tkl, slot, tile);
          }
      }
}
}  // namespace

Sm107Tensor to_sm107(const LutbView& w) {
  validate(w, "to_sm107 source");
  const Geometry g(w.shape);
  Sm107Tensor out;
  out.shape = w.shape;
  out.regions_n = g.regions_n;
  out.regions_k = g.regions_k;
  const std::int64_t regions = g.experts * g.regions_n * g.regions_k;
  out.packed.assign(static_cast<std::size_t>(regions * kRegionPackedBytes), 0);
  out.codebooks.assign(static_cast<std::size_t>(regions * kCodebookGroupBytes), 0);
  out.scales.assign(static_cast<std::size_t>(regions * kCodebooksPerGroup), kUE8M0One);
  for_each_slot(g, 0, g.experts, [&](std::int64_t reg, int tnl, int tkl, int slot, std::int64_t tile) {
    if (tile < 0) return;  // A5: padding tile stays zero / scale 127
    std::memcpy(out.codebooks.data() + reg * kCodebookGroupBytes + slot * kCodebookSize, w.tile_codebook(tile),
                kCodebookSize);
    out.scales[reg * kCodebooksPerGroup + slot] = w.tile_scale(tile);
    // A3: column n_local = tnl*8 + r gets this tile's row r at byte offset tkl*24 of its 48 bytes.
    for (int r = 0; r < kTileRows; ++r) {
      const int n_local = tnl * kTileRows + r;
      std::memcpy(out.packed.data() + reg * kRegionPackedBytes + n_local * kColumnBytes + tkl * kRowBytes,
                  w.tile_packed(tile) + r * kRowBytes, kRowBytes);
    }
  });
  return out;
}

static void check_native(const Sm107Tensor& w) {
  const Geometry g(w.shape);
  const std::int64_t regions = g.experts * g.regions_n * g.regions_k;
  if (w.regions_n != g.regions_n || w.regions_k != g.regions_k ||
      w.packed.size() != static_cast<std::size_t>(regions * kRegionPackedBytes) ||
      w.codebooks.size() != static_cast<std::size_t>(regions * kCodebookGroupBytes) ||
      w.scales.size() != static_cast<std::size_t>(regions * kCodebooksPerGroup))
    throw FormatError("sm107 tensor: buffer sizes or region counts do not match its shape");
}

static void copy_back(const Sm107Tensor& w, const Geometry& g, std::int64_t expert, LutbTensor& out) {
  const std::int64_t e0 = expert >= 0 ? expert : 0, e1 = expert >= 0 ? expert + 1 : g.experts;
  for_each_slot(g, e0, e1, [&](std::int64_t reg, int tnl, int tkl, int slot, std::int64_t tile) {
    if (tile < 0) return;
    const std::int64_t dst = expert >= 0 ? tile - expert * g.tiles_n * g.tiles_k : tile;
    std::memcpy(out.codebook.data() + dst * kCodebookSize,
                w.codebooks.data() + reg * kCodebookGroupBytes + slot * kCodebookSize, kCodebookSize);
    out.scale[dst] = w.scales[reg * kCodebooksPerGroup + slot];
    for (int r = 0; r < kTileRows; ++r) {
      const int n_local = tnl * kTileRows + r;
      std::memcpy(out.packed.data() + dst * kPackedBytes + r * kRowBytes,
                  w.packed.data() + reg * kRegionPackedBytes + n_local * kColumnBytes + tkl * kRowBytes, kRowBytes);
    }
  });
}

LutbTensor from_sm107(const Sm107Tensor& w) {
  check_native(w);
  LutbTensor out(w.shape);
  copy_back(w, Geometry(w.shape), -1, out);
  return out;
}

LutbTensor expert_from_sm107(const Sm107Tensor& w, std::int64_t e) {
  check_native(w);
  if (e < 0 || e >= w.shape.experts) throw std::out_of_range("expert_from_sm107: expert index out of range");
  LutbShape s = w.shape;
  s.experts = 1;
  s.stacked = false;
  LutbTensor out(s);
  // Restrict the walk to expert e (the geometry of the whole stack, filtered).
  copy_back(w, Geometry(w.shape), e, out);
  return out;
}

}  // namespace lutb::sm107
