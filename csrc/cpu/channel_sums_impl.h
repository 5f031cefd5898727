// Per-channel sums of one chunk (channel_sums.h), in this instruction set's vectors. Included
// after chunk_stats_impl.h inside an instruction-set namespace by kernels_<isa>.cpp; it includes
// nothing, so that each inclusion compiles for its own target.

// Sums in working precision cover at most this many values per lane before they go to double.
constexpr int64_t kChannelFold = 64;
// Vectors of channels summed side by side down the rows of a stride-1 channel axis: each takes
// five vector registers, so four where there are 32 (AVX-512), two where there are 16.
constexpr int64_t kChannelUnroll = kVectorBytes >= 64 ? 4 : 2;

template <typename Acc>
struct ChannelVectors {
  typedef Acc Vec __attribute__((vector_size(kVectorBytes)));
  using Index = decltype(Vec{} < Vec{});
  using Lane = std::conditional_t<sizeof(Acc) == 4, int32_t, int64_t>;
  static constexpr int64_t lanes = kVectorBytes / sizeof(Acc);

  static Vec load(const Acc* p) {
    Vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  // The bits of |v|: magnitudes order as these integers do, and a NaN's are above infinity's, so
  // their integer maximum is the NaN-propagating maximum of the magnitudes.
  static Index magnitude_bits(const Vec& v) {
    Index bits;
    std::memcpy(&bits, &v, sizeof v);
    return bits & (Index{} + std::numeric_limits<Lane>::max());
  }
  static Acc from_bits(Lane bits) {
    Acc v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
};

// The sums of values in vector lanes, each lane in working precision but the squares, which are
// taken in double: a float square leaves float's range from |v| of 2^64 up and 2^-75 down. The
// squares of a float vector are two vectors of the native width, its low and its high lanes: one
// vector twice as wide is kept in memory by the compiler, not in registers.
typedef double Doubles __attribute__((vector_size(kVectorBytes)));

// Lanes From.. of v, as many as Lanes names: a vector of their own.
template <size_t From, typename Vec, size_t... Lanes>
inline auto lanes_from(const Vec& v, std::index_sequence<Lanes...>) {
  return __builtin_shufflevector(v, v, (From + Lanes)...);
}

template <typename Acc>
struct LaneSums {
  using V = ChannelVectors<Acc>;
  static constexpr int64_t half = sizeof(Acc) == 4 ? V::lanes / 2 : V::lanes;
  using Halves = std::make_index_sequence<static_cast<size_t>(half)>;
  typename V::Vec sum{};
  Doubles low_sq{}, high_sq{};  // high_sq only for float lanes
  typename V::Index absmax{}, active{};

  void add(const typename V::Vec& v, const typename V::Vec& limit) {
    const typename V::Index bits = V::magnitude_bits(v);
    typename V::Vec a;
    std::memcpy(&a, &bits, sizeof a);
    if constexpr (sizeof(Acc) == 4) {
      typedef double Wide __attribute__((vector_size(2 * kVectorBytes)));
      const Wide w = __builtin_convertvector(v, Wide);
      const Doubles l = lanes_from<0>(w, Halves{});
      const Doubles h = lanes_from<half>(w, Halves{});
      low_sq += l * l;
      high_sq += h * h;
    } else {
      low_sq += v * v;
    }
    sum += v;
    absmax = bits > absmax ? bits : absmax;
    active -= a > limit;  // true is -1; NaN is not above
  }
  double square_sum(int64_t l) const { return l < half ? low_sq[l] : high_sq[l - half]; }
  // Every lane's sums added to channel c's, each plane stored once.
  void fold_lanes(int64_t c, ChannelSums& to) const {
    double s = 0, q = 0, m = 0, k = 0;
    for (int64_t l = 0; l < V::lanes; ++l) {
      s += sum[l];
      q += square_sum(l);
      m = fasthooks::nan_max(static_cast<double>(V::from_bits(absmax[l])), m);
      k += static_cast<double>(active[l]);
    }
    to.plane(kChannelSum)[c] += s;
    to.plane(kChannelSumSq)[c] += q;
    double& largest = to.plane(kChannelAbsmax)[c];
    largest = fasthooks::nan_max(m, largest);
    to.plane(kChannelActive)[c] += k;
  }
  // Lane l's sums added to channel c's.
  void fold_lane(int64_t l, int64_t c, ChannelSums& to) const {
    to.plane(kChannelSum)[c] += sum[l];
    to.plane(kChannelSumSq)[c] += square_sum(l);
    double& largest = to.plane(kChannelAbsmax)[c];
    largest = fasthooks::nan_max(static_cast<double>(V::from_bits(absmax[l])), largest);
    to.plane(kChannelActive)[c] += static_cast<double>(active[l]);
  }
};

// One value added to channel c's sums in double.
inline void add_to_channel_sums(double v, double near_zero, int64_t c, ChannelSums& to) {
  const double a = std::fabs(v);
  to.plane(kChannelSum)[c] += v;
  to.plane(kChannelSumSq)[c] += v * v;
  double& largest = to.plane(kChannelAbsmax)[c];
  largest = fasthooks::nan_max(a, largest);
  to.plane(kChannelActive)[c] += a > near_zero ? 1.0 : 0.0;
}

// Adds the n values at p, all of channel c, to its sums (a run of one channel, as in NCHW).
template <typename Acc>
inline void add_run(const Acc* p, int64_t n, Acc near_zero, int64_t c, ChannelSums& to) {
  using V = ChannelVectors<Acc>;
  const typename V::Vec limit = typename V::Vec{} + near_zero;
  constexpr int64_t step = 2 * V::lanes;
  int64_t j = 0;
  while (j + step <= n) {
    LaneSums<Acc> a, b;
    const int64_t end = std::min(n - step + 1, j + kChannelFold * step);
    for (; j < end; j += step) {
      a.add(V::load(p + j), limit);
      b.add(V::load(p + j + V::lanes), limit);
    }
    a.fold_lanes(c, to);
    b.fold_lanes(c, to);
  }
  for (; j < n; ++j) add_to_channel_sums(p[j], near_zero, c, to);
}

// Adds `rows` whole rows of `size` channels at p (a stride-1 channel axis) to their sums:
// kChannelUnroll vectors of channels at a time, summed down the rows in registers.
template <typename Acc>
inline void add_rows(const Acc* p, int64_t rows, int64_t size, Acc near_zero, ChannelSums& to) {
  using V = ChannelVectors<Acc>;
  const typename V::Vec limit = typename V::Vec{} + near_zero;
  constexpr int64_t width = kChannelUnroll * V::lanes;
  int64_t c = 0;
  for (; c + width <= size; c += width) {
    for (int64_t r0 = 0; r0 < rows; r0 += kChannelFold) {
      const int64_t r1 = std::min(rows, r0 + kChannelFold);
      LaneSums<Acc> sums[kChannelUnroll];
      for (int64_t r = r0; r < r1; ++r) {
        const Acc* row = p + r * size + c;
        for (int64_t u = 0; u < kChannelUnroll; ++u)
          sums[u].add(V::load(row + u * V::lanes), limit);
      }
      for (int64_t u = 0; u < kChannelUnroll; ++u) {
        for (int64_t l = 0; l < V::lanes; ++l) sums[u].fold_lane(l, c + u * V::lanes + l, to);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = c; k < size; ++k) add_to_channel_sums(p[r * size + k], near_zero, k, to);
  }
}

// Adds the n values at p (in Acc), positions start.. of a tensor in memory order, to the sums of
// their channels (map.channel without its offset).
template <typename Acc>
inline void add_channel_values_of(const Acc* p, int64_t start, int64_t n, const ChannelMap& map,
                                  Acc near_zero, ChannelSums& to) {
  if (map.stride != 1) {
    for (int64_t i = 0; i < n;) {  // runs of one channel
      const int64_t at = start + i;
      const int64_t m = std::min(map.stride - at % map.stride, n - i);
      add_run(p + i, m, near_zero, (at / map.stride) % map.size, to);
      i += m;
    }
    return;
  }
  // A partial first row, whole rows, a partial last row.
  const int64_t size = map.size;
  int64_t i = 0;
  for (int64_t c = start % size; c != 0 && c < size && i < n; ++c, ++i) {
    add_to_channel_sums(p[i], near_zero, c, to);
  }
  const int64_t rows = (n - i) / size;
  add_rows(p + i, rows, size, near_zero, to);
  i += rows * size;
  for (int64_t c = 0; i < n; ++c, ++i) add_to_channel_sums(p[i], near_zero, c, to);
}

template <typename T>
void add_channel_values(const T* p, int64_t start, int64_t n, const ChannelMap& map,
                        double near_zero, ChannelSums& to) {
  using Acc = typename Accumulator<T>::type;
  if constexpr (std::is_same_v<T, Acc>) {
    add_channel_values_of(p, start, n, map, static_cast<Acc>(near_zero), to);
  } else {  // 16-bit values a block at a time in float
    Acc block[kBlock];
    for (int64_t i = 0; i < n; i += kBlock) {
      const int64_t m = std::min(kBlock, n - i);
      to_accumulator(p + i, block, m);
      add_channel_values_of(block, start + i, m, map, static_cast<Acc>(near_zero), to);
    }
  }
}
