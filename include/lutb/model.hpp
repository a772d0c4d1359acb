// lutb/model.hpp: a CPU forward pass of whole MoE language models (issue 5, spec section 8).
//
// Families: qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v2, deepseek_v3, following the
// conventions of Hugging Face transformers 5 (modeling_<family>.py):
//   embeddings -> N x [RMSNorm -> attention -> residual -> RMSNorm -> MLP or MoE -> residual]
//   -> final RMSNorm -> lm_head (tied to the embeddings when tie_word_embeddings or when the
//   checkpoint has no lm_head.weight) -> log-softmax.
// Attention is causal, grouped-query (GQA) for the Llama-style families, with Qwen3's per-head q/k
// RMSNorm, OLMoE's whole-projection q/k RMSNorm and clip_qkv, Qwen2's q/k/v bias, and DeepSeek's
// multi-head latent attention (MLA: q_lora_rank, kv_lora_rank, qk_nope/qk_rope/v head dims, the
// rope on the qk_rope part only, interleaved when rope_interleave, softmax scale qk_head_dim^-0.5
// times yarn mscale^2 when mscale_all_dim is set). Rotary embeddings: rope types default, linear
// and yarn (transformers modeling_rope_utils), theta from rope_parameters.rope_theta or rope_theta.
//
// Numerics: every weight is converted to FP32 once at load (BF16/F16/F32 sources) and all compute
// is FP32 (FP32 accumulation; dense products through OpenBLAS cblas_sgemm). The sparse MLP blocks
// are pluggable (MoeBlock below, built by a MoeFactory, normally CheckpointMoe): router and shared
// experts in FP32, routed experts through lutb/moe.hpp (BF16 reference, LUT-B emulation, or a
// baseline format quantise-dequantised).
// Threads: the forward pass runs on the calling thread's OpenMP team (omp_get_max_threads(): what
// OMP_NUM_THREADS or the caller's omp_set_num_threads chose) and OpenBLAS's threads; the library
// sets no process-wide thread count, so a host process (the Python package, a server) keeps its own.
// Memory: the dense weights are held in FP32 (fine for the small models this CPU evaluator is
// meant for); routed experts are whatever the MoeBlock holds (BF16 or packed LUT-B).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/calibration.hpp"
#include "lutb/checkpoint.hpp"
#include "lutb/fit.hpp"
#include "lutb/moe.hpp"

namespace lutb {
class SafetensorsCollection;
}

namespace lutb::model {

/// Errors of this module (bad config, missing tensor, bad tokens file): the message names the file,
/// the tensor or key, and the reason.
struct ModelError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
/// A config.json value that is valid for its family but names a feature lutb's model does not
/// implement (hidden_act other than silu, a rope type other than default / linear / yarn): lutb eval
/// cannot run it, while the checkpoint is still a valid input of `lutb quantize` (its output serves
/// other runtimes). Every other ModelError of TransformerConfig is an invalid or missing value,
/// which lutb quantize refuses as lutb eval does (src/cli/quantize.cpp).
struct UnsupportedConfigError : ModelError {
  using ModelError::ModelError;
};

// -------------------------------------------------------------------------------------------------
// Configuration
// -------------------------------------------------------------------------------------------------

/// Rotary embedding parameters (transformers modeling_rope_utils: rope types "default", "linear",
/// "yarn"; other types are a ModelError).
struct RopeConfig {
  std::string type = "default";
  double theta = 10000.0;
  int dim = 0;                        // rotated dimensions (head_dim, or qk_rope_head_dim for MLA)
  double factor = 1.0;                // linear / yarn scaling factor
  double original_max_position = 0;   // yarn: original_max_position_embeddings
  double beta_fast = 32, beta_slow = 1;
  double mscale = 0, mscale_all_dim = 0;
  std::optional<double> attention_factor;  // yarn: explicit attention factor
  bool truncate = true;               // yarn: floor/ceil the correction range
};

/// Inverse frequencies inv_freq[dim/2] (FP32) and the cos/sin scaling ("attention_factor") of a
/// RopeConfig, as transformers computes them (default: theta^(-2i/dim); linear: divided by factor;
/// yarn: blend of interpolation and extrapolation over the beta_fast..beta_slow correction range,
/// attention factor 0.1*mscale*ln(factor)+1 ratios).
struct RopeTable {
  std::vector<float> inv_freq;
  float attention_scaling = 1.0f;
};
RopeTable make_rope_table(const RopeConfig& rope);

/// The architecture of one checkpoint, parsed from config.json (transformers 5 and 4 key variants).
struct TransformerConfig {
  std::string family;  // model_type: qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v2, deepseek_v3
  int hidden_size = 0;
  int num_layers = 0;
  int vocab_size = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;            // Llama-style attention head dimension
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  int intermediate_size = 0;   // dense MLP width
  double clip_qkv = 0;         // OLMoE: clamp q, k, v to +-clip_qkv when > 0 (after the q/k norms)
  int sliding_window = 0;      // > 0: keys further back than this are masked (not implemented:
                               // a sequence longer than the window is a ModelError)

