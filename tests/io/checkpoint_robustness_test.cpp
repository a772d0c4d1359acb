// Robustness of the checkpoint writers: interruption, output permissions, synth size checks and free
// space, stale temporaries, and inputs that must be refused or left out.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "io/checkpoint_internal.hpp"
#include "lutb/checkpoint.hpp"
#include "support/checkpoint_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::edit_config;
using test::entries;
using test::error_of;
using test::quiet;
using test::read_file;
using test::rewrite_safetensors;
using test::small_synth_layers;
using test::TempDir;

mode_t current_umask() {
  const mode_t m = ::umask(022);
  ::umask(m);
  return m;
}

fs::perms mode_of(const fs::path& p) { return fs::status(p).permissions() & fs::perms::mask; }

// In a Hugging Face cache snapshot every file is a symlink to ../../blobs/<sha>. The copy of the other
// files uses the link's own name, never fs::relative(path, in_dir), which resolves the link: writing
// tmp / "../../blobs/<sha>" with O_TRUNC would empty the source blob. The contents are copied,
// symlinked folders are left out and listed, and the sources stay byte for byte as they were.
TEST(QuantizeInput, HuggingFaceCacheSymlinksLeaveTheSourcesIntact) {
  TempDir t;
  synthesize_checkpoint(t.path / "src", small_synth_layers());
  std::ofstream(t.path / "src" / "tokenizer.json") << "{\"tokens\": 3}";
  const fs::path blobs = t.path / "cache" / "blobs", snap = t.path / "cache" / "snapshots" / "rev1";
  fs::create_directories(blobs);
  fs::create_directories(snap);
  fs::create_directories(t.path / "extra");
  std::ofstream(t.path / "extra" / "notes.txt") << "not part of the checkpoint";
  std::map<std::string, std::string> before;
  for (const auto& e : fs::directory_iterator(t.path / "src")) {
    const std::string name = e.path().filename().string();
    fs::copy_file(e.path(), blobs / ("sha-" + name));
    fs::create_symlink(fs::path("..") / ".." / "blobs" / ("sha-" + name), snap / name);
    before[name] = read_file(e.path());
  }
  fs::create_directory_symlink(t.path / "extra", snap / "linked_dir");
  ASSERT_GE(before.size(), 3u);
  for (const fs::path& out : {t.path / "cache" / "snapshots" / "rev1-lutb", t.path / "out"}) {
    const QuantizeSummary sum = quantize_checkpoint(snap, out, quiet());
    for (const auto& [name, bytes] : before) {
      EXPECT_EQ(read_file(blobs / ("sha-" + name)), bytes) << "source blob of " << name << " changed";
      EXPECT_TRUE(fs::exists(out / name)) << name;
      EXPECT_FALSE(fs::is_symlink(out / name)) << name;
    }
    EXPECT_EQ(read_file(out / "tokenizer.json"), before["tokenizer.json"]);
    EXPECT_TRUE(Checkpoint(out).is_lutb());
    EXPECT_FALSE(fs::exists(out / "linked_dir"));
    EXPECT_NE(std::find(sum.skipped_files.begin(), sum.skipped_files.end(), "linked_dir/"), sum.skipped_files.end());
    EXPECT_EQ(read_file(t.path / "extra" / "notes.txt"), "not part of the checkpoint");
    EXPECT_TRUE(entries(out.parent_path(), out.filename().string() + ".tmp.").empty());
  }
}

// quantize copies a Hugging Face repository's README.md, LICENSE, .gitattributes and subfolders into
// its output, so the next "quantize --force" must recognise that output as its own: a folder whose
// config.json says lutb wrote it is replaceable; the same files without such a config are refused.
TEST(QuantizeOutput, ForceReplacesOwnOutputOfAHuggingFaceRepository) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth_layers());
  std::ofstream(t.path / "in" / "README.md") << "# model card";
  std::ofstream(t.path / "in" / "LICENSE") << "license";
  std::ofstream(t.path / "in" / ".gitattributes") << "*.safetensors filter=lfs";
  fs::create_directories(t.path / "in" / "original");
  std::ofstream(t.path / "in" / "original" / "params.json") << "{}";
  quantize_checkpoint(t.path / "in", t.path / "out", quiet());
  EXPECT_TRUE(fs::exists(t.path / "out" / ".gitattributes"));
  QuantizeOptions f = quiet();
  f.force = true;
  const QuantizeSummary again = quantize_checkpoint(t.path / "in", t.path / "out", f);  // threw on the old code
  EXPECT_GT(again.tensors_quantized, 0);
  EXPECT_TRUE(Checkpoint(t.path / "out").is_lutb());
  EXPECT_TRUE(fs::exists(t.path / "out" / "original" / "params.json"));
  // The synth output itself (a BF16 checkpoint lutb wrote) is replaceable too.
  synthesize_checkpoint(t.path / "in2", small_synth_layers());
  std::ofstream(t.path / "in2" / "notes.md") << "mine";
  SynthOptions so = small_synth_layers();
  so.force = true;
  synthesize_checkpoint(t.path / "in2", so);
  EXPECT_FALSE(fs::exists(t.path / "in2" / "notes.md"));
  // Not written by lutb (no quantization_config, no synth marker): still refused, nothing changed.
  fs::create_directories(t.path / "theirs");
  std::ofstream(t.path / "theirs" / "config.json") << "{\"model_type\": \"qwen3_moe\"}";
  std::ofstream(t.path / "theirs" / "README.md") << "theirs";
  const std::string e = error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "theirs", f); });
  EXPECT_NE(e.find("README.md"), std::string::npos) << e;
  EXPECT_EQ(read_file(t.path / "theirs" / "README.md"), "theirs");
  // A config.json that is a symlink to a LUT-B config does not count.
  fs::create_directories(t.path / "linked");
  fs::create_symlink(t.path / "out" / "config.json", t.path / "linked" / "config.json");
  std::ofstream(t.path / "linked" / "README.md") << "keep";
  EXPECT_NE(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "linked", f); }).find("refusing"),
            std::string::npos);
  EXPECT_EQ(read_file(t.path / "linked" / "README.md"), "keep");
}

