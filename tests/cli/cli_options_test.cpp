// Option checking of the lutb command line: integer ranges printed as integers with
// the valid range named, synth size overrides, the default job validating every option before any
// work. Exit statuses: tests/cli/exit_status_test.cpp; free space: tests/io/free_space_test.cpp.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;

using test::CliOut;
using test::has;
using test::q;
using test::run;

// Regression: CLI::NonNegativeNumber printed "Value -3 not in range 0.000000 to 1797693134862...
// (a 309-digit double)", and an unsigned --seed -1 wrapped to 18446744073709551615 silently.
TEST(CliOptions, RangeMessagesPrintIntegersAndTheValidRange) {
  test::TempDir t;
  const std::string dummy = q(t.path / "none") + " -o " + q(t.path / "o");
  struct Case {
    std::string args, expect;
  } cases[] = {
      {"quantize " + dummy + " --threads -3", "--threads: -3 is outside the valid range 0..4096"},
      {"quantize " + dummy + " --threads 99999999999999999999", "--threads: 99999999999999999999 is outside the valid range 0..4096"},
      {"quantize " + dummy + " --threads 2.5", "--threads: 2.5 is not an integer (valid range 0..4096)"},
      {"eval " + q(t.path) + " --batch 0", "--batch: 0 is outside the valid range 1..4096"},
      {"eval " + q(t.path) + " --max-windows -1", "--max-windows: -1 is outside the valid range 0..9223372036854775807"},
      {"moe " + q(t.path) + " --layer 0 --activations x --threads -1", "--threads: -1 is outside the valid range 0..4096"},
      {"--experts -1", "--experts: -1 is outside the valid range 0..4096"},
      {"--seed -1", "--seed: -1 is outside the valid range 0..18446744073709551615"},
      {"--tokens 0", "--tokens: 0 is outside the valid range 1..1048576"},
      {"synth --family qwen3_moe --layers 0 -o " + q(t.path / "s"), "--layers: 0 is outside the valid range 1..1024"},
      {"synth --family qwen3_moe --layers 1 --seed -1 -o " + q(t.path / "s"), "--seed: -1 is outside the valid range"},
      // A real option: NaN and infinities are refused as well as negative values (CLI::NonNegativeNumber
      // accepts "nan").
      {"quantize " + dummy + " --calibration c --damping -1", "--damping: -1 is not a finite number >= 0"},
      {"quantize " + dummy + " --calibration c --damping nan", "--damping: nan is not a finite number >= 0"},
      {"eval " + q(t.path) + " --quant lutb --calibration c --damping inf", "--damping: inf is not a finite number >= 0"},
      {"moe " + q(t.path) + " --layer 0 --activations x --calibration c --damping 1e400",
       "--damping: 1e400 is not a finite number >= 0"},
      {"quantize " + dummy + " --calibration c --damping ''", "--damping: an empty value was given"},
  };
  for (const auto& c : cases) {
    const CliOut r = run(c.args);
    EXPECT_NE(r.code, 0) << c.args << "\n" << r.out;
    EXPECT_TRUE(has(r, c.expect)) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, "e+")) << c.args << "\n" << r.out;
    EXPECT_FALSE(has(r, ".000000")) << c.args << "\n" << r.out;
  }
  EXPECT_FALSE(fs::exists(t.path / "s"));
}