  // MLA (deepseek_v2 / deepseek_v3)
  bool mla = false;
  int q_lora_rank = 0;         // 0 = no low-rank q (q_proj)
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  bool rope_interleave = false;

  RopeConfig rope;
  float attention_scale = 0;   // softmax scale (head_dim^-0.5, or MLA's with mscale^2)

  // MoE layout (which layers are sparse, shared-expert shapes), copied from `moe`
  lutb::ModelConfig moe;       // the checkpoint module's parse of the same config.json
  int num_experts = 0;
  int moe_intermediate_size = 0;
  int n_shared_experts = 0;                   // deepseek n_shared_experts (qwen2_moe: 1 when it has one)
  int shared_expert_intermediate_size = 0;    // total width of the shared MLP (0 = none)
  std::vector<bool> sparse_layer;             // [num_layers]

  nlohmann::json raw;          // the whole config.json

  /// Parses `dir/config.json`. Throws ModelError naming the file and the key for an unknown family,
  /// a missing, ill-typed or invalid key; UnsupportedConfigError (a ModelError) for a valid value of a
  /// feature lutb's model does not implement.
  static TransformerConfig load(const std::filesystem::path& dir);
  /// Same from a parsed JSON; `where` names the source in errors.
  static TransformerConfig from_json(const nlohmann::json& j, const std::string& where);
};

// -------------------------------------------------------------------------------------------------
// Building blocks (reference implementations, unit-tested against hand-computed values)
// -------------------------------------------------------------------------------------------------

/// RMSNorm along the last axis: y[r][i] = w[i] * x[r][i] / sqrt(mean_i(x[r][i]^2) + eps), FP32.
/// x, y: [rows][dim] row-major, y may equal x; w: [dim] (transformers LlamaRMSNorm in FP32).
void rms_norm(const float* x, const float* w, float* y, std::int64_t rows, std::int64_t dim, float eps);

/// Rotary embedding in place on `heads` vectors per token. x: [T][row_stride] with head h's rotated
/// part at x[t*row_stride + h*head_stride + offset .. + rope dim). Position of token t is
/// positions[t]. Not interleaved (rotate_half): pairs (i, i + d/2); interleaved (DeepSeek's
/// rope_interleave / complex form): pairs (2i, 2i+1), written back in place (transformers writes
/// the de-interleaved order, which permutes q and k alike and so leaves q.k unchanged).
/// Pair i rotates by angle pos * inv_freq[i]; cos and sin are scaled by table.attention_scaling.
void apply_rope(float* x, std::int64_t T, const std::int32_t* positions, int heads, std::int64_t row_stride,
                std::int64_t head_stride, std::int64_t offset, const RopeTable& table, bool interleaved);

/// Causal scaled-dot-product attention over one sequence.
/// q: [T][num_heads*qk_dim] (head h at columns h*qk_dim), k: [T][num_kv_heads*qk_dim],
/// v: [T][num_kv_heads*v_dim], out: [T][num_heads*v_dim]; query head h reads kv head
/// h / (num_heads/num_kv_heads) (GQA). scores = scale * q.k, masked to key positions <= query
/// position, softmax in FP32, out = P v. num_heads must be a multiple of num_kv_heads.
void causal_attention(const float* q, const float* k, const float* v, float* out, std::int64_t T, int num_heads,
                      int num_kv_heads, int qk_dim, int v_dim, float scale);

/// y[T][N] = x[T][K] * W[N][K]^T (+ bias[N] when non-null), FP32 through cblas_sgemm.
/// `accumulate`: y += instead of y =.
void linear(const float* x, const float* W, const float* bias, float* y, std::int64_t T, std::int64_t N,
            std::int64_t K, bool accumulate = false);

/// The OpenBLAS kernel family in use (openblas_get_corename(): "SkylakeX", "Haswell", "Prescott"...).
std::string blas_core_name();
/// OpenBLAS (0.3.21 here) picks its kernels from cpuid when it is loaded; on a CPU newer than it
/// knows (e.g. Xeon family 6 model 207 under KVM) it falls back to the SSE3 "Prescott" kernels,
/// about 4x slower. Returns the OPENBLAS_CORETYPE value this CPU supports best ("SkylakeX" with
/// AVX-512 F/BW/DQ/VL, "Haswell" with AVX2+FMA) when that fallback happened, else "".
std::string blas_coretype_override();

/// Natural-log softmax NLL of `target` under logits[V] (max-subtracted, accumulated in double).
double nll(const float* logits, std::int64_t V, std::int64_t target);

// -------------------------------------------------------------------------------------------------
// The MoE block seam
// -------------------------------------------------------------------------------------------------

/// The sparse MLP block of one layer as the model calls it: router + top-k routed experts + the
/// shared experts when the family has them (DeepSeek shared_experts, Qwen2-MoE's gated
/// shared_expert). FP32 in, FP32 out.
struct MoeBlockParts;
class MoeBlock {
 public:
  virtual ~MoeBlock() = default;
  /// x: [T][hidden_size] FP32 (the post-attention-normed hidden states, exactly what transformers
  /// feeds the MoE block); out: [T][hidden_size] FP32, overwritten with the block's output (the
  /// routed experts' sum, BF16-rounded per spec section 4, plus the shared experts; MoeBlockParts).
  virtual void forward(const float* x, std::int64_t T, float* out) = 0;
  /// The block's parts around its routed experts, for running those on another backend (the GPU:
  /// `lutb moe/eval --device cuda`, src/cli/gpu.cpp) while the rest stays this CPU code. Null when
  /// the block does not expose them. Valid while the block lives.
  virtual const MoeBlockParts* parts() const { return nullptr; }
};

/// What forward() does, split at the routed experts:
///   forward(x) = bf16(experts(bf16(x), route(logits(x)))) + shared(x)
/// with route = moe::route(router, logits, correction_bias) (or DeepSeek-V2's group_limited_greedy),
/// experts = experts->apply_f32, and the two BF16 roundings of spec section 4 (the routed experts
/// read BF16 tokens, step 6 rounds their weighted sum to BF16); logits and shared read the FP32 x.
struct MoeBlockParts {
  moe::RouterConfig router;            // the routing rule (spec 5)
  bool group_limited_greedy = false;   // DeepSeek-V2's softmax group rule instead of moe::route
  const std::vector<float>* correction_bias = nullptr;  // [E] FP32 (DeepSeek-V3), empty otherwise
  const moe::Experts* experts = nullptr;  // the routed experts as held (DenseExperts, LutbCpuExperts...)
  /// logits[T][E] FP32 = x[T][H] . gate^T (FP32, as forward()).
  std::function<void(const float* x, std::int64_t T, float* logits)> router_logits;
  /// ids [T][k] int32, weights [T][k] FP32 from logits (forward()'s routing, CPU).
  std::function<void(const float* logits, std::int64_t T, std::int32_t* ids, float* weights)> route;
  /// out[T][H] += the shared experts of x (nothing when the family has none; forward()'s code).
  std::function<void(const float* x, float* out, std::int64_t T)> add_shared;
};

/// Builds the MoeBlock of sparse layer `layer`.
using MoeFactory = std::function<std::unique_ptr<MoeBlock>(int layer)>;

// -------------------------------------------------------------------------------------------------
// MoE blocks of a checkpoint: router + routed experts through lutb/moe.hpp
// -------------------------------------------------------------------------------------------------

/// How the routed experts are held and computed.
///   None      BF16 weights as loaded, moe::DenseExperts (the BF16 reference of spec section 4)
///   Lutb      LUT-B: on a BF16 checkpoint the online method (moe::LutBOnlineMoEMethod quantises
///             w13/w2 after loading, spec 6); on a LUT-B checkpoint the stored packed weights
///   Int3G128  weights quantise-dequantised to INT3 with groups of 128 (lutb/baselines.hpp), BF16
///   Mxfp4     weights quantise-dequantised to MXFP4 (lutb/baselines.hpp), BF16
enum class Quant : std::uint8_t { None, Lutb, Int3G128, Mxfp4 };
/// "none", "lutb", "int3-g128", "mxfp4".
std::string quant_name(Quant q);
/// Parses a quant name; throws ModelError naming the value and the allowed ones.
Quant quant_from_name(const std::string& name);

struct MoeOptions {
  Quant quant = Quant::None;
  /// Activation format entering the expert GEMMs (spec 4). The CLI defaults it to MXFP8 for LUT-B
  /// and BF16 otherwise.
  moe::ActivationFormat activations = moe::ActivationFormat::BF16;
  FitOptions fit;                                      // fitter and threads (Lutb on BF16 weights)
  /// The fit of w13 / w2 (Lutb on BF16 weights), called as lutb::quantize would be; empty =
  /// lutb::quantize (the CPU fitters). `lutb eval/moe --device cuda` passes the GPU fitter
  /// (lutb::cuda::quantize_gpu: the same bytes and FitStats as the CPU).
  moe::FitFunction fit_function;
  moe::EmulationKernel kernel = moe::EmulationKernel::Fast;
  /// Calibration statistics (lutb/calibration.hpp; Lutb on BF16 weights only): w13 and w2 of each
  /// layer are fitted with its column weights (FitOptions::column_weights, passed to fit_function).
  /// Null: the data-free fit. build() throws ModelError when a layer has no statistics or their
  /// shapes differ from the model's.
  std::shared_ptr<const CalibrationStats> calibration;
  /// With calibration statistics that hold the full second moments (lutb calibrate --full-moments):
  /// true fits w13 and w2 with cross-column error feedback under them (FitOptions::error_feedback,
  /// damped by `damping`; the CPU fitters only), false with the column weights alone.
  bool error_feedback = true;
  /// FitOptions::error_feedback.damping of those fits: lambda of H = C + lambda mean(diag C) I,
  /// finite and >= 0 (the fit throws std::invalid_argument otherwise).
  double damping = 0.01;
};

/// Quantisation error of one expert stack (w13 or w2 of one layer, all experts).
struct ExpertTensorStats {
  int layer = 0;
  std::string name;                // e.g. "model.layers.1.mlp.experts.w13"
  std::int64_t weights = 0;        // logical weights
  double sse = 0, sum_sq = 0;      // sum (w - w_hat)^2, sum w^2 (over logical weights)
  std::size_t source_bytes = 0;    // BF16 bytes of the source (2 per weight)
  std::size_t quantized_bytes = 0; // bytes held by the quantised representation
  /// 10 log10(sum_sq / sse); +inf when sse == 0.
  double sqnr_db() const;
};

/// Builds the sparse MLP blocks of a checkpoint directory (router, routed experts, shared experts)
/// and records the per-tensor quantisation statistics of the routed experts.
class CheckpointMoe {
 public:
  /// Opens `dir` (config.json + safetensors). Throws ModelError / SafetensorsError.
  CheckpointMoe(const std::filesystem::path& dir, MoeOptions opt);
  ~CheckpointMoe();
  CheckpointMoe(const CheckpointMoe&) = delete;
  CheckpointMoe& operator=(const CheckpointMoe&) = delete;

