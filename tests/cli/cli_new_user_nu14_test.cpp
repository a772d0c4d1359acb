// Defects a fresh new user found in session 14 (helper nu14) with unusual files and arguments. Each
// test failed on the code before its fix.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <string>

#include <fcntl.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "io/config_json.hpp"
#include "io/tensor_names.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/model.hpp"
#include "lutb/safetensors.hpp"
#include "model/model_test_util.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

const nlohmann::json& qwen_base() {
  static const nlohmann::json base = {{"model_type", "qwen3_moe"},
                                      {"hidden_size", 256},
                                      {"num_hidden_layers", 2},
                                      {"vocab_size", 64},
                                      {"num_attention_heads", 4},
                                      {"num_key_value_heads", 2},
                                      {"head_dim", 64},
                                      {"num_experts", 4},
                                      {"num_experts_per_tok", 2},
                                      {"moe_intermediate_size", 64},
                                      {"max_position_embeddings", 512},
                                      {"rms_norm_eps", 1e-6},
                                      {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}}}};
  return base;
}

const nlohmann::json& deepseek_base() {
  static const nlohmann::json base = {
      {"model_type", "deepseek_v3"}, {"hidden_size", 256},    {"num_hidden_layers", 2},    {"vocab_size", 64},
      {"num_attention_heads", 4},    {"n_routed_experts", 4}, {"num_experts_per_tok", 2},  {"moe_intermediate_size", 64},
      {"kv_lora_rank", 64},          {"q_lora_rank", 96},     {"qk_nope_head_dim", 32},    {"qk_rope_head_dim", 32},
      {"v_head_dim", 32},            {"first_k_dense_replace", 1}, {"intermediate_size", 512}};
  return base;
}

std::string config_error(const nlohmann::json& base, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = base;
  edit(j);
  try {
    model::TransformerConfig::from_json(j, "c.json");
  } catch (const model::ModelError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

// head_dim 2e9 (or DeepSeek's qk_rope_head_dim 2e9) in a corrupt config.json: lutb eval built a rotary
// table of 1e9 FP32 values before comparing the attention tensors' shapes with it (71 s, 3.9 GB of
// memory, then "q_proj.weight has shape [256, 256], expected [8000000000, 256]"). A negative MLA width
// was reported as a tensor "expected [124, 64]". Both are refused when config.json is read.
TEST(NewUserNu14, ImplausibleHeadWidthsRefused) {
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json&) {}), "no exception");
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["head_dim"] = 2000000000; }),
            "c.json: key 'head_dim': 2000000000 is more than lutb supports (65536; published models use 64-256): a "
            "corrupt config.json?");
  // A non-positive head_dim keeps the rotary dimension's wording (NewUserS11.ConfigRopeAndNormValuesNameTheKey).
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["head_dim"] = -64; }),
            "c.json: key 'head_dim': head_dim -64 x partial_rotary_factor 1 gives a rotary dimension of -64; it must "
            "be even and positive");
  EXPECT_EQ(config_error(qwen_base(), [](nlohmann::json& j) { j["head_dim"] = 65536; }), "no exception");

  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json&) {}), "no exception");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["qk_rope_head_dim"] = 2000000000; }),
            "c.json: key 'qk_rope_head_dim': 2000000000 is more than lutb supports (65536; published models use "
            "64-256): a corrupt config.json?");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["v_head_dim"] = -1; }),
            "c.json: key 'v_head_dim': must be positive, got -1");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["qk_nope_head_dim"] = 0; }),
            "c.json: key 'qk_nope_head_dim': must be positive, got 0");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["kv_lora_rank"] = -8; }),
            "c.json: key 'kv_lora_rank': must be positive, got -8");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["q_lora_rank"] = -1; }),
            "c.json: key 'q_lora_rank': must be positive (or 0 / null for no query compression), got -1");
  EXPECT_EQ(config_error(deepseek_base(), [](nlohmann::json& j) { j["q_lora_rank"] = nullptr; }), "no exception");
}

// Writes captured activations for layer 0 of a model of hidden size `H`.
void write_acts(const fs::path& p, DType in_dtype, std::int64_t H, std::uint8_t out_fill) {
  const std::int64_t T = 4;
  OwnedTensor in{in_dtype, {T, H}, std::vector<std::uint8_t>(static_cast<std::size_t>(T * H * dtype_size(in_dtype)), 0)};
  for (std::size_t i = 1; i < in.bytes.size(); i += 2) in.bytes[i] = 0x3F;  // BF16 1.0-ish values, or small integers
  OwnedTensor out{DType::BF16, {T, H}, std::vector<std::uint8_t>(static_cast<std::size_t>(T * H * 2), out_fill)};
  write_safetensors(p, {{"layers.0.moe_input", in}, {"layers.0.moe_output", out}});
}

