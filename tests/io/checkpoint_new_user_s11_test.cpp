// Defects a new user found in session 11 in the checkpoint reader and writer: fit errors without the
// file, F64 weights beyond FP32 reported as "+Inf", stored scale bytes whose weights overflow FP32,
// checkpoint folders named *.safetensors, download caches and .git copied into the output, and
// per-expert checkpoints lutb cannot run written without a word. Each test failed on the code
// before its fix.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

SynthOptions small(std::int64_t width = 64, bool stacked = false) {
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = 1;
  o.hidden_size = 128;
  o.moe_intermediate_size = width;
  o.num_experts = 4;
  o.stacked = stacked;
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

// Overwrites bytes [index, index + n) of tensor `name`'s data in safetensors file `file`.
void poke(const fs::path& file, const std::string& name, std::size_t index, const void* bytes, std::size_t n) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t hn = 0;
  f.read(reinterpret_cast<char*>(&hn), 8);
  std::string header(hn, '\0');
  f.read(header.data(), static_cast<std::streamsize>(hn));
  const auto j = nlohmann::json::parse(header);
  f.seekp(static_cast<std::streamoff>(8 + hn + j.at(name).at("data_offsets")[0].get<std::uint64_t>() + index));
  f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(n));
}

// Rewrites `file` with tensor `name` replaced by `bytes` of `dtype` (same shape).
void replace_tensor(const fs::path& file, const std::string& name, DType dtype, std::vector<std::uint8_t> bytes) {
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  {
    SafetensorsFile f(file);
    for (const auto& n : f.names()) {
      const TensorView& v = f.get(n);
      if (n == name)
        ts.push_back({n, OwnedTensor{dtype, v.shape, bytes}});
      else
        ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
  }
  write_safetensors(file, ts);
}

std::vector<std::uint8_t> f64_bytes(const std::vector<double>& v) {
  std::vector<std::uint8_t> b(v.size() * 8);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Finding: a NaN weight was reported as "quantize: tensor T, tile (..): NaN at row R col C": no file.
TEST(NewUserS11, FitErrorsNameTheSourceFile) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
  const fs::path file = t.path / "in" / "model.safetensors";
  const std::string n = "model.layers.0.mlp.experts.1.down_proj.weight";  // [128, 64] BF16
  const std::uint16_t nan = 0x7fc0;
  poke(file, n, (100 * 64 + 3) * 2, &nan, 2);  // row 100 col 3: tile (12, 0)
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); }),
            file.string() + ": tensor " + n + ", tile (12, 0): NaN at row 100 col 3; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "out"));
  EXPECT_EQ(error_of<std::invalid_argument>(
                [&] { quantize_file(file, t.path / "out.safetensors", "down_proj", quiet()); }),
            file.string() + ": tensor " + n + ", tile (12, 0): NaN at row 100 col 3; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "out.safetensors"));
}

// New-user QA, session 21: with --force over an existing output the same error said "nothing
// written", as if the old output were gone: it ends with "OUT is as it was", and the old output is
// still there.
TEST(NewUserS11, FitErrorOverAnExistingOutputSaysItIsAsItWas) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
  QuantizeOptions f = quiet();
  f.force = true;
  quantize_checkpoint(t.path / "in", t.path / "out", quiet());  // the old output
  const fs::path file = t.path / "in" / "model.safetensors";
  const std::string n = "model.layers.0.mlp.experts.1.down_proj.weight";
  const std::uint16_t nan = 0x7fc0;
  poke(file, n, (100 * 64 + 3) * 2, &nan, 2);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize_checkpoint(t.path / "in", t.path / "out", f); }),
            file.string() + ": tensor " + n + ", tile (12, 0): NaN at row 100 col 3; " + (t.path / "out").string() +
                " is as it was");
  EXPECT_TRUE(fs::exists(t.path / "out" / "config.json"));
  EXPECT_FALSE(fs::exists(t.path / ("out.tmp." + std::to_string(::getpid()))));
}

// Finding: the online fit of Checkpoint::lutb_experts(L, fit) on a BF16 checkpoint reported a bad
// weight in the fused stack ("quantize: tensor model.layers.0.mlp w13, expert 1, tile (8, 0): NaN
// at row 69 col 7"): no file, no stored tensor.
TEST(NewUserS11, OnlineFitOfACheckpointNamesTheStoredTensor) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
  const fs::path file = t.path / "in" / "model.safetensors";
  const std::uint16_t nan = 0x7fc0, big = 0x7f7f;  // NaN; 3.3895314e+38 (needs a scale byte above 246)
  poke(file, "model.layers.0.mlp.experts.3.down_proj.weight", (7 * 64 + 9) * 2, &big, 2);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { Checkpoint(t.path / "in").lutb_experts(0); }),
            file.string() +
                ": tensor model.layers.0.mlp.experts.3.down_proj.weight (layer 0, expert 3), row 7 col 9: magnitude "
                "3.3895314e+38 needs a scale byte above 246 (spec section 2); it cannot be quantised to LUT-B");
  poke(file, "model.layers.0.mlp.experts.1.up_proj.weight", (5 * 128 + 7) * 2, &nan, 2);  // w13 row 69
  EXPECT_EQ(error_of<std::invalid_argument>([&] { Checkpoint(t.path / "in").lutb_experts(0); }),
            file.string() +
                ": tensor model.layers.0.mlp.experts.1.up_proj.weight (layer 0, expert 1), row 5 col 7: NaN; a "
                "non-finite weight cannot be quantised to LUT-B (spec 2.1)");
  EXPECT_EQ(Checkpoint(t.path / "in").expert_location(0, true, 2, 3, 4),
            file.string() + ": tensor model.layers.0.mlp.experts.2.gate_proj.weight (layer 0, expert 2), row 3 col 4");
}

