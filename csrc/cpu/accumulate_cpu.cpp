// CPU kernel of fasthooks::accumulate_stats: one parallel read pass, merged into the state slot.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

#include "../binades.h"
#include "../checks.h"
#include "../dtype_dispatch.h"
#include "../top.h"
#include "capability.h"
#include "channel_sums.h"

namespace fasthooks {
namespace {

// Small enough to spread a few MB over threads, large enough that a chunk streams at full speed.
constexpr int64_t kChunk = 1 << 16;
// Lane-private uint32 counters are flushed into int64 before this many values could overflow them.
constexpr int64_t kChunksPerFlush = (int64_t{1} << 31) / kChunk;

// Adds lane-private rows of (bins + 1) counters into `counts`, the last counter of a row dropped.
void flush_rows(std::vector<uint32_t>& rows, std::vector<int64_t>& counts) {
  const size_t stride = counts.size() + 1;
  for (size_t lane = 0; lane < kHistLanes; ++lane) {
    for (size_t k = 0; k < counts.size(); ++k) counts[k] += rows[lane * stride + k];
  }
  std::fill(rows.begin(), rows.end(), 0u);
}

// A value's bits as an unsigned integer of its size, and the bin of its binade (binades.h).
template <typename T>
auto bits_of(T v) {
  std::conditional_t<sizeof(T) == 8, uint64_t,
                     std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>>
      bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}
inline int binade_of(float v) { return binade_of_bits(bits_of(v)); }
inline int binade_of(double v) { return binade_of_bits(bits_of(v)); }
inline int binade_of(torch::headeronly::Half v) { return binade_of_half_bits(bits_of(v)); }
inline int binade_of(torch::headeronly::BFloat16 v) { return binade_of_bfloat16_bits(bits_of(v)); }

// Adds the binades of n values to `counts` (kBinadeBins of them). Four rows of counters, one
// value to each in turn, so that runs of values of one binade do not wait on one counter.
constexpr int kBinadeRows = 4;
template <typename T>
void count_binades(const T* p, int64_t n, int64_t* counts) {
  uint32_t rows[kBinadeRows][kBinadeBins] = {};  // a chunk's counts fit 32 bits
  int64_t i = 0;
  for (; i + kBinadeRows <= n; i += kBinadeRows) {
    for (int r = 0; r < kBinadeRows; ++r) ++rows[r][binade_of(p[i + r])];
  }
  for (; i < n; ++i) ++rows[0][binade_of(p[i])];
  for (int k = 0; k < kBinadeBins; ++k) {
    for (int r = 0; r < kBinadeRows; ++r) counts[k] += rows[r][k];
  }
}

// A value's magnitude as the bits of its type with the sign cleared: magnitudes order as these
// integers do, and a NaN's are above infinity's.
template <typename T>
auto magnitude_bits(T v) {
  const auto bits = bits_of(v);
  return static_cast<decltype(bits)>(bits & ~(decltype(bits){1} << (8 * sizeof bits - 1)));
}
template <typename T>
auto infinity_bits() {
  return magnitude_bits(std::numeric_limits<T>::infinity());
}

// A float64 value back in T (widened's inverse): 16-bit values through float.
template <typename T>
T narrowed(double v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return static_cast<T>(static_cast<float>(v));
  }
}

// Offers the n values at p (positions start.. of the tensor in memory order) to a list of k top
// pairs. Once the list is full, a value can enter only with a magnitude at least its last's: a
// block of values below that is passed over on the largest of their magnitudes' bits, a loop the
// compiler vectorises.
template <typename T>
void offer_values(const T* p, int64_t start, int64_t n, const ChannelMap& map, TopPair* list,
                  int k) {
  using Bits = decltype(magnitude_bits(T{}));
  constexpr int64_t kBlock = 64;
  const Bits nan_from = infinity_bits<T>() + 1;
  auto floor_of = [&] {
    const double last = list[k - 1].value;
    return last == last ? magnitude_bits(narrowed<T>(last)) : Bits{0};
  };
  Bits floor = floor_of();
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = n - i < kBlock ? n - i : kBlock;
    Bits largest = 0;
    for (int64_t j = 0; j < m; ++j) {
      const Bits b = magnitude_bits(p[i + j]);
      largest = b > largest ? b : largest;
    }
    if (largest < floor) continue;
    for (int64_t j = 0; j < m; ++j) {
      const Bits b = magnitude_bits(p[i + j]);
      if (b < floor || b >= nan_from) continue;
      offer_top(list, k, {widened(p[i + j]), static_cast<double>(map.channel(start + i + j))});
      floor = floor_of();
    }
  }
}

