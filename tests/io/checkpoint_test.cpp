// Checkpoint loading (spec section 7) and writing LUT-B checkpoints (spec section 2.2).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "lutb/checkpoint.hpp"
#include "lutb/fit.hpp"
#include "support/checkpoint_support.hpp"
#include "support/test_support.hpp"

namespace lutb {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

// A small synthetic checkpoint (fast to write and quantise).
SynthOptions small(ModelFamily f, std::int64_t layers = 2, std::int64_t H = 128, std::int64_t I = 64, std::int64_t E = 4) {
  SynthOptions o = test::synth_options(H, I, E, layers);
  o.family = f;
  o.seed = 99;
  return o;
}

QuantizeOptions quiet(const std::string& fitter = "") {
  QuantizeOptions q;
  q.progress = false;
  q.fit.fitter = fitter;
  return q;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.nbytes == b.nbytes && std::memcmp(a.data, b.data, a.nbytes) == 0;
}

// Expect `f` to throw an exception whose message contains every one of `parts`.
template <class Ex, class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const Ex& e) {
    const std::string w = e.what();
    for (const auto& p : parts) EXPECT_NE(w.find(p), std::string::npos) << "message \"" << w << "\" lacks \"" << p << "\"";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

std::string fmt_shard(int l, int n) {
  char b[64];
  std::snprintf(b, sizeof b, "model-%05d-of-%05d.safetensors", l, n);
  return b;
}

// No "<name>.tmp.*" left beside `target`.
void expect_no_temp(const fs::path& target) {
  const std::string prefix = target.filename().string() + ".tmp.";
  for (const auto& e : fs::directory_iterator(target.parent_path()))
    EXPECT_NE(e.path().filename().string().rfind(prefix, 0), 0u) << "temporary left: " << e.path();
}

// ---------------------------------------------------------------------------
// Loading the shared models
// ---------------------------------------------------------------------------
TEST(Checkpoint, TinyQwen3ExpertsGatherPerExpertTensors) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-qwen3-moe");
  Checkpoint ck(dir);
  EXPECT_FALSE(ck.is_lutb());
  EXPECT_FALSE(ck.experts_stacked(1));
  EXPECT_FALSE(ck.experts_lutb(1));
  const ExpertsSource s = ck.experts_source(1);
  const std::int64_t E = 16, H = 256, I = 256;
  ASSERT_EQ(s.w13.dtype, DType::BF16);
  EXPECT_EQ(s.w13.experts, E);
  EXPECT_EQ(s.w13.rows, 2 * I);
  EXPECT_EQ(s.w13.cols, H);
  EXPECT_EQ(s.w2.rows, H);
  EXPECT_EQ(s.w2.cols, I);
  for (std::int64_t e : {0, 7, 15}) {
    const auto& g = ck.tensor(expert_weight_name(ck.config(), 1, e, Proj::gate));
    const auto& u = ck.tensor(expert_weight_name(ck.config(), 1, e, Proj::up));
    const auto& d = ck.tensor(expert_weight_name(ck.config(), 1, e, Proj::down));
    const std::uint8_t* w13 = s.w13.data.data() + e * 2 * I * H * 2;
    EXPECT_EQ(std::memcmp(w13, g.data, g.nbytes), 0) << "gate rows of expert " << e;
    EXPECT_EQ(std::memcmp(w13 + I * H * 2, u.data, u.nbytes), 0) << "up rows of expert " << e;
    EXPECT_EQ(std::memcmp(s.w2.data.data() + e * H * I * 2, d.data, d.nbytes), 0) << "down of expert " << e;
  }
  const RouterWeights r = ck.router(2);
  EXPECT_EQ(r.weight.rows, E);
  EXPECT_EQ(r.weight.cols, H);
  EXPECT_FALSE(r.bias);
  EXPECT_FALSE(ck.shared_expert(2));
  expect_error<CheckpointError>([&] { ck.tensor("model.layers.9.nope"); }, {dir.string(), "model.layers.9.nope", "not found"});
  expect_error<CheckpointError>([&] { ck.lutb_projection(1, Proj::gate); }, {"not stored as LUT-B"});
}

TEST(Checkpoint, TinyMixtralW1IsGateW3IsUp) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-mixtral");
  Checkpoint ck(dir);
  const ExpertsSource s = ck.experts_source(2);
  const std::int64_t H = 192, I = 320;
  const auto& w1 = ck.tensor("model.layers.2.block_sparse_moe.experts.5.w1.weight");
  const auto& w3 = ck.tensor("model.layers.2.block_sparse_moe.experts.5.w3.weight");
  const auto& w2 = ck.tensor("model.layers.2.block_sparse_moe.experts.5.w2.weight");
  const std::uint8_t* w13 = s.w13.data.data() + 5 * 2 * I * H * 2;
  EXPECT_EQ(std::memcmp(w13, w1.data, w1.nbytes), 0);
  EXPECT_EQ(std::memcmp(w13 + I * H * 2, w3.data, w3.nbytes), 0);
  EXPECT_EQ(std::memcmp(s.w2.data.data() + 5 * H * I * 2, w2.data, w2.nbytes), 0);
  EXPECT_EQ(ck.router(0).weight.rows, 8);
}

