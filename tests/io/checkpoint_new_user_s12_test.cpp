// Defects a new user found (sessions 11 and 12) in the checkpoint reader and writer, fixed in
// session 12: an invalid --match reported after the output checks, unknown or misspelt tensor names
// copied without a word, a vague refusal to re-quantise a LUT-B file, confusing messages for an
// output given as a symbolic link, and config.json checks (topk_method, routed_scaling_factor). Each
// test failed on the code before its fix.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/checkpoint.hpp"
#include "lutb/safetensors.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

SynthOptions small() {
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = 1;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 4;
  o.progress = false;
  return o;
}

QuantizeOptions quiet() {
  QuantizeOptions q;
  q.progress = false;
  return q;
}

template <class Ex, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Ex& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Rewrites `file` with BF16 [2, 2] zero tensors `extra` added.
void add_tensors(const fs::path& file, const std::vector<std::string>& extra) {
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  {
    SafetensorsFile f(file);
    for (const auto& n : f.names()) {
      const TensorView& v = f.get(n);
      ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
  }
  for (const auto& n : extra) ts.push_back({n, OwnedTensor{DType::BF16, {2, 2}, std::vector<std::uint8_t>(8, 0)}});
  write_safetensors(file, ts);
}

// Finding 7: with an existing output and an invalid --match, quantize_file reported the output
// first; the user removed it and only then learnt that the regex was invalid.
TEST(NewUserS12, InvalidMatchIsReportedBeforeTheOutput) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
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

// Finding 6: an output given as a symbolic link was refused as "exists and is not a directory" (a link
// to a folder that plainly exists, or a dangling link) or "not a regular .safetensors file".
TEST(NewUserS12, OutputGivenAsASymlinkIsNamedAsOne) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
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
    SynthOptions so = small();
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

// Finding 5: re-quantising a LUT-B file in file mode was refused vaguely ("U8 [..]: only 2-D or 3-D
// float tensors can be quantised", "no 2-D or 3-D float tensor to quantise"), and --all quantised the
// router a LUT-B checkpoint keeps unquantised without a word.
TEST(NewUserS12, RequantisingALutbFileSaysItIsLutb) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
  quantize_checkpoint(t.path / "in", t.path / "q", quiet());
  const fs::path f = t.path / "q" / "model.safetensors";
  const std::string x0 = "model.layers.0.mlp.experts.0.down_proj.weight";
  const std::string example =
      x0 + "_packed with " + x0 + "_codebook and " + x0 + "_scale, and 11 more LUT-B weights";
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_file(f, t.path / "a.safetensors", "", quiet()); }),
            f.string() + ": the file already holds LUT-B tensors (" + example +
                "); --all (the default without --match) would quantise its 1 remaining float tensor too (e.g. "
                "model.layers.0.mlp.gate.weight), which a LUT-B checkpoint keeps unquantised. To quantise some of "
                "them, name them with --match REGEX; to quantise anew, start from the original float file; nothing "
                "written");
  const std::string x1 = "model.layers.0.mlp.experts.1.down_proj.weight";
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_file(f, t.path / "a.safetensors", "experts\\.1\\.down", quiet()); }),
            f.string() + ": tensor " + x1 + "_packed matches --match \"experts\\.1\\.down\" but is already LUT-B (part of "
                "the quantised weight " + x1 + ": " + x1 + "_packed, " + x1 + "_codebook, " + x1 +
                "_scale) and cannot be quantised again; to quantise " + x1 +
                " anew (e.g. with another --fitter), start from the original float file; to quantise other tensors, "
                "narrow --match; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "a.safetensors"));
  // Naming the float tensors is allowed; the result holds nothing but LUT-B tensors, and is then
  // refused as such.
  quantize_file(f, t.path / "b.safetensors", "gate\\.weight$", quiet());
  EXPECT_TRUE(SafetensorsFile(t.path / "b.safetensors").contains("model.layers.0.mlp.gate.weight_packed"));
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_file(t.path / "b.safetensors", t.path / "c.safetensors", "", quiet()); }),
            (t.path / "b.safetensors").string() + ": the file is already LUT-B (" + x0 + "_packed with " + x0 +
                "_codebook and " + x0 +
                "_scale, and 12 more LUT-B weights) and holds no float tensor left to quantise; nothing to do: to "
                "quantise anew (e.g. with another --fitter), start from the original float file; nothing written");
  // Checkpoint mode says what to do too.
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "q", t.path / "qq", quiet()); }),
            (t.path / "q").string() + ": the checkpoint is already LUT-B (" + (t.path / "q" / "config.json").string() +
                " has a LUT-B quantization_config); nothing to do: to quantise again (e.g. with another --fitter), "
                "start from the original BF16 checkpoint; nothing written");
}

