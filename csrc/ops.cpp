// Operator schemas of fasthooks._C and the Python module entry point; kernels live per backend.
// Everything goes through torch's stable ABI, so one binary serves every torch from 2.10 on.
#include <Python.h>
#include <torch/csrc/stable/library.h>

#include <string>

#include "cpu/capability.h"
#include "schemas.h"
#include "stats.h"

namespace fasthooks {
namespace {

std::string cpu_capability() { return cpu_capability_name(); }

// The plane order the kernels were built with, checked against fasthooks/layout.py:
// "state planes;extra planes", each a comma-separated list.
std::string layout() {
  std::string out;
  for (const char* name : kStatePlaneNames) out += std::string(name) + ",";
  out.back() = ';';
  for (const char* name : kExtraPlaneNames) out += std::string(name) + ",";
  out.pop_back();
  return out;
}

}  // namespace
}  // namespace fasthooks

STABLE_TORCH_LIBRARY(fasthooks, m) {
  m.def(fasthooks::kAccumulateStatsSchema);
  m.def(fasthooks::kAccumulateStatsListSchema);
  m.def("cpu_capability() -> str");
  m.def("layout() -> str");
}

STABLE_TORCH_LIBRARY_IMPL(fasthooks, CompositeExplicitAutograd, m) {
  m.impl("cpu_capability", TORCH_BOX(&fasthooks::cpu_capability));
  m.impl("layout", TORCH_BOX(&fasthooks::layout));
}

// Importing fasthooks._C runs the registrations above; the module itself exposes nothing.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
