// Operator schemas of fasthooks._C and the Python module entry point; kernels live per backend.
#include <Python.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/capability.h"

namespace fasthooks {

void check_accumulate_args(const at::Tensor& x, const at::Tensor& state, const at::Tensor& cursor,
                           int64_t slot) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
      "accumulate_moments: x must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(state.scalar_type() == at::kDouble && state.dim() == 3 && state.size(0) == 3 &&
                  state.is_contiguous(),
              "accumulate_moments: state must be a contiguous float64 tensor of shape "
              "(3, modules, batches), got ",
              state.scalar_type(), " of shape ", state.sizes());
  TORCH_CHECK(cursor.scalar_type() == at::kLong && cursor.numel() == 1,
              "accumulate_moments: cursor must be a one-element int64 tensor, got ",
              cursor.scalar_type(), " of shape ", cursor.sizes());
  TORCH_CHECK(x.device() == state.device() && cursor.device() == state.device(),
              "accumulate_moments: x, state and cursor must be on one device, got x on ",
              x.device(), ", state on ", state.device(), ", cursor on ", cursor.device());
  TORCH_CHECK(slot >= 0 && slot < state.size(1), "accumulate_moments: slot must be in [0, ",
              state.size(1), "), got ", slot);
}

}  // namespace fasthooks

TORCH_LIBRARY(fasthooks, m) {
  m.def("accumulate_moments(Tensor x, Tensor(a!) state, Tensor cursor, int slot) -> ()");
  m.def("cpu_capability() -> str", [] { return std::string(fasthooks::cpu_capability_name()); });
}

// Importing fasthooks._C runs the registrations above; the module itself exposes nothing.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
