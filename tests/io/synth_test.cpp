// lutb synth's configurations: every override gives a config.json that lutb reads and runs.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/moe.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::CliOut;
using test::error_of;
using test::has;
using test::q;
using test::read_json;
using test::run;
using test::small_synth_layers;
using test::TempDir;
using test::write_activations;
using test::write_activations_of_layers;

// `lutb synth --family mixtral --hidden-size 100` writes a checkpoint lutb moe runs (head_dim even, not 100 //
// 32 = 3).
TEST(SynthConfig, HiddenSizeNotAMultipleOf64RunsInMoe) {
  test::TempDir t;
  const fs::path in = t.path / "in";
  ASSERT_EQ(run("synth --family mixtral --layers 1 --hidden-size 100 --moe-intermediate-size 56 --experts 2 "
                "--no-progress -o " + q(in))
                .code,
            0);
  write_activations_of_layers(t.path / "acts.safetensors", 100, 1);
  const CliOut r = run("moe " + q(in) + " --layer 0 --quant lutb --activations " + q(t.path / "acts.safetensors"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, "layer 0 of " + in.string() + " (mixtral), 4 tokens, quant lutb, activations mxfp8")) << r.out;
}

// Sizes of lutb synth are printed in readable units: a small checkpoint in bytes or MB, never "0.00 GB".
TEST(SynthConfig, SizesInReadableUnits) {
  test::TempDir t;
  const CliOut r = run("synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 4 "
                       "--no-progress -o " + q(t.path / "s"));
  ASSERT_EQ(r.code, 0) << r.out;
  // 4 experts x 3 x 64 x 128 BF16 = 196608 bytes of experts, plus the router 4 x 128 BF16 = 1024.
  EXPECT_TRUE(has(r, "lutb synth: will write 197632 bytes (197.6 kB) of BF16 tensors to ")) << r.out;
  EXPECT_TRUE(has(r, "lutb synth: qwen3_moe (1 layer, E 4, H 128, I 64, k 4) -> ")) << r.out;
  EXPECT_TRUE(has(r, ": 197.6 kB in ")) << r.out;
  EXPECT_FALSE(has(r, "GB")) << r.out;
  const CliOut two = run("synth --family qwen3_moe --layers 2 --hidden-size 1024 --moe-intermediate-size 512 "
                         "--experts 4 --no-progress -o " + q(t.path / "s2"));
  ASSERT_EQ(two.code, 0) << two.out;
  // 2 x (4 x 3 x 512 x 1024 + 4 x 1024) x 2 bytes = 25182208 bytes.
  EXPECT_TRUE(has(two, "will write 25182208 bytes (25.18 MB)")) << two.out;
  EXPECT_TRUE(has(two, "(2 layers, E 4, H 1024, I 512, k 4)")) << two.out;
}

// synth's DeepSeek-V3 config holds the attention keys lutb moe parses and routable expert groups; --experts 1
// is refused, since grouped routing ranks a group by the sum of its 2 best experts.
TEST(SynthConfig, MoeRunsOnSynthDeepSeekV3) {
  test::TempDir t;
  const CliOut s = run("synth --family deepseek_v3 --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 8 "
                       "--no-progress -o " + q(t.path / "ds"));
  ASSERT_EQ(s.code, 0) << s.out;
  const ModelConfig c = load_model_config(t.path / "ds");
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  write_activations(t.path / "acts.safetensors", 0, 8, 128);
  const std::string acts = " --layer 0 --threads 1 --json --activations " + q(t.path / "acts.safetensors");
  for (const char* quant : {"none", "lutb"}) {
    const CliOut r = run("moe " + q(t.path / "ds") + acts + " --quant " + quant);
    ASSERT_EQ(r.code, 0) << quant << "\n" << r.out;
    const auto end = r.out.find_last_not_of('\n');
    const auto j = nlohmann::json::parse(r.out.substr(r.out.rfind('\n', end) + 1));
    EXPECT_EQ(j["tokens"], 8);
    EXPECT_EQ(j["quant"], quant);
    EXPECT_TRUE(j["rel_l2"].is_number());
  }
  const CliOut one = run("synth --family deepseek_v3 --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 1 "
                         "--no-progress -o " + q(t.path / "one"));
  EXPECT_EQ(one.code, 1) << one.out;
  EXPECT_TRUE(has(one, "--experts 1: deepseek_v3 ranks expert groups by the sum of their 2 best experts")) << one.out;
  EXPECT_FALSE(fs::exists(t.path / "one"));
}

