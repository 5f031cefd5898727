// The AVX-512 chunk kernels (F, BW, DQ and VL: every x86-64 server CPU with AVX-512). Every header
// is included before the target pragma, so that no inline function shared with the other kernels
// is compiled for AVX-512 here.
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")

namespace fasthooks {
namespace avx512 {

#include "avx512_primitives.h"

constexpr CodeCounting kCodeCounting = CodeCounting::kNibbleLookup;

#include "chunk_stats_impl.h"

}  // namespace avx512
}  // namespace fasthooks

#pragma GCC pop_options

namespace fasthooks {
FASTHOOKS_KERNEL_TABLE(avx512_kernels, avx512::make_kernels());
}  // namespace fasthooks

#endif
