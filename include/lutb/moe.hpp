// lutb/moe.hpp: the LUT-B mixture-of-experts layer on the CPU (spec sections 4, 5 and 6).
//
// Contents
//   MoeConfig, ExpertMap        layer shape, expert-parallel routing tables (global -> local ids)
//   RouterConfig, route()       softmax top-k and DeepSeek-V3 sigmoid grouped top-k (spec 5)
//   Experts                     the "apply experts" interface: x[T, H] + top-k ids/weights -> out[T, H]
//     DenseExperts              BF16 weights; ActivationFormat::BF16 = the BF16 reference (spec 4,
//                               last paragraph), ActivationFormat::MXFP8 = the "dequantised" LUT-B
//                               emulation mode (weights dequantised to BF16, exact, spec 2)
//     LutbReferenceExperts      LUT-B emulation, spec section 4 step by step (plain, obviously right)
//     LutbCpuExperts            LUT-B emulation, fast CPU kernel: packed 3.14-bit weights decoded in
//                               the GEMM, tokens grouped by expert, OpenMP, AVX2/AVX-512 dispatch
//     Sm107Experts              holds the weights in the sm_107 native tile layout (sm107_layout.hpp)
//   NativeSupport               probe: can the native Rubin (cc 10.7) kernel run here, and why not
//   set_moe_logger()            pluggable logger (info_once semantics for the fallback reason)
//   RoutedExpertsLayer          the layer's parameters (source BF16/FP16 weights, then LUT-B)
//   LutBOnlineMoEMethod         the seed's online quantisation method (spec 6)
//
// Conventions (all functions below)
//   * Expert weights use the PyTorch / vLLM fused-MoE layout:
//       w13 [E, 2*I, H]: rows 0..I-1 are gate (w1, gate_proj), rows I..2I-1 are up (w3, up_proj)
//       w2  [E, H, I]  : down (w2, down_proj)
//     H = MoeConfig::hidden_size, I = MoeConfig::intermediate_size_per_partition, E = the number
//     of *local* experts (expert parallel: a rank holds only its own experts, in local-id order).
//   * BF16 / FP16 tensors are passed as raw 16-bit patterns (std::uint16_t).
//   * Hidden states and outputs are row-major [T, H] with H = hidden_size columns. Columns at or
//     beyond hidden_size_unpadded are treated as zero on input and written as zero on output
//     (vLLM's padded hidden dimension); likewise intermediate columns at or beyond
//     intermediate_size_per_partition_unpadded are zero (the seed's `_zero_padding`).
//   * Top-k ids are *global* expert ids, int32 [T, k]; weights are FP32 [T, k]. An id that is not
//     local to this rank contributes nothing (the sum over ranks is the caller's all-reduce); an id
//     outside 0..global_experts-1 is an std::out_of_range error naming the token and slot.
//   * Errors: std::invalid_argument for bad configuration or shapes (message names the field and
//     the value), lutb::FormatError for malformed LUT-B data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "lutb/dtype.hpp"
#include "lutb/fit.hpp"
#include "lutb/tile.hpp"

namespace lutb::moe {

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

/// Expert-parallel routing tables: which global experts this rank holds and their local ids
/// (vLLM `_expert_routing_tables`: global -> local map, -1 for experts held elsewhere).
struct ExpertMap {
  int global_experts = 0;
  int ep_rank = 0;
  int ep_size = 1;
  std::vector<std::int32_t> global_to_local;  // [global_experts], -1 = not on this rank
  std::vector<std::int32_t> local_to_global;  // [local experts], ascending global ids

