// INT3-g128, MXFP4 and NVFP4 quantise-dequantise against hand-computed cases.
#include "lutb/baselines.hpp"

#include <gtest/gtest.h>

#include <limits>
#include <stdexcept>
#include <vector>

#include "lutb/numerics.hpp"

namespace lutb::baselines {
namespace {

TEST(Baselines, E2M1RoundsToNearestEvenAndSaturates) {
  const float in[] = {0.0f, 0.24f, 0.25f, 0.26f, 0.75f, 1.25f, 1.3f, 1.75f, 2.5f, 2.6f, 3.5f, 5.0f, 5.1f, 100.0f, -0.3f, -5.0f};
  const float want[] = {0.0f, 0.0f, 0.0f, 0.5f, 1.0f, 1.0f, 1.5f, 2.0f, 2.0f, 3.0f, 4.0f, 4.0f, 6.0f, 6.0f, -0.5f, -4.0f};
  for (std::size_t i = 0; i < std::size(in); ++i) EXPECT_EQ(e2m1_round(in[i]), want[i]) << in[i];
}

TEST(Baselines, BitsPerWeight) {
  EXPECT_EQ(bits_per_weight(Format::kInt3G128), 3.25);
  EXPECT_EQ(bits_per_weight(Format::kMxfp4), 4.25);
  EXPECT_EQ(bits_per_weight(Format::kNvfp4), 4.5);
  EXPECT_EQ(format_name(Format::kNvfp4), "nvfp4");
}

TEST(Baselines, Int3G128HandCase) {
  // Row 0, group 0: min -1, max 2.5 -> zero -1, scale 0.5. Group 1 (2 values): constant 0.3.
  std::vector<float> w(130, 0.0f);
  w[0] = -1.0f;
  w[1] = 2.5f;
  w[2] = 0.26f;   // (1.26)/0.5 = 2.52 -> 3 -> 0.5
  w[3] = 0.25f;   // 2.5 -> ties to even 2 -> 0.0
  w[4] = -0.8f;   // 0.4 -> 0 -> -1.0
  w[128] = 0.3f;
  w[129] = 0.3f;
  std::vector<float> o(130);
  qdq_int3_g128(w.data(), 1, 130, o.data());
  EXPECT_EQ(o[0], -1.0f);
  EXPECT_EQ(o[1], 2.5f);
  EXPECT_EQ(o[2], 0.5f);
  EXPECT_EQ(o[3], 0.0f);
  EXPECT_EQ(o[4], -1.0f);
  EXPECT_EQ(o[5], 0.0f);  // 0 -> 2 -> 0.0
  const float z = fp16_to_float(fp16_from_float(0.3f));
  EXPECT_EQ(o[128], z);
  EXPECT_EQ(o[129], z);
}

TEST(Baselines, Mxfp4HandCase) {
  // One 32-block with amax 3: X = 2^(1 - 2) = 0.5.
  std::vector<float> w(40, 0.0f);
  w[0] = 3.0f;    // 6 -> 3.0
  w[1] = 1.3f;    // 2.6 -> 3 -> 1.5
  w[2] = 0.1f;    // 0.2 -> 0
  w[3] = -0.4f;   // -0.8 -> -1 -> -0.5
  w[32] = 0.0f;   // second block all zero
  std::vector<float> o(40);
  qdq_mxfp4(w.data(), 1, 40, o.data());
  EXPECT_EQ(o[0], 3.0f);
  EXPECT_EQ(o[1], 1.5f);
  EXPECT_EQ(o[2], 0.0f);
  EXPECT_EQ(o[3], -0.5f);
  EXPECT_EQ(o[32], 0.0f);
  // amax 7 -> X = 2^(2-2) = 1: 7 saturates to 6.
  std::vector<float> s = {7.0f, 4.9f};
  std::vector<float> so(2);
  qdq_mxfp4(s.data(), 1, 2, so.data());
  EXPECT_EQ(so[0], 6.0f);
  EXPECT_EQ(so[1], 4.0f);
}

TEST(Baselines, Nvfp4HandCase) {
  // Tensor amax 2688 -> global scale 1. Block 0: amax 2688 -> block scale e4m3(448) = 448.
  // Block 1: amax 30 -> e4m3(5) = 5.
  std::vector<float> w(32, 0.0f);
  w[0] = 2688.0f;   // 6 * 448
  w[1] = 100.0f;    // 0.223 -> 0
  w[2] = 1000.0f;   // 2.23 -> 2 -> 896
  w[16] = 30.0f;    // 6 -> 30
  w[17] = 7.0f;     // 1.4 -> 1.5 -> 7.5
  w[18] = -12.0f;   // -2.4 -> -2 -> -10
  std::vector<float> o(32);
  qdq_nvfp4(w.data(), 1, 32, o.data());
  EXPECT_EQ(o[0], 2688.0f);
  EXPECT_EQ(o[1], 0.0f);
  EXPECT_EQ(o[2], 896.0f);
  EXPECT_EQ(o[16], 30.0f);
  EXPECT_EQ(o[17], 7.5f);
  EXPECT_EQ(o[18], -10.0f);
}

TEST(Baselines, RejectNonFinite) {
  std::vector<float> w(64, 0.0f), o(64);
  w[33] = std::numeric_limits<float>::quiet_NaN();
  for (Format f : all_formats()) EXPECT_THROW(qdq(f, w.data(), 2, 32, o.data()), std::invalid_argument);
}

}  // namespace
}  // namespace lutb::baselines
