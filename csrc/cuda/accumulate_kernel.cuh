// Device code of fasthooks::accumulate_stats on CUDA. NVRTC compiles it where it runs, one kernel
// instantiation at a time (kernel_compiler.cpp); tests/cuda_on_cpu/ compiles the same file for the
// host against an emulation of the device API and runs it on the CPU. So it holds no host runtime
// call: what needs a device (streams, occupancy, launches) is in accumulate_cuda.cpp.
//
// Every thread keeps central moments, extremes and counts of a grid-stride range, summing powers
// of (x - its running mean) segment by segment; blocks merge them into partials in the
// workspace, and the last block to finish merges those in block order (so the result is
// deterministic), merges them into the state slot at the device-side cursor, writes the
// finalised statistics and resets the finished-blocks counter for the next call. Histograms are
// counted in shared memory (kernel_layout.h: per thread for few bins, per block for more) and
// added to the slot's row at the end of the block; so are binades (the "binades" extra), per
// block, in kernels of their own. With top_k (kernels of their own too), each warp keeps the k
// pairs of largest magnitude it has seen in shared memory; each block writes its warps' best to
// the workspace, and the last block merges those with the slot's row (top.h: a total order, so
// the result is the same whatever the blocks and the order they finish in). With channel
// statistics (kernels of their own too), the blocks add each channel's sums to the module's row
// first, in a pass of their own (channel_sums.cuh).
#pragma once

// The block's dynamic shared memory; the emulation defines its own before including this file.
#ifndef FASTHOOKS_DYNAMIC_SHARED
#define FASTHOOKS_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif
// A device function kept out of line (a slow path); the emulation spells it its own way.
#ifndef FASTHOOKS_NOINLINE
#define FASTHOOKS_NOINLINE __noinline__
#endif

#include "../binades.h"
#include "../histogram.h"
#include "channel_sums.cuh"
#include "kernel_layout.h"

