// Errors of stored and fitted tensors: each names the file, the tensor as stored, the layer (and
// expert), the tile and the reason.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/moe.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::edit_header;
using test::error_of;
using test::has;
using test::merge_without;
using test::poke_bytes;
using test::quiet;
using test::quiet_one_thread;
using test::read_json;
using test::replace_tensor;
using test::rewrite_safetensors;
using test::small_checkpoint;
using test::small_synth;
using test::small_synth_layers;
using test::TempDir;
using test::two_shard_checkpoint;
using test::write_json;

// The shard that holds `tensor`, from the checkpoint's index (the oracle: not the loader's code).
fs::path shard_of(const fs::path& dir, const std::string& tensor) {
  nlohmann::json idx;
  std::ifstream(dir / "model.safetensors.index.json") >> idx;
  return dir / idx.at("weight_map").at(tensor).get<std::string>();
}

// Removes `tensor` from the index's weight_map (the shard still holds it); returns that shard.
fs::path unlist(const fs::path& dir, const std::string& tensor) {
  const fs::path index = dir / "model.safetensors.index.json";
  nlohmann::json j = read_json(index);
  const fs::path shard = dir / j.at("weight_map").at(tensor).get<std::string>();
  j["weight_map"].erase(tensor);
  write_json(index, j);
  return shard;
}

