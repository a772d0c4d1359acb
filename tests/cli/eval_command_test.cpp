// `lutb eval`: its loss line and JSON summary, where the fit ran, the kernels' agreement, and its
// errors: bad options, token files, synthetic or mis-sized checkpoints, stored scales beyond FP32.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/config_json.hpp"
#include "io/tensor_names.hpp"
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
using test::CliOut;
using test::CliResult;
using test::has;
using test::q;
using test::run;
using test::run_cli;
using test::small_synth;
using test::TempDir;

// lutb eval on a checkpoint of lutb synth (or the default job's --keep) says that the checkpoint holds MoE
// blocks only, not "tokens file not found" or "missing tensor model.embed_tokens.weight".
TEST(CliEval, SyntheticCheckpointSaysWhy) {
  TempDir t;
  const fs::path bf = t.path / "syn";
  SynthOptions o = small_synth();
  synthesize_checkpoint(bf, o);
  const test::CliResult r = test::run_cli("eval " + test::q(bf) + " --threads 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "lutb: error: " + bf.string() + ": a synthetic checkpoint of lutb synth (" +
                       (bf / "config.json").string() +
                       " has 'lutb_synthetic'): it holds MoE blocks only, no embeddings or attention, so it is not a "
                       "language model lutb eval can run; run one of its MoE blocks with lutb moe " +
                       bf.string() + " --layer L --activations FILE\n");
}

// A config.json with a wrong hidden_size: eval's shape error says that the expected shape comes from
// config.json, the file at fault.
TEST(CliEval, ShapeErrorSaysTheExpectedShapeIsFromConfigJson) {
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
  const test::CliResult r = test::run_cli("eval " + q(dir) + " --max-windows 1 --threads 1");
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_NE(r.err.find("lutb: error: " + (dir / "model.safetensors").string() +
                       ": tensor model.embed_tokens.weight has shape [2048, 256], expected [2048, 512] from the sizes "
                       "in " +
                       (dir / "config.json").string()),
            std::string::npos)
      << r.err;
}

// "(1 window of 256)" in lutb eval's loss line: the count agrees with its noun.
TEST(CliEval, SaysOneWindow) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  const CliOut r = run("eval " + q(dir) + " --max-windows 1 --threads 1");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r, " nats over 255 predicted tokens (1 window of 256)\n")) << r.out;
}

// --kernel reference and the default kernel give losses that differ in the 6th significant digit. The help
// says why (FP32 summation order, spec section 4), and the difference stays at FP32-rounding level.
TEST(CliEval, KernelsAgreeToFp32RoundingAndTheHelpSaysSo) {
  for (const char* cmd : {"eval", "moe"})
    EXPECT_TRUE(has(run(std::string(cmd) + " --help"),
                    "only the order of the FP32 additions differs (spec section 4), so results agree to FP32 rounding"));
  LUTB_MODEL_OR_SKIP(m, "tiny-qwen3-moe");
  const auto loss = [&](const std::string& kernel) {
    const CliOut r = run("eval " + q(m) + " --quant lutb --max-windows 2 --threads 2 --json --kernel " + kernel);
    EXPECT_EQ(r.code, 0) << r.out;
    return nlohmann::json::parse(r.out.substr(r.out.rfind("\n{") + 1))["val_loss"].get<double>();
  };
  const double fast = loss("fast"), ref = loss("reference");
  EXPECT_GT(fast, 3.0);
  EXPECT_LT(fast, 5.0);
  EXPECT_NEAR(fast, ref, 1e-4 * fast);
}

