// Statistics of one chunk of contiguous values, in one read pass. This file is included inside an
// instruction-set namespace by kernels_<isa>.cpp, which first defines kVectorBytes (the width of
// its vectors), kCodeCounting, half_to_float() and the vector primitives; it includes nothing, so
// that each inclusion compiles for its own target.

template <typename T>
struct Accumulator {
  using type = float;  // half types and float32 sum in float32 within a block
};
template <>
struct Accumulator<double> {
  using type = double;
};

// Values summed in working precision, around one shift, before their sums go to double.
constexpr int64_t kBlock = 4096;

// Streaming from memory, a software prefetch this far ahead keeps more loads in flight than the
// hardware prefetcher alone (measured: about +10% once the tensor no longer fits in cache).
constexpr int64_t kPrefetchBytes = 16384;

// Counting primitives in the generic vector extension; a kernel with better instructions for them
// defines overloads of its own, which win.
// Adds one to each byte of hits where codes equals key (a true comparison is -1).
template <typename Bytes>
inline void count_equal(const Bytes& codes, const Bytes& key, Bytes& hits) {
  hits -= (Bytes)(codes == key);
}
// Adds one to each lane of counts where v <= limit.
template <typename Vec, typename Index>
inline void count_at_most(const Vec& v, const Vec& limit, Index& counts) {
  counts -= v <= limit;
}

// How a block's histogram is counted: with few bins, each value's bin goes into a byte code
// (outside [0, bins]: in no bin) and the codes are counted a vector of them at a time for each
// bin that occurs (count_codes); with many, the bins of the values in range are packed and
// counted one by one. kExactCoded is kCoded where the first guess of a bin is provably exact
// (ChunkParams::exact_origin).
enum class HistMode { kNone, kCoded, kExactCoded, kPacked };
constexpr bool coded(HistMode mode) {
  return mode == HistMode::kCoded || mode == HistMode::kExactCoded;
}
constexpr int64_t kNoBinCode = 255;
constexpr int64_t kMaxCodedBins = 64;
constexpr int64_t kCodeVector = kVectorBytes;

// Finds the bins of a vector of values. A first guess is clamped to [0.5, bins - 0.5] (a value in
// the outer half of an outer bin needs no check) and, only in the rare vector where some guess
// lies within `margin` of an edge, moved one step down or up against the exact edges (gathered).
// As scalar code, GCC turns the clamps into branches that random data mispredicts half the time
// (measured: 12 ns a value).
template <typename Acc>
struct VectorBins {
  typedef Acc Vec __attribute__((vector_size(kVectorBytes)));
  using Index = decltype(Vec{} < Vec{});
  using Int = std::conditional_t<sizeof(Acc) == 4, int32_t, int64_t>;
  static constexpr int64_t lanes = kVectorBytes / sizeof(Acc);
  // The codes of four vectors, as bytes: unsigned (kNoBinCode is the largest) and signed (it is
  // -1).
  typedef uint8_t CodeBytes __attribute__((vector_size(4 * lanes)));
  typedef int8_t SignedCodeBytes __attribute__((vector_size(4 * lanes)));

  VectorBins(const BinTable<Acc>& t, Acc margin, int64_t exact_origin)
      : table(t),
        scale(Vec{} + t.scale),
        offset(Vec{} + t.lo * t.scale),
        last(Index{} + static_cast<Int>(t.bins - 1)),
        first(Vec{} + t.lower[0]),
        top(Vec{} + t.top),
        near_low(Vec{} + margin),
        near_high(Vec{} + (Acc(1) - margin)),
        origin(Vec{} + (exact_origin == kNoExactOrigin ? Acc(0) : static_cast<Acc>(exact_origin))) {
  }

  // A first guess of each lane's bin, the floor of its position in bins, and the lanes whose
  // guess may be one bin off. Away from an edge the guess is the bin, or a position outside
  // [0, bins) for a value in none (NaN among them). (Vectors are passed by reference: returning
  // one by value changes the ABI of the portable kernels.)
  void guess(const Vec& v, Index& pos, Index& unsure) const {
    const Vec g = v * scale - offset;
    floor_to_index(g, pos);
    const Vec fraction = g - __builtin_convertvector(pos, Vec);
    unsure = (fraction < near_low) | (fraction > near_high);
  }

