// Argument checks shared by every backend of fasthooks::accumulate_stats.
#pragma once

#include <ATen/core/Tensor.h>

namespace fasthooks {

// Checks every argument but the cursor's value, which is checked where it can be read. Returns
// whether every statistic is wanted (a 9-plane state with an extras buffer) or mean and std only.
bool check_accumulate_args(const at::Tensor& x, const at::Tensor& state, const at::Tensor& stats,
                           const at::Tensor& extra, const at::Tensor& hist,
                           const at::Tensor& workspace, const at::Tensor& cursor, int64_t slot,
                           double hist_min, double hist_max);

}  // namespace fasthooks