// eval --quant lutb on a BF16 checkpoint fits the routed experts at load and says where and how long (--device
// cuda fits on the GPU: tests/cuda/cli_gpu_test.cpp); nothing is fitted for --quant none.
TEST(CliEval, ReportsWhereTheFitRan) {
  LUTB_MODEL_OR_SKIP(model, "tiny-mixtral");
  const CliResult r = run_cli("eval " + q(model) + " --quant lutb --max-windows 1 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = r.json();
  EXPECT_EQ(j["fit_device"], "cpu");
  EXPECT_GT(j["fit_seconds"].get<double>(), 0.0);
  EXPECT_EQ(j["fit_weights"].get<std::int64_t>(), 3 * 8 * 3 * 320 * 192);  // layers x E x (gate, up, down) x I x H
  EXPECT_TRUE(j["fit_note"].is_null());
  EXPECT_TRUE(has(r.out, "fit          cpu (binned-dp): ")) << r.out;
  const CliResult n = run_cli("eval " + q(model) + " --quant none --max-windows 1 --json");
  ASSERT_EQ(n.status, 0) << n.err;
  EXPECT_FALSE(n.json().contains("fit_device"));
  EXPECT_FALSE(has(n.out, "fit          ")) << n.out;
}

TEST(CliEval, BadInputs) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  CliResult r = run_cli("eval " + lutb::test::q(dir) + " --tokens /nonexistent/val.safetensors");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("/nonexistent/val.safetensors: tokens file not found"), std::string::npos) << r.err;
  r = run_cli("eval /nonexistent/model");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("/nonexistent/model"), std::string::npos) << r.err;
  // Without --tokens, a checkpoint that has no val_tokens.safetensors (transformers' own files only): the
  // error names the default and the option that replaces it.
  {
    lutb::test::TempDir t;
    for (const char* f : {"config.json", "model.safetensors"}) std::filesystem::create_symlink(dir / f, t.path / f);
    r = run_cli("eval " + lutb::test::q(t.path));
    EXPECT_EQ(r.status, 1);
    EXPECT_EQ(r.err, "lutb: error: " + (t.path / "val_tokens.safetensors").string() +
                         ": tokens file not found (the default of --tokens); pass --tokens FILE, a safetensors file "
                         "with input_ids\n")
        << r.err;
  }
  r = run_cli("eval " + lutb::test::q(dir) + " --quant int4");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("int4"), std::string::npos) << r.err;
  // Usage errors: exit status 2.
  r = run_cli("eval " + lutb::test::q(dir) + " --fitter optimal");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--fitter optimal only applies to --quant lutb"), std::string::npos) << r.err;
  r = run_cli("eval " + lutb::test::q(dir) + " --quant lutb --fitter nosuch");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("nosuch"), std::string::npos) << r.err;
}
TEST(CliEval, BaselineAndWindowsJson) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  const CliResult r = run_cli("eval " + lutb::test::q(dir) + " --quant mxfp4 --max-windows 2 --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = r.json();
  EXPECT_EQ(j["windows"], 2);
  EXPECT_EQ(j["tokens"], 510);
  EXPECT_EQ(j["quant"], "mxfp4");
  EXPECT_EQ(j["activations"], "bf16");
  EXPECT_DOUBLE_EQ(j["bits_per_weight"].get<double>(), 4.25);
  EXPECT_EQ(j["tensors"].size(), 6u);  // w13 and w2 of 3 layers
  EXPECT_GT(j["sqnr_db"].get<double>(), 10.0);
  EXPECT_TRUE(std::isfinite(j["val_loss"].get<double>()));
}
// A token file too short for one window, or with an id outside the vocabulary, is refused naming the
// file, not only "10 tokens are fewer than one window of 256" / "token id 1000000 at position 3 is
// outside the vocabulary [0, 2048)". Both are now checked
// before the weights load and name it.
TEST(CliEval, TokenFileErrorsNameTheFile) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-qwen3-moe");
  TempDir t;
  auto write_ids = [&](const std::string& name, std::vector<std::int32_t> ids) {
    std::vector<std::uint8_t> bytes(ids.size() * 4);
    std::memcpy(bytes.data(), ids.data(), bytes.size());
    const std::filesystem::path p = t.path / name;
    lutb::write_safetensors(p, {{"input_ids", lutb::OwnedTensor{lutb::DType::I32, {static_cast<std::int64_t>(ids.size())}, bytes}}});
    return p;
  };
  const auto short_file = write_ids("short.safetensors", std::vector<std::int32_t>(10, 5));
  CliResult r = run_cli("eval " + lutb::test::q(dir) + " --tokens " + lutb::test::q(short_file));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(short_file.string() + ": input_ids holds 10 tokens, fewer than one evaluation window of 256"),
            std::string::npos)
      << r.err;
  std::vector<std::int32_t> ids(600, 5);
  ids[3] = 1000000;
  const auto oov = write_ids("oov.safetensors", ids);
  r = run_cli("eval " + lutb::test::q(dir) + " --tokens " + lutb::test::q(oov));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(oov.string() + ": input_ids[3] = 1000000 is outside the vocabulary [0, 2048) of " + dir.string()),
            std::string::npos)
      << r.err;
  ids[3] = 5;
  ids[599] = -1;  // beyond the evaluated windows, still an invalid file
  const auto neg = write_ids("neg.safetensors", ids);
  r = run_cli("eval " + lutb::test::q(dir) + " --tokens " + lutb::test::q(neg));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(neg.string() + ": input_ids[599] = -1 is outside the vocabulary"), std::string::npos) << r.err;
}

