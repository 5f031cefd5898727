// Argument checks shared by every backend of fasthooks::accumulate_moments.
#pragma once

#include <ATen/core/Tensor.h>

namespace fasthooks {

// Checks x, state, cursor and slot; the cursor's value is checked where it can be read.
void check_accumulate_args(const at::Tensor& x, const at::Tensor& state, const at::Tensor& cursor,
                           int64_t slot);

// Elements in one plane (count, mean or m2) of a contiguous (3, modules, batches) state.
inline int64_t state_plane(const at::Tensor& state) { return state.size(1) * state.size(2); }

}  // namespace fasthooks