namespace fasthooks {
namespace cuda {

template <bool Full>
__device__ Stats shuffle_down(const Stats& s, int offset) {
  constexpr int fields = Full ? kFullPlanes : kBasicPlanes;
  double v[kFullPlanes];
  store_state<Full>(v, 1, s);
  for (int f = 0; f < fields; ++f) v[f] = __shfl_down_sync(0xffffffffu, v[f], offset);
  return load_state<Full>(v, 1);
}

// Merges s over the block in a fixed order; the result is valid in thread 0.
template <bool Full>
__device__ void block_reduce(Stats& s) {
  __shared__ double shared[kWarps][kFullPlanes];
  for (int offset = 16; offset > 0; offset /= 2) {
    const Stats other = shuffle_down<Full>(s, offset);
    s = merge<Full>(s, other);
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __syncthreads();  // the shared array may still be read by an earlier call
  if (lane == 0) store_state<Full>(shared[warp], 1, s);
  __syncthreads();
  if (warp == 0) {
    s = lane < kWarps ? load_state<Full>(shared[lane], 1) : Stats{};
    for (int offset = kWarps / 2; offset > 0; offset /= 2) {
      const Stats other = shuffle_down<Full>(s, offset);
      if (lane + offset < kWarps) s = merge<Full>(s, other);
    }
  }
}

// Extremes and counts of a thread's values; the extremes become NaN once a value is. A
// thread's counts fit 32 bits: its grid-stride share of even 2^40 values is far below 2^32.
// Within a segment the near-zero count is kept in float, each value's a compare that gives 1.0
// or 0.0 and an add (a predicated integer increment compiles to two instructions and a compare):
// exact, as a segment holds at most kSegmentLoads * 8 values (16-byte loads of 2-byte values).
// Non-finite values are counted only in a segment that holds one (thread_pass).
template <typename Acc>
struct Extremes {
  Acc min = static_cast<Acc>(INFINITY);
  Acc max = static_cast<Acc>(-INFINITY);
  unsigned int near_zero = 0;
  unsigned int nonfinite = 0;
  float segment_near_zero = 0.0f;
  // With kPairedExtremes, in place of min and max until the block merges (set to infinities
  // of the format by accumulate_block).
  uint32_t min_pair = 0;
  uint32_t max_pair = 0;

  __device__ void end_segment() {
    near_zero += static_cast<unsigned int>(segment_near_zero);
    segment_near_zero = 0.0f;
  }
};

// The minimum and maximum of a and b, NaN when either is: one instruction each from sm_80 on.
__device__ inline float min_or_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? a + b : fmin(a, b);
#endif
}
__device__ inline float max_or_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? a + b : fmax(a, b);
#endif
}
__device__ inline double min_or_nan(double a, double b) {
  return a != a || b != b ? a + b : fmin(a, b);
}
__device__ inline double max_or_nan(double a, double b) {
  return a != a || b != b ? a + b : fmax(a, b);
}

// 16-bit values read as they are (not a difference) keep their extremes as pairs of lanes in
// one 32-bit word, each lane the extreme of every other value of its load: a min.NaN and a
// max.NaN of two values at a time, half the instructions of one value at a time.
template <typename T, bool Diff>
constexpr bool kPairedExtremes = sizeof(T) == 2 && !Diff;

// A lane's bits: those of infinity, above which (sign aside) a lane is NaN.
template <typename T>
constexpr uint32_t kInfinityBits = 0x7f80u;  // bfloat16
template <>
constexpr uint32_t kInfinityBits<c10::Half> = 0x7c00u;

// Lane a or b (16 bits each): the larger (Max) or the smaller, NaN where either is. Floats of
// one sign order as their magnitudes' bits, so a key that flips the negative ones orders all.
template <typename T, bool Max>
__device__ inline uint32_t lane_extreme(uint32_t a, uint32_t b) {
  if ((a & 0x7fffu) > kInfinityBits<T>) return a;
  if ((b & 0x7fffu) > kInfinityBits<T>) return b;
  const auto key = [](uint32_t h) { return h & 0x8000u ? ~h & 0xffffu : h | 0x8000u; };
  return (key(a) < key(b)) == Max ? b : a;
}

// The extremes of two pairs, lane by lane: one instruction each from sm_80 on.
template <typename T, bool Max>
__device__ inline uint32_t pair_extreme(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  if constexpr (kInfinityBits<T> == kInfinityBits<c10::Half>) {
    if constexpr (Max) {
      asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    } else {
      asm("min.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    }
  } else if constexpr (Max) {
    asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  } else {
    asm("min.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  }
  return r;
#else
  return lane_extreme<T, Max>(a & 0xffffu, b & 0xffffu) | lane_extreme<T, Max>(a >> 16, b >> 16)
                                                              << 16;
#endif
}

// Lane k (0 or 1) of a pair as a float.
template <typename T>
__device__ inline float lane_value(uint32_t pair, int k) {
  T t;
  t.x = static_cast<uint16_t>(pair >> (16 * k));
  return static_cast<float>(t);
}

// The largest finite Acc: a value is finite exactly when its magnitude is at most this.
template <typename Acc>
constexpr Acc kLargest = static_cast<Acc>(3.4028234663852886e38);
template <>
constexpr double kLargest<double> = 1.7976931348623157e308;

template <typename Acc>
__device__ Acc finite_or_zero(Acc v) {
  return v - v == Acc(0) ? v : Acc(0);  // an infinite or NaN shift would poison every value
}

// The guess truncated to an unsigned integer as the hardware converts: NaN and negative values
// give 0, values past the range its largest; one instruction, where clamping in float took two.
__device__ inline uint32_t truncate_unsigned(float v) { return __float2uint_rz(v); }
__device__ inline uint32_t truncate_unsigned(double v) { return __double2uint_rz(v); }

// The bin of v, -1 below the range or for NaN, `bins` above it (so a thread's column needs no
// range check: it has a row for each), from lower[k] for k <= bins, lower[bins] the value after
// the top edge. For v's exact position x (in bins from lo), the guess is x + 1 - 1/16 by one fused
// multiply-add, off by under 2^-5: bins_resolvable bounds |lo| * scale, and |v| * scale in the
// range, by 2^16, so the roundings of lo, scale and three operations add at most 7 * 2^-8. So the
// guess lies in (x, x + 1], and its floor is v's bin or the next; the edge settles which.
template <typename Acc>
__device__ int32_t bin_or_outside(Acc v, const BinTable<Acc>& t) {
  constexpr Acc kLow = Acc(1) - Acc(0.0625);
  const Acc guess = fma(v, t.scale, kLow - t.lo * t.scale);
  const uint32_t truncated = truncate_unsigned(guess);
  const auto bins = static_cast<uint32_t>(t.bins);
  const auto next = static_cast<int32_t>(truncated < bins ? truncated : bins);
  return v >= t.lower[next] ? next : next - 1;  // NaN guessed 0, and is below lower[0]
}

// Where one thread counts its values' bins in shared memory: with kBinsPerThread its own column
// (bin k at counts[k * kThreads], values in no bin at k = -1 and k = bins), with kBinsPerBlock
// the block's table; and their binades in the block's table of kBinadeBins (null without).
struct BinCounts {
  unsigned int* counts;
  unsigned int* binades;
  unsigned int below;  // the lanes of this thread's warp below it
};

// Counts v's bin: in the thread's own column, or in the block's table, where lanes that share a
// bin add once, together, by the lowest of them.
template <int Hist, typename Acc>
__device__ void count_bin(Acc v, const BinTable<Acc>& table, const BinCounts& hist) {
  const int32_t bin = bin_or_outside(v, table);
  if constexpr (Hist == kBinsPerThread) {
    hist.counts[bin * kThreads] += 1;
  } else {
    const unsigned int peers = __match_any_sync(__activemask(), bin);
    const bool in_range = static_cast<uint32_t>(bin) < static_cast<uint32_t>(table.bins);
    if ((peers & hist.below) == 0 && in_range) {
      atomicAdd(hist.counts + bin, static_cast<unsigned int>(__popc(peers)));
    }
  }
}

// The binade of a value from its bits (binades.h). 16-bit values come converted to float, which
// holds each exactly, its subnormals as normal floats: the float's exponent is the value's binade,
// the bin binade_of_half_bits and binade_of_bfloat16_bits give, and the conversion is already made
// for the other statistics.
__device__ inline int32_t binade_of(float v) { return binade_of_bits(__float_as_uint(v)); }
__device__ inline int32_t binade_of(double v) {
  return binade_of_bits(static_cast<uint64_t>(__double_as_longlong(v)));
}

// Counts v's binade in the block's table as count_bin counts a block's bins: lanes that share a
// binade add once, together, by the lowest of them, so a warp of like values makes one
// shared-memory atomic, not 32 that wait on each other.
template <typename Acc>
__device__ void count_binade(Acc v, const BinCounts& hist) {
  const int32_t bin = binade_of(v);
  const unsigned int peers = __match_any_sync(__activemask(), bin);
  if ((peers & hist.below) == 0) {
    atomicAdd(hist.binades + bin, static_cast<unsigned int>(__popc(peers)));
  }
}

// The block's binade counters in shared memory: a table of each kernel that counts them.
template <bool Binades>
__device__ unsigned int* binade_table() {
  if constexpr (Binades) {
    __shared__ unsigned int table[kBinadeBins];
    return table;
  }
  return nullptr;
}

// The bin counts of every thread's column summed, a warp to a bin, and added to `row`.
__device__ inline void add_thread_columns(const unsigned int* columns, int64_t bins, int64_t* row) {
  const int lane = threadIdx.x % 32;
  for (int64_t k = threadIdx.x / 32; k < bins; k += kWarps) {
    unsigned int count = 0;
    for (int t = lane; t < kThreads; t += 32) count += columns[k * kThreads + t];
    for (int offset = 16; offset > 0; offset /= 2)
      count += __shfl_down_sync(0xffffffffu, count, offset);
    if (lane == 0 && count != 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(row + k),
                static_cast<unsigned long long>(count));
    }
  }
}

// The top_k lists of a block in shared memory: one per warp, ordered by ranks_before, with its
// floor (the magnitude of its last pair once full: values below it cannot enter) and a lock.
template <typename Acc>
struct TopLists {
  TopPair lists[kWarps][kMaxTopK];
  Acc floors[kWarps];
  unsigned int locks[kWarps];
};

template <typename Acc>
__device__ TopLists<Acc>* top_lists() {
  __shared__ TopLists<Acc> lists;
  return &lists;
}

__device__ inline TopPair empty_pair() {
  const double nan = __longlong_as_double(0x7ff8000000000000ll);  // as torch's NaN fill
  return {nan, nan};
}

// Offers p to the list of warp w under its lock (lanes of one warp may run apart, so they may
// offer at once too), raising its floor once full; whether p entered.
template <typename Acc>
__device__ bool offer_locked(TopLists<Acc>& t, int w, int k, const TopPair& p) {
  while (atomicCAS(&t.locks[w], 0u, 1u) != 0u) {
  }
  __threadfence_block();
  TopPair* list = t.lists[w];
  const bool entered = ranks_before(p, list[k - 1]);
  if (entered) {
    offer_top(list, k, p);
    const double last = list[k - 1].value;
    if (last == last) *static_cast<volatile Acc*>(&t.floors[w]) = static_cast<Acc>(fabs(last));
  }
  __threadfence_block();
  atomicExch(&t.locks[w], 0u);
  return entered;
}

// What a thread needs to offer its values: where the tensor starts (a value's position in
// memory order gives its channel), the channel map, k, and its copy of its warp's floor, never
// above the list's own (a stale copy only sends more loads down the slow path).
template <typename T, typename Acc>
struct TopCandidates {
  const T* x;
  ChannelMap map;
  int k;
  Acc floor;
};

// The slow path of a load with a value of magnitude at least the thread's floor: its `width`
// values at p, read again (from cache), offered one by one where they reach the warp's floor.
// Out of line, so the loop of the statistics keeps its registers. Returns the warp's floor.
template <typename T, typename Acc>
__device__ FASTHOOKS_NOINLINE Acc offer_candidates(const T* p, int width, const T* x,
                                                   ChannelMap map, int k) {
  TopLists<Acc>& t = *top_lists<Acc>();
  const int w = threadIdx.x / 32;
  const volatile Acc* floor = &t.floors[w];
  for (int j = 0; j < width; ++j) {
    const Acc value = static_cast<Acc>(p[j]);
    if (!(fabs(value) >= *floor)) continue;  // NaN never enters
    offer_locked(t, w, k,
                 {static_cast<double>(value), static_cast<double>(map.channel(p + j - x))});
  }
  return *floor;
}

// What a thread reads, Width values a load: x's values, or with Diff, x's minus the base's (a
// parameter's update: after its step minus before it), taken in Acc. Kernels without a base
// carry none: its loads would cost registers.
template <typename T, int Width, bool Diff>
struct Reader {
  const Load<T, Width>* x;
  const Load<T, Width>* base;  // null without Diff

  __device__ Load<T, Width> base_at(int64_t i) const {
    if constexpr (Diff) return base[i];
    return Load<T, Width>{};
  }
};

template <typename Acc, bool Diff, typename T, int Width>
__device__ Acc value_of(const Load<T, Width>& v, const Load<T, Width>& b, int k) {
  if constexpr (Diff) return static_cast<Acc>(v.val[k]) - static_cast<Acc>(b.val[k]);
  return static_cast<Acc>(v.val[k]);
}

// The mean of one load, the first shift of a thread: within about a standard deviation of the
// data unless the data are adversarial, which the far-shift check below catches.
template <typename Acc, typename T, int Width, bool Diff>
__device__ Acc load_mean(const Reader<T, Width, Diff>& r, int64_t i) {
  const Load<T, Width> v = r.x[i];
  const Load<T, Width> b = r.base_at(i);
  Acc sum = 0;
  for (int k = 0; k < Width; ++k) sum += value_of<Acc, Diff>(v, b, k);
  return finite_or_zero(sum / Width);
}

// Moments of one segment's values (loads begin, begin + step, ... before end) in double, around
// their own mean: for a segment whose float sums overflowed or underflowed (as one infinite or
// NaN value makes them), or whose shift proved far from its mean. With Full, the infinite and
// NaN values (in Acc, as the other statistics see them) are counted on the way.
template <typename Acc, bool Full, typename T, int Width, bool Diff>
__device__ Stats segment_in_double(const Reader<T, Width, Diff>& r, int64_t begin, int64_t end,
                                   int64_t step, unsigned int& nonfinite) {
  double sum = 0.0, count = 0.0;
  for (int64_t i = begin; i < end; i += step) {
    const Load<T, Width> v = r.x[i];
    const Load<T, Width> b = r.base_at(i);
    for (int k = 0; k < Width; ++k) {
      const Acc value = value_of<Acc, Diff>(v, b, k);
      sum += static_cast<double>(value);
      if constexpr (Full) nonfinite += !(fabs(value) <= kLargest<Acc>);
    }
    count += Width;
  }
  Stats s;
  s.count = count;
  s.mean = sum / count;  // kept as is: an infinite mean stays infinite
  for (int64_t i = begin; i < end; i += step) {
    const Load<T, Width> v = r.x[i];
    const Load<T, Width> b = r.base_at(i);
    for (int k = 0; k < Width; ++k) {
      const double d = static_cast<double>(value_of<Acc, Diff>(v, b, k)) - s.mean;
      s.m2 += d * d;
      if constexpr (Full) {
        s.m3 += d * d * d;
        s.m4 += d * d * d * d;
      }
    }
  }
  return s;
}

// Power sums around a segment's shift: of a group of loads in working precision, of the
// segment in double.
template <typename Acc>
struct PowerSums {
  Acc s1 = 0, s2 = 0, s3 = 0, s4 = 0;

  template <typename Other>
  __device__ void add(const PowerSums<Other>& o) {
    s1 += o.s1;
    s2 += o.s2;
    s3 += o.s3;
    s4 += o.s4;
  }
};

// Adds one load's values to a group's sums, extremes, counts, histogram and binades.
template <typename Acc, bool Full, int Hist, bool Binades, bool Diff, typename T, int Width>
__device__ void add_load(const Load<T, Width>& v, const Load<T, Width>& b, Acc shift, Acc near_zero,
                         const BinTable<Acc>& table, const BinCounts& hist, PowerSums<Acc>& a,
                         Extremes<Acc>& e) {
  constexpr bool kPaired = Full && kPairedExtremes<T, Diff> && Width % 2 == 0;
  if constexpr (kPaired) {
#pragma unroll
    for (int k = 0; k < Width; k += 2) {
      const uint32_t pair =
          static_cast<uint32_t>(v.val[k].x) | static_cast<uint32_t>(v.val[k + 1].x) << 16;
      e.min_pair = pair_extreme<T, false>(e.min_pair, pair);
      e.max_pair = pair_extreme<T, true>(e.max_pair, pair);
    }
  }
#pragma unroll
  for (int k = 0; k < Width; ++k) {
    const Acc value = value_of<Acc, Diff>(v, b, k);
    const Acc d = value - shift;
    const Acc d2 = d * d;
    a.s1 += d;
    a.s2 += d2;
    if constexpr (Full) {
      a.s3 += d2 * d;
      a.s4 += d2 * d2;
      if constexpr (!kPaired) {
        e.min = min_or_nan(e.min, value);
        e.max = max_or_nan(e.max, value);
      }
      e.segment_near_zero += value <= near_zero ? 1.0f : 0.0f;
    }
    if constexpr (Hist != kNoHistogram) count_bin<Hist>(value, table, hist);
    if constexpr (Binades) count_binade(value, hist);
  }
}

// With top_k, offers a load's values (read from `at`) to the warp's list when one reaches the
// thread's floor: a compare per value beside the statistics, the slow path only then.
template <typename Acc, typename T, int Width>
__device__ void offer_load(const Load<T, Width>& v, const T* at, TopCandidates<T, Acc>& top) {
  Acc largest = 0;  // NaN left out
#pragma unroll
  for (int k = 0; k < Width; ++k) largest = fmax(largest, fabs(value_of<Acc, false>(v, v, k)));
  if (largest >= top.floor) top.floor = offer_candidates<T, Acc>(at, Width, top.x, top.map, top.k);
}

// Adds the group of Loads loads at i, i + step, ... to `sums`: all issued before the first is
// used, summed in working precision, then added in double. Checked: loads at or past `end` are
// left out (a thread's last group). `top`: with top_k, its TopCandidates (kernels without it pass
// none, and keep their code).
template <typename Acc, bool Full, int Hist, bool Binades, int Loads, bool Checked, typename T,
          int Width, bool Diff, typename... Top>
__device__ void add_group(const Reader<T, Width, Diff>& r, int64_t i, int64_t end, int64_t step,
                          Acc shift, Acc near_zero, const BinTable<Acc>& table,
                          const BinCounts& hist, PowerSums<double>& sums, Extremes<Acc>& e,
                          Top&... top) {
  Load<T, Width> v[Loads];
  Load<T, Width> b[Loads];
#pragma unroll
  for (int u = 0; u < Loads; ++u) {
    if (!Checked || i + u * step < end) {
      v[u] = r.x[i + u * step];
      b[u] = r.base_at(i + u * step);
    }
  }
  PowerSums<Acc> group;
#pragma unroll
  for (int u = 0; u < Loads; ++u) {
    if (!Checked || i + u * step < end) {
      add_load<Acc, Full, Hist, Binades, Diff>(v[u], b[u], shift, near_zero, table, hist, group, e);
      (offer_load(v[u], reinterpret_cast<const T*>(r.x + i + u * step), top), ...);
    }
  }
  sums.add(group);
}

// A thread's share of `loads` loads of Width values: loads first, first + step, ... Each segment
// of kSegmentLoads is summed in working precision around the thread's running mean (at first,
// the mean of its first load), loads_in_flight loads at a time (each group's sums in working
// precision, added to the segment's in double), and merged into `moments` in double, so no
// choice of first values spoils the rest; extremes, counts, the histogram and binades are taken
// on the way, and with top_k (`top`, as add_group's) the top candidates.
template <typename Acc, bool Full, int Hist, bool Binades, typename T, int Width, bool Diff,
          typename... Top>
__device__ void thread_pass(const Reader<T, Width, Diff>& r, int64_t loads, int64_t first,
                            int64_t step, Acc near_zero, const BinTable<Acc>& table,
                            const BinCounts& hist, Stats& moments, Extremes<Acc>& e, Top&... top) {
  for (int64_t begin = first; begin < loads; begin += kSegmentLoads * step) {
    const Acc shift = moments.count > 0.0 ? finite_or_zero(static_cast<Acc>(moments.mean))
                                          : load_mean<Acc>(r, begin);
    const int64_t rest = (loads - begin + step - 1) / step;
    const int64_t segment_loads = rest < kSegmentLoads ? rest : kSegmentLoads;
    const int64_t end = begin + segment_loads * step;
    PowerSums<double> sums;
    constexpr int kInFlight = loads_in_flight<T, Full, Hist, Binades, Diff>();
    // Every group but a thread's last is whole: its loads need no bounds check. Beside the
    // per-thread bin counters ptxas then holds a group's second load back until the first is
    // used (half the bytes in flight, by cuda_roofline.py), so those kernels check every group.
    int64_t i = begin;
    if constexpr (Hist != kBinsPerThread) {
      const int64_t whole_end = begin + segment_loads / kInFlight * kInFlight * step;
      for (; i < whole_end; i += kInFlight * step) {
        add_group<Acc, Full, Hist, Binades, kInFlight, false>(r, i, end, step, shift, near_zero,
                                                              table, hist, sums, e, top...);
      }
    }
    for (; i < end; i += kInFlight * step) {
      add_group<Acc, Full, Hist, Binades, kInFlight, true>(r, i, end, step, shift, near_zero, table,
                                                           hist, sums, e, top...);
    }
    if constexpr (Full) e.end_segment();
    const auto count = static_cast<double>(segment_loads * Width);
    Stats segment;
    moments_from_shifted_sums<Full>(segment, count, shift, sums.s1, sums.s2, sums.s3, sums.s4);
    // The rounding error of the float sums grows with (mean - shift)^2 / variance: beyond two
    // standard deviations it could exceed 1e-7 of m2 (or more of m4). An infinite or NaN value
    // makes the sums infinite or NaN (finite values do so only by overflowing), so a segment
    // whose sums are finite holds no such value, and the others count theirs when read again.
    const double d = sums.s1 / count;
    const bool far = count * d * d > 4.0 * segment.m2 && isfinite(segment.mean);
    if (far || !isfinite(sums.s1 + sums.s2 + sums.s3 + sums.s4) ||
        spread_underflows<Acc, Full>(segment, count)) {
      segment = segment_in_double<Acc, Full>(r, begin, end, step, e.nonfinite);
    }
    moments = merge<Full>(moments, segment);
  }
}

template <typename Acc>
__device__ void clear_top_lists(TopLists<Acc>& t) {
  for (int i = threadIdx.x; i < kWarps * kMaxTopK; i += blockDim.x)
    t.lists[i / kMaxTopK][i % kMaxTopK] = empty_pair();
  if (threadIdx.x < kWarps) {
    t.floors[threadIdx.x] = 0;
    t.locks[threadIdx.x] = 0;
  }
}

// Merges the sorted list `from` of k pairs into `into`: from's first pair that does not enter
// ends it, as every later one ranks after it.
__device__ inline void merge_sorted(TopPair* into, int k, const TopPair* from) {
  for (int j = 0; j < k && ranks_before(from[j], into[k - 1]); ++j) offer_top(into, k, from[j]);
}

// The block's list: its warps' merged into the first, written to `out` (k pairs). By one thread.
template <typename Acc>
__device__ void write_block_list(TopLists<Acc>& t, int k, double* out) {
  for (int w = 1; w < kWarps; ++w) merge_sorted(t.lists[0], k, t.lists[w]);
  for (int j = 0; j < k; ++j) {
    out[2 * j] = t.lists[0][j].value;
    out[2 * j + 1] = t.lists[0][j].channel;
  }
}

// By the last block: the lists of all `blocks` blocks (at `lists`, k pairs each), merged by its
// threads into their warps' lists (emptied first) and those by one thread with the slot's `row`
// of k pairs, which takes the result.
template <typename Acc>
__device__ void merge_top_lists(TopLists<Acc>& t, int k, const double* lists, unsigned blocks,
                                double* row) {
  clear_top_lists(t);
  __syncthreads();
  const int w = threadIdx.x / 32;
  for (unsigned blk = threadIdx.x; blk < blocks; blk += blockDim.x) {
    const double* list = lists + 2 * k * static_cast<int64_t>(blk);
    for (int j = 0; j < k; ++j) {
      if (!offer_locked(t, w, k, {__ldcg(list + 2 * j), __ldcg(list + 2 * j + 1)})) break;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    TopPair* best = t.lists[0];
    for (int v = 1; v < kWarps; ++v) merge_sorted(best, k, t.lists[v]);
    for (int j = 0; j < k; ++j) offer_top(best, k, {row[2 * j], row[2 * j + 1]});
    for (int j = 0; j < k; ++j) {
      row[2 * j] = best[j].value;
      row[2 * j + 1] = best[j].channel;
    }
  }
}

// The TopBuffers of a kernel with top_k, its one `Top` argument.
__device__ inline const TopBuffers& top_buffers_of(const TopBuffers& tb) { return tb; }

// Block `block` of the `blocks` that read the n values at x (minus base, with Diff) for slot
// b.slot at column `column`: its partials go to partials[block], its ticket to *finished, and
// the last of them merges all into the slot and resets *finished for the next call. With
// Binades (never with Diff: a parameter's update has none), the values' binades are counted too;
// with TopK (neither), the top_k pairs kept too, as `tb` (a TopBuffers) says; kernels without
// top_k pass none, and keep their code.
template <typename T, typename Acc, bool Full, int Hist, bool Binades, bool TopK, bool Diff,
          typename... Top>
__device__ void accumulate_block(const T* __restrict__ x, const T* __restrict__ base, int64_t n,
                                 int64_t head, const Buffers& b, int64_t column, unsigned block,
                                 unsigned blocks, double* partials, unsigned int* finished,
                                 const Top&... tb) {
  FASTHOOKS_DYNAMIC_SHARED(dynamic_shared);
  auto* lower = reinterpret_cast<Acc*>(dynamic_shared);
  auto* hist = reinterpret_cast<unsigned int*>(lower + bin_edges(Hist));
  const BinTable<Acc> table = bin_table(lower, b.bins, b.hist_min, b.hist_max);
  static_assert(!(Binades && Diff), "binades are counted of values, not of differences");
  static_assert(!(TopK && Diff), "top_k is kept of values, not of differences");
  unsigned int* const binades = binade_table<Binades>();
  if constexpr (Hist != kNoHistogram || Binades || TopK) {
    if constexpr (Hist != kNoHistogram) {
      for (int64_t k = threadIdx.x; k <= b.bins; k += blockDim.x) {
        lower[k] = k < b.bins ? lower_edge<Acc>(k, b.bins, b.hist_min, b.hist_max)
                              : step(table.top, static_cast<Acc>(INFINITY));
        if (Hist == kBinsPerBlock && k < b.bins) hist[k] = 0;
      }
      if constexpr (Hist == kBinsPerThread) {
        for (int64_t k = 0; k < b.bins + 2; ++k) hist[k * kThreads + threadIdx.x] = 0;
      }
    }
    // Shared memory keeps what the block before left there.
    if constexpr (Binades) {
      for (int k = threadIdx.x; k < kBinadeBins; k += blockDim.x) binades[k] = 0;
    }
    if constexpr (TopK) clear_top_lists(*top_lists<Acc>());
    __syncthreads();
  }

  const Acc near_zero = static_cast<Acc>(b.near_zero);
  Stats moments;
  Extremes<Acc> e;
  if constexpr (kPairedExtremes<T, Diff>) {
    e.min_pair = kInfinityBits<T> * 0x10001u;
    e.max_pair = (kInfinityBits<T> | 0x8000u) * 0x10001u;
  }
  constexpr int kVec = kVecBytes / sizeof(T);
  const int64_t step = static_cast<int64_t>(blocks) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(block) * blockDim.x + threadIdx.x;
  const int64_t vectors = (n - head) / kVec;
  const T* tail = x + head + vectors * kVec;
  // Where a base is given its values sit at the same offsets, so the same cuts align it too.
  const auto at = [&](int64_t offset) { return base != nullptr ? base + offset : nullptr; };
  using Scalar = Load<T, 1>;
  using Vector = Load<T, kVec>;
  const Reader<T, 1, Diff> head_part{reinterpret_cast<const Scalar*>(x),
                                     reinterpret_cast<const Scalar*>(at(0))};
  const Reader<T, kVec, Diff> body{reinterpret_cast<const Vector*>(x + head),
                                   reinterpret_cast<const Vector*>(at(head))};
  const Reader<T, 1, Diff> tail_part{reinterpret_cast<const Scalar*>(tail),
                                     reinterpret_cast<const Scalar*>(at(tail - x))};
  // A thread's column starts a row in, for the values below the range.
  const BinCounts histogram{Hist == kBinsPerThread ? hist + kThreads + threadIdx.x : hist, binades,
                            (1u << (threadIdx.x % 32)) - 1u};
  // Kernels without top_k pass no TopCandidates, and keep their code.
  if constexpr (TopK) {
    const TopBuffers& t = top_buffers_of(tb...);
    TopCandidates<T, Acc> top{x, t.channels, static_cast<int>(t.k), Acc(0)};
    thread_pass<Acc, Full, Hist, Binades>(head_part, head, tid, step, near_zero, table, histogram,
                                          moments, e, top);
    thread_pass<Acc, Full, Hist, Binades>(body, vectors, tid, step, near_zero, table, histogram,
                                          moments, e, top);
    thread_pass<Acc, Full, Hist, Binades>(tail_part, x + n - tail, tid, step, near_zero, table,
                                          histogram, moments, e, top);
  } else {
    thread_pass<Acc, Full, Hist, Binades>(head_part, head, tid, step, near_zero, table, histogram,
                                          moments, e);
    thread_pass<Acc, Full, Hist, Binades>(body, vectors, tid, step, near_zero, table, histogram,
                                          moments, e);
    thread_pass<Acc, Full, Hist, Binades>(tail_part, x + n - tail, tid, step, near_zero, table,
                                          histogram, moments, e);
  }

  const int64_t cell = b.slot * b.capacity + column;
  if constexpr (Hist != kNoHistogram || Binades) __syncthreads();
  if constexpr (Binades) {
    // int32 counts that wrap, as the CPU's do: an unsigned add gives the same bits.
    auto* row = reinterpret_cast<unsigned int*>(b.binades + cell * kBinadeBins);
    for (int k = threadIdx.x; k < kBinadeBins; k += blockDim.x) {
      if (binades[k] != 0) atomicAdd(row + k, binades[k]);
    }
  }
  if constexpr (Hist != kNoHistogram) {
    int64_t* row = b.hist + cell * b.bins;
    if constexpr (Hist == kBinsPerThread) {
      add_thread_columns(hist + kThreads, b.bins, row);
    } else {
      for (int64_t k = threadIdx.x; k < b.bins; k += blockDim.x) {
        if (hist[k] != 0) {
          atomicAdd(reinterpret_cast<unsigned long long*>(row + k),
                    static_cast<unsigned long long>(hist[k]));
        }
      }
    }
  }

  if constexpr (Full) {
    if constexpr (kPairedExtremes<T, Diff>) {
      const Acc pair_min = min_or_nan(lane_value<T>(e.min_pair, 0), lane_value<T>(e.min_pair, 1));
      const Acc pair_max = max_or_nan(lane_value<T>(e.max_pair, 0), lane_value<T>(e.max_pair, 1));
      e.min = min_or_nan(e.min, pair_min);
      e.max = max_or_nan(e.max, pair_max);
    }
    moments.min = static_cast<double>(e.min);
    moments.max = static_cast<double>(e.max);
    moments.near_zero = static_cast<double>(e.near_zero);
    moments.nonfinite = static_cast<double>(e.nonfinite);
  }
  block_reduce<Full>(moments);
  __shared__ bool last_block;
  if (threadIdx.x == 0) {
    store_state<Full>(partials + kPartials * block, 1, moments);
    // Past block_reduce's barrier every warp's list is whole: the block's best k go beside.
    if constexpr (TopK) {
      const TopBuffers& t = top_buffers_of(tb...);
      write_block_list(*top_lists<Acc>(), static_cast<int>(t.k), t.lists + 2 * t.k * block);
    }
    __threadfence();  // release: the partials are visible before the ticket is taken
    last_block = atomicAdd(finished, 1u) == blocks - 1;
  }
  __syncthreads();
  if (!last_block) return;
  __threadfence();  // acquire: every block's partials are read after its ticket
  if constexpr (TopK) {
    const TopBuffers& t = top_buffers_of(tb...);
    merge_top_lists(*top_lists<Acc>(), static_cast<int>(t.k), t.lists, blocks,
                    t.rows + 2 * t.k * cell);
  }

  Stats total;
  for (int blk = threadIdx.x; blk < static_cast<int>(blocks); blk += blockDim.x) {
    double v[kPartials];
    for (int f = 0; f < (Full ? kFullPlanes : kBasicPlanes); ++f) {
      v[f] = __ldcg(partials + kPartials * blk + f);
    }
    total = merge<Full>(total, load_state<Full>(v, 1));
  }
  block_reduce<Full>(total);
  if (threadIdx.x == 0) {
    const int64_t plane = b.modules * b.capacity;
    const SlotPointers slot{b.state + cell, plane, b.stats + cell, plane,
                            Full ? b.extra + cell : nullptr};
    store_slot<Full>(slot, merge<Full>(load_slot<Full>(slot), total));
    if (b.order != nullptr) {
      const auto position = static_cast<int64_t>(atomicAdd(b.clock, 1ull));
      note_call_order<Full>(b.order + cell, plane, position, total);
    }
    *finished = 0;  // ready for the next call: no memset needed
  }
}

// A CUDA graph replayed past the capacity it was captured with finds the cursor beyond its
// buffers: the call is counted (`calls` of them), for the host to report on reading, and
// writes nothing. Returns the column, or -1 for such a call.
__device__ inline int64_t column_or_drop(const Buffers& b, unsigned long long calls) {
  const int64_t column = *b.cursor;
  if (column >= 0 && column < b.capacity) return column;
  if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(b.dropped, calls);
  return -1;
}

template <typename T, typename Acc, bool Full, int Hist, bool Diff, bool Binades, bool TopK,
          bool Channels>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
    accumulate_stats_kernel(const T* __restrict__ x, const T* __restrict__ base, int64_t n,
                            int64_t head, Buffers b, TopBuffers top, ChannelBuffers channels) {
  const int64_t column = column_or_drop(b, 1);
  if (column < 0) return;
  // Kernels without channel statistics leave the ChannelBuffers alone, and keep their code.
  static_assert(!(Channels && Diff), "channel statistics are kept of values, not of differences");
  if constexpr (Channels) {
    add_channel_sums<T, Acc>(x, n, channels, b.near_zero, blockIdx.x, gridDim.x);
  }
  // A kernel without top_k passes no TopBuffers on, and keeps its code.
  if constexpr (TopK) {
    accumulate_block<T, Acc, Full, Hist, Binades, TopK, Diff>(
        x, base, n, head, b, column, blockIdx.x, gridDim.x, b.partials, b.finished, top);
  } else {
    accumulate_block<T, Acc, Full, Hist, Binades, TopK, Diff>(
        x, base, n, head, b, column, blockIdx.x, gridDim.x, b.partials, b.finished);
  }
}

// Every tensor of a table in one launch: block i works for the tensor whose blocks hold i. It
// counts no binades (accumulate_stats_list keeps none).
template <typename T, typename Acc, bool Full, int Hist, bool Diff>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
    accumulate_list_kernel(const __grid_constant__ TensorTable table, Buffers b) {
  const int64_t column = column_or_drop(b, static_cast<unsigned long long>(table.count));
  if (column < 0) return;
  int t = 0;
  while (static_cast<int32_t>(blockIdx.x) >= table.first_block[t + 1]) ++t;
  const int32_t first = table.first_block[t];
  Buffers own = b;
  own.slot = table.slot[t];
  accumulate_block<T, Acc, Full, Hist, false, false, Diff>(
      static_cast<const T*>(table.x[t]), static_cast<const T*>(table.base[t]), table.n[t],
      table.head[t], own, column, blockIdx.x - first, table.first_block[t + 1] - first,
      b.partials + kPartials * first, b.finished + 2 * t);
}

}  // namespace cuda
}  // namespace fasthooks
