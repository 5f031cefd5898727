// The CUDA operator of fasthooks built for the host: its host side (csrc/cuda/operator_host.h,
// the file accumulate_cuda.cpp uses) over an emulated device, and its kernels
// (csrc/cuda/accumulate_kernel.cuh, the source NVRTC compiles) against device_api.h. The operators
// are registered as fasthooks_cuda_on_cpu::accumulate_stats(_list), with the schemas of
// fasthooks._C, on CPU tensors; a C interface serves tests/cuda_on_cpu/__init__.py the rest. The
// stream a call comes from is a number set per thread, and the resident-block count is that of an
// H100 or H200 unless set.
// The emulation first: the kernels' header uses what it defines.
#include "device_api.h"

#include <torch/csrc/stable/library.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <tuple>
#include <type_traits>

#include "cuda/accumulate_kernel.cuh"
#include "cuda/operator_host.h"
#include "schemas.h"

namespace {

using namespace fasthooks::cuda;

// An H100 or H200: 132 multiprocessors, each holding kMinBlocksPerSM blocks of the kernels.
constexpr int64_t kMultiprocessors = 132;
thread_local unsigned long long current_stream_number = 0;
std::atomic<int64_t> resident_override{0};

// What operator_host.h needs of a GPU, emulated: streams are numbers, launches run on fibers.
struct Emulated {
  using Stream = unsigned long long;
  struct Guard {
    explicit Guard(int) {}
  };

  static Stream current_stream(int) { return current_stream_number; }
  static CallOrigin origin_of(Stream stream) { return {static_cast<uintptr_t>(stream), false}; }

  static int64_t resident_blocks(const KernelVariant&, int) {
    const int64_t resident = resident_override.load();
    return resident > 0 ? resident : kMultiprocessors * kMinBlocksPerSM;
  }

  template <typename... Args>
  static void launch(const KernelVariant& v, int64_t blocks, Stream, int, Args... args) {
    with_kernel<Args...>(v, [&](auto kernel) {
      cuda_on_cpu::launch(kernel, static_cast<unsigned>(blocks), kThreads, shared_bytes(v),
                          args...);
    });
  }

 private:
  // f(the instantiation `v` names): the list kernel when launched with a table (for v's dtype),
  // else the one-tensor kernel for the values' type, as kernel_names.h names them for NVRTC.
  template <typename... Args, typename F>
  static void with_kernel(const KernelVariant& v, F&& f) {
    if constexpr (sizeof...(Args) == 2) {
      fasthooks::dispatch_dtype(fasthooks::dtype_at(v.dtype), [&](auto tag) {
        using T = typename decltype(tag)::type;
        with_flags(v, [&](auto full, auto hist, auto diff) {
          f(accumulate_list_kernel<T, typename Accumulator<T>::type, decltype(full)::value,
                                   decltype(hist)::value, decltype(diff)::value>);
        });
      });
    } else {
      using T =
          std::remove_cv_t<std::remove_pointer_t<std::tuple_element_t<0, std::tuple<Args...>>>>;
      with_flags(v, [&](auto full, auto hist, auto diff) {
        using Acc = typename Accumulator<T>::type;
        constexpr bool kFull = decltype(full)::value, kDiff = decltype(diff)::value;
        constexpr int kHist = decltype(hist)::value;
        // Binades, top_k and channel statistics only of values (variant_of): a kernel of a
        // difference has none.
        if constexpr (kDiff) {
          f(accumulate_stats_kernel<T, Acc, kFull, kHist, kDiff, false, false, false>);
        } else {
          with_extras(v, [&](auto binades, auto top, auto channels) {
            f(accumulate_stats_kernel<T, Acc, kFull, kHist, kDiff, decltype(binades)::value,
                                      decltype(top)::value, decltype(channels)::value>);
          });
        }
      });
    }
  }