TEST(Checkpoint, TinyDeepseekRouterBiasSharedExpertDenseLayer) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-deepseek-v3");
  Checkpoint ck(dir);
  const RouterWeights r = ck.router(1);
  ASSERT_TRUE(r.bias);
  ASSERT_EQ(r.bias->size(), 16u);
  const auto& b = ck.tensor("model.layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_EQ((*r.bias)[3], bf16_to_float(reinterpret_cast<const std::uint16_t*>(b.data)[3]));
  const auto sh = ck.shared_expert(3);
  ASSERT_TRUE(sh);
  EXPECT_EQ(sh->gate.rows, 128);
  EXPECT_EQ(sh->gate.cols, 256);
  EXPECT_EQ(sh->down.rows, 256);
  EXPECT_EQ(sh->down.cols, 128);
  EXPECT_FALSE(sh->output_gate);
  expect_error<CheckpointError>([&] { ck.experts_source(0); }, {"layer 0 is not a MoE layer", "1, 2, 3"});
}

// ---------------------------------------------------------------------------
// Synthetic checkpoints: stacked layout == per-expert layout, determinism
// ---------------------------------------------------------------------------
TEST(Checkpoint, StackedAndPerExpertHoldTheSameExperts) {
  for (ModelFamily f : {ModelFamily::qwen3_moe, ModelFamily::mixtral, ModelFamily::deepseek_v3}) {
    TempDir t;
    SynthOptions a = small(f, 1, 128, 40, 4);
    SynthOptions b = a;
    b.stacked = true;
    synthesize_checkpoint(t.path / "per", a);
    synthesize_checkpoint(t.path / "stk", b);
    Checkpoint pa(t.path / "per"), pb(t.path / "stk");
    EXPECT_FALSE(pa.experts_stacked(0));
    EXPECT_TRUE(pb.experts_stacked(0));
    ASSERT_TRUE(pb.contains(stacked_gate_up_name(pb.config(), 0)));
    EXPECT_EQ(pb.tensor(stacked_gate_up_name(pb.config(), 0)).shape, (std::vector<std::int64_t>{4, 80, 128}));
    EXPECT_EQ(pb.tensor(stacked_down_name(pb.config(), 0)).shape, (std::vector<std::int64_t>{4, 128, 40}));
    const ExpertsSource x = pa.experts_source(0), y = pb.experts_source(0);
    EXPECT_EQ(x.w13.data, y.w13.data) << family_name(f);
    EXPECT_EQ(x.w2.data, y.w2.data) << family_name(f);
    EXPECT_EQ(pa.router(0).weight.data, pb.router(0).weight.data);
    // Same options -> same bytes.
    synthesize_checkpoint(t.path / "again", a);
    EXPECT_EQ(read_file(t.path / "per" / "model.safetensors"), read_file(t.path / "again" / "model.safetensors"));
  }
}

TEST(Checkpoint, SynthWeightsAreHeavyTailedAndScaled) {
  TempDir t;
  synthesize_checkpoint(t.path / "c", small(ModelFamily::qwen3_moe, 1, 512, 256, 2));
  Checkpoint ck(t.path / "c");
  const std::vector<float> w = ck.experts_source(0).w13.to_float();
  double s2 = 0, s4 = 0;
  for (float v : w) {
    s2 += double(v) * v;
    s4 += double(v) * v * v * v;
  }
  const double var = s2 / w.size(), kurt = s4 / w.size() / (var * var);
  EXPECT_NEAR(std::sqrt(var), 1.0 / std::sqrt(512.0), 0.05 / std::sqrt(512.0));  // std 1/sqrt(fan_in)
  EXPECT_GT(kurt, 4.5);  // Student-t(5) has kurtosis 9 (Gaussian 3); the sample estimate is noisy but > 4.5
  // Tail probabilities of Student-t(5): P(|T| > 2.5706) = 0.05, P(|T| > 4.0321) = 0.01 (t tables).
  const double unit = 1.0 / (std::sqrt(512.0) * std::sqrt(5.0 / 3.0));  // the scale applied to T
  std::int64_t n5 = 0, n1 = 0;
  for (float v : w) {
    n5 += std::fabs(v) > 2.5706 * unit;
    n1 += std::fabs(v) > 4.0321 * unit;
  }
  EXPECT_NEAR(double(n5) / w.size(), 0.05, 0.002);
  EXPECT_NEAR(double(n1) / w.size(), 0.01, 0.001);
}

