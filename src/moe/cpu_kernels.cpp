// Vectorised GEMM row kernels of the fast CPU experts with runtime ISA dispatch (AVX-512, AVX2+FMA,
// portable scalar). The SIMD bodies live in cpu_kernels.inc, compiled once per ISA under
// `#pragma GCC target`, so the library itself needs no -m flags and runs on any x86-64 (or other) CPU.
#include <immintrin.h>

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized reports
// as "'__Y' may be used uninitialized" (a false positive inside avx512fintrin.h).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lutb/numerics.hpp"
#include "lutb/tile.hpp"
#include "moe/cpu_kernels.hpp"
#include "moe/moe_internal.hpp"

namespace lutb::moe::detail {

namespace {
struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int i = 0; i < 256; ++i) v[i] = e4m3_to_float(static_cast<std::uint8_t>(i));
  }
};
const E4M3Table kE4M3;
}  // namespace

void lutb_decode_codebook(const std::uint8_t* codebook8, std::uint8_t scale, float* out8) {
  for (int i = 0; i < 8; ++i) out8[i] = ldexp_ue8m0(kE4M3.v[codebook8[i]], scale);
}

// ---------------------------------------------------------------------------
// Portable scalar kernels (the fallback; also the reading of the format the SIMD paths follow)
// ---------------------------------------------------------------------------
namespace scalar {
void lutb_gemm(const std::uint8_t* packed, const std::uint8_t* codebook, const std::uint8_t* scale, std::int64_t TK,
               std::int64_t N, std::int64_t n0, std::int64_t n1, const float* const* a, int ntok, float* const* c) {
  std::vector<float> lut(static_cast<std::size_t>(TK * 8));
  std::uint8_t idx[kTileSize];
  std::vector<float> acc;
  for (std::int64_t tn = n0 / 8; tn * 8 < n1; ++tn) {
    const int valid = static_cast<int>(std::min<std::int64_t>(8, N - tn * 8));
    acc.assign(static_cast<std::size_t>(ntok) * 8, 0.0f);
    for (std::int64_t tk = 0; tk < TK; ++tk) {
      const std::int64_t tile = tn * TK + tk;
      float l[8];
      lutb_decode_codebook(codebook + tile * 8, scale[tile], l);
      unpack_tile_indices(packed + tile * kPackedBytes, idx);
      for (int r = 0; r < valid; ++r)
        for (int t = 0; t < ntok; ++t) {
          const float* at = a[t] + tk * 64;
          float s = acc[t * 8 + r];
          for (int col = 0; col < 64; ++col) s += l[idx[r * 64 + col]] * at[col];
          acc[t * 8 + r] = s;
        }
    }
    for (int t = 0; t < ntok; ++t)
      for (int r = 0; r < valid; ++r) c[t][tn * 8 + r] = acc[t * 8 + r];
  }
}

void dense_gemm(const std::uint16_t* w, std::int64_t K, std::int64_t n0, std::int64_t n1, const float* const* a,
                int ntok, float* const* c) {
  std::vector<float> row(static_cast<std::size_t>(K));
  for (std::int64_t n = n0; n < n1; ++n) {
    for (std::int64_t k = 0; k < K; ++k) row[k] = bf16_to_float(w[n * K + k]);
    for (int t = 0; t < ntok; ++t) {
      float s = 0.0f;
      for (std::int64_t k = 0; k < K; ++k) s += a[t][k] * row[k];
      c[t][n] = s;
    }
  }
}
}  // namespace scalar

