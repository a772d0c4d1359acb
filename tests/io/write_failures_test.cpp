// Writes that fail midway (a full disk, simulated with the file-size limit) name the output and leave
// it as it was; small files (config.json, the index) are written, flushed and checked like the shards.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "io/checkpoint_internal.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/numerics.hpp"
#include "lutb/safetensors.hpp"
#include "support/checkpoint_support.hpp"
#include "support/cli_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::entries;
using test::q;
using test::TempDir;

// Runs `lutb ARGS` with the file-size limit at `blocks` blocks of 512 bytes (16: 8 KiB) and SIGXFSZ
// ignored, so that writes beyond it fail with EFBIG as on a full disk. Returns (exit status, stderr).
// The shell runs the line: the trap and the limit hold for the exec'd lutb.
std::pair<int, std::string> run_with_file_size_limit(const std::string& args, int blocks = 16) {
  const test::CliResult r = test::run_cli(args, "trap '' XFSZ; ulimit -f " + std::to_string(blocks) + "; exec");
  return {r.status, r.err};
}

// A write that fails midway (a full disk; here the file-size limit, EFBIG) names the output and says what
// became of it, not only the temporary that is removed as the error propagates.
TEST(WriteFailures, FailedWriteNamesTheOutputAndLeavesItAsItWas) {
  TempDir t;
  const fs::path work = t.path / "w";
  fs::create_directory(work);
  const fs::path ck = t.path / "ck";
  synthesize_checkpoint(ck, test::synth_options(64, 128, 4));  // 4 x 3 x 64 x 128 BF16 experts: about 39 KB of LUT-B
  {
    SafetensorsFile f(ck / "model.safetensors");
    std::vector<std::pair<std::string, OwnedTensor>> one;
    const std::string name = "model.layers.0.mlp.experts.0.down_proj.weight";
    const TensorView& v = f.get(name);
    one.push_back({"w", OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    std::vector<std::uint8_t> big(64 * 1024 * 2);
    for (std::size_t i = 0; i < big.size(); i += 2) big[i + 1] = static_cast<std::uint8_t>(0x3C + (i / 2) % 3);
    one.push_back({"v", OwnedTensor{DType::BF16, {64, 1024}, big}});
    write_safetensors(t.path / "in.safetensors", one);
  }
  const auto before = entries(work);
  for (const bool file_mode : {true, false}) {
    const fs::path out = file_mode ? work / "out.safetensors" : work / "out";
    const auto [status, err] =
        run_with_file_size_limit("quantize " + q(file_mode ? t.path / "in.safetensors" : ck) + " -o " + q(out) +
                                 " --no-progress --threads 1");
    EXPECT_EQ(status, 1) << err;
    EXPECT_NE(err.find("lutb: error: " + out.string() + ": writing the output failed (" + out.string() + ".tmp."),
              std::string::npos)
        << err;
    EXPECT_NE(err.find("File too large"), std::string::npos) << err;
    // OUT did not exist before the run: the message must not say "OUT is as it was" of a path that
    // never existed.
    EXPECT_NE(err.find("the partial output was removed and nothing was created at " + out.string()),
              std::string::npos)
        << err;
    EXPECT_EQ(err.find("is as it was"), std::string::npos) << err;
    EXPECT_EQ(entries(work), before);
  }
  // An existing output replaced with --force: the failed run leaves it byte for byte, and says so.
  const fs::path out = work / "old.safetensors";
  {
    std::ofstream(out, std::ios::binary) << "old bytes";
  }
  const auto with_old = entries(work);
  const auto [status, err] = run_with_file_size_limit(
      "quantize " + q(t.path / "in.safetensors") + " -o " + q(out) + " --force --no-progress --threads 1");
  EXPECT_EQ(status, 1) << err;
  EXPECT_NE(err.find("File too large"), std::string::npos) << err;
  EXPECT_NE(err.find("the partial output was removed and " + out.string() + " is as it was"), std::string::npos) << err;
  std::stringstream kept;
  kept << std::ifstream(out, std::ios::binary).rdbuf();
  EXPECT_EQ(kept.str(), "old bytes");
  EXPECT_EQ(entries(work), with_old);
}

// The same when the copy of the checkpoint's other files fails (here the file-size limit, EFBIG, with the
// shard itself below it): the output is named and said to be as it was.
TEST(WriteFailures, FailedCopyNamesTheOutputAndLeavesItAsItWas) {
  TempDir t;
  const fs::path ck = t.path / "ck";
  synthesize_checkpoint(ck, test::tiny_synth());
  ASSERT_LT(fs::file_size(ck / "model.safetensors"), 32u * 1024);  // its LUT-B output is below the limit
  { std::ofstream(ck / "tokenizer.json") << std::string(64 * 1024, 'x'); }
  const fs::path work = t.path / "w";
  fs::create_directory(work);
  const fs::path out = work / "out";
  // 32 blocks: 16 KiB, above the shard and below tokenizer.json.
  const auto [status, err] =
      run_with_file_size_limit("quantize " + q(ck) + " -o " + q(out) + " --no-progress --threads 1", 32);
  EXPECT_EQ(status, 1) << err;
  EXPECT_NE(err.find("lutb: error: " + out.string() + ": writing the output failed (" + out.string() + ".tmp."),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("/tokenizer.json: cannot write: File too large); the partial output was removed and nothing was "
                     "created at " + out.string()),
            std::string::npos)
      << err;
  EXPECT_TRUE(entries(work).empty());
}

// quantize and synth write config.json and the shard index through detail::write_text_file: written, fsynced
// (a power cut after the rename must not leave a finished checkpoint with empty small files) and checked, the
// error naming the file. /dev/full fails every write with ENOSPC.
TEST(WriteFailures, SmallFilesAreWrittenCheckedAndNamed) {
  test::TempDir t;
  const std::filesystem::path ok = t.path / "config.json";
  detail::write_text_file(ok, "{\"a\": 1}\n");
  std::ifstream f(ok);
  const std::string back((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(back, "{\"a\": 1}\n");
  detail::write_text_file(ok, "x");  // replaced, not appended
  std::ifstream g(ok);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(g)), std::istreambuf_iterator<char>()), "x");
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  try {
    detail::write_text_file("/dev/full", std::string(4096, 'x'));
    FAIL() << "a write to /dev/full succeeded";
  } catch (const CheckpointError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("/dev/full: cannot write"), std::string::npos) << m;
    EXPECT_NE(m.find(std::strerror(ENOSPC)), std::string::npos) << m;
  }
  EXPECT_THROW(detail::write_text_file(t.path / "missing" / "config.json", "x"), CheckpointError);
}

}  // namespace
}  // namespace lutb
