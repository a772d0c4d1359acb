// src/fit/fit.cpp: fitter registry, fit_tile and the bulk quantize entry points (spec section 2.1).
#include "lutb/fit.hpp"

#include <omp.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>
#include <string>

#include "fit/fit_internal.hpp"

namespace lutb {

using namespace fit_detail;

double FitStats::sqnr_db() const {
  if (sse == 0.0) return std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(sum_sq / sse);
}

FitStats& FitStats::operator+=(const FitStats& o) {
  tiles += o.tiles;
  sse += o.sse;
  sum_sq += o.sum_sq;
  return *this;
}

FitStats FitStats::of_tiles(const std::vector<double>& sse, const std::vector<double>& sum_sq) {
  if (sse.size() != sum_sq.size())
    throw std::invalid_argument("FitStats::of_tiles: " + std::to_string(sse.size()) + " sse entries but " +
                                std::to_string(sum_sq.size()) + " sum_sq entries");
  FitStats st;
  st.tiles = static_cast<std::int64_t>(sse.size());
  for (std::size_t t = 0; t < sse.size(); ++t) {
    st.sse += sse[t];
    st.sum_sq += sum_sq[t];
  }
  return st;
}

namespace {
constexpr const char* kNames[] = {"binned-dp", "optimal", "ct-lloyd", "multistart"};
}  // namespace

namespace fit_detail {

Which resolve(std::string_view name) {
  if (name.empty()) return Which::kBinnedDp;
  for (int i = 0; i < 4; ++i)
    if (name == kNames[i]) return static_cast<Which>(i);
  check_fitter_name(name);  // throws
  return Which::kBinnedDp;
}

static std::string position(int f) {
  return "row " + std::to_string(f / kTileCols) + " col " + std::to_string(f % kTileCols);
}

// Checks a tile; returns an empty string when fine, else the reason (without the tile's name).
std::string check_tile(const float* x) {
  float amax = 0.0f;
  for (int f = 0; f < kTileSize; ++f) {
    if (!f32_is_finite(x[f]))
      return std::string(f32_is_nan(x[f]) ? "NaN" : (x[f] > 0 ? "+Inf" : "-Inf")) + " at tile " +
             position(f);
    amax = std::max(amax, std::fabs(x[f]));
  }
  // The shortest decimal that reads back as amax ("3.3e+38", where std::to_string gives
  // "329999996548271212625250308919809540096.000000"). The GPU fitter's message
  // (src/cuda/fit/quantize_gpu.cu) formats it the same way: the tests compare them.
  if (amax != 0.0f && rceil_scale(amax) > kMaxScale) {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof(buf), amax);
    return "magnitude " + std::string(buf, r.ptr) + " needs a scale byte above 246 (spec section 2)";
  }
  return {};
}

// w512: null or the tile's 512 weights; tiles with equal weights are fitted unweighted.
TileFit fit_checked(const float* x, Which w, int forced_scale, const float* w512) {
  if (w512) {
    bool equal = true;
    for (int f = 1; f < kTileSize; ++f) equal = equal && w512[f] == w512[0];
    if (equal) {
      TileFit t = fit_checked(x, w, forced_scale, nullptr);
      t.weighted_sse = w512[0] * t.sse;
      return t;
    }
  }
  switch (w) {
    case Which::kOptimal: return fit_optimal(x, forced_scale, w512);
    case Which::kBinnedDp: return fit_binned_dp(x, forced_scale, w512);
    case Which::kCtLloyd: return fit_ct_lloyd(x);
    case Which::kMultistart: return fit_multistart(x);
  }
  return {};
}

void check_weighted_fitter(const FitOptions& opt, Which w) {
  if (opt.column_weights && (w == Which::kCtLloyd || w == Which::kMultistart))
    throw std::invalid_argument("fitter '" + std::string(kNames[static_cast<int>(w)]) +
                                "' has no weighted objective: column weights (calibration) need binned-dp or optimal");
}

// The 512 per-element weights of tile tk from one expert's column weights cw[cols]: column c of the
// tile weighs cw[64 tk + c]; zero-padded columns take the smallest weight of the logical columns.
void gather_weights(const float* cw, std::int64_t cols, std::int64_t tk, float* w512) {
  const std::int64_t c0 = tk * kTileCols, nc = std::min<std::int64_t>(kTileCols, cols - c0);
  float lo = cw[c0];
  for (std::int64_t c = 1; c < nc; ++c) lo = std::min(lo, cw[c0 + c]);
  for (int r = 0; r < kTileRows; ++r)
    for (int c = 0; c < kTileCols; ++c) w512[r * kTileCols + c] = c < nc ? cw[c0 + c] : lo;
}

void check_forced(const FitOptions& opt, Which w) {
  if (opt.forced_scale < 0) return;
  if (opt.forced_scale < kMinScale || opt.forced_scale > kMaxScale)
    throw std::invalid_argument("forced_scale " + std::to_string(opt.forced_scale) +
                                " is outside the scale bytes 3..246 fitters may choose (spec section 2)");
  if (w == Which::kCtLloyd || w == Which::kMultistart)
    throw std::invalid_argument("fitter '" + std::string(kNames[static_cast<int>(w)]) +
                                "' has no scale (always byte 127, as upstream): forced_scale is not supported");
}

// Gathers tile (tn, tk) of a row-major [rows][cols] matrix of `type` into 512 floats with zero
// padding (tile.hpp's gather_tile for F32/BF16; the same rule for F16).
void gather(const void* src, DType type, std::int64_t rows, std::int64_t cols, std::int64_t tn,
            std::int64_t tk, float* out) {
  if (type == DType::F32) return gather_tile(static_cast<const float*>(src), rows, cols, tn, tk, out);
  if (type == DType::BF16) return gather_tile_bf16(static_cast<const std::uint16_t*>(src), rows, cols, tn, tk, out);
  for (int r = 0; r < kTileRows; ++r) {
    const std::int64_t row = tn * kTileRows + r, c0 = tk * kTileCols;
    const std::int64_t nc = row < rows ? std::clamp<std::int64_t>(cols - c0, 0, kTileCols) : 0;
    // Byte addressing with memcpy loads: a safetensors tensor's data need not be 2-byte aligned.
    const unsigned char* s = static_cast<const unsigned char*>(src) + 2 * (nc > 0 ? row * cols + c0 : 0);
    float* o = out + r * kTileCols;
    for (std::int64_t c = 0; c < nc; ++c) {
      std::uint16_t h;
      std::memcpy(&h, s + 2 * c, 2);
      o[c] = fp16_to_float(h);
    }
    for (std::int64_t c = nc; c < kTileCols; ++c) o[c] = 0.0f;
  }
}

}  // namespace fit_detail

