// fasthooks::accumulate_stats on CUDA: the host side (operator_host.h) over the CUDA runtime, one
// launch of the kernel (accumulate_kernel.cuh) per call on the current stream, with no host sync,
// no allocation and no memset.
#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <atomic>
#include <cstdint>

#include "operator_host.h"

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

// What operator_host.h needs of a GPU, from the CUDA runtime.
struct CudaRuntime {
  using Stream = cudaStream_t;
  using Guard = torch::stable::accelerator::DeviceGuard;

  static Stream current_stream(int device) {
    void* stream = nullptr;
    FASTHOOKS_CHECK(aoti_torch_get_current_cuda_stream(device, &stream) == AOTI_TORCH_SUCCESS,
                    "accumulate_stats: could not get the current CUDA stream of device ", device);
    return static_cast<cudaStream_t>(stream);
  }

  // Where a call comes from, for its workspace region (stream_regions.h).
  static CallOrigin origin_of(Stream stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &status), "asking whether the stream is capturing");
    return {reinterpret_cast<uintptr_t>(stream), status != cudaStreamCaptureStatusNone};
  }

  // Blocks of `Kernel` resident at once on the device (occupancy asked once per kernel): the
  // grid-stride loops cover the rest.
  template <auto Kernel>
  static int64_t resident_blocks(size_t shared, int device) {
    static const int blocks_per_sm = [&] {
      int blocks = 0;
      check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, kThreads, shared),
                 "reading the kernel's occupancy");
      return blocks;
    }();
    return multiprocessors(device) * blocks_per_sm;
  }

  template <typename Kernel, typename... Args>
  static void launch(Kernel kernel, int64_t blocks, size_t shared, Stream stream, Args... args) {
    kernel<<<static_cast<int>(blocks), kThreads, shared, stream>>>(args...);
    check_cuda(cudaGetLastError(), "kernel launch");
  }
};

using Host = OperatorHost<CudaRuntime>;

}  // namespace
}  // namespace cuda
}  // namespace fasthooks

STABLE_TORCH_LIBRARY_IMPL(fasthooks, CUDA, m) {
  m.impl("accumulate_stats", TORCH_BOX(&fasthooks::cuda::Host::accumulate_stats));
  m.impl("accumulate_stats_list", TORCH_BOX(&fasthooks::cuda::Host::accumulate_stats_list));
}