  int local_experts() const { return static_cast<int>(local_to_global.size()); }
  /// Whether global expert `global_id` is held by this rank. global_id must be in
  /// 0..global_experts-1 (the size of global_to_local); any other id throws std::out_of_range naming
  /// the id and the range (it indexed the table unchecked before: undefined behaviour).
  bool is_local(int global_id) const {
    if (global_id < 0 || static_cast<std::size_t>(global_id) >= global_to_local.size())
      throw std::out_of_range("ExpertMap::is_local: expert id " + std::to_string(global_id) + " is outside 0.." +
                              std::to_string(static_cast<long long>(global_to_local.size()) - 1));
    return global_to_local[global_id] >= 0;
  }

  /// vLLM's "linear" placement: rank r holds a contiguous range; the first (E mod ep_size) ranks
  /// hold one expert more: base = E / ep_size, rank r starts at r*base + min(r, E mod ep_size).
  /// Throws std::invalid_argument when ep_size < 1, ep_rank outside 0..ep_size-1 or E < ep_size.
  static ExpertMap linear(int global_experts, int ep_rank = 0, int ep_size = 1);
  /// Arbitrary placement: `local_to_global` lists this rank's experts (distinct, in range, any
  /// order; the local id is the position in the list). Throws std::invalid_argument otherwise.
  static ExpertMap from_list(int global_experts, std::vector<std::int32_t> local_to_global,
                             int ep_rank = 0, int ep_size = 1);
};

/// Activation function of the experts. Only the SiLU-gated MLP exists in the supported families:
/// h = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
enum class Activation : std::uint8_t { SiluGated };

/// Shape and options of one routed-experts layer (vLLM FusedMoEConfig, the fields the seed uses).
struct MoeConfig {
  int global_experts = 0;    // experts of the whole layer (routing range)
  int top_k = 1;             // experts per token
  std::int64_t hidden_size = 0;                              // H (storage width of x, out, w13 K, w2 N)
  std::int64_t intermediate_size_per_partition = 0;          // I (storage width; w13 N = 2I, w2 K = I)
  std::int64_t hidden_size_unpadded = -1;                    // logical H; -1 = hidden_size
  std::int64_t intermediate_size_per_partition_unpadded = -1;  // logical I; -1 = I
  bool has_bias = false;     // LUT-B refuses biased experts (spec 6)
  Activation activation = Activation::SiluGated;
  std::string moe_backend = "auto";  // "auto" or "emulation" (checked by LutBOnlineMoEMethod)
  ExpertMap expert_map;      // empty (global_experts == 0) = ExpertMap::linear(global_experts, 0, 1)

  int local_experts() const { return expert_map.local_experts(); }
  std::int64_t hidden_unpadded() const { return hidden_size_unpadded < 0 ? hidden_size : hidden_size_unpadded; }
  std::int64_t intermediate_unpadded() const {
    return intermediate_size_per_partition_unpadded < 0 ? intermediate_size_per_partition
                                                        : intermediate_size_per_partition_unpadded;
  }
  /// Logical-shape descriptors of the local stacks w13 [E, 2I, H] and w2 [E, H, I] (storage sizes).
  LutbShape w13_shape() const;
  LutbShape w2_shape() const;

