// ExpertSource over lutb::Checkpoint (per-expert or stacked tensors, BF16 or stored LUT-B, spec 7
// and 2.2), and the baseline formats' quantise-dequantise.
#include <fmt/core.h>

#include "lutb/baselines.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/numerics.hpp"
#include "model/expert_source.hpp"

namespace lutb::model {
namespace {

Linear to_linear(const DenseStack& d) {
  Linear l;
  l.out = d.rows;
  l.in = d.cols;
  l.w = d.to_float();
  return l;
}

class CheckpointExperts final : public ExpertSource {
 public:
  explicit CheckpointExperts(const std::filesystem::path& dir) : ck_(dir) {}

  bool lutb() const override { return ck_.is_lutb(); }
  std::string expert_prefix(int layer) const override { return moe_prefix(ck_.config(), layer) + ".experts"; }

  RouterWeights router(int layer) const override {
    lutb::RouterWeights r = ck_.router(layer);
    RouterWeights out;
    out.gate = r.weight.to_float();
    if (r.bias) out.correction_bias = *r.bias;
    return out;
  }

  SharedExperts shared(int layer) const override {
    SharedExperts s;
    const auto se = ck_.shared_expert(layer);
    if (!se) return s;
    s.mlp.gate = to_linear(se->gate);
    s.mlp.up = to_linear(se->up);
    s.mlp.down = to_linear(se->down);
    if (se->output_gate) s.gate = to_linear(*se->output_gate);
    return s;
  }

  std::pair<std::vector<std::uint16_t>, std::vector<std::uint16_t>> bf16_stacks(int layer) const override {
    ExpertsSource e = ck_.experts_source(layer);
    return {e.w13.to_bf16(), e.w2.to_bf16()};
  }

  std::pair<LutbTensor, LutbTensor> lutb_stacks(int layer) const override {
    ExpertsLutb e = ck_.lutb_experts(layer);
    return {std::move(e.w13), std::move(e.w2)};
  }

  std::string locate(int layer, bool w13, std::int64_t expert, std::int64_t row, std::int64_t col) const override {
    return ck_.expert_location(layer, w13, expert, row, col);
  }

  std::string locate_lutb_tile(int layer, bool w13, std::int64_t expert, std::int64_t tile_row,
                               std::int64_t tile_col) const override {
    const ModelConfig& c = ck_.config();
    const auto file = [&](const std::string& n) {
      return ck_.contains(n) ? ck_.tensors().file_of(n).path().string() : ck_.dir().string();
    };
    std::vector<std::string> stacked = {w13 ? stacked_gate_up_name(c, layer) : stacked_down_name(c, layer)};
    if (c.family == ModelFamily::mixtral)  // transformers 5 renames block_sparse_moe to mlp
      stacked.push_back(fmt::format("model.layers.{}.mlp.experts.{}", layer, w13 ? "gate_up_proj" : "down_proj"));
    for (const auto& n : stacked)
      if (const std::string sc = lutb_names(n).scale; ck_.contains(sc))
        return fmt::format("{}: tensor {} (layer {}), expert {}, tile row {}, tile column {} of the {} stack", file(sc),
                           sc, layer, expert, tile_row, tile_col, w13 ? "gate_up" : "down");
    const std::int64_t gate_tiles = (c.moe_intermediate_size + 7) / 8;
    Proj p = Proj::down;
    if (w13) p = tile_row < gate_tiles ? Proj::gate : Proj::up;
    if (p == Proj::up) tile_row -= gate_tiles;
    const std::string sc = lutb_names(expert_weight_name(c, layer, expert, p)).scale;
    return fmt::format("{}: tensor {} (layer {}, expert {}), tile [{}, {}]", file(sc), sc, layer, expert, tile_row,
                       tile_col);
  }

 private:
  Checkpoint ck_;
};

}  // namespace

std::unique_ptr<ExpertSource> ExpertSource::open(const std::filesystem::path& dir, const TransformerConfig&) {
  return std::make_unique<CheckpointExperts>(dir);
}

void baseline_qdq(Quant q, std::vector<std::uint16_t>& w, std::int64_t rows, std::int64_t cols, const std::string& name,
                  FitStats* stats, std::size_t* bytes) {
  const baselines::Format f = q == Quant::Int3G128 ? baselines::Format::kInt3G128 : baselines::Format::kMxfp4;
  if (q != Quant::Int3G128 && q != Quant::Mxfp4)
    throw ModelError(fmt::format("{}: {} is not a baseline format", name, quant_name(q)));
  const std::size_t n = static_cast<std::size_t>(rows * cols);
  if (w.size() != n) throw ModelError(fmt::format("{}: {} weights, expected {} x {}", name, w.size(), rows, cols));
  std::vector<float> src(n), dq(n);
  for (std::size_t i = 0; i < n; ++i) src[i] = bf16_to_float(w[i]);
  try {
    baselines::qdq(f, src.data(), rows, cols, dq.data());
  } catch (const std::exception& e) {
    throw ModelError(fmt::format("{}: {}", name, e.what()));
  }
  // The expert kernel takes BF16 weights: the dequantised values are rounded to BF16, and the
  // error is measured on the values actually used.
  FitStats s;
  for (std::size_t i = 0; i < n; ++i) {
    w[i] = bf16_from_float(dq[i]);
    const double d = static_cast<double>(bf16_to_float(w[i])) - src[i];
    s.sse += d * d;
    s.sum_sq += static_cast<double>(src[i]) * src[i];
  }
  *stats = s;
  *bytes = static_cast<std::size_t>(static_cast<double>(n) * baselines::bits_per_weight(f) / 8.0 + 0.5);
}

}  // namespace lutb::model
