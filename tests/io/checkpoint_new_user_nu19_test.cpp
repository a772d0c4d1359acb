// Defects a fresh new user found in session 19 (helper nu19) on synthetic and damaged checkpoints.
// Each test failed on the code before its fix.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

nlohmann::json read_json(const fs::path& p) {
  nlohmann::json j;
  std::ifstream(p) >> j;
  return j;
}

void write_json(const fs::path& p, const nlohmann::json& j) {
  fs::remove(p);
  std::ofstream(p) << j.dump(2);
}

// A small synthetic checkpoint: hidden 128, expert width 64, 4 experts, `layers` MoE layers (one
// shard per layer, with model.safetensors.index.json).
fs::path small_checkpoint(const fs::path& dir, std::int64_t layers = 1) {
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = layers;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 4;
  o.progress = false;
  synthesize_checkpoint(dir, o);
  return dir;
}

// Rewrites the checkpoint's shards as one model.safetensors (no index) without tensor `drop`.
void merge_without(const fs::path& dir, const std::string& drop) {
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  std::vector<fs::path> shards;
  {
    const SafetensorsCollection c = SafetensorsCollection::open_dir(dir);
    for (const auto& n : c.names()) {
      if (n == drop) continue;
      const TensorView& v = c.get(n);
      ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
    for (const auto& f : c.files()) shards.push_back(f->path());
  }
  for (const auto& s : shards) fs::remove(s);
  fs::remove(dir / "model.safetensors.index.json");
  write_safetensors(dir / "model.safetensors", ts);
}

// `lutb synth --hidden-size H` kept the family's attention heads: for the families whose config.json
// derives head_dim as hidden_size // num_attention_heads (Mixtral, Qwen2-MoE, OLMoE), --hidden-size
// 100 gave Mixtral head_dim 3, and lutb moe / lutb eval refused the checkpoint synth had just written
// ("key 'head_dim': head_dim 3 x partial_rotary_factor 1 gives a rotary dimension of 3"). Now the
// heads are reduced until head_dim is even; sizes that already give an even head_dim keep the
// family's heads.
TEST(CheckpointNewUserNu19, SynthHiddenSizeOverrideWritesAConfigLutbReads) {
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
    ASSERT_EQ(err, "(no error)");
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

// A routed expert that config.json implies but the checkpoint lacks: lutb eval and lutb moe said
// "checkpoint DIR: tensor X not found", naming neither the file searched nor why it was expected
// (lutb quantize named config.json). Now the message names the layer, config.json and the file.
TEST(CheckpointNewUserNu19, MissingRoutedExpertNamesConfigAndFileSearched) {
  TempDir t;
  const fs::path dir = small_checkpoint(t.path / "ck");
  const std::string gone = "model.layers.0.mlp.experts.2.up_proj.weight";
  merge_without(dir, gone);
  const std::string err = error_of([&] { (void)Checkpoint(dir).experts_source(0); });
  EXPECT_TRUE(has(err, "layer 0 is a MoE layer of " + (dir / "config.json").string() + ", which declares 4 routed experts")) << err;
  EXPECT_TRUE(has(err, "routed-expert tensor " + gone + " is missing")) << err;
  EXPECT_TRUE(has(err, "; " + (dir / "model.safetensors").string() + " has no such tensor")) << err;
}

// The same through an index whose shards do not hold it either: the index is named.
TEST(CheckpointNewUserNu19, MissingTensorThroughAnIndexNamesTheIndex) {
  TempDir t;
  const fs::path dir = small_checkpoint(t.path / "ck", 2);
  const std::string gone = "model.layers.1.mlp.experts.0.down_proj.weight";
  // Drop it from the index and from its shard.
  const fs::path index = dir / "model.safetensors.index.json";
  nlohmann::json j = read_json(index);
  const fs::path shard = dir / j.at("weight_map").at(gone).get<std::string>();
  j["weight_map"].erase(gone);
  write_json(index, j);
  {
    std::vector<std::pair<std::string, OwnedTensor>> ts;
    {
      const SafetensorsFile f(shard);
      for (const auto& n : f.names()) {
        if (n == gone) continue;
        const TensorView& v = f.get(n);
        ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
      }
    }
    fs::remove(shard);
    write_safetensors(shard, ts);
  }
  const std::string err = error_of([&] { (void)Checkpoint(dir).experts_source(1); });
  EXPECT_TRUE(has(err, "routed-expert tensor " + gone + " is missing")) << err;
  EXPECT_TRUE(has(err, "; " + index.string() + "'s weight_map does not list it (nor does any of its 2 shards hold it)"))
      << err;
  // Any "not found" of the collection names where it looked.
  const SafetensorsCollection c = SafetensorsCollection::open_dir(dir);
  EXPECT_EQ(c.absent_note("model.layers.0.mlp.gate.weight"), "");
  EXPECT_EQ(c.absent_note("nope"), "; " + index.string() + "'s weight_map does not list it (nor does any of its 2 "
                                                           "shards hold it)");
  EXPECT_EQ(SafetensorsCollection::open_file(shard).absent_note("nope"), "; " + shard.string() + " has no such tensor");
}

// lutb moe ran a layer of a checkpoint that stores more layers than config.json declares (lutb eval
// and lutb quantize refuse it), and called the stored layers beyond the config "out of range".
// CheckpointMoe, which lutb eval and lutb moe load the routed experts with, refuses it as eval does.
TEST(CheckpointNewUserNu19, CheckpointMoeRefusesLayersTheConfigDoesNotDeclare) {
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

}  // namespace
}  // namespace lutb

namespace lutb {
namespace {

// An existing output without --force was refused with "output directory exists (use --force to replace
// it)" even when --force would refuse it too (a folder of other files, the current folder): the advice
// led to a second refusal. Now the first error gives the --force check's reason.
TEST(CheckpointNewUserNu19, ExistingOutputThatForceWouldNotReplaceSaysSoAtOnce) {
  TempDir t;
  const fs::path in = small_checkpoint(t.path / "in");
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  fs::create_directories(t.path / "notes");
  std::ofstream(t.path / "notes" / "todo.txt") << "mine";
  const std::string err = error_of([&] { (void)quantize_checkpoint(in, t.path / "notes", q); });
  EXPECT_EQ(err, (t.path / "notes").string() +
                     ": the output exists, and --force would not replace it either: it does not look like a checkpoint "
                     "this tool wrote ('todo.txt' is not a file a checkpoint holds); choose another output or remove it "
                     "yourself; nothing written");
  std::string content;
  std::getline(std::ifstream(t.path / "notes" / "todo.txt"), content);
  EXPECT_EQ(content, "mine");
  // The current folder.
  const fs::path cwd = fs::current_path();
  fs::current_path(t.path / "notes");
  const std::string here = error_of([&] { (void)quantize_checkpoint(in, ".", q); });
  fs::current_path(cwd);
  EXPECT_EQ(here, ".: the output exists, and --force would not replace it either: it is the current directory or one of "
                  "its ancestors; choose another output or remove it yourself; nothing written");
  // An empty folder, which --force would replace: the plain advice.
  fs::create_directories(t.path / "empty");
  EXPECT_TRUE(has(error_of([&] { (void)quantize_checkpoint(in, t.path / "empty", q); }),
                  "output directory exists (use --force to replace it)"));
}

// Mixtral's expert width is intermediate_size: null (or absent, with no moe_intermediate_size) read as
// 0 and was reported as "the expert width must be positive, got 0", a value the file never held.
TEST(CheckpointNewUserNu19, MixtralNullIntermediateSizeIsMissingNotZero) {
  nlohmann::json j = {{"model_type", "mixtral"}, {"hidden_size", 64},       {"num_hidden_layers", 1},
                      {"vocab_size", 32},        {"num_local_experts", 2},  {"num_experts_per_tok", 1},
                      {"intermediate_size", nullptr}};
  std::string err = error_of([&] { (void)parse_model_config(j, "x/config.json"); });
  EXPECT_TRUE(has(err, "x/config.json: key 'intermediate_size': required but missing or null (Mixtral's expert width; "
                       "nor is 'moe_intermediate_size' given)"))
      << err;
  j.erase("intermediate_size");
  err = error_of([&] { (void)parse_model_config(j, "x/config.json"); });
  EXPECT_TRUE(has(err, "key 'intermediate_size': required but missing or null")) << err;
  j["intermediate_size"] = 0;
  err = error_of([&] { (void)parse_model_config(j, "x/config.json"); });
  EXPECT_TRUE(has(err, "key 'intermediate_size': the expert width must be positive, got 0")) << err;
  j["intermediate_size"] = 32;
  EXPECT_EQ(parse_model_config(j, "x/config.json").moe_intermediate_size, 32);
}

}  // namespace
}  // namespace lutb
