// Fitting an expert stack in groups of whole experts, polling an interrupt flag between groups
// (src/cli/gpu.cpp runs lutb::cuda::quantize_gpu so, since that call does not poll a flag). Header
// only and free of CUDA so that tests/cli/cli_fit_groups_test.cpp checks it with the CPU fitter.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include <fmt/core.h>

#include "lutb/dtype.hpp"
#include "lutb/fit.hpp"
#include "lutb/tile.hpp"

namespace lutb::cli {

/// Fits src (row-major [E, N, K] of dtype dt, or [N, K] when !shape.stacked) into `out` by calling
/// part(src_part, dt, part_shape, part_out) -> FitStats on consecutive groups of at most
/// max(1, group_weights / (N*K)) whole experts (one call when the tensor is not stacked or fits), and
/// concatenates the outputs: the tiles of a stack are in expert order (lutb/tile.hpp), so the result
/// is the whole-tensor fit's byte for byte whenever `part` is deterministic per expert (every fitter
/// is: a tile's fit depends only on the tile). Returns the FitStats summed group by group.
/// Before every group but the first, a nonzero *interrupt stops it: `out` is cleared and Interrupted
/// (signal = the flag's value, tiles_done = tiles of the groups fitted) is thrown, worded as
/// lutb::quantize words it ("quantize: tensor NAME: interrupted (flag V) after K of N tiles").
/// An std::invalid_argument from `part` whose message reads "<prefix>tensor NAME, expert E, ..." (prefix
/// "quantize_gpu: " or "quantize: ") is rethrown as "quantize: tensor NAME, expert E', ..." with E'
/// counted from the start of the stack; `out` is cleared.
template <class PartFit>
FitStats fit_in_expert_groups(const void* src, DType dt, const LutbShape& shape, LutbTensor& out,
                              const std::string& name, const InterruptFlag* interrupt, std::int64_t group_weights,
                              PartFit&& part) {
  const std::int64_t per_expert = shape.rows * shape.cols;
  const std::int64_t group = shape.stacked ? std::max<std::int64_t>(
                                                 1, std::min(shape.experts, group_weights / std::max<std::int64_t>(1, per_expert)))
                                           : shape.experts;
  const std::size_t esize = dtype_size(dt);
  const std::int64_t tiles_pe = shape.tiles_per_expert();
  const bool split = group < shape.experts;
  FitStats st;
  if (split) {
    out.shape = shape;
    out.packed.assign(static_cast<std::size_t>(shape.tiles()) * kPackedBytes, 0);
    out.codebook.assign(static_cast<std::size_t>(shape.tiles()) * kCodebookSize, 0);
    out.scale.assign(static_cast<std::size_t>(shape.tiles()), 0);
  }
  for (std::int64_t e0 = 0; e0 < shape.experts; e0 += group) {
    const std::int64_t n = std::min(group, shape.experts - e0);
    if (e0 > 0 && interrupt && interrupt->load() != 0) {
      const int sig = interrupt->load();
      out = LutbTensor{};
      throw Interrupted(sig, fmt::format("quantize: tensor {}: interrupted (flag {}) after {} of {} tiles", name, sig,
                                         e0 * tiles_pe, shape.tiles()),
                        e0 * tiles_pe, shape.tiles());
    }
    LutbShape ps = shape;
    ps.experts = n;
    LutbTensor piece;
    LutbTensor& dst = split ? piece : out;
    try {
      st += part(static_cast<const std::uint8_t*>(src) + static_cast<std::size_t>(e0 * per_expert) * esize, dt, ps, dst);
    } catch (const std::invalid_argument& e) {
      std::string m = e.what();
      for (const std::string p : {"quantize_gpu: ", "quantize: "})
        if (m.rfind(p, 0) == 0) {
          m = m.substr(p.size());
          break;
        }
      const std::string pre = "tensor " + name + ", expert ";
      if (m.rfind(pre, 0) == 0) {
        std::size_t end = pre.size();
        while (end < m.size() && m[end] >= '0' && m[end] <= '9') ++end;
        if (end > pre.size())
          m = pre + std::to_string(std::stoll(m.substr(pre.size(), end - pre.size())) + e0) + m.substr(end);
      }
      out = LutbTensor{};
      throw std::invalid_argument("quantize: " + m);
    }
    if (split) {
      const std::size_t t0 = static_cast<std::size_t>(e0 * tiles_pe);
      std::copy(piece.packed.begin(), piece.packed.end(), out.packed.begin() + t0 * kPackedBytes);
      std::copy(piece.codebook.begin(), piece.codebook.end(), out.codebook.begin() + t0 * kCodebookSize);
      std::copy(piece.scale.begin(), piece.scale.end(), out.scale.begin() + t0);
    }
  }
  return st;
}

}  // namespace lutb::cli