  // Each guess moved one step down or up against the exact edges where it is off, once brought
  // into [0, bins) for the gathers; then every value in no bin marked so (-1).
  void settle(const Vec& v, Index& pos) const {
    pos = pos < Index{} ? Index{} : pos;
    pos = pos > last ? last : pos;
    Vec edge;
    gather(table.lower, pos, edge);
    pos += v < edge;  // a true comparison is -1
    gather(table.lower, pos + 1, edge);
    pos -= v >= edge;
    Index none;
    outside(v, none);
    pos |= none;
  }

  // Lanes whose value is in no bin: outside the range, or NaN.
  void outside(const Vec& v, Index& out) const { out = (v < first) | ~(v <= top); }

  // Writes a whole vector at out; returns how many of its bins belong there.
  int64_t pack(const Vec& v, Int* out) const {
    Index pos, unsure, none;
    guess(v, pos, unsure);
    if (any_lane(unsure)) settle(v, pos);
    outside(v, none);
    return pack_lanes(pos, ~none, out);
  }

  // Each lane's bin, or a code outside [0, bins] for a value in no bin, for two vectors at once:
  // one test of whether any guess needs settling. Where the bins are exact in units of v * scale
  // (ChunkParams::exact_origin), the floor of v * scale - origin is the code and needs no check,
  // except code `bins`: values in [top, top + bin width), of which only top is in the last bin
  // (count_block_bins looks for it).
  template <bool Exact>
  void code(const Vec& a, const Vec& b, Index& code_a, Index& code_b) const {
    if constexpr (Exact) {
      shifted_floor(a, scale, origin, code_a);
      shifted_floor(b, scale, origin, code_b);
      return;
    }
    Index unsure_a, unsure_b;
    guess(a, code_a, unsure_a);
    guess(b, code_b, unsure_b);
    if (any_lane(unsure_a | unsure_b)) {
      settle(a, code_a);
      settle(b, code_b);
    }
  }

  const BinTable<Acc>& table;
  const Vec scale, offset;
  const Index last;  // the last bin
  const Vec first, top, near_low, near_high;
  const Vec origin;  // the exact origin, or 0 without one
};

// Bins found for one block, counted in one of kHistLanes lane-private rows so that consecutive
// values in one bin do not wait on each other's store.
template <typename Acc, typename Int>
inline void count_bins(const Int* bins, int64_t packed, const BinTable<Acc>& t, uint32_t* rows) {
  const int64_t stride = t.bins + 1;
  int64_t i = 0;
  for (; i + kHistLanes <= packed; i += kHistLanes) {
    for (int64_t k = 0; k < kHistLanes; ++k) ++rows[k * stride + bins[i + k]];
  }
  for (; i < packed; ++i) ++rows[bins[i]];
}

// Lane j of the result: lanes 2j and 2j + 1 of a followed by b, added.
template <typename Sums, size_t... Lane>
inline Sums add_neighbours(const Sums& a, const Sums& b, std::index_sequence<Lane...>) {
  return __builtin_shufflevector(a, b, (2 * Lane)...) +
         __builtin_shufflevector(a, b, (2 * Lane + 1)...);
}

// Adds the byte sum of counters[j] to row[first + j] for first + j <= last. The N vectors are
// reduced together, neighbouring lanes added pair by pair (which keeps their order): a few
// instructions a counter, where reducing each alone takes a dozen.
template <size_t N, typename Bytes>
inline void add_byte_sums(const Bytes (&counters)[N], int64_t first, int64_t last, uint32_t* row) {
  using Sums = decltype(byte_sums(counters[0]));
  constexpr size_t lanes = sizeof(Sums) / sizeof(int64_t);
  static_assert(N % lanes == 0, "every lane of the reduced sums holds one counter's sum");
  Sums sums[N];
  for (size_t j = 0; j < N; ++j) sums[j] = byte_sums(counters[j]);
  for (size_t m = N; m > N / lanes; m /= 2) {
    for (size_t j = 0; j < m / 2; ++j) {
      sums[j] = add_neighbours(sums[2 * j], sums[2 * j + 1], std::make_index_sequence<lanes>{});
    }
  }
  int64_t total[N];
  std::memcpy(total, sums, sizeof(total));
  for (int64_t j = 0; j < static_cast<int64_t>(N) && first + j <= last; ++j) {
    row[first + j] += total[j];
  }
}

