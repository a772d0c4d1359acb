// `lutb moe` and `lutb eval` through the command line: JSON output and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "lutb/safetensors.hpp"
#include "model/model_test_util.hpp"

using namespace lutb::test;

TEST(CliMoe, JsonOnCapturedActivationsDeepseekV3) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-deepseek-v3");
  const std::string acts = quote(dir / "moe_activations.safetensors");
  const CliResult none = run_cli("moe " + quote(dir) + " --layer 2 --activations " + acts + " --json");
  ASSERT_EQ(none.status, 0) << none.err;
  const auto a = none.json();
  EXPECT_EQ(a["layer"], 2);
  EXPECT_EQ(a["quant"], "none");
  EXPECT_EQ(a["activations"], "bf16");
  EXPECT_EQ(a["tokens"], 512);
  // FP32 compute against transformers' BF16 capture (routed + shared experts): BF16 rounding of the
  // inputs, weights and outputs, 2^-9 each, bounds the difference to about 1%.
  EXPECT_LT(a["rel_l2"].get<double>(), 0.01);
  EXPECT_GT(a["cosine"].get<double>(), 0.9999);
  EXPECT_GT(a["max_abs"].get<double>(), 0.0);

  const CliResult q = run_cli("moe " + quote(dir) + " --layer 2 --activations " + acts + " --quant lutb --json");
  ASSERT_EQ(q.status, 0) << q.err;
  const auto b = q.json();
  EXPECT_EQ(b["quant"], "lutb");
  EXPECT_EQ(b["activations"], "mxfp8");
  const double eps = std::pow(10.0, -b["sqnr_db"].get<double>() / 20);
  // Two quantised products in series (w13 then w2), each with relative weight error eps, plus MXFP8
  // activations: the output error is about sqrt(2) eps; 2 eps bounds it. And it exceeds BF16's.
  EXPECT_GT(b["rel_l2"].get<double>(), a["rel_l2"].get<double>());
  EXPECT_LT(b["rel_l2"].get<double>(), 2 * eps);
  std::printf("[ model ] lutb moe layer 2: rel_l2 none %.3e, lutb %.3e (eps %.3e)\n", a["rel_l2"].get<double>(),
              b["rel_l2"].get<double>(), eps);
}

TEST(CliMoe, BadInputs) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-deepseek-v3");
  const std::string acts = quote(dir / "moe_activations.safetensors");
  // --layer beyond the layers or on a dense one, a format given as the file: usage errors, exit status 2
  // (README "Exit status", nu18).
  CliResult r = run_cli("moe " + quote(dir) + " --layer 9 --activations " + acts);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("out of range"), std::string::npos) << r.err;
  r = run_cli("moe " + quote(dir) + " --layer 0 --activations " + acts);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("dense (non-MoE) layer"), std::string::npos) << r.err;
  r = run_cli("moe " + quote(dir) + " --layer 1 --activations /nonexistent/acts.safetensors");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("activations file not found"), std::string::npos) << r.err;
  // Regression (QA 2026-11-30): a format name given to moe's --activations (eval's meaning) read as
  // "mxfp8: activations file not found".
  r = run_cli("moe " + quote(dir) + " --layer 1 --activations mxfp8");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--activations takes a file for `moe`"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--act-format mxfp8"), std::string::npos) << r.err;
  // a capture file without that layer
  TempDir tmp;
  const auto partial = tmp.path / "acts.safetensors";
  lutb::write_safetensors(partial, {{"input_ids", lutb::OwnedTensor{lutb::DType::I32, {1}, {0, 0, 0, 0}}}});
  r = run_cli("moe " + quote(dir) + " --layer 3 --activations " + quote(partial));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("no tensor layers.3.moe_input"), std::string::npos) << r.err;
}

