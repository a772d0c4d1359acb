// Bulk (array) versions of the scalar conversions in lutb/numerics.hpp, vectorised with Highway.
//
// The library is compiled for the baseline x86-64 ISA (no -march=native), so this file is compiled
// once per Highway target (SSE2/SSSE3/SSE4/AVX2/AVX-512 on x86) and the best one the CPU supports
// is chosen at run time (HWY_DYNAMIC_DISPATCH). Every kernel is bit-exact with the scalar reference
// in numerics.hpp (tests/core/numerics_bulk_test.cpp checks every target against it); the ragged
// tail of each array goes through the scalar functions themselves.
//
// Techniques (all exact, no reliance on the FP rounding mode except round-to-nearest-even, which is
// the C++ default and which nothing in lutb changes):
//   - E4M3/FP16 subnormals decode as integer -> float conversion times an exact power of two;
//   - E4M3 subnormal encoding adds 2^14 to |x|: the sum's ulp is 2^-9 (the E4M3 subnormal step), so
//     the FP32 adder performs the round-to-nearest-even, and the result's low bits are the mantissa.

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/numerics_bulk.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>

#include "lutb/numerics.hpp"

HWY_BEFORE_NAMESPACE();
namespace lutb {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// All kernels work on 32-bit lanes; narrower element types are promoted/demoted at load/store.
using DF = hn::ScalableTag<float>;
using DU = hn::RebindToUnsigned<DF>;
using DI = hn::RebindToSigned<DF>;

void Bf16ToF32(const std::uint16_t* HWY_RESTRICT in, float* HWY_RESTRICT out, std::size_t n) {
  const DF df;
  const DU du;
  const hn::Rebind<std::uint16_t, DU> d16;
  const std::size_t N = hn::Lanes(df);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto h = hn::PromoteTo(du, hn::LoadU(d16, in + i));
    hn::StoreU(hn::BitCast(df, hn::ShiftLeft<16>(h)), df, out + i);
  }
  for (; i < n; ++i) out[i] = bf16_to_float(in[i]);
}

void F32ToBf16(const float* HWY_RESTRICT in, std::uint16_t* HWY_RESTRICT out, std::size_t n) {
  const DF df;
  const DU du;
  const DI di;
  const hn::Rebind<std::uint16_t, DI> d16;
  const std::size_t N = hn::Lanes(df);
  const auto abs_mask = hn::Set(du, 0x7fffffffu);
  const auto inf_bits = hn::Set(di, 0x7f800000);
  const auto bias = hn::Set(du, 0x7fffu);
  const auto one = hn::Set(du, 1u);
  const auto quiet = hn::Set(du, 0x0040u);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto u = hn::BitCast(du, hn::LoadU(df, in + i));
    const auto is_nan = hn::Gt(hn::BitCast(di, hn::And(u, abs_mask)), inf_bits);
    const auto rne = hn::ShiftRight<16>(hn::Add(hn::Add(u, bias), hn::And(hn::ShiftRight<16>(u), one)));
    const auto nan = hn::Or(hn::ShiftRight<16>(u), quiet);
    const auto r = hn::IfThenElse(hn::RebindMask(du, is_nan), nan, rne);
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, r)), d16, out + i);
  }
  for (; i < n; ++i) out[i] = bf16_from_float(in[i]);
}

void Fp16ToF32(const std::uint16_t* HWY_RESTRICT in, float* HWY_RESTRICT out, std::size_t n) {
  const DF df;
  const DU du;
  const DI di;
  const hn::Rebind<std::uint16_t, DU> d16;
  const std::size_t N = hn::Lanes(df);
  const auto exp_mask = hn::Set(du, 0x7c00u);
  const auto mag_mask = hn::Set(du, 0x7fffu);
  const auto man_mask = hn::Set(du, 0x3ffu);
  const auto sign_mask = hn::Set(du, 0x8000u);
  const auto rebias = hn::Set(du, 112u << 23);       // normal: exponent 15 -> 127
  const auto rebias_inf = hn::Set(du, 224u << 23);   // exponent 31 -> 255
  const auto two_m24 = hn::Set(df, 5.9604644775390625e-08f);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto h = hn::PromoteTo(du, hn::LoadU(d16, in + i));
    const auto e = hn::And(h, exp_mask);
    const auto shifted = hn::ShiftLeft<13>(hn::And(h, mag_mask));
    const auto normal = hn::Add(shifted, hn::IfThenElse(hn::Eq(e, exp_mask), rebias_inf, rebias));
    const auto sub = hn::BitCast(du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, hn::And(h, man_mask))), two_m24));
    const auto mag = hn::IfThenElse(hn::Eq(e, hn::Zero(du)), sub, normal);
    const auto sign = hn::ShiftLeft<16>(hn::And(h, sign_mask));
    hn::StoreU(hn::BitCast(df, hn::Or(mag, sign)), df, out + i);
  }
  for (; i < n; ++i) out[i] = fp16_to_float(in[i]);
}

