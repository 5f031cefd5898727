// The same do-nothing operator on torch's C++ API.
#include <Python.h>
#include <torch/library.h>

void noop(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
          const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, double,
          double) {}

TORCH_LIBRARY(noop_cpp_api, m) {
  m.def(
      "noop(Tensor x, Tensor(a!) state, Tensor(b!) stats, Tensor(c!) extra, Tensor(d!) hist, "
      "Tensor(e!) workspace, Tensor cursor, int slot, float near_zero, float hist_min, "
      "float hist_max) -> ()");
}

TORCH_LIBRARY_IMPL(noop_cpp_api, CPU, m) { m.impl("noop", &noop); }

PyMODINIT_FUNC PyInit_noop_cpp_api(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "noop_cpp_api", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