// An empty list of top pairs.
void clear_top(TopPair* list, int k) {
  for (int i = 0; i < k; ++i)
    list[i] = {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::quiet_NaN()};
}

// Where a chunk counts beside its statistics: its bins into lane rows (null without a histogram),
// its binades into kBinadeBins counters (null without them), its top values into a list of
// top_k pairs (null without them), its values into per-channel sums (null without them).
struct ChunkCounts {
  uint32_t* rows;
  int64_t* binades;
  TopPair* top;
  ChannelSums* channels;
};

// Statistics of n values taken a chunk at a time: chunk(start, length, counts) gives those of
// values [start, start + length) and counts their bins, binades, top values and channel sums
// (ChunkCounts). `counts`, `binades`, `top` and `channels` receive the totals (each empty, or
// null, when not kept).
template <bool Full, typename Chunk>
Stats chunked_stats(int64_t n, bool hist, const Chunk& chunk, std::vector<int64_t>& counts,
                    std::vector<int64_t>& binades, std::vector<TopPair>& top,
                    ChannelSums* channels) {
  const size_t rows_size = hist ? kHistLanes * (counts.size() + 1) : 0;
  const bool binned = !binades.empty();
  const int k = static_cast<int>(top.size());
  if (n <= kChunk) {  // a hook's typical call: no thread hand-off
    std::vector<uint32_t> rows(rows_size);
    const Stats s =
        chunk(0, n,
              ChunkCounts{hist ? rows.data() : nullptr, binned ? binades.data() : nullptr,
                          k ? top.data() : nullptr, channels});
    if (hist) flush_rows(rows, counts);
    return s;
  }
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<Stats> parts(chunks);
  std::mutex counts_mutex;
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> rows(rows_size);
    std::vector<int64_t> local(counts.size());
    std::vector<int64_t> local_binades(binades.size());
    TopPair local_top[kMaxTopK];
    clear_top(local_top, k);
    ChannelSums local_channels(channels != nullptr ? channels->channels() : 0);
    const ChunkCounts own{hist ? rows.data() : nullptr, binned ? local_binades.data() : nullptr,
                          k ? local_top : nullptr, channels != nullptr ? &local_channels : nullptr};
    for (int64_t c = begin; c < end; ++c) {
      const int64_t start = c * kChunk;
      parts[c] = chunk(start, n - start < kChunk ? n - start : kChunk, own);
      if (hist && ((c - begin + 1) % kChunksPerFlush == 0 || c + 1 == end)) {
        flush_rows(rows, local);
      }
    }
    if (hist || binned || k || channels != nullptr) {
      const std::lock_guard<std::mutex> lock(counts_mutex);
      for (size_t j = 0; j < counts.size(); ++j) counts[j] += local[j];
      for (size_t j = 0; j < binades.size(); ++j) binades[j] += local_binades[j];
      // The order is total, so the merged list does not depend on which thread comes first.
      for (int j = 0; j < k; ++j) offer_top(top.data(), k, local_top[j]);
      // Sums in another order round differently in the last bits; maxima and counts do not.
      if (channels != nullptr) channels->add(local_channels);
    }
  });
  // Merged in chunk order, so the result does not depend on the number of threads.
  Stats total;
  for (const Stats& part : parts) total = merge<Full>(total, part);
  return total;
}

// The statistics of p's n values, or of p's minus base's (taken in Acc a chunk at a time into a
// buffer that stays in cache, so each value is read once from memory), merged into the slot.
// The binades of a chunk are counted right after its statistics, while it is still in cache.
template <bool Full, typename T, typename Acc>
Stats merge_into_slot(const T* p, const T* base, int64_t n, ChunkFn<T, Acc> kernel,
                      ChunkFn<Acc, Acc> difference_kernel, ChannelFn<T> channel_kernel,
                      const ChunkParams<Acc>& params, std::vector<int64_t>& counts,
                      std::vector<int64_t>& binades, std::vector<TopPair>& top,
                      ChannelSums* channels, double near_zero, const ChannelMap& map,
                      const SlotPointers& slot) {
  const int k = static_cast<int>(top.size());
  const bool hist = params.bins != nullptr;
  Stats batch;
  if (base == nullptr) {
    batch = chunked_stats<Full>(
        n, hist,
        [&](int64_t start, int64_t length, const ChunkCounts& to) {
          const Stats s = kernel(p + start, length, params, to.rows);
          if (to.binades != nullptr) count_binades(p + start, length, to.binades);
          if (to.top != nullptr) offer_values(p + start, start, length, map, to.top, k);
          if (to.channels != nullptr) {
            channel_kernel(p + start, start, length, map, near_zero, *to.channels);
          }
          return s;
        },
        counts, binades, top, channels);
  } else {
    batch = chunked_stats<Full>(
        n, hist,
        [&](int64_t start, int64_t length, const ChunkCounts& to) {
          thread_local std::vector<Acc> difference(kChunk);
          for (int64_t i = 0; i < length; ++i) {
            difference[i] = static_cast<Acc>(p[start + i]) - static_cast<Acc>(base[start + i]);
          }
          return difference_kernel(difference.data(), length, params, to.rows);
        },
        counts, binades, top, nullptr);
  }
  store_slot<Full>(slot, merge<Full>(load_slot<Full>(slot), batch));
  return batch;
}