// Captured activations of an integer dtype: the error named the tensor but not the file ("lutb: error:
// tensor 'layers.0.moe_input': dtype I32 cannot be read as floating point").
TEST(NewUserNu14, MoeIntegerActivationsNameTheFile) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const fs::path acts = t.path / "acts.safetensors";
  write_acts(acts, DType::I16, 256, 0x3C);
  const test::CliResult r =
      test::run_cli("moe " + test::quote(src) + " --layer 0 --threads 1 --activations " + test::quote(acts));
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_EQ(r.err, "lutb: error: " + acts.string() +
                       ": tensor layers.0.moe_input has dtype I16; captured activations must be floating point (BF16, "
                       "F16, F32, F64 or F8_E4M3)\n");
}

// Captured outputs that are all zero: lutb moe printed "rel_l2 inf ... cosine -nan" (JSON: null) and
// exited with status 0.
TEST(NewUserNu14, MoeAllZeroCapturedOutputsRefused) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const fs::path acts = t.path / "acts.safetensors";
  write_acts(acts, DType::BF16, 256, 0x00);
  const test::CliResult r = test::run_cli("moe " + test::quote(src) + " --layer 0 --threads 1 --json --activations " +
                                          test::quote(acts));
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_EQ(r.err, "lutb: error: " + acts.string() +
                       ": tensor layers.0.moe_output is all zero (4 tokens): the error relative to it is undefined; "
                       "were the outputs captured?\n");
  EXPECT_EQ(r.out.find("inf"), std::string::npos) << r.out;
  // Non-zero outputs still run (the same inputs, outputs of BF16 0x3C3C = 0.0115).
  write_acts(acts, DType::BF16, 256, 0x3C);
  const test::CliResult ok = test::run_cli("moe " + test::quote(src) + " --layer 0 --threads 1 --json --activations " +
                                           test::quote(acts));
  ASSERT_EQ(ok.status, 0) << ok.out << ok.err;
  EXPECT_EQ(ok.json()["tokens"], 4);
}

// Overwrites element `index` of BF16 tensor `name` in safetensors file `file` with the bits `bits`.
void poke_bf16(const fs::path& file, const std::string& name, std::size_t index, std::uint16_t bits) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(static_cast<unsigned char>(f.get())) << (8 * i);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  const auto begin = nlohmann::json::parse(header).at(name).at("data_offsets").at(0).get<std::uint64_t>();
  f.seekp(static_cast<std::streamoff>(8 + n + begin + 2 * index));
  const char b[2] = {static_cast<char>(bits & 0xFF), static_cast<char>(bits >> 8)};
  f.write(b, 2);
}

// lutb moe on a layer whose router holds +Inf: "78592 of 131072 outputs are NaN or infinite (...): a
// weight, scale or input of the layer is NaN or overflowed", naming no tensor (lutb eval names it).
TEST(NewUserNu14, MoeNamesTheNonFiniteTensor) {
  LUTB_MODEL_OR_SKIP(src, "tiny-qwen3-moe");
  TempDir t;
  const fs::path m = t.path / "m";
  fs::create_directories(m);
  for (const char* f : {"config.json", "model.safetensors", "moe_activations.safetensors"}) {
    fs::copy_file(src / f, m / f);
    fs::permissions(m / f, fs::perms::owner_read | fs::perms::owner_write);
  }
  poke_bf16(m / "model.safetensors", "model.layers.1.mlp.gate.weight", 5, 0x7F80);  // +Inf
  // An input norm of the same layer holding NaN is not the MoE block's: not named.
  poke_bf16(m / "model.safetensors", "model.layers.1.input_layernorm.weight", 0, 0x7FC0);
  const test::CliResult r = test::run_cli("moe " + test::quote(m) + " --layer 1 --threads 1");
  EXPECT_EQ(r.status, 1);
  const std::string want = "a weight, scale or input of the layer is NaN or overflowed; " +
                           (m / "model.safetensors").string() +
                           " holds +Inf in tensor model.layers.1.mlp.gate.weight at [0, 5]\n";
  ASSERT_GE(r.err.size(), want.size()) << r.err;
  EXPECT_EQ(r.err.substr(r.err.size() - want.size()), want) << r.err;
}

