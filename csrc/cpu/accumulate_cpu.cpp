// CPU kernel of fasthooks::accumulate_moments: one parallel read pass, merged into the state slot.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"
#include "capability.h"

namespace fasthooks {
namespace {

// Small enough to spread a few MB over threads, large enough that a chunk streams at full speed.
constexpr int64_t kChunk = 1 << 16;

template <typename T>
Moments dense_moments(const T* p, int64_t n, Moments (*kernel)(const T*, int64_t)) {
  if (n <= kChunk) return kernel(p, n);  // a hook's typical call: no thread hand-off, no allocation
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<Moments> parts(chunks);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t start = c * kChunk;
      parts[c] = kernel(p + start, n - start < kChunk ? n - start : kChunk);
    }
  });
  // Merged in chunk order, so the result does not depend on the number of threads.
  Moments total{0.0, 0.0, 0.0};
  for (const Moments& part : parts) total = merge(total, part);
  return total;
}

Moments tensor_moments(const at::Tensor& x) {
  // Moments ignore element order, so any dense layout (channels_last included) is read in place.
  const at::Tensor dense = x.is_non_overlapping_and_dense() ? x : x.contiguous();
  const ChunkKernels& k = cpu_kernels();
  const int64_t n = dense.numel();
  switch (dense.scalar_type()) {
    case at::kFloat:
      return dense_moments(dense.const_data_ptr<float>(), n, k.f32);
    case at::kDouble:
      return dense_moments(dense.const_data_ptr<double>(), n, k.f64);
    case at::kHalf:
      return dense_moments(dense.const_data_ptr<c10::Half>(), n, k.f16);
    case at::kBFloat16:
      return dense_moments(dense.const_data_ptr<c10::BFloat16>(), n, k.bf16);
    default:
      TORCH_CHECK(false, "accumulate_moments: unsupported dtype ", dense.scalar_type());
  }
}

void accumulate_moments_cpu(const at::Tensor& x, const at::Tensor& state, const at::Tensor& cursor,
                            int64_t slot) {
  check_accumulate_args(x, state, cursor, slot);
  const int64_t column = *cursor.const_data_ptr<int64_t>();
  TORCH_CHECK(column >= 0 && column < state.size(2), "accumulate_moments: cursor must be in [0, ",
              state.size(2), "), got ", column);
  if (x.numel() == 0) return;
  const Moments batch = tensor_moments(x);
  const int64_t plane = state_plane(state);
  double* at = state.mutable_data_ptr<double>() + slot * state.size(2) + column;
  const Moments merged = merge({at[0], at[plane], at[2 * plane]}, batch);
  at[0] = merged.count;
  at[plane] = merged.mean;
  at[2 * plane] = merged.m2;
}

}  // namespace

TORCH_LIBRARY_IMPL(fasthooks, CPU, m) { m.impl("accumulate_moments", &accumulate_moments_cpu); }

}  // namespace fasthooks
