// Input paths of the commands: named pipes, empty and missing paths, unreadable files and folders,
// shard indexes, and what the input is when it is neither a checkpoint folder nor a safetensors file.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <string>
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
using test::run;
using test::small_synth;
using test::TempDir;

// Runs `fn` (which should refuse the named pipe `fifo`) with a deadline. A reader that blocks in
// open() is released by opening the pipe for writing, so the test never hangs: it fails instead.
std::string refused_without_waiting(const fs::path& fifo, const std::function<void()>& fn) {
  auto fut = std::async(std::launch::async, [&]() -> std::string {
    try {
      fn();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no exception";
  });
  if (fut.wait_for(std::chrono::seconds(20)) == std::future_status::ready) return fut.get();
  const int w = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);  // lets the blocked open() return
  if (w >= 0) ::close(w);
  return "blocked on the named pipe: " + fut.get();
}

// Writes a two-shard checkpoint folder whose index names shard 1 as `first_name` for tensor a and as
// "model-00001-of-00002.safetensors" for tensor b.
void write_sharded(const fs::path& dir, const std::string& first_name) {
  fs::create_directories(dir);
  const OwnedTensor x{DType::F32, {2}, std::vector<std::uint8_t>(8, 0)};
  write_safetensors(dir / "model-00001-of-00002.safetensors", {{"a", x}, {"b", x}});
  write_safetensors(dir / "model-00002-of-00002.safetensors", {{"c", x}});
  const nlohmann::json index = {{"metadata", nlohmann::json::object()},
                                {"weight_map",
                                 {{"a", first_name},
                                  {"b", "model-00001-of-00002.safetensors"},
                                  {"c", "model-00002-of-00002.safetensors"}}}};
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
}

std::string open_dir_error(const fs::path& dir) {
  return error_of([&] { (void)SafetensorsCollection::open_dir(dir); });
}

// `lutb ARGS` as an unprivileged user: root reads files whatever their mode, so as root the tool runs
// as nobody (uid 65534) through setpriv. "" when that is not possible (no setpriv, or nobody cannot
// run the tool): the caller skips.
std::string unprivileged_prefix() {
  if (::geteuid() != 0) return " ";
  return test::can_run_as_nobody() ? test::kAsNobody : std::string();
}

// A synthetic checkpoint (lutb synth's, as nobody can read it) in a folder nobody can enter.
fs::path open_folder(const TempDir& t) {
  fs::permissions(t.path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                              fs::perms::others_read | fs::perms::others_exec);
  SynthOptions o = small_synth();
  const fs::path m = t.path / "m";
  synthesize_checkpoint(m, o);
  return m;
}

// A named pipe as model.safetensors, config.json, the index or the tokens file is refused as not a regular
// file: open() would block until a writer appears, and a first SIGTERM only sets a flag while open() restarts.
TEST(CliInputPaths, NamedPipesAreRefusedNotWaitedOn) {
  TempDir t;
  const fs::path dir = t.path / "m";
  fs::create_directories(dir);
  const fs::path weights = dir / "model.safetensors", config = dir / "config.json";
  ASSERT_EQ(::mkfifo(weights.c_str(), 0644), 0);
  ASSERT_EQ(::mkfifo(config.c_str(), 0644), 0);
  EXPECT_EQ(refused_without_waiting(weights, [&] { SafetensorsFile f(weights); }),
            weights.string() + ": is a named pipe (FIFO), not a regular file");
  EXPECT_EQ(refused_without_waiting(config, [&] { (void)model::TransformerConfig::load(dir); }),
            config.string() + ": is a named pipe (FIFO); the checkpoint's config.json must be a regular file");
  EXPECT_EQ(refused_without_waiting(config, [&] { (void)load_model_config(dir); }),
            config.string() + ": is a named pipe (FIFO); the checkpoint's config.json must be a regular file");
  const fs::path index = dir / "model.safetensors.index.json";
  ASSERT_EQ(::mkfifo(index.c_str(), 0644), 0);
  EXPECT_EQ(refused_without_waiting(index, [&] { (void)SafetensorsCollection::open_dir(dir); }),
            index.string() + ": is a named pipe (FIFO); the index must be a regular file");
  EXPECT_EQ(detail::non_regular_kind(dir), "a directory");
  EXPECT_EQ(detail::non_regular_kind(dir / "absent"), "");

  // The CLI, end to end: lutb eval read config.json for --quant's default before the loader did.
  // `timeout` kills a run that blocks (exit status 137), which the assertions report.
  const test::CliResult r = test::run_cli("eval " + test::q(dir) + " --threads 1", "timeout -s KILL 30");
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.err, "lutb: error: " + config.string() +
                       ": is a named pipe (FIFO); the checkpoint's config.json must be a regular file\n");
}

