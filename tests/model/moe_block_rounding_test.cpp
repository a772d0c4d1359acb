// A checkpoint's MoE block follows spec section 4 at both ends of its routed experts: they read BF16
// tokens, and their weighted sum is rounded to BF16 (step 6) before the shared experts are added, as
// the GPU kernel (moe_forward) reads and writes BF16. A CPU block that kept both in FP32 would make
// `lutb eval --device cuda` differ from `--device cpu` by 1e-4..5e-4 of the loss; off-grid inputs
// show whether forward(x) rounds them.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "lutb/model.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

using namespace lutb;
using namespace lutb::model;

namespace {

MoeOptions options(Quant q) {
  MoeOptions o;
  o.quant = q;
  o.activations = q == Quant::Lutb ? moe::ActivationFormat::MXFP8 : moe::ActivationFormat::BF16;
  return o;
}

// The captured inputs of layer `layer` moved off the BF16 grid: each value times (1 + 2^-10), less
// than half a BF16 unit away, so bf16() of it is the captured BF16 value again.
std::vector<float> off_grid_inputs(const std::filesystem::path& dir, int layer) {
  const SafetensorsFile acts(dir / "moe_activations.safetensors");
  std::vector<float> x = acts.get("layers." + std::to_string(layer) + ".moe_input").to_float();
  for (float& v : x) v *= 1.0f + 0x1p-10f;
  return x;
}

}  // namespace

// forward(x) = bf16(experts(bf16(x), route(logits(x)))) + shared(x), bit for bit, recomputed from the
// block's own parts (model::MoeBlockParts), for BF16 and LUT-B experts, with and without shared
// experts (DeepSeek-V3 has one).
TEST(MoeBlockRounding, BlockForwardRoundsTokensAndRoutedSumToBf16) {
  for (const std::string name : {"tiny-qwen3-moe", "tiny-deepseek-v3"}) {
    LUTB_MODEL_OR_SKIP(dir, name);
    const int layer = name == "tiny-deepseek-v3" ? 1 : 0;  // DeepSeek's layer 0 is dense
    const std::vector<float> x = off_grid_inputs(dir, layer);
    for (const Quant q : {Quant::None, Quant::Lutb}) {
      SCOPED_TRACE(name + " " + quant_name(q));
      CheckpointMoe moe(dir, options(q));
      const std::unique_ptr<MoeBlock> block = moe.build(layer);
      const MoeBlockParts* p = block->parts();
      ASSERT_NE(p, nullptr);
      const std::int64_t H = moe.config().hidden_size, T = static_cast<std::int64_t>(x.size()) / H;
      const int E = p->router.num_experts, k = p->router.top_k;
      ASSERT_GT(T, 0);

      std::vector<float> got(x.size());
      block->forward(x.data(), T, got.data());

      std::vector<float> logits(static_cast<std::size_t>(T * E)), w(static_cast<std::size_t>(T * k));
      std::vector<std::int32_t> ids(static_cast<std::size_t>(T * k));
      p->router_logits(x.data(), T, logits.data());
      p->route(logits.data(), T, ids.data(), w.data());
      std::vector<float> xb(x.size()), want(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) xb[i] = bf16_round(x[i]);
      p->experts->apply_f32(moe::HiddenStates::f32(xb.data(), T), moe::TopK{ids.data(), w.data(), k}, want.data());
      std::size_t off_grid = 0;
      for (float& v : want) {
        off_grid += bf16_round(v) != v;
        v = bf16_round(v);
      }
      EXPECT_GT(off_grid, want.size() / 2) << "the FP32 sums must be off the BF16 grid for this test to mean anything";
      p->add_shared(x.data(), want.data(), T);

      std::size_t differ = 0;
      for (std::size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
      EXPECT_EQ(differ, 0u) << "of " << got.size() << " outputs";
      if (name == "tiny-qwen3-moe") {  // no shared experts: every output is a BF16 value
        std::size_t not_bf16 = 0;
        for (float v : got) not_bf16 += bf16_round(v) != v;
        EXPECT_EQ(not_bf16, 0u);
      }
    }
  }
}
