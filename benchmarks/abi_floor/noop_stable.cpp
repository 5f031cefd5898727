// An operator with fasthooks::accumulate_stats's schema that does nothing, on torch's stable ABI:
// what the calling convention alone costs.
#include <Python.h>
#include <torch/csrc/stable/library.h>

using torch::stable::Tensor;

void noop(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
          const Tensor&, int64_t, double, double, double) {}

STABLE_TORCH_LIBRARY(noop_stable, m) {
  m.def(
      "noop(Tensor x, Tensor(a!) state, Tensor(b!) stats, Tensor(c!) extra, Tensor(d!) hist, "
      "Tensor(e!) workspace, Tensor cursor, int slot, float near_zero, float hist_min, "
      "float hist_max) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(noop_stable, CPU, m) { m.impl("noop", TORCH_BOX(&noop)); }

PyMODINIT_FUNC PyInit_noop_stable(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "noop_stable", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