// ---------------------------------------------------------------------------
// Quantize round trips
// ---------------------------------------------------------------------------
void check_round_trip(const fs::path& in, const fs::path& out, const QuantizeSummary& sum, const std::string& fitter) {
  Checkpoint a(in), b(out);
  ASSERT_TRUE(b.is_lutb());
  EXPECT_EQ(b.quant_config()->fitter, fitter);
  EXPECT_EQ(b.config().raw.at("quantization_config").at("quant_method"), "lut_b");
  EXPECT_EQ(b.config().raw.at("quantization_config").at("tile"), nlohmann::json({8, 64}));
  // The config is unchanged apart from quantization_config.
  nlohmann::json stripped = b.config().raw;
  stripped.erase("quantization_config");
  EXPECT_EQ(stripped, a.config().raw);
  const std::regex re(routed_expert_pattern(a.config()));
  FitOptions fo;
  fo.fitter = fitter;
  std::int64_t quantised = 0, copied = 0;
  FitStats total;
  for (const auto& name : a.tensors().names()) {
    const TensorView& v = a.tensor(name);
    if (!std::regex_match(name, re)) {
      ASSERT_TRUE(b.contains(name)) << name;
      EXPECT_TRUE(same_bytes(v, b.tensor(name))) << name << " not copied bit for bit";
      ++copied;
      continue;
    }
    EXPECT_FALSE(b.contains(name)) << name << " should have been replaced";
    const LutbNames n = lutb_names(name);
    LutbShape shape = v.shape.size() == 2 ? LutbShape{1, v.shape[0], v.shape[1], false}
                                          : LutbShape{v.shape[0], v.shape[1], v.shape[2], true};
    LutbTensor ref;
    total += quantize(v.data, v.dtype, shape, ref, fo, name);
    const TensorView& p = b.tensor(n.packed);
    const TensorView& c = b.tensor(n.codebook);
    const TensorView& s = b.tensor(n.scale);
    EXPECT_EQ(p.dtype, DType::U8);
    EXPECT_EQ(c.dtype, DType::F8_E4M3);
    EXPECT_EQ(s.dtype, DType::U8);
    EXPECT_EQ(p.shape.back(), 192);
    EXPECT_EQ(c.shape.back(), 8);
    ASSERT_EQ(p.nbytes, ref.packed.size());
    EXPECT_EQ(std::memcmp(p.data, ref.packed.data(), p.nbytes), 0) << name;
    EXPECT_EQ(std::memcmp(c.data, ref.codebook.data(), c.nbytes), 0) << name;
    EXPECT_EQ(std::memcmp(s.data, ref.scale.data(), s.nbytes), 0) << name;
    ++quantised;
  }
  EXPECT_EQ(sum.tensors_quantized, quantised);
  EXPECT_EQ(sum.tensors_copied, copied);
  EXPECT_DOUBLE_EQ(sum.stats.sse, total.sse);
  EXPECT_DOUBLE_EQ(sum.stats.sum_sq, total.sum_sq);
  EXPECT_GT(sum.stats.sqnr_db(), 10.0);
  // Other files copied, except the source weights' reference losses (listed as not copied).
  for (const auto& e : fs::directory_iterator(in)) {
    const std::string f = e.path().filename().string();
    if (f == "config.json" || f.find("model") == 0) continue;
    if (f == "reference_eval.json") {
      EXPECT_FALSE(fs::exists(out / f));
      continue;
    }
    EXPECT_EQ(read_file(e.path()), read_file(out / f)) << f;
  }
}

