// Building blocks of the forward pass: RMSNorm, rotary embeddings, causal attention, linear, NLL.
// FP32 compute; dense products through OpenBLAS (cblas_sgemm).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <cblas.h>
#include <omp.h>
#include <fmt/core.h>

#include "lutb/model.hpp"

namespace lutb::model {
namespace {

/// OpenBLAS is used single-threaded: the parallelism is OpenMP's (see linear()). Its own pthread
/// pool would compete with the OpenMP threads (measured: half the time spent spinning in libgomp).
void blas_single_threaded() {
  static const bool once = [] {
    openblas_set_num_threads(1);
    return true;
  }();
  (void)once;
}

}  // namespace

void rms_norm(const float* x, const float* w, float* y, std::int64_t rows, std::int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    // transformers: variance = mean(x^2) in FP32, x * rsqrt(variance + eps), times the weight.
    float ss = 0.0f;
    for (std::int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
    for (std::int64_t i = 0; i < dim; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

void apply_rope(float* x, std::int64_t T, const std::int32_t* positions, int heads, std::int64_t row_stride,
                std::int64_t head_stride, std::int64_t offset, const RopeTable& table, bool interleaved) {
  const std::int64_t half = static_cast<std::int64_t>(table.inv_freq.size());
  const float att = table.attention_scaling;
#pragma omp parallel if (T * heads * half > 65536)
  {
    std::vector<float> c(half), s(half);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < T; ++t) {
      const float pos = static_cast<float>(positions[t]);
      for (std::int64_t i = 0; i < half; ++i) {
        // transformers: freqs = inv_freq * position in FP32; cos/sin in FP32, times attention_scaling.
        const float f = table.inv_freq[i] * pos;
        c[i] = static_cast<float>(std::cos(static_cast<double>(f))) * att;
        s[i] = static_cast<float>(std::sin(static_cast<double>(f))) * att;
      }
      for (int h = 0; h < heads; ++h) {
        float* v = x + t * row_stride + h * head_stride + offset;
        for (std::int64_t i = 0; i < half; ++i) {
          const std::int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
          const float x1 = v[a], x2 = v[b];
          v[a] = x1 * c[i] - x2 * s[i];
          v[b] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  }
}

void causal_attention(const float* q, const float* k, const float* v, float* out, std::int64_t T, int num_heads,
                      int num_kv_heads, int qk_dim, int v_dim, float scale) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0)
    throw ModelError(fmt::format("attention: {} heads is not a multiple of {} kv heads", num_heads, num_kv_heads));
  blas_single_threaded();
  const int group = num_heads / num_kv_heads;
  const std::int64_t ldq = static_cast<std::int64_t>(num_heads) * qk_dim, ldk = static_cast<std::int64_t>(num_kv_heads) * qk_dim;
  const std::int64_t ldv = static_cast<std::int64_t>(num_kv_heads) * v_dim, ldo = static_cast<std::int64_t>(num_heads) * v_dim;
  // One head per task: S = scale q k^T (causal rows only need columns 0..t), softmax, out = S v.
#pragma omp parallel if (num_heads > 1 && T >= 32)
  {
    std::vector<float> S(static_cast<std::size_t>(T * T));
#pragma omp for schedule(dynamic, 1)
    for (int h = 0; h < num_heads; ++h) {
      const int kvh = h / group;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, qk_dim, scale, q + h * qk_dim, ldq, k + kvh * qk_dim,
                  ldk, 0.0f, S.data(), T);
      for (std::int64_t t = 0; t < T; ++t) {
        float* row = S.data() + t * T;
        float m = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j <= t; ++j) m = std::max(m, row[j]);
        float sum = 0.0f;
        for (std::int64_t j = 0; j <= t; ++j) {
          row[j] = std::exp(row[j] - m);
          sum += row[j];
        }
        const float inv = 1.0f / sum;
        for (std::int64_t j = 0; j <= t; ++j) row[j] *= inv;
        for (std::int64_t j = t + 1; j < T; ++j) row[j] = 0.0f;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, v_dim, T, 1.0f, S.data(), T, v + kvh * v_dim, ldv, 0.0f,
                  out + h * v_dim, ldo);
    }
  }
}

void linear(const float* x, const float* W, const float* bias, float* y, std::int64_t T, std::int64_t N, std::int64_t K,
            bool accumulate) {
  blas_single_threaded();
  float beta = accumulate ? 1.0f : 0.0f;
  if (bias) {
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t n = 0; n < N; ++n) y[t * N + n] = (accumulate ? y[t * N + n] : 0.0f) + bias[n];
    beta = 1.0f;
  }
  if (T == 0 || N == 0) return;
  // OpenBLAS runs single-threaded; the product is split into row blocks of x (or of W when W is the
  // larger side) across the OpenMP threads, so that OpenMP and OpenBLAS never compete for cores.
  const double work = static_cast<double>(T) * N * K;
  const int threads = work < 1.0e6 ? 1 : omp_get_max_threads();
  if (threads <= 1) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, N, K, 1.0f, x, K, W, K, beta, y, N);
    return;
  }
  const bool split_rows = T >= N;
  const std::int64_t extent = split_rows ? T : N;
  const std::int64_t chunk = std::max<std::int64_t>(16, (extent + 4 * threads - 1) / (4 * threads));
  const std::int64_t blocks = (extent + chunk - 1) / chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t lo = b * chunk, n = std::min(chunk, extent - lo);
    if (split_rows)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, N, K, 1.0f, x + lo * K, K, W, K, beta, y + lo * N, N);
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, n, K, 1.0f, x, K, W + lo * K, K, beta, y + lo, N);
  }
}

std::string blas_core_name() {
  const char* n = openblas_get_corename();
  return n ? std::string(n) : std::string();
}

std::string blas_coretype_override() {
  const std::string core = blas_core_name();
  if (core != "Prescott" && core != "Core2" && core != "Nehalem" && core != "Sandybridge") return "";
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return core == "Haswell" ? "" : "Haswell";
  return "";
}

double nll(const float* logits, std::int64_t V, std::int64_t target) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < V; ++i) m = std::max(m, logits[i]);
  double sum = 0.0;
  for (std::int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(logits[i]) - m);
  return std::log(sum) + m - static_cast<double>(logits[target]);
}

}  // namespace lutb::model