// `PREFIX lutb ARGS` through the shell (PREFIX: environment assignments, `timeout ...`); stdout is
// discarded, stderr captured.
test::CliResult run_with(const std::string& prefix, const std::string& args) {
  TempDir t;
  const std::string err_file = (t.path / "err.txt").string();
  const std::string cmd =
      prefix + " '" + std::string(LUTB_CLI_PATH) + "' " + args + " >/dev/null 2>'" + err_file + "'";
  const int st = std::system(cmd.c_str());
  test::CliResult r;
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream e(err_file);
  r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  return r;
}

// Runs `fn` (which should refuse the named pipe `fifo`) with a deadline. A reader that blocks in
// open() is released by opening the pipe for writing, so the test never hangs: it fails instead.
std::string refused_without_waiting(const fs::path& fifo, const std::function<void()>& fn) {
  auto fut = std::async(std::launch::async, [&]() -> std::string {
    try {
      fn();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no exception";
  });
  if (fut.wait_for(std::chrono::seconds(20)) == std::future_status::ready) return fut.get();
  const int w = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);  // lets the blocked open() return
  if (w >= 0) ::close(w);
  return "blocked on the named pipe: " + fut.get();
}

// A named pipe as model.safetensors, config.json, the index or the tokens file: open() blocked until a
// writer appeared, so lutb eval / moe / quantize hung (quantize also ignored a first SIGTERM: its
// handler only sets a flag, and open() restarts). Refused as not a regular file.
TEST(NewUserNu14, NamedPipesAreRefusedNotWaitedOn) {
  TempDir t;
  const fs::path dir = t.path / "m";
  fs::create_directories(dir);
  const fs::path weights = dir / "model.safetensors", config = dir / "config.json";
  ASSERT_EQ(::mkfifo(weights.c_str(), 0644), 0);
  ASSERT_EQ(::mkfifo(config.c_str(), 0644), 0);
  EXPECT_EQ(refused_without_waiting(weights, [&] { SafetensorsFile f(weights); }),
            weights.string() + ": is a named pipe (FIFO), not a regular file");
  EXPECT_EQ(refused_without_waiting(config, [&] { (void)model::TransformerConfig::load(dir); }),
            config.string() + ": is a named pipe (FIFO); the checkpoint's config.json must be a regular file");
  EXPECT_EQ(refused_without_waiting(config, [&] { (void)load_model_config(dir); }),
            config.string() + ": is a named pipe (FIFO); the checkpoint's config.json must be a regular file");
  const fs::path index = dir / "model.safetensors.index.json";
  ASSERT_EQ(::mkfifo(index.c_str(), 0644), 0);
  EXPECT_EQ(refused_without_waiting(index, [&] { (void)SafetensorsCollection::open_dir(dir); }),
            index.string() + ": is a named pipe (FIFO); the index must be a regular file");
  EXPECT_EQ(detail::non_regular_kind(dir), "a directory");
  EXPECT_EQ(detail::non_regular_kind(dir / "absent"), "");

  // The CLI, end to end: lutb eval read config.json for --quant's default before the loader did.
  // `timeout` kills a run that blocks (exit status 137), which the assertions report.
  const test::CliResult r = run_with("timeout -s KILL 30", "eval " + test::quote(dir) + " --threads 1");
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.err, "lutb: error: " + config.string() +
                       ": is a named pipe (FIFO); the checkpoint's config.json must be a regular file\n");
}

// Writes a two-shard checkpoint folder whose index names shard 1 as `first_name` for tensor a and as
// "model-00001-of-00002.safetensors" for tensor b.
void write_sharded(const fs::path& dir, const std::string& first_name) {
  fs::create_directories(dir);
  const OwnedTensor x{DType::F32, {2}, std::vector<std::uint8_t>(8, 0)};
  write_safetensors(dir / "model-00001-of-00002.safetensors", {{"a", x}, {"b", x}});
  write_safetensors(dir / "model-00002-of-00002.safetensors", {{"c", x}});
  const nlohmann::json index = {{"metadata", nlohmann::json::object()},
                                {"weight_map",
                                 {{"a", first_name},
                                  {"b", "model-00001-of-00002.safetensors"},
                                  {"c", "model-00002-of-00002.safetensors"}}}};
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
}

