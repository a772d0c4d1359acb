// libFuzzer target for the safetensors header parser (SafetensorsFile::parse_header), the code that
// sees untrusted bytes first. The input is a whole file image. Properties checked on top of the
// sanitizers: parsing either throws SafetensorsError or yields views that lie inside the input and
// whose sizes agree with shape x dtype; reading every parsed tensor (to_float where the dtype
// allows) stays in bounds.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "lutb/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // Copy into an exact-size heap buffer so ASan catches any read past the end.
  std::vector<std::uint8_t> buf(data, data + size);
  const std::uint8_t* begin = buf.data();
  std::map<std::string, lutb::TensorView> tensors;
  std::vector<std::string> names;
  std::map<std::string, std::string> metadata;
  try {
    lutb::SafetensorsFile::parse_header(begin, buf.size(), "fuzz-input", tensors, names, metadata);
  } catch (const lutb::SafetensorsError&) {
    return 0;
  }
  if (names.size() != tensors.size()) std::abort();
  std::size_t covered = 0;
  for (const auto& [name, v] : tensors) {
    if (v.data < begin || v.data + v.nbytes > begin + buf.size()) std::abort();
    if (static_cast<std::uint64_t>(v.numel()) * lutb::dtype_size(v.dtype) != v.nbytes) std::abort();
    covered += v.nbytes;
    if (lutb::dtype_is_float_source(v.dtype) || v.dtype == lutb::DType::F8_E4M3) {
      const std::vector<float> f = v.to_float();
      if (f.size() != static_cast<std::size_t>(v.numel())) std::abort();
    }
  }
  // The tensors cover the data buffer exactly.
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | begin[i];
  if (covered != buf.size() - 8 - n) std::abort();
  return 0;
}
