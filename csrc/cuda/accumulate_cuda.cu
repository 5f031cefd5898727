// Host side of fasthooks::accumulate_stats on CUDA: checks, the workspace region of the call,
// and one launch of the kernel (accumulate_kernel.cuh) on the current stream, with no host
// sync, no allocation and no memset.
#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <vector>

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

// Blocks of `Kernel` resident at once on the device (occupancy asked once per kernel): the
// grid-stride loops cover the rest.
template <auto Kernel>
int64_t resident_blocks(size_t shared, int device) {
  static const int blocks_per_sm = [&] {
    int blocks = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, kThreads, shared),
               "reading the kernel's occupancy");
    return blocks;
  }();
  return multiprocessors(device) * blocks_per_sm;
}

// One launch of the kernel for T on `stream`, over x (minus base, when given).
template <typename T>
void launch(const Tensor& x, const Tensor* base, const Buffers& buffers, bool full,
            cudaStream_t stream) {
  const T* p = static_cast<const T*>(x.const_data_ptr());
  const T* b = base != nullptr ? static_cast<const T*>(base->const_data_ptr()) : nullptr;
  const int64_t n = x.numel();
  const int device = x.get_device_index();
  with_kernel<T>(full, buffers.bins > 0, b != nullptr, [&](auto kernel_of, size_t shared) {
    constexpr auto kernel = decltype(kernel_of)::kernel;
    const LaunchPlan plan = plan_launch(p, b, n, resident_blocks<kernel>(shared, device));
    kernel<<<static_cast<int>(plan.blocks), kThreads, shared, stream>>>(p, b, n, plan.head,
                                                                        buffers);
    check_cuda(cudaGetLastError(), "kernel launch");
  });
}

// Tensors of one dtype, read in place or as copies, and their slots.
struct Group {
  std::vector<Tensor> x;
  std::vector<Tensor> base;
  std::vector<int64_t> slot;
};

// Every tensor of a group with the list kernel: one launch per kListTensors tensors.
template <typename T>
void launch_list(const Group& group, const Buffers& buffers, bool full, cudaStream_t stream,
                 int device) {
  std::vector<const T*> x, base;
  std::vector<int64_t> n;
  for (size_t i = 0; i < group.x.size(); ++i) {
    x.push_back(static_cast<const T*>(group.x[i].const_data_ptr()));
    if (!group.base.empty()) base.push_back(static_cast<const T*>(group.base[i].const_data_ptr()));
    n.push_back(group.x[i].numel());
  }
  const bool diff = !group.base.empty();
  with_kernel<T, true>(full, buffers.bins > 0, diff, [&](auto kernel_of, size_t shared) {
    constexpr auto kernel = decltype(kernel_of)::kernel;
    for_each_table(x.data(), diff ? base.data() : nullptr, n.data(), group.slot.data(),
                   static_cast<int64_t>(x.size()), resident_blocks<kernel>(shared, device),
                   [&](const TensorTable& table) {
                     kernel<<<table.first_block[table.count], kThreads, shared, stream>>>(table,
                                                                                          buffers);
                     check_cuda(cudaGetLastError(), "kernel launch");
                   });
  });
}

// The workspace of a call and everything it checks beyond check_accumulate_args.
struct Call {
  cudaStream_t stream;
  double* workspace;
  int64_t region;
  int64_t bins;
};

Call prepare(const Tensor& workspace, const Tensor& hist, int device) {
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
  static StreamRegions regions(kRegions);
  const cudaStream_t stream = current_stream(device);
  double* space = static_cast<double*>(workspace.mutable_data_ptr());
  return {stream, space, regions.region_of(space, origin_of(stream)), bins};
}

// x's statistics into slot (slot, cursor), noted in the call order when `order` is given.
void accumulate_one(const Tensor& x, const Tensor& state, const Tensor& stats, const Tensor& extra,
                    const Tensor& hist, const Tensor* order, const Tensor& clock,
                    const Tensor& cursor, int64_t slot, bool full, const Call& call,
                    double near_zero, double hist_min, double hist_max) {
  if (x.numel() == 0) return;
  Buffers buffers = buffers_for(
      static_cast<double*>(state.mutable_data_ptr()), static_cast<float*>(stats.mutable_data_ptr()),
      full ? static_cast<float*>(extra.mutable_data_ptr()) : nullptr,
      call.bins > 0 ? static_cast<int64_t*>(hist.mutable_data_ptr()) : nullptr,
      static_cast<const int64_t*>(cursor.const_data_ptr()), call.workspace, call.region, slot,
      state.size(1), state.size(2), call.bins, near_zero, hist_min, hist_max);
  if (order != nullptr) {
    buffers.order = static_cast<int64_t*>(order->mutable_data_ptr());
    buffers.clock = static_cast<unsigned long long*>(clock.mutable_data_ptr());
  }
  const Tensor dense = dense_values(x);
  switch (dtype_of(dense)) {
    case ScalarType::Float:
      return launch<float>(dense, nullptr, buffers, full, call.stream);
    case ScalarType::Double:
      return launch<double>(dense, nullptr, buffers, full, call.stream);
    case ScalarType::Half:
      return launch<torch::headeronly::Half>(dense, nullptr, buffers, full, call.stream);
    case ScalarType::BFloat16:
      return launch<torch::headeronly::BFloat16>(dense, nullptr, buffers, full, call.stream);
    default:
      fail("accumulate_stats: unsupported dtype ", dense.scalar_type());
  }
}

