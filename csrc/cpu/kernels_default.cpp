// The portable chunk kernels: baseline instruction set of the target.
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace fasthooks {
namespace portable {

inline void half_to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename Acc, typename Index, typename Vec>
inline void gather(const Acc* table, const Index& index, Vec& out) {
  for (size_t j = 0; j < sizeof(Vec) / sizeof(Acc); ++j) out[j] = table[index[j]];
}

#include "chunk_stats_impl.h"

}  // namespace portable

const ChunkKernels default_kernels = portable::make_kernels();

}  // namespace fasthooks
