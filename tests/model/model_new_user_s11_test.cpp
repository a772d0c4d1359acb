// Defects a new user found in session 11 in the model layer (each test failed on the code before its
// fix): quantising the experts of a BF16 checkpoint on the fly (`lutb eval / moe --quant lutb`)
// reported a bad weight in the fused stack ("quantize: tensor w2_weight, expert 3, tile (0, 1): NaN
// at row 5 col 70"), naming neither the file, the layer nor the stored tensor; and a stored scale
// byte whose weights overflow FP32 gave a NaN loss naming no tensor.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "model/model_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

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

// Overwrites 2 bytes at element `index` of BF16 tensor `name` in safetensors file `file`.
void poke_bf16(const fs::path& file, const std::string& name, std::size_t index, std::uint16_t value) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t hn = 0;
  f.read(reinterpret_cast<char*>(&hn), 8);
  std::string header(hn, '\0');
  f.read(header.data(), static_cast<std::streamsize>(hn));
  const auto j = nlohmann::json::parse(header);
  f.seekp(static_cast<std::streamoff>(8 + hn + j.at(name).at("data_offsets")[0].get<std::uint64_t>() + 2 * index));
  f.write(reinterpret_cast<const char*>(&value), 2);
}

std::string build_error(const fs::path& dir, model::Quant q) {
  model::MoeOptions o;
  o.quant = q;
  try {
    model::CheckpointMoe moe(dir, o);
    moe.build(0);
  } catch (const model::ModelError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

TEST(NewUserS11, OnTheFlyQuantisationNamesTheStoredTensor) {
  TempDir t;
  synthesize_checkpoint(t.path / "pe", small(false));
  const fs::path file = t.path / "pe" / "model.safetensors";
  // Per-expert: expert 1's up_proj [64, 128], row 5 col 7 (row 69 of the fused [2I, H] stack).
  poke_bf16(file, "model.layers.0.mlp.experts.1.up_proj.weight", 5 * 128 + 7, 0x7fc0);
  EXPECT_EQ(build_error(t.path / "pe", model::Quant::Lutb),
            file.string() +
                ": tensor model.layers.0.mlp.experts.1.up_proj.weight (layer 0, expert 1), row 5 col 7: NaN; a "
                "non-finite weight cannot be quantised to LUT-B (spec 2.1)");
  EXPECT_EQ(build_error(t.path / "pe", model::Quant::Int3G128),
            file.string() +
                ": tensor model.layers.0.mlp.experts.1.up_proj.weight (layer 0, expert 1), row 5 col 7: NaN; a "
                "non-finite weight cannot be quantised to int3-g128");
  EXPECT_EQ(build_error(t.path / "pe", model::Quant::None), "no exception");  // the BF16 reference runs as stored

  // Stacked: expert 2's gate_up_proj rows, -Inf in the up half; and a magnitude too large for LUT-B
  // in down_proj.
  synthesize_checkpoint(t.path / "st", small(true));
  const fs::path sf = t.path / "st" / "model.safetensors";
  poke_bf16(sf, "model.layers.0.mlp.experts.down_proj", 3 * 128 * 64 + 100 * 64 + 9, 0x7f7f);  // 3.39e38
  EXPECT_EQ(build_error(t.path / "st", model::Quant::Lutb),
            sf.string() +
                ": tensor model.layers.0.mlp.experts.down_proj (layer 0, expert 3), row 100 col 9: magnitude "
                "3.3895314e+38 needs a scale byte above 246 (spec section 2); it cannot be quantised to LUT-B");
  poke_bf16(sf, "model.layers.0.mlp.experts.gate_up_proj", 2 * 128 * 128 + 70 * 128 + 3, 0xff80);
  EXPECT_EQ(build_error(t.path / "st", model::Quant::Mxfp4),
            sf.string() +
                ": tensor model.layers.0.mlp.experts.gate_up_proj (layer 0, expert 2), row 70 col 3: -Inf; a "
                "non-finite weight cannot be quantised to mxfp4");
}

// `lutb eval` on a LUT-B checkpoint whose stored scale bytes make the weights overflow FP32: the
// loader names the tensor and the tile (it printed "non-finite loss" naming no tensor).
TEST(NewUserS11, EvalOnOverflowingStoredScalesNamesTheTensor) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const fs::path q = t.path / "q";
  test::CliResult r = test::run_cli("quantize " + test::quote(dir) + " -o " + test::quote(q) + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string s = "model.layers.0.block_sparse_moe.experts.5.w2.weight_scale";
  poke_bf16(q / "model.safetensors", s, 0, 0xFEFE);  // tiles [0, 0] and [0, 1]: scale byte 254
  r = test::run_cli("eval " + test::quote(q) + " --max-windows 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find((q / "model.safetensors").string() + ": tensor " + s +
                       " (layer 0, expert 5): tile [0, 0] (tile row 0, tile column 0) has scale byte 254"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("val loss"), std::string::npos) << r.out;
}

// A BF16 checkpoint with NaN weights: `lutb eval` said "non-finite loss" naming no tensor (the
// quantisation statistics that name one exist only for --quant lutb / int3-g128 / mxfp4).
TEST(NewUserS11, NonFiniteLossNamesTheStoredTensor) {
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
  const test::CliResult r = test::run_cli("eval " + test::quote(m) + " --max-windows 1");
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
  const test::CliResult m2 = test::run_cli("moe " + test::quote(m) + " --layer 1 --activations " + test::quote(acts));
  EXPECT_EQ(m2.status, 1);
  // Refused before any result: "rel_l2 nan ..." was printed first (new-user QA, session 20), and with
  // --json a JSON line with "rel_l2": null, for --quant none (the BF16 experts as stored) as for LUT-B.
  EXPECT_EQ(m2.out.find("rel_l2"), std::string::npos) << m2.out;
  for (const char* quant : {"none", "lutb"}) {
    const test::CliResult j = test::run_cli("moe " + test::quote(m) + " --layer 1 --json --quant " + quant +
                                            " --activations " + test::quote(acts));
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

// config.json values that made `lutb eval` fail later without naming the file or the key ("rope
// dimension 0 must be even and positive") or compute a NaN loss (a negative rms_norm_eps), and
// rope types it would have refused only when building the table.
TEST(NewUserS11, ConfigRopeAndNormValuesNameTheKey) {
  const nlohmann::json base = {{"model_type", "qwen3_moe"},
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
  EXPECT_NO_THROW(model::TransformerConfig::from_json(base, "c.json"));
  auto err = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = base;
    edit(j);
    try {
      model::TransformerConfig::from_json(j, "c.json");
    } catch (const model::ModelError& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  EXPECT_EQ(err([](nlohmann::json& j) { j["head_dim"] = 0; }),
            "c.json: key 'head_dim': head_dim 0 x partial_rotary_factor 1 gives a rotary dimension of 0; it must be "
            "even and positive");
  EXPECT_EQ(err([](nlohmann::json& j) { j["rms_norm_eps"] = -1; }),
            "c.json: key 'rms_norm_eps': must be a finite number >= 0, got -1");
  EXPECT_EQ(err([](nlohmann::json& j) { j["rope_parameters"]["rope_type"] = "dynamic"; }),
            "c.json: key 'rope_parameters.rope_type': \"dynamic\" is not supported (default, linear, yarn)");
  EXPECT_EQ(err([](nlohmann::json& j) {
              j["rope_parameters"]["rope_type"] = "linear";
              j["rope_parameters"]["factor"] = 0;
            }),
            "c.json: key 'rope_parameters.factor': must be a finite number >= 1 for rope_type \"linear\" (the factor "
            "by which the context is extended, as transformers requires), got 0");
  EXPECT_EQ(err([](nlohmann::json& j) { j["rope_parameters"]["rope_theta"] = -5; }),
            "c.json: key 'rope_parameters.rope_theta': must be a positive finite number, got -5");
  EXPECT_EQ(err([](nlohmann::json& j) {
              j["rope_parameters"]["rope_type"] = "yarn";
              j["rope_parameters"]["factor"] = 4;
              j.erase("max_position_embeddings");
            }),
            "c.json: key 'rope_parameters.original_max_position_embeddings': required for rope_type \"yarn\" (or "
            "max_position_embeddings), and positive");
}

// `--kernel reference` with BF16 (or INT3 / MXFP4) experts was silently ignored, unlike --fitter.
TEST(NewUserS11, KernelWithoutLutbExpertsIsAnError) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  test::CliResult r = test::run_cli("eval " + test::quote(dir) + " --kernel reference --max-windows 1");
  EXPECT_EQ(r.status, 2);  // a usage error (README "Exit status", nu18)
  EXPECT_NE(r.err.find("lutb: error: --kernel reference only applies to LUT-B experts (--quant lutb, or a LUT-B "
                       "checkpoint); the experts here are --quant none"),
            std::string::npos)
      << r.err;
  r = test::run_cli("moe " + test::quote(dir) + " --layer 0 --quant mxfp4 --kernel fast --activations " +
                    test::quote(dir / "moe_activations.safetensors"));
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--kernel fast only applies to LUT-B experts (--quant lutb, or a LUT-B checkpoint); the "
                       "experts here are --quant mxfp4"),
            std::string::npos)
      << r.err;
  r = test::run_cli("eval " + test::quote(dir) + " --quant lutb --kernel reference --max-windows 1");
  EXPECT_EQ(r.status, 0) << r.err;
}

// `lutb eval ... --act-format mxfp8` (the flag `lutb moe` uses for the format) failed with "The
// following arguments were not expected: mxfp8 --act-format"; eval takes it as --activations.
TEST(NewUserS11, EvalTakesActFormatLikeMoe) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  const test::CliResult a = test::run_cli("eval " + test::quote(dir) + " --act-format mxfp8 --max-windows 1 --json");
  ASSERT_EQ(a.status, 0) << a.err;
  const test::CliResult b = test::run_cli("eval " + test::quote(dir) + " --activations mxfp8 --max-windows 1 --json");
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_EQ(a.json()["activations"], "mxfp8");
  EXPECT_EQ(a.json()["val_loss"], b.json()["val_loss"]);
}

// `lutb eval` of a checkpoint with more layers than config.json declares reported the loss of the
// shorter model and ignored the rest without a word (lutb quantize refuses the same checkpoint).
TEST(NewUserS11, LoadRefusesLayersTheConfigDoesNotDeclare) {
  LUTB_MODEL_OR_SKIP(src, "tiny-mixtral");
  TempDir t;
  const fs::path dir = t.path / "m";
  fs::copy(src, dir, fs::copy_options::recursive);
  nlohmann::json cfg;
  std::ifstream(dir / "config.json") >> cfg;
  const int layers = cfg.at("num_hidden_layers").get<int>();
  ASSERT_GE(layers, 2);
  cfg["num_hidden_layers"] = layers - 1;
  std::ofstream(dir / "config.json") << cfg.dump(2);
  std::string err = "no exception";
  try {
    model::CheckpointMoe moe(dir, model::MoeOptions{});
    model::LanguageModel::load(dir, moe.factory());
  } catch (const model::ModelError& e) {
    err = e.what();
  }
  const std::string want = "model.safetensors: tensor model.layers." + std::to_string(layers - 1) + ".";
  EXPECT_NE(err.find(want), std::string::npos) << err;
  EXPECT_NE(err.find("belongs to layer " + std::to_string(layers - 1) + ", but " + (dir / "config.json").string() +
                     " declares num_hidden_layers " + std::to_string(layers - 1) + " (layers 0.." +
                     std::to_string(layers - 2) + ")"),
            std::string::npos)
      << err;
  const test::CliResult r = test::run_cli("eval " + test::quote(dir) + " --max-windows 1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("belongs to layer " + std::to_string(layers - 1)), std::string::npos) << r.err;
  // The unmodified model loads (the check does not trip on declared layers).
  std::ofstream(dir / "config.json") << nlohmann::json::parse(std::ifstream(src / "config.json")).dump(2);
  model::CheckpointMoe moe(dir, model::MoeOptions{});
  EXPECT_NO_THROW(model::LanguageModel::load(dir, moe.factory()));
}

}  // namespace
}  // namespace lutb
