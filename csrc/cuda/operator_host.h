// The host side of fasthooks::accumulate_stats and accumulate_stats_list on CUDA: checks, the
// dense-or-copy choice, grouping a list by dtype, the workspace region of a call and the launch
// plans, over a Device that supplies what needs a GPU (the current stream, where a call comes
// from, the resident blocks of a kernel, a launch and a device guard). accumulate_cuda.cpp gives
// it the CUDA driver and the kernels NVRTC compiled; the CUDA-on-CPU harness (tests/cuda_on_cpu/)
// an emulation, so the harness runs this same plan.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <vector>

#include "../checks.h"
#include "../dtype_dispatch.h"
#include "launch_plan.h"
#include "stream_regions.h"

namespace fasthooks {
namespace cuda {

template <typename Device>
struct OperatorHost {
  using Stream = typename Device::Stream;

  // One launch of the kernel for T on `stream`, over x (minus base, when given).
  template <typename T>
  static void launch(const Tensor& x, const Tensor* base, const Buffers& buffers,
                     const TopBuffers& top, const ChannelBuffers& channels, bool full,
                     Stream stream, int device) {
    const T* p = static_cast<const T*>(x.const_data_ptr());
    const T* b = base != nullptr ? static_cast<const T*>(base->const_data_ptr()) : nullptr;
    const int64_t n = x.numel();
    const KernelVariant kernel =
        variant_of(dtype_position(dtype_of(x)), false, full, buffers.bins, b != nullptr,
                   buffers.binades != nullptr, top.rows != nullptr, channels.row != nullptr);
    const LaunchPlan plan = plan_launch(p, b, n, Device::resident_blocks(kernel, device));
    Device::launch(kernel, plan.blocks, stream, device, p, b, n, plan.head, buffers, top, channels);
  }

  // Tensors of one dtype, read in place or as copies, and their slots.
  struct Group {
    std::vector<Tensor> x;
    std::vector<Tensor> base;
    std::vector<int64_t> slot;
  };

  // Every tensor of a group with the list kernel: one launch per kListTensors tensors.
  template <typename T>
  static void launch_list(const Group& group, const Buffers& buffers, bool full, Stream stream,
                          int device) {
    std::vector<const T*> x, base;
    std::vector<int64_t> n;
    for (size_t i = 0; i < group.x.size(); ++i) {
      x.push_back(static_cast<const T*>(group.x[i].const_data_ptr()));
      if (!group.base.empty()) {
        base.push_back(static_cast<const T*>(group.base[i].const_data_ptr()));
      }
      n.push_back(group.x[i].numel());
    }
    const bool diff = !group.base.empty();
    const KernelVariant kernel = variant_of(dtype_position(dtype_of(group.x[0])), true, full,
                                            buffers.bins, diff, false, false, false);
    const int64_t resident = Device::resident_blocks(kernel, device);
    for_each_table(x.data(), diff ? base.data() : nullptr, n.data(), group.slot.data(),
                   static_cast<int64_t>(x.size()), resident, [&](const TensorTable& table) {
                     Device::launch(kernel, table.first_block[table.count], stream, device, table,
                                    buffers);
                   });
  }

  // The stream, workspace region and bins of a call, after the checks beyond
  // check_accumulate_args.
  struct Call {
    Stream stream;
    double* workspace;
    int64_t region;
    int64_t bins;
  };

  // The k the workspace has room for (kernel_layout.h, workspace_doubles), or -1.
  static int64_t top_room(const Tensor& workspace) {
    for (int64_t k = 0; k <= kMaxTopK; ++k) {
      if (workspace.numel() == workspace_doubles(k)) return k;
    }
    return -1;
  }

  // A call keeping top_k pairs (0: none) needs a workspace with room for them; one with room for
  // more serves any call of its run.
  static Call prepare(const Tensor& workspace, const Tensor& hist, int device, int64_t top_k) {
    const int64_t room = top_room(workspace);
    FASTHOOKS_CHECK(
        dtype_of(workspace) == ScalarType::Double && workspace.is_contiguous() && room >= top_k,
        "accumulate_stats: workspace must be a zeroed contiguous float64 tensor of ",
        workspace_doubles(top_k),
        " elements on CUDA (fasthooks.layout.cuda_workspace_doubles(top_k=", top_k, ")), got ",
        workspace.scalar_type(), " of shape ", shape_of(workspace));
    const int64_t bins = hist.numel() > 0 ? hist.size(2) : 0;
    FASTHOOKS_CHECK(bins <= kMaxBins, "accumulate_stats: at most ", kMaxBins, " bins on CUDA, got ",
                    bins);
    static StreamRegions regions(kRegions);
    const Stream stream = Device::current_stream(device);
    double* space = static_cast<double*>(workspace.mutable_data_ptr());
    return {stream, space, regions.region_of(space, Device::origin_of(stream)), bins};
  }

