// The dtypes the operator reads, dispatched once for every backend: the CPU operator, the CUDA
// operator and the CUDA-on-CPU harness call a generic function with a tag of the element type.
#pragma once

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include "checks.h"

namespace fasthooks {

template <typename T>
struct DtypeTag {
  using type = T;
};

// f(DtypeTag<T>{}) for x's element type T: float, double, Half or BFloat16.
template <typename F>
decltype(auto) dispatch_dtype(ScalarType dtype, F&& f) {
  switch (dtype) {
    case ScalarType::Float:
      return f(DtypeTag<float>{});
    case ScalarType::Double:
      return f(DtypeTag<double>{});
    case ScalarType::Half:
      return f(DtypeTag<torch::headeronly::Half>{});
    case ScalarType::BFloat16:
      return f(DtypeTag<torch::headeronly::BFloat16>{});
    default:
      fail("accumulate_stats: unsupported dtype ", dtype);
  }
}

// The position of a dtype among those dispatched, for grouping a list's tensors by dtype.
inline constexpr int kDtypes = 4;
inline int dtype_position(ScalarType dtype) {
  switch (dtype) {
    case ScalarType::Float:
      return 0;
    case ScalarType::Double:
      return 1;
    case ScalarType::Half:
      return 2;
    default:
      return 3;  // bfloat16: check_accumulate_args refused any other
  }
}

// The dtype at a position: dtype_position's inverse.
inline ScalarType dtype_at(int position) {
  constexpr ScalarType kAt[kDtypes] = {ScalarType::Float, ScalarType::Double, ScalarType::Half,
                                       ScalarType::BFloat16};
  return kAt[position];
}

}  // namespace fasthooks
