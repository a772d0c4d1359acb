// src/fit/error_feedback.cpp: quantize() with cross-column error feedback (GPTQ, Frantar et al. 2022,
// within LUT-B's tiles; FitOptions::error_feedback, docs/calibration.md "Cross-column error feedback").
//
// For one output row w of an expert projection with input second moment C = E[x x^T], the output error
// of a weight error d is d^T C d. GPTQ quantises the columns one at a time and moves each column's
// error onto the columns not yet quantised, so that the remaining columns compensate for it under H:
// with U the upper Cholesky factor of H^-1 (H^-1 = U^T U), column c's error e_c = (w_c - q_c) / U[c][c]
// is subtracted, times U[c][j], from every later column j. LUT-B adds the tile: the 64 columns of one
// tile column span share a codebook and a scale per 8 rows, so the codebooks of a span are fitted
// (by the tile fitter, with the column weights) on the span's current, error-updated values when the
// span begins, and inside the span each value only chooses its nearest entry.
//
// What holds:
//  - Rows do not interact: the update of row r depends only on row r's own errors. A strip of 8 rows
//    (one tile row) with its tile fits is therefore independent of every other strip, and each strip
//    is computed by one thread, columns in order, rows in order: the bytes do not depend on the
//    thread count.
//  - All arithmetic is double with a fixed order (src/fit is compiled with -ffp-contract=off); the
//    values handed to the tile fitter are the current values rounded to FP32.
//  - Nearest entry uses the exact midpoint rule of assign_sse (src/fit/tile_common.cpp), ties to the
//    lower index: without feedback (U diagonal, or an expert with no signal) every value is its source
//    value and the bytes are those of the fit without error feedback.
//  - U is computed without forming H^-1: with P the reversal of the columns and P H P = M M^T
//    (lower Cholesky factor M), H^-1 = (P M^-1 P)^T (P M^-1 P) and P M^-1 P is upper triangular with a
//    positive diagonal, hence the upper Cholesky factor of H^-1. Cost per expert: K^3 / 3 for M and
//    K^3 / 6 for its inverse (K = cols), K^2 doubles of memory.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "fit/fit_internal.hpp"

namespace lutb::fit_detail {
namespace {

// The upper Cholesky factor U [K][K] of H^-1, H = C + lambda * mean(diag C) * I, from C's lower
// triangle. Empty when mean(diag C) == 0 (an expert without signal: no feedback). Throws
// std::invalid_argument("... not positive definite ...") when H has no Cholesky factor.
std::vector<double> inverse_cholesky_upper(const float* C, std::int64_t K, double lambda, std::string& error) {
  const auto at = [K](std::int64_t i, std::int64_t j) { return static_cast<std::size_t>(i * K + j); };
  double mean = 0.0;
  for (std::int64_t i = 0; i < K; ++i) mean += C[i * K + i];
  mean /= static_cast<double>(K);
  if (!(mean > 0.0)) return {};
  const double damp = lambda * mean;
  // A = P H P (lower triangle), A[i][j] = H[K-1-i][K-1-j]; H's lower triangle is C[max][min].
  std::vector<double> M(static_cast<std::size_t>(K * K), 0.0);
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = 0; j <= i; ++j) {
      const std::int64_t hi = K - 1 - j, hj = K - 1 - i;  // hi >= hj: H's lower triangle
      M[at(i, j)] = static_cast<double>(C[hi * K + hj]) + (i == j ? damp : 0.0);
    }
  // In-place lower Cholesky factor, column by column (Cholesky-Banachiewicz order by rows).
  for (std::int64_t i = 0; i < K; ++i) {
    for (std::int64_t j = 0; j <= i; ++j) {
      double s = M[at(i, j)];
      for (std::int64_t k = 0; k < j; ++k) s -= M[at(i, k)] * M[at(j, k)];
      if (i == j) {
        if (!(s > 0.0) || !std::isfinite(s)) {
          char b1[32], b2[32];
          const auto r1 = std::to_chars(b1, b1 + sizeof(b1), lambda), r2 = std::to_chars(b2, b2 + sizeof(b2), s);
          error = "the second moments plus damping (H = C + " + std::string(b1, r1.ptr) +
                  " * mean(diag C) * I) are not positive definite (Cholesky pivot of column " +
                  std::to_string(K - 1 - i) + " is " + std::string(b2, r2.ptr) + "); raise the damping";
          return {};
        }
        M[at(i, i)] = std::sqrt(s);
      } else {
        M[at(i, j)] = s / M[at(j, j)];
      }
    }
  }
  // Minv = M^-1 (lower), by forward substitution on the columns of the identity.
  std::vector<double> Minv(static_cast<std::size_t>(K * K), 0.0);
  for (std::int64_t j = 0; j < K; ++j) {
    Minv[at(j, j)] = 1.0 / M[at(j, j)];
    for (std::int64_t i = j + 1; i < K; ++i) {
      double s = 0.0;
      for (std::int64_t k = j; k < i; ++k) s += M[at(i, k)] * Minv[at(k, j)];
      Minv[at(i, j)] = -s / M[at(i, i)];
    }
  }
  // U = P Minv P: U[i][j] = Minv[K-1-i][K-1-j], upper triangular.
  std::vector<double> U(static_cast<std::size_t>(K * K), 0.0);
  for (std::int64_t i = 0; i < K; ++i)
    for (std::int64_t j = i; j < K; ++j) U[at(i, j)] = Minv[at(K - 1 - i, K - 1 - j)];
  return U;
}

// The nearest entry of an ascending codebook of 8 dequantised values (duplicates of the largest at
// the end), ties to the lower index: the rule of assign_sse for a double value. The midpoints of two
// E4M3 * 2^(s-127) values are exact in FP32 (assign_sse says why), so the comparisons are exact.
struct Nearest {
  float val[kCodebookSize];
  float mid[kCodebookSize];
  std::uint8_t pos[kCodebookSize];
  int runs = 0;

