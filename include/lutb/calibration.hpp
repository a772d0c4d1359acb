// lutb/calibration.hpp: calibration statistics of the routed experts and the column weights of the
// weighted fit they give (issue 25).
//
// For one output row of a projection y = W x, the output error of a weight error dW is
// E[(dW x)^2] = dW^T C dW with C = E[x x^T] over the tokens that reach the projection. Its diagonal
// d_c = E[x_c^2] (one importance per input column) turns each tile's objective into
// sum d_c (w_rc - w_hat_rc)^2, which the DP fitters minimise exactly (FitOptions::column_weights).
//
// The statistics file (`lutb calibrate -o STATS.safetensors`, read by `lutb quantize/eval
// --calibration`) is an ordinary safetensors file, every tensor F32, per MoE layer with experts
// under PREFIX (the checkpoint's own, e.g. "model.layers.1.mlp.experts", Mixtral
// "model.layers.1.block_sparse_moe.experts") and expert e:
//   PREFIX.e.gate_up.x2  [hidden_size]            E[x_c^2] of the expert's input (gate and up share it)
//   PREFIX.e.down.x2     [moe_intermediate_size]  E[h_c^2] of down's input h = bf16(silu(g) * u)
//   PREFIX.e.tokens      [1]                      tokens routed to the expert (0: both x2 are 0)
// and, with `lutb calibrate --full-moments` (the full second moments of cross-column error feedback,
// FitOptions::error_feedback), for every expert of every layer:
//   PREFIX.e.gate_up.xxT [hidden_size, hidden_size]                       E[x x^T] of gate/up's input
//   PREFIX.e.down.hhT    [moe_intermediate_size, moe_intermediate_size]   E[h h^T] of down's input
// The means are over the tokens routed to the expert (each token once per expert that takes it).
// Metadata: "format" = "lutb-calibration", "model", "tokens_file", "tokens", "down_input",
// "token_weight". Every value is finite; x2, tokens and the diagonals of the full moments are >= 0.
// The diagonal of xxT is x2 up to the rounding of its sums (a blocked product in double).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "lutb/tile.hpp"

namespace lutb {

/// Statistics of one MoE layer's routed experts.
struct LayerCalibration {
  std::string prefix;               // tensor-name prefix of the layer's experts, e.g. "model.layers.1.mlp.experts"
  std::int64_t experts = 0, hidden = 0, intermediate = 0;
  std::vector<float> gate_up_x2;    // [experts][hidden]: E[x_c^2] of the input of gate/up (w13)
  std::vector<float> down_x2;       // [experts][intermediate]: E[h_c^2] of the input of down (w2)
  std::vector<float> tokens;        // [experts]: tokens routed to each expert
  /// The full second moments (lutb calibrate --full-moments): [experts][hidden][hidden] E[x x^T] and
  /// [experts][intermediate][intermediate] E[h h^T]. Empty when not gathered, and after load(), which
  /// only checks their names, dtypes and shapes: CalibrationStats::second_moments() reads them from the
  /// file a layer at a time (hidden^2 floats per expert: they stay out of memory until a fit needs them).
  std::vector<float> gate_up_xxT, down_hhT;
  bool full_moments = false;        // the layer has them (in memory, or in the file load() read)
};

/// Which projection's input: gate/up (w13, hidden_size columns) or down (w2, intermediate columns).
enum class CalibratedInput { kGateUp, kDown };

/// The layer mean M_layer of CalibrationStats::second_moments() (one layer and input, cols^2 doubles),
/// kept between calls by the caller. A checkpoint that stores each expert apart has E tensors per
/// projection, fitted one after another: with one cache, second_moments_for_tensor() reads the
/// layer's E expert moments once for them instead of once per tensor (E^2 reads per layer). Valid
/// for the CalibrationStats that filled it while its layers are unchanged; one per thread.
struct SecondMomentsCache {
  int layer = -1;  // -1: empty
  CalibratedInput input = CalibratedInput::kGateUp;
  double n_total = 0.0;      // sum_e n_e (0: no token reached the layer)
  std::vector<double> mean;  // M_layer [cols][cols]
};

/// The rule for rarely routed experts (issue 25): an expert's statistics are blended with the
/// layer's by token count,
///     d_e = (n_e * m_e + n0 * m_layer) / (n_e + n0),   m_layer = sum_e n_e m_e / sum_e n_e,
/// so an expert that no calibration token reaches (n_e = 0) takes the layer's statistics and one
/// with n_e >> n0 keeps its own. Then d_e is divided by its mean over the columns (the fit only
/// sees ratios) and raised to at least kMinRelativeWeight (a column that never carried signal in
/// calibration may carry some later; a zero weight would also leave the DP a run of weight 0).
/// A layer without any calibration token (sum n_e = 0) gives all-ones weights: the unweighted fit.
inline constexpr double kPriorTokens = 32.0;
inline constexpr double kMinRelativeWeight = 1e-3;

/// Calibration statistics of a whole model.
class CalibrationStats {
 public:
  /// Layers by layer index.
  std::map<int, LayerCalibration> layers;
  std::map<std::string, std::string> metadata;
  std::string source;  // the file load() read, for messages ("" when built in memory)

