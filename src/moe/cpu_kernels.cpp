// Vectorised GEMM row kernels of the fast CPU experts with runtime ISA dispatch (AVX-512, AVX2+FMA,
// portable scalar). The SIMD bodies live in cpu_kernels.inc, compiled once per ISA under
// `#pragma GCC target`, so the library itself needs no -m flags and runs on any x86-64 (or other) CPU.
#include <immintrin.h>

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized reports
// as "'__Y' may be used uninitialized" (a false positive inside avx512fintrin.h).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

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
inline V decode(V lut, std::uint64_t bits24) {
  const __m256i shifts = _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21);
  const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(bits24)), shifts);
  return _mm256_permutevar8x32_ps(lut, idx);  // uses the low 3 bits of each lane
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
// AVX-512 (F, VL): 16 lanes; two 3-byte groups per vector (48 bits -> two dwords -> vpermd
// broadcast to the halves -> vpsrlvd), vpermps over the 8-entry table duplicated to 16 lanes
// (lane bit 3 then selects the same entry, so no masking is needed).
// ---------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx2,fma")
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
inline V decode(V lut, std::uint64_t bits48) {
  const std::uint64_t two = (bits48 & 0xffffffu) | ((bits48 >> 24) << 32);
  const __m512i sel = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i shifts = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21);
  const __m512i words = _mm512_permutexvar_epi32(sel, _mm512_zextsi128_si512(_mm_cvtsi64_si128(static_cast<long long>(two))));
  return _mm512_permutexvar_ps(_mm512_srlv_epi32(words, shifts), lut);
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
void lutb_gemm(const std::uint8_t* packed, const std::uint8_t* codebook, const std::uint8_t* scale, std::int64_t TK,
               std::int64_t N, std::int64_t n0, std::int64_t n1, const float* const* a, int ntok, float* const* c) {
  switch (isa_level()) {
    case 2: return avx512::lutb_gemm(packed, codebook, scale, TK, N, n0, n1, a, ntok, c);
    case 1: return avx2::lutb_gemm(packed, codebook, scale, TK, N, n0, n1, a, ntok, c);
    default: return scalar::lutb_gemm(packed, codebook, scale, TK, N, n0, n1, a, ntok, c);
  }
}

void dense_gemm(const std::uint16_t* w, std::int64_t K, std::int64_t n0, std::int64_t n1, const float* const* a,
                int ntok, float* const* c) {
  switch (isa_level()) {
    case 2: return avx512::dense_gemm(w, K, n0, n1, a, ntok, c);
    case 1: return avx2::dense_gemm(w, K, n0, n1, a, ntok, c);
    default: return scalar::dense_gemm(w, K, n0, n1, a, ntok, c);
  }
}

}  // namespace lutb::moe::detail