std::vector<std::uint8_t> f64_bytes(const std::vector<double>& v) {
  std::vector<std::uint8_t> b(v.size() * 8);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Overwrites byte `index` of tensor `name`'s data in safetensors file `file`.
void poke_byte(const fs::path& file, const std::string& name, std::size_t index, std::uint8_t value) {
  poke_bytes(file, name, index, &value, 1);
}

// A routed expert of the wrong dtype or shape in the second shard: the errors of lutb eval / moe
// (Checkpoint::experts_source) and of lutb quantize name the shard, not the checkpoint folder, and the shape
// error says where the expected shape comes from.
TEST(TensorErrors, DtypeAndShapeErrorsNameTheShard) {
  TempDir t;
  const fs::path dir = two_shard_checkpoint(t.path / "m");
  const std::string up = "model.layers.1.mlp.experts.1.up_proj.weight";
  const fs::path shard = shard_of(dir, up);
  ASSERT_EQ(shard.filename(), "model-00002-of-00002.safetensors");

  edit_header(shard, [&](nlohmann::json& j) { j[up]["dtype"] = "I16"; });  // same bytes per element as BF16
  {
    const Checkpoint ck(dir);
    EXPECT_EQ(error_of([&] { (void)ck.experts_source(1); }),
              shard.string() + ": tensor " + up + " has dtype I16, expected a float weight (BF16, F16, F32 or F64)");
  }
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  EXPECT_EQ(error_of([&] { (void)quantize_checkpoint(dir, t.path / "q", q); }),
            shard.string() + ": routed-expert tensor " + up +
                " has dtype I16; LUT-B quantisation needs BF16, F16, F32 or F64 weights; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "q"));

  edit_header(shard, [&](nlohmann::json& j) {
    j[up]["dtype"] = "BF16";
    j[up]["shape"] = {128, 64};  // [H, I] instead of [I, H]: the same byte count
  });
  const Checkpoint ck(dir);
  EXPECT_EQ(error_of([&] { (void)ck.experts_source(1); }),
            shard.string() + ": tensor " + up + " has shape [128, 64], expected [64, 128] from " +
                (dir / "config.json").string() + " (hidden_size 128, expert width 64, 4 experts)");
  // Layer 0's shard is intact and still loads.
  EXPECT_NO_THROW((void)ck.experts_source(0));
}

// The router of the wrong shape: the error names the shard and config.json, where [E, H] comes from.
TEST(TensorErrors, RouterShapeErrorNamesTheShardAndTheConfig) {
  TempDir t;
  const fs::path dir = two_shard_checkpoint(t.path / "m");
  const std::string gate = "model.layers.1.mlp.gate.weight";
  const fs::path shard = shard_of(dir, gate);
  edit_header(shard, [&](nlohmann::json& j) { j[gate]["shape"] = {8, 64}; });  // 4 x 128 elements as 8 x 64
  const Checkpoint ck(dir);
  EXPECT_EQ(error_of([&] { (void)ck.router(1); }),
            shard.string() + ": tensor " + gate + " has shape [8, 64], expected [4, 128] from " +
                (dir / "config.json").string() + " (num_experts 4, hidden_size 128)");
}

// lutb quantize reads only the tensors model.safetensors.index.json lists, as lutb eval and lutb moe do: a
// routed expert the index leaves out is refused, naming the shard (quantised, it would turn an input eval
// refuses into a checkpoint eval runs); a stray tensor the index leaves out is not copied, with a warning.
TEST(TensorErrors, QuantizeReadsOnlyTheTensorsTheIndexLists) {
  TempDir t;
  const fs::path dir = two_shard_checkpoint(t.path / "m");
  const std::string up = "model.layers.1.mlp.experts.3.up_proj.weight";
  const fs::path shard = unlist(dir, up);
  const fs::path index = dir / "model.safetensors.index.json";
  ASSERT_TRUE(SafetensorsFile(shard).contains(up));
  EXPECT_EQ(error_of([&] { (void)quantize_checkpoint(dir, t.path / "q", quiet_one_thread()); }),
            "checkpoint " + dir.string() + ": layer 1 is a MoE layer of " + (dir / "config.json").string() +
                " (4 experts, 2 layers) but " + up + " is missing; " + shard.string() + " holds it, but " +
                index.string() + "'s weight_map does not list it (add it there); nothing written");
  EXPECT_FALSE(fs::exists(t.path / "q"));
  // eval's loader says the same of the input (the message quantize now matches).
  const Checkpoint ck(dir);
  EXPECT_NE(error_of([&] { (void)ck.experts_source(1); }).find(shard.string() + " holds it, but " + index.string() +
                                                                "'s weight_map does not list it"),
            std::string::npos);

  // A stray tensor in a shard, left out of the index: not part of the checkpoint, so neither read nor
  // copied (it was copied and listed in the output's index), with a warning naming shard and index.
  const fs::path dir2 = two_shard_checkpoint(t.path / "m2");
  const nlohmann::json idx = read_json(dir2 / "model.safetensors.index.json");
  const fs::path shard2 = dir2 / idx.at("weight_map").at("model.layers.0.mlp.gate.weight").get<std::string>();
  rewrite_safetensors(shard2, {}, {{"model.stray.weight", test::bf16_zeros_2x2()}});
  const QuantizeSummary s = quantize_checkpoint(dir2, t.path / "q2", quiet_one_thread());
  EXPECT_EQ(s.warnings, std::vector<std::string>{shard2.string() +
                                                 ": tensor model.stray.weight is not listed in " +
                                                 (dir2 / "model.safetensors.index.json").string() +
                                                 "'s weight_map, so it is not part of the checkpoint (lutb does not "
                                                 "read it); not copied"});
  const auto out = SafetensorsCollection::open_dir(t.path / "q2");
  EXPECT_FALSE(out.contains("model.stray.weight"));
  for (const auto& f : out.files()) EXPECT_FALSE(f->contains("model.stray.weight")) << f->path();
  EXPECT_TRUE(out.contains("model.layers.0.mlp.gate.weight"));
  EXPECT_TRUE(out.contains("model.layers.1.mlp.experts.3.up_proj.weight_packed"));
}

// A LUT-B checkpoint whose config.json lost its quantization_config: lutb quantize names the LUT-B
// tensors it found and the missing key, not only "no routed-expert tensors found".
TEST(TensorErrors, QuantizeNamesLutbTensorsWithoutTheirConfig) {
  TempDir t;
  synthesize_checkpoint(t.path / "bf16", test::synth_options(128, 64, 2));
  (void)quantize_checkpoint(t.path / "bf16", t.path / "lutb", quiet_one_thread());
  nlohmann::json cfg = read_json(t.path / "lutb" / "config.json");
  ASSERT_TRUE(cfg.contains("quantization_config"));
  cfg.erase("quantization_config");
  write_json(t.path / "lutb" / "config.json", cfg);
  const fs::path in = t.path / "lutb";
  EXPECT_EQ(error_of([&] { (void)quantize_checkpoint(in, t.path / "again", quiet_one_thread()); }),
            in.string() +
                ": the checkpoint is already LUT-B: it holds LUT-B routed-expert tensors "
                "(model.layers.0.mlp.experts.0.down_proj.weight_packed in " +
                (in / "model.safetensors").string() + ") and no float ones, but " + (in / "config.json").string() +
                " has no LUT-B quantization_config (the \"quantization_config\" with \"quant_method\": \"lut_b\" that "
                "says how to read them, spec 2.2): restore the config.json written with these weights to run them; to "
                "quantise, start from the original BF16 checkpoint; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "again"));
}

// A routed expert that config.json implies but the checkpoint lacks: the message names the layer, config.json
// and the file searched.
TEST(TensorErrors, MissingRoutedExpertNamesConfigAndFileSearched) {
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
TEST(TensorErrors, MissingTensorThroughAnIndexNamesTheIndex) {
  TempDir t;
  const fs::path dir = small_checkpoint(t.path / "ck", 2);
  const std::string gone = "model.layers.1.mlp.experts.0.down_proj.weight";
  // Drop it from the index and from its shard.
  const fs::path index = dir / "model.safetensors.index.json";
  const fs::path shard = unlist(dir, gone);
  rewrite_safetensors(shard, {gone});
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

// A NaN weight is reported with the source file, the tensor, the tile, the row and the column.
TEST(TensorErrors, FitErrorsNameTheSourceFile) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
  const fs::path file = t.path / "in" / "model.safetensors";
  const std::string n = "model.layers.0.mlp.experts.1.down_proj.weight";  // [128, 64] BF16
  const std::uint16_t nan = 0x7fc0;
  poke_bytes(file, n, (100 * 64 + 3) * 2, &nan, 2);  // row 100 col 3: tile (12, 0)
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); }),
            file.string() + ": tensor " + n + ", tile (12, 0): NaN at row 100 col 3; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "out"));
  EXPECT_EQ(error_of<std::invalid_argument>(
                [&] { quantize_file(file, t.path / "out.safetensors", "down_proj", quiet()); }),
            file.string() + ": tensor " + n + ", tile (12, 0): NaN at row 100 col 3; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "out.safetensors"));
}

// The online fit of Checkpoint::lutb_experts(L, fit) on a BF16 checkpoint reports a bad weight in the stored
// tensor of its file, not in the fused stack ("model.layers.0.mlp w13").
TEST(TensorErrors, OnlineFitOfACheckpointNamesTheStoredTensor) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
  const fs::path file = t.path / "in" / "model.safetensors";
  const std::uint16_t nan = 0x7fc0, big = 0x7f7f;  // NaN; 3.3895314e+38 (needs a scale byte above 246)
  poke_bytes(file, "model.layers.0.mlp.experts.3.down_proj.weight", (7 * 64 + 9) * 2, &big, 2);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { Checkpoint(t.path / "in").lutb_experts(0); }),
            file.string() +
                ": tensor model.layers.0.mlp.experts.3.down_proj.weight (layer 0, expert 3), row 7 col 9: magnitude "
                "3.3895314e+38 needs a scale byte above 246 (spec section 2); it cannot be quantised to LUT-B");
  poke_bytes(file, "model.layers.0.mlp.experts.1.up_proj.weight", (5 * 128 + 7) * 2, &nan, 2);  // w13 row 69
  EXPECT_EQ(error_of<std::invalid_argument>([&] { Checkpoint(t.path / "in").lutb_experts(0); }),
            file.string() +
                ": tensor model.layers.0.mlp.experts.1.up_proj.weight (layer 0, expert 1), row 5 col 7: NaN; a "
                "non-finite weight cannot be quantised to LUT-B (spec 2.1)");
  EXPECT_EQ(Checkpoint(t.path / "in").expert_location(0, true, 2, 3, 4),
            file.string() + ": tensor model.layers.0.mlp.experts.2.gate_proj.weight (layer 0, expert 2), row 3 col 4");
}