// Size overrides outside their range are refused naming the option and the range, before anything is
// written: a negative one is not replaced by the family's real size (a 0.8 GB Qwen3 layer for
// --hidden-size -5).
TEST(CliOptions, SynthRejectsBadSizes) {
  test::TempDir t;
  const std::string base = "synth --family qwen3_moe --layers 1 --no-progress -o " + q(t.path / "s");
  struct Case {
    std::string args, expect;
  } cases[] = {
      {base + " --hidden-size -5", "--hidden-size: -5 is outside the valid range 1..65536"},
      {base + " --hidden-size 0", "--hidden-size: 0 is outside the valid range 1..65536"},
      {base + " --moe-intermediate-size 1000000", "--moe-intermediate-size: 1000000 is outside the valid range 1..65536"},
      {base + " --experts 0", "--experts: 0 is outside the valid range 1..4096"},
      {base + " --experts 1e3", "--experts: 1e3 is not an integer (valid range 1..4096)"},
      {base + " --nu 2", "--nu 2: must be a number in (2, 1e6]"},
      {base + " --nu inf", "--nu inf: must be a number in (2, 1e6]"},
  };
  for (const auto& c : cases) {
    const CliOut r = run(c.args);
    EXPECT_NE(r.code, 0) << c.args << "\n" << r.out;
    EXPECT_TRUE(has(r, c.expect)) << c.args << "\n" << r.out;
  }
  EXPECT_TRUE(fs::is_empty(t.path)) << "something was written";

  // A valid run prints the size it writes: 2 layers x (router 4*64 + 3 * 4*32*64) BF16 values.
  const CliOut ok = run("synth --family qwen3_moe --layers 2 --hidden-size 64 --moe-intermediate-size 32 --experts 4 "
                     "--no-progress -o " + q(t.path / "ok"));
  ASSERT_EQ(ok.code, 0) << ok.out;
  EXPECT_TRUE(has(ok, "lutb synth: will write " + std::to_string(2 * 2 * (4 * 64 + 3 * 4 * 32 * 64)) + " bytes")) << ok.out;
}

// Every check of lutb synth (destination not replaceable, already there, not creatable, space short)
// runs before its "lutb synth: will write N bytes ..." line: a refusal prints only the error.
TEST(CliOptions, SynthAnnouncesNothingBeforeARefusal) {
  test::TempDir t;
  const std::string small = "synth --family qwen3_moe --layers 1 --hidden-size 64 --moe-intermediate-size 32 "
                            "--experts 2 --no-progress ";
  // --force onto a folder that does not look like a checkpoint.
  fs::create_directories(t.path / "notes");
  std::ofstream(t.path / "notes" / "todo.txt") << "mine";
  const CliOut notes = run(small + "--force -o " + q(t.path / "notes"));
  EXPECT_EQ(notes.code, 1) << notes.out;
  EXPECT_TRUE(has(notes, "does not look like a checkpoint this tool wrote ('todo.txt'")) << notes.out;
  EXPECT_FALSE(has(notes, "will write")) << notes.out;
  // An existing destination without --force.
  fs::create_directories(t.path / "there");
  const CliOut there = run(small + "-o " + q(t.path / "there"));
  EXPECT_EQ(there.code, 1) << there.out;
  EXPECT_TRUE(has(there, "output directory exists (use --force to replace it)")) << there.out;
  EXPECT_FALSE(has(there, "will write")) << there.out;
  // A destination that cannot be created (its parent is a file).
  std::ofstream(t.path / "file") << "x";
  const CliOut under = run(small + "-o " + q(t.path / "file" / "out"));
  EXPECT_EQ(under.code, 1) << under.out;
  EXPECT_TRUE(has(under, (t.path / "file" / "out").string() + ": cannot create the output")) << under.out;
  EXPECT_FALSE(has(under, "will write")) << under.out;
  // A file where the directory should go, with --force.
  const CliOut onfile = run(small + "--force -o " + q(t.path / "file"));
  EXPECT_EQ(onfile.code, 1) << onfile.out;
  EXPECT_TRUE(has(onfile, "exists and is not a directory")) << onfile.out;
  EXPECT_FALSE(has(onfile, "will write")) << onfile.out;
  // Nothing was changed or left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(t.path), fs::directory_iterator()), 3);
  EXPECT_TRUE(fs::is_empty(t.path / "there"));
  // A run that passes the checks still announces the size (2 * (2*64 + 3*2*32*64) bytes), then writes.
  const CliOut ok = run(small + "--force -o " + q(t.path / "there"));
  ASSERT_EQ(ok.code, 0) << ok.out;
  EXPECT_TRUE(has(ok, "lutb synth: will write " + std::to_string(2 * (2 * 64 + 3 * 2 * 32 * 64)) + " bytes")) << ok.out;
}

