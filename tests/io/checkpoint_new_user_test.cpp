// Defects a new user found in session 9 (none loses data, all hurt): errors that named a library
// function or an internal stack instead of the file, the stored tensor, the layer and the reason;
// folders without model.safetensors; layers config.json does not declare; synth's DeepSeek routing
// groups; unchecked ExpertMap / FitOptions inputs. Each test failed on the code before its fix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/moe.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

SynthOptions small(std::int64_t layers = 1, std::int64_t width = 64) {
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = layers;
  o.hidden_size = 128;
  o.moe_intermediate_size = width;
  o.num_experts = 4;
  o.progress = false;
  return o;
}

QuantizeOptions quiet() {
  QuantizeOptions q;
  q.progress = false;
  return q;
}

template <class Ex, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Ex& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

void edit_config(const fs::path& dir, const std::function<void(nlohmann::json&)>& f) {
  nlohmann::json j;
  {
    std::ifstream in(dir / "config.json");
    in >> j;
  }
  f(j);
  std::ofstream(dir / "config.json") << j.dump(2);
}

// Overwrites byte `index` of tensor `name`'s data in safetensors file `file`.
void poke(const fs::path& file, const std::string& name, std::size_t index, std::uint8_t value) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  const auto j = nlohmann::json::parse(header);
  const std::uint64_t at = 8 + n + j.at(name).at("data_offsets")[0].get<std::uint64_t>() + index;
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(value));
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

// Finding 1: a per-expert LUT-B checkpoint with moe_intermediate_size % 8 != 0 cannot be run (gate
// and up are padded to whole tiles separately). The error said "...; use lutb_projection()" (a
// library function) without the file or tensor; lutb moe / eval printed that. Now it names the
// file, the stored tensor, the layer, the reason and what to do; the remedies it names work.
TEST(NewUserErrors, PerExpertLutbWithWidthNotAMultipleOf8) {
  TempDir t;
  synthesize_checkpoint(t.path / "bf16", small(1, 100));
  quantize_checkpoint(t.path / "bf16", t.path / "lutb", quiet());
  const Checkpoint ck(t.path / "lutb");
  const std::string e = error_of<FormatError>([&] { ck.lutb_experts(0); });
  EXPECT_EQ(e.rfind((t.path / "lutb" / "model.safetensors").string() +
                        ": tensor model.layers.0.mlp.experts.0.gate_proj.weight_packed (layer 0): this checkpoint stores "
                        "each expert's gate and up projections as separate LUT-B tensors",
                    0),
            0u)
      << e;
  EXPECT_TRUE(has(e, "moe_intermediate_size 100 of " + (t.path / "lutb" / "config.json").string() +
                         " is not a multiple of 8, so each is padded to 104 rows"))
      << e;
  EXPECT_TRUE(has(e, "or run the BF16 checkpoint with --quant lutb")) << e;
  EXPECT_FALSE(has(e, "lutb_projection()")) << e;
  // Per projection it reads fine, and both remedies load: the online fit of the BF16 checkpoint and
  // a stacked checkpoint's LUT-B tiles.
  EXPECT_EQ(ck.lutb_projection(0, Proj::gate).shape.rows, 100);
  const ExpertsLutb online = Checkpoint(t.path / "bf16").lutb_experts(0);
  EXPECT_EQ(online.w13.shape.rows, 200);
  SynthOptions st = small(1, 100);
  st.stacked = true;
  synthesize_checkpoint(t.path / "bf16s", st);
  quantize_checkpoint(t.path / "bf16s", t.path / "lutbs", quiet());
  const Checkpoint cks(t.path / "lutbs");
  EXPECT_EQ(cks.lutb_experts(0).w13.shape.rows, 200);
  // The stacked gate_up cannot be cut into gate and up: that message named lutb_experts().
  const std::string g = error_of<FormatError>([&] { cks.lutb_projection(0, Proj::up); });
  EXPECT_EQ(g, (t.path / "lutbs" / "model.safetensors").string() +
                   ": tensor model.layers.0.mlp.experts.gate_up_proj_packed (layer 0) is a stacked LUT-B gate_up tensor "
                   "and the expert width moe_intermediate_size 100 is not a multiple of 8: its tiles straddle gate "
                   "and up, so the up projection cannot be read on its own (the whole gate_up stack can)");
}

