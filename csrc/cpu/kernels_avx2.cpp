// The AVX2 chunk kernels. Every header is included before the target pragma, so that no inline
// function shared with the portable kernels is compiled for AVX2 here.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstring>
#include <optional>
#include <type_traits>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace fasthooks {
namespace avx2 {

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

inline void clamp_lanes(const Float8& v, const Float8& low, const Float8& high, Float8& out) {
  // max_ps returns its second operand, low, for NaN.
  const __m256 above = _mm256_max_ps(reinterpret_cast<__m256>(v), reinterpret_cast<__m256>(low));
  out = reinterpret_cast<Float8>(_mm256_min_ps(above, reinterpret_cast<__m256>(high)));
}
inline void clamp_lanes(const Double4& v, const Double4& low, const Double4& high, Double4& out) {
  const __m256d above = _mm256_max_pd(reinterpret_cast<__m256d>(v), reinterpret_cast<__m256d>(low));
  out = reinterpret_cast<Double4>(_mm256_min_pd(above, reinterpret_cast<__m256d>(high)));
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

#include "chunk_stats_impl.h"

}  // namespace avx2
}  // namespace fasthooks

#pragma GCC pop_options

namespace fasthooks {
const ChunkKernels avx2_kernels = avx2::make_kernels();
}  // namespace fasthooks

#endif
