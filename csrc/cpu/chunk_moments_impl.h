// Moments of one chunk of contiguous values, in one read pass. This file is included inside an
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

// Values summed in working precision before the block's sums are flushed into double.
constexpr int64_t kBlock = 2048;

template <typename Acc>
struct ShiftedSums {
  Acc shift;
  double s1 = 0.0;
  double s2 = 0.0;
};

// Streaming from memory, a software prefetch this far ahead keeps more loads in flight than the
// hardware prefetcher alone (measured: about +10% once the tensor no longer fits in cache).
constexpr int64_t kPrefetchBytes = 16384;

// Four independent 32-byte accumulators per sum keep both FP pipes busy; GCC's vector extension
// compiles them to AVX2 in the AVX2 kernels and to pairs of SSE2 registers in the portable ones.
template <typename Acc>
inline void add_block(const Acc* p, int64_t n, ShiftedSums<Acc>& sums) {
  typedef Acc Vec __attribute__((vector_size(32)));
  constexpr int64_t lanes = 32 / sizeof(Acc);
  const Vec shift = Vec{} + sums.shift;
  Vec a[4] = {};
  Vec c[4] = {};
  int64_t i = 0;
  for (; i + 4 * lanes <= n; i += 4 * lanes) {
    const char* ahead = reinterpret_cast<const char*>(p + i) + kPrefetchBytes;
    __builtin_prefetch(ahead);
    __builtin_prefetch(ahead + 64);
    for (int k = 0; k < 4; ++k) {
      Vec d;
      std::memcpy(&d, p + i + k * lanes, sizeof(Vec));
      d -= shift;
      a[k] += d;
      c[k] += d * d;
    }
  }
  const Vec a_sum = (a[0] + a[1]) + (a[2] + a[3]);
  const Vec c_sum = (c[0] + c[1]) + (c[2] + c[3]);
  double b1 = 0.0;
  double b2 = 0.0;
  for (int64_t j = 0; j < lanes; ++j) {
    b1 += a_sum[j];
    b2 += c_sum[j];
  }
  for (; i < n; ++i) {
    const Acc d = p[i] - sums.shift;
    b1 += d;
    b2 += d * d;
  }
  sums.s1 += b1;
  sums.s2 += b2;
}

inline void bfloat16_to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i].x) << 16;
    std::memcpy(dst + i, &bits, sizeof(bits));
  }
}

inline void to_accumulator(const c10::Half* src, float* dst, int64_t n) {
  half_to_float(src, dst, n);
}
inline void to_accumulator(const c10::BFloat16* src, float* dst, int64_t n) {
  bfloat16_to_float(src, dst, n);
}

// Shifting by a value near the data keeps the float32 sums well conditioned when |mean| >> std.
template <typename Acc>
inline Acc pick_shift(const Acc* p, int64_t n) {
  Acc sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += p[i];
  const Acc shift = sum / static_cast<Acc>(n);
  return shift - shift == 0 ? shift : Acc(0);  // an infinite or NaN shift would poison every value
}

constexpr int64_t kShiftSamples = 16;

template <typename T>
Moments chunk_moments(const T* p, int64_t n) {
  using Acc = typename Accumulator<T>::type;
  const int64_t head = n < kShiftSamples ? n : kShiftSamples;
  if constexpr (std::is_same_v<T, Acc>) {
    ShiftedSums<Acc> sums{pick_shift(p, head)};
    for (int64_t b = 0; b < n; b += kBlock) add_block(p + b, n - b < kBlock ? n - b : kBlock, sums);
    return moments_from_shifted_sums(static_cast<double>(n), sums.shift, sums.s1, sums.s2);
  } else {
    Acc buffer[kBlock] = {};
    to_accumulator(p, buffer, head);
    ShiftedSums<Acc> sums{pick_shift(buffer, head)};
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = n - b < kBlock ? n - b : kBlock;
      to_accumulator(p + b, buffer, len);
      add_block(buffer, len, sums);
    }
    return moments_from_shifted_sums(static_cast<double>(n), sums.shift, sums.s1, sums.s2);
  }
}

inline ChunkKernels make_kernels() {
  return {&chunk_moments<float>, &chunk_moments<double>, &chunk_moments<c10::Half>,
          &chunk_moments<c10::BFloat16>};
}
