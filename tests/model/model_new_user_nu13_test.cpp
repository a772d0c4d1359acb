// Defects a fresh new user found in session 13 (helper nu13) with unusual or corrupt config.json
// values and captured activations. Each test failed on the code before its fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "model/model_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

const nlohmann::json& qwen_base() {
  static const nlohmann::json base = {{"model_type", "qwen3_moe"},
                                      {"hidden_size", 256},
                                      {"num_hidden_layers", 2},
                                      {"vocab_size", 64},
                                      {"num_attention_heads", 4},
                                      {"num_key_value_heads", 2},
                                      {"head_dim", 64},
                                      {"num_experts", 4},
                                      {"num_experts_per_tok", 2},
                                      {"moe_intermediate_size", 64},
                                      {"max_position_embeddings", 512},
                                      {"rms_norm_eps", 1e-6},
                                      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
  return base;
}

std::string config_error(const nlohmann::json& base, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = base;
  edit(j);
  try {
    model::TransformerConfig::from_json(j, "c.json");
  } catch (const model::ModelError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

// partial_rotary_factor 2 made the rotary dimension twice head_dim: the rotation wrote past each head,
// and past the end of the query / key buffer for the last head (lutb eval aborted in free() with
// "munmap_chunk(): invalid pointer"). Refused, naming the key.
TEST(NewUserNu13, PartialRotaryFactorAboveOneRefused) {
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["rope_parameters"]["partial_rotary_factor"] = 2.0; }),
            "c.json: key 'rope_parameters.partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 "
            "dimensions that is rotated), got 2");
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["partial_rotary_factor"] = 1.5; }),
            "c.json: key 'partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 dimensions that "
            "is rotated), got 1.5");
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["partial_rotary_factor"] = -0.5; }),
            "c.json: key 'partial_rotary_factor': must be in (0, 1] (the fraction of each head's 64 dimensions that "
            "is rotated), got -0.5");
  // A real partial rotation is still accepted: the first 32 of 64 dimensions.
  nlohmann::json half = qwen_base();
  half["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(model::TransformerConfig::from_json(half, "c.json").rope.dim, 32);
}

// A negative sliding window was read as "no window" without a word.
TEST(NewUserNu13, NegativeSlidingWindowRefused) {
  nlohmann::json mx = qwen_base();
  mx["model_type"] = "mixtral";
  mx.erase("moe_intermediate_size");
  mx["intermediate_size"] = 64;
  mx["num_local_experts"] = 4;
  mx.erase("num_experts");
  EXPECT_EQ(config_error(mx, [](nlohmann::json&) {}), "no exception");
  EXPECT_EQ(config_error(mx, [](nlohmann::json& j) { j["sliding_window"] = -5; }),
            "c.json: key 'sliding_window': must be a positive number of tokens (or 0 / null for none), got -5");
  EXPECT_EQ(config_error(qwen_base(),
                         [](nlohmann::json& j) {
                           j["use_sliding_window"] = true;
                           j["sliding_window"] = -1;
                         }),
            "c.json: key 'sliding_window': must be a positive number of tokens (or 0 / null for none), got -1");
}

// num_hidden_layers 2e9 on a 4-layer checkpoint: lutb eval ran for minutes and grew past 15 GB (per-layer
// state for every declared layer) and lutb moe took 45 s, before any error.
TEST(NewUserNu13, ImplausibleLayerCountRefused) {
  nlohmann::json j = qwen_base();
  j["num_hidden_layers"] = 2000000000;
  try {
    (void)parse_model_config(j, "c.json");
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "c.json: key 'num_hidden_layers': 2000000000 is more than lutb supports (65536; published models "
                 "have about a hundred): a corrupt config.json?");
  }
  j["num_hidden_layers"] = 65536;
  EXPECT_NO_THROW((void)parse_model_config(j, "c.json"));
}

// DeepSeek's first_k_dense_replace -1 made layer 0, dense in the checkpoint, a MoE layer, and the error
// read "checkpoint DIR: tensor model.layers.0.mlp.gate.weight not found", naming no key.
TEST(NewUserNu13, NegativeFirstKDenseReplaceRefused) {
  nlohmann::json j = qwen_base();
  j["model_type"] = "deepseek_v3";
  j.erase("num_experts");
  j["n_routed_experts"] = 4;
  j["first_k_dense_replace"] = -1;
  try {
    (void)parse_model_config(j, "c.json");
    ADD_FAILURE() << "no exception";
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "c.json: key 'first_k_dense_replace': must be >= 0 (the number of leading dense layers), got -1");
  }
  j["first_k_dense_replace"] = 0;
  EXPECT_TRUE(parse_model_config(j, "c.json").is_moe_layer(0));
}

