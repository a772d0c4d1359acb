// Private to src/model: where the routed experts and routers of a checkpoint come from.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lutb/fit.hpp"
#include "lutb/model.hpp"
#include "lutb/tile.hpp"
#include "model/layers.hpp"

namespace lutb::model {

struct RouterWeights {
  std::vector<float> gate;             // [E][H] FP32
  std::vector<float> correction_bias;  // [E] (DeepSeek-V3), else empty
};

/// The experts of one checkpoint, stacked in the fused-MoE layout of lutb/moe.hpp:
/// w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I].
class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  static std::unique_ptr<ExpertSource> open(const std::filesystem::path& dir, const TransformerConfig& cfg);
  /// True for a LUT-B checkpoint (spec 2.2).
  virtual bool lutb() const = 0;
  virtual RouterWeights router(int layer) const = 0;
  /// Shared experts of the layer in FP32 (empty when the family has none).
  virtual SharedExperts shared(int layer) const = 0;
  /// Name prefix of layer `layer`'s experts, e.g. "model.layers.1.mlp.experts".
  virtual std::string expert_prefix(int layer) const = 0;
  /// BF16 bits of w13 and w2 (BF16 copied, F16/F32 rounded to BF16). Throws on a LUT-B checkpoint.
  virtual std::pair<std::vector<std::uint16_t>, std::vector<std::uint16_t>> bf16_stacks(int layer) const = 0;
  /// Stored LUT-B w13 and w2. Throws on a BF16 checkpoint.
  virtual std::pair<LutbTensor, LutbTensor> lutb_stacks(int layer) const = 0;
  /// Where element (expert, row, col) of layer `layer`'s w13 (`w13` true) or w2 stack is stored:
  /// "FILE: tensor NAME (layer L, expert E), row R col C" in the stored tensor's own coordinates
  /// (per-expert gate / up / down, or the stacked tensors), for error messages.
  virtual std::string locate(int layer, bool w13, std::int64_t expert, std::int64_t row, std::int64_t col) const = 0;
  /// Where the scale of tile (tile_row, tile_col) of expert `expert` of layer `layer`'s stored LUT-B
  /// w13 (gate tiles, then up tiles) or w2 stack is, for error messages: "FILE: tensor NAME_scale
  /// (layer L, expert E), tile [R, C]" in the stored per-expert tensor's grid, or, for stacked
  /// tensors, "FILE: tensor NAME_scale (layer L), expert E, tile row R, tile column C of the w13 / w2
  /// stack". A LUT-B checkpoint only.
  virtual std::string locate_lutb_tile(int layer, bool w13, std::int64_t expert, std::int64_t tile_row,
                                       std::int64_t tile_col) const = 0;
};

/// Quantise-dequantise a BF16 weight [rows][cols] in place with a baseline format (INT3 g128 or
/// MXFP4, lutb/baselines.hpp; the dequantised values rounded to BF16 for the BF16 expert kernel);
/// stats over the weights as used, *bytes = the format's storage size (bits_per_weight * n / 8).
void baseline_qdq(Quant q, std::vector<std::uint16_t>& w, std::int64_t rows, std::int64_t cols, const std::string& name,
                  FitStats* stats, std::size_t* bytes);

}  // namespace lutb::model