std::string open_dir_error(const fs::path& dir) {
  try {
    (void)SafetensorsCollection::open_dir(dir);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no exception";
}

// An index naming one shard two ways ("./model-00001-of-00002.safetensors" for one tensor, without "./"
// for another; transformers reads both as one file) was refused as "tensor 'a' appears in both
// d/model-00001-of-00002.safetensors (where the index lists it) and d/./model-00001-of-00002.safetensors".
// An empty weight_map made every tensor "missing", and a shard that is not a safetensors file (the
// folder itself, config.json) was reported without the index entry that named it.
TEST(NewUserNu14, ShardIndexEntriesReadAsTransformersDoes) {
  TempDir t;
  const fs::path d = t.path / "d";
  write_sharded(d, "./model-00001-of-00002.safetensors");
  EXPECT_EQ(open_dir_error(d), "no exception");
  const SafetensorsCollection c = SafetensorsCollection::open_dir(d);
  EXPECT_EQ(c.files().size(), 2u);
  EXPECT_EQ(&c.file_of("a"), &c.file_of("b"));
  EXPECT_EQ(c.get("c").nbytes, 8u);

  const fs::path index = d / "model.safetensors.index.json";
  std::ofstream(index) << R"({"metadata": {}, "weight_map": {}})";
  EXPECT_EQ(open_dir_error(d), index.string() +
                                   ": 'weight_map' is empty: it lists no tensor (an index must name the shard of "
                                   "every tensor)");

  std::ofstream(index) << R"({"weight_map": {"a": ".", "b": "model-00001-of-00002.safetensors"}})";
  EXPECT_EQ(open_dir_error(d), index.string() + ": weight_map entry 'a' names shard '.', which cannot be read: " +
                                   (d / ".").string() + ": is a directory, not a regular file");
}

// Empty path arguments: `lutb quantize IN -o ""` failed with "filesystem error: cannot make absolute
// path: Invalid argument []"; `lutb eval ""` with ": no such directory". `lutb moe` on a folder that
// does not exist was told "--activations not given and /no/such holds no moe_activations.safetensors".
TEST(NewUserNu14, EmptyAndMissingPathsNamed) {
  const std::string kUsageHint = "Run 'lutb --help' (or 'lutb COMMAND --help') for the options.\n";
  TempDir t;
  const fs::path in = t.path / "in.safetensors";
  write_safetensors(in, {{"w", OwnedTensor{DType::F32, {8, 64}, std::vector<std::uint8_t>(8 * 64 * 4, 0)}}});
  test::CliResult r = test::run_cli("quantize " + test::quote(in) + " -o '' --no-progress");
  // Usage errors: exit status 2 and the --help hint (README "Exit status", nu18).
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lutb: error: --output: an empty output name was given\n" + kUsageHint);
  r = test::run_cli("quantize '' -o " + test::quote(t.path / "o.safetensors") + " --no-progress");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lutb: error: input: an empty input name was given\n" + kUsageHint);
  r = test::run_cli("eval ''");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lutb: error: model_dir: an empty checkpoint directory name was given\n" + kUsageHint);
  r = test::run_cli("moe '' --layer 0");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.err, "lutb: error: model_dir: an empty checkpoint directory name was given\n" + kUsageHint);
  const fs::path absent = t.path / "no-such-model";
  r = test::run_cli("moe " + test::quote(absent) + " --layer 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "lutb: error: " + absent.string() +
                       ": no such directory (a model is a Hugging Face checkpoint directory holding config.json and "
                       "*.safetensors)\n");
  r = test::run_cli("moe " + test::quote(in) + " --layer 0");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "lutb: error: " + in.string() +
                       ": not a directory (a model is a Hugging Face checkpoint directory holding config.json and "
                       "*.safetensors)\n");
}

