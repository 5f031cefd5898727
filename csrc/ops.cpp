// Operator schemas of fasthooks._C and the Python module entry point; kernels live per backend.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "cpu/capability.h"
#include "stats.h"

TORCH_LIBRARY(fasthooks, m) {
  m.def(
      "accumulate_stats(Tensor x, Tensor(a!) state, Tensor(b!) stats, Tensor(c!) extra, "
      "Tensor(d!) hist, Tensor(e!) workspace, Tensor cursor, int slot, float near_zero, "
      "float hist_min, float hist_max) -> ()");
  m.def("cpu_capability() -> str", [] { return std::string(fasthooks::cpu_capability_name()); });
  // The plane order the kernels were built with, checked against fasthooks/layout.py.
  // "state planes;extra planes", each a comma-separated list.
  m.def("layout() -> str", [] {
    std::string out;
    for (const char* name : fasthooks::kStatePlaneNames) out += std::string(name) + ",";
    out.back() = ';';
    for (const char* name : fasthooks::kExtraPlaneNames) out += std::string(name) + ",";
    out.pop_back();
    return out;
  });
}

// Importing fasthooks._C runs the registrations above; the module itself exposes nothing.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