std::vector<std::string> fitter_names() { return {std::begin(kNames), std::end(kNames)}; }

std::string column_weights_error(const float* cw, std::int64_t n) {
  for (std::int64_t c = 0; c < n; ++c)
    if (!(cw[c] > 0.0f) || !f32_is_finite(cw[c])) {
      char buf[32];
      const auto r = std::to_chars(buf, buf + sizeof(buf), cw[c]);
      return "column weight " + std::to_string(c) + " is " + std::string(buf, r.ptr) +
             "; column weights must be finite and > 0";
    }
  return {};
}

std::string default_fitter() { return kNames[0]; }

void check_fitter_name(std::string_view name) {
  for (const char* n : kNames)
    if (name == n) return;
  std::string msg = "unknown fitter '" + std::string(name) + "'; allowed:";
  for (const char* n : kNames) msg += std::string(" ") + n;
  throw std::invalid_argument(msg);
}

TileFit fit_tile(const float* values512, const FitOptions& opt) {
  const Which w = resolve(opt.fitter);
  check_forced(opt, w);
  check_weighted_fitter(opt, w);
  const std::string err = check_tile(values512);
  if (!err.empty()) throw std::invalid_argument("fit_tile: " + err);
  if (!opt.column_weights) return fit_checked(values512, w, opt.forced_scale);
  if (const std::string e = column_weights_error(opt.column_weights, kTileCols); !e.empty())
    throw std::invalid_argument("fit_tile: " + e);
  float w512[kTileSize];
  gather_weights(opt.column_weights, kTileCols, 0, w512);
  return fit_checked(values512, w, opt.forced_scale, w512);
}

