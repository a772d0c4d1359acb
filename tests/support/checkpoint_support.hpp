// Checkpoints for the tests: small synthetic ones, writable copies of the shared models, and edits of
// their files in place (config.json, a safetensors header, a tensor's bytes).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb::test {

/// QuantizeOptions that print no progress; the fit uses every processor.
inline QuantizeOptions quiet() {
  QuantizeOptions q;
  q.progress = false;
  return q;
}

/// quiet() with a one-thread fit.
inline QuantizeOptions quiet_one_thread() {
  QuantizeOptions q = quiet();
  q.fit.threads = 1;
  return q;
}

/// A synthetic qwen3_moe checkpoint of `layers` MoE layers of `experts` experts of width `width` at hidden
/// size `hidden`, per expert; no progress display.
inline SynthOptions synth_options(std::int64_t hidden, std::int64_t width, std::int64_t experts,
                                  std::int64_t layers = 1) {
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = layers;
  o.hidden_size = hidden;
  o.moe_intermediate_size = width;
  o.num_experts = experts;
  o.progress = false;
  return o;
}

/// A small synthetic qwen3_moe checkpoint: hidden 128, 4 experts of width `width`, `layers` MoE
/// layers, stacked (transformers-5 gate_up_proj / down_proj) or per expert; no progress display.
inline SynthOptions small_synth(std::int64_t width = 64, bool stacked = false, std::int64_t layers = 1) {
  SynthOptions o = synth_options(128, width, 4, layers);
  o.stacked = stacked;
  return o;
}

/// The smallest synthetic checkpoint the tests use: one qwen3_moe layer, hidden 64, 2 experts of width
/// 32; no progress display.
inline SynthOptions tiny_synth() { return synth_options(64, 32, 2); }

/// small_synth() with `layers` layers, per expert.
inline SynthOptions small_synth_layers(std::int64_t layers = 1, std::int64_t width = 64) {
  return small_synth(width, false, layers);
}

/// Writes small_synth_layers(layers) to `dir`; returns `dir`.
inline std::filesystem::path small_checkpoint(const std::filesystem::path& dir, std::int64_t layers = 1) {
  synthesize_checkpoint(dir, small_synth_layers(layers));
  return dir;
}

/// small_checkpoint() of two layers: one shard per layer, with model.safetensors.index.json.
inline std::filesystem::path two_shard_checkpoint(const std::filesystem::path& dir) { return small_checkpoint(dir, 2); }

/// A copy of the tensor `v` views (dtype, shape, bytes).
inline OwnedTensor owned(const TensorView& v) {
  return OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)};
}

/// A BF16 [2, 2] tensor of zeros: a stray tensor to add to a checkpoint.
inline OwnedTensor bf16_zeros_2x2() { return OwnedTensor{DType::BF16, {2, 2}, std::vector<std::uint8_t>(8, 0)}; }

/// Rewrites safetensors file `file` (its metadata kept) without the tensors named in `drop` and with
/// `add` appended.
inline void rewrite_safetensors(const std::filesystem::path& file, const std::vector<std::string>& drop,
                                const std::vector<std::pair<std::string, OwnedTensor>>& add = {}) {
  std::vector<std::pair<std::string, OwnedTensor>> keep;
  std::map<std::string, std::string> metadata;
  {
    const SafetensorsFile f(file);
    metadata = f.metadata();
    for (const auto& n : f.names())
      if (std::find(drop.begin(), drop.end(), n) == drop.end()) keep.push_back({n, owned(f.get(n))});
  }
  keep.insert(keep.end(), add.begin(), add.end());
  write_safetensors(file, keep, metadata);
}

/// Rewrites safetensors file `file` with tensor `name` holding `bytes` of `dtype` (its shape and place kept).
inline void replace_tensor(const std::filesystem::path& file, const std::string& name, DType dtype,
                           std::vector<std::uint8_t> bytes) {
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  std::map<std::string, std::string> metadata;
  {
    const SafetensorsFile f(file);
    metadata = f.metadata();
    for (const auto& n : f.names()) {
      if (n == name) ts.push_back({n, OwnedTensor{dtype, f.get(n).shape, bytes}});
      else ts.push_back({n, owned(f.get(n))});
    }
  }
  write_safetensors(file, ts, metadata);
}