// A destination that appears during a run (another run, the user) is never replaced without --force:
// the checks at the start are not enough, so install_replacing creates an absent destination with
// RENAME_NOREPLACE, refuses an existing one without force, and re-applies the --force rules to it.
TEST(QuantizeOutput, DestinationThatAppearedDuringTheRunIsNotReplaced) {
  TempDir t;
  const fs::path tmp = t.path / "out.tmp.1", out = t.path / "out";
  fs::create_directories(tmp);
  std::ofstream(tmp / "model.safetensors") << "new";
  fs::create_directories(out / "sub");
  std::ofstream(out / "notes.txt") << "precious";
  const std::string e1 = error_of<CheckpointError>([&] { detail::install_replacing(tmp, out, true, false); });
  EXPECT_NE(e1.find("appeared while the output was being written"), std::string::npos) << e1;
  EXPECT_NE(e1.find("--force"), std::string::npos) << e1;
  EXPECT_EQ(read_file(out / "notes.txt"), "precious");
  EXPECT_TRUE(fs::exists(out / "sub"));
  EXPECT_TRUE(fs::exists(tmp / "model.safetensors"));  // left for the caller's guard
  // With force, the --force rules apply to what is there now (notes.txt and sub/ are not checkpoint
  // entries; either may be named first).
  const std::string e2 = error_of<CheckpointError>([&] { detail::install_replacing(tmp, out, true, true); });
  EXPECT_NE(e2.find("does not look like a checkpoint this tool wrote"), std::string::npos) << e2;
  EXPECT_EQ(read_file(out / "notes.txt"), "precious");
  // A checkpoint-like destination is replaced with force; an absent one is created.
  fs::remove_all(out);
  fs::create_directories(out);
  std::ofstream(out / "config.json") << "{}";
  detail::install_replacing(tmp, out, true, true);
  EXPECT_EQ(read_file(out / "model.safetensors"), "new");
  EXPECT_FALSE(fs::exists(out / "config.json"));
  EXPECT_FALSE(fs::exists(tmp));
  const fs::path tmp2 = t.path / "two.tmp.1", out2 = t.path / "two";
  fs::create_directories(tmp2);
  detail::install_replacing(tmp2, out2, true, false);
  EXPECT_TRUE(fs::is_directory(out2));
  // File outputs: a file that appeared is not replaced without force.
  std::ofstream(t.path / "f.safetensors.tmp.1") << "new";
  std::ofstream(t.path / "f.safetensors") << "someone else's";
  const std::string e3 = error_of<CheckpointError>(
      [&] { detail::install_replacing(t.path / "f.safetensors.tmp.1", t.path / "f.safetensors", false, false); });
  EXPECT_NE(e3.find("appeared"), std::string::npos) << e3;
  EXPECT_EQ(read_file(t.path / "f.safetensors"), "someone else's");
}