  explicit Nearest(const float* cb) {
    for (int j = 0; j < kCodebookSize; ++j)
      if (runs == 0 || cb[j] != val[runs - 1]) {
        val[runs] = cb[j];
        pos[runs] = static_cast<std::uint8_t>(j);
        if (runs > 0) mid[runs - 1] = 0.5f * val[runs - 1] + 0.5f * cb[j];
        ++runs;
      }
  }
  int run(double x) const {
    int r = 0;
    for (int k = 0; k + 1 < runs; ++k) r += x > static_cast<double>(mid[k]) ? 1 : 0;
    return r;
  }
};

// The fit of one strip (expert e, tile row tn): every tile (tn, 0..tiles_k) stored in `out`, the
// tiles' sse and sum of squares against the source in sse[] / ssq[] (tile order). `U` empty: no
// feedback. Throws std::invalid_argument with tile_error's message.
void fit_strip(const void* src, DType src_type, const LutbShape& shape, const FitOptions& opt, Which w,
               const std::string& name, std::int64_t e, std::int64_t tn, const std::vector<double>& U,
               LutbTensor& out, double* sse, double* ssq) {
  const std::int64_t K = shape.cols, TK = shape.tiles_k(), KP = TK * kTileCols;
  const std::int64_t rows_here = std::clamp<std::int64_t>(shape.rows - tn * kTileRows, 0, kTileRows);
  const std::size_t expert_bytes = static_cast<std::size_t>(shape.rows * shape.cols) * dtype_size(src_type);
  const void* src_e = static_cast<const std::uint8_t*>(src) + e * expert_bytes;
  // The strip's source values (zero-padded) and its current, error-updated values, [8][KP].
  std::vector<float> x0(static_cast<std::size_t>(kTileRows * KP));
  std::vector<double> cur(static_cast<std::size_t>(kTileRows * KP));
  for (std::int64_t tk = 0; tk < TK; ++tk) {
    float x[kTileSize];
    gather(src_e, src_type, shape.rows, shape.cols, tn, tk, x);
    if (const std::string err = check_tile(x); !err.empty())
      throw std::invalid_argument(tile_error(name, shape, {e, tn, tk}, err));
    for (int r = 0; r < kTileRows; ++r)
      for (int c = 0; c < kTileCols; ++c) x0[static_cast<std::size_t>(r * KP + tk * kTileCols + c)] = x[r * kTileCols + c];
  }
  for (std::size_t i = 0; i < x0.size(); ++i) cur[i] = x0[i];
  const bool feedback = !U.empty();
  const double* Ud = U.data();
  for (std::int64_t tk = 0; tk < TK; ++tk) {
    const std::int64_t c0 = tk * kTileCols, nc = std::min<std::int64_t>(kTileCols, K - c0);
    float x[kTileSize];
    for (int r = 0; r < kTileRows; ++r)
      for (int c = 0; c < kTileCols; ++c)
        x[r * kTileCols + c] = static_cast<float>(cur[static_cast<std::size_t>(r * KP + c0 + c)]);
    if (const std::string err = check_tile(x); !err.empty())
      throw std::invalid_argument(tile_error(name, shape, {e, tn, tk}, err + " after error feedback"));
    float wt[kTileSize];
    if (opt.column_weights) gather_weights(opt.column_weights + e * K, K, tk, wt);
    TileFit f = fit_checked(x, w, opt.forced_scale, opt.column_weights ? wt : nullptr);
    float deq[kCodebookSize];
    for (int j = 0; j < kCodebookSize; ++j) deq[j] = ldexp_ue8m0(e4m3_to_float(f.block.codebook[j]), f.block.scale);
    const Nearest near(deq);
    std::uint8_t idx[kTileSize];
    for (int c = 0; c < kTileCols; ++c) {
      const std::int64_t col = c0 + c;
      const bool fed = feedback && c < nc;
      for (int r = 0; r < kTileRows; ++r) {
        double* row = cur.data() + r * KP;
        const int run = near.run(row[col]);
        idx[r * kTileCols + c] = near.pos[run];
        if (!fed || r >= rows_here) continue;
        // The error moves onto every later logical column, in column order.
        const double err = (row[col] - static_cast<double>(near.val[run])) / Ud[col * K + col];
        const double* u = Ud + col * K;
        for (std::int64_t j = col + 1; j < K; ++j) row[j] -= err * u[j];
      }
    }
    for (int g = 0; g < kTileSize / 8; ++g) pack8(idx + 8 * g, f.block.packed + 3 * g);
    // Statistics against the source, as encode_tile sums them (double, flat tile order).
    double s = 0.0, q = 0.0;
    for (int r = 0; r < kTileRows; ++r)
      for (int c = 0; c < kTileCols; ++c) {
        const double v = x0[static_cast<std::size_t>(r * KP + c0 + c)];
        const double d = v - static_cast<double>(deq[idx[r * kTileCols + c]]);
        s += d * d;
        q += v * v;
      }
    const std::int64_t t = (e * shape.tiles_n() + tn) * TK + tk;
    store_tile(out, t, f);
    sse[t] = s;
    ssq[t] = q;
  }
}

}  // namespace