/// Rewrites the shards of checkpoint `dir` as one model.safetensors (no index) without tensor `drop`.
inline void merge_without(const std::filesystem::path& dir, const std::string& drop) {
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  std::vector<std::filesystem::path> shards;
  {
    const SafetensorsCollection c = SafetensorsCollection::open_dir(dir);
    for (const auto& n : c.names())
      if (n != drop) ts.push_back({n, owned(c.get(n))});
    for (const auto& f : c.files()) shards.push_back(f->path());
  }
  for (const auto& s : shards) std::filesystem::remove(s);
  std::filesystem::remove(dir / "model.safetensors.index.json");
  write_safetensors(dir / "model.safetensors", ts);
}

/// The names in folder `d` that start with `prefix` (every name by default), sorted.
inline std::vector<std::string> entries(const std::filesystem::path& d, const std::string& prefix = "") {
  std::vector<std::string> v;
  for (const auto& e : std::filesystem::directory_iterator(d)) {
    std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) v.push_back(std::move(name));
  }
  std::sort(v.begin(), v.end());
  return v;
}

inline nlohmann::json read_json(const std::filesystem::path& p) {
  nlohmann::json j;
  std::ifstream(p) >> j;
  return j;
}

/// Replaces file `p` (a link included: the link itself) by `j`, indented.
inline void write_json(const std::filesystem::path& p, const nlohmann::json& j) {
  std::filesystem::remove(p);
  std::ofstream(p) << j.dump(2);
}

/// Edits `dir`/config.json in place.
inline void edit_config(const std::filesystem::path& dir, const std::function<void(nlohmann::json&)>& f) {
  nlohmann::json j;
  {
    std::ifstream in(dir / "config.json");
    in >> j;
  }
  f(j);
  std::ofstream(dir / "config.json") << j.dump(2);
}

/// Rewrites the header of a safetensors file in place (its length kept: padded with spaces).
inline void edit_header(const std::filesystem::path& file, const std::function<void(nlohmann::json&)>& edit) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t hn = 0;
  f.read(reinterpret_cast<char*>(&hn), 8);
  std::string header(hn, '\0');
  f.read(header.data(), static_cast<std::streamsize>(hn));
  auto j = nlohmann::json::parse(header);
  edit(j);
  std::string out = j.dump();
  ASSERT_LE(out.size(), hn);
  out.resize(hn, ' ');
  f.seekp(8);
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
}

/// Overwrites `n` bytes of tensor `name`'s data in safetensors file `file`, from byte `offset` of it.
inline void poke_bytes(const std::filesystem::path& file, const std::string& name, std::size_t offset,
                       const void* bytes, std::size_t n) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t hn = 0;
  f.read(reinterpret_cast<char*>(&hn), 8);
  std::string header(hn, '\0');
  f.read(header.data(), static_cast<std::streamsize>(hn));
  const auto j = nlohmann::json::parse(header);
  f.seekp(static_cast<std::streamoff>(8 + hn + j.at(name).at("data_offsets")[0].get<std::uint64_t>() + offset));
  f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
}

/// Overwrites element `index` (of `bytes` bytes) of tensor `name` with `value`.
inline void poke(const std::filesystem::path& file, const std::string& name, std::int64_t index, const void* value,
                 std::size_t bytes) {
  poke_bytes(file, name, static_cast<std::size_t>(index) * bytes, value, bytes);
}

/// Overwrites BF16 element `index` of tensor `name` with the bit pattern `bits`.
inline void poke_bf16(const std::filesystem::path& file, const std::string& name, std::int64_t index,
                      std::uint16_t bits) {
  poke(file, name, index, &bits, 2);
}

/// Captured activations for `lutb moe`: layers.L.moe_input / moe_output, FP32 [T, H], random (the tests
/// that use them check that the block runs, not its error).
inline void write_activations(const std::filesystem::path& file, int layer, std::int64_t T, std::int64_t H) {
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto make = [&] {
    std::vector<float> v(static_cast<std::size_t>(T * H));
    for (float& x : v) x = nd(rng);
    std::vector<std::uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return OwnedTensor{DType::F32, {T, H}, std::move(b)};
  };
  write_safetensors(file, {{"layers." + std::to_string(layer) + ".moe_input", make()},
                           {"layers." + std::to_string(layer) + ".moe_output", make()}});
}

