// What the host and the device code of the CUDA kernels share: the block shape, the workspace
// layout, the buffers a kernel writes and the table of the list kernel. NVRTC compiles it with
// the kernels (accumulate_kernel.cuh); the host side (launch_plan.h) fills what it declares.
#pragma once

#include "../channels.h"
#include "../device_base.h"
#include "../stats.h"
#include "../top.h"

namespace fasthooks {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Resident blocks per multiprocessor the kernels are compiled for (__launch_bounds__): at most
// 65536 / (3 * 256) = 85 registers a thread.
constexpr int kMinBlocksPerSM = 3;
constexpr int kVecBytes = 16;
// How a kernel counts histogram bins. Up to kThreadBins bins, each thread counts in its own
// column of shared memory (a plain add: no atomics, no bank conflicts, whatever the values); more
// bins share one table per block, the lanes of a warp that share a bin adding once by an atomic.
constexpr int kNoHistogram = 0;
constexpr int kBinsPerThread = 1;
constexpr int kBinsPerBlock = 2;
// A column of kThreadBins + 2 counters (the first and the last for values in no bin) for each of
// kThreads threads: 42 KB, within the 48 KB a launch may ask for without opting in to more, and
// three blocks fit an A100's, H100's, H200's or B200's multiprocessor.
constexpr int64_t kThreadBins = 40;
// Loads a thread issues before it uses the first of them (a load and its base's with Diff): as
// many as the registers hold beside the statistics', which keeps twice what an H200 needs to
// hide its memory's latency in flight where ptxas allows (benchmarks/cuda_roofline.py). Fewer
// where the statistics are kept in double, or where a block's bin search or binade count and
// 16-bit unpacking would otherwise spill in the loop.
template <typename T, bool Full, int Hist, bool Binades, bool Diff>
C10_HOST_DEVICE constexpr int loads_in_flight() {
  if (!Full && Hist == kNoHistogram && !Binades) return Diff ? 4 : (sizeof(T) == 4 ? 8 : 6);
  const bool tight = sizeof(T) == 8 || (sizeof(T) == 2 && (Hist == kBinsPerBlock || Binades));
  return Diff ? (tight ? 2 : 3) : (tight ? 4 : 6);
}
// Per-block partial results: one Stats, as the state planes.
constexpr int64_t kPartials = kFullPlanes;
// Shared memory is sized for the most bins fasthooks/layout.py allows.
constexpr int64_t kMaxBins = 2048;

// The bin edges (bin_table's lower) and the bin counters a kernel keeps in dynamic shared memory:
// per block one table, per thread a column a thread.
C10_HOST_DEVICE constexpr int64_t bin_edges(int hist) {
  return hist == kNoHistogram ? 0 : (hist == kBinsPerThread ? kThreadBins : kMaxBins) + 1;
}
C10_HOST_DEVICE constexpr int64_t bin_counters(int hist) {
  return hist == kBinsPerThread ? kThreads * (kThreadBins + 2)
                                : (hist == kBinsPerBlock ? kMaxBins : 0);
}
// Loads of a thread summed around one shift before they merge into its moments in double.
constexpr int kSegmentLoads = 64;

// Tensors one launch of the list kernel takes: their table (TensorTable) fits the 4 KB of kernel
// arguments.
constexpr int kListTensors = 64;

// The workspace (fasthooks/layout.py mirrors it): kRegions regions of kMaxBlocks partials each,
// then kListTensors finished-blocks counters per region (each in a double's place), then the
// count of calls that found the cursor past the buffers' capacity. Calls that may run at the same
// time (on different streams, or a captured graph beside eager calls) are given different
// regions by the host.
constexpr int64_t kMaxBlocks = 2048;
constexpr int64_t kRegions = 8;
constexpr int64_t kRegionDoubles = kPartials * kMaxBlocks;
constexpr int64_t kCountersAt = kRegions * kRegionDoubles;
constexpr int64_t kDroppedAt = kCountersAt + kRegions * kListTensors;
constexpr int64_t kWorkspaceDoubles = kDroppedAt + 1;
// With top_k, the workspace goes on with each region's per-block lists of k pairs: kept only by
// runs that ask for top_k, sized for their k.
C10_HOST_DEVICE constexpr int64_t top_region_doubles(int64_t k) { return kMaxBlocks * k * 2; }
C10_HOST_DEVICE constexpr int64_t workspace_doubles(int64_t top_k) {
  return kWorkspaceDoubles + kRegions * top_region_doubles(top_k);
}

template <typename T, int Width>
struct alignas(Width * sizeof(T)) Load {
  T val[Width];
};

// Half and bfloat16 values are summed in float, as torch's own reductions do.
template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};

struct Buffers {
  double* state;
  float* stats;
  float* extra;
  int64_t* hist;
  int32_t* binades;  // the "binades" extra's (modules, capacity, kBinadeBins); null without it
  const int64_t* cursor;
  double* partials;        // the call's region
  unsigned int* finished;  // the region's kListTensors counters, each a double apart
  unsigned long long* dropped;
  int64_t* order;  // the call order (stats.h, note_call_order); null when the run keeps none
  unsigned long long* clock;
  int64_t slot;
  int64_t modules;
  int64_t capacity;
  int64_t bins;
  double near_zero;
  double hist_min;
  double hist_max;
};

// The top_k option's, an argument of the one-tensor kernels of its own (Buffers keeps its size,
// so the list kernel its code): the slot rows (modules, capacity, k, 2), null without top_k; the
// call's region of per-block lists; the channel of each position.
struct TopBuffers {
  double* rows;
  double* lists;
  int64_t k;
  ChannelMap channels;
};

// The channel statistics' (channels.h), an argument of the one-tensor kernels of their own too:
// the run's kChannelPlanes planes of `room` doubles, null without them; the channel of each
// position (channel_region and channel_offset included); the values each channel has in the call.
struct ChannelBuffers {
  double* row;
  int64_t room;
  ChannelMap channels;
  double per_channel;
};

// One launch of the list kernel: up to kListTensors tensors of one dtype, tensor t taking blocks
// [first_block[t], first_block[t + 1]) and its partials at those indices.
struct TensorTable {
  const void* x[kListTensors];
  const void* base[kListTensors];  // null without a base
  int64_t n[kListTensors];
  int64_t head[kListTensors];
  int64_t slot[kListTensors];
  int32_t first_block[kListTensors + 1];
  int32_t count;
};

}  // namespace cuda
}  // namespace fasthooks
