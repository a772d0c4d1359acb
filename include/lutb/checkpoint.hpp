// lutb/checkpoint.hpp: Hugging Face MoE checkpoints (spec section 7) and LUT-B checkpoints
// (spec section 2.2): configuration, tensor naming, loading a MoE layer's experts, and writing a
// LUT-B checkpoint by streaming quantisation.
//
// Layouts used throughout (spec section 4):
//   w13 [E, 2I, H]  rows 0..I-1 = gate (Mixtral w1), rows I..2I-1 = up (Mixtral w3)
//   w2  [E, H, I]   down (Mixtral w2)
//   router [E, H], e_score_correction_bias [E] (DeepSeek-V3)
// with E = num_experts, H = hidden_size, I = moe_intermediate_size, PyTorch [out, in] layout.
//
// Stacked 3-D expert tensors (transformers 5 "fused experts"):
//   `<prefix>.experts.gate_up_proj` [E, 2I, H], gate = first I rows, up = last I rows, and
//   `<prefix>.experts.down_proj`    [E, H, I].
// Source: transformers 5 Qwen3MoeExperts / MixtralExperts / DeepseekV3NaiveMoe / Qwen2MoeExperts /
// OlmoeExperts declare `gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim,
// hidden_dim))`, `down_proj = ... (num_experts, hidden_dim, intermediate_dim)` and compute
// `gate, up = F.linear(x, gate_up_proj[e]).chunk(2, dim=-1)` (gate first). All six supported
// families share this layout; a stacked tensor of any other shape is an error naming the expected
// shape (we never transpose silently).
//
// Errors: ConfigError (config.json problems) and CheckpointError (missing or malformed tensors,
// output directory problems); both name the file or checkpoint directory, the tensor and the reason.
// Safetensors structural errors are SafetensorsError (lutb/safetensors.hpp), LUT-B data errors
// FormatError (lutb/tile.hpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "lutb/dtype.hpp"
#include "lutb/fit.hpp"
#include "lutb/safetensors.hpp"
#include "lutb/tile.hpp"

