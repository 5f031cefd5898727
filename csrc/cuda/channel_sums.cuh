// Per-channel running sums (channels.h) in the CUDA kernels: count, sum, sum of squares, largest
// magnitude and active count of each channel, added to the module's row with global atomics.
//
// They take a traversal of their own, in the same launch, before the statistics' pass: a thread
// keeps one channel for many values, so its sums stay in registers (in double, each value
// widened first, folded every kChannelFold values) and reach the row by a few atomics per
// thread, where the statistics' grid-stride order would give every load another channel. That
// reads the tensor twice; the second read is in the opposite order, so what the first left in L2
// is read again first (all of it for a tensor that fits), and the statistics keep their code and
// results bit for bit. Two layouts:
// - a stride-1 channel axis (rows of C channels: (..., C), channels_last): a block takes a tile
//   of up to kThreads channels over a part of the rows, each thread one channel down the rows
//   (a warp's loads coalesce along the row), threads that share a channel (C < kThreads) summed
//   in shared memory first;
// - runs of `stride` values of one channel (NCHW): a warp takes kChannelPiece values, each lane
//   every 32nd, a lane's sums sent on where its channel changes, the warp's summed first where
//   every lane ends in one channel.
// Counts need no pass: every channel has numel / C values in a call.
#pragma once

#include "kernel_layout.h"

namespace fasthooks {
namespace cuda {

// Values summed in a lane's partial sums before they are added to its totals.
constexpr int kChannelFold = 64;
// Values a warp takes at a time along runs of one channel: kChannelFold per lane.
constexpr int64_t kChannelPiece = 32 * kChannelFold;

// The bits of |v|: magnitudes order as these integers do, and a NaN's are above infinity's, so
// their integer maximum is the NaN-propagating maximum of the magnitudes.
__device__ inline uint32_t magnitude_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }
__device__ inline uint64_t magnitude_bits(double v) {
  return static_cast<uint64_t>(__double_as_longlong(v)) & 0x7fffffffffffffffull;
}
// Those bits as the bits of the same magnitude in double (a NaN stays a NaN of clear sign).
__device__ inline uint64_t as_double_bits(uint32_t bits) {
  return magnitude_bits(static_cast<double>(__uint_as_float(bits)));
}
__device__ inline uint64_t as_double_bits(uint64_t bits) { return bits; }

template <typename Acc>
struct MagnitudeBits {
  using type = uint32_t;
};
template <>
struct MagnitudeBits<double> {
  using type = uint64_t;
};

// One lane's sums of the values of one channel: those since the last fold, the rest; the largest
// magnitude (of the value in Acc) as its bits.
template <typename Acc>
struct ChannelRun {
  double sum = 0, sum_sq = 0;
  typename MagnitudeBits<Acc>::type largest = 0;
  unsigned int active = 0;
  double total_sum = 0, total_sum_sq = 0;

  __device__ void add(Acc v, Acc near_zero) {
    const auto bits = magnitude_bits(v);
    // Double: float squares overflow past 1.8e19, underflow below 1e-19; the pass is load-bound.
    const double w = static_cast<double>(v);
    sum += w;
    sum_sq += w * w;
    largest = bits > largest ? bits : largest;
    active += fabs(v) > near_zero ? 1u : 0u;  // NaN is not above
  }
  // At most every kChannelFold adds.
  __device__ void fold() {
    total_sum += sum;
    total_sum_sq += sum_sq;
    sum = 0;
    sum_sq = 0;
  }
};

// A run's sums in double, as they are merged and sent to the row. No initialisers: shared memory
// holds an array of them.
struct ChannelTotals {
  double sum, sum_sq, active;
  unsigned long long largest;  // the bits of a non-negative double (or NaN)

