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

inline void half_to_float(const c10::Half* src, float* dst, int64_t n) {
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

#include "chunk_stats_impl.h"

}  // namespace avx2
}  // namespace fasthooks

#pragma GCC pop_options

namespace fasthooks {
const ChunkKernels avx2_kernels = avx2::make_kernels();
}  // namespace fasthooks

#endif
