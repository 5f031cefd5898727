// The CUDA kernels of fasthooks (csrc/cuda/accumulate_kernel.cuh, the file nvcc compiles) built
// for the host against device_api.h, with a C interface for tests/cuda_on_cpu/__init__.py. The
// host side restates only what needs a GPU in accumulate_cuda.cu: the resident-block count is an
// argument here, and the stream a call comes from is a number.
// The emulation first: the kernels' header uses what it defines.
#include "device_api.h"

#include <cstdio>
#include <exception>

#include "cuda/accumulate_kernel.cuh"
#include "cuda/stream_regions.h"

namespace {

using namespace fasthooks::cuda;

template <typename T>
void run(const void* data, const void* base_data, int64_t n, const Buffers& buffers, bool full,
         int64_t resident) {
  const T* x = static_cast<const T*>(data);
  const T* base = static_cast<const T*>(base_data);
  with_kernel<T>(full, buffers.bins > 0, base != nullptr, [&](auto kernel_of, size_t shared) {
    const LaunchPlan plan = plan_launch(x, base, n, resident);
    cuda_on_cpu::launch(decltype(kernel_of)::kernel, static_cast<unsigned>(plan.blocks), kThreads,
                        shared, x, base, n, plan.head, buffers);
  });
}

template <typename T>
void run_list(const void* const* data, const void* const* base_data, const int64_t* n,
              const int64_t* slot, int64_t count, const Buffers& buffers, bool full,
              int64_t resident) {
  const auto* x = reinterpret_cast<const T* const*>(data);
  const auto* base = reinterpret_cast<const T* const*>(base_data);
  with_kernel<T, true>(full, buffers.bins > 0, base != nullptr, [&](auto kernel_of, size_t shared) {
    for_each_table(x, base, n, slot, count, resident, [&](const TensorTable& table) {
      cuda_on_cpu::launch(decltype(kernel_of)::kernel,
                          static_cast<unsigned>(table.first_block[table.count]), kThreads, shared,
                          table, buffers);
    });
  });
}

// Kernels that break a rule of CUDA, to show that the emulation catches each.
__global__ void shuffle_outside_its_mask() {
  // Lane 1 reads lane 2, which the mask leaves out.
  if (threadIdx.x < 2) __shfl_down_sync(0x3u, 1.0, 1);
}
__global__ void shuffle_beside_a_barrier() {
  // Lane 0 waits for the warp at a shuffle while the others wait at a barrier: a deadlock.
  if (threadIdx.x == 0) {
    __shfl_down_sync(0xffffffffu, 1.0, 1);
  } else {
    __syncthreads();
  }
}
__global__ void lane_outside_the_mask_calls() {
  if (threadIdx.x == 5) __match_any_sync(0x1u, 0);
}

StreamRegions& regions() {
  static StreamRegions r(kRegions);
  return r;
}

}  // namespace