namespace {

// ---------------------------------------------------------------------------
// quantize, step by step: check the arguments, fit every tile (in parallel), then report an
// interruption or the first tile that could not be fitted, else the summed statistics.
// ---------------------------------------------------------------------------

// FitOptions::error_feedback: a fitter that takes weights, a finite damping >= 0, and moments that are
// finite with a diagonal >= 0 (only the lower triangle is read).
void check_error_feedback(const LutbShape& shape, const FitOptions& opt, Which w, const std::string& name) {
  if (w == Which::kCtLloyd || w == Which::kMultistart)
    throw std::invalid_argument("quantize: tensor " + name + ": fitter '" + kNames[static_cast<int>(w)] +
                                "' has no weighted objective: error feedback (second moments) needs binned-dp or optimal");
  const double lambda = opt.error_feedback.damping;
  if (!std::isfinite(lambda) || lambda < 0.0) {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof(buf), lambda);
    throw std::invalid_argument("quantize: tensor " + name + ": error feedback damping " + std::string(buf, r.ptr) +
                                "; it must be finite and >= 0");
  }
  const std::int64_t K = shape.cols;
  for (std::int64_t e = 0; e < shape.experts; ++e) {
    const float* C = opt.error_feedback.second_moments + e * K * K;
    for (std::int64_t i = 0; i < K; ++i)
      for (std::int64_t j = 0; j <= i; ++j) {
        const float v = C[i * K + j];
        if (f32_is_finite(v) && (i != j || v >= 0.0f)) continue;
        char buf[32];
        const auto r = std::to_chars(buf, buf + sizeof(buf), v);
        throw std::invalid_argument("quantize: tensor " + name +
                                    (shape.stacked ? ", expert " + std::to_string(e) : std::string()) +
                                    ": second moment [" + std::to_string(i) + "][" + std::to_string(j) + "] is " +
                                    std::string(buf, r.ptr) + "; second moments must be finite, the diagonal >= 0");
      }
  }
}

// The arguments of quantize, each refusal naming the tensor: the source dtype, the shape (and that its
// tile count and packed bytes fit 64 bits), the source pointer, the thread count, the fitter's objective
// and every expert's column weights.
void check_quantize_args(const void* src, DType src_type, const LutbShape& shape, const FitOptions& opt, Which w,
                         const std::string& name) {
  if (src_type != DType::F32 && src_type != DType::BF16 && src_type != DType::F16)
    throw std::invalid_argument("quantize: tensor " + name + " has dtype " + std::string(dtype_name(src_type)) +
                                "; LUT-B fitting reads F32, BF16 or F16");
  if (shape.rows < 0 || shape.cols < 0 || shape.experts < 1 || (!shape.stacked && shape.experts != 1))
    throw std::invalid_argument("quantize: tensor " + name + " has an invalid shape");
  {
    // The tile count and the output's bytes must fit 64 bits: otherwise [2^40, 2^40] wraps to 0 tiles
    // (an empty tensor) and E = 2^63 - 1 fails as "cannot create std::vector larger than max_size()".
    constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
    std::int64_t bytes = 0;
    const bool overflow = shape.rows > kMax - (kTileRows - 1) || shape.cols > kMax - (kTileCols - 1) ||
                          __builtin_mul_overflow(shape.tiles_n(), shape.tiles_k(), &bytes) ||
                          __builtin_mul_overflow(bytes, shape.experts, &bytes) ||
                          __builtin_mul_overflow(bytes, static_cast<std::int64_t>(kPackedBytes), &bytes);
    if (overflow)
      throw std::invalid_argument("quantize: tensor " + name + " has shape [" + std::to_string(shape.experts) + ", " +
                                  std::to_string(shape.rows) + ", " + std::to_string(shape.cols) +
                                  "], too large: its packed bytes overflow 64-bit sizes");
  }
  if (shape.rows > 0 && shape.cols > 0 && src == nullptr)
    throw std::invalid_argument("quantize: tensor " + name + ": null source");
  if (opt.threads < 0)
    throw std::invalid_argument("quantize: tensor " + name + ": FitOptions::threads " + std::to_string(opt.threads) +
                                ": must be >= 0 (0 = all cores)");
  try {
    check_weighted_fitter(opt, w);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument("quantize: tensor " + name + ": " + e.what());
  }
  if (opt.column_weights)
    for (std::int64_t e = 0; e < shape.experts; ++e)
      if (const std::string msg = column_weights_error(opt.column_weights + e * shape.cols, shape.cols); !msg.empty())
        throw std::invalid_argument("quantize: tensor " + name +
                                    (shape.stacked ? ", expert " + std::to_string(e) : std::string()) + ": " + msg);
  if (opt.error_feedback.second_moments) check_error_feedback(shape, opt, w, name);
}

}  // namespace