TEST(Quantize, TinyQwen3RoundTrip) {
  LUTB_MODEL_OR_SKIP(dir, "tiny-qwen3-moe");
  TempDir t;
  const fs::path out = t.path / "q";
  const QuantizeSummary s = quantize_checkpoint(dir, out, quiet());
  check_round_trip(dir, out, s, default_fitter());
  EXPECT_EQ(s.tensors_quantized, 4 * 16 * 3);
  EXPECT_EQ(s.weights, 4 * 16 * 3 * 256 * 256);
  EXPECT_DOUBLE_EQ(s.bits_per_weight(), kBitsPerWeight);  // no padding
  EXPECT_TRUE(fs::exists(out / "tokenizer.json"));
  EXPECT_TRUE(fs::exists(out / "val_tokens.safetensors"));
  expect_no_temp(out);

  // Loading the LUT-B checkpoint: w13 = gate tiles then up tiles, equal to the stored ones and to
  // per-projection views; dequantised values equal what the fitter produced.
  Checkpoint q(out);
  EXPECT_TRUE(q.experts_lutb(2));
  const ExpertsLutb x = q.lutb_experts(2);
  EXPECT_EQ(x.w13.shape.rows, 512);
  EXPECT_EQ(x.w2.shape.cols, 256);
  const LutbTensor up = q.lutb_projection(2, Proj::up);
  const std::int64_t per13 = x.w13.shape.tiles_per_expert(), per = up.shape.tiles_per_expert();
  for (std::int64_t e = 0; e < 16; ++e)
    EXPECT_EQ(std::memcmp(up.packed.data() + e * per * 192, x.w13.packed.data() + (e * per13 + per) * 192, per * 192), 0);
  // The online method on the BF16 checkpoint gives the same tiles (I % 8 == 0: tiles never straddle).
  Checkpoint src(dir);
  const ExpertsLutb online = src.lutb_experts(2);
  EXPECT_EQ(online.w13.packed, x.w13.packed);
  EXPECT_EQ(online.w13.codebook, x.w13.codebook);
  EXPECT_EQ(online.w13.scale, x.w13.scale);
  EXPECT_EQ(online.w2.packed, x.w2.packed);
  expect_error<CheckpointError>([&] { q.experts_source(2); }, {"stored as LUT-B"});
  // Without its quantization_config the message says what is missing, not an internal function
  // ("use lutb_experts").
  {
    nlohmann::json cfg = q.config().raw;
    cfg.erase("quantization_config");
    std::ofstream(out / "config.json") << cfg.dump();
    try {
      Checkpoint(out).experts_source(2);
      ADD_FAILURE() << "no error";
    } catch (const CheckpointError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("no LUT-B quantization_config"), std::string::npos) << m;
      EXPECT_EQ(m.find("lutb_experts"), std::string::npos) << m;
    }
    std::ofstream(out / "config.json") << q.config().raw.dump();
  }
  // Quantising a LUT-B checkpoint again is refused.
  expect_error<CheckpointError>([&] { quantize_checkpoint(out, t.path / "qq", quiet()); }, {"already LUT-B"});
  EXPECT_FALSE(fs::exists(t.path / "qq"));
}

TEST(Quantize, ShardedStackedPaddedSynthetic) {
  TempDir t;
  SynthOptions o = small(ModelFamily::deepseek_v3, 3, 100, 20, 4);  // H 100, I 20: padding in both axes
  o.stacked = true;
  synthesize_checkpoint(t.path / "in", o);
  ASSERT_TRUE(fs::exists(t.path / "in" / "model.safetensors.index.json"));
  const QuantizeSummary s = quantize_checkpoint(t.path / "in", t.path / "out", quiet());
  check_round_trip(t.path / "in", t.path / "out", s, default_fitter());
  EXPECT_EQ(s.tensors_quantized, 6);
  EXPECT_GT(s.bits_per_weight(), kBitsPerWeight);  // padding costs
  // Shards kept, index rewritten with the new names.
  for (int l = 1; l <= 3; ++l) EXPECT_TRUE(fs::exists(t.path / "out" / fmt_shard(l, 3)));
  nlohmann::json idx = nlohmann::json::parse(read_file(t.path / "out" / "model.safetensors.index.json"));
  EXPECT_EQ(idx["weight_map"]["model.layers.1.mlp.experts.gate_up_proj_packed"], fmt_shard(2, 3));
  EXPECT_FALSE(idx["weight_map"].contains("model.layers.1.mlp.experts.gate_up_proj"));
  EXPECT_EQ(idx["weight_map"]["model.layers.1.mlp.gate.e_score_correction_bias"], fmt_shard(2, 3));
  EXPECT_EQ(idx["metadata"]["total_size"].get<std::uint64_t>(), s.output_bytes);
  // Logical shapes recorded; stacked LUT-B w13 loads for any I; dequantises to the logical shape.
  Checkpoint q(t.path / "out");
  const auto& ls = q.quant_config()->logical_shapes;
  EXPECT_EQ(ls.at("model.layers.0.mlp.experts.gate_up_proj"), (std::vector<std::int64_t>{4, 40, 100}));
  EXPECT_EQ(ls.at("model.layers.0.mlp.experts.down_proj"), (std::vector<std::int64_t>{4, 100, 20}));
  const ExpertsLutb x = q.lutb_experts(0);
  EXPECT_EQ(x.w13.shape.rows, 40);
  EXPECT_EQ(x.w13.shape.padded_cols(), 128);
  const std::vector<float> deq = dequantize(x.w13.view());
  const std::vector<float> ref = Checkpoint(t.path / "in").experts_source(0).w13.to_float();
  ASSERT_EQ(deq.size(), ref.size());
  double se = 0, ss = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    se += (deq[i] - ref[i]) * double(deq[i] - ref[i]);
    ss += double(ref[i]) * ref[i];
  }
  EXPECT_GT(10 * std::log10(ss / se), 10.0);
  // I % 8 != 0 with a stacked tensor: the gate projection cannot be cut out of straddling tiles.
  expect_error<FormatError>([&] { q.lutb_projection(0, Proj::gate); }, {"not a multiple of 8"});
  EXPECT_EQ(q.lutb_projection(0, Proj::down).shape.cols, 20);
}