namespace lutb {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct CheckpointError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Interrupted and InterruptFlag (the cancellation token of the writers and of the fitter) are
// declared in lutb/fit.hpp. When Interrupted propagates out of quantize_checkpoint, quantize_file
// or synthesize_checkpoint the temporary output has been removed and the destination is exactly as
// it was; a stop inside one tensor's fit says so ("... while fitting tensor T after K of N tiles")
// and carries tiles_done / tiles_total.

/// Temporaries that an earlier write of `target` left behind when its process died (killed, or a
/// second Ctrl-C): siblings named "<target>.tmp.<pid>..." or "<target>.old.<pid>..." whose <pid> is
/// not a running process (kill(pid, 0) fails with ESRCH). Temporaries of running processes (another
/// lutb writing the same target, or this process) are not listed. Sorted by name. Nothing is removed:
/// the callers (lutb quantize, lutb synth) report them and leave them, because a process id that is
/// not running here may be a live writer on another host sharing the filesystem.
std::vector<std::filesystem::path> stale_temporaries(const std::filesystem::path& target);

// ---------------------------------------------------------------------------
// Model families and configuration (spec section 7)
// ---------------------------------------------------------------------------
/// The supported `model_type` values of config.json.
enum class ModelFamily : std::uint8_t { qwen3_moe, qwen2_moe, mixtral, deepseek_v3, deepseek_v2, olmoe };

/// "qwen3_moe", "mixtral", ... (the config.json `model_type`).
std::string_view family_name(ModelFamily f);
/// Parses a model_type; nullopt when unsupported.
std::optional<ModelFamily> family_from_name(std::string_view model_type);
/// All supported model_type names, in enum order.
std::vector<std::string> family_names();

/// Router scoring function (spec section 5).
enum class ScoringFunc : std::uint8_t { softmax, sigmoid };

/// A MoE model's configuration, parsed from config.json with every key variant of spec section 7.
/// Defaults for absent keys are the transformers defaults of the family, noted per field.
struct ModelConfig {
  ModelFamily family = ModelFamily::qwen3_moe;
  std::string model_type;             // as written in config.json
  std::int64_t hidden_size = 0;       // H ("hidden_size", required)
  std::int64_t num_hidden_layers = 0; // ("num_hidden_layers", required)
  std::int64_t vocab_size = 0;        // ("vocab_size", required)
  /// Width of the dense MLPs ("intermediate_size"; for Mixtral this is also the expert width).
  std::int64_t intermediate_size = 0;
  /// I, the routed experts' width: "moe_intermediate_size"; Mixtral: "intermediate_size".
  std::int64_t moe_intermediate_size = 0;
  /// E: "num_experts" (Qwen2/3-MoE, OLMoE) / "num_local_experts" (Mixtral; transformers 5 for all)
  /// / "n_routed_experts" (DeepSeek). When several are present they must agree.
  std::int64_t num_experts = 0;
  std::int64_t num_experts_per_tok = 0;  // k ("num_experts_per_tok", required)
  /// Renormalise the top-k weights to sum 1 ("norm_topk_prob"; default false, DeepSeek-V3 true;
  /// Mixtral always true whatever the key says, spec section 5).
  bool norm_topk_prob = false;
  /// DeepSeek-V2/V3 routing keys (spec 5): "scoring_func" (DeepSeek-V3 default sigmoid, V2 softmax),
  /// "topk_method" ("greedy", "group_limited_greedy", "noaux_tc"; V3 default "noaux_tc", V2
  /// "greedy"), "n_group", "topk_group", "routed_scaling_factor" (defaults 1). Other families route
  /// by softmax top-k with no groups and no factor, and these keys in their config.json are ignored,
  /// as transformers ignores them: the fields keep the defaults (topk_method empty).
  ScoringFunc scoring_func = ScoringFunc::softmax;
  std::string topk_method;
  std::int64_t n_group = 1;
  std::int64_t topk_group = 1;
  double routed_scaling_factor = 1.0;
  /// Shared experts: DeepSeek "n_shared_experts" (width n_shared_experts * moe_intermediate_size,
  /// tensors mlp.shared_experts.*); Qwen2-MoE one shared expert of width
  /// "shared_expert_intermediate_size" (tensors mlp.shared_expert.*, scaled by
  /// sigmoid(mlp.shared_expert_gate.weight . x)). 0 when none.
  std::int64_t n_shared_experts = 0;
  std::int64_t shared_expert_intermediate_size = 0;  // total width of the shared MLP; 0 when none
  /// Dense-layer selection (is_moe_layer): "mlp_only_layers" (Qwen2/3-MoE, default []),
  /// "decoder_sparse_step" (Qwen2/3-MoE, default 1), "first_k_dense_replace" and "moe_layer_freq"
  /// (DeepSeek, defaults 0 and 1).
  std::vector<std::int64_t> mlp_only_layers;
  std::int64_t decoder_sparse_step = 1;
  std::int64_t first_k_dense_replace = 0;
  std::int64_t moe_layer_freq = 1;
  double rms_norm_eps = 1e-6;          // "rms_norm_eps" (default 1e-6; Mixtral 1e-5)
  bool tie_word_embeddings = false;    // "tie_word_embeddings" (default false)
  std::string hidden_act = "silu";     // "hidden_act"; the MoE pipeline of spec 4 requires "silu"
  nlohmann::json raw;                  // the whole config.json (attention/rope keys live here)
  std::string source;                  // where it was read from (for messages)

