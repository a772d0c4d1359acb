// The MoE layers of the shared tiny models against transformers: for every model in
// ../shared/models and every sparse MoE layer, the router + BF16 reference experts (+ DeepSeek's
// shared expert) on the captured `layers.L.moe_input` must reproduce `layers.L.moe_output`
// (relative L2 <= 1e-2). The LUT-B emulation (online method, default fitter) is run on the same
// inputs and its error against the same outputs is printed.
//
// A small local loader (spec section 7 names); model loading proper belongs to src/model.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "lutb/moe.hpp"
#include "lutb/safetensors.hpp"
#include "moe/moe_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb::moe {
namespace {

using test::rel_l2;

struct Family {
  std::string block;            // "mlp" or "block_sparse_moe"
  std::string gate, up, down;   // projection names
  bool deepseek = false;
};

Family family_of(const std::string& model_type) {
  if (model_type == "mixtral") return {"block_sparse_moe", "w1", "w3", "w2", false};
  if (model_type == "deepseek_v3") return {"mlp", "gate_proj", "up_proj", "down_proj", true};
  return {"mlp", "gate_proj", "up_proj", "down_proj", false};  // qwen3_moe, qwen2_moe, olmoe
}

std::vector<std::uint16_t> bf16_of(const SafetensorsFile& f, const std::string& name, std::int64_t numel) {
  const TensorView& t = f.get(name);
  EXPECT_EQ(t.numel(), numel) << name;
  const auto s = t.as<std::uint16_t>(DType::BF16);
  return {s.begin(), s.end()};
}

// Copies `src` (numel values) into dst.
void put(std::uint16_t* dst, const std::vector<std::uint16_t>& src) { std::copy(src.begin(), src.end(), dst); }

void run_model(const std::string& name) {
  LUTB_MODEL_OR_SKIP(dir, name);
  nlohmann::json cfgj;
  std::ifstream(dir / "config.json") >> cfgj;
  const std::string type = cfgj["model_type"];
  const Family fam = family_of(type);
  const int E = cfgj.contains("n_routed_experts") ? cfgj["n_routed_experts"].get<int>()
                : cfgj.contains("num_local_experts") ? cfgj["num_local_experts"].get<int>()
                                                     : cfgj["num_experts"].get<int>();
  const int k = cfgj["num_experts_per_tok"];
  const std::int64_t H = cfgj["hidden_size"];
  const std::int64_t I = type == "mixtral" ? cfgj["intermediate_size"].get<std::int64_t>()
                                           : cfgj["moe_intermediate_size"].get<std::int64_t>();
  const int layers = cfgj["num_hidden_layers"];
  const int first_dense = cfgj.value("first_k_dense_replace", 0);
  std::vector<int> mlp_only = cfgj.value("mlp_only_layers", std::vector<int>{});
  const int sparse_step = cfgj.value("decoder_sparse_step", 1);

  SafetensorsFile model(dir / "model.safetensors");
  SafetensorsFile acts(dir / "moe_activations.safetensors");
  int checked = 0;
  for (int L = 0; L < layers; ++L) {
    const bool sparse = L >= first_dense && std::find(mlp_only.begin(), mlp_only.end(), L) == mlp_only.end() &&
                        (L + 1) % sparse_step == 0;
    const std::string pre = "model.layers." + std::to_string(L) + "." + fam.block + ".";
    ASSERT_EQ(sparse, model.contains(pre + "gate.weight")) << name << " layer " << L << ": config and tensors disagree";
    if (!sparse) continue;
    const std::string in_name = "layers." + std::to_string(L) + ".moe_input";
    ASSERT_TRUE(acts.contains(in_name)) << in_name;
    const TensorView& xin = acts.get(in_name);
    const std::int64_t T = xin.shape[0];
    const auto xs = xin.as<std::uint16_t>(DType::BF16);
    const std::vector<std::uint16_t> x(xs.begin(), xs.end());
    const auto want_bits = bf16_of(acts, "layers." + std::to_string(L) + ".moe_output", T * H);
    const std::vector<float> want = test::bf16_to_f32(want_bits);

    // Router.
    RouterConfig rc;
    rc.num_experts = E;
    rc.top_k = k;
    rc.norm_topk_prob = type == "mixtral" ? true : cfgj.value("norm_topk_prob", false);
    std::vector<float> bias;
    if (fam.deepseek) {
      rc.scoring = ScoringFunc::Sigmoid;
      rc.n_group = cfgj["n_group"];
      rc.topk_group = cfgj["topk_group"];
      rc.routed_scaling_factor = cfgj["routed_scaling_factor"].get<float>();
      bias = model.get(pre + "gate.e_score_correction_bias").to_float();
    }
    const auto gate = bf16_of(model, pre + "gate.weight", E * H);
    std::vector<float> logits(T * E);
    // transformers: nn.Linear in BF16 for Mixtral/Qwen (BF16 logits); DeepSeek-V3 casts to FP32.
    router_logits_bf16(x.data(), gate.data(), T, H, E, /*round_to_bf16=*/!fam.deepseek, logits.data());
    const Routing r = route(rc, logits, T, fam.deepseek ? bias.data() : nullptr);
    const TopK topk{r.ids.data(), r.weights.data(), k};

    // Routed experts, w13 = [gate; up], w2 = down.
    MoeConfig mc;
    mc.global_experts = E;
    mc.top_k = k;
    mc.hidden_size = H;
    mc.intermediate_size_per_partition = I;
    mc.finalize();
    RoutedExpertsLayer layer(mc);
    for (int e = 0; e < E; ++e) {
      const std::string ep = pre + "experts." + std::to_string(e) + ".";
      put(layer.w13_expert(e), bf16_of(model, ep + fam.gate + ".weight", I * H));
      put(layer.w13_expert(e) + I * H, bf16_of(model, ep + fam.up + ".weight", I * H));
      put(layer.w2_expert(e), bf16_of(model, ep + fam.down + ".weight", H * I));
    }
    const DenseExperts bf16ref(mc, layer.w13_weight, layer.w2_weight);

    // DeepSeek's shared expert: a dense SiLU MLP = one expert with weight 1 for every token.
    std::unique_ptr<DenseExperts> shared;
    if (fam.deepseek) {
      const std::int64_t Is = I * cfgj.value("n_shared_experts", 1);
      MoeConfig sc;
      sc.global_experts = 1;
      sc.top_k = 1;
      sc.hidden_size = H;
      sc.intermediate_size_per_partition = Is;
      std::vector<std::uint16_t> w13(2 * Is * H);
      put(w13.data(), bf16_of(model, pre + "shared_experts.gate_proj.weight", Is * H));
      put(w13.data() + Is * H, bf16_of(model, pre + "shared_experts.up_proj.weight", Is * H));
      shared = std::make_unique<DenseExperts>(sc, std::move(w13), bf16_of(model, pre + "shared_experts.down_proj.weight", H * Is));
    }
    auto layer_output = [&](const Experts& routed) {
      std::vector<float> out(T * H);
      routed.apply_f32(HiddenStates::bf16(x.data(), T), topk, out.data());
      if (shared) {
        std::vector<std::int32_t> zero(T, 0);
        std::vector<float> one(T, 1.0f), s(T * H);
        shared->apply_f32(HiddenStates::bf16(x.data(), T), {zero.data(), one.data(), 1}, s.data());
        for (std::int64_t i = 0; i < T * H; ++i) out[i] = bf16_round(bf16_round(out[i]) + bf16_round(s[i]));
      } else {
        for (auto& v : out) v = bf16_round(v);
      }
      return out;
    };

    const double err_bf16 = rel_l2(layer_output(bf16ref), want);
    EXPECT_LE(err_bf16, 1e-2) << name << " layer " << L;

    // LUT-B emulation through the online method (default fitter, MXFP8 activations).
    LutBOnlineMoEMethod method(mc);
    const QuantizeReport rep = method.process_weights_after_loading(layer);
    const double err_lutb = rel_l2(layer_output(method.kernel()), want);
    std::printf("[transformers] %-18s layer %d: BF16 reference rel L2 = %.2e | LUT-B emulation (%s, SQNR w13 %.1f dB, "
                "w2 %.1f dB) rel L2 = %.3f\n",
                name.c_str(), L, err_bf16, method.kernel().name().c_str(), rep.w13.sqnr_db(), rep.w2.sqnr_db(), err_lutb);
    EXPECT_TRUE(std::isfinite(err_lutb));
    // 3-bit weights cost accuracy, but the layer must still compute the same function roughly
    // (a wrong layout or routing gives an error near or above 1).
    EXPECT_LT(err_lutb, 0.35) << name << " layer " << L;
    ++checked;
  }
  EXPECT_GT(checked, 0) << name << ": no MoE layer found";
}

TEST(Transformers, TinyQwen3Moe) { run_model("tiny-qwen3-moe"); }
TEST(Transformers, TinyMixtral) { run_model("tiny-mixtral"); }
TEST(Transformers, TinyDeepseekV3) { run_model("tiny-deepseek-v3"); }

}  // namespace
}  // namespace lutb::moe