// Finding: an F64 weight beyond the FP32 range became +Inf when narrowed for the fitter and was
// reported as "+Inf at row 9 col 70"; a huge FP32-range magnitude printed 39 digits and ".000000".
TEST(NewUserS11, F64BeyondFp32IsReportedWithItsMagnitude) {
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
  // the row and column as above (session 12, helper nu12b: it named the tile only).
  v[1 * 16 * 128 + 9 * 128 + 70] = 3.3e38;
  write_safetensors(in, {{"w", OwnedTensor{DType::F64, {2, 16, 128}, f64_bytes(v)}}});
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize_file(in, t.path / "o.safetensors", "", quiet()); }),
            in.string() +
                ": tensor w, expert 1, tile (1, 1): magnitude 3.3e+38 at row 9 col 70 needs a scale byte above 246 "
                "(spec section 2); nothing written");
  EXPECT_FALSE(fs::exists(t.path / "o.safetensors"));

  // Loading F64 experts (lutb eval / moe read them as FP32): refused by name, not turned into Inf.
  synthesize_checkpoint(t.path / "ck", small());
  const std::string g = "model.layers.0.mlp.experts.0.gate_proj.weight";  // [64, 128]
  std::vector<double> w(64 * 128, 0.01);
  w[5 * 128 + 7] = 1e39;
  replace_tensor(t.path / "ck" / "model.safetensors", g, DType::F64, f64_bytes(w));
  EXPECT_EQ(error_of<CheckpointError>([&] { Checkpoint(t.path / "ck").experts_source(0); }),
            (t.path / "ck" / "model.safetensors").string() + ": tensor " + g +
                " (F64) holds 1e+39 at [5, 7], beyond the FP32 range lutb computes in (largest magnitude about "
                "3.4e+38)");
}

// Finding: a stored weight_scale byte of 254 (valid UE8M0, but 448 * 2^127 is beyond FP32) loaded
// silently; `lutb eval` then reported a NaN loss naming no tensor.
TEST(NewUserS11, StoredScaleWhoseWeightsOverflowFp32IsRefused) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
  quantize_checkpoint(t.path / "in", t.path / "q", quiet());
  const fs::path file = t.path / "q" / "model.safetensors";
  const std::string s = "model.layers.0.mlp.experts.2.up_proj.weight_scale";  // [8, 2]
  const std::uint8_t b254 = 254;
  poke(file, s, 3, &b254, 1);  // tile [1, 1]
  const std::string e = error_of<FormatError>([&] { Checkpoint(t.path / "q").lutb_experts(0); });
  EXPECT_TRUE(has(e, file.string() + ": tensor " + s + " (layer 0, expert 2): tile [1, 1] (tile row 1, tile column 1) "
                                                     "has scale byte 254, and its codebook entry "))
      << e;
  EXPECT_TRUE(has(e, "times 2^127 is beyond the FP32 range: the weights would be infinite (fitters write scale bytes "
                     "3..246, spec 2); the checkpoint is corrupt"))
      << e;
  // A scale byte above 246 whose weights stay finite (small codebook entries) is valid UE8M0: read.
  const std::string c = "model.layers.0.mlp.experts.2.up_proj.weight_codebook";  // [8, 2, 8]
  const std::uint8_t small_entries[8] = {0x08, 0x08, 0x08, 0x08, 0x08, 0x08, 0x08, 0x08};  // 2^-6 each
  poke(file, c, 3 * 8, small_entries, 8);
  const ExpertsLutb x = Checkpoint(t.path / "q").lutb_experts(0);
  EXPECT_EQ(x.w13.scale[static_cast<std::size_t>(2 * 16 * 2 + 8 * 2 + 3)], 254);  // expert 2, up rows 64.., tile [1, 1]
}

