// src/fit/baselines.cpp: INT3-g128, MXFP4 and NVFP4 quantise-dequantise (see lutb/baselines.hpp).
#include "lutb/baselines.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "lutb/numerics.hpp"

namespace lutb::baselines {
namespace {

void check_finite(const float* w, std::int64_t rows, std::int64_t cols, const char* what) {
  for (std::int64_t i = 0; i < rows * cols; ++i)
    if (!f32_is_finite(w[i]))
      throw std::invalid_argument(std::string(what) + ": non-finite value at row " + std::to_string(i / cols) +
                                  " col " + std::to_string(i % cols));
}

float fp16_round(float x) { return fp16_to_float(fp16_from_float(x)); }

}  // namespace

std::vector<Format> all_formats() { return {Format::kInt3G128, Format::kMxfp4, Format::kNvfp4}; }

std::string format_name(Format f) {
  switch (f) {
    case Format::kInt3G128: return "int3-g128";
    case Format::kMxfp4: return "mxfp4";
    case Format::kNvfp4: return "nvfp4";
  }
  return "?";
}

double bits_per_weight(Format f) {
  switch (f) {
    case Format::kInt3G128: return 3.0 + 32.0 / 128.0;
    case Format::kMxfp4: return 4.0 + 8.0 / 32.0;
    case Format::kNvfp4: return 4.0 + 8.0 / 16.0;
  }
  return 0.0;
}

float e2m1_round(float x) {
  const float a = std::fabs(x);
  float q;
  if (a <= 0.25f) q = 0.0f;
  else if (a < 0.75f) q = 0.5f;
  else if (a <= 1.25f) q = 1.0f;
  else if (a < 1.75f) q = 1.5f;
  else if (a <= 2.5f) q = 2.0f;
  else if (a < 3.5f) q = 3.0f;
  else if (a <= 5.0f) q = 4.0f;
  else q = 6.0f;
  return std::signbit(x) ? -q : q;
}

void qdq_int3_g128(const float* w, std::int64_t rows, std::int64_t cols, float* out) {
  check_finite(w, rows, cols, "qdq_int3_g128");
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c0 = 0; c0 < cols; c0 += 128) {
      const std::int64_t n = std::min<std::int64_t>(128, cols - c0);
      const float* x = w + r * cols + c0;
      float* o = out + r * cols + c0;
      float mn = x[0], mx = x[0];
      for (std::int64_t i = 1; i < n; ++i) {
        mn = std::min(mn, x[i]);
        mx = std::max(mx, x[i]);
      }
      const float z = fp16_round(mn);
      const float d = fp16_round((mx - z) / 7.0f);
      for (std::int64_t i = 0; i < n; ++i) {
        float q = 0.0f;
        if (d > 0.0f) q = std::clamp(std::nearbyint((x[i] - z) / d), 0.0f, 7.0f);
        o[i] = q * d + z;
      }
    }
  }
}

void qdq_mxfp4(const float* w, std::int64_t rows, std::int64_t cols, float* out) {
  check_finite(w, rows, cols, "qdq_mxfp4");
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c0 = 0; c0 < cols; c0 += 32) {
      const std::int64_t n = std::min<std::int64_t>(32, cols - c0);
      const float* x = w + r * cols + c0;
      float* o = out + r * cols + c0;
      float amax = 0.0f;
      for (std::int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
      if (amax == 0.0f) {
        for (std::int64_t i = 0; i < n; ++i) o[i] = 0.0f;
        continue;
      }
      const int e = std::clamp(f32_floor_log2(amax) - 2, -127, 127);
      const float X = std::ldexp(1.0f, e);
      for (std::int64_t i = 0; i < n; ++i) o[i] = e2m1_round(x[i] / X) * X;
    }
  }
}

void qdq_nvfp4(const float* w, std::int64_t rows, std::int64_t cols, float* out) {
  check_finite(w, rows, cols, "qdq_nvfp4");
  float tmax = 0.0f;
  for (std::int64_t i = 0; i < rows * cols; ++i) tmax = std::max(tmax, std::fabs(w[i]));
  const float g = tmax / (6.0f * 448.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c0 = 0; c0 < cols; c0 += 16) {
      const std::int64_t n = std::min<std::int64_t>(16, cols - c0);
      const float* x = w + r * cols + c0;
      float* o = out + r * cols + c0;
      float amax = 0.0f;
      for (std::int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float b = g > 0.0f ? e4m3_round(amax / (6.0f * g)) : 0.0f;
      const float bs = b * g;
      for (std::int64_t i = 0; i < n; ++i) o[i] = bs > 0.0f ? e2m1_round(x[i] / bs) * bs : 0.0f;
    }
  }
}

void qdq(Format f, const float* w, std::int64_t rows, std::int64_t cols, float* out) {
  switch (f) {
    case Format::kInt3G128: return qdq_int3_g128(w, rows, cols, out);
    case Format::kMxfp4: return qdq_mxfp4(w, rows, cols, out);
    case Format::kNvfp4: return qdq_nvfp4(w, rows, cols, out);
  }
}

}  // namespace lutb::baselines
