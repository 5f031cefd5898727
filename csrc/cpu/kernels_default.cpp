// The portable chunk kernels: baseline instruction set of the target.
#include <cstring>
#include <type_traits>

#include "kernels.h"

namespace fasthooks {
namespace portable {

inline void half_to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename Acc, typename Index>
inline auto gather(const Acc* table, Index index) {
  typedef Acc Vec __attribute__((vector_size(32)));
  Vec out;
  for (size_t j = 0; j < sizeof(Vec) / sizeof(Acc); ++j) out[j] = table[index[j]];
  return out;
}

#include "chunk_stats_impl.h"

}  // namespace portable

const ChunkKernels default_kernels = portable::make_kernels();

}  // namespace fasthooks
