// The files lutb quantize copies beside the quantised weights, and those it leaves out (training state,
// download caches, git, the source's reference losses), with a note or a warning for each.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/config_json.hpp"
#include "io/tensor_names.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::CliOut;
using test::error_of;
using test::has;
using test::q;
using test::quiet;
using test::quiet_one_thread;
using test::run;
using test::small_synth;
using test::TempDir;
using test::tiny_synth;

// Rewrites `file` with BF16 [2, 2] zero tensors `extra` added.
void add_tensors(const fs::path& file, const std::vector<std::string>& extra) {
  std::vector<std::pair<std::string, OwnedTensor>> add;
  for (const auto& n : extra) add.push_back({n, test::bf16_zeros_2x2()});
  test::rewrite_safetensors(file, {}, add);
}

// Files lutb quantize cannot copy (a tokenizer.json blob missing from a Hugging Face cache snapshot, i.e. a
// dangling link, or a named pipe beside the weights) are listed in its summary, never left out without a word.
TEST(CopiedFiles, QuantizeListsFilesItCannotCopy) {
  TempDir t;
  const fs::path bf = t.path / "bf", out = t.path / "lb";
  SynthOptions o = small_synth();
  synthesize_checkpoint(bf, o);
  fs::create_symlink("../../blobs/0123abcd", bf / "tokenizer.json");
  ASSERT_EQ(::mkfifo((bf / "notes.fifo").c_str(), 0644), 0);
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  const QuantizeSummary s = quantize_checkpoint(bf, out, q);
  EXPECT_EQ(s.skipped_files, (std::vector<std::string>{"notes.fifo", "tokenizer.json"}));
  EXPECT_NE(std::find(s.warnings.begin(), s.warnings.end(),
                      (bf / "tokenizer.json").string() +
                          ": not copied: it is a symbolic link to ../../blobs/0123abcd, which does not exist (an "
                          "incomplete download?)"),
            s.warnings.end())
      << fmt::format("{}", fmt::join(s.warnings, "\n"));
  EXPECT_NE(std::find(s.warnings.begin(), s.warnings.end(),
                      (bf / "notes.fifo").string() + ": not copied: not a regular file (a named pipe (FIFO))"),
            s.warnings.end());
  EXPECT_NE(format_summary(s).find("not copied           notes.fifo, tokenizer.json (not a regular file: see the warning)\n"), std::string::npos)
      << format_summary(s);
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

// A file that quantize copies but cannot read (tokenizer.json at mode 000) is refused before anything is
// written, naming the input file and the reason, not by the copy step after the whole fit (hours on a real
// model).
TEST(CopiedFiles, UnreadableFileToCopyIsRefusedBeforeTheFit) {
  if (!test::can_run_as_nobody()) GTEST_SKIP() << "needs root, setpriv and a tool uid 65534 can run";
  test::TempDir t;
  fs::permissions(t.path, fs::perms::all);  // uid 65534 writes the output here
  const fs::path in = t.path / "m";
  ASSERT_EQ(run("synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 4 "
                "--no-progress -o " + q(in)).code, 0);
  const fs::path tok = in / "tokenizer.json";
  std::ofstream(tok) << "{}\n";
  ::chmod(tok.c_str(), 0);
  const fs::path out = t.path / "q";
  const CliOut r = run("quantize " + q(in) + " -o " + q(out) + " --no-progress", test::kAsNobody);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, tok.string() + ": cannot open it for reading: Permission denied; lutb quantize copies it into "
                                    "the output"))
      << r.out;
  EXPECT_TRUE(has(r, "; nothing written")) << r.out;
  EXPECT_FALSE(has(r, out.string() + "/tokenizer.json")) << r.out;
  EXPECT_FALSE(fs::exists(out));
  EXPECT_EQ(std::distance(fs::directory_iterator(t.path), fs::directory_iterator()), 1);  // no OUT.tmp.PID left

  // A subfolder it cannot list: refused the same way, before the fit.
  ::chmod(tok.c_str(), 0644);
  fs::create_directory(in / "extra");
  std::ofstream(in / "extra" / "a.txt") << "a\n";
  ::chmod((in / "extra").c_str(), 0);
  const CliOut r2 = run("quantize " + q(in) + " -o " + q(out) + " --no-progress", test::kAsNobody);
  ::chmod((in / "extra").c_str(), 0755);
  EXPECT_EQ(r2.code, 1) << r2.out;
  EXPECT_TRUE(has(r2, (in / "extra").string() + ": cannot list the input folder's files under it: Permission denied"))
      << r2.out;
  EXPECT_FALSE(fs::exists(out));
}

