// Layers a checkpoint stores beyond those config.json declares are refused by quantize, by the loader
// and by lutb moe alike.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
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
using test::edit_config;
using test::entries;
using test::error_of;
using test::has;
using test::kSynthDefaultLayers;
using test::q;
using test::quiet;
using test::read_json;
using test::run;
using test::small_checkpoint;
using test::small_synth_layers;
using test::TempDir;
using test::write_activations_of_layers;
using test::write_json;

// lutb moe refuses a layer of a checkpoint whose config.json declares fewer layers than it stores, as lutb
// eval and lutb quantize do, naming the declared count rather than "out of range".
TEST(DeclaredLayers, MoeCommandRefusesLayersTheConfigDoesNotDeclare) {
  test::TempDir t;
  const fs::path in = t.path / "in";
  ASSERT_EQ(run(kSynthDefaultLayers + "--layers 2 -o " + q(in)).code, 0);
  write_activations_of_layers(t.path / "acts.safetensors", 128, 2);
  const std::string acts = " --activations " + q(t.path / "acts.safetensors");
  ASSERT_EQ(run("moe " + q(in) + " --layer 1" + acts).code, 0);
  nlohmann::json j;
  std::ifstream(in / "config.json") >> j;
  j["num_hidden_layers"] = 1;
  fs::remove(in / "config.json");
  std::ofstream(in / "config.json") << j.dump(2);
  for (const char* layer : {"0", "1"}) {
    const CliOut r = run("moe " + q(in) + " --layer " + layer + acts);
    EXPECT_EQ(r.code, 1) << r.out;
    EXPECT_TRUE(has(r, "belongs to layer 1, but " + (in / "config.json").string() +
                           " declares num_hidden_layers 1 (layers 0..0): the checkpoint has layers the config does not"))
        << r.out;
  }
}

// CheckpointMoe, which lutb eval and lutb moe load the routed experts with, refuses a checkpoint that stores
// more layers than config.json declares, as eval does.
TEST(DeclaredLayers, CheckpointMoeRefusesLayersTheConfigDoesNotDeclare) {
  TempDir t;
  const fs::path dir = small_checkpoint(t.path / "ck", 2);
  nlohmann::json j = read_json(dir / "config.json");
  j["num_hidden_layers"] = 1;
  write_json(dir / "config.json", j);
  const std::string err = error_of([&] { model::CheckpointMoe moe(dir, model::MoeOptions{}); });
  EXPECT_TRUE(has(err, "tensor model.layers.1.")) << err;
  EXPECT_TRUE(has(err, "belongs to layer 1, but " + (dir / "config.json").string() +
                           " declares num_hidden_layers 1 (layers 0..0): the checkpoint has layers the config does not"))
      << err;
}

// quantize refuses layers config.json does not declare (num_hidden_layers 1 with two layers stored) and routed
// experts in a layer the config makes dense, before anything is written; DeepSeek-V3's multi-token-prediction
// layers (num_nextn_predict_layers, stored after the decoder layers) are accepted.
TEST(DeclaredLayers, QuantizeRefusesLayersTheConfigDoesNotDeclare) {
  TempDir t;
  const auto refused = [&](const fs::path& in) {
    const std::string e = error_of<CheckpointError>([&] { quantize_checkpoint(in, t.path / "out", quiet()); });
    EXPECT_FALSE(fs::exists(t.path / "out"));
    for (const auto& n : entries(t.path)) EXPECT_EQ(n.rfind("out", 0), std::string::npos) << n << " was written";
    return e;
  };
  synthesize_checkpoint(t.path / "a", small_synth_layers(2));
  edit_config(t.path / "a", [](nlohmann::json& j) { j["num_hidden_layers"] = 1; });
  EXPECT_EQ(refused(t.path / "a"),
            (t.path / "a" / "model-00002-of-00002.safetensors").string() +
                ": tensor model.layers.1.mlp.gate.weight belongs to layer 1, but " +
                (t.path / "a" / "config.json").string() +
                " declares num_hidden_layers 1 (layers 0..0): the checkpoint has layers the config does not; nothing "
                "written");
  synthesize_checkpoint(t.path / "b", small_synth_layers(3));
  edit_config(t.path / "b", [](nlohmann::json& j) { j["mlp_only_layers"] = {0, 2}; });
  EXPECT_EQ(refused(t.path / "b"),
            (t.path / "b" / "model-00001-of-00003.safetensors").string() +
                ": tensor model.layers.0.mlp.experts.0.gate_proj.weight is a routed expert of layer 0, but " +
                (t.path / "b" / "config.json").string() +
                " makes layer 0 a dense layer (its MoE layers: 1); the config and the weights disagree; nothing "
                "written");
  // DeepSeek-V3 with one decoder layer and one MTP layer: quantised, both layers.
  SynthOptions ds = small_synth_layers(2);
  ds.family = ModelFamily::deepseek_v3;
  synthesize_checkpoint(t.path / "c", ds);
  edit_config(t.path / "c", [](nlohmann::json& j) {
    j["num_hidden_layers"] = 1;
    j["num_nextn_predict_layers"] = 1;
  });
  EXPECT_EQ(quantize_checkpoint(t.path / "c", t.path / "out", quiet()).tensors_quantized, 2 * 4 * 3);
}

// The model loader (`lutb eval`) refuses a checkpoint with more layers than config.json declares, as lutb
// quantize does, rather than reporting the loss of the shorter model.
TEST(DeclaredLayers, ModelLoadRefusesLayersTheConfigDoesNotDeclare) {
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
  const test::CliResult r = test::run_cli("eval " + test::q(dir) + " --max-windows 1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("belongs to layer " + std::to_string(layers - 1)), std::string::npos) << r.err;
  // The unmodified model loads (the check does not trip on declared layers).
  std::ofstream(dir / "config.json") << nlohmann::json::parse(std::ifstream(src / "config.json")).dump(2);
  model::CheckpointMoe moe(dir, model::MoeOptions{});
  EXPECT_NO_THROW(model::LanguageModel::load(dir, moe.factory()));
}

}  // namespace
}  // namespace lutb
