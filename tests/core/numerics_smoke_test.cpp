#include <gtest/gtest.h>
#include "lutb/numerics.hpp"
TEST(NumericsSmoke, E4M3Basics) {
  EXPECT_EQ(lutb::e4m3_from_float(448.0f), 0x7e);
  EXPECT_EQ(lutb::e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(lutb::e4m3_from_float(1.0f), 0x38);
}
