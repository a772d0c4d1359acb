// Output paths: names too long, link loops, symbolic links, trailing dots, missing parents, names
// ending in .safetensors, outputs that --force would not replace, inputs linked into the output; every
// refusal comes before the work and leaves an existing output as it was.
#include <gtest/gtest.h>

#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

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
using test::CliResult;
using test::entries;
using test::error_of;
using test::has;
using test::kSynthAnyWidth;
using test::kSynthTo;
using test::poke_bytes;
using test::q;
using test::quiet;
using test::quiet_one_thread;
using test::read_file;
using test::run;
using test::run_cli;
using test::small_checkpoint;
using test::small_synth;
using test::TempDir;

// One 8 x 64 BF16 tensor "w" (values 1..512 / 512).
fs::path small_file(const fs::path& dir) {
  std::vector<std::uint8_t> bytes;
  for (int i = 0; i < 512; ++i) {
    const float f = static_cast<float>(i + 1) / 512.0f;
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    bytes.push_back(static_cast<std::uint8_t>(u >> 16));
    bytes.push_back(static_cast<std::uint8_t>(u >> 24));
  }
  const fs::path p = dir / "in.safetensors";
  write_safetensors(p, {{"w", OwnedTensor{DType::BF16, {8, 64}, bytes}}});
  return p;
}

// An input whose files link into the output folder is refused even with --force: `quantize inp -o victim
// --force`, with inp/model.safetensors a link to victim/model.safetensors, would replace the only copy of the
// BF16 weights. The checks compare the files read, not only the folders.
TEST(OutputPaths, InputLinkIntoTheOutputIsRefused) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthTo + q(t.path / "victim")).code, 0);
  const std::string before = read_file(t.path / "victim" / "model.safetensors");
  fs::create_directories(t.path / "inp");
  fs::copy_file(t.path / "victim" / "config.json", t.path / "inp" / "config.json");
  fs::create_symlink("../victim/model.safetensors", t.path / "inp" / "model.safetensors");
  const CliOut r = run("quantize " + q(t.path / "inp") + " -o " + q(t.path / "victim") + " --force --no-progress");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: " + (t.path / "victim").string() + ": the input " + (t.path / "inp").string() +
                         " reads " + (t.path / "inp" / "model.safetensors").string() +
                         " through a link into the output ("))
      << r.out;
  EXPECT_TRUE(has(r, "replacing the output would delete it; choose another output; nothing written")) << r.out;
  EXPECT_EQ(read_file(t.path / "victim" / "model.safetensors"), before);
  // A link to a folder inside the output is the same.
  fs::remove(t.path / "inp" / "model.safetensors");
  fs::copy_file(t.path / "victim" / "model.safetensors", t.path / "inp" / "model.safetensors");
  fs::create_directories(t.path / "victim" / "extra");
  fs::create_directory_symlink("../victim/extra", t.path / "inp" / "extra");
  const CliOut d = run("quantize " + q(t.path / "inp") + " -o " + q(t.path / "victim") + " --force --no-progress");
  EXPECT_EQ(d.code, 1) << d.out;
  EXPECT_TRUE(has(d, "through a link into the output")) << d.out;
  // A link elsewhere is fine.
  fs::remove(t.path / "inp" / "extra");
  const CliOut ok = run("quantize " + q(t.path / "inp") + " -o " + q(t.path / "out") + " --no-progress");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// `-o newq/.` names the folder newq: the output lands there, with or without an existing output and --force,