extern "C" {

int64_t harness_workspace_doubles() { return kWorkspaceDoubles; }
int64_t harness_max_blocks() { return kMaxBlocks; }
int64_t harness_regions() { return kRegions; }
int64_t harness_min_blocks_per_sm() { return kMinBlocksPerSM; }

void harness_options(int workers, int split_lanes, unsigned long long seed) {
  cuda_on_cpu::options() = {workers, split_lanes != 0, seed};
}

// launches, blocks, barriers, warp_ops, lane_splits, errors
void harness_counts(int64_t* out) {
  const cuda_on_cpu::Counts& c = cuda_on_cpu::counts();
  const int64_t values[] = {c.launches, c.blocks, c.barriers, c.warp_ops, c.lane_splits, c.errors};
  for (int i = 0; i < 6; ++i) out[i] = values[i];
}

// Runs rule breaker `which` (0, 1 or 2) on one block of 32 threads.
void harness_break_a_rule(int which) {
  if (which == 0) cuda_on_cpu::launch(shuffle_outside_its_mask, 1, 32, 0);
  if (which == 1) cuda_on_cpu::launch(shuffle_beside_a_barrier, 1, 32, 0);
  if (which == 2) cuda_on_cpu::launch(lane_outside_the_mask_calls, 1, 32, 0);
}

// The launch plan (plan_launch) of n values of `dtype` at `x`: out = {head, blocks}.
void harness_plan(int dtype, const void* x, int64_t n, int64_t resident, int64_t* out) {
  LaunchPlan plan{};
  using Half = torch::headeronly::Half;
  if (dtype == 0) plan = plan_launch<float>(static_cast<const float*>(x), nullptr, n, resident);
  if (dtype == 1) plan = plan_launch<double>(static_cast<const double*>(x), nullptr, n, resident);
  if (dtype >= 2) plan = plan_launch<Half>(static_cast<const Half*>(x), nullptr, n, resident);
  out[0] = plan.head;
  out[1] = plan.blocks;
}

const char* harness_last_error() { return cuda_on_cpu::last_error().c_str(); }

// The region a call from `stream` gets (stream_regions.h), or -1 with the message in `error`.
int64_t harness_region_of(const void* workspace, unsigned long long stream, int capturing,
                          char* error, int64_t error_size) {
  try {
    return regions().region_of(workspace, {static_cast<uintptr_t>(stream), capturing != 0});
  } catch (const std::exception& e) {
    std::snprintf(error, static_cast<size_t>(error_size), "%s", e.what());
    return -1;
  }
}

// One call of the operator's CUDA path on CPU memory: x's statistics, or with a base (else null)
// those of x - base, noted in the call order when `order` (and then `clock`) is given.
// dtype: 0 float32, 1 float64, 2 float16, 3 bfloat16.
int harness_accumulate(int dtype, const void* x, const void* base, int64_t n, double* state,
                       float* stats, float* extra, int64_t* hist, int64_t* order, int64_t* clock,
                       const int64_t* cursor, double* workspace, int64_t region, int64_t slot,
                       int64_t modules, int64_t capacity, int64_t bins, int full, double near_zero,
                       double hist_min, double hist_max, int64_t resident) {
  if (n == 0) return 0;
  Buffers b = buffers_for(state, stats, extra, hist, cursor, workspace, region, slot, modules,
                          capacity, bins, near_zero, hist_min, hist_max);
  b.order = order;
  b.clock = reinterpret_cast<unsigned long long*>(clock);
  switch (dtype) {
    case 0:
      run<float>(x, base, n, b, full != 0, resident);
      return 0;
    case 1:
      run<double>(x, base, n, b, full != 0, resident);
      return 0;
    case 2:
      run<torch::headeronly::Half>(x, base, n, b, full != 0, resident);
      return 0;
    case 3:
      run<torch::headeronly::BFloat16>(x, base, n, b, full != 0, resident);
      return 0;
    default:
      return 1;
  }
}

// The list kernel over `count` non-empty tensors of one dtype (their slots in `slot`), bases
// null or one per tensor, as accumulate_stats_list launches it for each dtype.
int harness_accumulate_list(int dtype, const void* const* x, const void* const* base,
                            const int64_t* n, const int64_t* slot, int64_t count, double* state,
                            float* stats, float* extra, int64_t* hist, const int64_t* cursor,
                            double* workspace, int64_t region, int64_t modules, int64_t capacity,
                            int64_t bins, int full, double near_zero, double hist_min,
                            double hist_max, int64_t resident) {
  if (count == 0) return 0;
  const Buffers b = buffers_for(state, stats, extra, hist, cursor, workspace, region, 0, modules,
                                capacity, bins, near_zero, hist_min, hist_max);
  switch (dtype) {
    case 0:
      run_list<float>(x, base, n, slot, count, b, full != 0, resident);
      return 0;
    case 1:
      run_list<double>(x, base, n, slot, count, b, full != 0, resident);
      return 0;
    case 2:
      run_list<torch::headeronly::Half>(x, base, n, slot, count, b, full != 0, resident);
      return 0;
    case 3:
      run_list<torch::headeronly::BFloat16>(x, base, n, slot, count, b, full != 0, resident);
      return 0;
    default:
      return 1;
  }
}

}  // extern "C"