// Regression: quantize_checkpoint copied the other files with std::filesystem::copy_file, which
// carries the source's permission bits over: a read-only source gave read-only outputs.
TEST(QuantizeOutput, CopiedFilesGetNormalPermissions) {
  TempDir t;
  const fs::path in = t.path / "in";
  synthesize_checkpoint(in, small_synth_layers());
  std::ofstream(in / "tokenizer.json") << "{}";
  fs::create_directories(in / "extra");
  std::ofstream(in / "extra" / "notes.txt") << "n";
  const auto ro_file = fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read;  // 0444
  const auto ro_dir = ro_file | fs::perms::owner_exec | fs::perms::group_exec | fs::perms::others_exec;  // 0555
  fs::permissions(in / "tokenizer.json", ro_file);
  fs::permissions(in / "extra" / "notes.txt", ro_file);
  fs::permissions(in / "extra", ro_dir);
  quantize_checkpoint(in, t.path / "out", quiet());
  fs::permissions(in / "extra", fs::perms::owner_all);  // let TempDir remove it

  const auto um = static_cast<fs::perms>(current_umask());
  const fs::perms file_mode = static_cast<fs::perms>(0666) & ~um;
  const fs::perms dir_mode = static_cast<fs::perms>(0777) & ~um;
  EXPECT_EQ(mode_of(t.path / "out" / "tokenizer.json"), file_mode);
  EXPECT_EQ(mode_of(t.path / "out" / "extra" / "notes.txt"), file_mode);
  EXPECT_EQ(mode_of(t.path / "out" / "extra"), dir_mode);
  EXPECT_EQ(mode_of(t.path / "out"), dir_mode);
  EXPECT_EQ(mode_of(t.path / "out" / "config.json"), file_mode);
  std::ifstream f(t.path / "out" / "extra" / "notes.txt");
  std::string s;
  f >> s;
  EXPECT_EQ(s, "n");  // contents copied
}