FitStats quantize_error_feedback(const void* src, DType src_type, const LutbShape& shape, LutbTensor& out,
                                 const FitOptions& opt, Which w, const std::string& name) {
  const std::int64_t tiles = shape.tiles(), E = shape.experts, TN = shape.tiles_n(), TK = shape.tiles_k();
  const std::int64_t K = shape.cols;
  out.shape = shape;
  out.packed.assign(static_cast<std::size_t>(tiles) * kPackedBytes, 0);
  out.codebook.assign(static_cast<std::size_t>(tiles) * kCodebookSize, 0);
  out.scale.assign(static_cast<std::size_t>(tiles), kUE8M0One);
  const int nthreads = opt.threads > 0 ? opt.threads : omp_get_max_threads();

  // U of every expert (in parallel over experts; each is computed by one thread).
  std::vector<std::vector<double>> U(static_cast<std::size_t>(E));
  std::vector<std::string> u_err(static_cast<std::size_t>(E));
  if (shape.rows > 0 && K > 0) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (std::int64_t e = 0; e < E; ++e)
      U[static_cast<std::size_t>(e)] = inverse_cholesky_upper(opt.error_feedback.second_moments + e * K * K, K,
                                                               opt.error_feedback.damping,
                                                               u_err[static_cast<std::size_t>(e)]);
  }
  for (std::int64_t e = 0; e < E; ++e)
    if (!u_err[static_cast<std::size_t>(e)].empty()) {
      out = LutbTensor();
      throw std::invalid_argument("quantize: tensor " + name +
                                  (shape.stacked ? ", expert " + std::to_string(e) : std::string()) + ": " +
                                  u_err[static_cast<std::size_t>(e)]);
    }

  std::vector<double> sse(static_cast<std::size_t>(tiles)), ssq(static_cast<std::size_t>(tiles));
  const std::int64_t strips = E * TN;
  std::int64_t bad_strip = std::numeric_limits<std::int64_t>::max();
  std::string bad_msg;
  const InterruptFlag* stop = opt.interrupt;
  std::vector<std::uint8_t> fitted(stop ? static_cast<std::size_t>(strips) : 0);
  std::atomic<int> stopped_by{0};

#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (std::int64_t s = 0; s < strips; ++s) {
    if (stop) {
      const int v = stop->load(std::memory_order_relaxed);
      if (v != 0) {
        stopped_by.store(v, std::memory_order_relaxed);
        continue;
      }
      fitted[static_cast<std::size_t>(s)] = 1;
    }
    const std::int64_t e = s / TN, tn = s % TN;
    std::string err;
    try {
      fit_strip(src, src_type, shape, opt, w, name, e, tn, U[static_cast<std::size_t>(e)], out, sse.data(),
                ssq.data());
    } catch (const std::exception& ex) {
      err = ex.what();
    }
    if (!err.empty()) {
#pragma omp critical(lutb_fit_feedback_error)
      if (s < bad_strip) {
        bad_strip = s;
        bad_msg = std::move(err);
      }
    }
  }
  const std::int64_t done = std::count(fitted.begin(), fitted.end(), std::uint8_t{1}) * TK;  // a fitted strip is TK tiles
  return finish_quantize(name, stopped_by.load(), done, tiles, bad_msg, sse, ssq, out);
}

}  // namespace lutb::fit_detail