TEST(Quantize, PerExpertPaddedIntermediate) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 1, 64, 12, 2));
  const QuantizeSummary s = quantize_checkpoint(t.path / "in", t.path / "out", quiet());
  check_round_trip(t.path / "in", t.path / "out", s, default_fitter());
  Checkpoint q(t.path / "out");
  EXPECT_EQ(q.tensor("model.layers.0.mlp.experts.1.gate_proj.weight_packed").shape, (std::vector<std::int64_t>{2, 1, 192}));
  EXPECT_EQ(q.quant_config()->logical_shapes.at("model.layers.0.mlp.experts.1.gate_proj.weight"),
            (std::vector<std::int64_t>{12, 64}));
  // gate and up are padded separately to 16 rows: a stacked w13 [E, 24, 64] would need straddling tiles.
  // (The message names the file, the tensor and the remedies, not a library function.)
  expect_error<FormatError>([&] { q.lutb_experts(0); },
                            {"model.safetensors: tensor model.layers.0.mlp.experts.0.gate_proj.weight_packed (layer 0)",
                             "not a multiple of 8", "--quant lutb"});
  const LutbTensor g = q.lutb_projection(0, Proj::gate);
  EXPECT_EQ(g.shape.rows, 12);
  EXPECT_EQ(g.shape.experts, 2);
  const std::vector<float> deq = dequantize(g.view());
  Checkpoint in(t.path / "in");
  const TensorView& g1 = in.tensor("model.layers.0.mlp.experts.1.gate_proj.weight");
  LutbTensor ref;
  quantize(g1.data, g1.dtype, LutbShape{1, 12, 64, false}, ref, {}, "g1");
  const std::vector<float> deq1 = dequantize(ref.view());
  ASSERT_EQ(deq.size(), 2u * 12 * 64);
  for (std::size_t i = 0; i < deq1.size(); ++i) ASSERT_EQ(deq[12 * 64 + i], deq1[i]) << i;
}

TEST(Quantize, CompressedTensorsWithoutScaleReadsAs127) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 1, 64, 16, 2));
  QuantizeOptions q = quiet("ct-lloyd");
  quantize_checkpoint(t.path / "in", t.path / "lut", q);
  // Rewrite as a compressed-tensors "lut-b" checkpoint: same tensors minus weight_scale (ct-lloyd
  // writes scale 127 everywhere), quant_method compressed-tensors.
  fs::create_directories(t.path / "ct");
  Checkpoint a(t.path / "lut");
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  for (const auto& n : a.tensors().names()) {
    if (n.size() > 6 && n.compare(n.size() - 6, 6, "_scale") == 0) {
      const TensorView& s = a.tensor(n);
      for (std::size_t i = 0; i < s.nbytes; ++i) ASSERT_EQ(s.data[i], 127);
      continue;
    }
    const TensorView& v = a.tensor(n);
    ts.push_back({n, OwnedTensor{v.dtype, v.shape, std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
  }
  write_safetensors(t.path / "ct" / "model.safetensors", ts);
  nlohmann::json cfg = a.config().raw;
  cfg["quantization_config"] = {{"quant_method", "compressed-tensors"}, {"format", "lut-b"}};
  std::ofstream(t.path / "ct" / "config.json") << cfg.dump();
  Checkpoint ct(t.path / "ct");
  ASSERT_TRUE(ct.is_lutb());
  const ExpertsLutb x = ct.lutb_experts(0), y = a.lutb_experts(0);
  EXPECT_EQ(x.w13.scale, y.w13.scale);
  EXPECT_EQ(x.w13.packed, y.w13.packed);
  EXPECT_EQ(x.w2.codebook, y.w2.codebook);
  // A lut_b checkpoint must have its scales.
  nlohmann::json c2 = a.config().raw;
  std::ofstream(t.path / "ct" / "config.json") << c2.dump();
  expect_error<CheckpointError>([&] { Checkpoint(t.path / "ct").lutb_experts(0); }, {"weight_scale", "not found"});
}

// A stored checkpoint whose quantization_config claims another tile fails to open, naming its
// config.json and the key (its weights would otherwise be read as 8x64).
TEST(Quantize, StoredQuantizationConfigIsValidated) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 1, 64, 16, 2));
  quantize_checkpoint(t.path / "in", t.path / "lut", quiet());
  nlohmann::json cfg = Checkpoint(t.path / "lut").config().raw;
  cfg["quantization_config"]["tile"] = {16, 64};
  std::ofstream(t.path / "lut" / "config.json") << cfg.dump();
  expect_error<ConfigError>([&] { Checkpoint c(t.path / "lut"); },
                            {(t.path / "lut" / "config.json").string() + ": key 'quantization_config.tile'"});
}

