// lutb/fit.hpp: fitting (quantising) weights to LUT-B (spec section 2.1).
//
// A fitter chooses, per 8x64 tile, a UE8M0 scale s, 8 E4M3 codebook entries and the 512 indices,
// minimising the tile's squared error sum (w - w_hat)^2. Indices always go to the nearest codebook
// entry on the exact dequantised values, ties to the lower index; codebooks are written ascending.
// All fitters are deterministic: the same input gives the same bytes on any thread count and machine.
//
// Fitters (by name, the default first):
//   "binned-dp"   the default: the exact DP of "optimal" on 32 equal-count bins of the sorted values
//                 (plus the 8 extreme values at each end individually), then an exact DP over
//                 windows of +-8 positions around each boundary (re-centred while a boundary sits
//                 on a window edge), at scale rceil(amax) only. Measured 0.012 dB below "optimal"
//                 on the real routed-expert tiles (docs/perf/fitting.md), ~9x faster.
//   "optimal"     exact minimum over codebooks of at most 8 entries from E4M3 * 2^(s-127), with the
//                 scale searched over the values that can matter (src/fit/optimal.cpp says why):
//                 rceil(amax), then downward while a saturation lower bound allows.
//   "ct-lloyd"    compressed-tensors PR #801: farthest-point start + 8 snapped Lloyd iterations, no
//                 scale (byte 127).
//   "multistart"  vLLM PR #51880: three starts x 16 snapped Lloyd iterations, best kept, no scale.
// Scale bytes are always in 3..246 (spec section 2): tiles whose rceil is below 3 use 3 (exact, as
// larger scales never help), tiles needing more than 246 are rejected (std::invalid_argument).
// All-zero tiles get scale 127 and an all-+0 codebook. A codebook repeats its largest entry only
// when fewer than 8 distinct entries are needed (or, for the Lloyd fitters, when upstream's
// snapping merges entries). Errors are sums in double in flat tile order.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "lutb/dtype.hpp"
#include "lutb/tile.hpp"

