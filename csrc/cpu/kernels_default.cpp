// The portable chunk kernels: baseline instruction set of the target.
#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace fasthooks {
namespace portable {

// The baseline's own width (SSE2, NEON): wider generic vectors are split, and GCC turns their
// compares and selects into scalar code.
constexpr int64_t kVectorBytes = 16;

inline void half_to_float(const torch::headeronly::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename Acc, typename Index, typename Vec>
inline void gather(const Acc* table, const Index& index, Vec& out) {
  for (size_t j = 0; j < sizeof(Vec) / sizeof(Acc); ++j) out[j] = table[index[j]];
}

template <typename Vec>
inline void clamp_lanes(const Vec& v, const Vec& low, const Vec& high, Vec& out) {
  const Vec above = v > low ? v : low;  // NaN becomes low
  out = above < high ? above : high;
}

// Each lane rounded down to a whole number, as an index: bounded to +-2^30 first (NaN to -2^30),
// so that every conversion is defined, truncated, then one less where that rounded up (a negative
// fraction). Baseline instructions only.
template <typename Vec, typename Index>
inline void floor_to_index(const Vec& v, Index& out) {
  const Vec limit = Vec{} + (1 << 30);
  Vec bounded;
  clamp_lanes(v, -limit, limit, bounded);
  const Index truncated = __builtin_convertvector(bounded, Index);
  out = truncated + (bounded < __builtin_convertvector(truncated, Vec));  // true is -1
}

// floor(v * scale - origin) as an index, for v * scale exact (NaN, or beyond +-2^30: outside
// [0, 256), as floor_to_index bounds its input).
template <typename Vec, typename Index>
inline void shifted_floor(const Vec& v, const Vec& scale, const Vec& origin, Index& out) {
  floor_to_index(v * scale, out);
  out -= __builtin_convertvector(origin, Index);
}

template <typename Index>
inline bool any_lane(const Index& mask) {
  bool any = false;
  for (size_t j = 0; j < sizeof(Index) / sizeof(mask[0]); ++j) any |= mask[j] != 0;
  return any;
}

template <typename Index, typename Int>
inline int64_t pack_lanes(const Index& index, const Index& mask, Int* out) {
  int64_t count = 0;
  for (size_t j = 0; j < sizeof(Index) / sizeof(Int); ++j) {
    out[count] = index[j];
    count += mask[j] != 0;
  }
  return count;
}

// Four vectors of bin codes as bytes: saturated to [-128, 127], which keeps every code outside
// [0, bins] outside it, and -1 (in no bin) as 0xff.
template <typename Index, typename Bytes>
inline void narrow_codes(const Index (&codes)[4], Bytes& out) {
  constexpr size_t lanes = sizeof(Index) / sizeof(codes[0][0]);
  typedef int8_t Quarter __attribute__((vector_size(lanes)));
  const Index lowest = Index{} - 128, highest = Index{} + 127;
  for (size_t q = 0; q < 4; ++q) {
    const Index above = codes[q] > lowest ? codes[q] : lowest;
    const Quarter bytes = __builtin_convertvector(above < highest ? above : highest, Quarter);
    std::memcpy(reinterpret_cast<char*>(&out) + q * lanes, &bytes, lanes);
  }
}

// The sums of each eight bytes.
typedef uint8_t Bytes16 __attribute__((vector_size(16)));
typedef int64_t Long2 __attribute__((vector_size(16)));
inline Long2 byte_sums(const Bytes16& bytes) {
  Long2 sums = {};
  for (size_t j = 0; j < sizeof(bytes); ++j) sums[j / 8] += bytes[j];
  return sums;
}

// No byte lookup in the baseline instruction set: bins are counted by comparison.
constexpr CodeCounting kCodeCounting = CodeCounting::kComparison;

#include "chunk_stats_impl.h"

}  // namespace portable

FASTHOOKS_KERNEL_TABLE(default_kernels, portable::make_kernels());

}  // namespace fasthooks
