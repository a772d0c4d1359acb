// Synthetic MoE checkpoints at real model shapes (lutb synth, the default job, memory tests).
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <fstream>

#include <fmt/core.h>
#include <fmt/format.h>

#include "io/checkpoint_internal.hpp"
#include "lutb/checkpoint.hpp"

namespace lutb {

namespace fs = std::filesystem;

namespace {

// Published config.json values of the imitated models (Hugging Face model cards:
// Qwen/Qwen3-30B-A3B, Qwen/Qwen1.5-MoE-A2.7B, mistralai/Mixtral-8x7B-v0.1, deepseek-ai/DeepSeek-V3,
// deepseek-ai/DeepSeek-V2-Lite, allenai/OLMoE-1B-7B-0924).
nlohmann::json real_config(ModelFamily f) {
  using nlohmann::json;
  switch (f) {
    case ModelFamily::qwen3_moe:
      return json{{"architectures", {"Qwen3MoeForCausalLM"}}, {"model_type", "qwen3_moe"}, {"hidden_size", 2048},
                  {"intermediate_size", 6144}, {"moe_intermediate_size", 768}, {"num_experts", 128},
                  {"num_experts_per_tok", 8}, {"norm_topk_prob", true}, {"decoder_sparse_step", 1},
                  {"mlp_only_layers", json::array()}, {"num_attention_heads", 32}, {"num_key_value_heads", 4},
                  {"head_dim", 128}, {"rms_norm_eps", 1e-6}, {"rope_theta", 1000000.0}, {"vocab_size", 151936},
                  {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
    case ModelFamily::qwen2_moe:
      return json{{"architectures", {"Qwen2MoeForCausalLM"}}, {"model_type", "qwen2_moe"}, {"hidden_size", 2048},
                  {"intermediate_size", 5632}, {"moe_intermediate_size", 1408}, {"shared_expert_intermediate_size", 5632},
                  {"num_experts", 60}, {"num_experts_per_tok", 4}, {"norm_topk_prob", false}, {"decoder_sparse_step", 1},
                  {"mlp_only_layers", json::array()}, {"num_attention_heads", 16}, {"num_key_value_heads", 16},
                  {"rms_norm_eps", 1e-6}, {"rope_theta", 1000000.0}, {"vocab_size", 151936},
                  {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
    case ModelFamily::mixtral:
      return json{{"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"}, {"hidden_size", 4096},
                  {"intermediate_size", 14336}, {"num_local_experts", 8}, {"num_experts_per_tok", 2},
                  {"num_attention_heads", 32}, {"num_key_value_heads", 8}, {"rms_norm_eps", 1e-5},
                  {"rope_theta", 1000000.0}, {"vocab_size", 32000}, {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
    case ModelFamily::deepseek_v3:
      return json{{"architectures", {"DeepseekV3ForCausalLM"}}, {"model_type", "deepseek_v3"}, {"hidden_size", 7168},
                  {"intermediate_size", 18432}, {"moe_intermediate_size", 2048}, {"n_routed_experts", 256},
                  {"n_shared_experts", 1}, {"num_experts_per_tok", 8}, {"n_group", 8}, {"topk_group", 4},
                  {"routed_scaling_factor", 2.5}, {"scoring_func", "sigmoid"}, {"topk_method", "noaux_tc"},
                  {"norm_topk_prob", true}, {"first_k_dense_replace", 0}, {"moe_layer_freq", 1},
                  {"num_attention_heads", 128}, {"kv_lora_rank", 512}, {"q_lora_rank", 1536}, {"rms_norm_eps", 1e-6},
                  // The attention keys lutb moe / eval parse (missing, lutb moe refused synth's DeepSeek
                  // checkpoints: "key 'qk_nope_head_dim': required but missing").
                  {"qk_nope_head_dim", 128}, {"qk_rope_head_dim", 64}, {"v_head_dim", 128},
                  {"max_position_embeddings", 163840}, {"rope_theta", 10000},
                  {"rope_scaling", {{"type", "yarn"}, {"factor", 40}, {"original_max_position_embeddings", 4096},
                                    {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}},
                  {"vocab_size", 129280}, {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
    case ModelFamily::deepseek_v2:
      return json{{"architectures", {"DeepseekV2ForCausalLM"}}, {"model_type", "deepseek_v2"}, {"hidden_size", 2048},
                  {"intermediate_size", 10944}, {"moe_intermediate_size", 1408}, {"n_routed_experts", 64},
                  {"n_shared_experts", 2}, {"num_experts_per_tok", 6}, {"n_group", 1}, {"topk_group", 1},
                  {"routed_scaling_factor", 1.0}, {"scoring_func", "softmax"}, {"topk_method", "greedy"},
                  {"norm_topk_prob", false}, {"first_k_dense_replace", 0}, {"moe_layer_freq", 1},
                  {"num_attention_heads", 16}, {"kv_lora_rank", 512}, {"rms_norm_eps", 1e-6}, {"vocab_size", 102400},
                  {"qk_nope_head_dim", 128}, {"qk_rope_head_dim", 64}, {"v_head_dim", 128},
                  {"max_position_embeddings", 163840}, {"rope_theta", 10000},
                  {"rope_scaling", {{"type", "yarn"}, {"factor", 40}, {"original_max_position_embeddings", 4096},
                                    {"beta_fast", 32}, {"beta_slow", 1}, {"mscale", 0.707}, {"mscale_all_dim", 0.707}}},
                  {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
    case ModelFamily::olmoe:
      return json{{"architectures", {"OlmoeForCausalLM"}}, {"model_type", "olmoe"}, {"hidden_size", 2048},
                  {"intermediate_size", 1024}, {"num_experts", 64}, {"num_experts_per_tok", 8},
                  {"norm_topk_prob", false}, {"num_attention_heads", 16}, {"num_key_value_heads", 16},
                  {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0}, {"vocab_size", 50304},
                  {"tie_word_embeddings", false}, {"hidden_act", "silu"}};
  }
  return {};
}

std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::uint64_t hash_name(const std::string& s, std::uint64_t seed) {
  std::uint64_t h = 1469598103934665603ull ^ seed;  // FNV-1a, then mixed
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return splitmix64(h);
}

// Student-t(nu) CDF: F(t) = 1 - I_x(nu/2, 1/2) / 2 for t > 0, x = nu / (nu + t^2) (regularised
// incomplete beta, continued fraction of Numerical Recipes 6.4 / Lentz).
double betacf(double a, double b, double x) {
  const double tiny = 1e-300;
  double c = 1.0, d = 1.0 - (a + b) * x / (a + 1.0);
  if (std::fabs(d) < tiny) d = tiny;
  d = 1.0 / d;
  double h = d;
  for (int m = 1; m <= 300; ++m) {
    const int m2 = 2 * m;
    double aa = m * (b - m) * x / ((a - 1.0 + m2) * (a + m2));
    d = 1.0 + aa * d;
    if (std::fabs(d) < tiny) d = tiny;
    c = 1.0 + aa / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1.0 / d;
    h *= d * c;
    aa = -(a + m) * (a + b + m) * x / ((a + m2) * (a + 1.0 + m2));
    d = 1.0 + aa * d;
    if (std::fabs(d) < tiny) d = tiny;
    c = 1.0 + aa / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1.0 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1.0) < 1e-15) break;
  }
  return h;
}

double betai(double a, double b, double x) {
  if (x <= 0.0) return 0.0;
  if (x >= 1.0) return 1.0;
  const double bt = std::exp(std::lgamma(a + b) - std::lgamma(a) - std::lgamma(b) + a * std::log(x) + b * std::log1p(-x));
  if (x < (a + 1.0) / (a + b + 2.0)) return bt * betacf(a, b, x) / a;
  return 1.0 - bt * betacf(b, a, 1.0 - x) / b;
}

// Student-t(nu) sampler by inversion: the quantile function tabulated at u = j / 2^16 (built once,
// exact to ~1e-12 by Newton on the CDF), linear interpolation inside a bin; the two outer bins
// (probability 2^-15) are inverted exactly per sample. One 64-bit random number per value.
class StudentT {
 public:
  explicit StudentT(double nu) : nu_(nu), q_(kBins + 1) {
    c_ = std::exp(std::lgamma((nu + 1) / 2) - std::lgamma(nu / 2)) / std::sqrt(nu * M_PI);
    q_[kBins / 2] = 0.0;
    // Lower half, descending: Newton from the previous (larger) quantile converges monotonically
    // because the CDF is convex for t < 0.
    for (int j = kBins / 2 - 1; j >= 1; --j) q_[j] = lower_quantile(static_cast<double>(j) / kBins, q_[j + 1]);
    for (int j = kBins / 2 + 1; j < kBins; ++j) q_[j] = -q_[kBins - j];
    q_[0] = q_[1];  // unused (outer bins are inverted exactly)
    q_[kBins] = q_[kBins - 1];
  }
  double operator()(std::uint64_t r) const {
    const int j = static_cast<int>(r >> 48);                                      // bin
    const double f = (static_cast<double>(r & 0xffffffffffffull) + 0.5) * 0x1p-48;  // position in the bin
    if (j == 0) return lower_quantile(f / kBins, q_[1]);
    if (j == kBins - 1) return -lower_quantile((1.0 - f) / kBins, q_[1]);
    return q_[j] + f * (q_[j + 1] - q_[j]);
  }

 private:
  static constexpr int kBins = 1 << 16;
  double cdf(double t) const {
    const double ib = betai(nu_ / 2, 0.5, nu_ / (nu_ + t * t));
    return t > 0 ? 1.0 - 0.5 * ib : 0.5 * ib;
  }
  double pdf(double t) const { return c_ * std::pow(1.0 + t * t / nu_, -(nu_ + 1) / 2); }
  // Quantile for u < 0.5 by Newton from `start` (a value at or above the root).
  double lower_quantile(double u, double start) const {
    double t = start;
    for (int it = 0; it < 200; ++it) {
      const double step = (cdf(t) - u) / pdf(t);
      t -= step;
      if (std::fabs(step) <= 1e-13 * (1.0 + std::fabs(t))) break;
    }
    return t;
  }
  double nu_, c_;
  std::vector<double> q_;
};

// One synthetic matrix: its values come from (name, row) only.
struct SynthSource {
  std::string name;  // the per-expert tensor name that seeds it
  std::int64_t rows, cols;
  double scale;      // multiplies the Student-t samples
};

void gen_rows(const SynthSource& src, std::int64_t r0, std::int64_t r1, std::uint64_t seed, const StudentT& dist,
              std::uint16_t* out) {
  const std::uint64_t base = hash_name(src.name, seed);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = r0; r < r1; ++r) {
    std::uint64_t s = base ^ (static_cast<std::uint64_t>(r) * 0xd1b54a32d192ed03ull);
    splitmix64(s);
    std::uint16_t* row = out + (r - r0) * src.cols;
    for (std::int64_t c = 0; c < src.cols; ++c)
      row[c] = bf16_from_float(static_cast<float>(src.scale * dist(splitmix64(s))));
  }
}

// An output tensor made of one or more sources stacked along rows.
struct SynthTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::vector<SynthSource> parts;
};

// The tensors of synthetic layer l of config c, in the order written.
std::vector<SynthTensor> synth_layer_tensors(const ModelConfig& c, const SynthOptions& opt, std::int64_t l) {
  const std::int64_t E = c.num_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  const double nu = opt.student_nu;
  const double tstd = std::sqrt(nu / (nu - 2.0));  // std of Student-t(nu)
  auto scale_for = [&](std::int64_t fan_in) { return 1.0 / (std::sqrt(static_cast<double>(fan_in)) * tstd); };

  std::vector<SynthTensor> t;
  const std::string router = router_weight_name(c, l);
  t.push_back({router, {E, H}, {{router, E, H, scale_for(H)}}});
  if (const std::string b = router_bias_name(c, l); !b.empty()) t.push_back({b, {E}, {{b, 1, E, 0.01}}});
  if (opt.stacked) {
    SynthTensor gu{stacked_gate_up_name(c, l), {E, 2 * I, H}, {}};
    SynthTensor dn{stacked_down_name(c, l), {E, H, I}, {}};
    for (std::int64_t e = 0; e < E; ++e) {
      gu.parts.push_back({expert_weight_name(c, l, e, Proj::gate), I, H, scale_for(H)});
      gu.parts.push_back({expert_weight_name(c, l, e, Proj::up), I, H, scale_for(H)});
      dn.parts.push_back({expert_weight_name(c, l, e, Proj::down), H, I, scale_for(I)});
    }
    t.push_back(std::move(gu));
    t.push_back(std::move(dn));
  } else {
    for (std::int64_t e = 0; e < E; ++e)
      for (Proj p : {Proj::gate, Proj::up, Proj::down}) {
        const std::string n = expert_weight_name(c, l, e, p);
        const bool down = p == Proj::down;
        t.push_back({n, {down ? H : I, down ? I : H}, {{n, down ? H : I, down ? I : H, scale_for(down ? I : H)}}});
      }
  }
  if (c.shared_expert_intermediate_size > 0) {
    const std::int64_t S = c.shared_expert_intermediate_size;
    const bool qwen2 = c.family == ModelFamily::qwen2_moe;
    const std::string base = moe_prefix(c, l) + (qwen2 ? ".shared_expert" : ".shared_experts");
    for (const char* p : {"gate_proj", "up_proj", "down_proj"}) {
      const bool down = std::string(p) == "down_proj";
      const std::string n = fmt::format("{}.{}.weight", base, p);
      t.push_back({n, {down ? H : S, down ? S : H}, {{n, down ? H : S, down ? S : H, scale_for(down ? S : H)}}});
    }
    if (qwen2) {
      const std::string g = moe_prefix(c, l) + ".shared_expert_gate.weight";
      t.push_back({g, {1, H}, {{g, 1, H, scale_for(H)}}});
    }
  }
  return t;
}

// Tensor bytes of every layer (BF16). The options are bounded by the CLI and the sizes are summed
// in 128 bits, so absurd programmatic sizes are reported as too large rather than wrapping.
std::uint64_t synth_total_bytes(const ModelConfig& c, const SynthOptions& opt) {
  unsigned __int128 total = 0;
  const std::vector<SynthTensor> one = synth_layer_tensors(c, opt, 0);  // every layer has the same shapes
  for (const auto& t : one) {
    unsigned __int128 n = 2;
    for (auto d : t.shape) n *= static_cast<std::uint64_t>(d);
    total += n;
  }
  total *= static_cast<std::uint64_t>(c.num_hidden_layers);
  if (total > std::numeric_limits<std::uint64_t>::max())
    throw std::invalid_argument(fmt::format("synth: {} layers of E {}, H {}, I {} exceed 2^64 bytes", c.num_hidden_layers,
                                            c.num_experts, c.hidden_size, c.moe_intermediate_size));
  return static_cast<std::uint64_t>(total);
}

}  // namespace

std::uint64_t synth_checkpoint_bytes(const SynthOptions& opt) { return synth_total_bytes(synth_config(opt), opt); }

ModelConfig synth_config(const SynthOptions& opt) {
  if (opt.layers < 1) throw std::invalid_argument(fmt::format("synth: --layers must be at least 1, got {}", opt.layers));
  for (const auto& [name, v] : {std::pair<const char*, std::int64_t>{"hidden_size", opt.hidden_size},
                                {"moe_intermediate_size", opt.moe_intermediate_size},
                                {"num_experts", opt.num_experts}})
    if (v < 0)
      throw std::invalid_argument(
          fmt::format("synth: {} override {} is negative (0 keeps the family's value, else it must be positive)", name, v));
  nlohmann::json j = real_config(opt.family);
  j["num_hidden_layers"] = opt.layers;
  j["torch_dtype"] = "bfloat16";
  j["lutb_synthetic"] = {{"seed", opt.seed}, {"student_nu", opt.student_nu}, {"stacked", opt.stacked},
                         {"note", "MoE blocks only (routed experts, router, correction bias, shared experts); "
                                  "Student-t weights with std 1/sqrt(fan_in); not a language model"}};
  const bool mixtral = opt.family == ModelFamily::mixtral;
  if (opt.hidden_size > 0) {
    j["hidden_size"] = opt.hidden_size;
    // Families whose config.json has no head_dim (Mixtral, Qwen2-MoE, OLMoE) derive it as hidden_size
    // // num_attention_heads, as transformers does; the rotary embedding needs it even and positive.
    // With --hidden-size 100, Mixtral's 32 heads would give head_dim 3, and lutb moe / eval would refuse
    // the checkpoint synth just wrote. The fewest
    // heads are dropped that give an even head_dim (kv heads: the largest common divisor), else
    // (hidden_size 1 or 3) one head of explicit head_dim 2. DeepSeek's MLA widths and Qwen3's explicit
    // head_dim do not depend on hidden_size.
    if (!j.contains("head_dim") && !j.contains("qk_rope_head_dim")) {
      const std::int64_t H = opt.hidden_size;
      const std::int64_t heads0 = j["num_attention_heads"].get<std::int64_t>();
      const std::int64_t kv0 = j.value("num_key_value_heads", heads0);
      std::int64_t heads = heads0;
      while (heads > 0 && (H / heads < 2 || (H / heads) % 2 != 0)) --heads;
      if (heads == 0) {
        j["num_attention_heads"] = 1;
        j["num_key_value_heads"] = 1;
        j["head_dim"] = 2;
      } else if (heads != heads0) {
        std::int64_t a = heads, b = kv0;
        while (b != 0) a = std::exchange(b, a % b);
        j["num_attention_heads"] = heads;
        j["num_key_value_heads"] = a;
      }
    }
  }
  if (opt.moe_intermediate_size > 0) {
    j[mixtral ? "intermediate_size" : "moe_intermediate_size"] = opt.moe_intermediate_size;
    if (opt.family == ModelFamily::olmoe) j["intermediate_size"] = opt.moe_intermediate_size;
    if (j.contains("shared_expert_intermediate_size")) j["shared_expert_intermediate_size"] = 4 * opt.moe_intermediate_size;
  }
  if (opt.num_experts > 0) {
    for (const char* k : {"num_experts", "num_local_experts", "n_routed_experts"})
      if (j.contains(k)) j[k] = opt.num_experts;
    const std::int64_t E = opt.num_experts;
    if (j["num_experts_per_tok"].get<std::int64_t>() > E) j["num_experts_per_tok"] = E;
    if (j.contains("n_group")) {
      // Group-limited routing stays consistent for any E (--experts 8 kept DeepSeek-V3's 8 groups,
      // i.e. groups of one expert, 4 kept groups and top-8, which no router can satisfy, and
      // sigmoid scoring ranks a group by its 2 best experts). n_group: the largest divisor of E up
      // to the family's value that leaves at least 2 experts per group; topk_group: the family's
      // value, capped at n_group and raised until the kept groups hold top-k experts.
      const std::int64_t k = j["num_experts_per_tok"].get<std::int64_t>();
      const bool sigmoid = j.value("scoring_func", std::string()) == "sigmoid";
      if (sigmoid && E < 2)
        throw std::invalid_argument(fmt::format(
            "synth: --experts {}: {} ranks expert groups by the sum of their 2 best experts (sigmoid scoring), so it "
            "needs at least 2 routed experts",
            E, family_name(opt.family)));
      std::int64_t g = std::min<std::int64_t>(j["n_group"].get<std::int64_t>(), E);
      while (g > 1 && (E % g != 0 || E / g < 2)) --g;
      std::int64_t tg = std::min<std::int64_t>(j["topk_group"].get<std::int64_t>(), g);
      while (tg < g && tg * (E / g) < k) ++tg;
      j["n_group"] = g;
      j["topk_group"] = tg;
    }
  }
  return parse_model_config(j, fmt::format("synthetic {}", family_name(opt.family)));
}

std::uint64_t synthesize_checkpoint(const fs::path& out_arg, const SynthOptions& opt) {
  const fs::path out_dir = detail::output_path(out_arg);  // "out/", "out/." -> "out"
  // Above 1e6 the sampler's lgamma difference cancels (lgamma(nu/2) ~ 1e16 at nu = 1e15: NaN
  // weights); such a t distribution is a Gaussian to every printed digit anyway.
  if (!(opt.student_nu > 2.0 && opt.student_nu <= 1e6))
    throw std::invalid_argument(fmt::format("synth: student_nu must be in (2, 1e6] (finite variance; above 1e6 the "
                                            "t distribution is numerically Gaussian and its sampler loses precision), "
                                            "got {}; nothing written",
                                            opt.student_nu));
  const ModelConfig c = synth_config(opt);
  // An empty path is refused first: the temporary would be ".tmp.PID" in the current directory, and
  // the final rename to "" would fail.
  if (out_dir.empty()) throw CheckpointError("synth: no output directory given; nothing written");
  detail::check_directory_output_name(out_dir, "synth");
  detail::check_replaceable(out_dir, /*want_directory=*/true, opt.force);
  if (fs::exists(out_dir) && !opt.force)
    throw CheckpointError(fmt::format("{}: output directory exists (use --force to replace it); nothing written",
                                      out_dir.string()));
  const std::int64_t L = c.num_hidden_layers;
  const std::uint64_t total = synth_total_bytes(c, opt);

  // Free space, before anything is written. The old output of --force is removed only after the
  // new one is complete, so it does not count as available.
  detail::check_free_space(out_dir, total + static_cast<std::uint64_t>(L + 1) * (64u << 10));  // + headers, config, index
  std::error_code ec;

  const fs::path tmp = detail::temp_sibling(out_dir);
  fs::remove_all(tmp, ec);
  // Missing parents are created (as mkdir -p) and, when the run fails or is interrupted, removed
  // again if still empty: a failed run leaves the filesystem as it was.
  std::vector<fs::path> made;  // deepest first
  for (fs::path p = tmp.parent_path(); !p.empty() && !fs::exists(fs::symlink_status(p, ec)); p = p.parent_path()) {
    made.push_back(p);
    if (p == p.parent_path()) break;
  }
  struct Guard {
    fs::path p;
    std::vector<fs::path> parents;
    bool armed = true;
    ~Guard() {
      if (!armed) return;
      std::error_code e;
      fs::remove_all(p, e);
      for (const auto& d : parents) fs::remove(d, e);  // only removes an empty directory
    }
  } guard{tmp, made};
  detail::create_temp_dir(tmp, out_dir);

  if (opt.on_start) opt.on_start(total);
  const StudentT dist(opt.student_nu);
  detail::Progress prog("synth", total, opt.progress);
  nlohmann::json weight_map = nlohmann::json::object();
  std::vector<std::uint16_t> buf;
  for (std::int64_t l = 0; l < L; ++l) {
    const std::string shard = L == 1 ? "model.safetensors" : fmt::format("model-{:05d}-of-{:05d}.safetensors", l + 1, L);
    const auto tensors = synth_layer_tensors(c, opt, l);
    SafetensorsWriter w(tmp / shard, {{"format", "pt"}});
    for (const auto& t : tensors) {
      w.declare(t.name, DType::BF16, t.shape);
      weight_map[t.name] = shard;
    }
    for (const auto& t : tensors)
      for (const auto& part : t.parts) {
        const std::int64_t block = std::max<std::int64_t>(1, (4 << 20) / std::max<std::int64_t>(1, part.cols));
        for (std::int64_t r0 = 0; r0 < part.rows; r0 += block) {
          detail::check_interrupt(opt.interrupt, out_dir);
          const std::int64_t r1 = std::min(part.rows, r0 + block);
          buf.resize(static_cast<std::size_t>((r1 - r0) * part.cols));
          gen_rows(part, r0, r1, opt.seed, dist, buf.data());
          w.write(buf.data(), buf.size() * 2);
          prog.advance(buf.size() * 2);
        }
      }
    w.commit();
  }
  prog.finish();
  if (L > 1) {
    nlohmann::json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    detail::write_text_file(tmp / "model.safetensors.index.json", idx.dump(2) + "\n");
  }
  detail::write_text_file(tmp / "config.json", c.raw.dump(2) + "\n");
  detail::check_interrupt(opt.interrupt, out_dir);
  // An old output (force, checked above) is renamed aside, the new one renamed in, then the old
  // one removed: a failure in between leaves the old one in place.
  detail::install_replacing(tmp, out_dir, /*want_directory=*/true, opt.force);
  guard.armed = false;
  return total;
}

}  // namespace lutb