namespace lutb {

/// Cancellation token of the long operations (quantize() below, and the checkpoint writers of
/// lutb/checkpoint.hpp): the caller keeps it at 0 and stores a nonzero value to ask for a stop, from
/// any thread or from a signal handler (it is lock-free, hence async-signal-safe; the lutb CLI stores
/// the signal number). Operations only read it.
using InterruptFlag = std::atomic<int>;
static_assert(InterruptFlag::is_always_lock_free, "a signal handler may only touch a lock-free atomic");

/// Thrown by an operation that stopped because its InterruptFlag became nonzero. `signal` is the
/// flag's value. When the stop happened inside one tensor's fit, tiles_done and tiles_total say how
/// far it had got (tiles fitted before the stop, of the tensor's tiles); otherwise both are -1.
struct Interrupted : std::runtime_error {
  Interrupted(int sig, const std::string& what, std::int64_t done = -1, std::int64_t total = -1)
      : std::runtime_error(what), signal(sig), tiles_done(done), tiles_total(total) {}
  int signal;
  std::int64_t tiles_done, tiles_total;
};

/// Options of a fit. Default-constructed options select the default fitter on all cores.
struct FitOptions {
  std::string fitter;     // a name from fitter_names(); empty = the default fitter
  /// OpenMP threads of the fit: 0 = all cores (omp_get_max_threads()), N >= 1 = N threads (1 =
  /// single-threaded); the results never depend on it. Negative values are invalid: quantize(),
  /// quantize_checkpoint(), Checkpoint::lutb_experts() (online fit) and LutBOnlineMoEMethod throw
  /// std::invalid_argument for them.
  int threads = 0;
  int forced_scale = -1;  // 3..246 forces this scale byte on every tile (tests, research); -1 = free.
                          // Only "optimal" and "binned-dp" have a scale: the Lloyd fitters reject it.
  /// Cancellation (null: none). quantize() reads it before every tile, on every thread; once it
  /// reads nonzero the remaining tiles are skipped (the stop takes about one tile's fit per thread:
  /// well under a millisecond for "binned-dp", a few for "optimal"), `out` is left empty and
  /// Interrupted is thrown: "quantize: tensor NAME: interrupted (flag V) after K of N tiles" with
  /// signal V, tiles_done K, tiles_total N. A fit that completes is unaffected: same bytes, same
  /// statistics. fit_tile() does not read it.
  const InterruptFlag* interrupt = nullptr;
  /// Column weights d_c > 0 of the weighted objective sum d_c (w_rc - w_hat_rc)^2 (null: unweighted,
  /// d_c = 1). For a projection y = W x, d_c = E[x_c^2] over the tokens it sees makes this the
  /// diagonal part of the output error E[(dW x)^2] (issue 25; lutb/calibration.hpp builds them).
  /// quantize(): float32 [experts][cols] (one row per expert of the logical shape, row-major);
  /// fit_tile(): float32 [64], the tile's columns. Rows share their column's weight. Every value
  /// must be finite and > 0 (std::invalid_argument naming the tensor, expert and column otherwise).
  /// A tile whose weights are all equal is fitted unweighted (the objective is the same up to a
  /// constant factor), so constant weights give exactly the unweighted bytes; zero-padded columns
  /// (cols not a multiple of 64) take the smallest weight of the tile's logical columns. Only
  /// "optimal" and "binned-dp" minimise a weighted objective: the Lloyd fitters reject weights.
  /// The GPU fitters take the same weights (lutb/cuda/fit.hpp GpuFitOptions::column_weights) and
  /// give the same bytes.
  const float* column_weights = nullptr;
  /// Cross-column error feedback (GPTQ, Frantar et al. 2022, within LUT-B's tiles; docs/calibration.md,
  /// "Cross-column error feedback"). quantize() only: the feedback crosses tiles, so fit_tile()
  /// ignores it. See ErrorFeedback.
  struct ErrorFeedback {
    /// Null: no feedback (every tile fitted on its own, the bytes of the plain or column-weighted fit).
    /// Else the second moments C_e = E[x x^T] of each expert's input, float32 [experts][cols][cols]
    /// (row-major, logical cols; lutb/calibration.hpp's CalibrationStats::second_moments gives them
    /// blended with the layer by token count). Only the lower triangle is read (C is symmetric).
    /// Every value must be finite and every diagonal value >= 0 (std::invalid_argument naming the
    /// tensor, expert, row and column otherwise).
    const float* second_moments = nullptr;
    /// lambda of H = C_e + lambda * mean(diag C_e) * I (GPTQ's dampening): finite and >= 0. With
    /// lambda = 0 a singular C_e is refused (not positive definite).
    double damping = 0.01;
  };
  /// With error_feedback.second_moments, quantize() fits each expert over K in blocks of 64 columns
  /// (one tile column span): the block's tiles get codebook and scale from the fitter (with
  /// column_weights as above) on the current, error-updated weights; then column by column each
  /// weight takes its tile's nearest entry, and its error divided by U[c][c] is fed back, times
  /// U[c][j], into every later column j (U the upper Cholesky factor of H^-1). An expert with
  /// mean(diag C_e) == 0 (no signal at all) is fitted without feedback. Needs "binned-dp" or
  /// "optimal". Deterministic: the strips of 8 rows are independent and each is computed by one
  /// thread in a fixed order. The GPU fitters do not take it (lutb/cuda/fit.hpp).
  ErrorFeedback error_feedback;
};

/// Result of fitting one tile.
struct TileFit {
  TileBlock block;     // packed indices, ascending codebook, scale
  double sse = 0.0;    // sum over the 512 values of (w - w_hat)^2, in double
  double sum_sq = 0.0; // sum of w^2
  /// The fit's objective: sum over the 512 values of d_c (w - w_hat)^2 with the column weights d_c
  /// of FitOptions::column_weights, in double in flat order; == sse for an unweighted fit.
  double weighted_sse = 0.0;
};

/// Aggregate error of a bulk fit.
struct FitStats {
  std::int64_t tiles = 0;
  double sse = 0.0;     // total squared error
  double sum_sq = 0.0;  // total squared weight
  /// 10*log10(sum_sq / sse); +inf when sse == 0.
  double sqnr_db() const;
  FitStats& operator+=(const FitStats& o);
  /// The stats of a bulk fit from its per-tile sse and sum_sq (equal sizes, one entry per tile),
  /// summed in tile order: the CPU and GPU fitters report the same doubles for the same tiles.
  static FitStats of_tiles(const std::vector<double>& sse, const std::vector<double>& sum_sq);
};

/// Names of all fitters, the default first.
std::vector<std::string> fitter_names();
/// Name of the default fitter.
std::string default_fitter();
/// Throws std::invalid_argument naming `name` and the allowed names when it is not a fitter.
void check_fitter_name(std::string_view name);

/// The rule of FitOptions::column_weights on n weights cw[0..n): "" when every one is finite and
/// > 0, else the reason for the first bad one: "column weight C is X; column weights must be finite
/// and > 0" (X the shortest decimal that reads back as the value). quantize() and the GPU fitters
/// (lutb/cuda/fit.hpp) word their errors with it.
std::string column_weights_error(const float* cw, std::int64_t n);

/// Fits one tile of 512 FP32 values in flat tile order (f = r*64 + c), weighted by
/// opt.column_weights[0..64) when set.
/// Throws std::invalid_argument if a value is NaN or +-Inf ("NaN at tile row r col c"), if the
/// tile's magnitude needs a scale byte above 246 (spec section 2), for an unknown fitter name, an
/// invalid forced_scale or invalid column weights. Thread-safe (each call uses only thread-local scratch).
TileFit fit_tile(const float* values512, const FitOptions& opt = {});

/// Fits a 2-D weight [rows][cols] or an expert stack [experts][rows][cols] (row-major, logical
/// shape; padding is zero-filled, spec section 2) of element type `src_type` (F32, BF16 or F16).
/// Writes into `out`, which is (re)allocated for `shape` (layout of LutbTensor). `name` is used in
/// error messages ("tensor X, expert e, tile (tn, tk): NaN at row r col c", row/col of the logical
/// matrix); with several bad tiles the first in storage order is reported, and `out` is left empty.
/// Multithreaded over tiles (OpenMP, opt.threads); the bytes and the returned FitStats (summed in
/// tile order) do not depend on the thread count. Memory: the output plus 16 bytes per tile (17
/// with opt.interrupt). Cancellable through opt.interrupt (see FitOptions); a stop takes precedence
/// over a bad tile found before it. With opt.error_feedback.second_moments (FitOptions): the block
/// loop described there, parallel over strips of 8 rows (a tile row) of every expert, the same
/// errors for bad source values, and also "tensor X, expert e: ... not positive definite" for
/// moments whose H has no Cholesky factor; memory: the output, the experts' U in double (8 cols^2
/// bytes each) and 8 rows of double per thread.
FitStats quantize(const void* src, DType src_type, const LutbShape& shape, LutbTensor& out,
                  const FitOptions& opt = {}, const std::string& name = "weight");

/// Convenience: FP32 source, returns the tensor.
LutbTensor quantize(const float* src, const LutbShape& shape, const FitOptions& opt = {},
                    FitStats* stats = nullptr, const std::string& name = "weight");

}  // namespace lutb
