// Defects a fresh new user found in session 16 (helper nu16) with unusual config.json files and a
// truncated weights file. Each test failed on the code before its fix.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "io/checkpoint_internal.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

using nlohmann::json;

json softmax_family_config(const char* type) {
  return {{"model_type", type},           {"hidden_size", 64},   {"num_hidden_layers", 2},
          {"vocab_size", 100},            {"num_experts", 4},    {"num_experts_per_tok", 2},
          {"moe_intermediate_size", 32},  {"intermediate_size", 32}};
}

// scoring_func, topk_method, n_group, topk_group and routed_scaling_factor are DeepSeek's routing
// keys (spec 5). The softmax top-k routers of Qwen2/3-MoE, Mixtral and OLMoE have no such parameters
// and transformers ignores the keys in their config.json, but lutb read them for every family: a
// qwen3_moe config with "routed_scaling_factor": 2.5 scaled every expert's output by 2.5,
// "scoring_func": "sigmoid" switched to DeepSeek's grouped sigmoid routing, and "n_group": 3 (which
// does not divide 4 experts) was refused.
TEST(ModelConfigNewUserNu16, DeepSeekRoutingKeysAreIgnoredBySoftmaxFamilies) {
  for (const char* type : {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe"}) {
    SCOPED_TRACE(type);
    json j = softmax_family_config(type);
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
    j["routed_scaling_factor"] = 2.5;
    j["n_group"] = 3;
    j["topk_group"] = 2;
    ModelConfig c;
    ASSERT_NO_THROW(c = parse_model_config(j, "m/config.json"));
    EXPECT_EQ(c.scoring_func, ScoringFunc::softmax);
    EXPECT_EQ(c.topk_method, "");
    EXPECT_EQ(c.n_group, 1);
    EXPECT_EQ(c.topk_group, 1);
    EXPECT_EQ(c.routed_scaling_factor, 1.0);
    // Values DeepSeek would refuse are not read either.
    j["scoring_func"] = "relu";
    j["routed_scaling_factor"] = -1;
    EXPECT_NO_THROW(parse_model_config(j, "m/config.json"));
  }
  // DeepSeek-V3 still reads them all (control).
  json d = softmax_family_config("deepseek_v3");
  d["num_experts"] = 8;
  d["n_group"] = 4;
  d["topk_group"] = 2;
  d["routed_scaling_factor"] = 2.5;
  const ModelConfig c = parse_model_config(d, "m/config.json");
  EXPECT_EQ(c.scoring_func, ScoringFunc::sigmoid);
  EXPECT_EQ(c.topk_method, "noaux_tc");
  EXPECT_EQ(c.n_group, 4);
  EXPECT_EQ(c.topk_group, 2);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
}

// The same through the whole model: tiny-qwen3-moe with DeepSeek's keys added to its config.json has
// transformers' loss, the checkpoint's own (it was 4.040 nats with routed_scaling_factor 2.5 and
// 3.919 with scoring_func "sigmoid" instead of 3.843 over 4 windows).
TEST(ModelConfigNewUserNu16, QwenLossIgnoresDeepSeekRoutingKeys) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-qwen3-moe");
  namespace fs = std::filesystem;
  const auto tokens = model::load_token_ids(dir / "val_tokens.safetensors");
  model::EvalOptions eo;
  eo.max_windows = 2;
  auto loss = [&](const fs::path& d) {
    model::CheckpointMoe moe(d, model::MoeOptions{});
    model::LanguageModel lm = model::LanguageModel::load(d, moe.factory());
    return model::evaluate(lm, tokens, eo).val_loss;
  };
  const double reference = loss(dir);
  test::TempDir t;
  for (const auto& [key, value] : {std::pair<const char*, json>{"routed_scaling_factor", 2.5},
                                   std::pair<const char*, json>{"scoring_func", "sigmoid"}}) {
    SCOPED_TRACE(key);
    const fs::path d = t.path / key;
    fs::create_directories(d);
    for (const char* f : {"model.safetensors", "val_tokens.safetensors"}) fs::create_symlink(dir / f, d / f);
    json cfg;
    std::ifstream(dir / "config.json") >> cfg;
    cfg[key] = value;
    std::ofstream(d / "config.json") << cfg.dump(1);
    EXPECT_NEAR(loss(d), reference, 1e-6);
  }
}

// A weights file cut short (an interrupted download or copy: 13.9 of tiny-qwen3-moe's 27.8 MB) was
// reported as "tensor 'X': data_offsets [13772544, 13903616] out of range: the data buffer has
// 13899540 bytes", which left the user to work out that the file, not its header, is at fault.
TEST(SafetensorsNewUserNu16, TruncatedFileSaysHowManyBytesAreMissing) {
  namespace fs = std::filesystem;
  test::TempDir t;
  const fs::path full = t.path / "full.safetensors", cut = t.path / "cut.safetensors";
  write_safetensors(full, {{"a", OwnedTensor{DType::U8, {100}, std::vector<std::uint8_t>(100, 1)}},
                           {"b", OwnedTensor{DType::U8, {300}, std::vector<std::uint8_t>(300, 2)}}});
  const auto size = fs::file_size(full);
  fs::copy_file(full, cut);
  fs::resize_file(cut, size - 250);  // b's data [100, 400) now ends 250 bytes past the file's end
  std::string what = "no exception";
  try {
    SafetensorsFile f(cut);
  } catch (const SafetensorsError& e) {
    what = e.what();
  }
  EXPECT_EQ(what, fmt::format("{}: tensor 'b': data_offsets [100, 400] out of range: the data buffer has 150 bytes; the "
                              "header's tensors need 400 bytes of data, 250 more than the file ({} bytes) holds: the file is "
                              "truncated (an interrupted download or copy?) or its header is corrupt",
                              cut.string(), size - 250));
}

// nu16: quantize and synth wrote config.json and the shard index with std::ofstream, without fsync
// (a power cut after the rename could leave a finished checkpoint with empty small files) and, for
// synth's index, without any error check. Both now go through detail::write_text_file: written,
// fsynced and checked, the error naming the file. /dev/full fails every write with ENOSPC.
TEST(CheckpointNewUserNu16, SmallFilesAreWrittenCheckedAndNamed) {
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
