// How the host cuts a call into launches, and which kernel each launch runs: plain C++, shared by
// the CUDA operator (accumulate_cuda.cpp) and the CUDA-on-CPU harness (tests/cuda_on_cpu/).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernel_layout.h"

namespace fasthooks {
namespace cuda {

// The kernel's view of a run's buffers, for a call that uses workspace region `region`.
inline Buffers buffers_for(double* state, float* stats, float* extra, int64_t* hist,
                           const int64_t* cursor, double* workspace, int64_t region, int64_t slot,
                           int64_t modules, int64_t capacity, int64_t bins, double near_zero,
                           double hist_min, double hist_max) {
  Buffers b{};
  b.state = state;
  b.stats = stats;
  b.extra = extra;
  b.hist = hist;
  b.cursor = cursor;
  b.partials = workspace + region * kRegionDoubles;
  b.finished = reinterpret_cast<unsigned int*>(workspace + kCountersAt + region * kListTensors);
  b.dropped = reinterpret_cast<unsigned long long*>(workspace + kDroppedAt);
  b.slot = slot;
  b.modules = modules;
  b.capacity = capacity;
  b.bins = bins;
  b.near_zero = near_zero;
  b.hist_min = hist_min;
  b.hist_max = hist_max;
  return b;
}

// How a call of n values at x (and at base, when given) is cut: `head` scalar values up to the
// first 16-byte boundary, then 16-byte vectors, then the scalar rest; `blocks` blocks of kThreads
// threads, at most `resident` (the grid-stride loops cover the rest). A base whose values are not
// aligned as x's are is read with scalar loads throughout.
struct LaunchPlan {
  int64_t head;
  int64_t blocks;
};

template <typename T>
int64_t head_of(const T* x, const T* base, int64_t n) {
  const auto misalignment = static_cast<int64_t>(reinterpret_cast<uintptr_t>(x) % kVecBytes);
  const bool base_aligned =
      base == nullptr ||
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(base) % kVecBytes) == misalignment;
  // Values that do not sit on their own size's boundary never reach a vector boundary.
  const int64_t head =
      !base_aligned || misalignment % static_cast<int64_t>(sizeof(T)) != 0
          ? n
          : (kVecBytes - misalignment) % kVecBytes / static_cast<int64_t>(sizeof(T));
  return head < n ? head : n;
}

// Blocks worth giving n values of T, at most `resident`.
template <typename T>
int64_t blocks_for(int64_t n, int64_t resident) {
  const int64_t per_block = kThreads * (kVecBytes / static_cast<int64_t>(sizeof(T)));
  const int64_t blocks = (n + per_block - 1) / per_block;
  return blocks < resident ? blocks : resident;
}

template <typename T>
LaunchPlan plan_launch(const T* x, const T* base, int64_t n, int64_t resident) {
  const int64_t blocks = blocks_for<T>(n, resident);
  return {head_of(x, base, n), blocks < kMaxBlocks ? blocks : kMaxBlocks};
}

// Fills `table` with tensors [begin, end) of (x, base, n, slot), end - begin <= kListTensors and
// none empty: each gets its share of `resident` blocks (at least one), in all at most kMaxBlocks.
template <typename T>
void plan_table(TensorTable& table, const T* const* x, const T* const* base, const int64_t* n,
                const int64_t* slot, int64_t begin, int64_t end, int64_t resident) {
  int64_t blocks[kListTensors];
  int64_t total = 0, wanted = 0;
  for (int64_t i = begin; i < end; ++i) {
    blocks[i - begin] = blocks_for<T>(n[i], resident);
    wanted += blocks[i - begin];
  }
  const int64_t count = end - begin;
  table.count = static_cast<int32_t>(count);
  table.first_block[0] = 0;
  for (int64_t t = 0; t < count; ++t) {
    int64_t b = blocks[t];
    if (wanted > kMaxBlocks) b = 1 + (b - 1) * (kMaxBlocks - count) / (wanted - count);
    table.x[t] = x[begin + t];
    table.base[t] = base != nullptr ? base[begin + t] : nullptr;
    table.n[t] = n[begin + t];
    table.head[t] =
        head_of(x[begin + t], base != nullptr ? base[begin + t] : nullptr, n[begin + t]);
    table.slot[t] = slot[begin + t];
    total += b;
    table.first_block[t + 1] = static_cast<int32_t>(total);
  }
}

// Calls launch(table) for each launch of the list kernel over `count` non-empty tensors.
template <typename T, typename Launch>
void for_each_table(const T* const* x, const T* const* base, const int64_t* n, const int64_t* slot,
                    int64_t count, int64_t resident, Launch&& launch) {
  for (int64_t begin = 0; begin < count; begin += kListTensors) {
    const int64_t end = begin + kListTensors < count ? begin + kListTensors : count;
    TensorTable table{};
    plan_table(table, x, base, n, slot, begin, end, resident);
    launch(table);
  }
}

// Which kernel a launch runs: accumulate_stats_kernel or, for a list, accumulate_list_kernel,
// instantiated for a dtype (its dtype_position), the statistics asked for, how a histogram of
// `bins` bins is counted (kernel_layout.h) and whether binades, top_k and channel statistics
// are. With a base (diff), every statistic is; binades, top_k and channel statistics only by
// accumulate_stats_kernel of values, not of a difference.
struct KernelVariant {
  int dtype;
  bool list;
  bool full;
  int hist;
  bool diff;
  bool binades;
  bool top;
  bool channels;
};

inline KernelVariant variant_of(int dtype, bool list, bool full, int64_t bins, bool diff,
                                bool binades, bool top, bool channels) {
  const int hist =
      bins == 0 ? kNoHistogram : (bins <= kThreadBins ? kBinsPerThread : kBinsPerBlock);
  const bool values = !list && !diff;
  return {
      dtype, list, full || diff, hist, diff, binades && values, top && values, channels && values};
}

// float64 values are summed in double, every other dtype in float (Accumulator).
inline bool sums_in_double(const KernelVariant& v) { return v.dtype == 1; }

// The dynamic shared memory of a kernel counting a histogram as `hist` says, its bin edges `acc`
// bytes each: the edges and the bin counters.
constexpr size_t histogram_bytes(int hist, size_t acc) {
  return static_cast<size_t>(bin_edges(hist)) * acc +
         static_cast<size_t>(bin_counters(hist)) * sizeof(unsigned int);
}
inline size_t shared_bytes(const KernelVariant& v) {
  return histogram_bytes(v.hist, sums_in_double(v) ? sizeof(double) : sizeof(float));
}
// A kernel launched with more dynamic shared memory than 48 KB must opt in first; none needs to.
static_assert(histogram_bytes(kBinsPerThread, sizeof(double)) <= 48 * 1024 &&
                  histogram_bytes(kBinsPerBlock, sizeof(double)) <= 48 * 1024,
              "a histogram outgrows the 48 KB of shared memory a launch gets without opting in");

}  // namespace cuda
}  // namespace fasthooks
