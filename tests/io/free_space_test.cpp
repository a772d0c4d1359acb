// Free-space checks: quantize (checkpoint and file mode) and synth refuse an output larger than the free
// space before anything is written, naming both sizes, and a pseudo file system is named as such, not as
// full.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
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
using test::quiet_one_thread;
using test::run;
using test::TempDir;
using test::tiny_synth;

// /proc and /sys report 0 bytes free and take no new entries: an output there is refused as uncreatable, not
// as "needs N MB but only 0.00 MB are free" (the fix is not more space).
TEST(FreeSpace, PseudoFilesystemIsNotBlamedOnFreeSpace) {
  if (!fs::exists("/proc/self/status")) GTEST_SKIP() << "/proc is not mounted here";
  test::TempDir t;
  const CliOut s = run("synth --family qwen3_moe --layers 1 --hidden-size 128 --moe-intermediate-size 64 --experts 4 "
                       "--no-progress -o " + q(t.path / "ck"));
  ASSERT_EQ(s.code, 0) << s.out;
  const std::string dir_out = "/proc/lutb-free-space-" + std::to_string(::getpid());
  const std::string runs[] = {
      "quantize " + q(t.path / "ck") + " -o " + dir_out + " --no-progress",
      "quantize " + q(t.path / "ck" / "model.safetensors") + " -o " + dir_out + ".safetensors --no-progress",
      "synth --family qwen3_moe --layers 1 --no-progress -o " + dir_out};
  for (const std::string& args : runs) {
    const CliOut r = run(args);
    EXPECT_EQ(r.code, 1) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, ": nothing can be created in /proc: ")) << args << "\n" << r.out;
    EXPECT_TRUE(has(r, "; nothing written")) << r.out;
    EXPECT_FALSE(has(r, "are free on the filesystem")) << r.out;
  }
}

// lutb quantize checks the free space before any fit, as lutb synth does: a (sparse) 4 TiB file it would copy
// makes the output larger than the disk, and the refusal, before anything is written, names both sizes.
TEST(FreeSpace, QuantizeChecksFreeSpaceFirst) {
  TempDir t;
  SynthOptions o = tiny_synth();
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

// The free-space check of file mode (quantize IN.safetensors -o OUT.safetensors) speaks of the output file: a
// 1-D tensor of 2^40 F32 values in a sparse input file (4 TiB, copied unquantised) makes the output larger
// than the disk.
TEST(FreeSpace, QuantizeFileChecksFreeSpaceFirst) {
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
  const std::string e = error_of([&] { (void)quantize_file(in, out, "", quiet_one_thread()); });
  EXPECT_EQ(e.rfind(out.string() + ": the output file needs 4.40 TB (", 0), 0u) << e;
  EXPECT_NE(e.find("are free on the filesystem of " + t.path.string() + "; nothing written"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(t.path / "sub"));
  EXPECT_EQ(std::distance(fs::directory_iterator(t.path), fs::directory_iterator()), 1);  // only the input
}

// lutb synth's checkpoint of 1024 layers of 4096 experts of 65536 x 65536 is more than any disk holds:
// refused before anything is written, naming both sizes.
TEST(FreeSpace, SynthChecksFreeSpaceFirst) {
  TempDir t;
  SynthOptions o = test::small_synth(65536, false, 1024);
  o.hidden_size = 65536;
  o.num_experts = 4096;
  const std::string w = error_of<CheckpointError>([&] { synthesize_checkpoint(t.path / "big", o); });
  EXPECT_NE(w.find((t.path / "big").string() + ": the checkpoint needs"), std::string::npos) << w;
  EXPECT_NE(w.find("are free on the filesystem of"), std::string::npos) << w;
  EXPECT_TRUE(test::entries(t.path).empty());
}

// The same through the command line: refused before writing, and before announcing what it would write.
TEST(FreeSpace, SynthCommandRefusesBeforeAnnouncing) {
  TempDir t;
  const CliOut big = run("synth --family qwen3_moe --layers 1000 --hidden-size 65536 --experts 4096 --no-progress -o " +
                         q(t.path / "big"));
  EXPECT_EQ(big.code, 1) << big.out;
  EXPECT_FALSE(has(big, "will write")) << big.out;
  EXPECT_TRUE(has(big, ": the checkpoint needs")) << big.out;
  EXPECT_TRUE(has(big, "are free on the filesystem of")) << big.out;
  EXPECT_TRUE(fs::is_empty(t.path)) << "something was written";
}

// lutb calibrate --full-moments counts the full second moments in the size it checks (hidden_size^2 +
// moe_intermediate_size^2 floats per expert): tiny-mixtral's config.json at hidden and intermediate
// size 65536 and 64 layers makes 17.59 TB of moments, refused before the model runs; without them the
// statistics are 0.03 GB and the run goes on to the weights, whose shapes config.json contradicts.
TEST(FreeSpace, CalibrateCountsTheFullMoments) {
  const auto m = test::model_dir("tiny-mixtral");
  const auto shared = test::shared_dir();
  if (!m || !shared || !fs::exists(*shared / "calib/train_tokens.safetensors"))
    GTEST_SKIP() << "../shared models or calib tokens absent";
  TempDir t;
  if (fs::space(t.path).available > std::uintmax_t{17} * 1000000000000u) GTEST_SKIP() << "more than 17 TB free here";
  const fs::path big = test::copy_model(*m, t.path / "m");
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(big / "config.json"));
  cfg["hidden_size"] = 65536;
  cfg["intermediate_size"] = 65536;
  cfg["num_hidden_layers"] = 64;
  std::ofstream(big / "config.json") << cfg.dump();
  const fs::path out = t.path / "sub" / "s.safetensors";  // its parent is missing: not created either
  const std::string args = "calibrate " + q(big) + " --tokens " + q(*shared / "calib/train_tokens.safetensors") +
                           " --max-tokens 256 --threads 1 -o " + q(out);
  const CliOut r = run(args + " --full-moments");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r, "lutb: error: " + out.string() + ": the statistics file needs 17.59 TB (")) << r.out;
  EXPECT_FALSE(fs::exists(t.path / "sub"));
  const CliOut d = run(args);
  EXPECT_EQ(d.code, 1) << d.out;
  EXPECT_FALSE(has(d, "are free on the filesystem")) << d.out;
}

}  // namespace
}  // namespace lutb