// A checkpoint saved mid-training (transformers' Trainer, Accelerate, DeepSpeed) carries its training state
// beside the weights: an optimizer.pt is about twice the size of the weights. lutb quantize leaves it out and
// lists it; trainer_state.json (the training log) and the tokenizer are copied.
TEST(CopiedFiles, TrainingStateIsNotCopied) {
  TempDir t;
  SynthOptions o = tiny_synth();
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

// A large file lutb does not know (a 100 MiB model.pt) is copied, with a warning.
TEST(CopiedFiles, LargeUnknownFileIsCopiedWithAWarning) {
  TempDir t;
  SynthOptions o = tiny_synth();
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

// reference_eval.json (transformers' held-out loss of the BF16 weights, spec section 8) is not copied into the
// LUT-B checkpoint, where it would read as the reference of weights it does not describe; it is listed.
// val_tokens.safetensors and the captured activations are copied (eval and moe read them from the output
// folder).
TEST(CopiedFiles, QuantizeDoesNotCopyTheSourceReferenceLosses) {
  TempDir t;
  synthesize_checkpoint(t.path / "m", test::synth_options(128, 64, 2));
  std::ofstream(t.path / "m" / "reference_eval.json") << "{\"val_loss_fp32_compute\": 3.97}";
  std::ofstream(t.path / "m" / "tokenizer.json") << "{}";
  write_safetensors(t.path / "m" / "val_tokens.safetensors",
                    {{"input_ids", OwnedTensor{DType::I32, {2}, std::vector<std::uint8_t>(8, 1)}}});
  const QuantizeSummary s = quantize_checkpoint(t.path / "m", t.path / "q", quiet_one_thread());
  EXPECT_EQ(s.skipped_files, std::vector<std::string>{"reference_eval.json"});
  EXPECT_FALSE(fs::exists(t.path / "q" / "reference_eval.json"));
  EXPECT_TRUE(fs::exists(t.path / "q" / "tokenizer.json"));
  EXPECT_TRUE(fs::exists(t.path / "q" / "val_tokens.safetensors"));
  EXPECT_NE(format_summary(s).find("not copied           reference_eval.json (the source weights' reference losses, "
                                   "spec section 8)\n"),
            std::string::npos)
      << format_summary(s);
}

// `huggingface-cli download --local-dir` leaves .cache/huggingface/ (hashes of the BF16 files) in the model
// folder, and a git clone has .git/ (its LFS store holds the BF16 weights again): neither is copied into the
// LUT-B checkpoint; both are listed.
TEST(CopiedFiles, DownloadCachesAndGitAreNotCopied) {
  TempDir t;
  const fs::path in = t.path / "in";
  synthesize_checkpoint(in, small_synth());
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
  // Each reason stands with its own files, not every reason after every list.
  EXPECT_TRUE(has(format_summary(s), "not copied           .cache/ (download cache); .git/, original/.git/ (version "
                                     "control)\n"))
      << format_summary(s);
}

// A stray copy of the BF16 weights beside the checkpoint's own file (an unlisted shard,
// "model_backup.safetensors") is copied with a warning.
TEST(CopiedFiles, CopiedSafetensorsHoldingTheWeightsWarn) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
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

// Tensors that are not tensors of the model are copied unquantised with a warning; a misspelt routed-expert
// name is refused, since no loader would ever read it.
TEST(CopiedFiles, QuantizeWarnsAboutStrayTensorsAndRefusesMisspeltExperts) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
  const fs::path f = t.path / "in" / "model.safetensors";
  const std::string cfg = (t.path / "in" / "config.json").string();
  add_tensors(f, {"model.extra.weight", "model.layers.0.self_attn.q_prj.weight", "model.layers.0.mlp.gate_proj.weight",
                  "model.layers.0.self_attn.rotary_emb.inv_freq"});
  const QuantizeSummary s = quantize_checkpoint(t.path / "in", t.path / "out", quiet());
  const std::string head = f.string() + ": tensor ";
  const std::string tail = " is not a tensor of the qwen3_moe model " + cfg + " describes";
  EXPECT_EQ(s.warnings, (std::vector<std::string>{
                            head + "model.extra.weight" + tail + "; copied unquantised",
                            head + "model.layers.0.mlp.gate_proj.weight" + tail + " (a dense MLP weight, but " + cfg +
                                " makes layer 0 a MoE layer); copied unquantised",
                            head + "model.layers.0.self_attn.q_prj.weight" + tail + "; copied unquantised"}));
  EXPECT_TRUE(SafetensorsFile(t.path / "out" / "model.safetensors").contains("model.extra.weight"));

  // Beyond 5, one line counts the rest.
  add_tensors(f, {"a.0", "a.1", "a.2", "a.3"});
  const QuantizeSummary s7 = quantize_checkpoint(t.path / "in", t.path / "out7", quiet());
  ASSERT_EQ(s7.warnings.size(), 6u);
  EXPECT_EQ(s7.warnings[0], head + "a.0" + tail + "; copied unquantised");
  EXPECT_EQ(s7.warnings[5], "2 more tensors are not tensors of the qwen3_moe model " + cfg +
                                " describes (the first 5 are listed above); for each: copied unquantised");

  // A misspelt expert tensor is refused, naming what was expected.
  synthesize_checkpoint(t.path / "in2", small_synth());
  const fs::path f2 = t.path / "in2" / "model.safetensors";
  add_tensors(f2, {"model.layers.0.mlp.experts.1.gate_prj.weight"});
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in2", t.path / "out2", quiet()); }),
            f2.string() +
                ": tensor model.layers.0.mlp.experts.1.gate_prj.weight is named like an expert tensor of MoE layer 0 "
                "but is not one the model has (expected per expert model.layers.0.mlp.experts.0.gate_proj.weight for "
                "experts 0..3 and gate, up, down, or stacked model.layers.0.mlp.experts.gate_up_proj and "
                "model.layers.0.mlp.experts.down_proj; a misspelt name?); lutb would not read it: rename or remove "
                "it; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "out2"));
  // LUT-B tensors in a checkpoint whose config.json is not LUT-B.
  synthesize_checkpoint(t.path / "in3", small_synth());
  const fs::path f3 = t.path / "in3" / "model.safetensors";
  add_tensors(f3, {"model.layers.0.mlp.experts.2.up_proj.weight_packed"});
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in3", t.path / "out3", quiet()); }),
            f3.string() +
                ": tensor model.layers.0.mlp.experts.2.up_proj.weight_packed is a LUT-B tensor of a routed expert, but " +
                (t.path / "in3" / "config.json").string() +
                " has no LUT-B quantization_config (the \"quantization_config\" with \"quant_method\": \"lut_b\" that "
                "says how to read LUT-B weights, spec 2.2; a BF16 checkpoint's experts are float tensors): if the "
                "checkpoint's experts are LUT-B, restore the config.json written with them; otherwise remove the "
                "tensor; nothing written");
}

}  // namespace
}  // namespace lutb