// and no temporary is left behind; `-o X/..` is refused at once, before anything is created.
TEST(OutputPaths, OutputGivenWithTrailingDot) {
  test::TempDir t;
  const CliOut s = run(kSynthTo + q(t.path / "s") + "/.");
  ASSERT_EQ(s.code, 0) << s.out;
  EXPECT_TRUE(fs::is_regular_file(t.path / "s" / "config.json")) << s.out;
  const CliOut a = run("quantize " + q(t.path / "s") + " -o " + q(t.path / "newq") + "/. --no-progress");
  EXPECT_EQ(a.code, 0) << a.out;
  EXPECT_TRUE(fs::is_regular_file(t.path / "newq" / "config.json")) << a.out;
  const CliOut b = run("quantize " + q(t.path / "s") + " -o " + q(t.path / "newq") + "/./ --force --no-progress");
  EXPECT_EQ(b.code, 0) << b.out;
  const CliOut f = run("quantize " + q(t.path / "s" / "model.safetensors") + " -o " + q(t.path / "f.safetensors") +
                       "/. --no-progress");
  EXPECT_EQ(f.code, 0) << f.out;
  EXPECT_TRUE(fs::is_regular_file(t.path / "f.safetensors")) << f.out;
  for (const auto& e : fs::directory_iterator(t.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  // "-o n6/x/.." cannot be renamed into place at the end of the job: every writer refuses it at once,
  // and nothing is created.
  const std::string dots = q(t.path / "n6") + "/x/..";
  for (const std::string& args : {"quantize " + q(t.path / "s") + " -o " + dots + " --no-progress",
                                  "quantize " + q(t.path / "s" / "model.safetensors") + " -o " + dots + " --no-progress",
                                  kSynthTo + dots}) {
    const CliOut r = run(args);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, "/n6/x/..: an output path may not end in '..'; give the folder by its own name; nothing "
                       "written"))
        << r.out;
    EXPECT_FALSE(has(r, "will write")) << r.out;
    EXPECT_FALSE(fs::exists(t.path / "n6")) << args;
  }
}

// lutb quantize and lutb synth refuse a checkpoint folder named *.safetensors, writing nothing: a usage
// error (exit status 2), as calibrate's output not named *.safetensors is.
TEST(OutputPaths, CommandsRefuseACheckpointNamedSafetensors) {
  test::TempDir t;
  ASSERT_EQ(run(kSynthAnyWidth + "--moe-intermediate-size 64 -o " + q(t.path / "in")).code, 0);
  const CliOut r = run("quantize " + q(t.path / "in") + " -o " + q(t.path / "q.safetensors") + " --no-progress");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: -o " + (t.path / "q.safetensors").string() +
                         ": a checkpoint directory must not be named *.safetensors"))
      << r.out;
  EXPECT_FALSE(fs::exists(t.path / "q.safetensors"));
  const CliOut s = run(kSynthAnyWidth + "--moe-intermediate-size 64 -o " + q(t.path / "s.safetensors"));
  EXPECT_EQ(s.code, 2) << s.out;
  EXPECT_TRUE(has(s, ": a checkpoint directory must not be named *.safetensors")) << s.out;
  EXPECT_FALSE(fs::exists(t.path / "s.safetensors"));
}

// `lutb quantize -o missing/x` creates the missing parent as `lutb synth -o missing/x` does (still writing to
// a temporary name and renaming), in checkpoint and in file mode.
TEST(OutputPaths, QuantizeCreatesAMissingParentAsSynthDoes) {
  LUTB_MODEL_OR_SKIP(model, "tiny-mixtral");
  TempDir t;
  const fs::path out = t.path / "a" / "b" / "q";
  CliResult r = run_cli("quantize " + test::q(model) + " -o " + test::q(out) + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(out / "config.json"));
  EXPECT_TRUE(fs::is_regular_file(out / "model.safetensors"));
  for (const auto& e : fs::directory_iterator(t.path / "a" / "b"))  // only q: no temporary left
    EXPECT_EQ(e.path().filename(), "q");
  const fs::path file = t.path / "c" / "d" / "acts.safetensors";
  r = run_cli("quantize " + test::q(model / "moe_activations.safetensors") + " -o " + test::q(file) + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(file));
  // synth, for comparison: the same behaviour.
  r = run_cli("synth --family mixtral --layers 1 --hidden-size 64 --moe-intermediate-size 64 --experts 2 -o " +
              test::q(t.path / "e" / "f" / "s") + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(t.path / "e" / "f" / "s" / "config.json"));
}

// An existing output that --force would not replace either (a folder of other files, the current folder) is
// refused with the --force check's reason at once, not with advice to use --force that leads to a second
// refusal.
TEST(OutputPaths, ExistingOutputThatForceWouldNotReplaceSaysSoAtOnce) {
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

// A fit error with --force over an existing output ends with "OUT is as it was", not "nothing written", and
// the old output is still there.
TEST(OutputPaths, FitErrorOverAnExistingOutputSaysItIsAsItWas) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
  QuantizeOptions f = quiet();
  f.force = true;
  quantize_checkpoint(t.path / "in", t.path / "out", quiet());  // the old output
  const fs::path file = t.path / "in" / "model.safetensors";
  const std::string n = "model.layers.0.mlp.experts.1.down_proj.weight";
  const std::uint16_t nan = 0x7fc0;
  poke_bytes(file, n, (100 * 64 + 3) * 2, &nan, 2);
  EXPECT_EQ(error_of<std::invalid_argument>([&] { quantize_checkpoint(t.path / "in", t.path / "out", f); }),
            file.string() + ": tensor " + n + ", tile (12, 0): NaN at row 100 col 3; " + (t.path / "out").string() +
                " is as it was");
  EXPECT_TRUE(fs::exists(t.path / "out" / "config.json"));
  EXPECT_FALSE(fs::exists(t.path / ("out.tmp." + std::to_string(::getpid()))));
}