  template <typename F>
  static void with_flags(const KernelVariant& v, F&& f) {
    with_histogram(v, [&](auto hist) {
      using Yes = std::true_type;
      using No = std::false_type;
      if (v.diff) return f(Yes{}, hist, Yes{});
      if (v.full) return f(Yes{}, hist, No{});
      f(No{}, hist, No{});
    });
  }

  template <typename F>
  static void with_extras(const KernelVariant& v, F&& f) {
    with_flag(v.binades, [&](auto binades) {
      with_flag(v.top, [&](auto top) {
        with_flag(v.channels, [&](auto channels) { f(binades, top, channels); });
      });
    });
  }

  template <typename F>
  static void with_flag(bool on, F&& f) {
    if (on) return f(std::true_type{});
    f(std::false_type{});
  }

  template <typename F>
  static void with_histogram(const KernelVariant& v, F&& f) {
    if (v.hist == kBinsPerThread) return f(std::integral_constant<int, kBinsPerThread>{});
    if (v.hist == kBinsPerBlock) return f(std::integral_constant<int, kBinsPerBlock>{});
    f(std::integral_constant<int, kNoHistogram>{});
  }
};

using Host = OperatorHost<Emulated>;

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
__global__ void nothing() {}  // launched with more shared memory than CUDA grants by default

StreamRegions& regions() {
  static StreamRegions r(kRegions);
  return r;
}

}  // namespace

// The C interface is what the library exports; everything else is hidden, as in fasthooks._C.
#pragma GCC visibility push(default)
extern "C" {

int64_t harness_workspace_doubles() { return kWorkspaceDoubles; }
int64_t harness_max_blocks() { return kMaxBlocks; }
int64_t harness_regions() { return kRegions; }
int64_t harness_min_blocks_per_sm() { return kMinBlocksPerSM; }
int64_t harness_thread_bins() { return kThreadBins; }

void harness_options(int workers, int split_lanes, unsigned long long seed) {
  cuda_on_cpu::options() = {workers, split_lanes != 0, seed};
}

// launches, blocks, barriers, warp_ops, lane_splits, errors
void harness_counts(int64_t* out) {
  const cuda_on_cpu::Counts& c = cuda_on_cpu::counts();
  const int64_t values[] = {c.launches, c.blocks, c.barriers, c.warp_ops, c.lane_splits, c.errors};
  for (int i = 0; i < 6; ++i) out[i] = values[i];
}

// Runs rule breaker `which` (0, 1, 2 or 3) on one block of 32 threads.
void harness_break_a_rule(int which) {
  if (which == 0) cuda_on_cpu::launch(shuffle_outside_its_mask, 1, 32, 0);
  if (which == 1) cuda_on_cpu::launch(shuffle_beside_a_barrier, 1, 32, 0);
  if (which == 2) cuda_on_cpu::launch(lane_outside_the_mask_calls, 1, 32, 0);
  if (which == 3) cuda_on_cpu::launch(nothing, 1, 32, 48 * 1024 + 1);
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

// The stream number the calls of this thread come from, and the blocks a launch gets (0: those
// of an H100 or H200).
void harness_set_stream(unsigned long long stream) { current_stream_number = stream; }
void harness_set_resident(int64_t resident) { resident_override = resident; }
int64_t harness_resident_blocks() { return kMultiprocessors * kMinBlocksPerSM; }

}  // extern "C"
#pragma GCC visibility pop

STABLE_TORCH_LIBRARY(fasthooks_cuda_on_cpu, m) {
  m.def(fasthooks::kAccumulateStatsSchema);
  m.def(fasthooks::kAccumulateStatsListSchema);
}

STABLE_TORCH_LIBRARY_IMPL(fasthooks_cuda_on_cpu, CPU, m) {
  m.impl("accumulate_stats", TORCH_BOX(&Host::accumulate_stats));
  m.impl("accumulate_stats_list", TORCH_BOX(&Host::accumulate_stats_list));
}