TEST(CliEval, BadInputs) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  CliResult r = run_cli("eval " + quote(dir) + " --tokens /nonexistent/val.safetensors");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("/nonexistent/val.safetensors: tokens file not found"), std::string::npos) << r.err;
  r = run_cli("eval /nonexistent/model");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("/nonexistent/model"), std::string::npos) << r.err;
  r = run_cli("eval " + quote(dir) + " --quant int4");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("int4"), std::string::npos) << r.err;
  // Usage errors: exit status 2 (nu18).
  r = run_cli("eval " + quote(dir) + " --fitter optimal");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--fitter optimal only applies to --quant lutb"), std::string::npos) << r.err;
  r = run_cli("eval " + quote(dir) + " --quant lutb --fitter nosuch");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("nosuch"), std::string::npos) << r.err;
}

TEST(CliEval, BaselineAndWindowsJson) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  const CliResult r = run_cli("eval " + quote(dir) + " --quant mxfp4 --max-windows 2 --json");
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

// Regression (QA 2026-11-30): a token file too short for one window, or with an id outside the
// vocabulary, failed with "10 tokens are fewer than one window of 256" / "token id 1000000 at
// position 3 is outside the vocabulary [0, 2048)", without naming the file. Both are now checked
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
  CliResult r = run_cli("eval " + quote(dir) + " --tokens " + quote(short_file));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(short_file.string() + ": input_ids holds 10 tokens, fewer than one evaluation window of 256"),
            std::string::npos)
      << r.err;
  std::vector<std::int32_t> ids(600, 5);
  ids[3] = 1000000;
  const auto oov = write_ids("oov.safetensors", ids);
  r = run_cli("eval " + quote(dir) + " --tokens " + quote(oov));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(oov.string() + ": input_ids[3] = 1000000 is outside the vocabulary [0, 2048) of " + dir.string()),
            std::string::npos)
      << r.err;
  ids[3] = 5;
  ids[599] = -1;  // beyond the evaluated windows, still an invalid file
  const auto neg = write_ids("neg.safetensors", ids);
  r = run_cli("eval " + quote(dir) + " --tokens " + quote(neg));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(neg.string() + ": input_ids[599] = -1 is outside the vocabulary"), std::string::npos) << r.err;
}

// Sets every byte of each tensor whose name matches `pred` in safetensors file `file` to `value`,
// in place (the header says where each tensor lies).
static int patch_tensors(const std::filesystem::path& file, const std::function<bool(const std::string&)>& pred,
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

// Regression (QA 2026-11-30): a stored weight_scale byte 0xFE (2^127) made the loss NaN, and
// `lutb eval` printed "val loss nan" and exited 0; since then a non-finite loss is an error naming the
// checkpoint, and the loader refuses 0xFE itself, naming the tensor (its weights are beyond FP32, see
// model_new_user_s11_test). 0xF6 = 2^119, the largest scale fitters write, keeps the weights finite
// (up to 448 * 2^119) and the layer's sums overflow: that still gave "non-finite loss" naming no
// tensor (new-user QA, session 15). Since session 16 (cli16) such weights, 2^64 or more (the rule of
// --quant none for BF16 weights), are refused when the layer is built, naming the file, the scale
// tensor, the expert and the tile, by lutb eval and lutb moe alike.
TEST(CliEval, StoredScale246IsRefusedNamingTheTensor) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const auto q = t.path / "q";
  CliResult r = run_cli("quantize " + quote(dir) + " -o " + quote(q) + " --no-progress");
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
  for (const std::string& cmd : {"eval " + quote(q) + " --max-windows 1", "moe " + quote(q) + " --layer 0 --activations " +
                                                                             quote(dir / "moe_activations.safetensors")}) {
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

// Regression (QA 2026-11-30): --fitter on a stored LUT-B checkpoint was silently ignored.
TEST(CliEval, FitterOnAStoredCheckpointIsAnError) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  TempDir t;
  const auto q = t.path / "q";
  CliResult r = run_cli("quantize " + quote(dir) + " -o " + quote(q) + " --no-progress");
  ASSERT_EQ(r.status, 0) << r.err;
  r = run_cli("eval " + quote(q) + " --fitter optimal --max-windows 1");
  EXPECT_EQ(r.status, 2);  // a usage error (nu18)
  EXPECT_NE(r.err.find("--fitter optimal: " + q.string() + " holds stored LUT-B weights"), std::string::npos) << r.err;
}