  /// True when decoder layer L has a routed-expert MoE block (0 <= L < num_hidden_layers; layers
  /// beyond, e.g. DeepSeek's multi-token-prediction layer, follow the same rule).
  ///   Qwen2/3-MoE: L not in mlp_only_layers and num_experts > 0 and (L + 1) % decoder_sparse_step == 0
  ///   DeepSeek-V2/V3: L >= first_k_dense_replace and L % moe_layer_freq == 0
  ///   Mixtral, OLMoE: every layer
  bool is_moe_layer(std::int64_t layer) const;
  /// The MoE layers among 0..num_hidden_layers-1, ascending.
  std::vector<std::int64_t> moe_layers() const;
  /// True for the softmax top-k routing of Mixtral (always renormalised) and the norm_topk_prob key
  /// elsewhere: the value the router must use (spec section 5).
  bool renormalize() const { return family == ModelFamily::mixtral ? true : norm_topk_prob; }
};

/// Parses a config.json object. `where` names its file in error messages. Throws ConfigError naming
/// `where` and the key when a required key is missing or has the wrong type, when a size or count
/// is negative or does not fit a 32-bit integer (what the model parser accepts), when the experts
/// keys disagree, for an unsupported model_type, naming it and the supported ones, and for a
/// quantization_config whose quant_method is neither LUT-B ("lut_b", or compressed-tensors "lut-b")
/// nor absent (e.g. DeepSeek-V3's FP8 release, "fp8"): lutb reads only float or LUT-B weights.
ModelConfig parse_model_config(const nlohmann::json& config, const std::string& where = "config.json");
/// Reads and parses `path` (a config.json file or a checkpoint directory holding one).
ModelConfig load_model_config(const std::filesystem::path& path);

// ---------------------------------------------------------------------------
// Tensor names (spec section 7)
// ---------------------------------------------------------------------------
/// The three projections of an expert (gate = w1, up = w3, down = w2).
enum class Proj : std::uint8_t { gate, up, down };
std::string_view proj_name(Proj p);  // "gate", "up", "down"

/// Block prefix of layer L's MoE: "model.layers.L.mlp" (Mixtral: "model.layers.L.block_sparse_moe").
std::string moe_prefix(const ModelConfig& c, std::int64_t layer);
/// Per-expert projection weight: "model.layers.L.mlp.experts.e.gate_proj.weight" (Mixtral:
/// "model.layers.L.block_sparse_moe.experts.e.w1.weight"; w1 gate, w3 up, w2 down).
std::string expert_weight_name(const ModelConfig& c, std::int64_t layer, std::int64_t expert, Proj p);
/// Stacked tensors: "<prefix>.experts.gate_up_proj" ([E, 2I, H]) and "<prefix>.experts.down_proj"
/// ([E, H, I]). For Mixtral both "block_sparse_moe" and "mlp" prefixes are looked up (transformers
/// 5 renames the block); this returns the first name (Checkpoint looks up both).
std::string stacked_gate_up_name(const ModelConfig& c, std::int64_t layer);
std::string stacked_down_name(const ModelConfig& c, std::int64_t layer);
/// Router weight "<prefix>.gate.weight" [E, H].
std::string router_weight_name(const ModelConfig& c, std::int64_t layer);
/// DeepSeek-V3 "<prefix>.gate.e_score_correction_bias" [E]; empty for families without one.
std::string router_bias_name(const ModelConfig& c, std::int64_t layer);

/// The regular expression (ECMAScript) of every routed-expert projection name of the family, per
/// expert and stacked; written into quantization_config as the module pattern. Capture groups are
/// not part of the contract.
std::string routed_expert_pattern(const ModelConfig& c);

/// LUT-B tensor names of a projection named `weight_name`: "X.weight" -> "X.weight_packed",
/// "X.weight_codebook", "X.weight_scale"; a name not ending in ".weight" (stacked, or any tensor of
/// quantize_file) gets "_packed", "_codebook", "_scale" appended.
struct LutbNames {
  std::string packed, codebook, scale;
};
LutbNames lutb_names(const std::string& weight_name);

// ---------------------------------------------------------------------------
// The quantization_config of a LUT-B checkpoint (spec section 2.2)
// ---------------------------------------------------------------------------
/// What config.json's "quantization_config" says about LUT-B.
///   {"quant_method": "lut_b", "format": "lut_b_tiles", "tile": [8, 64],
///    "codebook_dtype": "float8_e4m3fn", "scale_dtype": "ue8m0", "fitter": "...",
///    "activation": "mxfp8", "modules": "<routed_expert_pattern>",
///    "logical_shapes": {"<weight name>": [N, K] or [E, N, K], ...}  (only padded tensors)}
/// A compressed-tensors checkpoint (quant_method "compressed-tensors" whose "format", top level or
/// in any config_groups entry, is "lut-b") is accepted as LUT-B too; it has no weight_scale tensors
/// and reads as scale byte 127 (spec 2.2).
struct LutbQuantConfig {
  std::string quant_method;  // "lut_b" or "compressed-tensors"
  std::string format;
  std::string fitter;
  std::string activation = "mxfp8";
  std::string modules;  // pattern of the quantised names
  std::map<std::string, std::vector<std::int64_t>> logical_shapes;
  bool compressed_tensors = false;  // true: no weight_scale tensors, scale byte 127
};
/// Parses config["quantization_config"]; nullopt when absent or not LUT-B. A "lut_b" block whose
/// format, tile, index_bits, codebook_size, codebook/scale dtype, activation or activation_block
/// differ from LUT-B's (spec 2.2) throws ConfigError "WHERE: key 'quantization_config.K': reason".
std::optional<LutbQuantConfig> parse_lutb_quant_config(const nlohmann::json& config,
                                                       std::string_view where = "config.json");

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------
/// A dense (float) stack of matrices, row-major [experts][rows][cols], in the checkpoint's source
/// dtype (BF16, F16 or F32: the dtype of the first tensor read; all experts of one stack must agree,
/// else CheckpointError). `experts == 1` and a 2-D use for the router or a shared expert.
struct DenseStack {
  DType dtype = DType::BF16;
  std::int64_t experts = 1, rows = 0, cols = 0;
  std::vector<std::uint8_t> data;  // experts*rows*cols*dtype_size(dtype) bytes

