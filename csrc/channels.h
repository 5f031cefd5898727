// Per-channel statistics: running sums per channel, added to by every call until the recorder
// takes a snapshot and clears them. Every module of a run shares one buffer of kChannelPlanes
// planes, each module's channels a region of it from channel_region, so it takes the channels the
// modules have, not modules times the widest. channel_offset (where a sharded output's local
// channel 0 lies in the whole tensor) adds to it, as it adds to the top_k channels. Shared by the
// CPU and CUDA kernels; fasthooks/moments.py (channel_sums) computes the same planes.
#pragma once

#include "stats.h"

namespace fasthooks {

// The planes of the buffer, each as many doubles as the run keeps channels
// (fasthooks/layout.py, CHANNEL_PLANES).
enum ChannelPlane { kChannelCount, kChannelSum, kChannelSumSq, kChannelAbsmax, kChannelActive };
constexpr int kChannelPlanes = kChannelActive + 1;
// The largest magnitudes merge with stats.h's nan_max: NaN once either is NaN.

}  // namespace fasthooks
