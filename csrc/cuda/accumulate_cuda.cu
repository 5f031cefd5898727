// Host side of fasthooks::accumulate_stats on CUDA: checks, the workspace region of the call,
// and one launch of the kernel (accumulate_kernel.cuh) on the current stream, with no host
// sync, no allocation and no memset.
#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <atomic>
#include <cstdint>

#include "../checks.h"
#include "accumulate_kernel.cuh"
#include "stream_regions.h"

namespace fasthooks {
namespace cuda {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  FASTHOOKS_CHECK(status == cudaSuccess, "accumulate_stats: ", what, ": ",
                  cudaGetErrorString(status));
}

// Multiprocessors of a device, asked once per device.
int64_t multiprocessors(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices] = {};
  FASTHOOKS_CHECK(device >= 0 && device < kMaxDevices, "accumulate_stats: CUDA device index ",
                  device, " out of range");
  int count = counts[device].load(std::memory_order_relaxed);
  if (count == 0) {
    check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device),
               "reading the multiprocessor count");
    counts[device].store(count, std::memory_order_relaxed);
  }
  return count;
}

cudaStream_t current_stream(int device) {
  void* stream = nullptr;
  FASTHOOKS_CHECK(aoti_torch_get_current_cuda_stream(device, &stream) == AOTI_TORCH_SUCCESS,
                  "accumulate_stats: could not get the current CUDA stream of device ", device);
  return static_cast<cudaStream_t>(stream);
}

// Where a call comes from, for its workspace region (stream_regions.h).
CallOrigin origin_of(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status), "asking whether the stream is capturing");
  return {reinterpret_cast<uintptr_t>(stream), status != cudaStreamCaptureStatusNone};
}

// One launch of the kernel for T on `stream`.
template <typename T>
void launch(const Tensor& dense, const Buffers& buffers, bool full, cudaStream_t stream) {
  const T* x = static_cast<const T*>(dense.const_data_ptr());
  const int64_t n = dense.numel();
  const int device = dense.get_device_index();
  with_kernel<T>(full, buffers.bins > 0, [&](auto kernel_of, size_t shared) {
    constexpr auto kernel = decltype(kernel_of)::kernel;
    // As many blocks as can be resident at once (asked once per kernel): the grid-stride loops
    // cover the rest.
    static const int blocks_per_sm = [&] {
      int blocks = 0;
      check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, shared),
                 "reading the kernel's occupancy");
      return blocks;
    }();
    const LaunchPlan plan = plan_launch(x, n, multiprocessors(device) * blocks_per_sm);
    kernel<<<static_cast<int>(plan.blocks), kThreads, shared, stream>>>(x, n, plan.head, buffers);
    check_cuda(cudaGetLastError(), "kernel launch");
  });
}

void accumulate_stats_cuda(const Tensor& x, const Tensor& state, const Tensor& stats,
                           const Tensor& extra, const Tensor& hist, const Tensor& workspace,
                           const Tensor& cursor, int64_t slot, double near_zero, double hist_min,
                           double hist_max) {
  const bool full = check_accumulate_args(x, state, stats, extra, hist, workspace, cursor, slot,
                                          hist_min, hist_max);
  FASTHOOKS_CHECK(dtype_of(workspace) == ScalarType::Double && workspace.is_contiguous() &&
                      workspace.numel() == kWorkspaceDoubles,
                  "accumulate_stats: workspace must be a zeroed contiguous float64 tensor of ",
                  kWorkspaceDoubles,
                  " elements on CUDA (fasthooks.layout.CUDA_WORKSPACE_DOUBLES), "
                  "got ",
                  workspace.scalar_type(), " of shape ", shape_of(workspace));
  const int64_t bins = hist.numel() > 0 ? hist.size(2) : 0;
  FASTHOOKS_CHECK(bins <= kMaxBins, "accumulate_stats: at most ", kMaxBins, " bins on CUDA, got ",
                  bins);
  if (x.numel() == 0) return;
  const int device = x.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const cudaStream_t stream = current_stream(device);
  static StreamRegions regions(kRegions);
  double* space = static_cast<double*>(workspace.mutable_data_ptr());
  const Buffers buffers = buffers_for(
      static_cast<double*>(state.mutable_data_ptr()), static_cast<float*>(stats.mutable_data_ptr()),
      full ? static_cast<float*>(extra.mutable_data_ptr()) : nullptr,
      bins > 0 ? static_cast<int64_t*>(hist.mutable_data_ptr()) : nullptr,
      static_cast<const int64_t*>(cursor.const_data_ptr()), space,
      regions.region_of(space, origin_of(stream)), slot, state.size(1), state.size(2), bins,
      near_zero, hist_min, hist_max);
  const Tensor dense = dense_values(x);
  switch (dtype_of(dense)) {
    case ScalarType::Float:
      return launch<float>(dense, buffers, full, stream);
    case ScalarType::Double:
      return launch<double>(dense, buffers, full, stream);
    case ScalarType::Half:
      return launch<torch::headeronly::Half>(dense, buffers, full, stream);
    case ScalarType::BFloat16:
      return launch<torch::headeronly::BFloat16>(dense, buffers, full, stream);
    default:
      fail("accumulate_stats: unsupported dtype ", dense.scalar_type());
  }
}

}  // namespace
}  // namespace cuda
}  // namespace fasthooks

STABLE_TORCH_LIBRARY_IMPL(fasthooks, CUDA, m) {
  m.impl("accumulate_stats", TORCH_BOX(&fasthooks::cuda::accumulate_stats_cuda));
}