  /// Fills expert_map when empty and checks every field: sizes > 0, unpadded <= padded,
  /// 1 <= top_k <= global_experts, expert_map consistent with global_experts. Throws
  /// std::invalid_argument naming the field and value. Returns *this for chaining.
  MoeConfig& finalize();
};

// ---------------------------------------------------------------------------
// Routing (spec section 5)
// ---------------------------------------------------------------------------

enum class ScoringFunc : std::uint8_t { Softmax, Sigmoid };

/// Router parameters.
///   Softmax (Mixtral, Qwen2/3-MoE, OLMoE): p = softmax(logits) in FP32, the k largest (ties to
///     the lower expert index), renormalised to sum 1 when norm_topk_prob (Mixtral: always true),
///     then times routed_scaling_factor (1 for these families).
///   Sigmoid (DeepSeek-V3, Kimi K2): s = sigmoid(logits); choice = s + e_score_correction_bias;
///     experts form n_group equal groups; group score = sum of its top-2 choice scores; keep the
///     topk_group best groups (ties: lower group); the k best choice scores inside them (ties:
///     lower expert); weights = plain s of those, divided by their sum when norm_topk_prob,
///     times routed_scaling_factor.
/// All math in FP32. Output ids are ordered by descending choice score (probability for softmax).
struct RouterConfig {
  ScoringFunc scoring = ScoringFunc::Softmax;
  int num_experts = 0;
  int top_k = 1;
  bool norm_topk_prob = true;
  int n_group = 1;
  int topk_group = 1;
  float routed_scaling_factor = 1.0f;
  /// Throws std::invalid_argument naming the field: num_experts >= 1, 1 <= top_k <= num_experts,
  /// n_group divides num_experts, 1 <= topk_group <= n_group, top_k <= topk_group * experts/group,
  /// and (sigmoid) each group has >= 2 experts.
  void validate() const;
};

/// Routes T tokens. logits: FP32 [T, E]; correction_bias: FP32 [E] (Sigmoid only; nullptr = zeros).
/// Writes ids int32 [T, k] (global expert ids) and weights FP32 [T, k]. A NaN logit routes like
/// -inf (never chosen before a finite score). Throws std::invalid_argument via cfg.validate().
void route(const RouterConfig& cfg, const float* logits, std::int64_t tokens, const float* correction_bias,
           std::int32_t* topk_ids, float* topk_weights);

/// Routing result of route_tokens().
struct Routing {
  std::int64_t tokens = 0;
  int top_k = 0;
  std::vector<std::int32_t> ids;  // [T, k]
  std::vector<float> weights;     // [T, k]
};
Routing route(const RouterConfig& cfg, const std::vector<float>& logits, std::int64_t tokens,
              const float* correction_bias = nullptr);

/// Router logits = x . gate_weight^T, FP32 accumulation of exact products.
/// x: BF16 bits [T, H]; gate_weight: BF16 bits [E, H]; out: FP32 [T, E].
/// round_to_bf16 = true rounds each logit to BF16 (what transformers' nn.Linear in BF16 produces for
/// Mixtral, Qwen2/3-MoE, OLMoE); false keeps FP32 (transformers' DeepSeek-V3 router casts to FP32).
void router_logits_bf16(const std::uint16_t* x, const std::uint16_t* gate_weight, std::int64_t tokens,
                        std::int64_t hidden, int num_experts, bool round_to_bf16, float* out);

// ---------------------------------------------------------------------------
// Experts
// ---------------------------------------------------------------------------

/// Format of the activations entering each expert GEMM.
///   MXFP8: spec section 4 (a = mxfp8_qdq(x) along H; h = mxfp8_qdq(bf16(silu(g)*u)) along I), rceil.
///   BF16 : no MXFP8 steps (x as given; h = bf16(silu(g)*u)).
enum class ActivationFormat : std::uint8_t { MXFP8, BF16 };

/// Hidden states: [tokens, hidden_size] row-major, BF16 bits or FP32.
struct HiddenStates {
  const void* data = nullptr;
  DType dtype = DType::BF16;  // BF16 or F32
  std::int64_t tokens = 0;

  static HiddenStates bf16(const std::uint16_t* p, std::int64_t t) { return {p, DType::BF16, t}; }
  static HiddenStates f32(const float* p, std::int64_t t) { return {p, DType::F32, t}; }
};

/// Top-k routing of the tokens: global ids int32 [tokens, k], weights FP32 [tokens, k].
struct TopK {
  const std::int32_t* ids = nullptr;
  const float* weights = nullptr;
  int k = 0;
};

/// The "apply experts" interface. Implementations are immutable after construction and apply()
/// is safe to call concurrently from several threads.
class Experts {
 public:
  virtual ~Experts();
  /// Short name for logs and reports ("bf16-reference", "lutb-reference", "lutb-cpu", ...).
  virtual std::string name() const = 0;
  const MoeConfig& config() const { return cfg_; }

