// q/k norms follow the family (transformers: Qwen3-MoE and OLMoE attention have them, Mixtral and
// Qwen2-MoE not): missing ones are refused, stray ones are unknown tensors and not applied.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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
using test::edited_model;
using test::error_of;
using test::TempDir;

std::string check_error(const fs::path& dir) {
  return error_of<model::ModelError>([&] { (void)model::LanguageModel::check_tensors(dir); });
}

// A BF16 tensor of `n` elements all equal to 2.0.
OwnedTensor twos(std::int64_t n) {
  std::vector<std::uint8_t> b(static_cast<std::size_t>(n) * 2);
  for (std::int64_t i = 0; i < n; ++i) {
    b[2 * i] = 0x00;
    b[2 * i + 1] = 0x40;  // BF16 2.0 = 0x4000
  }
  return OwnedTensor{DType::BF16, {n}, std::move(b)};
}

// Qwen3-MoE's attention has q/k norms (transformers Qwen3MoeAttention): a checkpoint without q_norm (with or
// without k_norm) is refused, as one without k_norm alone is; run without them a layer gives another loss
// (3.953 instead of 3.820 for one window).
TEST(ModelQkNorm, Qwen3MoeMissingQNormRefused) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const std::string q = "model.layers.0.self_attn.q_norm.weight", k = "model.layers.0.self_attn.k_norm.weight";
  const fs::path no_q = edited_model(t.path / "no_q", src, {q});
  const fs::path no_qk = edited_model(t.path / "no_qk", src, {q, k});
  const fs::path no_k = edited_model(t.path / "no_k", src, {k});
  const auto want = [](const fs::path& dir, const std::string& name) {
    return dir.string() + ": missing tensor " + name + "; " + (dir / "model.safetensors").string() +
           " has no such tensor";
  };
  EXPECT_EQ(check_error(no_q), want(no_q, q));
  EXPECT_EQ(check_error(no_qk), want(no_qk, q));
  EXPECT_EQ(check_error(no_k), want(no_k, k));  // as before

  // lutb eval refuses it (it reported a loss), and lutb quantize (it wrote a checkpoint).
  test::CliResult r = test::run_cli("eval " + test::q(no_q) + " --max-windows 1");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("missing tensor " + q), std::string::npos) << r.err;
  r = test::run_cli("quantize " + test::q(no_qk) + " -o " + test::q(t.path / "lb") + " --no-progress");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("missing tensor " + q), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(t.path / "lb"));
}

// Mixtral's attention has no q/k norms (transformers MixtralAttention): stray
// model.layers.0.self_attn.{q,k}_norm.weight are tensors lutb eval does not read, with the note any unknown
// tensor gets, and the loss is the model's (3.87, not the 4.10 with them applied).
TEST(ModelQkNorm, MixtralStrayQkNormsNotApplied) {
  LUTB_MODEL_OR_SKIP(src, "tiny-mixtral");
  TempDir t;
  const std::string q = "model.layers.0.self_attn.q_norm.weight", k = "model.layers.0.self_attn.k_norm.weight";
  std::vector<std::pair<std::string, OwnedTensor>> add;
  add.push_back({q, twos(64)});  // [head_dim]: a per-head norm, as Qwen3-MoE's
  add.push_back({k, twos(64)});
  const fs::path m = edited_model(t.path / "m", src, {}, std::move(add));

  // Not among the tensors the model reads (lutb quantize copies them with a warning).
  const std::vector<std::string> read = model::LanguageModel::check_tensors(m);
  EXPECT_EQ(std::find(read.begin(), read.end(), q), read.end());
  EXPECT_EQ(std::find(read.begin(), read.end(), k), read.end());

  const test::CliResult base = test::run_cli("eval " + test::q(src) + " --max-windows 1 --json");
  const test::CliResult stray = test::run_cli("eval " + test::q(m) + " --max-windows 1 --json");
  ASSERT_EQ(base.status, 0) << base.err;
  ASSERT_EQ(stray.status, 0) << stray.err;
  EXPECT_EQ(stray.json()["val_loss"], base.json()["val_loss"]);
  const std::string file = (m / "model.safetensors").string(), config = (m / "config.json").string();
  for (const std::string& n : {k, q})
    EXPECT_NE(stray.err.find("lutb: warning: " + file + ": tensor " + n + " is not a tensor of the mixtral model " +
                             config + " describes (a q/k norm, which the mixtral attention does not have); lutb eval "
                                      "does not read it"),
              std::string::npos)
        << stray.err;
}

// The family decides (transformers: Qwen3-MoE and OLMoE attention have q/k norms, Mixtral and
// Qwen2-MoE not): stored q/k norms are the model's tensors for the first, unknown ones for the others.
TEST(ModelQkNorm, QkNormsFollowTheFamily) {
  const auto warnings = [](const std::string& type) {
    const nlohmann::json j = {{"model_type", type},          {"hidden_size", 64},        {"num_hidden_layers", 1},
                              {"vocab_size", 32},            {"num_attention_heads", 4}, {"num_key_value_heads", 4},
                              {"head_dim", 16},              {"num_experts", 2},         {"num_experts_per_tok", 1},
                              {"moe_intermediate_size", 16}, {"intermediate_size", 16}};
    TempDir t;
    std::ofstream(t.path / "config.json") << j.dump();
    std::vector<std::pair<std::string, OwnedTensor>> ts;
    ts.push_back({"model.layers.0.self_attn.q_norm.weight", twos(16)});
    ts.push_back({"model.layers.0.self_attn.k_norm.weight", twos(16)});
    write_safetensors(t.path / "model.safetensors", ts);
    const ModelConfig cfg = load_model_config(t.path);
    const SafetensorsCollection st = SafetensorsCollection::open_dir(t.path);
    return detail::check_tensor_names(cfg, st, t.path / "config.json", "not read", "").size();
  };
  EXPECT_EQ(warnings("qwen3_moe"), 0u);
  EXPECT_EQ(warnings("olmoe"), 0u);
  EXPECT_EQ(warnings("mixtral"), 2u);
  EXPECT_EQ(warnings("qwen2_moe"), 2u);
}

}  // namespace
}  // namespace lutb
