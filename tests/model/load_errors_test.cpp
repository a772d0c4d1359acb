// Errors of the model loader and forward pass that name the stored tensor: non-float dtypes, sizes
// beyond the stored shapes, non-finite weights and scales.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::edit_header;
using test::error_of;
using test::poke_bf16;
using test::TempDir;

// Sets the dtype of tensor `name` in the header of `file` (same element size), keeping the header length.
void set_dtype(const fs::path& file, const std::string& name, const std::string& dtype) {
  edit_header(file, [&](nlohmann::json& j) { j[name]["dtype"] = dtype; });
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
  return error_of([&] {
    model::CheckpointMoe moe(dir, o);
    moe.build(0);
  });
}

SynthOptions small(bool stacked) {
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = 1;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 4;
  o.stacked = stacked;
  o.progress = false;
  return o;
}

std::string model_error_of_build(const fs::path& dir, model::Quant q) {
  model::MoeOptions o;
  o.quant = q;
  return error_of<model::ModelError>([&] {
    model::CheckpointMoe moe(dir, o);
    moe.build(0);
  });
}

TEST(ModelLoadErrors, NonFloatTensorErrorNamesTheFileOnce) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const fs::path m = t.path / "m";
  fs::create_directories(m);
  for (const char* f : {"config.json", "model.safetensors", "val_tokens.safetensors"}) {
    fs::copy_file(dir / f, m / f);
    fs::permissions(m / f, fs::perms::owner_read | fs::perms::owner_write);
  }
  set_dtype(m / "model.safetensors", "model.layers.0.input_layernorm.weight", "I16");
  const test::CliResult r = test::run_cli("eval " + test::q(m) + " --max-windows 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("lutb: error: " + (m / "model.safetensors").string() +
                       ": tensor 'model.layers.0.input_layernorm.weight': dtype I16 cannot be read as floating point"),
            std::string::npos)
      << r.err;
}