// A bound on |first guess - exact position| in bins for a guess v * scale - lo * scale in Acc:
// the rounding of lo * scale, of the scale and of the arithmetic, with room to spare.
template <typename Acc>
Acc guess_margin(const BinTable<Acc>& table, double lo) {
  const double scale = static_cast<double>(table.scale);
  const double eps = std::numeric_limits<Acc>::epsilon();
  const double offset = static_cast<double>(table.lo * table.scale);
  const double offset_error = std::fabs(offset - lo * scale);
  const double margin = offset_error + (table.bins + 1 + std::fabs(lo) * scale) * 8 * eps;
  return static_cast<Acc>(margin < 0.5 ? margin : 0.5);
}

// c when the scale is a power of two of at least 1, so that v * scale is exact (a smaller one
// would round subnormal values), and edge k is exactly
// (c + k) / scale with c an integer: then bin k is [c + k, c + k + 1) in units of v * scale, and
// its floor is the bin with no check against the edges (fastai's default, 40 bins over (0, 10),
// is one such case). kNoExactOrigin otherwise.
template <typename Acc>
int64_t exact_origin(const BinTable<Acc>& table, double lo, double hi) {
  const double scale = static_cast<double>(table.scale);
  int exponent;
  if (scale != table.bins / (hi - lo) || std::frexp(scale, &exponent) != 0.5 || scale < 1) {
    return kNoExactOrigin;
  }
  const double origin = lo * scale;
  // Below this, every half-integer between origin and origin + bins is exact in Acc.
  const double limit = std::ldexp(1.0, std::numeric_limits<Acc>::digits - 2);
  if (!(std::fabs(origin) + table.bins < limit) || origin != std::floor(origin)) {
    return kNoExactOrigin;
  }
  for (int64_t k = 0; k <= table.bins; ++k) {
    if (hist_edge(k, table.bins, lo, hi) != (origin + k) / scale) return kNoExactOrigin;
  }
  return static_cast<int64_t>(origin);
}

// The slot (slot, cursor) of the buffers, checked.
struct Destination {
  SlotPointers slot;
  int64_t hist_offset;
  int32_t* binades;  // the slot's row, null without binades
  TopPair* top;      // the slot's top_k pairs, null without them
  int top_k;
  double* channels;  // the run's running per-channel sums, null without them
  int64_t channel_room;
  int64_t channel_region;  // where the module's channels start in them
};

Destination destination(const Tensor& state, const Tensor& stats, const Tensor& extra,
                        const Tensor& hist, const Tensor* binades, const Tensor* top,
                        const Tensor* channels, int64_t channel_region, const Tensor& cursor,
                        int64_t slot, bool full) {
  const int64_t column = *static_cast<const int64_t*>(cursor.const_data_ptr());
  const int64_t batches = state.size(2);
  FASTHOOKS_CHECK(column >= 0 && column < batches, "accumulate_stats: cursor must be in [0, ",
                  batches, "), got ", column);
  const int64_t cell = slot * batches + column;
  const int64_t plane = state.size(1) * batches;
  const SlotPointers at{static_cast<double*>(state.mutable_data_ptr()) + cell, plane,
                        static_cast<float*>(stats.mutable_data_ptr()) + cell, plane,
                        full ? static_cast<float*>(extra.mutable_data_ptr()) + cell : nullptr};
  int32_t* binade_row =
      binades != nullptr && binades->numel() > 0
          ? static_cast<int32_t*>(binades->mutable_data_ptr()) + cell * kBinadeBins
          : nullptr;
  const int top_k = top != nullptr && top->numel() > 0 ? static_cast<int>(top->size(2)) : 0;
  TopPair* top_row =
      top_k > 0
          ? reinterpret_cast<TopPair*>(static_cast<double*>(top->mutable_data_ptr())) + cell * top_k
          : nullptr;
  const bool summed = channels != nullptr && channels->numel() > 0;
  return {at,
          hist.numel() > 0 ? cell * hist.size(2) : 0,
          binade_row,
          top_row,
          top_k,
          summed ? static_cast<double*>(channels->mutable_data_ptr()) : nullptr,
          summed ? channels->size(1) : 0,
          channel_region};
}