// The library refuses a checkpoint folder named like one safetensors file (`quantize MODEL_DIR -o
// q.safetensors`, `synth -o s.safetensors`).
TEST(OutputPaths, CheckpointFolderNamedSafetensorsIsRefused) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
  for (const std::string out : {"q.safetensors", "q.safetensors/"}) {
    EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / out, quiet()); }),
              (t.path / "q.safetensors").string() +
                  ": a checkpoint directory must not be named *.safetensors (readers take that name for one "
                  "safetensors file; to quantise the tensors of one file, give that .safetensors file as the "
                  "input); nothing written");
    EXPECT_FALSE(fs::exists(t.path / "q.safetensors"));
  }
  EXPECT_EQ(error_of<CheckpointError>([&] { synthesize_checkpoint(t.path / "s.safetensors", small_synth()); }),
            (t.path / "s.safetensors").string() +
                ": a checkpoint directory must not be named *.safetensors (readers take that name for one "
                "safetensors file; a checkpoint is a folder of config.json and *.safetensors files); nothing written");
  EXPECT_FALSE(fs::exists(t.path / "s.safetensors"));
}

// With an existing output and an invalid --match, quantize_file reports the regex first: the output check
// would send the user to remove the output only to learn then that the regex is invalid.
TEST(OutputPaths, InvalidMatchIsReportedBeforeTheOutput) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
  const fs::path out = t.path / "out.safetensors";
  std::ofstream(out) << "old";
  EXPECT_TRUE(has(error_of<std::invalid_argument>(
                      [&] { quantize_file(t.path / "in" / "model.safetensors", out, "experts.(", quiet()); }),
                  "--match \"experts.(\": invalid regular expression"));
  // The output is untouched.
  std::ifstream in(out);
  std::string s;
  in >> s;
  EXPECT_EQ(s, "old");
}

// An output given as a symbolic link (to a folder that exists, or dangling) is refused as a link, with its
// target: lutb renames the output into place, which would replace the link, not its target.
TEST(OutputPaths, OutputGivenAsASymlinkIsNamedAsOne) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small_synth());
  fs::create_directory(t.path / "real");
  fs::create_directory_symlink(t.path / "real", t.path / "link");
  fs::create_symlink(t.path / "nowhere", t.path / "dangling");
  const std::string tail =
      "; lutb does not write through a link (the output is renamed into place, which would replace the link, not its "
      "target): give the target itself as the output";
  for (const bool force : {false, true}) {
    QuantizeOptions o = quiet();
    o.force = force;
    EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "link", o); }),
              (t.path / "link").string() + ": is a symbolic link (to " + (t.path / "real").string() + ")" + tail + " (" +
                  (t.path / "real").string() + "), or remove the link; nothing written");
    EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "dangling", o); }),
              (t.path / "dangling").string() + ": is a symbolic link (to " + (t.path / "nowhere").string() +
                  ", which does not exist)" + tail + ", or remove the link; nothing written");
    SynthOptions so = small_synth();
    so.force = force;
    EXPECT_TRUE(has(error_of<CheckpointError>([&] { synthesize_checkpoint(t.path / "link", so); }),
                    ": is a symbolic link (to "));
  }
  // File mode: a link to a .safetensors file, with --force.
  std::ofstream(t.path / "old.safetensors") << "x";
  fs::create_symlink("old.safetensors", t.path / "flink.safetensors");
  QuantizeOptions o = quiet();
  o.force = true;
  EXPECT_EQ(error_of<CheckpointError>(
                [&] { quantize_file(t.path / "in" / "model.safetensors", t.path / "flink.safetensors", "", o); }),
            (t.path / "flink.safetensors").string() + ": is a symbolic link (to old.safetensors)" + tail + " (" +
                (t.path / "old.safetensors").string() + "), or remove the link; nothing written");
  EXPECT_TRUE(fs::is_empty(t.path / "real"));
  EXPECT_TRUE(fs::is_symlink(t.path / "flink.safetensors"));
}

