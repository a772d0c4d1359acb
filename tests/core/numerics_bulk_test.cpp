// The bulk conversions (src/core/numerics_bulk.cpp) against the scalar reference, bit for bit, on
// every Highway target this CPU supports (runtime dispatch is re-run per target), at every length
// 0..3 vectors to cover the scalar tail, and at unaligned offsets.
#include <gtest/gtest.h>

#include <hwy/targets.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "lutb/numerics.hpp"

namespace lutb {
namespace {

// Runs `body` once per supported compiled target, then restores the default dispatch.
template <class Body>
void for_each_target(Body body) {
  const auto targets = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(targets.empty());
  for (const std::int64_t t : targets) {
    hwy::SetSupportedTargetsForTest(t);
    SCOPED_TRACE(hwy::TargetName(t));
    body();
  }
  hwy::SetSupportedTargetsForTest(0);
}

std::vector<float> interesting_floats() {
  std::vector<float> v;
  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) v.push_back(f32_from_bits(static_cast<std::uint32_t>(rng())));
  std::uniform_real_distribution<float> ex(-14.0f, 10.0f);
  for (int i = 0; i < 200000; ++i) v.push_back((i & 1 ? -1.0f : 1.0f) * std::exp2(ex(rng)));
  for (int b = 0; b < 0x7e; ++b) {  // E4M3 midpoints and their neighbours
    const float mid = (e4m3_to_float(static_cast<std::uint8_t>(b)) + e4m3_to_float(static_cast<std::uint8_t>(b + 1))) / 2;
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  for (float x : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 448.0f, 464.0f, 3.4028235e38f, 1.4e-45f,
                  f32_from_bits(0x7f800001u), f32_from_bits(0xffbfffffu), f32_from_bits(0x7f7fffffu),
                  f32_from_bits(0x3f808000u), f32_from_bits(0x3f818000u)})
    v.push_back(x);
  return v;
}

TEST(NumericsBulk, E4M3ToFloatAllBytes) {
  std::vector<std::uint8_t> in(256 * 3 + 13);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::uint8_t>(i * 7 + 3);
  for_each_target([&] {
    for (std::size_t off : {0u, 1u, 3u}) {
      const std::size_t n = in.size() - off;
      std::vector<float> out(n);
      e4m3_to_float_n(in.data() + off, out.data(), n);
      for (std::size_t i = 0; i < n; ++i) {
        const float want = e4m3_to_float(in[off + i]);
        ASSERT_EQ(f32_bits(out[i]), f32_bits(want)) << "byte " << int(in[off + i]);
      }
    }
  });
}

TEST(NumericsBulk, BF16AndFP16ToFloatAll65536) {
  std::vector<std::uint16_t> in(65536 + 5);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::uint16_t>(i);
  std::vector<float> out(in.size());
  for_each_target([&] {
    bf16_to_float_n(in.data() + 1, out.data(), in.size() - 1);
    for (std::size_t i = 0; i + 1 < in.size(); ++i) ASSERT_EQ(f32_bits(out[i]), f32_bits(bf16_to_float(in[i + 1]))) << i;
    fp16_to_float_n(in.data() + 1, out.data(), in.size() - 1);
    for (std::size_t i = 0; i + 1 < in.size(); ++i) ASSERT_EQ(f32_bits(out[i]), f32_bits(fp16_to_float(in[i + 1]))) << i;
  });
}

TEST(NumericsBulk, FloatToE4M3AndBF16) {
  const std::vector<float> in = interesting_floats();
  std::vector<std::uint8_t> e(in.size());
  std::vector<std::uint16_t> h(in.size());
  for_each_target([&] {
    e4m3_from_float_n(in.data(), e.data(), in.size());
    bf16_from_float_n(in.data(), h.data(), in.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
      ASSERT_EQ(e[i], e4m3_from_float(in[i])) << "x bits 0x" << std::hex << f32_bits(in[i]);
      ASSERT_EQ(h[i], bf16_from_float(in[i])) << "x bits 0x" << std::hex << f32_bits(in[i]);
    }
  });
}

TEST(NumericsBulk, EveryLengthAndOffset) {
  // Lengths 0..70 at offsets 0..3 cover the vector body and the scalar tail on every target; the
  // output must be written exactly in [0, n).
  const std::vector<float> src = interesting_floats();
  for_each_target([&] {
    for (std::size_t off = 0; off < 4; ++off)
      for (std::size_t n = 0; n <= 70; ++n) {
        std::vector<std::uint8_t> e(n + 1, 0xAA);
        e4m3_from_float_n(src.data() + off, e.data(), n);
        for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(e[i], e4m3_from_float(src[off + i]));
        ASSERT_EQ(e[n], 0xAA) << "wrote past the end, n = " << n;
        std::vector<float> f(n + 1, -1.0f);
        e4m3_to_float_n(e.data(), f.data(), n);
        for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(f32_bits(f[i]), f32_bits(e4m3_to_float(e[i])));
        ASSERT_EQ(f[n], -1.0f);
      }
  });
}

}  // namespace
}  // namespace lutb
