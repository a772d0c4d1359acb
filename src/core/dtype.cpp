#include "lutb/dtype.hpp"

#include <array>
#include <utility>

namespace lutb {
namespace {
constexpr std::array<std::pair<DType, std::string_view>, 16> kNames{{
    {DType::BOOL, "BOOL"}, {DType::U8, "U8"}, {DType::I8, "I8"}, {DType::U16, "U16"},
    {DType::I16, "I16"}, {DType::U32, "U32"}, {DType::I32, "I32"}, {DType::U64, "U64"},
    {DType::I64, "I64"}, {DType::F16, "F16"}, {DType::BF16, "BF16"}, {DType::F32, "F32"},
    {DType::F64, "F64"}, {DType::F8_E4M3, "F8_E4M3"}, {DType::F8_E5M2, "F8_E5M2"},
    {DType::F8_E8M0, "F8_E8M0"},
}};
}  // namespace

std::string_view dtype_name(DType t) {
  for (const auto& [d, n] : kNames)
    if (d == t) return n;
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& [d, n] : kNames)
    if (n == name) return d;
  return std::nullopt;
}

}  // namespace lutb