  /// The MoE block of sparse layer `layer`: FP32 router logits x . gate^T (as transformers in FP32
  /// compute), moe::route (spec 5; family rules from config.json), experts per options.
  /// Throws ModelError for a layer that is not sparse or out of range, naming it.
  std::unique_ptr<MoeBlock> build(int layer);
  /// A factory calling build() (this object must outlive the factory's use).
  MoeFactory factory();

  const TransformerConfig& config() const;
  /// True when the checkpoint stores LUT-B experts (spec 2.2).
  bool lutb_checkpoint() const;
  const MoeOptions& options() const;
  /// Statistics of every expert stack built so far (quantised modes; empty for None).
  const std::vector<ExpertTensorStats>& stats() const;
  /// Aggregate SQNR over all stacks built (10 log10(sum sum_sq / sum sse)).
  double aggregate_sqnr_db() const;
  /// Bits per weight of the routed experts as held (16 for BF16).
  double bits_per_weight() const;
  /// Bytes of the routed experts in the source checkpoint and as held.
  std::size_t source_bytes() const;
  std::size_t held_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// -------------------------------------------------------------------------------------------------
// The language model
// -------------------------------------------------------------------------------------------------

/// The dense weights of one checkpoint in FP32 (everything but the sparse MLP blocks) and the
/// forward pass.
class LanguageModel {
 public:
  /// Loads config.json and the dense tensors of `dir` (single or sharded safetensors): embeddings,
  /// norms, attention, dense MLPs, lm_head; sparse layers get their block from `moe(layer)`.
  /// Throws ModelError (unknown family, missing tensor naming it, shape mismatch naming the tensor,
  /// expected and found shapes) or the safetensors reader's error.
  static LanguageModel load(const std::filesystem::path& dir, const MoeFactory& moe);