// Sets every byte of each tensor whose name matches `pred` in safetensors file `file` to `value`,
// in place (the header says where each tensor lies).
int patch_tensors(const std::filesystem::path& file, const std::function<bool(const std::string&)>& pred,
                  unsigned char value) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  const auto h = nlohmann::json::parse(header);
  int patched = 0;
  for (const auto& [name, v] : h.items()) {
    if (name == "__metadata__" || !pred(name)) continue;
    const auto b = v["data_offsets"][0].get<std::uint64_t>(), e = v["data_offsets"][1].get<std::uint64_t>();
    f.seekp(static_cast<std::streamoff>(8 + n + b));
    const std::string bytes(e - b, static_cast<char>(value));
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ++patched;
  }
  return patched;
}
// A stored weight_scale byte 0xFE (2^127) is refused by the loader, naming the tensor (its weights are
// beyond FP32, see tests/model/load_errors_test.cpp), and a non-finite loss is an error naming the
// checkpoint, never "val loss nan" with exit status 0. 0xF6 = 2^119, the largest scale fitters write,
// keeps the weights finite (up to 448 * 2^119) but the layer's sums overflow: such weights, 2^64 or
// more (the rule of --quant none for BF16 weights), are refused when the layer is built, naming the
// file, the scale tensor, the expert and the tile, by lutb eval and lutb moe alike.
TEST(CliEval, StoredScale246IsRefusedNamingTheTensor) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const auto q = t.path / "q";
  CliResult r = run_cli("quantize " + lutb::test::q(dir) + " -o " + lutb::test::q(q) + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  const int n = patch_tensors(
      q / "model.safetensors",
      [](const std::string& s) {
        return s.rfind("model.layers.0.", 0) == 0 && s.size() > 13 && s.compare(s.size() - 13, 13, ".weight_scale") == 0;
      },
      0xF6);
  ASSERT_GT(n, 0);
  const std::string where = (q / "model.safetensors").string() +
                            ": tensor model.layers.0.block_sparse_moe.experts.0.w1.weight_scale (layer 0, expert 0), "
                            "tile [0, 0]: scale byte 246 with codebook entry 0 (";
  for (const std::string& cmd : {"eval " + lutb::test::q(q) + " --max-windows 1", "moe " + lutb::test::q(q) + " --layer 0 --activations " +
                                                                             lutb::test::q(dir / "moe_activations.safetensors")}) {
    SCOPED_TRACE(cmd);
    r = run_cli(cmd);
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.err.find(where), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("2^64 or more, far beyond any trained weight"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("Scale bytes up to 246 are valid LUT-B (spec section 2)"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("non-finite loss"), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("val loss"), std::string::npos) << r.out;
  }
}
// --fitter on a stored LUT-B checkpoint is a usage error, never silently ignored.
TEST(CliEval, FitterOnAStoredCheckpointIsAnError) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const auto q = t.path / "q";
  CliResult r = run_cli("quantize " + lutb::test::q(dir) + " -o " + lutb::test::q(q) + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  r = run_cli("eval " + lutb::test::q(q) + " --fitter optimal --max-windows 1");
  EXPECT_EQ(r.status, 2);  // a usage error
  EXPECT_NE(r.err.find("--fitter optimal: " + q.string() + " holds stored LUT-B weights"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace lutb