  std::int64_t numel() const { return experts * rows * cols; }
  const void* ptr() const { return data.data(); }
  /// Elements as FP32 (exact for BF16/F16).
  std::vector<float> to_float() const;
  /// Elements as BF16 bits (exact for BF16 sources; F32/F16 round to nearest even).
  std::vector<std::uint16_t> to_bf16() const;
};

/// A MoE layer's routed experts in source precision.
struct ExpertsSource {
  DenseStack w13;  // [E, 2I, H], gate rows then up rows
  DenseStack w2;   // [E, H, I]
};

/// A MoE layer's routed experts as LUT-B (owned copies of the stored tiles, or fits).
///   w13: shape {experts E, rows 2I, cols H, stacked}; w2: {E, H, I, stacked}.
/// For a per-expert checkpoint gate and up are two tensors of [I, H] each (padded separately to
/// I8 = ceil(I/8)*8 rows); they are stacked by copying whole tiles, which is exact only when
/// I % 8 == 0 (then tile rows never straddle gate and up). When I % 8 != 0 the stacked w13 would
/// need tiles that straddle, so lutb_experts() throws FormatError naming the file, the first gate
/// tensor, the layer and the remedies (a checkpoint with stacked experts, or the online fit of the
/// BF16 checkpoint); lutb_projection() still reads each projection. (A stacked LUT-B gate_up tensor
/// is used as stored, for any I.)
struct ExpertsLutb {
  LutbTensor w13;
  LutbTensor w2;
};

/// The router of a MoE layer.
struct RouterWeights {
  DenseStack weight;                // [E, H] (experts = 1, rows = E, cols = H)
  std::optional<std::vector<float>> bias;  // e_score_correction_bias [E] (DeepSeek-V3) as FP32
};

/// Shared experts of a MoE layer, as one dense SwiGLU MLP of width S (DeepSeek: S =
/// n_shared_experts * I; Qwen2-MoE: shared_expert_intermediate_size).
struct SharedExpert {
  DenseStack gate;  // [S, H]
  DenseStack up;    // [S, H]
  DenseStack down;  // [H, S]
  /// Qwen2-MoE: shared_expert_gate.weight [1, H]; the output is scaled by sigmoid(gate . x).
  std::optional<DenseStack> output_gate;
};

/// An opened checkpoint directory: config.json plus the safetensors (single file, index + shards,
/// or every *.safetensors) memory-mapped. Tensor data stays in the mapping until a method copies it;
/// the methods that copy (dense, experts_source, lutb_experts, lutb_projection, router,
/// shared_expert) then drop the copied pages of the mapping from the resident set (madvise), so a
/// layer's weights are resident once, not twice. tensor() views stay valid (pages fault back in).
class Checkpoint {
 public:
  /// Opens `dir`. Throws ConfigError (missing/invalid config.json, unsupported family) or
  /// SafetensorsError / CheckpointError naming `dir` (no weights, truncated shard, bad index).
  explicit Checkpoint(const std::filesystem::path& dir);
  ~Checkpoint();
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;

  const std::filesystem::path& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  const SafetensorsCollection& tensors() const { return *st_; }

  /// True when config.json has a LUT-B quantization_config (quant_method "lut_b", or
  /// compressed-tensors format "lut-b").
  bool is_lutb() const { return quant_.has_value(); }
  const std::optional<LutbQuantConfig>& quant_config() const { return quant_; }

  bool contains(const std::string& name) const;
  /// Any tensor by name. Throws CheckpointError "checkpoint DIR: tensor NAME not found".
  const TensorView& tensor(const std::string& name) const;
  /// A 1-D/2-D float tensor copied as a DenseStack (experts = 1; 1-D gives rows = 1; BF16, F16 and
  /// F32 kept, F64 narrowed to F32). Throws CheckpointError naming the folder and the tensor when it
  /// is absent, not 1-D/2-D, or not a float dtype.
  DenseStack dense(const std::string& name) const;

  /// True when layer L's experts are stored stacked (gate_up_proj / down_proj or their LUT-B forms).
  bool experts_stacked(std::int64_t layer) const;
  /// True when layer L's routed experts are stored as LUT-B.
  bool experts_lutb(std::int64_t layer) const;

