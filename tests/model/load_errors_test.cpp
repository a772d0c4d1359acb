// Errors of the model loader and forward pass that name the stored tensor: non-float dtypes, sizes
// beyond the stored shapes, non-finite weights and scales.
#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <filesystem>
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
using test::copy_model;
using test::edit_config;
using test::edit_header;
using test::error_of;
using test::poke_bf16;
using test::small_synth;
using test::TempDir;

// The message of building layer 0's MoE block of checkpoint `dir` with quantisation `q` (one fit
// thread), when it throws an `Ex`; "no exception" when it builds.
template <class Ex = std::exception>
std::string build_error(const fs::path& dir, model::Quant q) {
  model::MoeOptions o;
  o.quant = q;
  o.fit.threads = 1;
  return error_of<Ex>([&] {
    model::CheckpointMoe moe(dir, o);
    moe.build(0);
  });
}

TEST(ModelLoadErrors, NonFloatTensorErrorNamesTheFileOnce) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const fs::path m = copy_model(dir, t.path / "m");
  edit_header(m / "model.safetensors",
              [](nlohmann::json& j) { j["model.layers.0.input_layernorm.weight"]["dtype"] = "I16"; });
  const test::CliResult r = test::run_cli("eval " + test::q(m) + " --max-windows 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("lutb: error: " + (m / "model.safetensors").string() +
                       ": tensor 'model.layers.0.input_layernorm.weight': dtype I16 cannot be read as floating point"),
            std::string::npos)
      << r.err;
}

// moe_intermediate_size 2e9 (a corrupt config.json) on a checkpoint of width 64 is refused naming the stored
// tensor: the stored shapes are checked before the expert stacks are allocated at config.json's size. The
// shard that holds the tensor is named, and where the expected shape comes from (the folder's config.json).
TEST(ModelLoadErrors, HugeExpertWidthNamesTheTensorBeforeAllocating) {
  const struct {
    bool stacked;
    const char* bf16_shapes;  // the BF16 checkpoint's first expert tensor, its shape and the expected one
    model::Quant other_quant;  // a quantisation on the fly, besides LUT-B or none
    const char* lutb_error;   // the LUT-B checkpoint's, after "FILE: "
  } cases[] = {
      {true, "tensor model.layers.0.mlp.experts.gate_up_proj has shape [4, 128, 128], expected [4, 4000000000, 128]",
       model::Quant::Lutb,
       "tensor model.layers.0.mlp.experts.gate_up_proj_packed (layer 0) has shape [4, 16, 2, 192], expected [4, "
       "500000000, 2, 192] for logical shape [4, 4000000000, 128] (spec 2.2)"},
      {false, "tensor model.layers.0.mlp.experts.0.gate_proj.weight has shape [64, 128], expected [2000000000, 128]",
       model::Quant::Int3G128,
       "tensor model.layers.0.mlp.experts.0.gate_proj.weight_packed (layer 0, expert 0) has shape [8, 2, 192], "
       "expected [250000000, 2, 192] for logical shape [2000000000, 128] (spec 2.2)"},
  };
  TempDir t;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.stacked ? "stacked" : "per expert");
    const fs::path bf = t.path / (c.stacked ? "bf_st" : "bf_pe"), lb = t.path / (c.stacked ? "lb_st" : "lb_pe");
    synthesize_checkpoint(bf, small_synth(64, c.stacked));
    quantize_checkpoint(bf, lb, test::quiet_one_thread());
    const auto huge = [](nlohmann::json& j) { j["moe_intermediate_size"] = 2000000000; };
    edit_config(bf, huge);
    edit_config(lb, huge);
    const std::string want = (bf / "model.safetensors").string() + ": " + c.bf16_shapes + " from " +
                             (bf / "config.json").string() + " (hidden_size 128, expert width 2000000000, 4 experts)";
    EXPECT_EQ(build_error(bf, model::Quant::None), want);
    EXPECT_EQ(build_error(bf, c.other_quant), want);
    EXPECT_EQ(build_error(lb, model::Quant::Lutb), (lb / "model.safetensors").string() + ": " + c.lutb_error);
  }
}

// A weight that cannot be quantised on the fly (non-finite, or too large for LUT-B's scale) is named with its
// stored tensor, layer, expert, row and column; the BF16 reference (no quantisation) runs as stored.
TEST(ModelLoadErrors, OnTheFlyQuantisationNamesTheStoredTensor) {
  const struct {
    bool stacked;
    const char* tensor;
    std::int64_t index;  // the element poked
    std::uint16_t bf16;  // its new bits
    model::Quant quant;
    const char* error;  // after "FILE: "; "no exception" when the block builds
  } cases[] = {
      // Per-expert: expert 1's up_proj [64, 128], row 5 col 7 (row 69 of the fused [2I, H] stack).
      {false, "model.layers.0.mlp.experts.1.up_proj.weight", 5 * 128 + 7, 0x7fc0, model::Quant::Lutb,
       "tensor model.layers.0.mlp.experts.1.up_proj.weight (layer 0, expert 1), row 5 col 7: NaN; a non-finite weight "
       "cannot be quantised to LUT-B (spec 2.1)"},
      {false, "model.layers.0.mlp.experts.1.up_proj.weight", 5 * 128 + 7, 0x7fc0, model::Quant::Int3G128,
       "tensor model.layers.0.mlp.experts.1.up_proj.weight (layer 0, expert 1), row 5 col 7: NaN; a non-finite weight "
       "cannot be quantised to int3-g128"},
      {false, "model.layers.0.mlp.experts.1.up_proj.weight", 5 * 128 + 7, 0x7fc0, model::Quant::None, "no exception"},
      // Stacked: a magnitude too large for LUT-B in expert 3's down_proj (3.39e38); -Inf in the up half of
      // expert 2's gate_up_proj rows.
      {true, "model.layers.0.mlp.experts.down_proj", 3 * 128 * 64 + 100 * 64 + 9, 0x7f7f, model::Quant::Lutb,
       "tensor model.layers.0.mlp.experts.down_proj (layer 0, expert 3), row 100 col 9: magnitude 3.3895314e+38 needs "
       "a scale byte above 246 (spec section 2); it cannot be quantised to LUT-B"},
      {true, "model.layers.0.mlp.experts.gate_up_proj", 2 * 128 * 128 + 70 * 128 + 3, 0xff80, model::Quant::Mxfp4,
       "tensor model.layers.0.mlp.experts.gate_up_proj (layer 0, expert 2), row 70 col 3: -Inf; a non-finite weight "
       "cannot be quantised to mxfp4"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.error);
    TempDir t;
    synthesize_checkpoint(t.path / "m", small_synth(64, c.stacked));
    const fs::path file = t.path / "m" / "model.safetensors";
    poke_bf16(file, c.tensor, c.index, c.bf16);
    const std::string want = c.error == std::string("no exception") ? c.error : file.string() + ": " + c.error;
    EXPECT_EQ(build_error<model::ModelError>(t.path / "m", c.quant), want);
  }
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
  const fs::path m = copy_model(dir, t.path / "m");
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