// An F64 weight beyond the FP32 range is reported with its magnitude, not as the +Inf it would become when
// narrowed for the fitter; a huge FP32-range magnitude is printed readably, not with 39 digits and ".000000".
TEST(TensorErrors, F64BeyondFp32IsReportedWithItsMagnitude) {
  TempDir t;
  const fs::path in = t.path / "w.safetensors";
  std::vector<double> v(2 * 16 * 128, 0.5);
  v[1 * 16 * 128 + 9 * 128 + 70] = -1e300;  // expert 1, row 9, col 70: tile (1, 1)
  write_safetensors(in, {{"w", OwnedTensor{DType::F64, {2, 16, 128}, f64_bytes(v)}}});
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize_file(in, t.path / "o.safetensors", "", quiet()); }),
            in.string() +
                ": tensor w, expert 1, tile (1, 1): magnitude 1e+300 at row 9 col 70 needs a scale byte above 246 "
                "(spec section 2; it is beyond the FP32 range, the fitters read F64 weights as F32); nothing written");
  // Within the FP32 range but too large for a scale byte of 246: the fitter's message, readable, with
  // the row and column as above, not the tile only.
  v[1 * 16 * 128 + 9 * 128 + 70] = 3.3e38;
  write_safetensors(in, {{"w", OwnedTensor{DType::F64, {2, 16, 128}, f64_bytes(v)}}});
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize_file(in, t.path / "o.safetensors", "", quiet()); }),
            in.string() +
                ": tensor w, expert 1, tile (1, 1): magnitude 3.3e+38 at row 9 col 70 needs a scale byte above 246 "
                "(spec section 2); nothing written");
  EXPECT_FALSE(fs::exists(t.path / "o.safetensors"));

  // Loading F64 experts (lutb eval / moe read them as FP32): refused by name, not turned into Inf.
  synthesize_checkpoint(t.path / "ck", small_synth());
  const std::string g = "model.layers.0.mlp.experts.0.gate_proj.weight";  // [64, 128]
  std::vector<double> w(64 * 128, 0.01);
  w[5 * 128 + 7] = 1e39;
  replace_tensor(t.path / "ck" / "model.safetensors", g, DType::F64, f64_bytes(w));
  EXPECT_EQ(error_of<CheckpointError>([&] { Checkpoint(t.path / "ck").experts_source(0); }),
            (t.path / "ck" / "model.safetensors").string() + ": tensor " + g +
                " (F64) holds 1e+39 at [5, 7], beyond the FP32 range lutb computes in (largest magnitude about "
                "3.4e+38)");
}

