// The operators' schemas, declared once: fasthooks._C registers them, and so does the CUDA-on-CPU
// harness (tests/cuda_on_cpu/) under a namespace of its own, so both take the same arguments.
#pragma once

namespace fasthooks {

inline constexpr const char* kAccumulateStatsSchema =
    "accumulate_stats(Tensor x, Tensor(a!) state, Tensor(b!) stats, Tensor(c!) extra, "
    "Tensor(d!) hist, Tensor(e!) binades, Tensor(f!) top, Tensor(g!) channels, "
    "Tensor(h!) workspace, Tensor(i!) order, Tensor(j!) clock, Tensor cursor, int slot, "
    "float near_zero, float hist_min, float hist_max, int channel_dim=-1, int channel_offset=0, "
    "int channel_region=0) -> ()";

// xs[i] into slot i; with bases, the statistics of xs[i] - bases[i] (parameters' updates).
inline constexpr const char* kAccumulateStatsListSchema =
    "accumulate_stats_list(Tensor[] xs, Tensor[] bases, Tensor(a!) state, Tensor(b!) stats, "
    "Tensor(c!) extra, Tensor(d!) hist, Tensor(e!) workspace, Tensor cursor, float near_zero, "
    "float hist_min, float hist_max) -> ()";

}  // namespace fasthooks