// Returns the call's own statistics.
template <typename T, typename Acc>
Stats accumulate(const Tensor& dense, const Tensor* base, ChunkFn<T, Acc> const (&kernels)[2],
                 ChunkFn<Acc, Acc> const (&difference_kernels)[2], ChannelFn<T> channel_kernel,
                 bool full, const Destination& to, double near_zero, const Tensor& hist,
                 double hist_min, double hist_max, const ChannelMap& map) {
  const int64_t bins = hist.numel() > 0 ? hist.size(2) : 0;
  std::vector<Acc> lower;  // empty, and no allocation, without a histogram
  for (int64_t k = 0; bins > 0 && k <= bins; ++k) {
    lower.push_back(lower_edge<Acc>(k, bins, hist_min, hist_max));
  }
  const BinTable<Acc> table = bin_table(lower.data(), bins, hist_min, hist_max);
  const ChunkParams<Acc> params{
      static_cast<Acc>(near_zero), bins > 0 ? &table : nullptr,
      bins > 0 ? guess_margin(table, hist_min) : Acc(0),
      bins > 0 ? exact_origin(table, hist_min, hist_max) : kNoExactOrigin};
  std::vector<int64_t> counts(bins);
  std::vector<int64_t> binades(to.binades != nullptr ? kBinadeBins : 0);
  std::vector<TopPair> top(to.top_k);
  clear_top(top.data(), to.top_k);
  ChannelSums channels(to.channels != nullptr ? map.size : 0);
  ChannelSums* summed = to.channels != nullptr ? &channels : nullptr;
  const T* p = static_cast<const T*>(dense.const_data_ptr());
  const T* b = base != nullptr ? static_cast<const T*>(base->const_data_ptr()) : nullptr;
  const int f = full ? 1 : 0;
  const Stats call =
      full ? merge_into_slot<true>(p, b, dense.numel(), kernels[f], difference_kernels[f],
                                   channel_kernel, params, counts, binades, top, summed, near_zero,
                                   map, to.slot)
           : merge_into_slot<false>(p, b, dense.numel(), kernels[f], difference_kernels[f],
                                    channel_kernel, params, counts, binades, top, summed, near_zero,
                                    map, to.slot);
  if (summed != nullptr) {
    channels.add_to_planes(to.channels, to.channel_room, to.channel_region + map.offset,
                           static_cast<double>(dense.numel() / map.size));
  }
  int64_t* row =
      bins > 0 ? static_cast<int64_t*>(hist.mutable_data_ptr()) + to.hist_offset : nullptr;
  for (int64_t k = 0; k < bins; ++k) row[k] += counts[k];
  // int32 counts, as the CUDA kernels keep them: a slot's 2^31 values in one binade wrap.
  for (size_t k = 0; k < binades.size(); ++k) {
    to.binades[k] = static_cast<int32_t>(static_cast<uint32_t>(to.binades[k]) +
                                         static_cast<uint32_t>(binades[k]));
  }
  for (const TopPair& pair : top) offer_top(to.top, to.top_k, pair);
  return call;
}

// A kernel table's kernels for values of type T, and those for their differences (taken in the
// accumulation type).
const auto& kernels_of(const ChunkKernels& k, DtypeTag<float>) { return k.f32; }
const auto& kernels_of(const ChunkKernels& k, DtypeTag<double>) { return k.f64; }
const auto& kernels_of(const ChunkKernels& k, DtypeTag<torch::headeronly::Half>) { return k.f16; }
const auto& kernels_of(const ChunkKernels& k, DtypeTag<torch::headeronly::BFloat16>) {
  return k.bf16;
}
const auto& difference_kernels_of(const ChunkKernels& k, DtypeTag<double>) { return k.f64; }
auto channel_kernel_of(const ChunkKernels& k, DtypeTag<float>) { return k.channels_f32; }
auto channel_kernel_of(const ChunkKernels& k, DtypeTag<double>) { return k.channels_f64; }
auto channel_kernel_of(const ChunkKernels& k, DtypeTag<torch::headeronly::Half>) {
  return k.channels_f16;
}
auto channel_kernel_of(const ChunkKernels& k, DtypeTag<torch::headeronly::BFloat16>) {
  return k.channels_bf16;
}
template <typename T>
const auto& difference_kernels_of(const ChunkKernels& k, DtypeTag<T>) {
  return k.f32;
}