// The interrupt flag (set by the CLI's signal handler): the write stops, the temporary goes, the
// destination stays as it was.
TEST(QuantizeOutput, InterruptFlagLeavesTheDestinationAsItWas) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth_layers(2));
  fs::create_directories(t.path / "out");
  std::ofstream(t.path / "out" / "keep.json") << "old";
  InterruptFlag flag{SIGINT};
  QuantizeOptions q = quiet();
  q.force = true;
  q.interrupt = &flag;
  try {
    quantize_checkpoint(t.path / "in", t.path / "out", q);
    ADD_FAILURE() << "not interrupted";
  } catch (const Interrupted& e) {
    EXPECT_EQ(e.signal, SIGINT);
    EXPECT_NE(std::string(e.what()).find((t.path / "out").string() + ": interrupted by signal 2"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(entries(t.path, "out"), std::vector<std::string>{"out"});
  EXPECT_EQ(entries(t.path / "out", ""), std::vector<std::string>{"keep.json"});

  // quantize_file and synthesize_checkpoint honour it too.
  const fs::path shard = t.path / "in" / "model-00001-of-00002.safetensors";
  EXPECT_NE(error_of<Interrupted>([&] { quantize_file(shard, t.path / "x.safetensors", "", q); }).find("interrupted"),
            std::string::npos);
  EXPECT_TRUE(entries(t.path, "x.safetensors").empty());
  SynthOptions so = small_synth_layers();
  so.interrupt = &flag;
  EXPECT_NE(error_of<Interrupted>([&] { synthesize_checkpoint(t.path / "s", so); }).find("interrupted"),
            std::string::npos);
  EXPECT_TRUE(entries(t.path, "s").empty());
  // A zero flag changes nothing.
  flag = 0;
  quantize_checkpoint(t.path / "in", t.path / "out", q);
  EXPECT_TRUE(Checkpoint(t.path / "out").is_lutb());
}

// FitOptions::interrupt makes one tensor's fit interruptible. A set flag stops
// the fit before its next tile with Interrupted naming the tensor and the progress; a zero flag
// changes nothing (same bytes and statistics as no flag).
TEST(QuantizeOutput, FitReadsTheInterruptFlagBeforeEveryTile) {
  const LutbShape shape{3, 40, 130, true};  // 3 experts x 5 x 3 tiles, padded
  std::vector<float> w(static_cast<std::size_t>(3 * 40 * 130));
  std::uint32_t x = 12345;
  for (auto& v : w) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<float>(static_cast<std::int32_t>(x >> 8) - (1 << 23)) / (1 << 23);
  }
  for (const char* fitter : {"binned-dp", "optimal", "ct-lloyd"}) {
    SCOPED_TRACE(fitter);
    FitOptions plain;
    plain.fitter = fitter;
    plain.threads = 2;
    LutbTensor ref;
    const FitStats rs = quantize(w.data(), DType::F32, shape, ref, plain);

    InterruptFlag flag{0};
    FitOptions polled = plain;
    polled.interrupt = &flag;
    LutbTensor same;
    const FitStats ss = quantize(w.data(), DType::F32, shape, same, polled);
    EXPECT_EQ(same.packed, ref.packed);
    EXPECT_EQ(same.codebook, ref.codebook);
    EXPECT_EQ(same.scale, ref.scale);
    EXPECT_EQ(ss.tiles, rs.tiles);
    EXPECT_EQ(ss.sse, rs.sse);
    EXPECT_EQ(ss.sum_sq, rs.sum_sq);

    flag = SIGTERM;
    LutbTensor stopped;
    try {
      quantize(w.data(), DType::F32, shape, stopped, polled, "experts.w13");
      ADD_FAILURE() << "not interrupted";
    } catch (const Interrupted& e) {
      EXPECT_EQ(e.signal, SIGTERM);
      EXPECT_EQ(e.tiles_done, 0);
      EXPECT_EQ(e.tiles_total, 45);
      EXPECT_EQ(std::string(e.what()), "quantize: tensor experts.w13: interrupted (flag 15) after 0 of 45 tiles");
    }
    EXPECT_TRUE(stopped.packed.empty());
    EXPECT_TRUE(stopped.scale.empty());
  }
  // A stop wins over a bad tile (the tiles after the stop are not looked at).
  w[7] = std::nanf("");
  InterruptFlag flag{SIGINT};
  FitOptions o;
  o.interrupt = &flag;
  LutbTensor out;
  EXPECT_NE(error_of<Interrupted>([&] { quantize(w.data(), DType::F32, shape, out, o); }).find("interrupted (flag 2)"),
            std::string::npos);
  flag = 0;
  EXPECT_NE(error_of<std::invalid_argument>([&] { quantize(w.data(), DType::F32, shape, out, o, "t"); })
                .find("quantize: tensor t, expert 0, tile (0, 0): NaN at row 0 col 7"),
            std::string::npos);
}

// --force replaces only what looks like a checkpoint, never any existing destination (a directory
// holding the user's notes, the current directory): anything else is refused naming the path and the
// offending entry, changing nothing.
TEST(ForceOutput, ReplacesOnlyCheckpointLikeDestinations) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth_layers());
  QuantizeOptions f = quiet();
  f.force = true;
  const fs::path d = t.path / "d";
  fs::create_directories(d);
  std::ofstream(d / "config.json") << "{}";
  std::ofstream(d / "notes.txt") << "precious";
  const std::string e1 = error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", d, f); });
  EXPECT_NE(e1.find(d.string() + ": does not look like a checkpoint"), std::string::npos) << e1;
  EXPECT_NE(e1.find("'notes.txt'"), std::string::npos) << e1;
  EXPECT_NE(e1.find("nothing changed"), std::string::npos) << e1;
  EXPECT_EQ(entries(d, ""), (std::vector<std::string>{"config.json", "notes.txt"}));
  EXPECT_EQ(entries(t.path, "d"), std::vector<std::string>{"d"});  // no d.tmp.*, d.old.*
  SynthOptions so = small_synth_layers();
  so.force = true;
  const std::string e2 = error_of<CheckpointError>([&] { synthesize_checkpoint(d, so); });
  EXPECT_NE(e2.find("'notes.txt'"), std::string::npos) << e2;
  EXPECT_EQ(entries(d, ""), (std::vector<std::string>{"config.json", "notes.txt"}));

  // A subdirectory is refused too.
  fs::remove(d / "notes.txt");
  fs::create_directories(d / "sub");
  const std::string e3 = error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", d, f); });
  EXPECT_NE(e3.find("'sub' is a subdirectory"), std::string::npos) << e3;
  EXPECT_TRUE(fs::exists(d / "sub"));
  fs::remove(d / "sub");

  // The current directory (or an ancestor of it) is never replaced, even when it looks like one.
  const fs::path cwd = fs::current_path();
  fs::create_directories(t.path / "d2");
  std::ofstream(t.path / "d2" / "config.json") << "{}";
  fs::current_path(t.path / "d2");
  const std::string e4 = error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "d2", f); });
  const std::string e5 = error_of<CheckpointError>([&] { synthesize_checkpoint(fs::path("."), so); });
  fs::current_path(cwd);
  EXPECT_NE(e4.find("current directory"), std::string::npos) << e4;
  EXPECT_NE(e5.find("current directory"), std::string::npos) << e5;
  EXPECT_TRUE(fs::exists(t.path / "d2" / "config.json"));

  // A checkpoint-like directory (only config.json here) is replaced, by quantize and by synth.
  quantize_checkpoint(t.path / "in", d, f);
  EXPECT_TRUE(Checkpoint(d).is_lutb());
  synthesize_checkpoint(d, so);
  EXPECT_FALSE(Checkpoint(d).is_lutb());
  EXPECT_EQ(entries(t.path, "d"), (std::vector<std::string>{"d", "d2"}));

  // File outputs: only a regular *.safetensors file is replaced.
  const fs::path shard = t.path / "in" / "model.safetensors";
  std::ofstream(t.path / "notes.txt") << "precious";
  const std::string e6 = error_of<CheckpointError>([&] { quantize_file(shard, t.path / "notes.txt", "", f); });
  EXPECT_NE(e6.find("not a regular .safetensors file"), std::string::npos) << e6;
  std::ifstream nf(t.path / "notes.txt");
  std::string word;
  nf >> word;
  EXPECT_EQ(word, "precious");
  quantize_file(shard, t.path / "x.safetensors", "", f);
  quantize_file(shard, t.path / "x.safetensors", "", f);  // replaced
  EXPECT_TRUE(fs::is_regular_file(t.path / "x.safetensors"));
}

