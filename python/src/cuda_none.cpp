// bind_cuda of a build without the CUDA backend: only has_cuda() == False.
#include "module.hpp"

namespace lutb::python {

void bind_cuda(nanobind::module_& m) {
  m.def("has_cuda", [] { return false; });
}

}  // namespace lutb::python