  /// out = sum_k weight_k * y_{e_k} over this rank's local experts, FP32 [tokens, hidden_size],
  /// overwritten (not accumulated). Expert outputs y are computed per spec section 4 (the
  /// implementation's numerics), the sum runs over slots k = 0..top_k-1 in order.
  /// Throws std::invalid_argument when x.dtype is not BF16/F32 or topk.k != config().top_k,
  /// std::out_of_range for an id outside the global range.
  virtual void apply_f32(const HiddenStates& x, const TopK& topk, float* out) const = 0;

  /// out = bf16(apply_f32(...)), BF16 bits [tokens, hidden_size] (spec section 4, step 6).
  void apply(const HiddenStates& x, const TopK& topk, std::uint16_t* out) const;

  /// Bytes held for expert weights (what really stays resident).
  virtual std::size_t weight_bytes() const = 0;

 protected:
  explicit Experts(MoeConfig cfg);
  MoeConfig cfg_;
};

/// Instruction sets of the vectorised CPU kernels (LutbCpuExperts, DenseExperts):
///   Scalar  portable C++;
///   Avx2    AVX2 + FMA;
///   Avx512  AVX-512 F, VL, BW and VBMI (Ice Lake and later).
/// All three compute the same exact products; only the order of FP32 additions may differ
/// (tests/moe/experts_test.cpp checks each one the machine supports against the golden layer).
enum class CpuIsa : std::uint8_t { Scalar, Avx2, Avx512 };

/// The best instruction set this CPU supports (runtime detection, cached).
CpuIsa best_cpu_isa();
/// "scalar", "avx2" or "avx512".
const char* cpu_isa_name(CpuIsa isa);
/// cpu_isa_name(best_cpu_isa()).
std::string cpu_isa();

/// Experts with 16-bit (BF16 bits) dense weights, FP32 accumulation of exact products.
///   ActivationFormat::BF16  = the BF16 reference of spec section 4 (no MXFP8 steps).
///   ActivationFormat::MXFP8 = the "dequantised" emulation mode: with weights dequantised from
///     LUT-B (exact in BF16), equal to the LUT-B emulation up to FP32 summation order.
/// Weights: w13 BF16 [E_local, 2I, H], w2 BF16 [E_local, H, I] (moved in; sizes checked, throws
/// std::invalid_argument naming the tensor, expected and actual element counts). Multithreaded
/// over (expert, row block), vectorised (runtime AVX2 / AVX-512 dispatch, same driver as the LUT-B
/// kernel), so that it is a fair baseline.
class DenseExperts final : public Experts {
 public:
  /// isa: the instruction set to use, capped at best_cpu_isa() (a request the CPU cannot run
  /// falls back to the best it can; name() says which one runs).
  DenseExperts(MoeConfig cfg, std::vector<std::uint16_t> w13_bf16, std::vector<std::uint16_t> w2_bf16,
               ActivationFormat act = ActivationFormat::BF16, CpuIsa isa = best_cpu_isa());
  std::string name() const override;
  void apply_f32(const HiddenStates& x, const TopK& topk, float* out) const override;
  std::size_t weight_bytes() const override;
  const std::vector<std::uint16_t>& w13() const { return w13_; }
  const std::vector<std::uint16_t>& w2() const { return w2_; }