// Index entries are read as transformers reads them: one shard named two ways
// ("./model-00001-of-00002.safetensors" and without "./") is one file. An empty weight_map is named as such,
// and a shard that is not a safetensors file (the folder itself, config.json) is reported with the index entry
// that names it.
TEST(CliInputPaths, ShardIndexEntriesReadAsTransformersDoes) {
  TempDir t;
  const fs::path d = t.path / "d";
  write_sharded(d, "./model-00001-of-00002.safetensors");
  EXPECT_EQ(open_dir_error(d), "no exception");
  const SafetensorsCollection c = SafetensorsCollection::open_dir(d);
  EXPECT_EQ(c.files().size(), 2u);
  EXPECT_EQ(&c.file_of("a"), &c.file_of("b"));
  EXPECT_EQ(c.get("c").nbytes, 8u);

  const fs::path index = d / "model.safetensors.index.json";
  std::ofstream(index) << R"({"metadata": {}, "weight_map": {}})";
  EXPECT_EQ(open_dir_error(d), index.string() +
                                   ": 'weight_map' is empty: it lists no tensor (an index must name the shard of "
                                   "every tensor)");

  std::ofstream(index) << R"({"weight_map": {"a": ".", "b": "model-00001-of-00002.safetensors"}})";
  EXPECT_EQ(open_dir_error(d), index.string() + ": weight_map entry 'a' names shard '.', which cannot be read: " +
                                   (d / ".").string() + ": is a directory, not a regular file");
}

// Empty path arguments are usage errors naming the option, and a model folder that does not exist is named as
// missing, before the default activations file is looked for.
TEST(CliInputPaths, EmptyAndMissingPathsNamed) {
  const std::string kUsageHint = "Run 'lutb --help' (or 'lutb COMMAND --help') for the options.\n";
  TempDir t;
  const fs::path in = t.path / "in.safetensors";
  write_safetensors(in, {{"w", OwnedTensor{DType::F32, {8, 64}, std::vector<std::uint8_t>(8 * 64 * 4, 0)}}});
  test::CliResult r = test::run_cli("quantize " + test::q(in) + " -o '' --no-progress");
  // Usage errors: exit status 2 and the --help hint (README "Exit status").
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lutb: error: --output: an empty output name was given\n" + kUsageHint);
  r = test::run_cli("quantize '' -o " + test::q(t.path / "o.safetensors") + " --no-progress");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lutb: error: input: an empty input name was given\n" + kUsageHint);
  r = test::run_cli("eval ''");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lutb: error: model_dir: an empty checkpoint directory name was given\n" + kUsageHint);
  r = test::run_cli("moe '' --layer 0");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lutb: error: model_dir: an empty checkpoint directory name was given\n" + kUsageHint);
  const fs::path absent = t.path / "no-such-model";
  r = test::run_cli("moe " + test::q(absent) + " --layer 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "lutb: error: " + absent.string() +
                       ": no such directory (a model is a Hugging Face checkpoint directory holding config.json and "
                       "*.safetensors)\n");
  r = test::run_cli("moe " + test::q(in) + " --layer 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "lutb: error: " + in.string() +
                       ": not a directory (a model is a Hugging Face checkpoint directory holding config.json and "
                       "*.safetensors)\n");
}