  /// Reads a statistics file (format above). Throws std::runtime_error naming the file: for a file
  /// of another kind (a metadata "format" other than "lutb-calibration", such as a checkpoint's "pt"),
  /// and, naming the tensor too, for a name outside the pattern (a file without "format" is read by
  /// its names), a missing or ill-shaped tensor, a dtype other than F32, a negative or non-finite value.
  static CalibrationStats load(const std::filesystem::path& file);
  /// Writes the file atomically (a temporary name, renamed when complete; an existing file is
  /// replaced), with "format" = "lutb-calibration" added to the metadata. Refuses, before anything is
  /// written, what check() refuses ("FILE: " + its message + "; nothing written"). Throws
  /// std::runtime_error naming `file` (never the temporary) when the write fails: "FILE: cannot write
  /// the calibration statistics (REASON); nothing was created at FILE" (or "FILE is as it was").
  /// The parent directory must exist.
  void save(const std::filesystem::path& file) const;

  /// Checks what save() writes: per layer, gate_up_x2 of experts x hidden values, down_x2 of experts x
  /// intermediate and tokens of experts, all finite and >= 0; with full moments in memory,
  /// gate_up_xxT of experts x hidden^2 and down_hhT of experts x intermediate^2 values, finite with a
  /// diagonal >= 0 ("..., expert E, gate_up.xxT [i][j] is NaN; ..."). Throws std::runtime_error for the first
  /// offence, layer by layer, expert by expert, gate_up.x2 before down.x2 before tokens:
  /// "the calibration statistics of layer L (PREFIX), expert E, gate_up.x2 column C is NaN; statistics
  /// are finite and >= 0" (NaN, +Inf, -Inf or the negative value), or "... of layer L (PREFIX),
  /// down.x2 holds N values, expected experts x intermediate = E x I".
  void check() const;

  /// Column weights [experts][cols] of one layer's projection input after the rule above: finite,
  /// >= kMinRelativeWeight, mean 1 per expert (or all 1). Throws std::runtime_error when the layer
  /// has no statistics.
  std::vector<float> column_weights(int layer, CalibratedInput input) const;

  /// Column weights for a routed-expert tensor of a checkpoint as `lutb quantize` fits it, by name:
  /// per-expert PREFIX.e.{gate_proj,up_proj,w1,w3}.weight -> gate/up of expert e, PREFIX.e.
  /// {down_proj,w2}.weight -> down of expert e; stacked PREFIX.gate_up_proj / PREFIX.down_proj -> all
  /// experts. `cols` is the tensor's column count, checked against the statistics. nullopt when the
  /// name is under no layer's prefix; throws std::runtime_error (naming `file_for_errors`, the tensor
  /// and the shapes) for an expert tensor the statistics do not fit.
  std::optional<std::vector<float>> weights_for_tensor(const std::string& name, std::int64_t experts,
                                                       std::int64_t cols, const std::string& file_for_errors) const;

  /// Whether every layer has the full second moments (`lutb calibrate --full-moments`).
  bool has_second_moments() const;
  /// Second moments [n][cols][cols] (float32, both triangles) of experts e0..e0+n of one layer's
  /// projection input, blended with the layer by token count as column_weights() blends the
  /// diagonal: C_e = (n_e M_e + kPriorTokens M_layer) / (n_e + kPriorTokens), M_layer = sum_e n_e M_e /
  /// sum_e n_e, in double. An expert no token reaches takes the layer's moments; a layer no token
  /// reaches gives zeros (FitOptions::error_feedback then fits without feedback, as column_weights()
  /// gives the unweighted fit). Reads the layer from the file when they are not in memory (memory:
  /// cols^2 doubles for the layer sum and the n experts' floats). Throws std::runtime_error naming the
  /// file and the tensor: no full moments, a dtype other than F32, a shape other than [cols, cols], a
  /// value that is not finite or a negative diagonal.
  /// With `cache` (see SecondMomentsCache), the layer's M_layer is taken from it when it holds this
  /// layer and input, else computed and stored there: only the n experts' moments are read.
  std::vector<float> second_moments(int layer, CalibratedInput input, std::int64_t e0, std::int64_t n,
                                    SecondMomentsCache* cache = nullptr) const;
  /// second_moments() for a routed-expert tensor, by name as weights_for_tensor() finds it (the same
  /// errors for a tensor the statistics do not fit); nullopt when the name is under no layer's prefix.
  std::optional<std::vector<float>> second_moments_for_tensor(const std::string& name, std::int64_t experts,
                                                              std::int64_t cols, const std::string& file_for_errors,
                                                              SecondMomentsCache* cache = nullptr) const;
};

}  // namespace lutb
