// lutb/dtype.hpp: tensor element types, named as the safetensors format names them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace lutb {

/// Element types of the safetensors format (https://github.com/huggingface/safetensors, "dtype").
enum class DType : std::uint8_t {
  BOOL, U8, I8, U16, I16, U32, I32, U64, I64,
  F16, BF16, F32, F64,
  F8_E4M3, F8_E5M2, F8_E8M0,
};

/// Bytes per element.
constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::BOOL: case DType::U8: case DType::I8:
    case DType::F8_E4M3: case DType::F8_E5M2: case DType::F8_E8M0: return 1;
    case DType::U16: case DType::I16: case DType::F16: case DType::BF16: return 2;
    case DType::U32: case DType::I32: case DType::F32: return 4;
    case DType::U64: case DType::I64: case DType::F64: return 8;
  }
  return 0;
}

/// The safetensors name ("BF16", "F8_E4M3", ...).
std::string_view dtype_name(DType t);
/// Parses a safetensors dtype name; nullopt when unknown.
std::optional<DType> dtype_from_name(std::string_view name);

/// True for F16, BF16, F32 and F64: the source types a weight can be quantised from.
constexpr bool dtype_is_float_source(DType t) {
  return t == DType::F16 || t == DType::BF16 || t == DType::F32 || t == DType::F64;
}

}  // namespace lutb
