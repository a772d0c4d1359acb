// ExpertSource over the safetensors of a checkpoint directory (per-expert tensors, spec 7).
#include <fmt/core.h>
#include <fmt/ranges.h>

#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "model/expert_source.hpp"

namespace lutb::model {
namespace {

class SafetensorsExperts final : public ExpertSource {
 public:
  SafetensorsExperts(const std::filesystem::path& dir, const TransformerConfig& cfg)
      : dir_(dir.string()), cfg_(cfg), st_(SafetensorsCollection::open_dir(dir)) {}

  bool lutb() const override { return false; }

  std::string mlp(int layer) const {
    return fmt::format("model.layers.{}.{}", layer, cfg_.family == "mixtral" ? "block_sparse_moe" : "mlp");
  }
  std::string expert_prefix(int layer) const override { return mlp(layer) + ".experts"; }

  const TensorView& get(const std::string& name, std::vector<std::int64_t> shape) const {
    if (!st_.contains(name)) throw ModelError(fmt::format("{}: missing tensor {}", dir_, name));
    const TensorView& t = st_.get(name);
    if (t.shape != shape)
      throw ModelError(fmt::format("{}: tensor {} has shape [{}], expected [{}]", dir_, name, fmt::join(t.shape, ", "),
                                   fmt::join(shape, ", ")));
    return t;
  }

  RouterWeights router(int layer) const override {
    RouterWeights r;
    const std::int64_t E = cfg_.num_experts, H = cfg_.hidden_size;
    r.gate = get(mlp(layer) + ".gate.weight", {E, H}).to_float();
    const std::string b = mlp(layer) + ".gate.e_score_correction_bias";
    if (cfg_.family == "deepseek_v3") r.correction_bias = get(b, {E}).to_float();
    return r;
  }

  Linear lin(const std::string& name, std::int64_t out, std::int64_t in) const {
    Linear l;
    l.out = out;
    l.in = in;
    l.w = get(name, {out, in}).to_float();
    return l;
  }

  SharedExperts shared(int layer) const override {
    SharedExperts s;
    const std::int64_t S = cfg_.shared_expert_intermediate_size, H = cfg_.hidden_size;
    if (S <= 0) return s;
    const bool qwen2 = cfg_.family == "qwen2_moe";
    const std::string p = mlp(layer) + (qwen2 ? ".shared_expert." : ".shared_experts.");
    s.mlp.gate = lin(p + "gate_proj.weight", S, H);
    s.mlp.up = lin(p + "up_proj.weight", S, H);
    s.mlp.down = lin(p + "down_proj.weight", H, S);
    if (qwen2) s.gate = lin(mlp(layer) + ".shared_expert_gate.weight", 1, H);
    return s;
  }

  static void to_bf16(const TensorView& t, std::uint16_t* dst) {
    if (t.dtype == DType::BF16) {
      auto s = t.as<std::uint16_t>(DType::BF16);
      std::copy(s.begin(), s.end(), dst);
      return;
    }
    const std::vector<float> f = t.to_float();
    for (std::size_t i = 0; i < f.size(); ++i) dst[i] = bf16_from_float(f[i]);
  }

  std::pair<std::vector<std::uint16_t>, std::vector<std::uint16_t>> bf16_stacks(int layer) const override {
    const std::int64_t E = cfg_.num_experts, H = cfg_.hidden_size, I = cfg_.moe_intermediate_size;
    std::vector<std::uint16_t> w13(static_cast<std::size_t>(E * 2 * I * H)), w2(static_cast<std::size_t>(E * H * I));
    const bool mixtral = cfg_.family == "mixtral";
    for (std::int64_t e = 0; e < E; ++e) {
      const std::string p = fmt::format("{}.{}.", expert_prefix(layer), e);
      to_bf16(get(p + (mixtral ? "w1.weight" : "gate_proj.weight"), {I, H}), w13.data() + e * 2 * I * H);
      to_bf16(get(p + (mixtral ? "w3.weight" : "up_proj.weight"), {I, H}), w13.data() + e * 2 * I * H + I * H);
      to_bf16(get(p + (mixtral ? "w2.weight" : "down_proj.weight"), {H, I}), w2.data() + e * H * I);
    }
    return {std::move(w13), std::move(w2)};
  }

  std::pair<LutbTensor, LutbTensor> lutb_stacks(int layer) const override {
    throw ModelError(fmt::format("{}: layer {}: not a LUT-B checkpoint", dir_, layer));
  }

 private:
  std::string dir_;
  TransformerConfig cfg_;
  SafetensorsCollection st_;
};

}  // namespace

std::unique_ptr<ExpertSource> ExpertSource::open(const std::filesystem::path& dir, const TransformerConfig& cfg) {
  return std::make_unique<SafetensorsExperts>(dir, cfg);
}

void baseline_qdq(Quant q, std::vector<std::uint16_t>&, std::int64_t, std::int64_t, const std::string& name, FitStats*,
                  std::size_t*) {
  throw ModelError(fmt::format("{}: --quant {} needs lutb/baselines.hpp (not merged yet)", name, quant_name(q)));
}

}  // namespace lutb::model