// The lookup index (see lookup_index) of the j-th vector of codes in a table whose first entry is
// code `origin`.
template <typename Bytes>
inline Bytes code_index(const uint8_t* codes, int64_t j, const Bytes& origin) {
  Bytes v, index;
  std::memcpy(&v, codes + j * sizeof(Bytes), sizeof(v));
  lookup_index(v - origin, index);
  return index;
}

// Counts the byte codes of a block (a whole number of vectors, padded with kNoBinCode) for each
// bin from first to last, four bins per read of the codes, by comparison. `ahead` is fetched on
// the way, so that memory stays busy meanwhile.
template <typename Bytes>
inline void count_codes_by_comparison(const uint8_t* codes, int64_t vectors, int64_t first,
                                      int64_t last, uint32_t* row, const char* ahead) {
  constexpr int64_t kKeys = 4;
  constexpr int64_t kReads = 255;  // a byte counter gains at most one a read
  for (int64_t k = first; k <= last; k += kKeys) {
    Bytes key[kKeys];
    for (int64_t q = 0; q < kKeys; ++q) key[q] = Bytes{} + static_cast<uint8_t>(k + q);
    for (int64_t start = 0; start < vectors; start += kReads) {
      const int64_t end = start + kReads < vectors ? start + kReads : vectors;
      Bytes hits[kKeys] = {};
      for (int64_t j = start; j < end; ++j) {
        if (k == first) __builtin_prefetch(ahead + j * 64);
        Bytes v;
        std::memcpy(&v, codes + j * kCodeVector, sizeof(v));
        for (int64_t q = 0; q < kKeys; ++q) count_equal(v, key[q], hits[q]);
      }
      add_byte_sums(hits, k, last, row);
    }
  }
}

// The same, eight bins per read, with a byte lookup in 16-entry tables: one table per pair of bins
// holds 1 for the first and 16 for the second, so that the two counts build up in the nibbles of a
// byte, moved to byte counters before they can carry. Half the instructions of comparing.
template <typename Bytes>
inline void count_codes_by_lookup(const uint8_t* codes, int64_t vectors, int64_t first,
                                  int64_t last, uint32_t* row, const char* ahead) {
  constexpr int64_t kPairs = 4;
  constexpr int64_t kNibbleMax = 15;
  static_assert(kBlock / sizeof(Bytes) <= 255, "a byte counter must not wrap within a block");
  for (int64_t k = first; k <= last; k += 2 * kPairs) {
    Bytes table[kPairs], nibbles[kPairs] = {}, even[kPairs] = {}, odd[kPairs] = {};
    for (int64_t q = 0; q < kPairs; ++q) {
      for (int64_t j = 0; j < kCodeVector; ++j) {
        const int64_t entry = j % 16;
        table[q][j] = entry == 2 * q ? 1 : entry == 2 * q + 1 ? 16 : 0;
      }
    }
    const Bytes origin = Bytes{} + static_cast<uint8_t>(k);
    int64_t room = kNibbleMax;  // reads before a nibble could carry
    for (int64_t j = 0; j < vectors; ++j) {
      if (k == first) __builtin_prefetch(ahead + j * 64);
      const Bytes index = code_index(codes, j, origin);
      for (int64_t q = 0; q < kPairs; ++q) {
        Bytes hit;
        lookup(table[q], index, hit);
        nibbles[q] += hit;
      }
      if (--room == 0 || j + 1 == vectors) {
        for (int64_t q = 0; q < kPairs; ++q) {
          even[q] += nibbles[q] & 15;
          odd[q] += nibbles[q] >> 4;
          nibbles[q] = Bytes{};
        }
        room = kNibbleMax;
      }
    }
    Bytes counters[2 * kPairs];
    for (int64_t q = 0; q < kPairs; ++q) {
      counters[2 * q] = even[q];
      counters[2 * q + 1] = odd[q];
    }
    add_byte_sums(counters, k, last, row);
  }
}

// Byte j of the q-th eight bytes moved to byte 8j + q: the 8 x 8 transpose of a 64-byte vector.
template <typename Bytes, size_t... Byte>
inline Bytes transpose_bytes(const Bytes& v, std::index_sequence<Byte...>) {
  return __builtin_shufflevector(v, v, (Byte % 8 * 8 + Byte / 8)...);
}