namespace fit_detail {

static TilePos tile_pos(const LutbShape& shape, std::int64_t t) {
  const std::int64_t tpe = shape.tiles_per_expert(), tk_n = shape.tiles_k();
  return {t / tpe, (t % tpe) / tk_n, t % tk_n};
}

// Fits the tile at `p` of `src` (experts of [rows][cols] `src_type` values), weighted by the expert's
// column weights when opt has them. Throws with the tile check's or the fitter's reason, which names
// the element as "at tile row R col C".
static TileFit fit_source_tile(const void* src, DType src_type, const LutbShape& shape, const FitOptions& opt, Which w,
                        const TilePos& p) {
  const std::size_t expert_bytes = static_cast<std::size_t>(shape.rows * shape.cols) * dtype_size(src_type);
  float x[kTileSize];
  gather(static_cast<const std::uint8_t*>(src) + p.e * expert_bytes, src_type, shape.rows, shape.cols, p.tn, p.tk,
         x);
  if (const std::string err = check_tile(x); !err.empty()) throw std::invalid_argument(err);
  float wt[kTileSize];
  if (opt.column_weights) gather_weights(opt.column_weights + p.e * shape.cols, shape.cols, p.tk, wt);
  return fit_checked(x, w, opt.forced_scale, opt.column_weights ? wt : nullptr);
}

// Stores tile t's fit in `out`.
void store_tile(LutbTensor& out, std::int64_t t, const TileFit& f) {
  std::memcpy(&out.packed[static_cast<std::size_t>(t) * kPackedBytes], f.block.packed, kPackedBytes);
  std::memcpy(&out.codebook[static_cast<std::size_t>(t) * kCodebookSize], f.block.codebook, kCodebookSize);
  out.scale[static_cast<std::size_t>(t)] = f.block.scale;
}

// The message for a tile that could not be fitted: the tensor, the expert (stacked tensors) and the
// tile named, "at tile row R col C" rewritten as the tensor's row and column.
std::string tile_error(const std::string& name, const LutbShape& shape, const TilePos& p, std::string err) {
  const std::string where = "tensor " + name + (shape.stacked ? ", expert " + std::to_string(p.e) : std::string()) +
                            ", tile (" + std::to_string(p.tn) + ", " + std::to_string(p.tk) + ")";
  const auto at = err.find("at tile row ");
  if (at != std::string::npos) {
    int r = 0, c = 0;
    std::sscanf(err.c_str() + at, "at tile row %d col %d", &r, &c);
    err = err.substr(0, at) + "at row " + std::to_string(p.tn * kTileRows + r) + " col " +
          std::to_string(p.tk * kTileCols + c);
  }
  return where + ": " + err;
}

FitStats finish_quantize(const std::string& name, int stopped, std::int64_t done, std::int64_t tiles,
                         const std::string& bad_msg, const std::vector<double>& sse,
                         const std::vector<double>& ssq, LutbTensor& out) {
  if (stopped != 0) {
    out = LutbTensor();
    throw Interrupted(stopped,
                      "quantize: tensor " + name + ": interrupted (flag " + std::to_string(stopped) + ") after " +
                          std::to_string(done) + " of " + std::to_string(tiles) + " tiles",
                      done, tiles);
  }
  if (!bad_msg.empty()) {
    out = LutbTensor();
    throw std::invalid_argument("quantize: " + bad_msg);
  }
  return FitStats::of_tiles(sse, ssq);
}

}  // namespace fit_detail