// ---------------------------------------------------------------------------
// AVX2 + FMA: 8 lanes; a 3-byte group of 8 indices -> vpsrlvd from a broadcast word, vpermps.
// ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
namespace simd {
constexpr int kLanes = 8;
using V = __m256;
inline V zero() { return _mm256_setzero_ps(); }
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V load_lut(const float* p) { return _mm256_loadu_ps(p); }
// Indices j*8 .. j*8+7 of a 24-byte row: the 24-bit word at row + 3j, broadcast straight from
// memory (vpbroadcastd m32), shifted per lane (vpsrlvd), looked up (vpermps, low 3 bits). The last
// group reads bytes 20..23 and shifts 8 more, so no read passes the row.
inline V decode(V lut, const std::uint8_t* row, int j) {
  std::int32_t w;
  if (j < 7) {
    std::memcpy(&w, row + 3 * j, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
    return _mm256_permutevar8x32_ps(lut, _mm256_srlv_epi32(_mm256_set1_epi32(w), shifts));
  }
  std::memcpy(&w, row + 20, 4);
  const __m256i shifts = _mm256_setr_epi32(8, 11, 14, 17, 20, 23, 26, 29);
  return _mm256_permutevar8x32_ps(lut, _mm256_srlv_epi32(_mm256_set1_epi32(w), shifts));
}
// Table of a tile: e4m3(codebook[i]) * 2^(scale-127), without touching FP32 subnormals (an
// operation on a subnormal costs a microcode assist of ~100 cycles). E4M3 bits (b & 0x7F) << 20 plus
// 120 << 23 are the FP32 bits of the value when the E4M3 exponent is not 0; for subnormals (exponent
// 0, value m * 2^-9) the exponent is raised by one more, giving 2^-6 + m * 2^-9, and 2^-6 is
// subtracted: exact. Then one multiply by 2^(scale-127), which rounds once, exactly as ldexp_ue8m0
// (exact for scales 3..246).
inline void decode_codebook(const std::uint8_t* cb, std::uint8_t scale, float* out8) {
  std::int64_t bytes;
  std::memcpy(&bytes, cb, 8);
  const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
  const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
  __m256i bits = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20),
                                  _mm256_set1_epi32(120 << 23));
  bits = _mm256_add_epi32(bits, _mm256_and_si256(sub, _mm256_set1_epi32(1 << 23)));
  __m256 v = _mm256_sub_ps(_mm256_castsi256_ps(bits), _mm256_and_ps(_mm256_castsi256_ps(sub), _mm256_set1_ps(0x1p-6f)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  v = _mm256_or_ps(v, _mm256_castsi256_ps(sign));
  _mm256_storeu_ps(out8, _mm256_mul_ps(v, _mm256_set1_ps(ue8m0_to_float(scale))));
}
inline V load_bf16(const std::uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(V v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
}  // namespace simd
#include "moe/cpu_kernels.inc"
void lutb_gemm(const std::uint8_t* packed, const std::uint8_t* codebook, const std::uint8_t* scale, std::int64_t TK,
               std::int64_t N, std::int64_t n0, std::int64_t n1, const float* const* a, int ntok, float* const* c) {
  lutb_gemm_impl(packed, codebook, scale, TK, N, n0, n1, a, ntok, c);
}
void dense_gemm(const std::uint16_t* w, std::int64_t K, std::int64_t n0, std::int64_t n1, const float* const* a,
                int ntok, float* const* c) {
  dense_gemm_impl(w, K, n0, n1, a, ntok, c);
}
}  // namespace avx2
#pragma GCC pop_options

// ---------------------------------------------------------------------------
// AVX-512 (F, VL, BW, VBMI): 16 lanes; 16 indices per vpmultishiftqb, vpermps over the 8-entry
// table duplicated to 16 lanes.
// ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512vbmi,avx2,fma")
namespace avx512 {
namespace simd {
constexpr int kLanes = 16;
using V = __m512;
inline V zero() { return _mm512_setzero_ps(); }
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V load_lut(const float* p) {
  const __m512 l = _mm512_zextps256_ps512(_mm256_loadu_ps(p));
  return _mm512_shuffle_f32x4(l, l, 0x44);  // 128-bit lanes [0, 1, 0, 1]
}
// Indices 16c .. 16c+15 of a 24-byte row start at byte 6c: one qword broadcast from memory
// (vpbroadcastq m64), then vpmultishiftqb puts index 2i at byte 0 and index 2i+1 at byte 4 of qword
// lane i (bit offsets 6i and 6i+3), i.e. in the low bits of dword lanes 2i, 2i+1; vpermps looks them
// up (lane bit 3 is the next index's bit, harmless with the table duplicated). The last chunk reads
// bytes 16..23 with offsets +16, so no read passes the row.
inline V decode(V lut, const std::uint8_t* row, int j) {
  std::int64_t q;
  if (j < 3) {
    std::memcpy(&q, row + 6 * j, 8);
    const __m512i ctrl = _mm512_setr_epi64(0x0000000300000000ll, 0x0000000906000006ll, 0x0000000f0c00000cll,
                                           0x0000001512000012ll, 0x0000001b18000018ll, 0x000000211e00001ell,
                                           0x0000002724000024ll, 0x0000002d2a00002all);
    return _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64(q)), lut);
  }
  std::memcpy(&q, row + 16, 8);
  const __m512i ctrl = _mm512_setr_epi64(0x0000001310000010ll, 0x0000001916000016ll, 0x0000001f1c00001cll,
                                         0x0000002522000022ll, 0x0000002b28000028ll, 0x000000312e00002ell,
                                         0x0000003734000034ll, 0x0000003d3a00003all);
  return _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64(q)), lut);
}
inline void decode_codebook(const std::uint8_t* cb, std::uint8_t scale, float* out8) {
  avx2::simd::decode_codebook(cb, scale, out8);
}
inline V load_bf16(const std::uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
}  // namespace simd
#include "moe/cpu_kernels.inc"
void lutb_gemm(const std::uint8_t* packed, const std::uint8_t* codebook, const std::uint8_t* scale, std::int64_t TK,
               std::int64_t N, std::int64_t n0, std::int64_t n1, const float* const* a, int ntok, float* const* c) {
  lutb_gemm_impl(packed, codebook, scale, TK, N, n0, n1, a, ntok, c);
}
void dense_gemm(const std::uint16_t* w, std::int64_t K, std::int64_t n0, std::int64_t n1, const float* const* a,
                int ntok, float* const* c) {
  dense_gemm_impl(w, K, n0, n1, a, ntok, c);
}
}  // namespace avx512
#pragma GCC pop_options

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------
void lutb_gemm(CpuIsa isa, const std::uint8_t* packed, const std::uint8_t* codebook, const std::uint8_t* scale, std::int64_t TK,
               std::int64_t N, std::int64_t n0, std::int64_t n1, const float* const* a, int ntok, float* const* c) {
  switch (isa) {
    case CpuIsa::Avx512: return avx512::lutb_gemm(packed, codebook, scale, TK, N, n0, n1, a, ntok, c);
    case CpuIsa::Avx2: return avx2::lutb_gemm(packed, codebook, scale, TK, N, n0, n1, a, ntok, c);
    default: return scalar::lutb_gemm(packed, codebook, scale, TK, N, n0, n1, a, ntok, c);
  }
}

void lutb_decode_codebook_dispatch(CpuIsa isa, const std::uint8_t* codebook8, std::uint8_t scale, float* out8) {
  switch (isa) {
    case CpuIsa::Avx512: return avx512::simd::decode_codebook(codebook8, scale, out8);
    case CpuIsa::Avx2: return avx2::simd::decode_codebook(codebook8, scale, out8);
    default: return lutb_decode_codebook(codebook8, scale, out8);
  }
}

void dense_gemm(CpuIsa isa, const std::uint16_t* w, std::int64_t K, std::int64_t n0, std::int64_t n1, const float* const* a,
                int ntok, float* const* c) {
  switch (isa) {
    case CpuIsa::Avx512: return avx512::dense_gemm(w, K, n0, n1, a, ntok, c);
    case CpuIsa::Avx2: return avx2::dense_gemm(w, K, n0, n1, a, ntok, c);
    default: return scalar::dense_gemm(w, K, n0, n1, a, ntok, c);
  }
}

}  // namespace lutb::moe::detail
