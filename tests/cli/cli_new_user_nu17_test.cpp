// Defects a fresh new user found in session 17 (helper nu17) through the lutb command line. Each
// test failed on the code before its fix.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <sys/wait.h>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/numerics.hpp"
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

// `lutb eval --activations` named the activation format while `lutb moe --activations` names the
// captured-activations file: the format is --act-format in both now, and eval's --activations is
// the hidden old spelling: a format still works (with a note), a file name is refused saying what
// to use.
TEST(CliNewUserNu17, EvalActivationsIsTheOldSpellingOfActFormat) {
  const test::CliResult help = test::run_cli("eval --help");
  ASSERT_EQ(help.status, 0);
  EXPECT_NE(help.out.find("--act-format"), std::string::npos) << help.out;
  EXPECT_EQ(help.out.find("--activations"), std::string::npos) << help.out;

  TempDir t;  // the errors come before the checkpoint is read
  test::CliResult r = test::run_cli("eval " + quote(t.path) + " --activations " + quote(t.path / "acts.safetensors"));
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_NE(r.err.find("lutb: error: --activations: '" + (t.path / "acts.safetensors").string() +
                       "': lutb eval takes no captured-activations file (that is lutb moe --activations FILE); the "
                       "activation format of the expert GEMMs is --act-format bf16|mxfp8"),
            std::string::npos)
      << r.err;
  r = test::run_cli("eval " + quote(t.path) + " --activations mxfp8 --act-format bf16");
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_NE(r.err.find("--activations: mxfp8 contradicts --act-format bf16"), std::string::npos) << r.err;

  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  const test::CliResult a = test::run_cli("eval " + quote(dir) + " --act-format mxfp8 --max-windows 1 --json");
  ASSERT_EQ(a.status, 0) << a.err;
  EXPECT_EQ(a.err.find("old spelling"), std::string::npos) << a.err;
  const test::CliResult b = test::run_cli("eval " + quote(dir) + " --activations mxfp8 --max-windows 1 --json");
  ASSERT_EQ(b.status, 0) << b.err;
  const std::string note = "lutb: note: `lutb eval --activations mxfp8` is the old spelling of --act-format mxfp8";
  const std::size_t at = b.err.find(note);
  EXPECT_NE(at, std::string::npos) << b.err;
  EXPECT_EQ(b.err.find(note, at + 1), std::string::npos) << "printed twice (once before re-executing): " << b.err;
  EXPECT_EQ(b.json()["activations"], "mxfp8");
  EXPECT_EQ(a.json()["val_loss"], b.json()["val_loss"]);
}

// A config.json with a wrong hidden_size: eval's error said "embed_tokens.weight has shape [2048, 256],
// expected [2048, 512]" without saying that 512 came from config.json, which was the file at fault.
TEST(CliNewUserNu17, EvalShapeErrorSaysTheExpectedShapeIsFromConfigJson) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const fs::path dir = t.path / "m";
  fs::create_directory(dir);
  for (const char* f : {"config.json", "model.safetensors", "val_tokens.safetensors"}) {
    fs::copy_file(src / f, dir / f);
    fs::permissions(dir / f, fs::perms::owner_read | fs::perms::owner_write);
  }
  nlohmann::json cfg;
  std::ifstream(dir / "config.json") >> cfg;
  cfg["hidden_size"] = 512;
  std::ofstream(dir / "config.json") << cfg.dump();
  const test::CliResult r = test::run_cli("eval " + quote(dir) + " --max-windows 1 --threads 1");
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find("lutb: error: " + (dir / "model.safetensors").string() +
                       ": tensor model.embed_tokens.weight has shape [2048, 256], expected [2048, 512] from the sizes "
                       "in " +
                       (dir / "config.json").string()),
            std::string::npos)
      << r.err;
}

// An F32 file of one tensor scaled by `scale` (16 x 64, standard normal before scaling).
void write_scaled(const fs::path& file, float scale) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  OwnedTensor o{DType::F32, {16, 64}, std::vector<std::uint8_t>(16 * 64 * 4)};
  for (int i = 0; i < 16 * 64; ++i) {
    const float v = nd(rng) * scale;
    std::memcpy(o.bytes.data() + 4 * i, &v, 4);
  }
  write_safetensors(file, {{"w", o}});
}

// ct-lloyd / multistart fit no tile scale: weights of magnitude 1e-30 were quantised to zero (0 dB)
// and lutb quantize printed "aggregate SQNR 0.00 dB" with no warning, exit 0.
TEST(CliNewUserNu17, QuantizeWarnsWhenAnUnscaledFitterLosesTheTensor) {
  TempDir t;
  const fs::path in = t.path / "in.safetensors";
  write_scaled(in, 1e-30f);
  test::CliResult r = test::run_cli("quantize " + quote(in) + " -o " + quote(t.path / "o.safetensors") +
                                    " --fitter ct-lloyd --no-progress --threads 1");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("lutb: warning: " + in.string() + ": tensor w: SQNR 0.00 dB with ct-lloyd"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("the scaled fitters binned-dp (the default) and optimal fit them"), std::string::npos) << r.err;
  r = test::run_cli("quantize " + quote(in) + " -o " + quote(t.path / "b.safetensors") + " --no-progress --threads 1");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
}