  template <typename Acc>
  __device__ static ChannelTotals of(const ChannelRun<Acc>& run) {
    return {run.total_sum, run.total_sum_sq, static_cast<double>(run.active),
            static_cast<unsigned long long>(as_double_bits(run.largest))};
  }
  __device__ void add(const ChannelTotals& o) {
    sum += o.sum;
    sum_sq += o.sum_sq;
    active += o.active;
    largest = o.largest > largest ? o.largest : largest;
  }
  // Added to channel c (offset included) of the row.
  __device__ void send(const ChannelBuffers& cb, int64_t c) const {
    double* at = cb.row + c;
    const int64_t plane = cb.room;
    atomicAdd(at + kChannelSum * plane, sum);
    atomicAdd(at + kChannelSumSq * plane, sum_sq);
    atomicAdd(at + kChannelActive * plane, active);
    // Non-negative doubles order as their bits, so the integer maximum is theirs.
    atomicMax(reinterpret_cast<unsigned long long*>(at + kChannelAbsmax * plane), largest);
  }
};

__device__ inline ChannelTotals shuffle_down(const ChannelTotals& t, int offset) {
  return {__shfl_down_sync(0xffffffffu, t.sum, offset),
          __shfl_down_sync(0xffffffffu, t.sum_sq, offset),
          __shfl_down_sync(0xffffffffu, t.active, offset),
          __shfl_down_sync(0xffffffffu, t.largest, offset)};
}

// A stride-1 channel axis: the n values are rows of C channels.
template <typename T, typename Acc>
__device__ void channel_rows(const T* __restrict__ x, int64_t n, const ChannelBuffers& cb,
                             Acc near_zero, unsigned block, unsigned blocks) {
  __shared__ ChannelTotals shared[kThreads];
  const int64_t size = cb.channels.size;
  const int64_t rows = n / size;
  const int64_t tiles = (size + kThreads - 1) / kThreads;
  // Parts of the rows enough for every block, each of a few folds at least.
  int64_t parts = static_cast<int64_t>(blocks) / tiles;
  const int64_t most = (rows + kChannelFold - 1) / kChannelFold;
  parts = parts < 1 ? 1 : (parts > most ? most : parts);
  const int64_t units = tiles * parts;
  for (int64_t u = units - 1 - block; u >= 0; u -= blocks) {
    const int64_t tile = u % tiles, part = u / tiles;
    const int64_t first = tile * kThreads;
    const int width = static_cast<int>(size - first < kThreads ? size - first : kThreads);
    const int lanes = kThreads / width;  // threads sharing a channel
    const int lane = static_cast<int>(threadIdx.x) / width;
    const int column = static_cast<int>(threadIdx.x) % width;
    const int64_t begin = part * rows / parts, end = (part + 1) * rows / parts;
    ChannelRun<Acc> run;
    if (lane < lanes) {
      const T* p = x + first + column;
      for (int64_t r = begin + lane; r < end; r += static_cast<int64_t>(lanes) * kChannelFold) {
        const int64_t stop = r + static_cast<int64_t>(lanes) * kChannelFold;
        const int64_t last = stop < end ? stop : end;
#pragma unroll 4
        for (int64_t q = r; q < last; q += lanes) run.add(static_cast<Acc>(p[q * size]), near_zero);
        run.fold();
      }
    }
    ChannelTotals totals = ChannelTotals::of(run);
    if (lanes == 1) {
      if (lane == 0) totals.send(cb, cb.channels.offset + first + column);
      continue;
    }
    shared[threadIdx.x] = totals;
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < width) {
      for (int k = 1; k < lanes; ++k) totals.add(shared[k * width + threadIdx.x]);
      totals.send(cb, cb.channels.offset + first + column);
    }
    __syncthreads();  // shared is read before the next unit writes it
  }
}

// Runs of `stride` values of one channel, stride > 1.
template <typename T, typename Acc>
__device__ void channel_runs(const T* __restrict__ x, int64_t n, const ChannelBuffers& cb,
                             Acc near_zero, unsigned block, unsigned blocks) {
  const int64_t stride = cb.channels.stride, size = cb.channels.size;
  const int64_t pieces = (n + kChannelPiece - 1) / kChannelPiece;
  const int64_t warps = static_cast<int64_t>(blocks) * kWarps;
  const int64_t warp = static_cast<int64_t>(block) * kWarps + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  // A lane's next value is 32 positions on: hop_runs runs and hop_rest positions.
  const int64_t hop_runs = 32 / stride, hop_rest = 32 % stride;
  for (int64_t piece = pieces - 1 - warp; piece >= 0; piece -= warps) {
    int64_t i = piece * kChannelPiece + lane;
    const bool any = i < n;
    int64_t at = i % stride;
    int64_t c = i / stride % size;
    int64_t current = c;
    ChannelRun<Acc> run;
    for (int j = 0; j < kChannelFold; ++j, i += 32) {
      if (i < n) {
        if (c != current) {
          run.fold();
          ChannelTotals::of(run).send(cb, cb.channels.offset + current);
          run = ChannelRun<Acc>{};
          current = c;
        }
        run.add(static_cast<Acc>(x[i]), near_zero);
      }
      at += hop_rest;
      c += hop_runs;
      if (at >= stride) {
        at -= stride;
        ++c;
      }
      while (c >= size) c -= size;
    }
    run.fold();
    ChannelTotals totals = ChannelTotals::of(run);
    // A warp whose lanes all end in one channel sends one sum (lanes past n have none to send;
    // channels past int's range are never taken for one another).
    const int key = size <= 0x7fffffff ? static_cast<int>(current) : lane;
    const unsigned peers = __match_any_sync(0xffffffffu, any ? key : -1);
    if (peers == 0xffffffffu && any) {
      for (int offset = 16; offset > 0; offset /= 2) totals.add(shuffle_down(totals, offset));
      if (lane == 0) totals.send(cb, cb.channels.offset + current);
    } else if (any) {
      totals.send(cb, cb.channels.offset + current);
    }
  }
}

// Block `block` of `blocks`: its share of the sums of the n values at x, and with block 0 the
// counts of the call. Out of line, so that the statistics' loop keeps its registers.
template <typename T, typename Acc>
__device__ FASTHOOKS_NOINLINE void add_channel_sums(const T* __restrict__ x, int64_t n,
                                                    const ChannelBuffers& cb, double near_zero,
                                                    unsigned block, unsigned blocks) {
  const Acc limit = static_cast<Acc>(near_zero);
  if (cb.channels.stride == 1) {
    channel_rows<T, Acc>(x, n, cb, limit, block, blocks);
  } else {
    channel_runs<T, Acc>(x, n, cb, limit, block, blocks);
  }
  if (block == 0) {
    double* counts = cb.row + kChannelCount * cb.room + cb.channels.offset;
    for (int64_t c = threadIdx.x; c < cb.channels.size; c += blockDim.x) {
      atomicAdd(counts + c, cb.per_channel);
    }
  }
}

}  // namespace cuda
}  // namespace fasthooks