// Counts the codes of Halves x 8 bins from k into total (see count_codes_by_transpose).
template <int Halves, typename Bytes>
inline void count_window_by_transpose(const uint8_t* codes, int64_t vectors, int64_t k,
                                      const Bytes (&one_hot)[2], const char* ahead,
                                      int64_t (&total)[16]) {
  static_assert(sizeof(Bytes) == 64, "the transposes work on eight groups of eight bytes");
  // A read adds at most 8 to a byte counter: 16 reads fit, then they go to wider sums.
  constexpr int64_t kReads = 16;
  using Sums = decltype(byte_sums(Bytes{}));
  const Bytes origin = Bytes{} + static_cast<uint8_t>(k);
  Sums sums[Halves] = {};
  for (int64_t start = 0; start < vectors; start += kReads) {
    const int64_t end = start + kReads < vectors ? start + kReads : vectors;
    Bytes counts[Halves] = {};
    for (int64_t j = start; j < end; ++j) {
      if (ahead != nullptr) __builtin_prefetch(ahead + j * 64);
      const Bytes index = code_index(codes, j, origin);
      for (int h = 0; h < Halves; ++h) {
        Bytes bits;
        lookup(one_hot[h], index, bits);
        counts[h] += popcount_bytes(transpose_bits(bits));
      }
    }
    for (int h = 0; h < Halves; ++h) {
      sums[h] += byte_sums(transpose_bytes(counts[h], std::make_index_sequence<64>{}));
    }
  }
  std::memcpy(total, sums, sizeof(sums));
}

// The same, sixteen bins per read of the codes with two byte lookups, where the kernel transposes
// the bits of each eight bytes (transpose_bits) and counts the bits of a byte (popcount_bytes): a
// lookup gives each code one bit, its bin's among eight; after the transpose, byte j of each eight
// holds the bits of bin j of those eight codes, and their count is added. Each bin costs a quarter
// of the instructions of nibble lookups.
template <typename Bytes>
inline void count_codes_by_transpose(const uint8_t* codes, int64_t vectors, int64_t first,
                                     int64_t last, uint32_t* row, const char* ahead) {
  Bytes one_hot[2];
  for (int64_t j = 0; j < kCodeVector; ++j) {
    const int64_t entry = j % 16;
    one_hot[0][j] = entry < 8 ? 1 << entry : 0;
    one_hot[1][j] = entry < 8 ? 0 : 1 << (entry - 8);
  }
  for (int64_t k = first; k <= last; k += 16) {
    const char* fetch = k == first ? ahead : nullptr;
    int64_t total[16] = {};
    if (last - k < 8) {
      count_window_by_transpose<1>(codes, vectors, k, one_hot, fetch, total);
    } else {
      count_window_by_transpose<2>(codes, vectors, k, one_hot, fetch, total);
    }
    for (int64_t j = 0; j < 16 && k + j <= last; ++j) row[k + j] += total[j];
  }
}

inline void count_codes(const uint8_t* codes, int64_t vectors, int64_t first, int64_t last,
                        uint32_t* row, const char* ahead) {
  typedef uint8_t Bytes __attribute__((vector_size(kCodeVector)));
  if constexpr (kCodeCounting == CodeCounting::kBitTranspose) {
    count_codes_by_transpose<Bytes>(codes, vectors, first, last, row, ahead);
  } else if constexpr (kCodeCounting == CodeCounting::kNibbleLookup) {
    count_codes_by_lookup<Bytes>(codes, vectors, first, last, row, ahead);
  } else {
    count_codes_by_comparison<Bytes>(codes, vectors, first, last, row, ahead);
  }
}

// A vector's lanes combined by op as a tree of halves: a few instructions where a loop over the
// lanes takes a few per lane.
template <typename V, typename Op, size_t... Low>
inline auto fold_halves(const V& v, Op op, std::index_sequence<Low...>) {
  return op(__builtin_shufflevector(v, v, Low...),
            __builtin_shufflevector(v, v, (Low + sizeof...(Low))...));
}
template <typename V, typename Op>
inline auto reduce_lanes(const V& v, Op op) {
  constexpr size_t lanes = sizeof(V) / sizeof(v[0]);
  if constexpr (lanes == 2) {
    return op(v[0], v[1]);
  } else {
    return reduce_lanes(fold_halves(v, op, std::make_index_sequence<lanes / 2>{}), op);
  }
}
constexpr auto plus = [](const auto& a, const auto& b) { return a + b; };
constexpr auto smaller = [](const auto& a, const auto& b) { return a < b ? a : b; };
constexpr auto larger = [](const auto& a, const auto& b) { return a > b ? a : b; };

