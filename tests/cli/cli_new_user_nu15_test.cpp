// Defects a fresh new user found in session 15 (helper nu15) through the lutb command line. Each
// test failed on the code before its fix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <sys/wait.h>

#include "lutb/checkpoint.hpp"
#include "lutb/safetensors.hpp"
#include "model/model_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::quote;
using test::TempDir;

std::vector<std::string> entries(const fs::path& d) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(d)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

// Runs `lutb ARGS` with the file-size limit at 8 KiB (ulimit -f 16 blocks of 512 bytes) and SIGXFSZ
// ignored, so that writes beyond it fail with EFBIG as on a full disk. Returns (exit status, stderr).
std::pair<int, std::string> run_with_small_file_limit(const std::string& args, const fs::path& err_file) {
  // std::system runs the line with /bin/sh: the trap and the limit hold for the exec'd lutb.
  const std::string cmd =
      "trap '' XFSZ; ulimit -f 16; exec " + quote(LUTB_CLI_PATH) + " " + args + " >/dev/null 2>" + quote(err_file);
  const int st = std::system(cmd.c_str());
  std::stringstream ss;
  ss << std::ifstream(err_file).rdbuf();
  fs::remove(err_file);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, ss.str()};
}

// A write that fails midway (a full disk; here the file-size limit, EFBIG) was reported as
// "OUT.tmp.PID/model.safetensors.tmp.PID: write failed: File too large", naming only a temporary
// that is removed as the error propagates and not saying what became of OUT.
TEST(CliNewUserNu15, FailedWriteNamesTheOutputAndLeavesItAsItWas) {
  TempDir t;
  const fs::path work = t.path / "w";
  fs::create_directory(work);
  SynthOptions so;
  so.progress = false;
  so.hidden_size = 64;
  so.moe_intermediate_size = 128;
  so.num_experts = 4;
  const fs::path ck = t.path / "ck";
  synthesize_checkpoint(ck, so);  // 4 x 3 x 64 x 128 BF16 experts: about 39 KB of LUT-B
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
        run_with_small_file_limit("quantize " + quote(file_mode ? t.path / "in.safetensors" : ck) + " -o " + quote(out) +
                                      " --no-progress --threads 1",
                                  t.path / "stderr.txt");
    EXPECT_EQ(status, 1) << err;
    EXPECT_NE(err.find("lutb: error: " + out.string() + ": writing the output failed (" + out.string() + ".tmp."),
              std::string::npos)
        << err;
    EXPECT_NE(err.find("File too large"), std::string::npos) << err;
    // OUT did not exist before the run: the message said "OUT is as it was" of a path that had never
    // existed (new-user QA, session 20).
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
  const auto [status, err] = run_with_small_file_limit(
      "quantize " + quote(t.path / "in.safetensors") + " -o " + quote(out) + " --force --no-progress --threads 1",
      t.path / "stderr.txt");
  EXPECT_EQ(status, 1) << err;
  EXPECT_NE(err.find("File too large"), std::string::npos) << err;
  EXPECT_NE(err.find("the partial output was removed and " + out.string() + " is as it was"), std::string::npos) << err;
  std::stringstream kept;
  kept << std::ifstream(out, std::ios::binary).rdbuf();
  EXPECT_EQ(kept.str(), "old bytes");
  EXPECT_EQ(entries(work), with_old);
}

}  // namespace
}  // namespace lutb