FitStats quantize(const void* src, DType src_type, const LutbShape& shape, LutbTensor& out,
                  const FitOptions& opt, const std::string& name) {
  const Which w = resolve(opt.fitter);
  check_forced(opt, w);
  check_quantize_args(src, src_type, shape, opt, w, name);
  if (opt.error_feedback.second_moments) return quantize_error_feedback(src, src_type, shape, out, opt, w, name);

  const std::int64_t tiles = shape.tiles();
  out.shape = shape;
  out.packed.assign(static_cast<std::size_t>(tiles) * kPackedBytes, 0);
  out.codebook.assign(static_cast<std::size_t>(tiles) * kCodebookSize, 0);
  out.scale.assign(static_cast<std::size_t>(tiles), kUE8M0One);

  std::vector<double> sse(static_cast<std::size_t>(tiles)), ssq(static_cast<std::size_t>(tiles));
  // The first tile (by index) that could not be fitted, whichever thread met it first.
  std::int64_t bad_tile = std::numeric_limits<std::int64_t>::max();
  std::string bad_msg;
  const int nthreads = opt.threads > 0 ? opt.threads : omp_get_max_threads();
  // Cancellation (FitOptions::interrupt): every thread reads the flag before each tile and skips
  // the rest once it is set; `fitted` marks the tiles done, for the message. Reading the flag does
  // not change what a completed fit computes.
  const InterruptFlag* stop = opt.interrupt;
  std::vector<std::uint8_t> fitted(stop ? static_cast<std::size_t>(tiles) : 0);
  std::atomic<int> stopped_by{0};

#pragma omp parallel for schedule(dynamic, 16) num_threads(nthreads)
  for (std::int64_t t = 0; t < tiles; ++t) {
    if (stop) {
      const int v = stop->load(std::memory_order_relaxed);
      if (v != 0) {
        stopped_by.store(v, std::memory_order_relaxed);
        continue;
      }
      fitted[static_cast<std::size_t>(t)] = 1;
    }
    const TilePos p = tile_pos(shape, t);
    std::string err;
    try {
      const TileFit f = fit_source_tile(src, src_type, shape, opt, w, p);
      store_tile(out, t, f);
      sse[static_cast<std::size_t>(t)] = f.sse;
      ssq[static_cast<std::size_t>(t)] = f.sum_sq;
    } catch (const std::exception& ex) {
      err = ex.what();
    }
    if (!err.empty()) {
      std::string msg = tile_error(name, shape, p, std::move(err));
#pragma omp critical(lutb_fit_error)
      if (t < bad_tile) {
        bad_tile = t;
        bad_msg = std::move(msg);
      }
    }
  }
  const std::int64_t done = std::count(fitted.begin(), fitted.end(), std::uint8_t{1});
  return finish_quantize(name, stopped_by.load(), done, tiles, bad_msg, sse, ssq, out);
}

LutbTensor quantize(const float* src, const LutbShape& shape, const FitOptions& opt, FitStats* stats,
                    const std::string& name) {
  LutbTensor out;
  const FitStats st = quantize(src, DType::F32, shape, out, opt, name);
  if (stats) *stats = st;
  return out;
}

}  // namespace lutb
