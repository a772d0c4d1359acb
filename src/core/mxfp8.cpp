// MXFP8 activations (OCP MX v1.0, spec section 3): block 32 along the last axis, E4M3 elements,
// one UE8M0 scale per block.
#include "lutb/mxfp8.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace lutb {

void mxfp8_quantize_block(const float* x, int n, std::uint8_t* elems32, std::uint8_t* scale, MxScaleRule rule) {
  if (n < 0 || n > kMxBlock) throw std::invalid_argument("mxfp8_quantize_block: n must be 0..32");
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < n; ++i) {
    finite &= f32_is_finite(x[i]);
    amax = std::max(amax, x[i] < 0 ? -x[i] : x[i]);
  }
  if (!finite) {
    // A block with NaN or +-Inf: scale 255 (NaN) and NaN elements; it decodes to NaN.
    *scale = kUE8M0NaN;
    std::memset(elems32, kE4M3NaN, kMxBlock);
    return;
  }
  const std::uint8_t b = mx_block_scale(amax, rule);
  *scale = b;
  for (int i = 0; i < n; ++i) elems32[i] = mx_encode(x[i], b);
  for (int i = n; i < kMxBlock; ++i) elems32[i] = 0;  // zero padding of a ragged K
}

namespace {
inline std::int64_t padded_cols(std::int64_t cols) { return (cols + kMxBlock - 1) / kMxBlock * kMxBlock; }
void check_dims(std::int64_t rows, std::int64_t cols, const char* fn) {
  if (rows < 0 || cols < 0) throw std::invalid_argument(std::string(fn) + ": negative dimension");
}
}  // namespace

void mxfp8_quantize_rows(const float* x, std::int64_t rows, std::int64_t cols, std::uint8_t* elems,
                         std::uint8_t* scales, MxScaleRule rule) {
  check_dims(rows, cols, "mxfp8_quantize_rows");
  const std::int64_t pc = padded_cols(cols), nb = pc / kMxBlock;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t b = 0; b < nb; ++b) {
      const std::int64_t c0 = b * kMxBlock;
      const int n = static_cast<int>(std::min<std::int64_t>(kMxBlock, cols - c0));
      mxfp8_quantize_block(x + r * cols + c0, n, elems + r * pc + c0, scales + r * nb + b, rule);
    }
}

void mxfp8_dequantize_rows(const std::uint8_t* elems, const std::uint8_t* scales, std::int64_t rows,
                           std::int64_t cols, float* out) {
  check_dims(rows, cols, "mxfp8_dequantize_rows");
  const std::int64_t pc = padded_cols(cols), nb = pc / kMxBlock;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) out[r * cols + c] = mx_decode(elems[r * pc + c], scales[r * nb + c / kMxBlock]);
}

namespace {
// Quantise-dequantise one row block by block; `load` fills up to 32 FP32 values of the row.
template <class Load>
void qdq_row(std::int64_t cols, float* out, MxScaleRule rule, Load load) {
  float buf[kMxBlock];
  std::uint8_t q[kMxBlock];
  std::uint8_t s = 0;
  for (std::int64_t c0 = 0; c0 < cols; c0 += kMxBlock) {
    const int n = static_cast<int>(std::min<std::int64_t>(kMxBlock, cols - c0));
    load(c0, n, buf);
    mxfp8_quantize_block(buf, n, q, &s, rule);
    for (int i = 0; i < n; ++i) out[c0 + i] = mx_decode(q[i], s);
  }
}
}  // namespace

void mxfp8_qdq_rows(const float* x, std::int64_t rows, std::int64_t cols, float* out, MxScaleRule rule) {
  check_dims(rows, cols, "mxfp8_qdq_rows");
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    qdq_row(cols, out + r * cols, rule,
            [&](std::int64_t c0, int n, float* buf) { std::memcpy(buf, xr + c0, static_cast<std::size_t>(n) * sizeof(float)); });
  }
}

void mxfp8_qdq_rows_bf16(const std::uint16_t* x, std::int64_t rows, std::int64_t cols, float* out, MxScaleRule rule) {
  check_dims(rows, cols, "mxfp8_qdq_rows_bf16");
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::uint16_t* xr = x + r * cols;
    qdq_row(cols, out + r * cols, rule,
            [&](std::int64_t c0, int n, float* buf) { bf16_to_float_n(xr + c0, buf, static_cast<std::size_t>(n)); });
  }
}

}  // namespace lutb