// A layer storing its routed experts twice, per expert (experts.0.gate_proj.weight, ...) and stacked
// (experts.gate_up_proj, experts.down_proj): lutb eval read the stacked copy without a word (the loss
// of tiny-qwen3-moe with a zero stacked copy added: 4.82 instead of 3.82), lutb moe printed "rel_l2 1
// ... cosine -nan" with exit status 0, and lutb quantize wrote both. Refused by the check all three
// commands share, naming both tensors.
TEST(NewUserNu14, ExpertsStoredInTwoLayoutsRefused) {
  TempDir t;
  const fs::path bf = t.path / "bf", out = t.path / "lb";
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = 1;  // one file, model.safetensors
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 4;
  o.progress = false;
  synthesize_checkpoint(bf, o);
  // Layer 0 gains a stacked copy of its experts (zeros).
  {
    std::vector<std::pair<std::string, OwnedTensor>> all;
    {
      const SafetensorsFile f(bf / "model.safetensors");
      for (const auto& n : f.names()) {
        const TensorView& v = f.get(n);
        all.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
      }
    }
    all.push_back({"model.layers.0.mlp.experts.gate_up_proj",
                   OwnedTensor{DType::BF16, {4, 128, 128}, std::vector<std::uint8_t>(4 * 128 * 128 * 2, 0)}});
    all.push_back({"model.layers.0.mlp.experts.down_proj",
                   OwnedTensor{DType::BF16, {4, 128, 64}, std::vector<std::uint8_t>(4 * 128 * 64 * 2, 0)}});
    write_safetensors(bf / "model.safetensors", all);
  }
  const std::string want = (bf / "model.safetensors").string() +
                           ": layer 0 stores its routed experts twice, in two layouts "
                           "(model.layers.0.mlp.experts.0.down_proj.weight and "
                           "model.layers.0.mlp.experts.down_proj); lutb would read one and ignore the other: remove "
                           "the copy that is not the model's";
  const ModelConfig cfg = load_model_config(bf);
  const SafetensorsCollection st = SafetensorsCollection::open_dir(bf);
  try {
    (void)detail::check_tensor_names(cfg, st, bf / "config.json", "not read", "");
    ADD_FAILURE() << "no exception";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()), want);
  }
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  try {
    quantize_checkpoint(bf, out, q);
    ADD_FAILURE() << "no exception";
  } catch (const CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()), want + "; nothing written");
  }
  EXPECT_FALSE(fs::exists(out));
  // The stacked copy alone is fine.
  {
    std::vector<std::pair<std::string, OwnedTensor>> keep;
    {
      const SafetensorsFile f(bf / "model.safetensors");
      for (const auto& n : f.names()) {
        if (n.rfind("model.layers.0.mlp.experts.", 0) == 0 && n.find("_proj.weight") != std::string::npos) continue;
        const TensorView& v = f.get(n);
        keep.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
      }
    }
    write_safetensors(bf / "model.safetensors", keep);
  }
  const SafetensorsCollection mixed = SafetensorsCollection::open_dir(bf);
  EXPECT_NO_THROW((void)detail::check_tensor_names(cfg, mixed, bf / "config.json", "not read", ""));
}

// A Hugging Face cache snapshot whose tokenizer.json blob is missing (a dangling link), or a named pipe
// beside the weights: lutb quantize left them out of the LUT-B checkpoint without a word.
TEST(NewUserNu14, QuantizeListsFilesItCannotCopy) {
  TempDir t;
  const fs::path bf = t.path / "bf", out = t.path / "lb";
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = 1;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 4;
  o.progress = false;
  synthesize_checkpoint(bf, o);
  fs::create_symlink("../../blobs/0123abcd", bf / "tokenizer.json");
  ASSERT_EQ(::mkfifo((bf / "notes.fifo").c_str(), 0644), 0);
  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  const QuantizeSummary s = quantize_checkpoint(bf, out, q);
  EXPECT_EQ(s.skipped_files, (std::vector<std::string>{"notes.fifo", "tokenizer.json"}));
  EXPECT_NE(std::find(s.warnings.begin(), s.warnings.end(),
                      (bf / "tokenizer.json").string() +
                          ": not copied: it is a symbolic link to ../../blobs/0123abcd, which does not exist (an "
                          "incomplete download?)"),
            s.warnings.end())
      << fmt::format("{}", fmt::join(s.warnings, "\n"));
  EXPECT_NE(std::find(s.warnings.begin(), s.warnings.end(),
                      (bf / "notes.fifo").string() + ": not copied: not a regular file (a named pipe (FIFO))"),
            s.warnings.end());
  EXPECT_NE(format_summary(s).find("not copied           notes.fifo, tokenizer.json (not a regular file: see the warning)\n"), std::string::npos)
      << format_summary(s);
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
}