  static Buffers buffers_of(const Tensor& state, const Tensor& stats, const Tensor& extra,
                            const Tensor& hist, const Tensor& cursor, int64_t slot, bool full,
                            const Call& call, double near_zero, double hist_min, double hist_max) {
    return buffers_for(static_cast<double*>(state.mutable_data_ptr()),
                       static_cast<float*>(stats.mutable_data_ptr()),
                       full ? static_cast<float*>(extra.mutable_data_ptr()) : nullptr,
                       call.bins > 0 ? static_cast<int64_t*>(hist.mutable_data_ptr()) : nullptr,
                       static_cast<const int64_t*>(cursor.const_data_ptr()), call.workspace,
                       call.region, slot, state.size(1), state.size(2), call.bins, near_zero,
                       hist_min, hist_max);
  }

  static void accumulate_stats(const Tensor& x, const Tensor& state, const Tensor& stats,
                               const Tensor& extra, const Tensor& hist, const Tensor& binades,
                               const Tensor& top, const Tensor& channels, const Tensor& workspace,
                               const Tensor& order, const Tensor& clock, const Tensor& cursor,
                               int64_t slot, double near_zero, double hist_min, double hist_max,
                               int64_t channel_dim, int64_t channel_offset,
                               int64_t channel_region) {
    const bool full = check_accumulate_args(x, state, stats, extra, hist, &binades, workspace,
                                            cursor, slot, hist_min, hist_max);
    check_top(top, x, state, channel_dim, channel_offset);
    check_channels(channels, x, state, channel_dim, channel_offset, channel_region);
    const int64_t top_k = top.numel() > 0 ? top.size(2) : 0;
    const bool ordered = check_call_order(order, clock, state);
    const int device = x.get_device_index();
    const typename Device::Guard guard(device);
    const Call call = prepare(workspace, hist, device, top_k);
    if (x.numel() == 0) return;
    Buffers buffers = buffers_of(state, stats, extra, hist, cursor, slot, full, call, near_zero,
                                 hist_min, hist_max);
    if (binades.numel() > 0) buffers.binades = static_cast<int32_t*>(binades.mutable_data_ptr());
    if (ordered) {
      buffers.order = static_cast<int64_t*>(order.mutable_data_ptr());
      buffers.clock = static_cast<unsigned long long*>(clock.mutable_data_ptr());
    }
    const Tensor dense = dense_values(x);
    TopBuffers top_buffers{};
    if (top_k > 0) {
      top_buffers.rows = static_cast<double*>(top.mutable_data_ptr());
      top_buffers.lists =
          call.workspace + kWorkspaceDoubles + call.region * top_region_doubles(top_k);
      top_buffers.k = top_k;
      top_buffers.channels = channel_map(dense, channel_dim, channel_offset);
    }
    // Not per column or slot: the run's running sums, whatever the cursor.
    ChannelBuffers channel_buffers{};
    if (channels.numel() > 0) {
      channel_buffers.row = static_cast<double*>(channels.mutable_data_ptr());
      channel_buffers.room = channels.size(1);
      channel_buffers.channels = channel_map(dense, channel_dim, channel_region + channel_offset);
      channel_buffers.per_channel =
          static_cast<double>(dense.numel() / channel_buffers.channels.size);
    }
    dispatch_dtype(dtype_of(dense), [&](auto tag) {
      launch<typename decltype(tag)::type>(dense, nullptr, buffers, top_buffers, channel_buffers,
                                           full, call.stream, device);
    });
  }

  // Every tensor of a list, one launch of the list kernel per dtype and kListTensors tensors, in
  // slot order on one stream (so that they share one workspace region).
  static void accumulate_stats_list(std::vector<Tensor> xs, std::vector<Tensor> bases,
                                    const Tensor& state, const Tensor& stats, const Tensor& extra,
                                    const Tensor& hist, const Tensor& workspace,
                                    const Tensor& cursor, double near_zero, double hist_min,
                                    double hist_max) {
    const CheckedList list =
        check_list(xs, bases, state, stats, extra, hist, workspace, cursor, hist_min, hist_max);
    if (list.xs.empty()) return;
    const bool full = list.full;
    Group groups[kDtypes];
    for (size_t i = 0; i < list.xs.size(); ++i) {
      if (list.xs[i].numel() == 0) continue;
      Group& group = groups[dtype_position(dtype_of(list.xs[i]))];
      group.x.push_back(list.xs[i]);
      if (!list.bases.empty()) group.base.push_back(list.bases[i]);
      group.slot.push_back(static_cast<int64_t>(i));
    }
    const int device = state.get_device_index();
    const typename Device::Guard guard(device);
    const Call call = prepare(workspace, hist, device, 0);
    const Buffers buffers =
        buffers_of(state, stats, extra, hist, cursor, 0, full, call, near_zero, hist_min, hist_max);
    for (const Group& group : groups) {
      if (group.x.empty()) continue;
      dispatch_dtype(dtype_of(group.x[0]), [&](auto tag) {
        launch_list<typename decltype(tag)::type>(group, buffers, full, call.stream, device);
      });
    }
  }
};

}  // namespace cuda
}  // namespace fasthooks
