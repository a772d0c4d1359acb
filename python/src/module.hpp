// Shared declarations of the extension's translation units (python/src).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "lutb/dtype.hpp"
#include "lutb/tile.hpp"

namespace lutb::python {

/// Any DLPack array (numpy or torch, CPU or CUDA, any dtype); only its pointer, size and device are read.
using Array = nanobind::ndarray<>;

/// Elements of `a`.
std::size_t elements(const Array& a);
/// Throws std::invalid_argument naming `what` unless `a` is on the CUDA (cuda = true) or CPU device,
/// holds exactly `bytes` bytes and has data.
void require(const Array& a, const char* what, std::size_t bytes, bool cuda);
/// "F32" / "BF16" / "F16" -> DType; anything else throws std::invalid_argument.
DType source_dtype(const std::string& name);
/// LutbShape with the given sizes; throws std::invalid_argument for sizes < 1.
LutbShape make_shape(std::int64_t experts, std::int64_t rows, std::int64_t cols, bool stacked);

/// Adds the CUDA entry points (python/src/cuda.cpp) when the library was built with lutb_cuda, and
/// has_cuda() (true / false) in every build.
void bind_cuda(nanobind::module_& m);

}  // namespace lutb::python