// The same through `lutb moe --quant lutb --fitter ct-lloyd` (the online fit of a BF16 checkpoint):
// the per-tensor lines said "SQNR 0.000 dB" and nothing else.
TEST(CliNewUserNu17, MoeWarnsWhenAnUnscaledFitterLosesTheExperts) {
  TempDir t;
  SynthOptions so;
  so.progress = false;
  so.hidden_size = 64;
  so.moe_intermediate_size = 64;
  so.num_experts = 4;
  const fs::path ck = t.path / "ck";
  synthesize_checkpoint(ck, so);
  {  // the routed experts scaled by 1e-30 (exact in BF16's FP32 exponent range)
    const fs::path file = ck / "model.safetensors";
    std::vector<std::pair<std::string, OwnedTensor>> out;
    {
      const SafetensorsFile f(file);
      for (const auto& n : f.names()) {
        const TensorView& v = f.get(n);
        OwnedTensor o{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)};
        if (n.find(".experts.") != std::string::npos) {
          ASSERT_EQ(v.dtype, DType::BF16);
          for (std::size_t i = 0; i < o.bytes.size(); i += 2) {
            std::uint16_t h;
            std::memcpy(&h, o.bytes.data() + i, 2);
            h = bf16_from_float(bf16_to_float(h) * 1e-30f);
            std::memcpy(o.bytes.data() + i, &h, 2);
          }
        }
        out.push_back({n, std::move(o)});
      }
    }
    write_safetensors(file, out);
  }
  const fs::path acts = t.path / "acts.safetensors";
  {
    OwnedTensor x{DType::F32, {4, 64}, std::vector<std::uint8_t>(4 * 64 * 4)};
    for (int i = 0; i < 4 * 64; ++i) {
      const float v = static_cast<float>((i * 37) % 11) - 5.0f;
      std::memcpy(x.bytes.data() + 4 * i, &v, 4);
    }
    write_safetensors(acts, {{"layers.0.moe_input", x}, {"layers.0.moe_output", x}});
  }
  const std::string base = "moe " + quote(ck) + " --layer 0 --activations " + quote(acts) + " --threads 1 --quant lutb";
  test::CliResult r = test::run_cli(base + " --fitter ct-lloyd");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("lutb: warning: layer 0: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(": SQNR 0.00 dB with ct-lloyd"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("ct-lloyd fits no tile scale"), std::string::npos) << r.err;
  r = test::run_cli(base);  // binned-dp scales each tile: no warning
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
}

// A full disk while lutb quantize copied the checkpoint's other files (here: the file-size limit,
// EFBIG, with the shard itself below it) was reported as "OUT.tmp.PID/tokenizer.json: cannot write:
// File too large", naming only the removed temporary and not what became of OUT (nu15 fixed this for
// the safetensors shards only).
TEST(CliNewUserNu17, FailedCopyNamesTheOutputAndLeavesItAsItWas) {
  TempDir t;
  SynthOptions so;
  so.progress = false;
  so.hidden_size = 64;
  so.moe_intermediate_size = 32;
  so.num_experts = 2;
  const fs::path ck = t.path / "ck";
  synthesize_checkpoint(ck, so);
  ASSERT_LT(fs::file_size(ck / "model.safetensors"), 32u * 1024);  // its LUT-B output is below the limit
  { std::ofstream(ck / "tokenizer.json") << std::string(64 * 1024, 'x'); }
  const fs::path work = t.path / "w";
  fs::create_directory(work);
  const fs::path out = work / "out";
  const fs::path err_file = t.path / "stderr.txt";
  // ulimit -f 32: 16 KiB; SIGXFSZ ignored so that the write fails with EFBIG as on a full disk.
  const std::string cmd = "trap '' XFSZ; ulimit -f 32; exec " + quote(LUTB_CLI_PATH) + " quantize " + quote(ck) +
                          " -o " + quote(out) + " --no-progress --threads 1 >/dev/null 2>" + quote(err_file);
  const int st = std::system(cmd.c_str());
  std::stringstream ss;
  ss << std::ifstream(err_file).rdbuf();
  const std::string err = ss.str();
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << err;
  EXPECT_NE(err.find("lutb: error: " + out.string() + ": writing the output failed (" + out.string() + ".tmp."),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("/tokenizer.json: cannot write: File too large); the partial output was removed and nothing was "
                     "created at " + out.string()),
            std::string::npos)
      << err;
  EXPECT_TRUE(entries(work).empty());
}

}  // namespace
}  // namespace lutb