// Shards in subfolders with the same file name (a/w.safetensors, b/w.safetensors) are written at the index's
// relative paths: written flat, the second would overwrite the first and the index would list tensors in a
// file that does not hold them. The original shards are not copied beside them.
TEST(CliInputPaths, QuantizeKeepsShardsInSubfolders) {
  TempDir t;
  const fs::path bf = t.path / "bf", out = t.path / "lb";
  SynthOptions o = small_synth();
  synthesize_checkpoint(bf, o);
  std::vector<std::pair<std::string, OwnedTensor>> a, b;
  {
    const SafetensorsFile f(bf / "model.safetensors");
    for (const auto& n : f.names()) {
      const TensorView& v = f.get(n);
      (n.find(".experts.0.") != std::string::npos || n.find(".experts.1.") != std::string::npos ? a : b)
          .push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
  }
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  fs::remove(bf / "model.safetensors");
  fs::create_directories(bf / "a");
  fs::create_directories(bf / "b");
  write_safetensors(bf / "a" / "w.safetensors", a);
  write_safetensors(bf / "b" / "w.safetensors", b);
  nlohmann::json wm = nlohmann::json::object();
  for (const auto& [n, _] : a) wm[n] = "a/w.safetensors";
  for (const auto& [n, _] : b) wm[n] = "b/w.safetensors";
  std::ofstream(bf / "model.safetensors.index.json") << nlohmann::json{{"weight_map", wm}}.dump();

  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  const QuantizeSummary s = quantize_checkpoint(bf, out, q);
  EXPECT_TRUE(s.warnings.empty()) << fmt::format("{}", fmt::join(s.warnings, "\n"));
  EXPECT_FALSE(fs::exists(out / "w.safetensors"));
  const SafetensorsCollection c = SafetensorsCollection::open_dir(out);
  EXPECT_EQ(c.files().size(), 2u);
  EXPECT_EQ(c.file_of("model.layers.0.mlp.experts.0.gate_proj.weight_packed").path(), out / "a" / "w.safetensors");
  EXPECT_EQ(c.file_of("model.layers.0.mlp.experts.3.down_proj.weight_scale").path(), out / "b" / "w.safetensors");
  // Every tensor of the output is LUT-B or one of the source's non-expert tensors: no unquantised expert.
  for (const auto& n : c.names()) EXPECT_EQ(n.find("_proj.weight"), n.find("_proj.weight_")) << n;
}

// quantize, eval and moe of checkpoint `m`, run through `as` (an unprivileged user): each fails (exit status
// 1) printing `want` and none of `not_said`; quantize's output `out` is not created.
void expect_each_command_refuses(const fs::path& m, const fs::path& out, const std::string& as, const std::string& want,
                                 const std::vector<std::string>& not_said) {
  for (const std::string& args : {"quantize " + q(m) + " -o " + q(out) + " --no-progress",
                                  "eval " + q(m) + " --max-windows 1", "moe " + q(m) + " --layer 0"}) {
    const CliOut r = run(args, as);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, want)) << args << "\n" << r.out;
    for (const std::string& n : not_said) EXPECT_FALSE(has(r, n)) << args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(out));
}

// A config.json that cannot be read (mode 000) is named with the reason (permission denied) by quantize, moe
// and eval alike, not as missing.
TEST(CliInputPaths, UnreadableConfigJsonSaysWhy) {
  const std::string as = unprivileged_prefix();
  if (as.empty()) GTEST_SKIP() << "running as root without a way to drop privileges (setpriv)";
  TempDir t;
  const fs::path m = open_folder(t);
  const fs::path config = m / "config.json";
  fs::permissions(config, fs::perms::none);
  expect_each_command_refuses(m, t.path / "lb", as, "lutb: error: " + config.string() + ": cannot open: Permission denied",
                              {"no config.json", "not a Hugging Face checkpoint directory"});
}

// A checkpoint folder of mode 0 is named with the reason, not the library's "filesystem error: status:
// Permission denied [...]".
TEST(CliInputPaths, FolderWithoutPermissionsNamed) {
  const std::string as = unprivileged_prefix();
  if (as.empty()) GTEST_SKIP() << "running as root without a way to drop privileges (setpriv)";
  TempDir t;
  const fs::path m = open_folder(t);
  fs::permissions(m, fs::perms::none);
  expect_each_command_refuses(
      m, t.path / "lb", as,
      "lutb: error: " + m.string() + ": cannot look inside the checkpoint directory: Permission denied",
      {"filesystem error"});
  fs::permissions(m, fs::perms::owner_all);  // for TempDir's removal as non-root
}

// `lutb quantize /dev/null -o x.safetensors` (or a FIFO) names what the input is (a character device, a FIFO),
// not "no such checkpoint directory or file".
TEST(CliInputPaths, QuantizeNamesWhatTheInputIs) {
  TempDir t;
  const fs::path fifo = t.path / "in.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const std::string out = " -o " + q(t.path / "x.safetensors") + " --no-progress";
  CliOut r = test::run("quantize /dev/null" + out);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(r.out, "lutb: error: /dev/null: is a character device, not a checkpoint directory or a regular "
                   ".safetensors file\n");
  r = test::run("quantize " + q(fifo) + out);
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_EQ(r.out, "lutb: error: " + fifo.string() +
                       ": is a named pipe (FIFO), not a checkpoint directory or a regular .safetensors file\n");
  EXPECT_FALSE(fs::exists(t.path / "x.safetensors"));
}

}  // namespace
}  // namespace lutb