  /// Layer L's routed experts in source precision, gathered from per-expert or stacked tensors
  /// (one layer in memory: 3*E*I*H elements). Throws CheckpointError when L is not a MoE layer,
  /// when the experts are stored as LUT-B, or naming a missing tensor, a wrong shape (expected vs
  /// actual) or a non-float dtype.
  ExpertsSource experts_source(std::int64_t layer) const;
  /// Layer L's routed experts as LUT-B: the stored tiles when the checkpoint is LUT-B (validated;
  /// compressed-tensors scale 127), else fitted now from the source with `fit` (the online method:
  /// w13 and w2 quantised as [E, 2I, H] and [E, H, I] stacks). See ExpertsLutb for I % 8 != 0.
  /// Stored tensors must be U8 weight_packed [.., N/8, K/64, 192], F8_E4M3 weight_codebook
  /// [.., N/8, K/64, 8] and U8 weight_scale [.., N/8, K/64] (spec 2.2; "..": E when stacked).
  /// Throws CheckpointError (missing tensor, wrong dtype or shape, a contradicting
  /// quantization_config.logical_shapes entry) or FormatError (a NaN codebook byte 0x7F/0xFF, a
  /// scale byte 255), each naming the file that holds the tensor, the tensor as stored, the layer
  /// (and expert) and, for data errors, the tile in that tensor's grid; std::invalid_argument for
  /// fit.threads < 0 (online fit only), and for a source weight the fit cannot take (NaN, +-Inf,
  /// or a magnitude needing a scale byte above 246), naming it as expert_location() does.
  ExpertsLutb lutb_experts(std::int64_t layer, const FitOptions& fit = {}, FitStats* stats = nullptr) const;
  /// Where element (expert, row, col) of layer L's fused w13 [E, 2I, H] (`w13` true; gate rows, then
  /// up rows) or w2 [E, H, I] stack is stored, for messages: "FILE: tensor NAME (layer L, expert E),
  /// row R col C", in the stored tensor's own rows (per-expert gate / up / down, or the stacked
  /// gate_up_proj / down_proj).
  std::string expert_location(std::int64_t layer, bool w13, std::int64_t expert, std::int64_t row,
                              std::int64_t col) const;
  /// One stored LUT-B projection stacked over experts: gate/up [E, I, H] or down [E, H, I] (any I
  /// for per-expert tensors). Throws CheckpointError when the layer is not stored as LUT-B,
  /// FormatError for gate/up of a stacked gate_up tensor with I % 8 != 0 (its tiles straddle gate
  /// and up), and the errors of lutb_experts() for the stored tensors.
  LutbTensor lutb_projection(std::int64_t layer, Proj p) const;
  /// Router weight [E, H] (any float dtype) and (DeepSeek) correction bias [E] as FP32. Throws
  /// CheckpointError when L is not a MoE layer, the weight is absent or not [E, H], the bias has
  /// not E elements, or noaux_tc routing lacks the bias.
  RouterWeights router(std::int64_t layer) const;
  /// Shared experts (gate/up [S, H], down [H, S], S = shared_expert_intermediate_size; Qwen2-MoE's
  /// output gate [1, H]), nullopt when the layer has none. Throws CheckpointError naming a missing
  /// tensor or a wrong shape.
  std::optional<SharedExpert> shared_expert(std::int64_t layer) const;

 private:
  // Name of the stacked tensor of layer L whose name + suffix exists ("" when none).
  std::string find_stacked(std::int64_t layer, bool gate_up, const char* suffix) const;
  void check_moe_layer(std::int64_t layer) const;
  // Copies the stored LUT-B triple of `weight_name` (logical shape `one`) of layer `layer` (expert
  // `expert`, -1 for a stacked tensor) into out at tile_offset, checking dtypes, shapes, NaN
  // codebook bytes and scale 255; errors name the file, the stored tensor, the layer and the tile.
  // `headers_only`: only the dtypes and shapes are checked and `out` is not touched (run before `out`
  // is allocated at config.json's sizes).
  void read_lutb(const std::string& weight_name, const LutbShape& one, LutbTensor& out, std::int64_t tile_offset,
                 std::int64_t layer, std::int64_t expert = -1, bool headers_only = false) const;
  // read_lutb(headers_only) of every stored LUT-B tensor of projection `p` of layer `layer` (Proj::gate
  // for the gate and up stack).
  void check_lutb_headers(std::int64_t layer, Proj p) const;
  // The file holding tensor `name` (the checkpoint folder when absent).
  std::string file_of(const std::string& name) const;
  // " from DIR/config.json (hidden_size H, expert width I, E experts)": where the expected shapes of
  // the routed experts come from, for shape errors.
  std::string expected_from_config() const;
  // Throws FormatError: per-expert LUT-B gate/up of layer L cannot be stacked (I % 8 != 0).
  [[noreturn]] void throw_unstackable(std::int64_t layer) const;