  /// Checks, without reading their data, the tensors load() reads other than the routed experts
  /// (embeddings, norms, attention, dense MLPs, lm_head, and of each MoE layer the router, DeepSeek's
  /// correction bias and the shared experts) against config.json: present, of the shape the config
  /// implies, of a float dtype. Throws ModelError with load()'s wording (naming the file and the
  /// tensor); returns the names checked. For `lutb quantize`, which copies these tensors: a broken one
  /// is refused before the quantisation, not by `lutb eval` after it.
  static std::vector<std::string> check_tensors(const std::filesystem::path& dir);

  LanguageModel(LanguageModel&&) noexcept;
  LanguageModel& operator=(LanguageModel&&) noexcept;
  ~LanguageModel();

  const TransformerConfig& config() const;

  /// Forward pass of `batch` independent sequences of length T each (tokens: [batch][T], positions
  /// 0..T-1 in each). Writes logits[batch*T][vocab] when `logits` is non-null. Returns the sum over
  /// sequences of the next-token NLL (nats) of positions 0..T-2 (targets tokens[t+1]).
  /// Throws ModelError for a token id outside [0, vocab).
  double forward(const std::int32_t* tokens, std::int64_t batch, std::int64_t T, float* logits = nullptr);

  /// The hidden state entering layer `layer`'s MoE block for one sequence (x: [T][H], output of the
  /// post-attention RMSNorm); used by tests and debugging. Throws for a non-sparse layer.
  std::vector<float> moe_input(const std::int32_t* tokens, std::int64_t T, int layer);

