// Per-channel statistics: one module's running sums per channel, added to by every call until
// the recorder takes a snapshot and clears them. Shared by the CPU and CUDA kernels;
// fasthooks/moments.py (channel_sums) computes the same planes.
#pragma once

#include "stats.h"

namespace fasthooks {

// The planes of a row, each max_channels doubles (fasthooks/layout.py, CHANNEL_PLANES).
enum ChannelPlane { kChannelCount, kChannelSum, kChannelSumSq, kChannelAbsmax, kChannelActive };
constexpr int kChannelPlanes = kChannelActive + 1;
// The largest magnitudes merge with stats.h's nan_max: NaN once either is NaN.

}  // namespace fasthooks
