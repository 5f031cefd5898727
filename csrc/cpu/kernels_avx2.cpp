// The AVX2 chunk kernels. Every header is included before the target pragma, so that no inline
// function shared with the portable kernels is compiled for AVX2 here.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace fasthooks {
namespace avx2 {

constexpr int64_t kVectorBytes = 32;

inline void half_to_float(const torch::headeronly::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(bits));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i].x);
}

typedef float Float8 __attribute__((vector_size(32)));
typedef int32_t Int8 __attribute__((vector_size(32)));
typedef double Double4 __attribute__((vector_size(32)));
typedef int64_t Long4 __attribute__((vector_size(32)));

inline void gather(const float* table, const Int8& index, Float8& out) {
  out = reinterpret_cast<Float8>(_mm256_i32gather_ps(table, reinterpret_cast<__m256i>(index), 4));
}
inline void gather(const double* table, const Long4& index, Double4& out) {
  out = reinterpret_cast<Double4>(_mm256_i64gather_pd(table, reinterpret_cast<__m256i>(index), 8));
}

// max_pd returns its second operand, low, for NaN.
inline void clamp_lanes(const Double4& v, const Double4& low, const Double4& high, Double4& out) {
  const __m256d above = _mm256_max_pd(reinterpret_cast<__m256d>(v), reinterpret_cast<__m256d>(low));
  out = reinterpret_cast<Double4>(_mm256_min_pd(above, reinterpret_cast<__m256d>(high)));
}

// Each lane rounded down to a whole number, as an index (NaN, or beyond the index range: the
// lowest index).
inline void floor_to_index(const Float8& v, Int8& out) {
  out = reinterpret_cast<Int8>(_mm256_cvtps_epi32(_mm256_floor_ps(reinterpret_cast<__m256>(v))));
}
inline void floor_to_index(const Double4& v, Long4& out) {
  out = __builtin_convertvector(
      reinterpret_cast<Double4>(_mm256_floor_pd(reinterpret_cast<__m256d>(v))), Long4);
}

// floor(v * scale - origin) as an index, for v * scale exact (NaN, or beyond the index range:
// outside [0, 256)). The product's floor, converted, then the whole origin subtracted.
inline void shifted_floor(const Float8& v, const Float8& scale, const Float8& origin, Int8& out) {
  const __m256 floor = _mm256_floor_ps(reinterpret_cast<__m256>(v * scale));
  out = reinterpret_cast<Int8>(_mm256_cvtps_epi32(floor)) - __builtin_convertvector(origin, Int8);
}
inline void shifted_floor(const Double4& v, const Double4& scale, const Double4& origin,
                          Long4& out) {
  Double4 bounded;
  clamp_lanes(v * scale, origin - 1.0, origin + 256.0, bounded);  // NaN becomes origin - 1
  floor_to_index(bounded, out);
  out -= __builtin_convertvector(origin, Long4);
}

inline bool any_lane(const Int8& mask) {
  return _mm256_movemask_ps(reinterpret_cast<__m256>(mask)) != 0;
}
inline bool any_lane(const Long4& mask) {
  return _mm256_movemask_pd(reinterpret_cast<__m256d>(mask)) != 0;
}

// For each mask of 8 lanes, the permutation that moves the selected lanes to the front.
struct PackTable {
  int32_t lanes[256][8];
};
constexpr PackTable make_pack_table() {
  PackTable table{};
  for (int mask = 0; mask < 256; ++mask) {
    int next = 0;
    for (int j = 0; j < 8; ++j) {
      if (mask >> j & 1) table.lanes[mask][next++] = j;
    }
  }
  return table;
}
alignas(32) constexpr PackTable kPackTable = make_pack_table();

// Stores the lanes of index selected by mask contiguously at out (a whole vector is written);
// returns how many there were.
inline int64_t pack_lanes(const Int8& index, const Int8& mask, int32_t* out) {
  const int bits = _mm256_movemask_ps(reinterpret_cast<__m256>(mask));
  const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPackTable.lanes[bits]));
  const __m256i packed = _mm256_permutevar8x32_epi32(reinterpret_cast<__m256i>(index), order);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
  return __builtin_popcount(bits);
}
inline int64_t pack_lanes(const Long4& index, const Long4& mask, int64_t* out) {
  int64_t count = 0;
  for (int j = 0; j < 4; ++j) {
    out[count] = index[j];
    count += mask[j] != 0;
  }
  return count;
}

// Four vectors of bin codes as bytes, in any order (counting needs none): signed saturation keeps
// every code outside [0, bins] outside it, and -1 (in no bin) as 0xff.
template <typename Bytes>
inline void narrow_codes(const Int8 (&codes)[4], Bytes& out) {
  static_assert(sizeof(Bytes) == 32);
  const __m256i low =
      _mm256_packs_epi32(reinterpret_cast<__m256i>(codes[0]), reinterpret_cast<__m256i>(codes[1]));
  const __m256i high =
      _mm256_packs_epi32(reinterpret_cast<__m256i>(codes[2]), reinterpret_cast<__m256i>(codes[3]));
  out = reinterpret_cast<Bytes>(_mm256_packs_epi16(low, high));
}
template <typename Bytes>
inline void narrow_codes(const Long4 (&codes)[4], Bytes& out) {
  for (int q = 0; q < 4; ++q) {
    for (int j = 0; j < 4; ++j) {
      const int64_t c = codes[q][j];
      out[4 * q + j] = static_cast<uint8_t>(c < -128 ? -128 : c > 127 ? 127 : c);
    }
  }
}

typedef uint8_t Bytes32 __attribute__((vector_size(32)));
// The sums of each eight bytes.
inline Long4 byte_sums(const Bytes32& bytes) {
  return reinterpret_cast<Long4>(
      _mm256_sad_epu8(reinterpret_cast<__m256i>(bytes), _mm256_setzero_si256()));
}

// Byte lookups in a 16-entry table per 16-byte lane. The index of a code `offset` above the
// table's first entry (wrapped below it) has bit 7 clear, and the offset in its low bits, only for
// an offset below 16: then the lookup gives the entry, else 0.
inline void lookup_index(const Bytes32& offset, Bytes32& index) {
  index = reinterpret_cast<Bytes32>(
      _mm256_adds_epu8(reinterpret_cast<__m256i>(offset), _mm256_set1_epi8(0x70)));
}
inline void lookup(const Bytes32& table, const Bytes32& index, Bytes32& out) {
  out = reinterpret_cast<Bytes32>(
      _mm256_shuffle_epi8(reinterpret_cast<__m256i>(table), reinterpret_cast<__m256i>(index)));
}

constexpr CodeCounting kCodeCounting = CodeCounting::kNibbleLookup;

#include "chunk_stats_impl.h"

}  // namespace avx2
}  // namespace fasthooks

#pragma GCC pop_options

namespace fasthooks {
FASTHOOKS_KERNEL_TABLE(avx2_kernels, avx2::make_kernels());
}  // namespace fasthooks

#endif
