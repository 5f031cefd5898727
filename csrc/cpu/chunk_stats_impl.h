// Statistics of one chunk of contiguous values, in one read pass. This file is included inside an
// instruction-set namespace by kernels_<isa>.cpp, which first defines half_to_float(); it
// includes nothing, so that each inclusion compiles for its own target.

template <typename T>
struct Accumulator {
  using type = float;  // half types and float32 sum in float32 within a block
};
template <>
struct Accumulator<double> {
  using type = double;
};

// Values summed in working precision, around one shift, before their sums go to double.
constexpr int64_t kBlock = 2048;

// Streaming from memory, a software prefetch this far ahead keeps more loads in flight than the
// hardware prefetcher alone (measured: about +10% once the tensor no longer fits in cache).
constexpr int64_t kPrefetchBytes = 16384;

// Finds the bins of a vector of values and packs those of the values inside the range, dropping
// the others. A first guess is clamped to [0.5, bins - 0.5] (a value in the outer half of an
// outer bin needs no check) and, only in the rare vector where some guess lies within `margin` of
// an edge, moved one step down or up against the exact edges (gathered). As scalar code, GCC
// turns the clamps into branches that random data mispredicts half the time (measured: 12 ns a
// value).
template <typename Acc>
struct VectorBins {
  typedef Acc Vec __attribute__((vector_size(32)));
  using Index = decltype(Vec{} < Vec{});
  using Int = std::conditional_t<sizeof(Acc) == 4, int32_t, int64_t>;
  static constexpr int64_t lanes = 32 / sizeof(Acc);

  VectorBins(const BinTable<Acc>& t, Acc margin)
      : table(t),
        scale(Vec{} + t.scale),
        offset(Vec{} + t.lo * t.scale),
        low(Vec{} + Acc(0.5)),
        high(Vec{} + (static_cast<Acc>(t.bins) - Acc(0.5))),
        first(Vec{} + t.lower[0]),
        top(Vec{} + t.top),
        near_low(Vec{} + margin),
        near_high(Vec{} + (Acc(1) - margin)) {}

  // Writes a whole vector at out; returns how many of its bins belong there.
  int64_t pack(const Vec& v, Int* out) const {
    Vec guess;
    clamp_lanes(v * scale - offset, low, high, guess);  // NaN becomes 0.5
    Index pos = __builtin_convertvector(guess, Index);
    const Vec fraction = guess - __builtin_convertvector(pos, Vec);
    if (any_lane((fraction < near_low) | (fraction > near_high))) {
      Vec edge;
      gather(table.lower, pos, edge);
      pos += v < edge;  // a true comparison is -1
      gather(table.lower, pos + 1, edge);
      pos -= v >= edge;
    }
    return pack_lanes(pos, (v >= first) & (v <= top), out);
  }

  const BinTable<Acc>& table;
  const Vec scale, offset, low, high, first, top, near_low, near_high;
};

// Bins found for one block, counted in one of kHistLanes lane-private rows so that consecutive
// values in one bin do not wait on each other's store; then the values left unbinned, one by one.
template <typename Acc, typename Int>
inline void count_bins(const Int* bins, int64_t packed, const Acc* rest, int64_t rest_n,
                       const BinTable<Acc>& t, uint32_t* rows) {
  const int64_t stride = t.bins + 1;
  int64_t i = 0;
  for (; i + kHistLanes <= packed; i += kHistLanes) {
    for (int64_t k = 0; k < kHistLanes; ++k) ++rows[k * stride + bins[i + k]];
  }
  for (; i < packed; ++i) ++rows[bins[i]];
  for (int64_t j = 0; j < rest_n; ++j) ++rows[bin_of(rest[j], t)];
}

template <typename Acc>
struct BlockSums {
  double s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0;  // power sums of (x - shift)
  Acc min, max;                                   // NaN is ignored here and found afterwards
  int64_t near_zero = 0;
  int64_t packed = 0;  // with a histogram: bins found, and values looked at, in the vector loop
  int64_t binned = 0;
};