// A vector of doubles as long as Vec (a typedef inside a template would not depend on Vec).
template <typename Vec>
struct DoublesLike {
  typedef double type __attribute__((vector_size(sizeof(Vec) / sizeof(Vec{}[0]) * sizeof(double))));
};

// The sum of a vector's lanes, each converted to double first.
template <typename Vec>
inline double sum_in_double(const Vec& v) {
  return reduce_lanes(__builtin_convertvector(v, typename DoublesLike<Vec>::type), plus);
}

template <typename Acc>
struct BlockSums {
  double s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0;  // power sums of (x - shift)
  Acc min, max;                                   // NaN is ignored here and found afterwards
  int64_t near_zero = 0;
  int64_t binned = 0;  // with a histogram: values looked at in the vector loop
  int64_t packed = 0;  // HistMode::kPacked: bins written
  int64_t first_bin = kNoBinCode, last_bin = -1;  // coded modes: the bins that occur
};

// Where the vector loop writes what it finds of each value's bin: packed bins or byte codes.
template <typename Acc, HistMode Mode>
using BinsOut = std::conditional_t<coded(Mode), uint8_t, typename VectorBins<Acc>::Int>;

// One pass over a block, finding histogram bins on the way unless Mode is kNone. Independent
// vector accumulators keep the FP pipes busy (four for mean and std; two when every statistic is
// on, which would otherwise run out of registers); GCC's vector extension compiles them to AVX-512
// or AVX2 in those kernels and to the baseline's 16-byte vectors (SSE2, NEON) in the portable.
template <typename Acc, bool Full, HistMode Mode>
inline BlockSums<Acc> block_sums(const Acc* p, int64_t n, Acc shift, Acc near_zero,
                                 const VectorBins<Acc>* finder, BinsOut<Acc, Mode>* out) {
  typedef Acc Vec __attribute__((vector_size(kVectorBytes)));
  using Mask = decltype(Vec{} <= Vec{});
  using Bins = VectorBins<Acc>;
  constexpr int64_t lanes = kVectorBytes / sizeof(Acc);
  constexpr int kAcc = Full ? 2 : 4;
  // Vectors per step: four where their codes are narrowed to bytes together.
  constexpr int kStep = coded(Mode) ? 4 : kAcc;
  const Vec shift_v = Vec{} + shift;
  const Vec near_zero_v = Vec{} + near_zero;
  Vec a1[kAcc] = {}, a2[kAcc] = {}, a3[kAcc] = {}, a4[kAcc] = {};
  Vec lo = Vec{} + static_cast<Acc>(INFINITY);
  Vec hi = Vec{} - static_cast<Acc>(INFINITY);
  Mask small = {};
  // Codes seen, as unsigned bytes (lowest: kNoBinCode never wins) and signed (highest: codes of
  // values below the range, kNoBinCode among them, are negative).
  typename Bins::CodeBytes lowest = {};
  lowest = ~lowest;
  typename Bins::SignedCodeBytes highest = {};
  highest -= 1;
  int64_t packed = 0;
  int64_t i = 0;
  for (; i + kStep * lanes <= n; i += kStep * lanes) {
    const char* ahead = reinterpret_cast<const char*>(p + i) + kPrefetchBytes;
    for (int64_t line = 0; line < kStep * kVectorBytes; line += 64) {
      __builtin_prefetch(ahead + line);
    }
    for (int k = 0; k < kStep; ++k) {
      Vec v;
      std::memcpy(&v, p + i + k * lanes, sizeof(Vec));
      const Vec d = v - shift_v;
      const Vec d2 = d * d;
      a1[k % kAcc] += d;
      a2[k % kAcc] += d2;
      if constexpr (Full) {
        a3[k % kAcc] += d2 * d;
        a4[k % kAcc] += d2 * d2;
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        count_at_most(v, near_zero_v, small);
      }
      if constexpr (Mode == HistMode::kPacked) packed += finder->pack(v, out + packed);
    }
    if constexpr (coded(Mode)) {
      typename Bins::Index codes[4];
      for (int k = 0; k < 4; k += 2) {
        Vec a, b;
        std::memcpy(&a, p + i + k * lanes, sizeof(Vec));
        std::memcpy(&b, p + i + (k + 1) * lanes, sizeof(Vec));
        finder->template code<Mode == HistMode::kExactCoded>(a, b, codes[k], codes[k + 1]);
      }
      typename Bins::CodeBytes bytes;
      narrow_codes(codes, bytes);
      std::memcpy(out + i, &bytes, sizeof(bytes));
      lowest = bytes < lowest ? bytes : lowest;
      const auto as_signed = (typename Bins::SignedCodeBytes)bytes;
      highest = as_signed > highest ? as_signed : highest;
    }
  }
  BlockSums<Acc> s;
  s.packed = packed;
  s.binned = i;
  if constexpr (coded(Mode)) {
    s.first_bin = reduce_lanes(lowest, smaller);
    s.last_bin = reduce_lanes(highest, larger);
  }
  Vec t1 = a1[0], t2 = a2[0], t3 = a3[0], t4 = a4[0];
  for (int k = 1; k < kAcc; ++k) {
    t1 += a1[k];
    t2 += a2[k];
    t3 += a3[k];
    t4 += a4[k];
  }
  s.s1 = sum_in_double(t1);
  s.s2 = sum_in_double(t2);
  if constexpr (Full) {
    s.s3 = sum_in_double(t3);
    s.s4 = sum_in_double(t4);
    s.min = reduce_lanes(lo, smaller);
    s.max = reduce_lanes(hi, larger);
    s.near_zero = reduce_lanes(small, plus);
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

// How many of n values equal the top edge (in the last bin, where the values just above it are in
// none).
template <typename Acc>
inline uint32_t count_top_edge(const Acc* p, int64_t n, Acc top) {
  uint32_t count = 0;
  for (int64_t i = 0; i < n; ++i) count += p[i] == top;
  return count;
}

// Counts what the vector loop found of a block's bins, then the values it left, one by one.
template <typename Acc, HistMode Mode>
inline void count_block_bins(const BlockSums<Acc>& s, BinsOut<Acc, Mode>* found, const Acc* p,
                             int64_t n, const BinTable<Acc>& t, uint32_t* rows) {
  if constexpr (coded(Mode)) {
    const int64_t vectors = (s.binned + kCodeVector - 1) / kCodeVector;
    std::memset(found + s.binned, kNoBinCode, vectors * kCodeVector - s.binned);
    const int64_t last = s.last_bin < t.bins ? s.last_bin : t.bins;
    const uint32_t beyond = rows[t.bins];
    count_codes(found, vectors, s.first_bin, last, rows,
                reinterpret_cast<const char*>(p + n) + kPrefetchBytes);
    if (Mode == HistMode::kExactCoded && rows[t.bins] != beyond) {
      rows[t.bins - 1] += count_top_edge(p, s.binned, t.top);
    }
  } else {
    count_bins(found, s.packed, t, rows);
  }
  for (int64_t j = s.binned; j < n; ++j) ++rows[bin_of(p[j], t)];
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

// The largest distance of a block's values from `shift`: from its extremes where the block pass
// found them, else by a look at every value.
template <typename Acc, bool Full>
inline Acc largest_deviation(const Acc* p, int64_t n, Acc shift, const BlockSums<Acc>& s) {
  if constexpr (Full) return s.max - shift > shift - s.min ? s.max - shift : shift - s.min;
  Acc largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Acc d = p[i] > shift ? p[i] - shift : shift - p[i];
    largest = d > largest ? d : largest;
  }
  return largest;
}

// The moments of a block whose spread underflows (spread_underflows), summed again with every
// value multiplied by a power of two that brings the largest deviation from `shift` near 1. The
// products are exact (no scaled value leaves the normal range) and so are their differences, so
// the scaled sums are those of exact deviations; the moments are scaled back in double.
template <typename Acc, bool Full>
inline void rescaled_moments(const Acc* p, int64_t n, Acc shift, Acc largest, Stats& b) {
  if (largest == Acc(0)) return;  // constant values: no spread to lose
  const int exponent = -std::ilogb(largest);
  const Acc scale = std::ldexp(Acc(1), exponent);
  Acc scaled[kBlock];
  for (int64_t i = 0; i < n; ++i) scaled[i] = p[i] * scale;
  const Acc scaled_shift = shift * scale;
  const BlockSums<Acc> s =
      block_sums<Acc, Full, HistMode::kNone>(scaled, n, scaled_shift, Acc(0), nullptr, nullptr);
  Stats r;
  moments_from_shifted_sums<Full>(r, static_cast<double>(n), scaled_shift, s.s1, s.s2, s.s3, s.s4);
  b.mean = std::ldexp(r.mean, -exponent);
  b.m2 = std::ldexp(r.m2, -2 * exponent);
  if constexpr (Full) {
    b.m3 = std::ldexp(r.m3, -3 * exponent);
    b.m4 = std::ldexp(r.m4, -4 * exponent);
  }
}

// Statistics of one block, summed around `shift`, then once more around the block's own mean
// when `shift` proved far from it (float sums around a distant shift lose the spread), or with
// its values scaled where the spread is too small for the working precision's powers.
// With a histogram, the block's bins are counted into `rows` too.
template <typename Acc, bool Full, HistMode Mode>
inline Stats block_stats(const Acc* p, int64_t n, Acc shift, Acc near_zero,
                         const VectorBins<Acc>* finder, uint32_t* rows) {
  const double count = static_cast<double>(n);
  BinsOut<Acc, Mode> found[Mode == HistMode::kNone ? 1 : kBlock + kCodeVector];
  BlockSums<Acc> s = block_sums<Acc, Full, Mode>(p, n, shift, near_zero, finder, found);
  if constexpr (Mode != HistMode::kNone) {
    count_block_bins<Acc, Mode>(s, found, p, n, finder->table, rows);
  }
  Stats b;
  moments_from_shifted_sums<Full>(b, count, shift, s.s1, s.s2, s.s3, s.s4);
  const double d = s.s1 / count;
  if (spread_underflows<Acc, Full>(b, count)) {
    const Acc mean = finite_or_zero(static_cast<Acc>(b.mean));
    rescaled_moments<Acc, Full>(p, n, mean, largest_deviation<Acc, Full>(p, n, mean, s), b);
  } else if (4.0 * count * d * d > b.m2 && std::isfinite(b.mean)) {
    shift = finite_or_zero(static_cast<Acc>(b.mean));
    s = block_sums<Acc, Full, HistMode::kNone>(p, n, shift, near_zero, nullptr, nullptr);
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

// Statistics of n contiguous values block by block, the histogram counted the way Mode says.
template <typename T, bool Full, HistMode Mode>
Stats blocks_stats(const T* p, int64_t n, typename Accumulator<T>::type near_zero,
                   const VectorBins<typename Accumulator<T>::type>* finder, uint32_t* hist_rows) {
  using Acc = typename Accumulator<T>::type;
  Stats total;
  [[maybe_unused]] Acc buffer[std::is_same_v<T, Acc> ? 1 : kBlock];
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
    total = merge<Full>(
        total, block_stats<Acc, Full, Mode>(values, len, shift, near_zero, finder, hist_rows));
  }
  return total;
}

template <typename T, bool Full>
Stats chunk_stats(const T* p, int64_t n, const ChunkParams<typename Accumulator<T>::type>& params,
                  uint32_t* hist_rows) {
  using Acc = typename Accumulator<T>::type;
  if (hist_rows == nullptr) {
    return blocks_stats<T, Full, HistMode::kNone>(p, n, params.near_zero, nullptr, nullptr);
  }
  const VectorBins<Acc> finder(*params.bins, params.bin_margin, params.exact_origin);
  if (params.bins->bins > kMaxCodedBins) {
    return blocks_stats<T, Full, HistMode::kPacked>(p, n, params.near_zero, &finder, hist_rows);
  }
  if (params.exact_origin != kNoExactOrigin) {
    return blocks_stats<T, Full, HistMode::kExactCoded>(p, n, params.near_zero, &finder, hist_rows);
  }
  return blocks_stats<T, Full, HistMode::kCoded>(p, n, params.near_zero, &finder, hist_rows);
}

#include "channel_sums_impl.h"

// Evaluated at compile time only (see FASTHOOKS_KERNEL_TABLE in kernels.h).
constexpr ChunkKernels make_kernels() {
  return {
      {&chunk_stats<float, false>, &chunk_stats<float, true>},
      {&chunk_stats<double, false>, &chunk_stats<double, true>},
      {&chunk_stats<torch::headeronly::Half, false>, &chunk_stats<torch::headeronly::Half, true>},
      {&chunk_stats<torch::headeronly::BFloat16, false>,
       &chunk_stats<torch::headeronly::BFloat16, true>},
      &add_channel_values<float>,
      &add_channel_values<double>,
      &add_channel_values<torch::headeronly::Half>,
      &add_channel_values<torch::headeronly::BFloat16>};
}