  std::filesystem::path dir_;
  ModelConfig config_;
  std::unique_ptr<SafetensorsCollection> st_;
  std::optional<LutbQuantConfig> quant_;
};

// ---------------------------------------------------------------------------
// Writing LUT-B checkpoints
// ---------------------------------------------------------------------------
/// Options of quantize_checkpoint / quantize_file.
struct QuantizeOptions {
  FitOptions fit;          // fitter and threads
  /// Replace an existing output. Default false: an existing output is an error and is left as it
  /// was. With force the new output is built under a temporary name first and only then swapped in
  /// (the old one is removed after the swap). Force replaces only what looks like a checkpoint: a
  /// regular *.safetensors file; a folder of checkpoint files (*.safetensors, *.json, tokenizer
  /// files) or one whose config.json says this tool wrote it (quantization_config.quant_method
  /// "lut_b", or a synth output); never the current folder or one above it.
  bool force = false;
  bool progress = true;    // progress bar on stderr (only drawn when stderr is a terminal)
  /// Polled between tensors, between 32 MB copy chunks and, inside a tensor's fit, before every
  /// tile (it is passed on as FitOptions::interrupt when fit.interrupt is null): when it reads
  /// nonzero the write stops within about one tile per thread, the temporary output is removed and
  /// Interrupted is thrown; the destination is left as it was. Null: never interrupted.
  const InterruptFlag* interrupt = nullptr;
  /// quantize_checkpoint: called with the input directory after the routed experts and the names
  /// have been checked and before anything is written; it checks the tensors the model reads other
  /// than the routed experts (the CLI passes lutb::model::LanguageModel::check_tensors: presence,
  /// shape, float dtype, with the loader's wording) and returns their names. Its exception is
  /// rethrown with "; nothing written". The returned tensors are scanned for NaN / Inf while they are
  /// copied (the copy reads every byte anyway); one stops the run, naming the file, the tensor and
  /// the element, and the destination is left as it was. Null: no check (the library's io layer
  /// does not know the model's dense tensors).
  std::function<std::vector<std::string>(const std::filesystem::path&)> check_model;
  /// The fit of each quantised tensor. Null (default): lutb::quantize (the CPU fitters of fit.hpp).
  /// Otherwise it is called exactly as lutb::quantize would be (source, dtype, shape, output, the
  /// FitOptions above with `interrupt` filled in, tensor name) and must honour the same contract:
  /// fill `out`, return the FitStats, throw std::invalid_argument worded "quantize: tensor NAME, ..."
  /// for a data error (NaN / Inf / scale above 246) and Interrupted when stopped. `lutb quantize
  /// --device cuda` passes lutb::cuda::quantize_gpu here (the same bytes; src/cli/gpu.cpp).
  using FitFunction = std::function<FitStats(const void* src, DType src_type, const LutbShape& shape, LutbTensor& out,
                                             const FitOptions& fit, const std::string& name)>;
  FitFunction fit_function;
};

/// Summary of a quantisation run.
struct QuantizeSummary {
  std::int64_t tensors_quantized = 0;  // source weights replaced by LUT-B triples
  std::int64_t tensors_copied = 0;     // everything else
  std::int64_t weights = 0;            // logical weights quantised
  std::uint64_t bytes_before = 0;      // bytes of the quantised source tensors
  std::uint64_t bytes_after = 0;       // bytes of their packed + codebook + scale tensors
  std::uint64_t input_bytes = 0;       // all tensor bytes in
  std::uint64_t output_bytes = 0;      // all tensor bytes out
  FitStats stats;                      // aggregate squared error -> SQNR
  std::string fitter;
  double seconds = 0.0;
  std::uint64_t peak_rss_bytes = 0;    // VmHWM of this process at the end (/proc/self/status)
  /// Files of the input checkpoint directory that were not copied because they hold the weights in
  /// another format or training state (see quantize_checkpoint), and symlinked folders (listed with
  /// a trailing '/'), relative paths, sorted; and the folders .cache/, .huggingface/ (download
  /// caches), .git/ and global_stepN/ (DeepSpeed), at any depth, listed with a trailing '/'. Empty
  /// for quantize_file.
  std::vector<std::string> skipped_files;
  /// Things the caller should tell the user about a checkpoint that was written nonetheless: a
  /// per-expert LUT-B checkpoint whose expert width is not a multiple of 8 (valid, spec 2.2, but
  /// lutb eval / moe cannot run it); a copied *.safetensors file holding tensors of the checkpoint
  /// (unquantised weights in the output); a copied file of 100 MiB or more of unknown purpose; a
  /// quantised tensor that lost at least half of its energy (low_sqnr_warning, quantize_file too).
  /// `lutb quantize` prints them on stderr.
  std::vector<std::string> warnings;
  /// Bits per weight of the quantised tensors: 8 * bytes_after / weights (3.140625 unpadded).
  double bits_per_weight() const { return weights ? 8.0 * static_cast<double>(bytes_after) / weights : 0.0; }
};
/// Human-readable multi-line summary.
std::string format_summary(const QuantizeSummary& s);

/// A warning for a quantised tensor that lost at least half of its energy (sse >= sum_sq / 2, i.e.
/// SQNR <= 3.01 dB, with sum_sq > 0), else "". `where` names the tensor (and file); `method` is the
/// fitter or format name ("ct-lloyd", "int3-g128", ...); `weights` the count behind sse and sum_sq.
/// Typical fits keep 13-15 dB; an all-zero reconstruction is 0 dB. The upstream fitters ct-lloyd and
/// multistart fit no tile scale (scale byte 127, spec 2.1), so their codebook holds only magnitudes
/// 2^-9..448: on weights far outside that range (scaled to 1e-30, or 1e30) every tile is lost or
/// clipped, and the warning says so and names the scaled fitters.
std::string low_sqnr_warning(const std::string& where, double sse, double sum_sq, std::int64_t weights,
                             const std::string& method);

/// Writes the LUT-B checkpoint of spec 2.2 for the checkpoint in `in_dir` into `out_dir`.
/// - Every routed-expert projection (per expert "P.weight" [N, K], or stacked [E, N, K]) of every
///   MoE layer is fitted and replaced by P.weight_packed U8 [N/8, K/64, 192], P.weight_codebook
///   F8_E4M3 [N/8, K/64, 8] and P.weight_scale U8 [N/8, K/64] (stacked: a leading E, names from
///   lutb_names()); N, K padded to the tile with zeros; gate and up are fitted as separate tensors.
/// - Every other tensor is copied bit for bit, in the same shard, in the same order; shard file
///   names are kept and model.safetensors.index.json is rewritten for the new names and sizes. A
///   tensor of a shard that the index does not list is not part of the checkpoint (the readers follow
///   the index): it is not copied (a warning names it), and a routed expert left out is missing.
/// - Every other file of in_dir (tokenizer, generation config, ...) is copied; config.json gains
///   "quantization_config" (see LutbQuantConfig) with logical_shapes for padded tensors. Files that
///   hold the (unquantised) weights in another form are not copied but listed in
///   QuantizeSummary::skipped_files: pytorch_model*.bin, consolidated*.{pth,pt,safetensors}
///   (Meta / Mistral originals), tf_model*.h5, flax_model*.msgpack, the index files of those, and
///   *.gguf (a framework reading them would silently load the unquantised weights); the training
///   state of a checkpoint saved mid-training (transformers' Trainer: optimizer.pt, scheduler.pt,
///   scaler.pt, rng_state*.pth, training_args.bin; Accelerate: optimizer*.bin, scheduler*.bin,
///   random_states_*.pkl); reference_eval.json (the source weights' reference losses, spec section
///   8, which do not describe the LUT-B weights); and the folders .cache/, .huggingface/ and .git/
///   (download caches, version control) and DeepSpeed's global_stepN/. Other files, other *.safetensors data
///   (val_tokens, activations) included, are copied; one of 100 MiB or more that is not
///   *.safetensors is named in a warning; the flag of QuantizeOptions::interrupt is polled per MB
///   while they are.
/// - Streaming: tensors are processed one at a time from the memory-mapped source; the source pages
///   of a tensor are released (madvise) once written, so peak memory is about one stacked tensor's
///   LUT-B output plus one tensor's FP32 staging, independent of the checkpoint size.
/// - Symlinks in in_dir (a Hugging Face cache snapshot links every file to ../../blobs/<sha>): a
///   symlinked file is copied, its contents under the link's own name; the sources are only read.
///   A symlinked folder is not followed; it is left out and listed in skipped_files.
/// - Atomic: everything is written to "<out_dir>.tmp.<pid>" and renamed to out_dir at the end; on
///   any error the temporary directory is removed and out_dir is untouched. An out_dir that appears
///   during the run is not replaced without force (CheckpointError "appeared while the output was
///   being written"), and with force the rules above are applied to it again.
/// Errors: CheckpointError when out_dir exists (without force), equals in_dir, is named *.safetensors,
/// or in_dir is already LUT-B (a LUT-B quantization_config, or LUT-B expert tensors and no float ones),
/// when a routed-expert tensor's shape or expert index contradicts config.json, when a MoE
/// layer's routed experts are incomplete (a MoE layer below num_hidden_layers without them, or
/// one missing any expert's projection or one of the stacked pair), or when a MoE layer's routed experts have a bias tensor ("... LUT-B online MoE
/// quantization does not support bias.", spec 6); ConfigError / SafetensorsError for bad input; std::invalid_argument naming the tensor and
/// tile for NaN/Inf weights and magnitudes needing a scale byte above 246 (from the fitter, prefixed
/// with the source file); CheckpointError for a non-float expert tensor.
QuantizeSummary quantize_checkpoint(const std::filesystem::path& in_dir, const std::filesystem::path& out_dir,
                                    const QuantizeOptions& opt = {});

/// Quantises tensors of one safetensors file: each selected 2-D [N, K] or 3-D [E, N, K] float tensor
/// X becomes X_packed / X_codebook / X_scale (lutb_names: "....weight" -> "....weight_packed"),
/// others are copied bit for bit. Selection: `match` (ECMAScript regex, std::regex_search on the
/// name), or every 2-D/3-D float tensor when `match` is empty. The file's __metadata__ is kept and
/// gains "lutb.quant_method" = "lut_b", "lutb.fitter", and for each padded tensor
/// "lutb.logical_shape.<X>" = "[N, K]" (or "[E, N, K]"). A selected tensor that is not 2-D/3-D float
/// is an error naming it. Atomic via the temporary-name writer; `out` existing is an error unless
/// opt.force, and `out` must end in ".safetensors" (CheckpointError otherwise). Returns the summary.
QuantizeSummary quantize_file(const std::filesystem::path& in, const std::filesystem::path& out,
                              const std::string& match, const QuantizeOptions& opt = {});

// ---------------------------------------------------------------------------
// Synthetic checkpoints (lutb synth)
// ---------------------------------------------------------------------------
/// Options of synthesize_checkpoint.
struct SynthOptions {
  ModelFamily family = ModelFamily::qwen3_moe;
  std::int64_t layers = 1;      // number of MoE layers written
  std::uint64_t seed = 1234;    // deterministic: same options -> same bytes
  double student_nu = 5.0;      // Student-t degrees of freedom of the weights (heavy tails), in (2, 1e6]
  bool stacked = false;         // write transformers-5 stacked gate_up_proj/down_proj tensors
  bool progress = true;
  bool force = false;           // replace an existing out_dir
  /// Override the real shapes (tests): 0 keeps the family's value; negative is an error.
  std::int64_t hidden_size = 0, moe_intermediate_size = 0, num_experts = 0;
  /// As QuantizeOptions::interrupt, polled between blocks of rows (a few MB).
  const InterruptFlag* interrupt = nullptr;
  /// Called once with the tensor bytes that will be written (synth_checkpoint_bytes(opt)) after
  /// every check has passed (options, destination replaceable, free space) and the temporary
  /// output directory was created, just before the first tensor is written; never called on a
  /// refusal. lutb synth prints its "will write N bytes" line here. May be empty.
  std::function<void(std::uint64_t bytes)> on_start;
};

/// The real model a family's synthetic checkpoint imitates (shapes from its published config.json):
///   qwen3_moe   Qwen3-30B-A3B:  H 2048, I 768,  E 128, k 8, norm_topk_prob true
///   qwen2_moe   Qwen1.5-MoE-A2.7B: H 2048, I 1408, E 60, k 4, one shared expert of 5632
///   mixtral     Mixtral-8x7B:   H 4096, I 14336, E 8, k 2
///   deepseek_v3 DeepSeek-V3:    H 7168, I 2048, E 256, k 8, 1 shared expert, sigmoid, 8 groups top-4,
///                               routed_scaling_factor 2.5
///   deepseek_v2 DeepSeek-V2-Lite: H 2048, I 1408, E 64, k 6, 2 shared experts, softmax greedy
///   olmoe       OLMoE-1B-7B:    H 2048, I 1024, E 64, k 8
/// The config written has num_hidden_layers = `layers` and every layer a MoE layer (first_k_dense_replace
/// 0, mlp_only_layers []); it is not a full language model.
ModelConfig synth_config(const SynthOptions& opt);

/// Writes a synthetic checkpoint: config.json and, per layer, only the MoE block (routed experts,
/// router, DeepSeek correction bias, shared experts) in BF16 -- no attention, norms or embeddings.
/// Files: "model.safetensors" for one layer, else one shard per layer
/// "model-0000L-of-0000N.safetensors" with model.safetensors.index.json.
/// Weights are Student-t(nu) (inversion of the exact CDF, tabulated) scaled to standard deviation 1/sqrt(fan_in),
/// the scale of trained projections; the router the same; the DeepSeek correction bias 0.01*t.
/// Deterministic from the seed: each row of each tensor has its own generator seeded by
/// hash(seed, per-expert tensor name, row), so stacked and per-expert layouts hold the same
/// values and results do not depend on the thread count. Streaming: tensors are generated and
/// written a block of rows at a time (memory bounded by a few MB per thread), atomically
/// (temporary directory renamed at the end; an existing out_dir is an error unless force).
/// An empty out_dir is a CheckpointError. Before writing, the free space of out_dir's filesystem (std::filesystem::space of its parent) must
/// exceed synth_checkpoint_bytes(opt), else CheckpointError naming both sizes; nothing is written.
/// Returns the tensor bytes written.
std::uint64_t synthesize_checkpoint(const std::filesystem::path& out_dir, const SynthOptions& opt);

/// The tensor bytes synthesize_checkpoint(opt) writes (safetensors headers and config.json, a few
/// KB per shard, not included). Throws as synth_config for invalid options.
std::uint64_t synth_checkpoint_bytes(const SynthOptions& opt);

/// Peak resident set size of this process (VmHWM of /proc/self/status) in bytes; 0 if unknown.
std::uint64_t peak_rss_bytes();

}  // namespace lutb
