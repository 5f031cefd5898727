// The AVX-512 chunk kernels for CPUs that also have GFNI, BITALG and VBMI (Intel since Ice Lake,
// AMD since Zen 4): the avx512 kernels, but for counting a histogram's bin codes, which a bit
// transpose and a byte popcount make four times cheaper (count_codes_by_transpose). Every header
// is included before the target pragma, so that no inline function shared with the other kernels
// is compiled for these instructions here.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,gfni,avx512bitalg,avx512vbmi")

namespace fasthooks {
namespace avx512_gfni {

#include "avx512_primitives.h"

// Within each eight bytes, bit i of byte j moved to bit 7 - j of byte i: an affine map over GF(2)
// whose matrix is the data itself, applied to the bytes 1 << i.
inline Bytes64 transpose_bits(const Bytes64& v) {
  const __m512i units = _mm512_set1_epi64(0x8040201008040201LL);
  return reinterpret_cast<Bytes64>(
      _mm512_gf2p8affine_epi64_epi8(units, reinterpret_cast<__m512i>(v), 0));
}

inline Bytes64 popcount_bytes(const Bytes64& v) {
  return reinterpret_cast<Bytes64>(_mm512_popcnt_epi8(reinterpret_cast<__m512i>(v)));
}

constexpr CodeCounting kCodeCounting = CodeCounting::kBitTranspose;

#include "chunk_stats_impl.h"

}  // namespace avx512_gfni
}  // namespace fasthooks

#pragma GCC pop_options

namespace fasthooks {
FASTHOOKS_KERNEL_TABLE(avx512_gfni_kernels, avx512_gfni::make_kernels());
}  // namespace fasthooks

#endif