// A config.json that is valid JSON but not an object ([], 1, null): lutb eval / moe said "key 'model_type':
// required but missing", lutb quantize "not a JSON object".
TEST(NewUserNu13, ConfigThatIsNotAnObjectSaysSo) {
  for (const nlohmann::json& j : {nlohmann::json::array(), nlohmann::json(1), nlohmann::json()})
    EXPECT_EQ(config_error(j, [](nlohmann::json&) {}), "c.json: not a JSON object") << j.dump();
}

// Edits config.json of checkpoint folder `dir`.
void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j;
  {
    std::ifstream in(dir / "config.json");
    j = nlohmann::json::parse(in);
  }
  edit(j);
  std::ofstream(dir / "config.json") << j.dump(1);
}

std::string build_error(const fs::path& dir, model::Quant q) {
  model::MoeOptions o;
  o.quant = q;
  o.fit.threads = 1;
  try {
    model::CheckpointMoe moe(dir, o);
    moe.build(0);
  } catch (const std::bad_alloc&) {
    return "std::bad_alloc";
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no exception";
}

// moe_intermediate_size 2e9 (a corrupt config.json) on a checkpoint of width 64: the expert stacks were
// allocated at config.json's size before any tensor was looked at, and lutb eval / moe reported "out of
// memory (an allocation failed)", naming nothing. The stored shapes are now checked first.
TEST(NewUserNu13, HugeExpertWidthNamesTheTensorBeforeAllocating) {
  TempDir t;
  for (bool stacked : {false, true}) {
    SynthOptions o;
    o.family = ModelFamily::qwen3_moe;
    o.layers = 1;
    o.hidden_size = 128;
    o.moe_intermediate_size = 64;
    o.num_experts = 4;
    o.stacked = stacked;
    o.progress = false;
    const fs::path bf = t.path / (stacked ? "bf_st" : "bf_pe"), lb = t.path / (stacked ? "lb_st" : "lb_pe");
    synthesize_checkpoint(bf, o);
    QuantizeOptions q;
    q.progress = false;
    q.fit.threads = 1;
    quantize_checkpoint(bf, lb, q);
    const auto huge = [](nlohmann::json& j) { j["moe_intermediate_size"] = 2000000000; };
    edit_config(bf, huge);
    edit_config(lb, huge);
    const std::string file = (lb / "model.safetensors").string();
    if (stacked) {
      // The shard that holds the tensor and where the expected shape comes from (nu17: the folder).
      const std::string want = (bf / "model.safetensors").string() +
                               ": tensor model.layers.0.mlp.experts.gate_up_proj has shape [4, 128, 128], expected "
                               "[4, 4000000000, 128] from " +
                               (bf / "config.json").string() + " (hidden_size 128, expert width 2000000000, 4 experts)";
      EXPECT_EQ(build_error(bf, model::Quant::None), want);
      EXPECT_EQ(build_error(bf, model::Quant::Lutb), want);
      EXPECT_EQ(build_error(lb, model::Quant::Lutb),
                file + ": tensor model.layers.0.mlp.experts.gate_up_proj_packed (layer 0) has shape [4, 16, 2, 192], "
                       "expected [4, 500000000, 2, 192] for logical shape [4, 4000000000, 128] (spec 2.2)");
    } else {
      const std::string want = (bf / "model.safetensors").string() +
                               ": tensor model.layers.0.mlp.experts.0.gate_proj.weight has shape [64, 128], expected "
                               "[2000000000, 128] from " +
                               (bf / "config.json").string() + " (hidden_size 128, expert width 2000000000, 4 experts)";
      EXPECT_EQ(build_error(bf, model::Quant::None), want);
      EXPECT_EQ(build_error(bf, model::Quant::Int3G128), want);
      EXPECT_EQ(build_error(lb, model::Quant::Lutb),
                file + ": tensor model.layers.0.mlp.experts.0.gate_proj.weight_packed (layer 0, expert 0) has shape "
                       "[8, 2, 192], expected [250000000, 2, 192] for logical shape [2000000000, 128] (spec 2.2)");
    }
  }
}

// Captured activations of no tokens ([0, H]): lutb moe printed "rel_l2 -nan ... cosine -nan" and exited
// with status 0.
TEST(NewUserNu13, MoeWithoutTokensRefused) {
  const auto src = test::model_dir("tiny-qwen3-moe");
  if (!src) GTEST_SKIP() << "model tiny-qwen3-moe absent (../shared/models): skipping";
  TempDir t;
  const fs::path acts = t.path / "acts.safetensors";
  write_safetensors(acts, {{"layers.0.moe_input", OwnedTensor{DType::BF16, {0, 256}, {}}},
                           {"layers.0.moe_output", OwnedTensor{DType::BF16, {0, 256}, {}}}});
  const test::CliResult r =
      test::run_cli("moe " + test::quote(*src) + " --layer 0 --threads 1 --activations " + test::quote(acts));
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("lutb: error: " + acts.string() +
                       ": tensor layers.0.moe_input has shape [0, 256]: it holds no tokens to run the block on"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("nan"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace lutb