// Finding: `lutb quantize MODEL_DIR -o q.safetensors` (and `lutb synth -o s.safetensors`) wrote a
// checkpoint folder named like one safetensors file.
TEST(NewUserS11, CheckpointFolderNamedSafetensorsIsRefused) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
  for (const std::string out : {"q.safetensors", "q.safetensors/"}) {
    EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / out, quiet()); }),
              (t.path / "q.safetensors").string() +
                  ": a checkpoint directory must not be named *.safetensors (readers take that name for one "
                  "safetensors file; to quantise the tensors of one file, give that .safetensors file as the "
                  "input); nothing written");
    EXPECT_FALSE(fs::exists(t.path / "q.safetensors"));
  }
  EXPECT_EQ(error_of<CheckpointError>([&] { synthesize_checkpoint(t.path / "s.safetensors", small()); }),
            (t.path / "s.safetensors").string() +
                ": a checkpoint directory must not be named *.safetensors (readers take that name for one "
                "safetensors file; a checkpoint is a folder of config.json and *.safetensors files); nothing written");
  EXPECT_FALSE(fs::exists(t.path / "s.safetensors"));
}

// Finding: `huggingface-cli download --local-dir` leaves .cache/huggingface/ (hashes of the BF16
// files) in the model folder, and a git clone has .git/ (its LFS store holds the BF16 weights
// again): both were copied into the LUT-B checkpoint.
TEST(NewUserS11, DownloadCachesAndGitAreNotCopied) {
  TempDir t;
  const fs::path in = t.path / "in";
  synthesize_checkpoint(in, small());
  fs::create_directories(in / ".cache" / "huggingface" / "download");
  std::ofstream(in / ".cache" / "huggingface" / "download" / "model.safetensors.metadata") << "sha of the BF16 file";
  fs::create_directories(in / ".git" / "lfs" / "objects");
  std::ofstream(in / ".git" / "HEAD") << "ref: refs/heads/main\n";
  fs::create_directories(in / "original" / ".git");
  std::ofstream(in / "original" / ".git" / "HEAD") << "x";
  std::ofstream(in / "original" / "params.json") << "{}";
  std::ofstream(in / ".gitattributes") << "*.safetensors filter=lfs\n";
  const QuantizeSummary s = quantize_checkpoint(in, t.path / "out", quiet());
  EXPECT_EQ(s.skipped_files, (std::vector<std::string>{".cache/", ".git/", "original/.git/"}));
  EXPECT_FALSE(fs::exists(t.path / "out" / ".cache"));
  EXPECT_FALSE(fs::exists(t.path / "out" / ".git"));
  EXPECT_FALSE(fs::exists(t.path / "out" / "original" / ".git"));
  EXPECT_TRUE(fs::exists(t.path / "out" / "original" / "params.json"));
  EXPECT_TRUE(fs::exists(t.path / "out" / ".gitattributes"));
  // Each reason with its files (session 19: the line gave every reason after every list).
  EXPECT_TRUE(has(format_summary(s), "not copied           .cache/ (download cache); .git/, original/.git/ (version "
                                     "control)\n"))
      << format_summary(s);
}

// Finding: a per-expert checkpoint of expert width 12 was quantised without a word, although lutb
// eval / moe then refuse it (gate and up padded separately cannot form [2I, H] tiles).
TEST(NewUserS11, PerExpertWidthNotAMultipleOf8Warns) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(12));
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
  synthesize_checkpoint(t.path / "st", small(12, true));
  EXPECT_TRUE(quantize_checkpoint(t.path / "st", t.path / "st_out", quiet()).warnings.empty());
  synthesize_checkpoint(t.path / "w64", small(64));
  EXPECT_TRUE(quantize_checkpoint(t.path / "w64", t.path / "w64_out", quiet()).warnings.empty());
}

// Finding: a stray copy of the BF16 weights beside the checkpoint's own file (an unlisted shard,
// "model_backup.safetensors") was copied into the LUT-B checkpoint without a word.
TEST(NewUserS11, CopiedSafetensorsHoldingTheWeightsWarn) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
  fs::create_directories(t.path / "in" / "old");
  fs::copy_file(t.path / "in" / "model.safetensors", t.path / "in" / "old" / "model_backup.safetensors");
  write_safetensors(t.path / "in" / "acts.safetensors",
                    {{"layers.0.moe_input", OwnedTensor{DType::F32, {1, 2}, std::vector<std::uint8_t>(8, 0)}}});
  const QuantizeSummary s = quantize_checkpoint(t.path / "in", t.path / "out", quiet());
  ASSERT_EQ(s.warnings.size(), 1u);
  EXPECT_TRUE(has(s.warnings[0], (t.path / "out").string() +
                                     ": copied old/model_backup.safetensors unquantised: it holds tensor model.layers.0."))
      << s.warnings[0];
  EXPECT_TRUE(has(s.warnings[0], " of this checkpoint (a stray shard or a copy of the weights?)")) << s.warnings[0];
  EXPECT_TRUE(fs::exists(t.path / "out" / "old" / "model_backup.safetensors"));  // still the user's data
  EXPECT_TRUE(fs::exists(t.path / "out" / "acts.safetensors"));
}

}  // namespace
}  // namespace lutb