// Finding 3: bad stored LUT-B data was reported against the internal stacks ("model.layers.0.mlp.
// experts w13: tile (expert 2, tn 11, tk 1)", rows counted across gate and up), without the file;
// wrong dtypes named the folder, not the file, and no layer. Now: the file, the tensor as stored,
// the layer (and expert), the tile in that tensor's grid and the reason.
TEST(NewUserErrors, StoredLutbErrorsNameFileTensorLayerAndTile) {
  TempDir t;
  synthesize_checkpoint(t.path / "bf16", small(2));
  quantize_checkpoint(t.path / "bf16", t.path / "lutb", quiet());
  // Layer 1 lives in the second shard. Expert 2's up_proj codebook, tile row 3, tile column 1
  // ([64, 128] = 8 x 2 tiles): entry 5 becomes 0x7F (E4M3 NaN).
  const fs::path shard = t.path / "lutb" / "model-00002-of-00002.safetensors";
  poke(shard, "model.layers.1.mlp.experts.2.up_proj.weight_codebook", (3 * 2 + 1) * 8 + 5, 0x7F);
  const std::string e = error_of<FormatError>([&] { Checkpoint(t.path / "lutb").lutb_experts(1); });
  EXPECT_EQ(e, shard.string() +
                   ": tensor model.layers.1.mlp.experts.2.up_proj.weight_codebook (layer 1, expert 2): tile [3, 1] (tile "
                   "row 3, tile column 1) has a NaN codebook entry (entry 5, byte 0x7F); E4M3 codebook bytes 0x7F and "
                   "0xFF are NaN and invalid in LUT-B (spec 2)");
  // A stacked checkpoint: down_proj [E, H, I] = [4, 128, 64] has 16 x 1 tiles per expert; expert 1,
  // tile row 9 gets scale 255.
  SynthOptions st = small(1);
  st.stacked = true;
  synthesize_checkpoint(t.path / "bf16s", st);
  quantize_checkpoint(t.path / "bf16s", t.path / "lutbs", quiet());
  const fs::path file = t.path / "lutbs" / "model.safetensors";
  poke(file, "model.layers.0.mlp.experts.down_proj_scale", 1 * 16 + 9, 255);
  const std::string s = error_of<FormatError>([&] { Checkpoint(t.path / "lutbs").lutb_experts(0); });
  EXPECT_EQ(s, file.string() +
                   ": tensor model.layers.0.mlp.experts.down_proj_scale (layer 0): tile [1, 9, 0] (expert 1, tile row 9, "
                   "tile column 0) has scale byte 255, which is UE8M0 NaN and invalid in LUT-B (spec 2)");
  // A stored tensor of the wrong dtype: the file and layer are named.
  synthesize_checkpoint(t.path / "bf16d", small(1));
  quantize_checkpoint(t.path / "bf16d", t.path / "lutbd", quiet());
  const fs::path f1 = t.path / "lutbd" / "model.safetensors";
  std::vector<std::pair<std::string, OwnedTensor>> all;
  {
    const SafetensorsFile f(f1);
    for (const auto& n : f.names()) {
      const TensorView& v = f.get(n);
      OwnedTensor o{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)};
      if (n == "model.layers.0.mlp.experts.3.down_proj.weight_scale") o.dtype = DType::I8;
      all.push_back({n, std::move(o)});
    }
  }
  write_safetensors(f1, all, {{"format", "pt"}});
  const std::string d = error_of<CheckpointError>([&] { Checkpoint(t.path / "lutbd").lutb_experts(0); });
  EXPECT_EQ(d, f1.string() + ": tensor model.layers.0.mlp.experts.3.down_proj.weight_scale (layer 0, expert 3) has dtype "
                             "I8, expected U8 (spec 2.2)");
}