// One pass over a block, finding histogram bins on the way when `finder` is given. Independent
// 32-byte accumulators keep the FP pipes busy (four for mean and std; two when every statistic is
// on, which would otherwise run out of registers); GCC's vector extension compiles them to AVX2
// in the AVX2 kernels and to SSE2 pairs in the portable.
template <typename Acc, bool Full, bool Hist>
inline BlockSums<Acc> block_sums(const Acc* p, int64_t n, Acc shift, Acc near_zero,
                                 const VectorBins<Acc>* finder,
                                 typename VectorBins<Acc>::Int* bins) {
  typedef Acc Vec __attribute__((vector_size(32)));
  using Mask = decltype(Vec{} <= Vec{});
  constexpr int64_t lanes = 32 / sizeof(Acc);
  constexpr int kAcc = Full ? 2 : 4;
  const Vec shift_v = Vec{} + shift;
  const Vec near_zero_v = Vec{} + near_zero;
  Vec a1[kAcc] = {}, a2[kAcc] = {}, a3[kAcc] = {}, a4[kAcc] = {};
  Vec lo = Vec{} + static_cast<Acc>(INFINITY);
  Vec hi = Vec{} - static_cast<Acc>(INFINITY);
  Mask small = {};
  int64_t packed = 0;
  int64_t i = 0;
  for (; i + kAcc * lanes <= n; i += kAcc * lanes) {
    const char* ahead = reinterpret_cast<const char*>(p + i) + kPrefetchBytes;
    __builtin_prefetch(ahead);
    if (kAcc * lanes * sizeof(Acc) > 64) __builtin_prefetch(ahead + 64);
    for (int k = 0; k < kAcc; ++k) {
      Vec v;
      std::memcpy(&v, p + i + k * lanes, sizeof(Vec));
      const Vec d = v - shift_v;
      const Vec d2 = d * d;
      a1[k] += d;
      a2[k] += d2;
      if constexpr (Full) {
        a3[k] += d2 * d;
        a4[k] += d2 * d2;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        small -= v <= near_zero_v;
      }
      if constexpr (Hist) packed += finder->pack(v, bins + packed);
    }
  }
  BlockSums<Acc> s;
  s.packed = packed;
  s.binned = i;
  Vec t1 = a1[0], t2 = a2[0], t3 = a3[0], t4 = a4[0];
  for (int k = 1; k < kAcc; ++k) {
    t1 += a1[k];
    t2 += a2[k];
    t3 += a3[k];
    t4 += a4[k];
  }
  s.min = lo[0];
  s.max = hi[0];
  for (int64_t j = 0; j < lanes; ++j) {
    s.s1 += t1[j];
    s.s2 += t2[j];
    s.s3 += t3[j];
    s.s4 += t4[j];
    s.min = lo[j] < s.min ? lo[j] : s.min;
    s.max = hi[j] > s.max ? hi[j] : s.max;
    s.near_zero += small[j];
  }
  for (; i < n; ++i) {
    const Acc v = p[i];
    const Acc d = v - shift;
    s.s1 += d;
    s.s2 += d * d;
    if constexpr (Full) {
      s.s3 += d * d * d;
      s.s4 += d * d * d * d;
      s.min = v < s.min ? v : s.min;
      s.max = v > s.max ? v : s.max;
      s.near_zero += v <= near_zero;
    }
  }
  return s;
}

inline void bfloat16_to_float(const torch::headeronly::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i].x) << 16;
    std::memcpy(dst + i, &bits, sizeof(bits));
  }
}

inline void to_accumulator(const torch::headeronly::Half* src, float* dst, int64_t n) {
  half_to_float(src, dst, n);
}
inline void to_accumulator(const torch::headeronly::BFloat16* src, float* dst, int64_t n) {
  bfloat16_to_float(src, dst, n);
}

template <typename Acc>
inline Acc finite_or_zero(Acc v) {
  return v - v == Acc(0) ? v : Acc(0);  // an infinite or NaN shift would poison every value
}

constexpr int64_t kShiftSamples = 16;

// The first block's shift: the mean of its first few values.
template <typename Acc>
inline Acc head_mean(const Acc* p, int64_t n) {
  const int64_t head = n < kShiftSamples ? n : kShiftSamples;
  Acc sum = 0;
  for (int64_t i = 0; i < head; ++i) sum += p[i];
  return finite_or_zero(sum / static_cast<Acc>(head));
}

template <typename Acc>
inline void count_nonfinite(const Acc* p, int64_t n, Stats& s) {
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    nan |= p[i] != p[i];
    s.nonfinite += !(p[i] - p[i] == Acc(0));
  }
  if (nan) s.min = s.max = NAN;
}