// An output that cannot be created (no permission; here, as the tests may run as root, a parent that
// is a file) is reported under the user's path, not the temporary ".../out.tmp.PID".
TEST(ForceOutput, CreationErrorsNameTheUsersPath) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth_layers());
  std::ofstream(t.path / "f") << "x";
  const fs::path out = t.path / "f" / "out", outf = t.path / "f" / "out.safetensors";
  for (const auto& [path, e] : std::vector<std::pair<fs::path, std::string>>{
           {out, error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", out, quiet()); })},
           {out, error_of<CheckpointError>([&] { synthesize_checkpoint(out, small_synth_layers()); })},
           {outf, error_of<CheckpointError>([&] { quantize_file(t.path / "in" / "model.safetensors", outf, "", quiet()); })}}) {
    EXPECT_EQ(e.rfind(path.string() + ": cannot create the output: ", 0), 0u) << e;
    EXPECT_EQ(e.find(".tmp."), std::string::npos) << e;
  }
}

TEST(Synth, NegativeOverridesAreRejected) {
  SynthOptions o = small_synth_layers();
  o.hidden_size = -5;
  EXPECT_NE(error_of<std::invalid_argument>([&] { synth_config(o); }).find("hidden_size override -5 is negative"),
            std::string::npos);
  o = small_synth_layers();
  o.num_experts = -1;
  EXPECT_NE(error_of<std::invalid_argument>([&] { synth_config(o); }).find("num_experts override -1"), std::string::npos);
  o = small_synth_layers();
  o.moe_intermediate_size = -64;
  EXPECT_NE(error_of<std::invalid_argument>([&] { synth_config(o); }).find("moe_intermediate_size override -64"),
            std::string::npos);
}

// nu is limited to (2, 1e6]: beyond it the sampler's lgamma difference cancels (--nu 1e16 gives NaN
// weights, 1e15 a wrong distribution).
TEST(Synth, StudentNuOutsideItsRangeIsRefusedBeforeWriting) {
  TempDir t;
  for (const double nu : {1e16, 1e7, 2.0, -1.0}) {
    SynthOptions o = small_synth_layers();
    o.student_nu = nu;
    const std::string e = error_of<std::invalid_argument>([&] { synthesize_checkpoint(t.path / "x", o); });
    EXPECT_NE(e.find("student_nu must be in (2, 1e6]"), std::string::npos) << nu << ": " << e;
    EXPECT_FALSE(fs::exists(t.path / "x")) << nu;
  }
  SynthOptions o = small_synth_layers();
  o.student_nu = 1e6;  // the largest accepted: finite weights, about unit-variance scaled like the others
  synthesize_checkpoint(t.path / "ok", o);
  const QuantizeSummary q = quantize_checkpoint(t.path / "ok", t.path / "okq", quiet());  // throws on a NaN weight
  EXPECT_GT(q.weights, 0);
  EXPECT_TRUE(std::isfinite(q.stats.sqnr_db()));
}

TEST(Synth, PlannedBytesEqualTheBytesWritten) {
  TempDir t;
  for (ModelFamily f : {ModelFamily::qwen3_moe, ModelFamily::qwen2_moe, ModelFamily::deepseek_v3}) {
    SynthOptions o = small_synth_layers(2);
    o.family = f;
    o.stacked = f == ModelFamily::qwen2_moe;
    const std::uint64_t planned = synth_checkpoint_bytes(o);
    const fs::path dir = t.path / std::string(family_name(f));
    EXPECT_EQ(synthesize_checkpoint(dir, o), planned);
    // Against the files: tensor bytes = file sizes minus the headers.
    std::uint64_t tensors = 0;
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().extension() != ".safetensors") continue;
      const SafetensorsFile sf(e.path());
      for (const auto& n : sf.names()) tensors += sf.get(n).nbytes;
    }
    EXPECT_EQ(tensors, planned) << family_name(f);
  }
  // Qwen3 per layer: router E*H + 3 projections of E*I*H, BF16.
  EXPECT_EQ(synth_checkpoint_bytes(small_synth_layers(3)), 3u * 2u * (4u * 128u + 3u * 4u * 64u * 128u));
}

// SynthOptions::on_start (lutb synth's "will write N bytes" line) is never called when a check refuses, called once with the planned bytes when the write starts.
TEST(Synth, OnStartOnlyAfterEveryCheckPassed) {
  TempDir t;
  std::vector<std::uint64_t> calls;
  SynthOptions o = small_synth_layers();
  o.on_start = [&](std::uint64_t b) { calls.push_back(b); };
  fs::create_directories(t.path / "notes");
  std::ofstream(t.path / "notes" / "todo.txt") << "mine";
  o.force = true;
  EXPECT_NE(error_of<CheckpointError>([&] { synthesize_checkpoint(t.path / "notes", o); }).find("does not look like"),
            std::string::npos);
  o.force = false;
  EXPECT_NE(error_of<CheckpointError>([&] { synthesize_checkpoint(t.path / "notes", o); }).find("exists"),
            std::string::npos);
  std::ofstream(t.path / "file") << "x";
  EXPECT_NE(error_of<CheckpointError>([&] { synthesize_checkpoint(t.path / "file" / "out", o); }).find("cannot create"),
            std::string::npos);
  SynthOptions big = o;
  big.layers = 1024;
  big.hidden_size = big.moe_intermediate_size = 65536;
  big.num_experts = 4096;
  EXPECT_NE(error_of<CheckpointError>([&] { synthesize_checkpoint(t.path / "big", big); }).find("needs"),
            std::string::npos);
  EXPECT_TRUE(calls.empty());
  EXPECT_EQ(synthesize_checkpoint(t.path / "ok", o), synth_checkpoint_bytes(o));
  EXPECT_EQ(calls, std::vector<std::uint64_t>{synth_checkpoint_bytes(o)});
}