// Finding 2: a folder without model.safetensors read every *.safetensors as weights, so the data
// files beside a model (val_tokens.safetensors and moe_activations.safetensors both hold
// "input_ids") gave "tensor 'input_ids' appears in both ..."; shards without their index and with
// one missing were accepted. Now: what is missing, naming the folder.
TEST(NewUserErrors, FolderWithoutModelSafetensors) {
  TempDir t;
  const OwnedTensor ids{DType::I32, {2}, std::vector<std::uint8_t>(8, 1)};
  // Only config.json and the data files.
  synthesize_checkpoint(t.path / "m", small(1));
  fs::remove(t.path / "m" / "model.safetensors");
  write_safetensors(t.path / "m" / "val_tokens.safetensors", {{"input_ids", ids}});
  write_safetensors(t.path / "m" / "moe_activations.safetensors", {{"input_ids", ids}});
  const std::string e = error_of<SafetensorsError>([&] { Checkpoint c(t.path / "m"); });
  EXPECT_EQ(e, (t.path / "m").string() +
                   ": no model weights: the folder has no model.safetensors.index.json (sharded checkpoint), no "
                   "model.safetensors and no other *.safetensors weight file (val_tokens.safetensors, "
                   "moe_activations.safetensors and consolidated*.safetensors are not read as weights); it holds only: "
                   "moe_activations.safetensors, val_tokens.safetensors, config.json");
  fs::remove(t.path / "m" / "val_tokens.safetensors");
  fs::remove(t.path / "m" / "moe_activations.safetensors");
  EXPECT_EQ(error_of<SafetensorsError>([&] { Checkpoint c(t.path / "m"); }),
            (t.path / "m").string() +
                ": no model weights: the folder has no model.safetensors.index.json (sharded checkpoint), no "
                "model.safetensors and no other *.safetensors weight file; it holds only: config.json");
  fs::create_directories(t.path / "empty");
  EXPECT_TRUE(has(error_of<SafetensorsError>([&] { SafetensorsCollection::open_dir(t.path / "empty"); }),
                  (t.path / "empty").string() + ": no model weights: ") );
  // Shards without their index, beside the data files: read, the data files left out.
  synthesize_checkpoint(t.path / "s", small(3));
  fs::remove(t.path / "s" / "model.safetensors.index.json");
  write_safetensors(t.path / "s" / "val_tokens.safetensors", {{"input_ids", ids}});
  write_safetensors(t.path / "s" / "moe_activations.safetensors", {{"input_ids", ids}});
  {
    const Checkpoint c(t.path / "s");
    EXPECT_FALSE(c.contains("input_ids"));
    EXPECT_EQ(c.router(2).weight.rows, 4);
  }
  // ... and one of them missing.
  fs::remove(t.path / "s" / "model-00002-of-00003.safetensors");
  EXPECT_EQ(error_of<SafetensorsError>([&] { Checkpoint c(t.path / "s"); }),
            (t.path / "s").string() +
                ": shard model-00002-of-00003.safetensors is missing (the folder has 2 of the 3 shards "
                "model-NNNNN-of-00003.safetensors and no model.safetensors.index.json that lists them)");
  // Two weight files holding one name: the message says why both were read.
  synthesize_checkpoint(t.path / "d", small(1));
  fs::copy_file(t.path / "d" / "model.safetensors", t.path / "d" / "weights-a.safetensors");
  fs::rename(t.path / "d" / "model.safetensors", t.path / "d" / "weights-b.safetensors");
  const std::string d = error_of<SafetensorsError>([&] { Checkpoint c(t.path / "d"); });
  EXPECT_TRUE(has(d, (t.path / "d").string() + ": tensor 'model.layers.0.mlp.gate.weight' appears in both " +
                         (t.path / "d" / "weights-a.safetensors").string() + " and " +
                         (t.path / "d" / "weights-b.safetensors").string() +
                         ": the folder has no model.safetensors and no model.safetensors.index.json, so every "
                         "*.safetensors file in it is read as part of the weights"))
      << d;
}