// ---------------------------------------------------------------------------
// Bad inputs: clear messages, destination untouched
// ---------------------------------------------------------------------------
TEST(QuantizeErrors, MissingConfigAndWeights) {
  TempDir t;
  fs::create_directories(t.path / "in");
  expect_error<ConfigError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); }, {"no config.json", (t.path / "in").string()});
  EXPECT_FALSE(fs::exists(t.path / "out"));
  synthesize_checkpoint(t.path / "syn", small(ModelFamily::qwen3_moe, 1));
  fs::copy_file(t.path / "syn" / "config.json", t.path / "in" / "config.json");
  EXPECT_THROW(quantize_checkpoint(t.path / "in", t.path / "out", quiet()), SafetensorsError);
  EXPECT_FALSE(fs::exists(t.path / "out"));
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "nowhere", t.path / "out", quiet()); }, {"nowhere"});
  expect_no_temp(t.path / "out");
}

TEST(QuantizeErrors, UnknownFamily) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 1));
  nlohmann::json c = nlohmann::json::parse(read_file(t.path / "in" / "config.json"));
  c["model_type"] = "gpt_oss";
  std::ofstream(t.path / "in" / "config.json") << c.dump();
  expect_error<ConfigError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); },
                            {"config.json", "\"gpt_oss\"", "qwen3_moe", "mixtral", "deepseek_v3"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
}

TEST(QuantizeErrors, OutputExistsUnlessForce) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::mixtral, 1));
  fs::create_directories(t.path / "out");
  std::ofstream(t.path / "out" / "keep.txt") << "precious";
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); }, {"exists", "--force"});
  EXPECT_EQ(read_file(t.path / "out" / "keep.txt"), "precious");
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "in", quiet()); }, {"is the input"});
  QuantizeOptions f = quiet();
  f.force = true;
  // --force replaces only what looks like a checkpoint: keep.txt is not a checkpoint file.
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", f); }, {"keep.txt"});
  EXPECT_EQ(read_file(t.path / "out" / "keep.txt"), "precious");
  fs::rename(t.path / "out" / "keep.txt", t.path / "out" / "keep.json");
  quantize_checkpoint(t.path / "in", t.path / "out", f);
  EXPECT_FALSE(fs::exists(t.path / "out" / "keep.json"));
  EXPECT_TRUE(Checkpoint(t.path / "out").is_lutb());
  expect_no_temp(t.path / "out");
  // A trailing separator names the same directory.
  quantize_checkpoint(t.path / "in", fs::path((t.path / "out2").string() + "/"), quiet());
  EXPECT_TRUE(Checkpoint(t.path / "out2").is_lutb());
  expect_no_temp(t.path / "out2");
}

// An output nested with the input is refused even with --force: an output that contains the input
// (its parent) would be swapped out and deleted together with the input, and an output inside the
// input would recurse into itself.
TEST(QuantizeErrors, OutputNestedWithTheInputIsRefusedEvenWithForce) {
  TempDir t;
  synthesize_checkpoint(t.path / "par" / "m", small(ModelFamily::mixtral, 1));
  QuantizeOptions f = quiet();
  f.force = true;
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "par" / "m", t.path / "par", f); },
                                {"contains the input"});
  EXPECT_TRUE(fs::exists(t.path / "par" / "m" / "config.json"));
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "par" / "m", t.path / "par" / "m" / "sub", f); },
                                {"inside"});
  EXPECT_FALSE(fs::exists(t.path / "par" / "m" / "sub"));
  expect_no_temp(t.path / "par" / "m" / "sub");
}

// --force never replaces a file with a directory, or the reverse.
TEST(QuantizeErrors, ForceNeverReplacesTheOtherKind) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::mixtral, 1));
  std::ofstream(t.path / "file.txt") << "precious";
  fs::create_directories(t.path / "dir");
  std::ofstream(t.path / "dir" / "keep.txt") << "precious";
  QuantizeOptions f = quiet();
  f.force = true;
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "file.txt", f); }, {"not a directory"});
  EXPECT_EQ(read_file(t.path / "file.txt"), "precious");
  expect_error<CheckpointError>([&] { quantize_file(t.path / "in" / "model.safetensors", t.path / "dir", "", f); },
                                {"is a directory"});
  EXPECT_EQ(read_file(t.path / "dir" / "keep.txt"), "precious");
  SynthOptions so = small(ModelFamily::mixtral, 1);
  so.force = true;
  expect_error<CheckpointError>([&] { synthesize_checkpoint(t.path / "file.txt", so); }, {"not a directory"});
  EXPECT_EQ(read_file(t.path / "file.txt"), "precious");
}