// `lutb synth --hidden-size H` writes a config.json lutb reads: for the families that derive head_dim as
// hidden_size // num_attention_heads (Mixtral, Qwen2-MoE, OLMoE), the heads are reduced until head_dim is
// even; sizes that already give an even head_dim keep the family's heads.
TEST(SynthConfig, HiddenSizeOverrideWritesAConfigLutbReads) {
  TempDir t;
  struct Case {
    ModelFamily family;
    std::int64_t hidden;
    int heads, kv_heads, head_dim;  // expected
  } cases[] = {
      {ModelFamily::mixtral, 100, 25, 1, 4},      // 100 // 32 = 3 before
      {ModelFamily::mixtral, 128, 32, 8, 4},      // even already: the family's heads
      {ModelFamily::qwen2_moe, 48, 12, 4, 4},     // 48 // 16 = 3 before
      {ModelFamily::olmoe, 100, 16, 16, 6},       // 100 // 16 = 6: kept
      {ModelFamily::olmoe, 1, 1, 1, 2},           // no head count works: one head of explicit head_dim 2
      {ModelFamily::mixtral, 3, 1, 1, 2},
  };
  int i = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(family_name(c.family)) + " hidden " + std::to_string(c.hidden));
    SynthOptions o;
    o.family = c.family;
    o.layers = 1;
    o.hidden_size = c.hidden;
    o.moe_intermediate_size = 8;
    o.num_experts = 2;
    o.progress = false;
    const fs::path dir = t.path / std::to_string(i++);  // (GCC 12 -Wrestrict false positive on "s" + to_string)
    synthesize_checkpoint(dir, o);
    model::TransformerConfig cfg;
    const std::string err = error_of([&] { cfg = model::TransformerConfig::load(dir); });
    ASSERT_EQ(err, "no exception");
    EXPECT_EQ(cfg.hidden_size, c.hidden);
    EXPECT_EQ(cfg.num_heads, c.heads);
    EXPECT_EQ(cfg.num_kv_heads, c.kv_heads);
    EXPECT_EQ(cfg.head_dim, c.head_dim);
  }
  // Qwen3 (explicit head_dim 128) and DeepSeek (MLA widths) do not derive head_dim from hidden_size.
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = 1;
  o.hidden_size = 100;
  o.moe_intermediate_size = 8;
  o.num_experts = 2;
  o.progress = false;
  synthesize_checkpoint(t.path / "q3", o);
  const nlohmann::json j = read_json(t.path / "q3" / "config.json");
  EXPECT_EQ(j.at("num_attention_heads"), 32);
  EXPECT_EQ(j.at("head_dim"), 128);
}

// synth --experts E gives DeepSeek-V3 a routable n_group / topk_group for every E: groups of one expert, of
// which 4 are kept for top-8, cannot be satisfied (sigmoid scoring ranks a group by its 2 best experts).
TEST(SynthConfig, DeepSeekRoutingGroupsAreConsistent) {
  SynthOptions o = small_synth_layers(1);
  o.family = ModelFamily::deepseek_v3;
  struct Case {
    std::int64_t e, n_group, topk_group, k;
  } cases[] = {{256, 8, 4, 8}, {64, 8, 4, 8}, {16, 8, 4, 8}, {8, 4, 4, 8}, {12, 6, 4, 8},
               {6, 3, 3, 6},   {5, 1, 1, 5},  {4, 2, 2, 4},  {2, 1, 1, 2}};
  for (const Case& c : cases) {
    o.num_experts = c.e;
    const ModelConfig m = synth_config(o);
    EXPECT_EQ(m.n_group, c.n_group) << "E " << c.e;
    EXPECT_EQ(m.topk_group, c.topk_group) << "E " << c.e;
    EXPECT_EQ(m.num_experts_per_tok, c.k) << "E " << c.e;
    moe::RouterConfig rc;
    rc.scoring = moe::ScoringFunc::Sigmoid;
    rc.num_experts = static_cast<int>(m.num_experts);
    rc.top_k = static_cast<int>(m.num_experts_per_tok);
    rc.n_group = static_cast<int>(m.n_group);
    rc.topk_group = static_cast<int>(m.topk_group);
    EXPECT_NO_THROW(rc.validate()) << "E " << c.e;
  }
  o.num_experts = 1;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { synth_config(o); }),
            "synth: --experts 1: deepseek_v3 ranks expert groups by the sum of their 2 best experts (sigmoid scoring), "
            "so it needs at least 2 routed experts");
  // The attention keys lutb moe / eval parse are present (lutb moe refused the synth config).
  o.num_experts = 8;
  const ModelConfig m = synth_config(o);
  for (const char* k : {"qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"})
    EXPECT_TRUE(m.raw.contains(k)) << k;
}

}  // namespace
}  // namespace lutb