// Odd option values get an error naming the option, never a bare library message.
TEST(CliOptions, OddValuesGiveClearErrors) {
  test::TempDir t;
  // synth -o '' is a usage error naming the option, as quantize -o '' is: written, the checkpoint would
  // go to ".tmp.PID" and then fail to be renamed to "".
  const CliOut empty = run("synth --family qwen3_moe --layers 1 --hidden-size 64 --moe-intermediate-size 32 --experts 2 "
                           "--no-progress -o ''");
  EXPECT_EQ(empty.code, 2) << empty.out;
  EXPECT_TRUE(has(empty, "lutb: error: --output: an empty output name was given")) << empty.out;
  EXPECT_FALSE(has(empty, "will write")) << empty.out;
  // moe --layer beyond int: the valid range, not CLI11's "Could not convert".
  const CliOut layer = run("moe " + q(t.path) + " --activations x --layer 99999999999999999999");
  EXPECT_NE(layer.code, 0) << layer.out;
  EXPECT_TRUE(has(layer, "--layer: 99999999999999999999 is outside the valid range 0..2147483647")) << layer.out;
  // The default job's --work-dir that cannot be created: "filesystem error: cannot create directories".
  std::ofstream(t.path / "file") << "x";
  const CliOut wd = run("--experts 2 --tokens 4 --work-dir " + q(t.path / "file" / "w"));
  EXPECT_EQ(wd.code, 1) << wd.out;
  EXPECT_TRUE(has(wd, "--work-dir " + (t.path / "file" / "w").string() + ": cannot create it: Not a directory")) << wd.out;
  EXPECT_FALSE(has(wd, "filesystem error")) << wd.out;
}

// Regression: `lutb --fitter nope` failed only after synthesising the checkpoint (minutes at the
// default size); every option is now checked before any work.
TEST(CliOptions, DefaultJobValidatesBeforeWork) {
  test::TempDir t;
  const fs::path w = t.path / "w";
  const CliOut r = run("--fitter nope --experts 2 --tokens 4 --work-dir " + q(w));
  EXPECT_EQ(r.code, 2) << r.out;  // a usage error
  EXPECT_TRUE(has(r, "--fitter: unknown fitter 'nope'")) << r.out;
  EXPECT_FALSE(has(r, "synthesised")) << r.out;
  EXPECT_FALSE(has(r, "the main job")) << r.out;
  EXPECT_FALSE(fs::exists(w)) << "the work directory was created";

  std::ofstream(t.path / "file") << "x";
  const CliOut f = run("--experts 2 --tokens 4 --work-dir " + q(t.path / "file"));
  EXPECT_EQ(f.code, 1) << f.out;
  EXPECT_TRUE(has(f, "--work-dir " + (t.path / "file").string() + ": exists and is not a directory")) << f.out;
  EXPECT_FALSE(has(f, "synthesised")) << f.out;
}

// A huge --tokens is refused before any work, saying how much memory the buffers would need: they are
// sized against the free memory, never left to end in a bare "std::bad_alloc".
TEST(CliOptions, DefaultJobChecksTokenMemoryUpFront) {
  std::uint64_t avail_kb = 0;
  {
    std::ifstream mi("/proc/meminfo");
    std::string key, unit;
    std::uint64_t kb = 0;
    while (mi >> key >> kb >> unit)
      if (key == "MemAvailable:") avail_kb = kb;
  }
  // 2^20 tokens of Qwen3-30B-A3B's layer with 2 experts need about 49 GB.
  if (avail_kb == 0 || avail_kb > 40ull * 1000 * 1000) GTEST_SKIP() << "this machine has the memory for it";
  test::TempDir t;
  const fs::path w = t.path / "w";
  const CliOut r = run("--experts 2 --tokens 1048576 --work-dir " + q(w));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "--tokens 1048576: the token buffers would need about ")) << r.out;
  EXPECT_TRUE(has(r, "GB of memory is available; use fewer tokens")) << r.out;
  EXPECT_FALSE(has(r, "synthesised")) << r.out;
  EXPECT_FALSE(fs::exists(w)) << "the work directory was created";
}

}  // namespace
}  // namespace lutb