void E4m3ToF32(const std::uint8_t* HWY_RESTRICT in, float* HWY_RESTRICT out, std::size_t n) {
  const DF df;
  const DU du;
  const DI di;
  const hn::Rebind<std::uint8_t, DU> d8;
  const std::size_t N = hn::Lanes(df);
  const auto mag_mask = hn::Set(du, 0x7fu);
  const auto sign_mask = hn::Set(du, 0x80u);
  const auto rebias = hn::Set(du, 120u << 23);  // exponent bias 7 -> 127
  const auto eight = hn::Set(di, 8);
  const auto nan_byte = hn::Set(du, 0x7fu);
  const auto qnan = hn::Set(du, 0x7fc00000u);
  const auto two_m9 = hn::Set(df, 0.001953125f);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto b = hn::PromoteTo(du, hn::LoadU(d8, in + i));
    const auto mag = hn::And(b, mag_mask);
    const auto normal = hn::Add(hn::ShiftLeft<20>(mag), rebias);
    const auto sub = hn::BitCast(du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mag)), two_m9));
    auto r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(hn::BitCast(di, mag), eight)), sub, normal);
    r = hn::IfThenElse(hn::Eq(mag, nan_byte), qnan, r);
    r = hn::Or(r, hn::ShiftLeft<24>(hn::And(b, sign_mask)));
    hn::StoreU(hn::BitCast(df, r), df, out + i);
  }
  for (; i < n; ++i) out[i] = e4m3_to_float(in[i]);
}

void F32ToE4m3(const float* HWY_RESTRICT in, std::uint8_t* HWY_RESTRICT out, std::size_t n) {
  const DF df;
  const DU du;
  const DI di;
  const hn::Rebind<std::uint8_t, DI> d8;
  const std::size_t N = hn::Lanes(df);
  const auto abs_mask = hn::Set(du, 0x7fffffffu);
  const auto inf_bits = hn::Set(di, 0x7f800000);
  const auto sat_bits = hn::Set(di, 0x43e00000);     // 448
  const auto normal_min = hn::Set(di, 0x3c800000);   // 2^-6
  const auto round_bias = hn::Set(du, 0x7ffffu);
  const auto one = hn::Set(du, 1u);
  const auto rebias = hn::Set(du, 120u << 23);
  const auto magic = hn::Set(df, 16384.0f);          // 2^14: ulp 2^-9
  const auto magic_bits = hn::Set(du, 0x46800000u);
  const auto sign_mask = hn::Set(du, 0x80u);
  const auto e4m3_max = hn::Set(du, 0x7eu);
  const auto e4m3_nan = hn::Set(du, 0x7fu);
  std::size_t i = 0;
  for (; i + N <= n; i += N) {
    const auto u = hn::BitCast(du, hn::LoadU(df, in + i));
    const auto a = hn::And(u, abs_mask);
    const auto ai = hn::BitCast(di, a);
    const auto normal = hn::ShiftRight<20>(
        hn::Sub(hn::Add(hn::Add(a, round_bias), hn::And(hn::ShiftRight<20>(a), one)), rebias));
    const auto sub = hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, a), magic)), magic_bits);
    auto r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(ai, normal_min)), sub, normal);
    r = hn::IfThenElse(hn::RebindMask(du, hn::Lt(ai, sat_bits)), r, e4m3_max);
    r = hn::IfThenElse(hn::RebindMask(du, hn::Gt(ai, inf_bits)), e4m3_nan, r);
    r = hn::Or(r, hn::And(hn::ShiftRight<24>(u), sign_mask));
    hn::StoreU(hn::DemoteTo(d8, hn::BitCast(di, r)), d8, out + i);
  }
  for (; i < n; ++i) out[i] = e4m3_from_float(in[i]);
}

}  // namespace HWY_NAMESPACE
}  // namespace lutb
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace lutb {
HWY_EXPORT(Bf16ToF32);
HWY_EXPORT(F32ToBf16);
HWY_EXPORT(Fp16ToF32);
HWY_EXPORT(E4m3ToF32);
HWY_EXPORT(F32ToE4m3);

void bf16_to_float_n(const std::uint16_t* in, float* out, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(Bf16ToF32)(in, out, n);
}
void bf16_from_float_n(const float* in, std::uint16_t* out, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(F32ToBf16)(in, out, n);
}
void fp16_to_float_n(const std::uint16_t* in, float* out, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(Fp16ToF32)(in, out, n);
}
void e4m3_to_float_n(const std::uint8_t* in, float* out, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(E4m3ToF32)(in, out, n);
}
void e4m3_from_float_n(const float* in, std::uint8_t* out, std::size_t n) {
  HWY_DYNAMIC_DISPATCH(F32ToE4m3)(in, out, n);
}
}  // namespace lutb
#endif  // HWY_ONCE