 private:
  std::vector<std::uint16_t> w13_, w2_;
  ActivationFormat act_;
  CpuIsa isa_;
};

/// LUT-B emulation, reference implementation: spec section 4 step by step, one token and one
/// expert at a time, each weight dequantised with tile.hpp's dequantize_tile. Slow; the oracle
/// the fast kernel and the CUDA backend are tested against.
/// w13: LUT-B stack of logical shape [E_local, 2I, H]; w2: [E_local, H, I] (cfg.w13_shape(),
/// cfg.w2_shape(); throws std::invalid_argument on a mismatch). Validated (FormatError).
class LutbReferenceExperts final : public Experts {
 public:
  LutbReferenceExperts(MoeConfig cfg, LutbTensor w13, LutbTensor w2,
                       ActivationFormat act = ActivationFormat::MXFP8);
  std::string name() const override { return "lutb-reference"; }
  void apply_f32(const HiddenStates& x, const TopK& topk, float* out) const override;
  std::size_t weight_bytes() const override { return w13_.bytes() + w2_.bytes(); }

 private:
  LutbTensor w13_, w2_;
  ActivationFormat act_;
};

/// LUT-B emulation, fast CPU kernel. Weights stay packed (3.140625 bits per weight); inside the
/// GEMM each tile's codebook x 2^(scale-127) is decoded once to 8 FP32 values and weights are
/// gathered by their 3-bit index straight from the packed bytes (AVX2: vpbroadcastd + vpsrlvd +
/// vpermps per 8 weights; AVX-512: vpbroadcastq + vpmultishiftqb + vpermps per 16) and multiplied
/// with the MXFP8-dequantised activations in FP32 (up to 4 tokens per decoded vector). Tokens are
/// grouped by expert; OpenMP over (expert, block of 8-row tiles of ~64K weights) for w13, then for
/// w2; the k-sum runs in slot order. Equal to
/// LutbReferenceExperts up to FP32 summation order. Same shape rules as LutbReferenceExperts.
class LutbCpuExperts final : public Experts {
 public:
  /// isa: as DenseExperts (capped at best_cpu_isa()).
  LutbCpuExperts(MoeConfig cfg, LutbTensor w13, LutbTensor w2, ActivationFormat act = ActivationFormat::MXFP8,
                 CpuIsa isa = best_cpu_isa());
  std::string name() const override;  // "lutb-cpu/<isa>"
  void apply_f32(const HiddenStates& x, const TopK& topk, float* out) const override;
  std::size_t weight_bytes() const override { return w13_.bytes() + w2_.bytes(); }
  const LutbTensor& w13() const { return w13_; }
  const LutbTensor& w2() const { return w2_; }

 private:
  LutbTensor w13_, w2_;
  ActivationFormat act_;
  CpuIsa isa_;
};


/// Which LUT-B emulation implementation to build.
enum class EmulationKernel : std::uint8_t {
  Fast,         // LutbCpuExperts (default)
  Reference,    // LutbReferenceExperts
  Dequantized,  // DenseExperts over dequantised BF16 weights with MXFP8 activations (the seed's mode)
};

/// Builds an emulation Experts from packed LUT-B stacks, e.g. read from a LUT-B checkpoint
/// (spec 2.2; per-expert tensors are stacked in local-id order by the caller).
std::unique_ptr<Experts> make_lutb_experts(const MoeConfig& cfg, LutbTensor w13, LutbTensor w2,
                                           EmulationKernel kernel = EmulationKernel::Fast,
                                           ActivationFormat act = ActivationFormat::MXFP8);

// ---------------------------------------------------------------------------
// Native (Rubin, sm_107) support probe and the native-layout experts
// ---------------------------------------------------------------------------

/// Can the native LUT-B kernel (tcgen05 .decompress_b, compute capability 10.7) run here?
struct NativeSupport {
  bool supported = false;
  std::string reason;  // empty when supported; else e.g. "built without sm_107 support"