// A stored weight_scale byte of 254 (valid UE8M0, but 448 * 2^127 is beyond FP32) is refused at load, naming
// the tensor: loaded, it would give a NaN loss naming no tensor.
TEST(TensorErrors, StoredScaleWhoseWeightsOverflowFp32IsRefused) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
  quantize_checkpoint(t.path / "in", t.path / "q", quiet());
  const fs::path file = t.path / "q" / "model.safetensors";
  const std::string s = "model.layers.0.mlp.experts.2.up_proj.weight_scale";  // [8, 2]
  const std::uint8_t b254 = 254;
  poke_bytes(file, s, 3, &b254, 1);  // tile [1, 1]
  const std::string e = error_of<FormatError>([&] { Checkpoint(t.path / "q").lutb_experts(0); });
  EXPECT_TRUE(has(e, file.string() + ": tensor " + s + " (layer 0, expert 2): tile [1, 1] (tile row 1, tile column 1) "
                                                     "has scale byte 254, and its codebook entry "))
      << e;
  EXPECT_TRUE(has(e, "times 2^127 is beyond the FP32 range: the weights would be infinite (fitters write scale bytes "
                     "3..246, spec 2); the checkpoint is corrupt"))
      << e;
  // A scale byte above 246 whose weights stay finite (small_synth codebook entries) is valid UE8M0: read.
  const std::string c = "model.layers.0.mlp.experts.2.up_proj.weight_codebook";  // [8, 2, 8]
  const std::uint8_t small_entries[8] = {0x08, 0x08, 0x08, 0x08, 0x08, 0x08, 0x08, 0x08};  // 2^-6 each
  poke_bytes(file, c, 3 * 8, small_entries, 8);
  const ExpertsLutb x = Checkpoint(t.path / "q").lutb_experts(0);
  EXPECT_EQ(x.w13.scale[static_cast<std::size_t>(2 * 16 * 2 + 8 * 2 + 3)], 254);  // expert 2, up rows 64.., tile [1, 1]
}