/// Captured activations for `lutb moe`: layers.L.moe_input / moe_output, F32 [4, H], for L < layers.
inline void write_activations_of_layers(const std::filesystem::path& file, std::int64_t H, int layers) {
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  std::vector<float> x(static_cast<std::size_t>(4 * H));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 37) % 17) / 8.0f - 1.0f;
  std::vector<std::uint8_t> bytes(x.size() * 4);
  std::memcpy(bytes.data(), x.data(), bytes.size());
  for (int l = 0; l < layers; ++l) {
    ts.push_back({"layers." + std::to_string(l) + ".moe_input", OwnedTensor{DType::F32, {4, H}, bytes}});
    ts.push_back({"layers." + std::to_string(l) + ".moe_output", OwnedTensor{DType::F32, {4, H}, bytes}});
  }
  write_safetensors(file, ts);
}

/// A writable copy of a shared model folder (the files the commands read).
inline std::filesystem::path copy_model(const std::filesystem::path& src, const std::filesystem::path& dst) {
  namespace fs = std::filesystem;
  fs::create_directories(dst);
  for (const char* f : {"config.json", "model.safetensors", "val_tokens.safetensors", "moe_activations.safetensors"}) {
    if (!fs::exists(src / f)) continue;
    fs::copy_file(src / f, dst / f);
    fs::permissions(dst / f, fs::perms::owner_read | fs::perms::owner_write);
  }
  return dst;
}

/// A folder of symbolic links to the files of shared model `model`, with config.json patched.
inline std::filesystem::path patched_model(const std::filesystem::path& dir, const std::filesystem::path& model,
                                           const nlohmann::json& patch) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(model))
    if (e.path().filename() != "config.json") fs::create_symlink(e.path(), dir / e.path().filename());
  nlohmann::json j;
  std::ifstream(model / "config.json") >> j;
  if (patch.is_object()) j.merge_patch(patch);
  std::ofstream(dir / "config.json") << j.dump(2);
  return dir;
}

/// A copy of shared model `model` in `dir` (config.json and model.safetensors copied, the other files
/// linked) whose model.safetensors lacks the tensors in `drop` and gains those in `add`.
inline std::filesystem::path edited_model(const std::filesystem::path& dir, const std::filesystem::path& model,
                                          const std::vector<std::string>& drop,
                                          std::vector<std::pair<std::string, OwnedTensor>> add = {}) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  for (const auto& e : fs::directory_iterator(model)) {
    const std::string name = e.path().filename().string();
    if (name == "model.safetensors") continue;
    if (name == "config.json") fs::copy_file(e.path(), dir / name);
    else fs::create_symlink(e.path(), dir / name);
  }
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  {
    const SafetensorsFile f(model / "model.safetensors");
    for (const auto& n : f.names()) {
      if (std::find(drop.begin(), drop.end(), n) != drop.end()) continue;
      const TensorView& v = f.get(n);
      ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
  }
  for (auto& t : add) ts.push_back(std::move(t));
  write_safetensors(dir / "model.safetensors", ts);
  return dir;
}

/// A writable copy of the shared tiny-mixtral (empty `m` when the model is absent: see MIXTRAL_OR_SKIP).
struct Mixtral {
  Mixtral() {
    const auto src = model_dir("tiny-mixtral");
    if (src) m = copy_model(*src, t.path / "m");
  }
  TempDir t;
  std::filesystem::path m;
  std::filesystem::path st() const { return m / "model.safetensors"; }
};

}  // namespace lutb::test

/// Binds `x` to a writable tiny-mixtral copy (lutb::test::Mixtral); skips the test when it is absent.
#define MIXTRAL_OR_SKIP(x)   \
  ::lutb::test::Mixtral x;   \
  if (x.m.empty()) GTEST_SKIP() << "model tiny-mixtral absent (../shared/models): skipping"
