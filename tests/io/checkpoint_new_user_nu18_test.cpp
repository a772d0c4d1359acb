// Defects a fresh new user found in session 18 (helper nu18) on damaged and unusual checkpoints.
// Each test failed on the code before its fix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
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

QuantizeOptions quiet() {
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  return q;
}

// A two-layer synthetic checkpoint (one shard per layer, with model.safetensors.index.json):
// hidden 128, expert width 64, 4 experts.
fs::path two_shard_checkpoint(const fs::path& dir) {
  SynthOptions o;
  o.layers = 2;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 4;
  o.progress = false;
  synthesize_checkpoint(dir, o);
  return dir;
}

nlohmann::json read_json(const fs::path& p) {
  nlohmann::json j;
  std::ifstream(p) >> j;
  return j;
}

void write_json(const fs::path& p, const nlohmann::json& j) {
  fs::remove(p);
  std::ofstream(p) << j.dump(2);
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

// Rewrites the safetensors file `file` with one more tensor `name` (BF16 [2, 2], zeros).
void add_tensor(const fs::path& file, const std::string& name) {
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  {
    const SafetensorsFile f(file);
    for (const auto& n : f.names()) {
      const TensorView& v = f.get(n);
      ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
  }
  ts.push_back({name, OwnedTensor{DType::BF16, {2, 2}, std::vector<std::uint8_t>(8, 0)}});
  write_safetensors(file, ts);
}

// lutb quantize read every tensor of every shard, ignoring the index: a routed expert that
// model.safetensors.index.json leaves out (which lutb eval and lutb moe do not read: "tensor ... not
// found; SHARD holds it, but the weight_map does not list it") was quantised, and the output's index
// listed it, exit status 0: an input eval refused became a checkpoint eval ran, without a word. Now
// quantize refuses it as eval does, naming the shard; a stray tensor the index leaves out is not
// copied, with a warning.
TEST(CheckpointNewUserNu18, QuantizeReadsOnlyTheTensorsTheIndexLists) {
  TempDir t;
  const fs::path dir = two_shard_checkpoint(t.path / "m");
  const std::string up = "model.layers.1.mlp.experts.3.up_proj.weight";
  const fs::path shard = unlist(dir, up);
  const fs::path index = dir / "model.safetensors.index.json";
  ASSERT_TRUE(SafetensorsFile(shard).contains(up));
  EXPECT_EQ(error_of([&] { (void)quantize_checkpoint(dir, t.path / "q", quiet()); }),
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
  add_tensor(shard2, "model.stray.weight");
  const QuantizeSummary s = quantize_checkpoint(dir2, t.path / "q2", quiet());
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

// A LUT-B checkpoint whose config.json lost its quantization_config: lutb quantize said only
// "checkpoint DIR: no routed-expert tensors found (expected names like ...)", naming neither the LUT-B
// tensors it had found nor the missing key (new-user QA sessions 17-18).
TEST(CheckpointNewUserNu18, QuantizeNamesLutbTensorsWithoutTheirConfig) {
  TempDir t;
  SynthOptions o;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 2;
  o.progress = false;
  synthesize_checkpoint(t.path / "bf16", o);
  (void)quantize_checkpoint(t.path / "bf16", t.path / "lutb", quiet());
  nlohmann::json cfg = read_json(t.path / "lutb" / "config.json");
  ASSERT_TRUE(cfg.contains("quantization_config"));
  cfg.erase("quantization_config");
  write_json(t.path / "lutb" / "config.json", cfg);
  const fs::path in = t.path / "lutb";
  EXPECT_EQ(error_of([&] { (void)quantize_checkpoint(in, t.path / "again", quiet()); }),
            in.string() +
                ": the checkpoint is already LUT-B: it holds LUT-B routed-expert tensors "
                "(model.layers.0.mlp.experts.0.down_proj.weight_packed in " +
                (in / "model.safetensors").string() + ") and no float ones, but " + (in / "config.json").string() +
                " has no LUT-B quantization_config (the \"quantization_config\" with \"quant_method\": \"lut_b\" that "
                "says how to read them, spec 2.2): restore the config.json written with these weights to run them; to "
                "quantise, start from the original BF16 checkpoint; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "again"));
}

// quantize copied reference_eval.json (transformers' held-out loss of the BF16 weights, spec section
// 8) into the LUT-B checkpoint, where it read as the reference of weights it does not describe: not
// copied now, and listed. val_tokens.safetensors and the captured activations are still copied (eval
// and moe read them from the output folder).
TEST(CheckpointNewUserNu18, QuantizeDoesNotCopyTheSourceReferenceLosses) {
  TempDir t;
  SynthOptions o;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 2;
  o.progress = false;
  synthesize_checkpoint(t.path / "m", o);
  std::ofstream(t.path / "m" / "reference_eval.json") << "{\"val_loss_fp32_compute\": 3.97}";
  std::ofstream(t.path / "m" / "tokenizer.json") << "{}";
  write_safetensors(t.path / "m" / "val_tokens.safetensors",
                    {{"input_ids", OwnedTensor{DType::I32, {2}, std::vector<std::uint8_t>(8, 1)}}});
  const QuantizeSummary s = quantize_checkpoint(t.path / "m", t.path / "q", quiet());
  EXPECT_EQ(s.skipped_files, std::vector<std::string>{"reference_eval.json"});
  EXPECT_FALSE(fs::exists(t.path / "q" / "reference_eval.json"));
  EXPECT_TRUE(fs::exists(t.path / "q" / "tokenizer.json"));
  EXPECT_TRUE(fs::exists(t.path / "q" / "val_tokens.safetensors"));
  EXPECT_NE(format_summary(s).find("not copied           reference_eval.json (the source weights' reference losses, "
                                   "spec section 8)\n"),
            std::string::npos)
      << format_summary(s);
}

// The free-space check of file mode (quantize IN.safetensors -o OUT.safetensors) was untested, and
// its message said "the checkpoint needs" of a single file. A 1-D tensor of 2^40 F32 values in a
// sparse input file (4 TiB, copied unquantised) makes the output larger than the disk.
TEST(CheckpointNewUserNu18, QuantizeFileChecksFreeSpaceFirst) {
  TempDir t;
  const fs::path in = t.path / "in.safetensors";
  const std::uint64_t big = std::uint64_t{1} << 42;  // bytes of the 1-D F32 tensor
  {
    const std::string header = "{\"a.weight\":{\"dtype\":\"BF16\",\"shape\":[8,64],\"data_offsets\":[0,1024]},"
                               "\"b.bias\":{\"dtype\":\"F32\",\"shape\":[" +
                               std::to_string(big / 4) + "],\"data_offsets\":[1024," + std::to_string(1024 + big) +
                               "]}}";
    std::string padded = header;
    padded.resize((header.size() + 7) / 8 * 8, ' ');
    std::ofstream f(in, std::ios::binary);
    const std::uint64_t n = padded.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(padded.data(), static_cast<std::streamsize>(padded.size()));
    const std::vector<char> w(1024, 0x3c);  // BF16 1.171875: a finite, fittable tile
    f.write(w.data(), static_cast<std::streamsize>(w.size()));
  }
  std::error_code ec;
  fs::resize_file(in, fs::file_size(in) + big, ec);
  if (ec) GTEST_SKIP() << "this filesystem holds no sparse 4 TiB file: " << ec.message();
  if (fs::space(t.path).available > big) GTEST_SKIP() << "more than 4 TiB free here";
  const fs::path out = t.path / "sub" / "out.safetensors";  // its parent is missing: not created either
  const std::string e = error_of([&] { (void)quantize_file(in, out, "", quiet()); });
  EXPECT_EQ(e.rfind(out.string() + ": the output file needs 4.40 TB (", 0), 0u) << e;
  EXPECT_NE(e.find("are free on the filesystem of " + t.path.string() + "; nothing written"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(t.path / "sub"));
  EXPECT_EQ(std::distance(fs::directory_iterator(t.path), fs::directory_iterator()), 1);  // only the input
}

// A NUL byte ends nlohmann's input: a header "{...}\0<anything>" parsed as "{...}" and the rest was
// ignored, a file the reference reader refuses (serde_json: trailing characters). Refused, naming
// the offset; spaces remain the header's padding.
TEST(CheckpointNewUserNu18, HeaderWithANulByteIsRefused) {
  TempDir t;
  const std::string json = "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}";
  const auto write = [&](const fs::path& p, const std::string& header) {
    std::ofstream f(p, std::ios::binary);
    const std::uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(header.data(), static_cast<std::streamsize>(header.size()));
    f.write("\x01\x02", 2);
  };
  write(t.path / "spaces.safetensors", json + "      ");
  EXPECT_EQ(SafetensorsFile(t.path / "spaces.safetensors").get("a").nbytes, 2u);
  write(t.path / "nul.safetensors", json + std::string("\0\0  xy", 6));
  EXPECT_EQ(error_of([&] { SafetensorsFile f(t.path / "nul.safetensors"); }),
            (t.path / "nul.safetensors").string() + ": header holds a NUL byte at offset " +
                std::to_string(json.size()) + " of its " + std::to_string(json.size() + 6) +
                " bytes: a safetensors header is UTF-8 JSON text, padded with spaces only (a corrupt or truncated "
                "header?)");
}

}  // namespace
}  // namespace lutb