// ---------------------------------------------------------------------------
// Bad inputs
// ---------------------------------------------------------------------------
// Regression: lutb synth -o "" wrote the whole checkpoint to ".tmp.PID" in the current directory,
// then failed to rename it to "" with a bare filesystem error.
TEST(Synth, EmptyOutputIsRefusedBeforeWriting) {
  SynthOptions o = small_synth_layers();
  bool started = false;
  o.on_start = [&](std::uint64_t) { started = true; };
  EXPECT_EQ(error_of<CheckpointError>([&] { synthesize_checkpoint("", o); }),
            "synth: no output directory given; nothing written");
  EXPECT_FALSE(started);
}

// Regression: synthesize_checkpoint creates missing parents of its output (as mkdir -p); a failed
// or interrupted run removed its temporary but left those parents behind.
TEST(Synth, FailedRunRemovesTheParentsItCreated) {
  TempDir t;
  InterruptFlag flag{SIGINT};
  SynthOptions o = small_synth_layers();
  o.interrupt = &flag;
  EXPECT_NE(error_of<Interrupted>([&] { synthesize_checkpoint(t.path / "new1" / "new2" / "out", o); })
                .find("interrupted by signal 2"),
            std::string::npos);
  EXPECT_TRUE(fs::is_empty(t.path)) << "parents left behind";
  // A parent that existed, or holds something else by then, is kept.
  fs::create_directories(t.path / "kept");
  EXPECT_NE(error_of<Interrupted>([&] { synthesize_checkpoint(t.path / "kept" / "new" / "out", o); }).find("interrupted"),
            std::string::npos);
  EXPECT_EQ(entries(t.path, ""), std::vector<std::string>{"kept"});
  EXPECT_TRUE(fs::is_empty(t.path / "kept"));
  // A successful run keeps them, of course.
  flag = 0;
  synthesize_checkpoint(t.path / "new1" / "new2" / "out", o);
  EXPECT_TRUE(fs::exists(t.path / "new1" / "new2" / "out" / "config.json"));
}

// Regression: a checkpoint whose routed experts are incomplete (an expert's projection missing,
// config.json declaring more experts or layers than stored, half a stacked pair) was quantised into
// a LUT-B checkpoint that lutb eval then refused. Now refused before writing, naming the tensor.
TEST(QuantizeInput, IncompleteRoutedExpertsAreRefused) {
  TempDir t;
  const auto refused = [&](const fs::path& in) {
    const std::string e = error_of<CheckpointError>([&] { quantize_checkpoint(in, t.path / "out", quiet()); });
    EXPECT_TRUE(entries(t.path, "out").empty()) << "something was written";
    return e;
  };
  // One expert's up projection missing (per-expert layout, 4 experts).
  synthesize_checkpoint(t.path / "a", small_synth_layers(1));
  rewrite_safetensors(t.path / "a" / "model.safetensors", {"model.layers.0.mlp.experts.2.up_proj.weight"});
  std::string e = refused(t.path / "a");
  EXPECT_EQ(e, "checkpoint " + (t.path / "a").string() + ": layer 0 is a MoE layer of " +
                   (t.path / "a" / "config.json").string() +
                   " (4 experts, 1 layers) but model.layers.0.mlp.experts.2.up_proj.weight is missing; " +
                   (t.path / "a" / "model.safetensors").string() + " has no such tensor; nothing written");
  // config.json declaring 8 experts where 4 are stored (n_group etc. stay valid).
  synthesize_checkpoint(t.path / "b", small_synth_layers(1));
  edit_config(t.path / "b", [](nlohmann::json& j) { j["num_experts"] = 8; });
  e = refused(t.path / "b");
  EXPECT_NE(e.find("layer 0 is a MoE layer of " + (t.path / "b" / "config.json").string() +
                   " (8 experts, 1 layers) but model.layers.0.mlp.experts.4.gate_proj.weight is missing"),
            std::string::npos)
      << e;
  // config.json declaring 3 layers where 2 are stored.
  synthesize_checkpoint(t.path / "c", small_synth_layers(2));
  edit_config(t.path / "c", [](nlohmann::json& j) { j["num_hidden_layers"] = 3; });
  e = refused(t.path / "c");
  EXPECT_NE(e.find("layer 2 is a MoE layer of " + (t.path / "c" / "config.json").string() +
                   " (4 experts, 3 layers) but model.layers.2.mlp.experts.0.gate_proj.weight is missing (no "
                   "routed-expert tensor of this layer was found)"),
            std::string::npos)
      << e;
  // Stacked layout with the down_proj missing.
  SynthOptions st = small_synth_layers(1);
  st.stacked = true;
  synthesize_checkpoint(t.path / "d", st);
  rewrite_safetensors(t.path / "d" / "model.safetensors", {"model.layers.0.mlp.experts.down_proj"});
  e = refused(t.path / "d");
  EXPECT_NE(e.find("but model.layers.0.mlp.experts.down_proj is missing (its stacked gate_up_proj is present)"),
            std::string::npos)
      << e;
  // The complete checkpoints quantise (the check does not refuse valid input).
  synthesize_checkpoint(t.path / "ok", small_synth_layers(2));
  EXPECT_EQ(quantize_checkpoint(t.path / "ok", t.path / "out", quiet()).tensors_quantized, 2 * 4 * 3);
  fs::remove_all(t.path / "out");
  synthesize_checkpoint(t.path / "oks", st);
  EXPECT_EQ(quantize_checkpoint(t.path / "oks", t.path / "out", quiet()).tensors_quantized, 2);
}