TEST(QuantizeErrors, WrongDtype) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 1, 64, 16, 2));
  const std::string n = "model.layers.0.mlp.experts.1.up_proj.weight";
  test::replace_tensor(t.path / "in" / "model.safetensors", n, DType::I16, std::vector<std::uint8_t>(16 * 64 * 2, 1));
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); }, {n, "I16", "BF16"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
  expect_error<CheckpointError>([&] { Checkpoint(t.path / "in").experts_source(0); }, {n, "I16"});
  expect_no_temp(t.path / "out");
}

// quantize checks the expert shapes against config.json (swapped dims, or hidden_size doubled in the
// config) before writing: it fails naming the shard, the tensor and both shapes, and writes nothing,
// rather than a checkpoint eval would reject.
TEST(QuantizeErrors, ExpertShapeMustMatchTheConfig) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 1, 64, 16, 2));
  const std::string n = "model.layers.0.mlp.experts.1.up_proj.weight";  // [16, 64]
  std::vector<std::uint8_t> b = test::owned(Checkpoint(t.path / "in").tensor(n)).bytes;
  {
    std::vector<std::pair<std::string, OwnedTensor>> ts;
    SafetensorsFile f(t.path / "in" / "model.safetensors");
    for (const auto& name : f.names()) {
      const TensorView& v = f.get(name);
      ts.push_back({name, OwnedTensor{v.dtype, name == n ? std::vector<std::int64_t>{64, 16} : v.shape,
                                      std::vector<std::uint8_t>(v.data, v.data + v.nbytes)}});
    }
    write_safetensors(t.path / "in" / "model2.safetensors", ts);
  }
  fs::rename(t.path / "in" / "model2.safetensors", t.path / "in" / "model.safetensors");
  const std::string shard = (t.path / "in" / "model.safetensors").string();
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); },
                                {shard + ": routed-expert tensor " + n + " has shape [64, 16], expected [16, 64]",
                                 "nothing written"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
  expect_no_temp(t.path / "out");

  // The tensors right, the config wrong: hidden_size doubled.
  test::replace_tensor(t.path / "in" / "model.safetensors", n, DType::BF16, b);
  nlohmann::json cfg = Checkpoint(t.path / "in").config().raw;
  cfg["hidden_size"] = 128;
  std::ofstream(t.path / "in" / "config.json") << cfg.dump();
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); },
                                {"routed-expert tensor model.layers.0.mlp.experts.", "hidden_size 128", "nothing written"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
}

TEST(QuantizeErrors, ExpertBiasIsRefused) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 1, 64, 16, 2));
  test::rewrite_safetensors(
      t.path / "in" / "model.safetensors", {},
      {{"model.layers.0.mlp.experts.0.up_proj.bias", OwnedTensor{DType::BF16, {16}, std::vector<std::uint8_t>(32)}}});
  expect_error<CheckpointError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); },
                                {"up_proj.bias", "does not support bias"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
}

TEST(QuantizeErrors, NaNWeightNamesTensorAndTile) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 1, 128, 16, 2));
  const std::string n = "model.layers.0.mlp.experts.1.down_proj.weight";  // [128, 16]
  std::vector<std::uint8_t> b = test::owned(Checkpoint(t.path / "in").tensor(n)).bytes;
  const std::uint16_t nan = 0x7fc0;
  std::memcpy(b.data() + (100 * 16 + 3) * 2, &nan, 2);  // row 100 col 3: tile (12, 0)
  test::replace_tensor(t.path / "in" / "model.safetensors", n, DType::BF16, b);
  expect_error<std::invalid_argument>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); }, {n, "12"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
  expect_no_temp(t.path / "out");
}

TEST(QuantizeErrors, TruncatedShard) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 2));
  const fs::path shard = t.path / "in" / "model-00002-of-00002.safetensors";
  fs::resize_file(shard, fs::file_size(shard) - 1000);
  expect_error<SafetensorsError>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet()); }, {"model-00002-of-00002"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
  expect_no_temp(t.path / "out");
}

TEST(QuantizeErrors, BadFitterName) {
  TempDir t;
  synthesize_checkpoint(t.path / "in", small(ModelFamily::qwen3_moe, 1));
  expect_error<std::invalid_argument>([&] { quantize_checkpoint(t.path / "in", t.path / "out", quiet("kmeans++")); }, {"kmeans++"});
  EXPECT_FALSE(fs::exists(t.path / "out"));
}