// Finding 4: quantize accepted layers config.json does not declare (num_hidden_layers 1 with two
// layers stored: both quantised) and routed experts in a layer the config makes dense (copied in
// BF16). Both are refused before anything is written; DeepSeek-V3's multi-token-prediction layers
// (num_nextn_predict_layers, stored after the decoder layers) are still accepted.
TEST(NewUserErrors, QuantizeRefusesLayersTheConfigDoesNotDeclare) {
  TempDir t;
  const auto refused = [&](const fs::path& in) {
    const std::string e = error_of<CheckpointError>([&] { quantize_checkpoint(in, t.path / "out", quiet()); });
    EXPECT_FALSE(fs::exists(t.path / "out"));
    for (const auto& n : entries(t.path)) EXPECT_EQ(n.rfind("out", 0), std::string::npos) << n << " was written";
    return e;
  };
  synthesize_checkpoint(t.path / "a", small(2));
  edit_config(t.path / "a", [](nlohmann::json& j) { j["num_hidden_layers"] = 1; });
  EXPECT_EQ(refused(t.path / "a"),
            (t.path / "a" / "model-00002-of-00002.safetensors").string() +
                ": tensor model.layers.1.mlp.gate.weight belongs to layer 1, but " +
                (t.path / "a" / "config.json").string() +
                " declares num_hidden_layers 1 (layers 0..0): the checkpoint has layers the config does not; nothing "
                "written");
  synthesize_checkpoint(t.path / "b", small(3));
  edit_config(t.path / "b", [](nlohmann::json& j) { j["mlp_only_layers"] = {0, 2}; });
  EXPECT_EQ(refused(t.path / "b"),
            (t.path / "b" / "model-00001-of-00003.safetensors").string() +
                ": tensor model.layers.0.mlp.experts.0.gate_proj.weight is a routed expert of layer 0, but " +
                (t.path / "b" / "config.json").string() +
                " makes layer 0 a dense layer (its MoE layers: 1); the config and the weights disagree; nothing "
                "written");
  // DeepSeek-V3 with one decoder layer and one MTP layer: quantised, both layers.
  SynthOptions ds = small(2);
  ds.family = ModelFamily::deepseek_v3;
  synthesize_checkpoint(t.path / "c", ds);
  edit_config(t.path / "c", [](nlohmann::json& j) {
    j["num_hidden_layers"] = 1;
    j["num_nextn_predict_layers"] = 1;
  });
  EXPECT_EQ(quantize_checkpoint(t.path / "c", t.path / "out", quiet()).tensors_quantized, 2 * 4 * 3);
}

// Finding 5: synth --experts kept DeepSeek-V3's n_group 8 / topk_group 4 whenever 8 divided E:
// --experts 8 gave groups of one expert, of which 4 are kept, for top-8 (no router can satisfy it;
// sigmoid scoring ranks a group by its 2 best experts). Every E now gives a routable config.
TEST(NewUserErrors, SynthDeepSeekRoutingGroupsAreConsistent) {
  SynthOptions o = small(1);
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

// Finding 7: ExpertMap::is_local indexed its table unchecked (undefined behaviour out of range);
// FitOptions::threads < 0 was accepted silently.
TEST(NewUserErrors, ExpertMapIsLocalAndNegativeThreads) {
  const moe::ExpertMap m = moe::ExpertMap::linear(8, 1, 2);
  EXPECT_FALSE(m.is_local(0));
  EXPECT_TRUE(m.is_local(4));
  EXPECT_EQ(error_of<std::out_of_range>([&] { (void)m.is_local(8); }), "ExpertMap::is_local: expert id 8 is outside 0..7");
  EXPECT_EQ(error_of<std::out_of_range>([&] { (void)m.is_local(-1); }), "ExpertMap::is_local: expert id -1 is outside 0..7");
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(1));
  QuantizeOptions q = quiet();
  q.fit.threads = -2;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize_checkpoint(t.path / "in", t.path / "out", q); }),
            "quantize: FitOptions::threads -2: must be >= 0 (0 = all cores); nothing written");
  EXPECT_FALSE(fs::exists(t.path / "out"));
  FitOptions f;
  f.threads = -1;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { Checkpoint(t.path / "in").lutb_experts(0, f); }),
            "FitOptions::threads -1: must be >= 0 (0 = all cores)");
  moe::MoeConfig mc;
  mc.global_experts = 4;
  mc.top_k = 2;
  mc.hidden_size = 128;
  mc.intermediate_size_per_partition = 64;
  moe::OnlineOptions oo;
  oo.fit.threads = -3;
  EXPECT_EQ(error_of<std::invalid_argument>([&] { moe::LutBOnlineMoEMethod(mc, oo); }),
            "FitOptions::threads -3: must be >= 0 (0 = all cores)");
  // lutb::quantize itself (it used to treat a negative count as 0).
  const std::vector<float> w(8 * 64, 0.25f);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { (void)quantize(w.data(), LutbShape{1, 8, 64, false}, f, nullptr, "w"); }),
            "quantize: tensor w: FitOptions::threads -1: must be >= 0 (0 = all cores)");
}

}  // namespace
}  // namespace lutb