// quantize_checkpoint leaves the unquantised weights in other forms (pytorch_model*.bin, Mistral's
// consolidated.safetensors, original/*.pth) and training state (optimizer.pt, training_args.bin) out
// of the LUT-B checkpoint and lists them; other files (other safetensors data too) are copied.
TEST(QuantizeInput, OtherFormatWeightFilesAreNotCopied) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth_layers(1));
  const fs::path in = t.path / "in";
  fs::create_directories(in / "original");
  for (const char* f : {"pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json", "consolidated.safetensors",
                        "original/consolidated.00.pth", "tf_model.h5", "flax_model.msgpack", "model-q4.gguf",
                        "val_tokens.safetensors", "tokenizer.json", "training_args.bin", "optimizer.pt", "README.md",
                        "original/params.json"})
    std::ofstream(in / f) << "bytes of " << f;
  const QuantizeSummary s = quantize_checkpoint(in, t.path / "out", quiet());
  EXPECT_EQ(s.skipped_files,
            (std::vector<std::string>{"consolidated.safetensors", "flax_model.msgpack", "model-q4.gguf", "optimizer.pt",
                                      "original/consolidated.00.pth", "pytorch_model-00001-of-00002.bin",
                                      "pytorch_model.bin.index.json", "tf_model.h5", "training_args.bin"}));
  for (const auto& f : s.skipped_files) EXPECT_FALSE(fs::exists(t.path / "out" / f)) << f;
  for (const char* f : {"val_tokens.safetensors", "tokenizer.json", "README.md", "original/params.json"}) {
    std::ifstream c(t.path / "out" / f);
    std::string line;
    std::getline(c, line);
    EXPECT_EQ(line, std::string("bytes of ") + f);
  }
  EXPECT_TRUE(Checkpoint(t.path / "out").is_lutb());
  EXPECT_NE(format_summary(s).find("not copied           consolidated.safetensors, flax_model.msgpack, model-q4.gguf, "
                                   "original/consolidated.00.pth, pytorch_model-00001-of-00002.bin, "
                                   "pytorch_model.bin.index.json, tf_model.h5 (the weights in another format); "
                                   "optimizer.pt, training_args.bin (training state)\n"),
            std::string::npos)
      << format_summary(s);
}

// Regression: a tensor name with a layer index beyond 64 bits ended in a bare "stoll" (std::out_of_range).
TEST(QuantizeInput, HugeLayerIndexInATensorName) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth_layers(1));
  const std::string bad = "model.layers.99999999999999999999.mlp.experts.0.gate_proj.weight";
  rewrite_safetensors(t.path / "in" / "model.safetensors", {}, {{bad, OwnedTensor{DType::BF16, {64, 128}, std::vector<std::uint8_t>(64 * 128 * 2)}}});
  const std::string e = error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); });
  EXPECT_EQ(e, (t.path / "in" / "model.safetensors").string() + ": tensor " + bad +
                   " has a layer index that does not fit 63 bits; nothing written");
  EXPECT_TRUE(entries(t.path, "out").empty());
}

// Regression: `lutb quantize DIR/model.safetensors -o OUT_DIR` wrote a safetensors file named OUT_DIR.
TEST(QuantizeInput, FileOutputMustBeNamedSafetensors) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth_layers(1));
  for (const char* name : {"out", "out.json", "out.safetensors.tmp"}) {
    const std::string e = error_of<CheckpointError>(
        [&] { quantize_file(t.path / "in" / "model.safetensors", t.path / name, "", quiet()); });
    EXPECT_EQ(e, (t.path / name).string() +
                     ": the output of one quantised file must be named *.safetensors (to write a checkpoint "
                     "directory, give the input checkpoint directory); nothing written");
  }
  EXPECT_EQ(entries(t.path, "out"), std::vector<std::string>{});
  quantize_file(t.path / "in" / "model.safetensors", t.path / "out.safetensors", "", quiet());
  EXPECT_TRUE(fs::is_regular_file(t.path / "out.safetensors"));
}