void accumulate_stats_cuda(const Tensor& x, const Tensor& state, const Tensor& stats,
                           const Tensor& extra, const Tensor& hist, const Tensor& workspace,
                           const Tensor& order, const Tensor& clock, const Tensor& cursor,
                           int64_t slot, double near_zero, double hist_min, double hist_max) {
  const bool full = check_accumulate_args(x, state, stats, extra, hist, workspace, cursor, slot,
                                          hist_min, hist_max);
  const bool ordered = check_call_order(order, clock, state);
  const int device = x.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const Call call = prepare(workspace, hist, device);
  accumulate_one(x, state, stats, extra, hist, ordered ? &order : nullptr, clock, cursor, slot,
                 full, call, near_zero, hist_min, hist_max);
}

int group_of(ScalarType dtype) {
  switch (dtype) {
    case ScalarType::Float:
      return 0;
    case ScalarType::Double:
      return 1;
    case ScalarType::Half:
      return 2;
    default:
      return 3;  // bfloat16: check_accumulate_args refused any other
  }
}

// Every tensor of a list, one launch of the list kernel per dtype and kListTensors tensors, in
// slot order on one stream (so that they share one workspace region).
void accumulate_stats_list_cuda(std::vector<Tensor> xs, std::vector<Tensor> bases,
                                const Tensor& state, const Tensor& stats, const Tensor& extra,
                                const Tensor& hist, const Tensor& workspace, const Tensor& cursor,
                                double near_zero, double hist_min, double hist_max) {
  check_list_lengths(xs, bases, state);
  if (xs.empty()) return;
  bool full = false;
  Group groups[4];                          // by dtype: float32, float64, float16, bfloat16
  for (size_t i = 0; i < xs.size(); ++i) {  // every tensor checked before any is counted
    full = check_accumulate_args(xs[i], state, stats, extra, hist, workspace, cursor,
                                 static_cast<int64_t>(i), hist_min, hist_max);
    if (xs[i].numel() == 0) continue;
    Group& group = groups[group_of(dtype_of(xs[i]))];
    if (bases.empty()) {
      group.x.push_back(dense_values(xs[i]));
    } else {
      DensePair pair = dense_pair(xs[i], bases[i], i);
      group.x.push_back(pair.x);
      group.base.push_back(pair.base);
    }
    group.slot.push_back(static_cast<int64_t>(i));
  }
  const int device = state.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const Call call = prepare(workspace, hist, device);
  const Buffers buffers = buffers_for(
      static_cast<double*>(state.mutable_data_ptr()), static_cast<float*>(stats.mutable_data_ptr()),
      full ? static_cast<float*>(extra.mutable_data_ptr()) : nullptr,
      call.bins > 0 ? static_cast<int64_t*>(hist.mutable_data_ptr()) : nullptr,
      static_cast<const int64_t*>(cursor.const_data_ptr()), call.workspace, call.region, 0,
      state.size(1), state.size(2), call.bins, near_zero, hist_min, hist_max);
  if (!groups[0].x.empty()) launch_list<float>(groups[0], buffers, full, call.stream, device);
  if (!groups[1].x.empty()) launch_list<double>(groups[1], buffers, full, call.stream, device);
  if (!groups[2].x.empty()) {
    launch_list<torch::headeronly::Half>(groups[2], buffers, full, call.stream, device);
  }
  if (!groups[3].x.empty()) {
    launch_list<torch::headeronly::BFloat16>(groups[3], buffers, full, call.stream, device);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace fasthooks

STABLE_TORCH_LIBRARY_IMPL(fasthooks, CUDA, m) {
  m.impl("accumulate_stats", TORCH_BOX(&fasthooks::cuda::accumulate_stats_cuda));
  m.impl("accumulate_stats_list", TORCH_BOX(&fasthooks::cuda::accumulate_stats_list_cuda));
}