// lutb eval on a checkpoint of lutb synth (or the default job's --keep): "val_tokens.safetensors: tokens
// file not found", and with --tokens "missing tensor model.embed_tokens.weight", never saying that the
// checkpoint holds MoE blocks only.
TEST(NewUserNu14, EvalOnASyntheticCheckpointSaysWhy) {
  TempDir t;
  const fs::path bf = t.path / "syn";
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = 1;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 4;
  o.progress = false;
  synthesize_checkpoint(bf, o);
  const test::CliResult r = test::run_cli("eval " + test::quote(bf) + " --threads 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "lutb: error: " + bf.string() + ": a synthetic checkpoint of lutb synth (" +
                       (bf / "config.json").string() +
                       " has 'lutb_synthetic'): it holds MoE blocks only, no embeddings or attention, so it is not a "
                       "language model lutb eval can run; run one of its MoE blocks with lutb moe " +
                       bf.string() + " --layer L --activations FILE\n");
}

// The default job with TMPDIR naming a folder that does not exist: "filesystem error:
// temp_directory_path: No such file or directory", naming neither the variable nor the folder.
TEST(NewUserNu14, DefaultJobNamesAnUnusableTmpdir) {
  TempDir t;
  const fs::path absent = t.path / "no-such-tmp";
  const test::CliResult r = run_with("TMPDIR=" + test::quote(absent), "--experts 1 --tokens 1");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("lutb: error: the temporary folder TMPDIR=" + absent.string() + " is not usable ("),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("): set TMPDIR to an existing folder, or give --work-dir DIR\n"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(absent));
}

// An index whose shards sit in subfolders with the same file name (a/w.safetensors, b/w.safetensors):
// lutb quantize wrote both flat as w.safetensors, the second over the first, so the LUT-B checkpoint's
// index listed tensors in a file that did not hold them (lutb eval: "tensor 'model.embed_tokens.weight'
// is listed in shard 'w.safetensors' but that file does not hold it"), exit status 0; and it copied the
// original shards unquantised beside them. Shards are written at the index's relative paths.
TEST(NewUserNu14, QuantizeKeepsShardsInSubfolders) {
  TempDir t;
  const fs::path bf = t.path / "bf", out = t.path / "lb";
  SynthOptions o;
  o.family = ModelFamily::qwen3_moe;
  o.layers = 1;
  o.hidden_size = 128;
  o.moe_intermediate_size = 64;
  o.num_experts = 4;
  o.progress = false;
  synthesize_checkpoint(bf, o);
  std::vector<std::pair<std::string, OwnedTensor>> a, b;
  {
    const SafetensorsFile f(bf / "model.safetensors");
    for (const auto& n : f.names()) {
      const TensorView& v = f.get(n);
      (n.find(".experts.0.") != std::string::npos || n.find(".experts.1.") != std::string::npos ? a : b)
          .push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
  }
  ASSERT_FALSE(a.empty());
  ASSERT_FALSE(b.empty());
  fs::remove(bf / "model.safetensors");
  fs::create_directories(bf / "a");
  fs::create_directories(bf / "b");
  write_safetensors(bf / "a" / "w.safetensors", a);
  write_safetensors(bf / "b" / "w.safetensors", b);
  nlohmann::json wm = nlohmann::json::object();
  for (const auto& [n, _] : a) wm[n] = "a/w.safetensors";
  for (const auto& [n, _] : b) wm[n] = "b/w.safetensors";
  std::ofstream(bf / "model.safetensors.index.json") << nlohmann::json{{"weight_map", wm}}.dump();

  QuantizeOptions q;
  q.progress = false;
  q.fit.threads = 1;
  const QuantizeSummary s = quantize_checkpoint(bf, out, q);
  EXPECT_TRUE(s.warnings.empty()) << fmt::format("{}", fmt::join(s.warnings, "\n"));
  EXPECT_FALSE(fs::exists(out / "w.safetensors"));
  const SafetensorsCollection c = SafetensorsCollection::open_dir(out);
  EXPECT_EQ(c.files().size(), 2u);
  EXPECT_EQ(c.file_of("model.layers.0.mlp.experts.0.gate_proj.weight_packed").path(), out / "a" / "w.safetensors");
  EXPECT_EQ(c.file_of("model.layers.0.mlp.experts.3.down_proj.weight_scale").path(), out / "b" / "w.safetensors");
  // Every tensor of the output is LUT-B or one of the source's non-expert tensors: no unquantised expert.
  for (const auto& n : c.names()) EXPECT_EQ(n.find("_proj.weight"), n.find("_proj.weight_")) << n;
}

}  // namespace
}  // namespace lutb