// Quantising a per-expert checkpoint of expert width 12 warns that lutb eval / moe cannot run the result (gate
// and up padded separately cannot form [2I, H] tiles).
TEST(TensorErrors, PerExpertWidthNotAMultipleOf8Warns) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth(12));
  const QuantizeSummary s = quantize_checkpoint(t.path / "in", t.path / "out", quiet());
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_EQ(s.warnings[0],
            (t.path / "out").string() + ": the expert width moe_intermediate_size 12 of " +
                (t.path / "in" / "config.json").string() +
                " is not a multiple of 8 and the experts are stored per expert (e.g. "
                "model.layers.0.mlp.experts.0.gate_proj.weight): each LUT-B gate and up tensor is padded to 16 rows, "
                "a valid LUT-B checkpoint (spec 2.2), but lutb eval and lutb moe cannot run it (they run an expert's "
                "gate and up as one [2I, H] matrix of 8-row tiles). To run LUT-B weights of this model with lutb, "
                "quantise a checkpoint with stacked experts (gate_up_proj [E, 2I, H]) or run the BF16 checkpoint "
                "with --quant lutb");
  EXPECT_TRUE(fs::exists(t.path / "out" / "model.safetensors"));  // still written: it is valid LUT-B
  // Stacked experts of the same width, and per-expert ones of width 64: nothing to warn about.
  synthesize_checkpoint(t.path / "st", small_synth(12, true));
  EXPECT_TRUE(quantize_checkpoint(t.path / "st", t.path / "st_out", quiet()).warnings.empty());
  synthesize_checkpoint(t.path / "w64", small_synth(64));
  EXPECT_TRUE(quantize_checkpoint(t.path / "w64", t.path / "w64_out", quiet()).warnings.empty());
}

// Re-quantising a LUT-B file is refused as LUT-B, saying what to do, in file and in checkpoint mode; naming
// its float tensors with --match is allowed, and the result is refused as LUT-B in turn.
TEST(TensorErrors, RequantisingALutbFileSaysItIsLutb) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
  quantize_checkpoint(t.path / "in", t.path / "q", quiet());
  const fs::path f = t.path / "q" / "model.safetensors";
  const std::string x0 = "model.layers.0.mlp.experts.0.down_proj.weight";
  const std::string example =
      x0 + "_packed with " + x0 + "_codebook and " + x0 + "_scale, and 11 more LUT-B weights";
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_file(f, t.path / "a.safetensors", "", quiet()); }),
            f.string() + ": the file already holds LUT-B tensors (" + example +
                "); --all (the default without --match) would quantise its 1 remaining float tensor too (e.g. "
                "model.layers.0.mlp.gate.weight), which a LUT-B checkpoint keeps unquantised. To quantise some of "
                "them, name them with --match REGEX; to quantise anew, start from the original float file; nothing "
                "written");
  const std::string x1 = "model.layers.0.mlp.experts.1.down_proj.weight";
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_file(f, t.path / "a.safetensors", "experts\\.1\\.down", quiet()); }),
            f.string() + ": tensor " + x1 + "_packed matches --match \"experts\\.1\\.down\" but is already LUT-B (part of "
                "the quantised weight " + x1 + ": " + x1 + "_packed, " + x1 + "_codebook, " + x1 +
                "_scale) and cannot be quantised again; to quantise " + x1 +
                " anew (e.g. with another --fitter), start from the original float file; to quantise other tensors, "
                "narrow --match; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "a.safetensors"));
  // Naming the float tensors is allowed; the result holds nothing but LUT-B tensors, and is then
  // refused as such.
  quantize_file(f, t.path / "b.safetensors", "gate\\.weight$", quiet());
  EXPECT_TRUE(SafetensorsFile(t.path / "b.safetensors").contains("model.layers.0.mlp.gate.weight_packed"));
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_file(t.path / "b.safetensors", t.path / "c.safetensors", "", quiet()); }),
            (t.path / "b.safetensors").string() + ": the file is already LUT-B (" + x0 + "_packed with " + x0 +
                "_codebook and " + x0 +
                "_scale, and 12 more LUT-B weights) and holds no float tensor left to quantise; nothing to do: to "
                "quantise anew (e.g. with another --fitter), start from the original float file; nothing written");
  // Checkpoint mode says what to do too.
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "q", t.path / "qq", quiet()); }),
            (t.path / "q").string() + ": the checkpoint is already LUT-B (" + (t.path / "q" / "config.json").string() +
                " has a LUT-B quantization_config); nothing to do: to quantise again (e.g. with another --fitter), "
                "start from the original BF16 checkpoint; nothing written");
}