// An output name too long for the file system, or one reached through a loop of links, is refused as such:
// path_within's weakly_canonical fails on it, and an empty result must not be taken for "/" (which would
// report "the output contains the input").
TEST(OutputPaths, UnresolvableOutputsAreNamedForWhatTheyAre) {
  TempDir t;
  const fs::path in = small_file(t.path);
  const std::string huge(300, 'n');
  fs::create_directory_symlink("loop", t.path / "loop");  // loop -> loop
  const auto before = entries(t.path);
  for (const fs::path& out : {t.path / (huge + ".safetensors"), t.path / "loop" / "x.safetensors"}) {
    const std::string m = error_of([&] { quantize_file(in, out, "", quiet_one_thread()); });
    EXPECT_EQ(m.find("contains the input"), std::string::npos) << m;
    EXPECT_EQ(m.rfind(out.string() + ": cannot be used as the output: ", 0), 0u) << m;
    EXPECT_NE(m.find("nothing written"), std::string::npos) << m;
  }
  EXPECT_NE(error_of([&] { quantize_file(in, t.path / (huge + ".safetensors"), "", quiet_one_thread()); })
                .find("File name too long (a file or folder name may have at most 255 bytes"),
            std::string::npos);
  EXPECT_NE(error_of([&] { quantize_file(in, t.path / "loop" / "x.safetensors", "", quiet_one_thread()); })
                .find("Too many levels of symbolic links"),
            std::string::npos);
  // Checkpoint mode and synth: the same check, before anything else looks at the output.
  const fs::path ck = t.path / "ck";
  fs::create_directory(ck);
  const std::string mq = error_of([&] { quantize_checkpoint(ck, t.path / huge, quiet_one_thread()); });
  EXPECT_EQ(mq.rfind((t.path / huge).string() + ": cannot be used as the output: File name too long", 0), 0u) << mq;
  const std::string ms = error_of([&] { synthesize_checkpoint(t.path / "loop" / "y", test::synth_options(64, 64, 2)); });
  EXPECT_EQ(ms.rfind((t.path / "loop" / "y").string() + ": cannot be used as the output: ", 0), 0u) << ms;
  fs::remove(ck);
  EXPECT_EQ(entries(t.path), before);
}

// A single-file output whose own name fits the limit but whose temporaries (OUT.tmp.PID, and the writer's
// OUT.tmp.PID.tmp.PID: 236-245 bytes with a 5-digit process id) do not is refused before anything is written,
// saying how long the output name may be.
TEST(OutputPaths, TemporaryNameTooLongSaysHowLongTheOutputMayBe) {
  TempDir t;
  const fs::path in = small_file(t.path);
  const long limit = ::pathconf(t.path.c_str(), _PC_NAME_MAX);
  ASSERT_GT(limit, 40);
  const std::size_t suffix = std::string(".tmp." + std::to_string(::getpid())).size();
  const auto before = entries(t.path);
  // Own name one byte below the limit (the first temporary is too long), then one that leaves room
  // for the first temporary only (the writer's nested one is too long).
  for (std::size_t own : {static_cast<std::size_t>(limit) - 1, static_cast<std::size_t>(limit) - suffix}) {
    const fs::path out = t.path / (std::string(own - 12, 'a') + ".safetensors");
    ASSERT_EQ(out.filename().string().size(), own);
    const std::string m = error_of([&] { quantize_file(in, out, "", quiet_one_thread()); });
    EXPECT_EQ(m.rfind(out.string() + ": cannot create the output: File name too long: lutb writes the output under "
                                     "the temporary name ",
                      0),
              0u)
        << m;
    const std::size_t fits = static_cast<std::size_t>(limit) - 2 * suffix;
    EXPECT_NE(m.find(fmt::format("choose an output name of at most {} bytes (this one has {})", fits, own)),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("nothing written"), std::string::npos) << m;
    EXPECT_EQ(entries(t.path), before);
  }
  // The longest name that works is written.
  const fs::path ok = t.path / (std::string(static_cast<std::size_t>(limit) - 2 * suffix - 12, 'a') + ".safetensors");
  quantize_file(in, ok, "", quiet_one_thread());
  EXPECT_TRUE(SafetensorsFile(ok).contains("w_packed"));
}

}  // namespace
}  // namespace lutb
