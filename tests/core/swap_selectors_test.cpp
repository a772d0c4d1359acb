// tests/core/swap_selectors_test.cpp: the two forms of the swap-AB decode K-loop's PRMT selectors
// (src/cuda/swap_selectors.hpp; session 17, alu17) give the same four 32-bit words, and those words
// hold what the selectors must hold by an independent per-nibble construction (the PRMT byte numbers
// of the 16 indices). The GPU test MoeDecodePaths.SelImadBitIdenticalToDefault checks the kernels.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "cuda/swap_selectors.hpp"

namespace lutb::test {
namespace {

using cuda::kern::kSwapSelNeg1;
using cuda::kern::swap_sel_alu;
using cuda::kern::swap_sel_imad;

void expect_same(std::uint32_t x, std::uint32_t y) {
  std::uint32_t a[4], m[4];
  swap_sel_alu(x, y, a);
  swap_sel_imad(x, y, kSwapSelNeg1, m);
  for (int i = 0; i < 4; ++i) ASSERT_EQ(a[i], m[i]) << "selector " << i << " x " << std::hex << x << " y " << y;
}

// Nibble j of the selectors' low 16 bits from the definition (swap_selectors.hpp): sel0 / sel1 /
// sel2 take bits 0..2 of x's nibbles 0..3 / 4..7 and y's nibbles 0..3; sel3's nibble j gathers
// bit 3 of x's nibble j (-> bit 0), of x's nibble j + 4 (-> bit 1) and of y's nibble j (-> bit 2).
// Bit 3 of every such nibble is 0 (PRMT's plain byte select).
TEST(SwapSelectors, LowHalvesMatchTheNibbleDefinition) {
  std::mt19937 rng(17);
  for (int it = 0; it < 20000; ++it) {
    const std::uint32_t x = static_cast<std::uint32_t>(rng()), y = static_cast<std::uint32_t>(rng()) & 0xffffu;
    std::uint32_t s[4];
    swap_sel_alu(x, y, s);
    for (int j = 0; j < 4; ++j) {
      const std::uint32_t xl = (x >> (4 * j)) & 15u, xh = (x >> (4 * j + 16)) & 15u, yn = (y >> (4 * j)) & 15u;
      ASSERT_EQ((s[0] >> (4 * j)) & 15u, xl & 7u);
      ASSERT_EQ((s[1] >> (4 * j)) & 15u, xh & 7u);
      ASSERT_EQ((s[2] >> (4 * j)) & 15u, yn & 7u);
      ASSERT_EQ((s[3] >> (4 * j)) & 15u, (xl >> 3) | ((xh >> 3) << 1) | ((yn >> 3) << 2));
    }
  }
}

// Every pattern of the 8 + 4 spare bits (bit 3 of each nibble of x and y: the bits the IMAD form
// subtracts), each with random, all-zero and all-one low bits.
TEST(SwapSelectors, ImadFormEqualsAluFormOnEverySpareBitPattern) {
  std::mt19937 rng(1717);
  for (std::uint32_t p = 0; p < (1u << 12); ++p) {
    std::uint32_t sx = 0, sy = 0;
    for (int i = 0; i < 8; ++i) sx |= ((p >> i) & 1u) << (4 * i + 3);
    for (int i = 0; i < 4; ++i) sy |= ((p >> (8 + i)) & 1u) << (4 * i + 3);
    expect_same(sx, sy);
    expect_same(sx | 0x77777777u, sy | 0x7777u);
    for (int r = 0; r < 4; ++r)
      expect_same(sx | (static_cast<std::uint32_t>(rng()) & 0x77777777u), sy | (static_cast<std::uint32_t>(rng()) & 0x7777u));
  }
}

// Edge words and random words (y is a zero-extended 16-bit load in the kernel).
TEST(SwapSelectors, ImadFormEqualsAluFormOnEdgeAndRandomWords) {
  const std::uint32_t xs[] = {0u, 0xffffffffu, 0x88888888u, 0x77777777u, 0x80000000u, 0x00000008u, 0x12345678u, 0xfedcba98u};
  const std::uint32_t ys[] = {0u, 0xffffu, 0x8888u, 0x7777u, 0x8000u, 0x0008u, 0x1234u};
  for (std::uint32_t x : xs)
    for (std::uint32_t y : ys) expect_same(x, y);
  std::mt19937 rng(9);
  for (int it = 0; it < 200000; ++it)
    expect_same(static_cast<std::uint32_t>(rng()), static_cast<std::uint32_t>(rng()) & 0xffffu);
  EXPECT_EQ(kSwapSelNeg1, 0xffffffffu);
}

}  // namespace
}  // namespace lutb::test