// ---------------------------------------------------------------------------
// quantize_file
// ---------------------------------------------------------------------------
std::vector<std::uint8_t> f32_bytes(std::int64_t n, float scale, std::uint32_t seed) {
  std::vector<std::uint8_t> b(n * 4);
  std::uint32_t s = seed;
  for (std::int64_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    const float v = scale * (static_cast<float>(s >> 8) / 16777216.0f - 0.5f);
    std::memcpy(b.data() + i * 4, &v, 4);
  }
  return b;
}

fs::path make_file(const fs::path& dir) {
  std::vector<std::pair<std::string, OwnedTensor>> ts;
  ts.push_back({"a.weight", OwnedTensor{DType::F32, {16, 128}, f32_bytes(16 * 128, 0.1f, 1)}});
  ts.push_back({"b.experts", OwnedTensor{DType::F32, {3, 5, 70}, f32_bytes(3 * 5 * 70, 2.0f, 2)}});
  ts.push_back({"c.bias", OwnedTensor{DType::F32, {16}, f32_bytes(16, 1.0f, 3)}});
  ts.push_back({"d.index", OwnedTensor{DType::I32, {4, 4}, std::vector<std::uint8_t>(64, 7)}});
  const fs::path p = dir / "in.safetensors";
  write_safetensors(p, ts, {{"format", "pt"}});
  return p;
}

TEST(QuantizeFile, AllAndMatch) {
  TempDir t;
  const fs::path in = make_file(t.path);
  const QuantizeSummary s = quantize_file(in, t.path / "all.safetensors", "", quiet());
  EXPECT_EQ(s.tensors_quantized, 2);
  EXPECT_EQ(s.tensors_copied, 2);
  SafetensorsFile src(in), out(t.path / "all.safetensors");
  EXPECT_TRUE(out.contains("a.weight_packed"));
  EXPECT_TRUE(out.contains("a.weight_codebook"));
  EXPECT_TRUE(out.contains("a.weight_scale"));
  EXPECT_FALSE(out.contains("a.weight"));
  EXPECT_EQ(out.get("b.experts_packed").shape, (std::vector<std::int64_t>{3, 1, 2, 192}));
  EXPECT_EQ(out.get("b.experts_scale").shape, (std::vector<std::int64_t>{3, 1, 2}));
  EXPECT_TRUE(same_bytes(src.get("c.bias"), out.get("c.bias")));
  EXPECT_TRUE(same_bytes(src.get("d.index"), out.get("d.index")));
  EXPECT_EQ(out.metadata().at("format"), "pt");
  EXPECT_EQ(out.metadata().at("lutb.quant_method"), "lut_b");
  EXPECT_EQ(out.metadata().at("lutb.logical_shape.b.experts"), "[3, 5, 70]");
  EXPECT_EQ(out.metadata().count("lutb.logical_shape.a.weight"), 0u);
  // Stored tiles are what the fitter produces.
  LutbTensor ref;
  quantize(src.get("b.experts").data, DType::F32, LutbShape{3, 5, 70, true}, ref);
  EXPECT_EQ(std::memcmp(out.get("b.experts_packed").data, ref.packed.data(), ref.packed.size()), 0);
  EXPECT_EQ(std::memcmp(out.get("b.experts_codebook").data, ref.codebook.data(), ref.codebook.size()), 0);
  EXPECT_EQ(std::memcmp(out.get("b.experts_scale").data, ref.scale.data(), ref.scale.size()), 0);

  const QuantizeSummary m = quantize_file(in, t.path / "m.safetensors", "^a\\.", quiet());
  EXPECT_EQ(m.tensors_quantized, 1);
  SafetensorsFile mo(t.path / "m.safetensors");
  EXPECT_TRUE(mo.contains("a.weight_packed"));
  EXPECT_TRUE(same_bytes(src.get("b.experts"), mo.get("b.experts")));

  expect_error<CheckpointError>([&] { quantize_file(in, t.path / "x.safetensors", "index", quiet()); }, {"d.index", "I32"});
  expect_error<CheckpointError>([&] { quantize_file(in, t.path / "x.safetensors", "nomatch", quiet()); }, {"no tensor matches"});
  expect_error<std::invalid_argument>([&] { quantize_file(in, t.path / "x.safetensors", "([", quiet()); }, {"invalid regular expression"});
  EXPECT_FALSE(fs::exists(t.path / "x.safetensors"));
  expect_error<CheckpointError>([&] { quantize_file(in, t.path / "m.safetensors", "", quiet()); }, {"exists"});
  expect_no_temp(t.path / "x.safetensors");
}

}  // namespace
}  // namespace lutb
