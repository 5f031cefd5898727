// CUDA kernel of fasthooks::accumulate_moments: one launch on the current stream, no host sync.
//
// Every thread sums (x - shift) and (x - shift)^2 over a grid-stride range, blocks reduce to
// partial sums, and the last block to finish adds the partials in block order (so the result is
// deterministic) and merges them into the state slot at the device-side cursor.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <cstdint>

#include "../checks.h"
#include "../moments.h"

namespace fasthooks {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVecBytes = 16;

template <typename T>
struct alignas(kVecBytes) Vec {
  T val[kVecBytes / sizeof(T)];
};

// Sums a and b over the block; the totals are valid in thread 0.
__device__ void block_sum(double& a, double& b) {
  __shared__ double shared[2][kWarps];
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b += __shfl_down_sync(0xffffffffu, b, offset);
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __syncthreads();  // the shared array may still be read by an earlier call
  if (lane == 0) {
    shared[0][warp] = a;
    shared[1][warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < kWarps ? shared[0][lane] : 0.0;
    b = lane < kWarps ? shared[1][lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) {
      a += __shfl_down_sync(0xffffffffu, a, offset);
      b += __shfl_down_sync(0xffffffffu, b, offset);
    }
  }
}

template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads)
    accumulate_moments_kernel(const T* __restrict__ x, int64_t n, bool vectorised,
                              double* __restrict__ partials, unsigned int* __restrict__ finished,
                              double* __restrict__ state, const int64_t* __restrict__ cursor,
                              int64_t slot, int64_t capacity, int64_t plane) {
  // A shift near the data keeps the sums well conditioned when |mean| >> std; every thread reads
  // the same first element, so all partial sums share it.
  const Acc first = static_cast<Acc>(x[0]);
  const Acc shift = first - first == Acc(0) ? first : Acc(0);

  constexpr int kVec = kVecBytes / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vectorised ? n / kVec : 0;
  const Vec<T>* xv = reinterpret_cast<const Vec<T>*>(x);
  double s1 = 0.0;
  double s2 = 0.0;
#pragma unroll 4
  for (int64_t i = tid; i < n_vec; i += stride) {
    const Vec<T> v = xv[i];
    Acc a1 = 0;
    Acc a2 = 0;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const Acc d = static_cast<Acc>(v.val[k]) - shift;
      a1 += d;
      a2 += d * d;
    }
    s1 += a1;
    s2 += a2;
  }
  for (int64_t i = n_vec * kVec + tid; i < n; i += stride) {
    const Acc d = static_cast<Acc>(x[i]) - shift;
    s1 += d;
    s2 += static_cast<double>(d) * d;
  }

  block_sum(s1, s2);
  __shared__ bool last_block;
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = s1;
    partials[2 * blockIdx.x + 1] = s2;
    __threadfence();  // the partials are visible before the ticket is taken
    last_block = atomicAdd(finished, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;

  double t1 = 0.0;
  double t2 = 0.0;
  for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    t1 += __ldcg(partials + 2 * b);
    t2 += __ldcg(partials + 2 * b + 1);
  }
  block_sum(t1, t2);
  if (threadIdx.x == 0) {
    const int64_t column = *cursor;
    CUDA_KERNEL_ASSERT(column >= 0 && column < capacity);
    double* at = state + slot * capacity + column;
    const Moments merged = merge({at[0], at[plane], at[2 * plane]},
                                 moments_from_shifted_sums(static_cast<double>(n), shift, t1, t2));
    at[0] = merged.count;
    at[plane] = merged.mean;
    at[2 * plane] = merged.m2;
  }
}

template <typename T>
void launch(const at::Tensor& dense, const at::Tensor& state, const at::Tensor& cursor,
            int64_t slot) {
  using Acc = at::opmath_type<T>;
  const auto kernel = accumulate_moments_kernel<T, Acc>;
  // As many blocks as can be resident at once: the grid-stride loop covers the rest.
  static const int blocks_per_sm = [&] {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0));
    return blocks;
  }();
  const int64_t n = dense.numel();
  const int64_t per_block = static_cast<int64_t>(kThreads) * (kVecBytes / sizeof(T));
  const int64_t resident =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) *
      blocks_per_sm;
  const int64_t wanted = (n + per_block - 1) / per_block;
  const int blocks = static_cast<int>(wanted < resident ? wanted : resident);

  // Two partial sums per block, then one double whose bytes hold the finished-blocks counter.
  const at::Tensor workspace = at::empty({2 * blocks + 1}, state.options());
  double* partials = workspace.mutable_data_ptr<double>();
  auto* finished = reinterpret_cast<unsigned int*>(partials + 2 * blocks);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemsetAsync(finished, 0, sizeof(double), stream));

  const T* x = dense.const_data_ptr<T>();
  const bool vectorised = reinterpret_cast<uintptr_t>(x) % kVecBytes == 0;
  kernel<<<blocks, kThreads, 0, stream>>>(
      x, n, vectorised, partials, finished, state.mutable_data_ptr<double>(),
      cursor.const_data_ptr<int64_t>(), slot, state.size(2), state_plane(state));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void accumulate_moments_cuda(const at::Tensor& x, const at::Tensor& state, const at::Tensor& cursor,
                             int64_t slot) {
  check_accumulate_args(x, state, cursor, slot);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  // Moments ignore element order, so any dense layout (channels_last included) is read in place.
  const at::Tensor dense = x.is_non_overlapping_and_dense() ? x : x.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dense.scalar_type(),
                                  "accumulate_moments_cuda",
                                  [&] { launch<scalar_t>(dense, state, cursor, slot); });
}

}  // namespace

TORCH_LIBRARY_IMPL(fasthooks, CUDA, m) { m.impl("accumulate_moments", &accumulate_moments_cuda); }

}  // namespace fasthooks