// moe_intermediate_size 2e9 (a corrupt config.json) on a checkpoint of width 64 is refused naming the stored
// tensor: the stored shapes are checked before the expert stacks are allocated at config.json's size.
TEST(ModelLoadErrors, HugeExpertWidthNamesTheTensorBeforeAllocating) {
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
      // The shard that holds the tensor and where the expected shape comes from (the folder).
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

TEST(ModelLoadErrors, OnTheFlyQuantisationNamesTheStoredTensor) {
  TempDir t;
  synthesize_checkpoint(t.path / "pe", small(false));
  const fs::path file = t.path / "pe" / "model.safetensors";
  // Per-expert: expert 1's up_proj [64, 128], row 5 col 7 (row 69 of the fused [2I, H] stack).
  poke_bf16(file, "model.layers.0.mlp.experts.1.up_proj.weight", 5 * 128 + 7, 0x7fc0);
  EXPECT_EQ(model_error_of_build(t.path / "pe", model::Quant::Lutb),
            file.string() +
                ": tensor model.layers.0.mlp.experts.1.up_proj.weight (layer 0, expert 1), row 5 col 7: NaN; a "
                "non-finite weight cannot be quantised to LUT-B (spec 2.1)");
  EXPECT_EQ(model_error_of_build(t.path / "pe", model::Quant::Int3G128),
            file.string() +
                ": tensor model.layers.0.mlp.experts.1.up_proj.weight (layer 0, expert 1), row 5 col 7: NaN; a "
                "non-finite weight cannot be quantised to int3-g128");
  EXPECT_EQ(model_error_of_build(t.path / "pe", model::Quant::None), "no exception");  // the BF16 reference runs as stored

  // Stacked: expert 2's gate_up_proj rows, -Inf in the up half; and a magnitude too large for LUT-B
  // in down_proj.
  synthesize_checkpoint(t.path / "st", small(true));
  const fs::path sf = t.path / "st" / "model.safetensors";
  poke_bf16(sf, "model.layers.0.mlp.experts.down_proj", 3 * 128 * 64 + 100 * 64 + 9, 0x7f7f);  // 3.39e38
  EXPECT_EQ(model_error_of_build(t.path / "st", model::Quant::Lutb),
            sf.string() +
                ": tensor model.layers.0.mlp.experts.down_proj (layer 0, expert 3), row 100 col 9: magnitude "
                "3.3895314e+38 needs a scale byte above 246 (spec section 2); it cannot be quantised to LUT-B");
  poke_bf16(sf, "model.layers.0.mlp.experts.gate_up_proj", 2 * 128 * 128 + 70 * 128 + 3, 0xff80);
  EXPECT_EQ(model_error_of_build(t.path / "st", model::Quant::Mxfp4),
            sf.string() +
                ": tensor model.layers.0.mlp.experts.gate_up_proj (layer 0, expert 2), row 70 col 3: -Inf; a "
                "non-finite weight cannot be quantised to mxfp4");
}

// `lutb eval` on a LUT-B checkpoint whose stored scale bytes make the weights overflow FP32: the loader names
// the tensor and the tile, rather than a "non-finite loss" naming no tensor.
TEST(ModelLoadErrors, EvalOnOverflowingStoredScalesNamesTheTensor) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const fs::path q = t.path / "q";
  test::CliResult r = test::run_cli("quantize " + test::q(dir) + " -o " + test::q(q) + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string s = "model.layers.0.block_sparse_moe.experts.5.w2.weight_scale";
  poke_bf16(q / "model.safetensors", s, 0, 0xFEFE);  // tiles [0, 0] and [0, 1]: scale byte 254
  r = test::run_cli("eval " + test::q(q) + " --max-windows 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find((q / "model.safetensors").string() + ": tensor " + s +
                       " (layer 0, expert 5): tile [0, 0] (tile row 0, tile column 0) has scale byte 254"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("val loss"), std::string::npos) << r.out;
}

// A BF16 checkpoint with NaN weights: `lutb eval` names the stored tensor (the quantisation statistics that
// would name one exist only for --quant lutb / int3-g128 / mxfp4).
TEST(ModelLoadErrors, NonFiniteLossNamesTheStoredTensor) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const fs::path m = t.path / "m";
  fs::create_directories(m);
  for (const char* f : {"config.json", "model.safetensors", "val_tokens.safetensors"}) {
    fs::copy_file(dir / f, m / f);
    fs::permissions(m / f, fs::perms::owner_read | fs::perms::owner_write);
  }
  for (int e = 0; e < 8; ++e)
    poke_bf16(m / "model.safetensors", "model.layers.1.block_sparse_moe.experts." + std::to_string(e) + ".w2.weight", 0,
              0x7fc0);
  const test::CliResult r = test::run_cli("eval " + test::q(m) + " --max-windows 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(m.string() + ": non-finite loss (nan) over 255 predicted tokens: a weight, scale or activation "
                                    "overflowed or is NaN; " +
                       (m / "model.safetensors").string() +
                       " holds NaN in tensor model.layers.1.block_sparse_moe.experts.0.w2.weight at [0, 0]; the "
                       "checkpoint's tensors are likely corrupt"),
            std::string::npos)
      << r.err;
  // `lutb moe` on that layer: the error named the layer only ("layer 1: 512 of 98304 outputs are NaN
  // or infinite"), not the checkpoint or the inputs.
  const fs::path acts = dir / "moe_activations.safetensors";
  const test::CliResult m2 = test::run_cli("moe " + test::q(m) + " --layer 1 --activations " + test::q(acts));
  EXPECT_EQ(m2.status, 1);
  // Refused before any result: no "rel_l2 nan ..." line, and with --json no JSON line with
  // "rel_l2": null, for --quant none (the BF16 experts as stored) as for LUT-B.
  EXPECT_EQ(m2.out.find("rel_l2"), std::string::npos) << m2.out;
  for (const char* quant : {"none", "lutb"}) {
    const test::CliResult j = test::run_cli("moe " + test::q(m) + " --layer 1 --json --quant " + quant +
                                            " --activations " + test::q(acts));
    EXPECT_EQ(j.status, 1) << quant;
    EXPECT_EQ(j.out, "") << quant;
    EXPECT_NE(j.err.find(std::string(quant) == "none" ? " outputs are NaN or infinite" : "NaN"), std::string::npos)
        << quant << ": " << j.err;
  }
  EXPECT_NE(m2.err.find("lutb: error: " + m.string() + ": layer 1: "), std::string::npos) << m2.err;
  EXPECT_NE(m2.err.find(" outputs are NaN or infinite (on the inputs of " + acts.string() +
                        "): a weight, scale or input of the layer is NaN or overflowed"),
            std::string::npos)
      << m2.err;
}

}  // namespace
}  // namespace lutb