// A per-expert LUT-B checkpoint with moe_intermediate_size % 8 != 0 cannot be run (gate and up are padded to
// whole tiles separately). The error names the file, the stored tensor, the layer, the reason and what to do,
// never a library function; the remedies it names work.
TEST(TensorErrors, PerExpertLutbWithWidthNotAMultipleOf8) {
  TempDir t;
  synthesize_checkpoint(t.path / "bf16", small_synth_layers(1, 100));
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
  SynthOptions st = small_synth_layers(1, 100);
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

// Bad stored LUT-B data is reported against the tensor as stored, not the internal stacks: the file, the
// tensor, the layer (and expert), the tile in that tensor's grid and the reason; a wrong dtype names the file
// and the layer.
TEST(TensorErrors, StoredLutbErrorsNameFileTensorLayerAndTile) {
  TempDir t;
  synthesize_checkpoint(t.path / "bf16", small_synth_layers(2));
  quantize_checkpoint(t.path / "bf16", t.path / "lutb", quiet());
  // Layer 1 lives in the second shard. Expert 2's up_proj codebook, tile row 3, tile column 1
  // ([64, 128] = 8 x 2 tiles): entry 5 becomes 0x7F (E4M3 NaN).
  const fs::path shard = t.path / "lutb" / "model-00002-of-00002.safetensors";
  poke_byte(shard, "model.layers.1.mlp.experts.2.up_proj.weight_codebook", (3 * 2 + 1) * 8 + 5, 0x7F);
  const std::string e = error_of<FormatError>([&] { Checkpoint(t.path / "lutb").lutb_experts(1); });
  EXPECT_EQ(e, shard.string() +
                   ": tensor model.layers.1.mlp.experts.2.up_proj.weight_codebook (layer 1, expert 2): tile [3, 1] (tile "
                   "row 3, tile column 1) has a NaN codebook entry (entry 5, byte 0x7F); E4M3 codebook bytes 0x7F and "
                   "0xFF are NaN and invalid in LUT-B (spec 2)");
  // A stacked checkpoint: down_proj [E, H, I] = [4, 128, 64] has 16 x 1 tiles per expert; expert 1,
  // tile row 9 gets scale 255.
  SynthOptions st = small_synth_layers(1);
  st.stacked = true;
  synthesize_checkpoint(t.path / "bf16s", st);
  quantize_checkpoint(t.path / "bf16s", t.path / "lutbs", quiet());
  const fs::path file = t.path / "lutbs" / "model.safetensors";
  poke_byte(file, "model.layers.0.mlp.experts.down_proj_scale", 1 * 16 + 9, 255);
  const std::string s = error_of<FormatError>([&] { Checkpoint(t.path / "lutbs").lutb_experts(0); });
  EXPECT_EQ(s, file.string() +
                   ": tensor model.layers.0.mlp.experts.down_proj_scale (layer 0): tile [1, 9, 0] (expert 1, tile row 9, "
                   "tile column 0) has scale byte 255, which is UE8M0 NaN and invalid in LUT-B (spec 2)");
  // A stored tensor of the wrong dtype: the file and layer are named.
  synthesize_checkpoint(t.path / "bf16d", small_synth_layers(1));
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

// A folder without model.safetensors is refused naming what is missing, never read as if every *.safetensors
// held weights (val_tokens.safetensors and moe_activations.safetensors both hold "input_ids"); shards without
// their index, or with one missing, are refused too.
TEST(TensorErrors, FolderWithoutModelSafetensors) {
  TempDir t;
  const OwnedTensor ids{DType::I32, {2}, std::vector<std::uint8_t>(8, 1)};
  // Only config.json and the data files.
  synthesize_checkpoint(t.path / "m", small_synth_layers(1));
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
  synthesize_checkpoint(t.path / "s", small_synth_layers(3));
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
  synthesize_checkpoint(t.path / "d", small_synth_layers(1));
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

// ExpertMap::is_local checks its index (std::out_of_range naming the id and the range, never an unchecked
// read); FitOptions::threads < 0 is refused wherever a fit starts.
TEST(TensorErrors, ExpertMapIsLocalIsCheckedAndNegativeThreadsAreRefused) {
  const moe::ExpertMap m = moe::ExpertMap::linear(8, 1, 2);
  EXPECT_FALSE(m.is_local(0));
  EXPECT_TRUE(m.is_local(4));
  EXPECT_EQ(error_of<std::out_of_range>([&] { (void)m.is_local(8); }), "ExpertMap::is_local: expert id 8 is outside 0..7");
  EXPECT_EQ(error_of<std::out_of_range>([&] { (void)m.is_local(-1); }), "ExpertMap::is_local: expert id -1 is outside 0..7");
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth_layers(1));
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
