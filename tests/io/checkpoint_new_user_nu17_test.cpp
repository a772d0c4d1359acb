// Defects a fresh new user found in session 17 (helper nu17) on damaged and unusual checkpoints.
// Each test failed on the code before its fix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
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

// Rewrites the header of a safetensors file in place (its length kept: padded with spaces).
void edit_header(const fs::path& file, const std::function<void(nlohmann::json&)>& edit) {
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

// The shard that holds `tensor`, from the checkpoint's index (the oracle: not the loader's code).
fs::path shard_of(const fs::path& dir, const std::string& tensor) {
  nlohmann::json idx;
  std::ifstream(dir / "model.safetensors.index.json") >> idx;
  return dir / idx.at("weight_map").at(tensor).get<std::string>();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// A routed expert of the wrong dtype or shape in the second shard: the errors of lutb eval / moe
// (Checkpoint::experts_source) named the checkpoint folder ("checkpoint DIR: tensor ... has dtype
// I16"), and lutb quantize's dtype error did too, so the user had to search the shards; the shape
// error did not say where the expected shape came from.
TEST(CheckpointNewUserNu17, DtypeAndShapeErrorsNameTheShard) {
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

// The router of the wrong shape: the error named the folder and not where [E, H] came from.
TEST(CheckpointNewUserNu17, RouterShapeErrorNamesTheShardAndTheConfig) {
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

// A checkpoint saved mid-training (transformers' Trainer, Accelerate, DeepSpeed) carries its training
// state beside the weights. lutb quantize copied all of it into the LUT-B output: an optimizer.pt is
// about twice the size of the weights. It is now left out and listed; trainer_state.json (the
// training log) and the tokenizer are still copied.
TEST(CheckpointNewUserNu17, TrainingStateIsNotCopied) {
  TempDir t;
  SynthOptions o;
  o.hidden_size = 64;
  o.moe_intermediate_size = 32;
  o.num_experts = 2;
  o.progress = false;
  const fs::path in = t.path / "checkpoint-500";
  synthesize_checkpoint(in, o);
  const std::vector<std::string> state = {"optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth",
                                          "rng_state_3.pth", "training_args.bin", "optimizer.bin",
                                          "optimizer_1.bin", "scheduler.bin", "random_states_0.pkl"};
  const std::vector<std::string> kept = {"trainer_state.json", "tokenizer.json", "global_stepX/notes.txt",
                                         "scheduler_notes.txt"};
  for (const auto& f : state) std::ofstream(in / f) << "state";
  fs::create_directories(in / "global_step500");
  std::ofstream(in / "global_step500" / "mp_rank_00_model_states.pt") << "zero";
  fs::create_directories(in / "global_stepX");
  for (const auto& f : kept) std::ofstream(in / f) << "{}";

  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  const QuantizeSummary s = quantize_checkpoint(in, t.path / "out", q);
  std::vector<std::string> want = state;
  want.push_back("global_step500/");
  std::sort(want.begin(), want.end());
  EXPECT_EQ(s.skipped_files, want);
  for (const auto& f : state) EXPECT_FALSE(fs::exists(t.path / "out" / f)) << f;
  EXPECT_FALSE(fs::exists(t.path / "out" / "global_step500"));
  for (const auto& f : kept) EXPECT_TRUE(fs::exists(t.path / "out" / f)) << f;
  EXPECT_NE(format_summary(s).find("training state"), std::string::npos) << format_summary(s);
  EXPECT_TRUE(s.warnings.empty()) << s.warnings.front();
}

// A large file lutb does not know (a 100 MiB model.pt) is still copied, but said.
TEST(CheckpointNewUserNu17, LargeUnknownFileIsCopiedWithAWarning) {
  TempDir t;
  SynthOptions o;
  o.hidden_size = 64;
  o.moe_intermediate_size = 32;
  o.num_experts = 2;
  o.progress = false;
  const fs::path in = t.path / "m";
  synthesize_checkpoint(in, o);
  { std::ofstream(in / "model.pt") << "x"; }
  fs::resize_file(in / "model.pt", 100u << 20);  // sparse: no disk used for the source
  { std::ofstream(in / "notes.bin") << "small"; }
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  const QuantizeSummary s = quantize_checkpoint(in, t.path / "out", q);
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_EQ(s.warnings[0], (t.path / "out").string() +
                               ": copied model.pt (104.9 MB) unchanged: it is not a file of a Hugging Face checkpoint "
                               "lutb knows; delete it from the output if the checkpoint does not need it");
  EXPECT_EQ(fs::file_size(t.path / "out" / "model.pt"), 100u << 20);
  EXPECT_TRUE(fs::exists(t.path / "out" / "notes.bin"));
}

// lutb quantize checked no free space (lutb synth does): on a full disk it fitted every tensor and then
// failed writing. A (sparse) 4 TiB file it would copy makes the output larger than the disk: refused
// before anything is written, naming both sizes.
TEST(CheckpointNewUserNu17, QuantizeChecksFreeSpaceFirst) {
  TempDir t;
  SynthOptions o;
  o.hidden_size = 64;
  o.moe_intermediate_size = 32;
  o.num_experts = 2;
  o.progress = false;
  const fs::path in = t.path / "m";
  synthesize_checkpoint(in, o);
  { std::ofstream(in / "huge.bin") << "x"; }
  std::error_code ec;
  fs::resize_file(in / "huge.bin", std::uintmax_t{1} << 42, ec);
  if (ec) GTEST_SKIP() << "this filesystem holds no sparse 4 TiB file: " << ec.message();
  const fs::space_info sp = fs::space(t.path);
  if (sp.available > (std::uintmax_t{1} << 42)) GTEST_SKIP() << "more than 4 TiB free here";
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  const fs::path out = t.path / "out" / "q";  // its parent is missing: it must not be created either
  const std::string e = error_of([&] { (void)quantize_checkpoint(in, out, q); });
  EXPECT_EQ(e.rfind(out.string() + ": the checkpoint needs 4.40 TB (", 0), 0u) << e;
  EXPECT_NE(e.find("are free on the filesystem of " + t.path.string() + "; nothing written"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(t.path / "out"));
  // The training state and the weights in another form do not count: the same file as optimizer.pt
  // is left out, and the checkpoint is written.
  fs::rename(in / "huge.bin", in / "optimizer.pt");
  const QuantizeSummary s = quantize_checkpoint(in, out, q);
  EXPECT_EQ(s.skipped_files, std::vector<std::string>{"optimizer.pt"});
  EXPECT_TRUE(fs::exists(out / "config.json"));
}

// A tensor whose data_offsets were copied from another tensor's: the parser reported the gap left at
// its own place, naming the tensor after it ("model...experts.3.up_proj.weight: data_offsets [..]
// leave a gap"), not the two tensors that share bytes.
TEST(CheckpointNewUserNu17, SharedBytesAreReportedAsTheOverlapNotAGap) {
  TempDir t;
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]},)"
      R"("c":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})";
  const fs::path f = t.path / "x.safetensors";
  {
    std::ofstream o(f, std::ios::binary);
    const std::uint64_t n = header.size();
    o.write(reinterpret_cast<const char*>(&n), 8);
    o << header << std::string(12, '\0');
  }
  EXPECT_EQ(error_of([&] { SafetensorsFile x(f); }),
            f.string() + ": tensor 'c': data_offsets [8, 12] overlap tensor 'b' (which ends at 12)");
}

// A config.json, an index or a safetensors header that is not valid JSON: the message carried the
// library's error id, "invalid JSON: [json.exception.parse_error.101] parse error at line 1, ...".
TEST(CheckpointNewUserNu17, JsonErrorsWithoutTheLibraryTag) {
  TempDir t;
  const fs::path dir = two_shard_checkpoint(t.path / "m");
  const std::string want = (dir / "config.json").string() + ": invalid JSON: parse error at line 1, column ";
  std::ofstream(dir / "config.json") << "{\"hidden_size\": 256,";
  const std::string a = error_of([&] { Checkpoint c(dir); });
  EXPECT_EQ(a.rfind(want, 0), 0u) << a;
  const std::string b = error_of([&] { (void)model::TransformerConfig::load(dir); });
  EXPECT_EQ(b.rfind(want, 0), 0u) << b;
  std::ofstream(dir / "model.safetensors.index.json") << "{\"weight_map\": {";
  const std::string c = error_of([&] { (void)SafetensorsCollection::open_dir(dir); });
  EXPECT_EQ(c.rfind((dir / "model.safetensors.index.json").string() + ": invalid JSON: parse error at line 1", 0), 0u)
      << c;
  for (const std::string& e : {a, b, c}) EXPECT_EQ(e.find("json.exception"), std::string::npos) << e;
}

TEST(CheckpointNewUserNu17, LowSqnrWarningRule) {
  // 0 dB (an all-zero reconstruction) with an upstream fitter: the reason and the way out.
  const std::string w = low_sqnr_warning("f: tensor t", 4.0, 4.0, 4, "ct-lloyd");
  EXPECT_EQ(w, "f: tensor t: SQNR 0.00 dB with ct-lloyd: the quantised tensor kept less than half of the weights' "
               "energy (typical fits keep 13-15 dB); ct-lloyd fits no tile scale (scale byte 127, spec 2.1), so its "
               "codebook holds only magnitudes 2^-9..448 and weights far outside them are lost (this tensor's RMS "
               "is 1); the scaled fitters binned-dp (the default) and optimal fit them");
  // The boundary: sse = sum_sq / 2 (3.01 dB) warns, just below it does not.
  EXPECT_NE(low_sqnr_warning("t", 0.5, 1.0, 1, "binned-dp").find("SQNR 3.01 dB with binned-dp"), std::string::npos);
  EXPECT_EQ(low_sqnr_warning("t", 0.499, 1.0, 1, "binned-dp"), "");
  // Another method: no fitter-specific clause.
  EXPECT_EQ(low_sqnr_warning("t", 1.0, 1.0, 1, "int3-g128").find("tile scale"), std::string::npos);
  // No energy (an all-zero tensor) or an exact fit: nothing to warn about.
  EXPECT_EQ(low_sqnr_warning("t", 0.0, 0.0, 1, "ct-lloyd"), "");
  EXPECT_EQ(low_sqnr_warning("t", 0.0, 1.0, 1, "ct-lloyd"), "");
}

// ct-lloyd and multistart fit no tile scale: on weights of magnitude 1e-30 every tile quantises to
// zero (0 dB) and lutb quantize said nothing. binned-dp fits the same tensor at about 15 dB.
TEST(CheckpointNewUserNu17, UnscaledFittersWarnOnTinyWeights) {
  TempDir t;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto tensor = [&](float scale) {
    OwnedTensor o{DType::F32, {16, 64}, std::vector<std::uint8_t>(16 * 64 * 4)};
    for (int i = 0; i < 16 * 64; ++i) {
      const float v = nd(rng) * scale;
      std::memcpy(o.bytes.data() + 4 * i, &v, 4);
    }
    return o;
  };
  const fs::path in = t.path / "w.safetensors";
  write_safetensors(in, {{"tiny", tensor(1e-30f)}, {"unit", tensor(0.02f)}});
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  for (const char* fitter : {"ct-lloyd", "multistart"}) {
    SCOPED_TRACE(fitter);
    q.fit.fitter = fitter;
    q.force = true;
    const QuantizeSummary s = quantize_file(in, t.path / "o.safetensors", "", q);
    ASSERT_EQ(s.warnings.size(), 1u);
    EXPECT_EQ(s.warnings[0].rfind(in.string() + ": tensor tiny: SQNR 0.00 dB with " + fitter + ":", 0), 0u)
        << s.warnings[0];
    EXPECT_NE(s.warnings[0].find("fits no tile scale"), std::string::npos) << s.warnings[0];
  }
  q.fit.fitter = "binned-dp";
  const QuantizeSummary s = quantize_file(in, t.path / "o.safetensors", "", q);
  EXPECT_TRUE(s.warnings.empty()) << s.warnings.front();
  EXPECT_GT(s.stats.sqnr_db(), 10.0);
}

}  // namespace
}  // namespace lutb