  /// Probes the build and the device. This build has no sm_107 code (CUDA 13.0 cannot target it),
  /// so it reports "built without sm_107 support"; a build with it would check for a CUDA device of
  /// compute capability 10.7 and report "no CUDA device with compute capability 10.7" otherwise.
  static NativeSupport probe();
  /// The decision itself, from the facts: whether the build has sm_107 kernels, and the compute
  /// capability of the current CUDA device (major < 0: no CUDA device). Reasons:
  ///   "built without sm_107 support"
  ///   "no CUDA device with compute capability 10.7 (no CUDA device found)"
  ///   "no CUDA device with compute capability 10.7 (device has 9.0)"
  static NativeSupport decide(bool built_with_sm107, int device_major, int device_minor);
};

/// Experts holding their weights in the sm_107 native tile layout (lutb/sm107_layout.hpp). Selected
/// when the native backend is chosen. The tcgen05 kernel cannot be built here, so apply_f32 runs
/// the spec-4 emulation by reading the native layout back tile by tile (so the layout conversion is
/// exercised end to end); on real sm_107 hardware this class is where the native launch goes.
class Sm107Experts final : public Experts {
 public:
  /// w13/w2: LUT-B stacks as for LutbReferenceExperts; converted to the native layout and released.
  Sm107Experts(MoeConfig cfg, const LutbTensor& w13, const LutbTensor& w2);
  std::string name() const override { return "lutb-sm107"; }
  void apply_f32(const HiddenStates& x, const TopK& topk, float* out) const override;
  std::size_t weight_bytes() const override;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// ---------------------------------------------------------------------------
// Logging (pluggable, so tests can capture the fallback reason)
// ---------------------------------------------------------------------------

enum class LogLevel : std::uint8_t { Debug, Info, Warning };
using MoeLogger = std::function<void(LogLevel, std::string_view message)>;

/// Installs the logger (nullptr = default: Info and above to stderr as "[lutb] message").
/// Returns the previous one. Thread-safe.
MoeLogger set_moe_logger(MoeLogger logger);
/// Logs `message` at `level` the first time this exact message is logged in the process (vLLM's
/// logger.info_once); later calls with the same message are dropped.
void log_once(LogLevel level, const std::string& message);
/// Forgets which messages were logged (tests).
void reset_log_once();

// ---------------------------------------------------------------------------
// The layer and the online method (spec section 6)
// ---------------------------------------------------------------------------

enum class Backend : std::uint8_t { Native, Emulation };
std::string_view backend_name(Backend b);  // "native-sm107", "emulation"

/// Parameters of one routed-experts layer, as a model loader fills them (vLLM's FusedMoE module).
/// Before process_weights_after_loading: w13_weight / w2_weight hold the source (BF16 or FP16 bits,
/// `weight_dtype`) in the layout of the file header ([E_local, 2I, H], [E_local, H, I], storage sizes).
/// After: the source vectors are empty with their capacity released, and the quantised weights live
/// in the method's kernel (packed LUT-B, or native layout).
struct RoutedExpertsLayer {
  MoeConfig config;
  DType weight_dtype = DType::BF16;        // BF16 or F16
  std::vector<std::uint16_t> w13_weight;   // [E_local, 2I, H]
  std::vector<std::uint16_t> w2_weight;    // [E_local, H, I]
  bool already_processed = false;          // the seed's _already_called_process_weights_after_loading