// Finding 3: DeepSeek's topk_method was not checked (a typo was routed as noaux_tc or greedy without a
// word) and a negative routed_scaling_factor was accepted (every expert output's sign flipped).
TEST(NewUserS12, DeepseekRoutingKeysAreChecked) {
  SynthOptions o = small();
  o.family = ModelFamily::deepseek_v3;
  const nlohmann::json base = synth_config(o).raw;
  ASSERT_EQ(base.at("topk_method"), "noaux_tc");
  const auto with = [&](const nlohmann::json& patch) {
    nlohmann::json j = base;
    j.merge_patch(patch);
    return error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); });
  };
  const std::string accepted =
      "(accepted: \"noaux_tc\" with scoring_func \"sigmoid\"; \"greedy\" or \"group_limited_greedy\" with scoring_func "
      "\"softmax\")";
  EXPECT_EQ(with({{"topk_method", "noaux-tc"}}), "m/config.json: key 'topk_method': \"noaux-tc\" is not supported " + accepted);
  EXPECT_EQ(with({{"model_type", "deepseek_v2"}, {"topk_method", "group_limited"}}),
            "m/config.json: key 'topk_method': \"group_limited\" is not supported " + accepted);
  EXPECT_EQ(with({{"topk_method", "greedy"}}),
            "m/config.json: key 'topk_method': \"greedy\" with scoring_func \"sigmoid\" is not supported (accepted: "
            "\"noaux_tc\" with sigmoid scores; the scoring_func default is \"sigmoid\" for deepseek_v3)");
  EXPECT_EQ(with({{"topk_method", "noaux_tc"}, {"scoring_func", "softmax"}}),
            "m/config.json: key 'topk_method': \"noaux_tc\" with scoring_func \"softmax\" is not supported (accepted: "
            "\"greedy\" or \"group_limited_greedy\" with softmax scores; the scoring_func default is \"sigmoid\" for "
            "deepseek_v3)");
  // What the routing implements is accepted.
  EXPECT_EQ(with({{"topk_method", "noaux_tc"}}), "no exception");
  EXPECT_EQ(with({{"topk_method", "greedy"}, {"scoring_func", "softmax"}}), "no exception");
  EXPECT_EQ(with({{"model_type", "deepseek_v2"}, {"topk_method", "group_limited_greedy"}, {"scoring_func", nullptr}}),
            "no exception");
  // routed_scaling_factor: finite and > 0.
  EXPECT_EQ(with({{"routed_scaling_factor", -2.5}}),
            "m/config.json: key 'routed_scaling_factor': must be a finite number > 0, got -2.5");
  EXPECT_EQ(with({{"routed_scaling_factor", 0}}),
            "m/config.json: key 'routed_scaling_factor': must be a finite number > 0, got 0");
  EXPECT_EQ(with({{"routed_scaling_factor", std::numeric_limits<double>::infinity()}}),
            "m/config.json: key 'routed_scaling_factor': must be a finite number > 0, got inf");
  nlohmann::json ok = base;
  ok["routed_scaling_factor"] = 2.5;
  EXPECT_EQ(parse_model_config(ok, "m/config.json").routed_scaling_factor, 2.5);
}

// Finding 2: grouped-routing faults were refused only when a layer was built, as "router of
// deepseek_v3: RouterConfig: top_k=5 exceeds ...", naming neither config.json nor a key.
TEST(NewUserS12, GroupedRoutingKeysNameTheFileAndKey) {
  SynthOptions o = small();
  o.family = ModelFamily::deepseek_v3;
  nlohmann::json j = synth_config(o).raw;  // 4 experts
  j["n_group"] = 2;
  j["topk_group"] = 1;
  j["num_experts_per_tok"] = 3;
  EXPECT_EQ(error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'num_experts_per_tok': 3 exceeds the 2 experts of the groups the router keeps "
            "(topk_group 1 x 2 experts per group: 4 experts in n_group 2)");
  j["num_experts_per_tok"] = 2;
  EXPECT_EQ(parse_model_config(j, "m/config.json").n_group, 2);
  j["n_group"] = 4;
  EXPECT_EQ(error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); }),
            "m/config.json: key 'n_group': 4 groups of the 4 experts leave 1 expert per group; sigmoid (noaux_tc) "
            "routing scores each group by the sum of its top 2 experts, so a group needs at least 2");
  // Softmax greedy routing does not use the groups: accepted as before.
  j["scoring_func"] = "softmax";
  j["topk_method"] = "greedy";
  j["num_experts_per_tok"] = 3;
  EXPECT_EQ(parse_model_config(j, "m/config.json").num_experts_per_tok, 3);
  j["topk_method"] = "group_limited_greedy";
  j["n_group"] = 2;
  EXPECT_TRUE(has(error_of<ConfigError>([&] { parse_model_config(j, "m/config.json"); }),
                  "m/config.json: key 'num_experts_per_tok': 3 exceeds the 2 experts"));
}