// One tensor's statistics (of dense, or of dense - *base, both read in one order) into slot
// (slot, cursor); returns the call's own (none for an empty tensor).
Stats accumulate_one(const Tensor& dense, const Tensor* base, const Tensor& state,
                     const Tensor& stats, const Tensor& extra, const Tensor& hist,
                     const Tensor* binades, const Tensor* top, const Tensor* channels,
                     const ChannelMap& map, int64_t channel_region, const Tensor& cursor,
                     int64_t slot, bool full, double near_zero, double hist_min, double hist_max) {
  const Destination to = destination(state, stats, extra, hist, binades, top, channels,
                                     channel_region, cursor, slot, full);
  if (dense.numel() == 0) return {};
  const ChunkKernels& k = cpu_kernels();
  return dispatch_dtype(dtype_of(dense), [&](auto tag) {
    return accumulate(dense, base, kernels_of(k, tag), difference_kernels_of(k, tag),
                      channel_kernel_of(k, tag), full, to, near_zero, hist, hist_min, hist_max,
                      map);
  });
}

// Takes the call clock's next position and notes the call at (slot, cursor) of the order buffer.
void note_order(const Tensor& order, const Tensor& clock, const Tensor& cursor, int64_t slot,
                bool full, const Stats& call) {
  const int64_t column = *static_cast<const int64_t*>(cursor.const_data_ptr());
  const int64_t batches = order.size(2);
  int64_t* first = static_cast<int64_t*>(order.mutable_data_ptr()) + slot * batches + column;
  // Atomic: hooks may run on several threads, and positions must stay distinct.
  const int64_t position =
      __atomic_fetch_add(static_cast<int64_t*>(clock.mutable_data_ptr()), 1, __ATOMIC_RELAXED);
  const int64_t plane = order.size(1) * batches;
  if (full) {
    note_call_order<true>(first, plane, position, call);
  } else {
    note_call_order<false>(first, plane, position, call);
  }
}

void accumulate_stats_cpu(const Tensor& x, const Tensor& state, const Tensor& stats,
                          const Tensor& extra, const Tensor& hist, const Tensor& binades,
                          const Tensor& top, const Tensor& channels, const Tensor& workspace,
                          const Tensor& order, const Tensor& clock, const Tensor& cursor,
                          int64_t slot, double near_zero, double hist_min, double hist_max,
                          int64_t channel_dim, int64_t channel_offset, int64_t channel_region) {
  const bool full = check_accumulate_args(x, state, stats, extra, hist, &binades, workspace, cursor,
                                          slot, hist_min, hist_max);
  check_top(top, x, state, channel_dim, channel_offset);
  check_channels(channels, x, state, channel_dim, channel_offset, channel_region);
  const bool ordered = check_call_order(order, clock, state);
  const Tensor dense = dense_values(x);
  const Stats call =
      accumulate_one(dense, nullptr, state, stats, extra, hist, &binades, &top, &channels,
                     channel_map(dense, channel_dim, channel_offset), channel_region, cursor, slot,
                     full, near_zero, hist_min, hist_max);
  if (ordered && call.count > 0) note_order(order, clock, cursor, slot, full, call);
}

void accumulate_stats_list_cpu(std::vector<Tensor> xs, std::vector<Tensor> bases,
                               const Tensor& state, const Tensor& stats, const Tensor& extra,
                               const Tensor& hist, const Tensor& workspace, const Tensor& cursor,
                               double near_zero, double hist_min, double hist_max) {
  const CheckedList list =
      check_list(xs, bases, state, stats, extra, hist, workspace, cursor, hist_min, hist_max);
  for (size_t i = 0; i < list.xs.size(); ++i) {
    accumulate_one(list.xs[i], list.bases.empty() ? nullptr : &list.bases[i], state, stats, extra,
                   hist, nullptr, nullptr, nullptr, ChannelMap{1, 1, 0}, 0, cursor,
                   static_cast<int64_t>(i), list.full, near_zero, hist_min, hist_max);
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fasthooks, CPU, m) {
  m.impl("accumulate_stats", TORCH_BOX(&accumulate_stats_cpu));
  m.impl("accumulate_stats_list", TORCH_BOX(&accumulate_stats_list_cpu));
}

}  // namespace fasthooks