 private:
  struct Impl;
  explicit LanguageModel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// -------------------------------------------------------------------------------------------------
// Evaluation protocol (spec section 8)
// -------------------------------------------------------------------------------------------------

/// Reads `input_ids` (I32, or I64 converted; 1-D, or 2-D [1][n]) from a safetensors file.
/// Throws ModelError naming the file when missing, or the tensor when absent or of another dtype.
std::vector<std::int32_t> load_token_ids(const std::filesystem::path& file);

struct EvalOptions {
  std::int64_t window = 256;    // tokens per window
  std::int64_t batch = 8;       // windows per forward call (results do not depend on it)
  std::int64_t max_windows = 0; // 0 = all (tests may evaluate a prefix)
  /// Called after each batch with (windows done, windows total).
  std::function<void(std::int64_t, std::int64_t)> progress;
};

struct EvalResult {
  double val_loss = 0;          // mean next-token NLL in nats
  std::int64_t tokens = 0;      // predicted tokens = windows * (window - 1)
  std::int64_t windows = 0;
  double seconds = 0;           // wall time of the forward passes
};

/// Non-overlapping windows of opt.window tokens from index 0, the last partial window dropped;
/// mean NLL over the window-1 predicted positions of every window. Throws ModelError when fewer
/// tokens than one window are given.
EvalResult evaluate(LanguageModel& model, const std::vector<std::int32_t>& tokens, const EvalOptions& opt = {});

// -------------------------------------------------------------------------------------------------
// Calibration statistics (issue 25; the file and the weights they give: lutb/calibration.hpp)
// -------------------------------------------------------------------------------------------------

/// Which input the statistics of down (w2) describe: h of the BF16 model (the default), or h of the
/// model whose w13 is already LUT-B (fitted with binned-dp under the gate_up statistics of a first
/// pass, MXFP8 activations: what w2 meets in the quantised model; a second pass over the tokens).
enum class DownInput : std::uint8_t { Bf16Model, QuantizedW13 };

/// How the tokens routed to an expert count in its statistics: all alike, or by the square of their
/// routing weight for it (the block's output is sum_k weight_k * y_e, so an error of y_e reaches the
/// model scaled by weight_k: E[weight^2 (dW x)^2] is then the output error of the block).
enum class TokenWeight : std::uint8_t { Uniform, RoutingWeight };

struct CalibrateOptions {
  std::int64_t window = 256;     // tokens per sequence (non-overlapping windows from index 0)
  std::int64_t batch = 8;        // windows per forward call
  std::int64_t max_tokens = 0;   // use only the first N tokens (0 = all); whole windows only
  DownInput down_input = DownInput::Bf16Model;
  TokenWeight token_weight = TokenWeight::Uniform;
  /// Also gather the full second moments E[x x^T] and E[h h^T] of every expert's inputs
  /// (LayerCalibration::gate_up_xxT / down_hhT, for FitOptions::error_feedback): E * (H^2 + I^2) doubles
  /// while the model runs.
  bool full_moments = false;
  FitOptions fit;                // the fit of w13 for DownInput::QuantizedW13 (threads, fitter)
  /// Called after each batch with (windows done, windows total) over all passes.
  std::function<void(std::int64_t, std::int64_t)> progress;
  /// Cancellation (lutb/fit.hpp): polled after each batch and by the fit of the second pass; when it
  /// reads nonzero, Interrupted is thrown ("calibration: interrupted by signal V (strsignal(V)) after W
  /// of N windows": the flag holds the signal number, as the CLI's handler stores it).
  const InterruptFlag* interrupt = nullptr;
};

/// Runs the BF16 checkpoint `dir` (the BF16 reference of spec section 4) over the calibration tokens
/// and returns, per MoE layer and routed expert, the mean squares of the inputs of gate/up and of
/// down over the tokens routed to it, and their number (src/model/calibrate.cpp says exactly what is
/// measured). Throws ModelError for a LUT-B checkpoint, fewer tokens than one window, a NaN or
/// infinite routed-expert weight (before the model runs, named as Checkpoint::expert_location names
/// it: "FILE: tensor NAME (layer L, expert E), row R col C: NaN; ..."), or what LanguageModel::load
/// throws. A non-finite weight elsewhere (attention, norms) is not looked for: it makes the returned
/// statistics non-finite, which CalibrationStats::check() and save() refuse.
CalibrationStats collect_calibration(const std::filesystem::path& dir, const std::vector<std::int32_t>& tokens,
                                     const CalibrateOptions& opt = {});

}  // namespace lutb::model