// Finding 1: tensors that are not tensors of the model were copied by lutb quantize without a word,
// a misspelt routed-expert name included (copied unquantised, and never read by the loaders).
TEST(NewUserS12, QuantizeWarnsAboutStrayTensorsAndRefusesMisspeltExperts) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small());
  const fs::path f = t.path / "in" / "model.safetensors";
  const std::string cfg = (t.path / "in" / "config.json").string();
  add_tensors(f, {"model.extra.weight", "model.layers.0.self_attn.q_prj.weight", "model.layers.0.mlp.gate_proj.weight",
                  "model.layers.0.self_attn.rotary_emb.inv_freq"});
  const QuantizeSummary s = quantize_checkpoint(t.path / "in", t.path / "out", quiet());
  const std::string head = f.string() + ": tensor ";
  const std::string tail = " is not a tensor of the qwen3_moe model " + cfg + " describes";
  EXPECT_EQ(s.warnings, (std::vector<std::string>{
                            head + "model.extra.weight" + tail + "; copied unquantised",
                            head + "model.layers.0.mlp.gate_proj.weight" + tail + " (a dense MLP weight, but " + cfg +
                                " makes layer 0 a MoE layer); copied unquantised",
                            head + "model.layers.0.self_attn.q_prj.weight" + tail + "; copied unquantised"}));
  EXPECT_TRUE(SafetensorsFile(t.path / "out" / "model.safetensors").contains("model.extra.weight"));

  // Beyond 5, one line counts the rest.
  add_tensors(f, {"a.0", "a.1", "a.2", "a.3"});
  const QuantizeSummary s7 = quantize_checkpoint(t.path / "in", t.path / "out7", quiet());
  ASSERT_EQ(s7.warnings.size(), 6u);
  EXPECT_EQ(s7.warnings[0], head + "a.0" + tail + "; copied unquantised");
  EXPECT_EQ(s7.warnings[5], "2 more tensors are not tensors of the qwen3_moe model " + cfg +
                                " describes (the first 5 are listed above); for each: copied unquantised");

  // A misspelt expert tensor is refused, naming what was expected.
  synthesize_checkpoint(t.path / "in2", small());
  const fs::path f2 = t.path / "in2" / "model.safetensors";
  add_tensors(f2, {"model.layers.0.mlp.experts.1.gate_prj.weight"});
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in2", t.path / "out2", quiet()); }),
            f2.string() +
                ": tensor model.layers.0.mlp.experts.1.gate_prj.weight is named like an expert tensor of MoE layer 0 "
                "but is not one the model has (expected per expert model.layers.0.mlp.experts.0.gate_proj.weight for "
                "experts 0..3 and gate, up, down, or stacked model.layers.0.mlp.experts.gate_up_proj and "
                "model.layers.0.mlp.experts.down_proj; a misspelt name?); lutb would not read it: rename or remove "
                "it; nothing written");
  EXPECT_FALSE(fs::exists(t.path / "out2"));
  // LUT-B tensors in a checkpoint whose config.json is not LUT-B.
  synthesize_checkpoint(t.path / "in3", small());
  const fs::path f3 = t.path / "in3" / "model.safetensors";
  add_tensors(f3, {"model.layers.0.mlp.experts.2.up_proj.weight_packed"});
  EXPECT_EQ(error_of<CheckpointError>([&] { quantize_checkpoint(t.path / "in3", t.path / "out3", quiet()); }),
            f3.string() +
                ": tensor model.layers.0.mlp.experts.2.up_proj.weight_packed is a LUT-B tensor of a routed expert, but " +
                (t.path / "in3" / "config.json").string() +
                " has no LUT-B quantization_config (the \"quantization_config\" with \"quant_method\": \"lut_b\" that "
                "says how to read LUT-B weights, spec 2.2; a BF16 checkpoint's experts are float tensors): if the "
                "checkpoint's experts are LUT-B, restore the config.json written with them; otherwise remove the "
                "tensor; nothing written");
}

}  // namespace
}  // namespace lutb