  /// Allocates zeroed source weights for `config` (already finalized).
  explicit RoutedExpertsLayer(MoeConfig config, DType weight_dtype = DType::BF16);
  /// Pointer to expert `local` of w13 / w2 (for loaders copying per-expert tensors in).
  std::uint16_t* w13_expert(int local);
  std::uint16_t* w2_expert(int local);
};

/// Options of the online method beyond MoeConfig.
/// A fitter: quantises `src` (element type src_type, logical `shape`) into `out`, like lutb::quantize.
using FitFunction = std::function<FitStats(const void* src, DType src_type, const LutbShape& shape,
                                           LutbTensor& out, const FitOptions& opt, const std::string& name)>;

struct OnlineOptions {
  FitOptions fit;                                       // fitter for w13 and w2 (lutb/fit.hpp)
  FitFunction fit_function;                             // empty = lutb::quantize (fit.hpp); else e.g. a GPU fitter
  EmulationKernel emulation = EmulationKernel::Fast;    // emulation implementation
  ActivationFormat activations = ActivationFormat::MXFP8;
  std::optional<NativeSupport> native_support;          // overrides NativeSupport::probe() (tests)
};

/// Statistics of process_weights_after_loading.
struct QuantizeReport {
  FitStats w13, w2;
  std::size_t source_bytes = 0;     // BF16/FP16 bytes released
  std::size_t quantized_bytes = 0;  // bytes now held by the kernel
};

/// The seed's LutBOnlineMoEMethod: quantises a layer's BF16/FP16 routed experts to LUT-B after
/// loading and picks the backend.
class LutBOnlineMoEMethod {
 public:
  /// Errors (std::invalid_argument), exactly as the seed:
  ///   cfg.has_bias  -> "LUT-B online MoE quantization does not support bias."
  ///   cfg.moe_backend not "auto"/"emulation" ->
  ///     "moe_backend='<value>' is not supported for LUT-B MoE; expected 'auto' or 'emulation'."
  /// Selection: "emulation" -> Emulation (nothing logged); "auto" -> Native iff the native support
  /// probe says supported and hidden_size % 128 == 0 and intermediate_size_per_partition % 128 == 0;
  /// otherwise Emulation, logging once at Info "LUT-B MoE: CPU emulation of Rubin's LUT-B numerics
  /// (native sm_107 path not used: <reason>)" where
  /// reason is the probe's reason, or "hidden and intermediate sizes must be multiples of 128"
  /// when the device is supported but the shape is not.
  explicit LutBOnlineMoEMethod(MoeConfig cfg, OnlineOptions options = {});

  Backend backend() const { return backend_; }
  /// The fallback reason (empty when native or when emulation was requested explicitly).
  const std::string& fallback_reason() const { return reason_; }
  const MoeConfig& config() const { return cfg_; }

  /// Idempotent (a second call returns at once with an empty report): zeroes the padding (rows and
  /// columns at or beyond the unpadded sizes, both halves of w13), quantises w13 and w2 with
  /// options.fit (FitError / std::invalid_argument name "w13_weight"/"w2_weight", expert and tile
  /// on NaN/Inf), converts to the native layout (Native) or keeps packed LUT-B / dequantises
  /// (Emulation, per options.emulation), releases the source vectors (shrink to zero capacity), and
  /// builds the kernel with the layer's routing tables. Throws std::invalid_argument when the
  /// layer's config differs from the method's or the source sizes are wrong.
  QuantizeReport process_weights_after_loading(RoutedExpertsLayer& layer);

  /// Uses already-packed LUT-B weights (a LUT-B checkpoint) instead of quantising: builds the
  /// kernel for the selected backend from w13 [E_local, 2I, H] and w2 [E_local, H, I] and marks the
  /// layer processed (its source vectors are released if any). Throws like the Experts constructors.
  void load_packed(RoutedExpertsLayer& layer, LutbTensor w13, LutbTensor w2);

  /// The kernel built by process_weights_after_loading / load_packed; throws std::logic_error
  /// ("process_weights_after_loading has not run") before.
  const Experts& kernel() const;
  bool ready() const { return kernel_ != nullptr; }

  /// apply through the kernel (see Experts::apply / apply_f32).
  void apply(const HiddenStates& x, const TopK& topk, std::uint16_t* out) const { kernel().apply(x, topk, out); }
  void apply_f32(const HiddenStates& x, const TopK& topk, float* out) const { kernel().apply_f32(x, topk, out); }

 private:
  void build_kernel(RoutedExpertsLayer& layer, LutbTensor w13, LutbTensor w2);
  MoeConfig cfg_;
  OnlineOptions opt_;
  Backend backend_ = Backend::Emulation;
  std::string reason_;
  std::shared_ptr<const Experts> kernel_;
};

}  // namespace lutb::moe