// Two passes in double over finite values whose float sums overflowed.
template <bool Full, typename Acc>
inline void moments_in_double(const Acc* p, int64_t n, Stats& b) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += p[i];
  const double mean = sum / static_cast<double>(n);
  double s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = p[i] - mean;
    s1 += d;
    s2 += d * d;
    s3 += d * d * d;
    s4 += d * d * d * d;
  }
  moments_from_shifted_sums<Full>(b, static_cast<double>(n), mean, s1, s2, s3, s4);
}

// Statistics of one block, summed around `shift`, then once more around the block's own mean
// when `shift` proved far from it: float sums around a distant shift lose the spread.
// With a histogram, the block's bins are counted into `rows` too.
template <typename Acc, bool Full, bool Hist>
inline Stats block_stats(const Acc* p, int64_t n, Acc shift, Acc near_zero,
                         const VectorBins<Acc>* finder, uint32_t* rows) {
  const double count = static_cast<double>(n);
  typename VectorBins<Acc>::Int bins[Hist ? kBlock + VectorBins<Acc>::lanes : 1];
  BlockSums<Acc> s = block_sums<Acc, Full, Hist>(p, n, shift, near_zero, finder, bins);
  if constexpr (Hist) count_bins(bins, s.packed, p + s.binned, n - s.binned, finder->table, rows);
  Stats b;
  moments_from_shifted_sums<Full>(b, count, shift, s.s1, s.s2, s.s3, s.s4);
  const double d = s.s1 / count;
  if (4.0 * count * d * d > b.m2 && std::isfinite(b.mean)) {
    shift = finite_or_zero(static_cast<Acc>(b.mean));
    s = block_sums<Acc, Full, false>(p, n, shift, near_zero, nullptr, nullptr);
    moments_from_shifted_sums<Full>(b, count, shift, s.s1, s.s2, s.s3, s.s4);
  }
  if constexpr (Full) {
    b.min = s.min;
    b.max = s.max;
    b.near_zero = static_cast<double>(s.near_zero);
  }
  // Finite sums prove every value finite. Otherwise look for NaN and infinities; where there are
  // none, the sums overflowed the working precision (values near the float32 maximum) and are
  // taken again in double.
  if (!std::isfinite(s.s1 + s.s2 + s.s3 + s.s4)) {
    Stats found;
    count_nonfinite(p, n, found);
    if (found.nonfinite == 0) {
      moments_in_double<Full>(p, n, b);
    } else if constexpr (Full) {
      b.nonfinite = found.nonfinite;
      if (found.min != found.min) b.min = b.max = NAN;
    }
  }
  return b;
}

template <typename T, bool Full>
Stats chunk_stats(const T* p, int64_t n, const ChunkParams<typename Accumulator<T>::type>& params,
                  uint32_t* hist_rows) {
  using Acc = typename Accumulator<T>::type;
  Stats total;
  [[maybe_unused]] Acc buffer[std::is_same_v<T, Acc> ? 1 : kBlock];
  const std::optional<VectorBins<Acc>> finder =
      hist_rows != nullptr
          ? std::optional<VectorBins<Acc>>(std::in_place, *params.bins, params.bin_margin)
          : std::nullopt;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = n - b < kBlock ? n - b : kBlock;
    const Acc* values;
    if constexpr (std::is_same_v<T, Acc>) {
      values = p + b;
    } else {
      to_accumulator(p + b, buffer, len);
      values = buffer;
    }
    // Every block re-centres on the running mean, so no choice of first values spoils the rest.
    const Acc shift =
        b == 0 ? head_mean(values, len) : finite_or_zero(static_cast<Acc>(total.mean));
    const Stats block = finder ? block_stats<Acc, Full, true>(values, len, shift, params.near_zero,
                                                              &*finder, hist_rows)
                               : block_stats<Acc, Full, false>(values, len, shift, params.near_zero,
                                                               nullptr, nullptr);
    total = merge<Full>(total, block);
  }
  return total;
}

inline ChunkKernels make_kernels() {
  return {
      {&chunk_stats<float, false>, &chunk_stats<float, true>},
      {&chunk_stats<double, false>, &chunk_stats<double, true>},
      {&chunk_stats<torch::headeronly::Half, false>, &chunk_stats<torch::headeronly::Half, true>},
      {&chunk_stats<torch::headeronly::BFloat16, false>,
       &chunk_stats<torch::headeronly::BFloat16, true>}};
}