// Regression: quantization_config.logical_shapes contradicting config.json was silently ignored.
TEST(QuantizeInput, LogicalShapesMustAgreeWithConfig) {
  TempDir t;
  SynthOptions o = small_synth_layers(1);
  o.hidden_size = 100;  // padded: K 100 -> 128 for gate/up, N 100 -> 104 for down
  o.moe_intermediate_size = 64;
  synthesize_checkpoint(t.path / "in", o);
  quantize_checkpoint(t.path / "in", t.path / "q", quiet());
  const std::string gate = "model.layers.0.mlp.experts.1.gate_proj.weight";
  EXPECT_EQ(Checkpoint(t.path / "q").quant_config()->logical_shapes.at(gate), (std::vector<std::int64_t>{64, 100}));
  EXPECT_EQ(Checkpoint(t.path / "q").lutb_projection(0, Proj::gate).shape.cols, 100);  // as written: fine
  edit_config(t.path / "q", [&](nlohmann::json& j) { j["quantization_config"]["logical_shapes"][gate] = {64, 96}; });
  const Checkpoint ck(t.path / "q");
  EXPECT_EQ(error_of<CheckpointError>([&] { ck.lutb_projection(0, Proj::gate); }),
            "checkpoint " + (t.path / "q").string() + ": config.json key 'quantization_config.logical_shapes." + gate +
                "' (layer 0, expert 1) is [64, 96], but hidden_size 100 and the expert width 64 give [64, 100]");
  EXPECT_NE(error_of<CheckpointError>([&] { ck.lutb_experts(0); }).find("is [64, 96]"), std::string::npos);
}

}  // namespace
}  // namespace lutb

namespace lutb {
namespace {

// The safetensors format does not align tensor data, so the F16 fit path and the F64 conversion must
// not read it through typed pointers (a misaligned load, which UBSan aborts on in the asan preset). A
// file whose F16 and F64 tensors start at odd addresses must
// quantise to the same bytes as the same values in FP32.
TEST(QuantizeFile, MisalignedF16AndF64TensorData) {
  test::TempDir t;
  constexpr int kN = 8, kK = 64, kNum = kN * kK;
  std::vector<float> v(kNum);
  for (int i = 0; i < kNum; ++i) v[i] = fp16_to_float(fp16_from_float(0.001f * static_cast<float>(i % 97) - 0.05f));
  std::string data(1, '\x07');  // one U8 byte first: every later tensor starts at an odd offset
  for (int i = 0; i < kNum; ++i) {
    const std::uint16_t h = fp16_from_float(v[i]);
    data.append(reinterpret_cast<const char*>(&h), 2);
  }
  for (int i = 0; i < kNum; ++i) {
    const double d = v[i];
    data.append(reinterpret_cast<const char*>(&d), 8);
  }
  std::string header = R"({"pad":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                       R"("a.weight":{"dtype":"F16","shape":[8,64],"data_offsets":[1,1025]},)"
                       R"("b.weight":{"dtype":"F64","shape":[8,64],"data_offsets":[1025,5121]}})";
  while ((8 + header.size()) % 8 != 0) header += ' ';  // the data section starts 8-aligned
  const std::uint64_t hlen = header.size();
  const fs::path in = t.path / "odd.safetensors", out = t.path / "odd_q.safetensors";
  {
    std::ofstream f(in, std::ios::binary);
    f.write(reinterpret_cast<const char*>(&hlen), 8);
    f << header << data;
  }
  {
    const SafetensorsFile sf(in);
    ASSERT_EQ(reinterpret_cast<std::uintptr_t>(sf.get("a.weight").data) % 2, 1u);  // the case under test
    ASSERT_EQ(reinterpret_cast<std::uintptr_t>(sf.get("b.weight").data) % 8, 1u);
  }
  quantize_file(in, out, "weight$", quiet());
  FitOptions fo;
  fo.threads = 1;
  const LutbTensor ref = quantize(v.data(), LutbShape{1, kN, kK, false}, fo, nullptr, "ref");
  const SafetensorsFile q(out);
  for (const char* name : {"a.weight", "b.weight"}) {
    SCOPED_TRACE(name);
    const TensorView& p = q.get(std::string(name) + "_packed");
    const TensorView& c = q.get(std::string(name) + "_codebook");
    const TensorView& s = q.get(std::string(name) + "_scale");
    EXPECT_EQ(std::vector<std::uint8_t>(p.data, p.data + p.nbytes), ref.packed);
    EXPECT_EQ(std::vector<std::uint8_t>(c.data, c.data + c.nbytes), ref.codebook);
    EXPECT_EQ(std::vector<std::uint8_t>(s.data, s.data + s.nbytes), ref.scale);
  }
}

}  // namespace
}  // namespace lutb
