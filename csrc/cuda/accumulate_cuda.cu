// CUDA kernel of fasthooks::accumulate_stats: one launch on the current stream, no host sync, no
// allocation, no memset.
//
// Every thread keeps central moments, extremes and counts of a grid-stride range, summing powers
// of (x - its running mean) segment by segment; blocks merge them into partials in the
// workspace, and the last block to finish merges those in block order (so the result is
// deterministic), merges them into the state slot at the device-side cursor, writes the
// finalised statistics and resets the finished-blocks counter for the next call. Histograms are
// counted per block in shared memory, with one atomic per group of lanes that share a bin, and
// added to the slot's row at the end of the block.
#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/headeronly/macros/Macros.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <atomic>
#include <cstdint>

#include "../checks.h"
#include "../histogram.h"
#include "../stats.h"

namespace fasthooks {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVecBytes = 16;
// Per-block partial results: one Stats, as the state planes.
constexpr int kPartials = kFullPlanes;
// Shared memory is sized for the most bins fasthooks/layout.py allows.
constexpr int64_t kMaxBins = 2048;
// Loads of a thread summed around one shift before they merge into its moments in double.
constexpr int kSegmentLoads = 16;

template <typename T, int Width>
struct alignas(Width * sizeof(T)) Load {
  T val[Width];
};

// Half and bfloat16 values are summed in float, as torch's own reductions do.
template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};

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

struct Buffers {
  double* state;
  float* stats;
  float* extra;
  int64_t* hist;
  const int64_t* cursor;
  double* partials;
  unsigned int* finished;
  int64_t slot;
  int64_t modules;
  int64_t capacity;
  int64_t bins;
  double near_zero;
  double hist_min;
  double hist_max;
};

template <bool Full>
__device__ Stats shuffle_down(const Stats& s, int offset) {
  constexpr int fields = Full ? kFullPlanes : kBasicPlanes;
  double v[kFullPlanes];
  store_state<Full>(v, 1, s);
  for (int f = 0; f < fields; ++f) v[f] = __shfl_down_sync(0xffffffffu, v[f], offset);
  return load_state<Full>(v, 1);
}

// Merges s over the block in a fixed order; the result is valid in thread 0.
template <bool Full>
__device__ void block_reduce(Stats& s) {
  __shared__ double shared[kWarps][kFullPlanes];
  for (int offset = 16; offset > 0; offset /= 2) {
    const Stats other = shuffle_down<Full>(s, offset);
    s = merge<Full>(s, other);
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __syncthreads();  // the shared array may still be read by an earlier call
  if (lane == 0) store_state<Full>(shared[warp], 1, s);
  __syncthreads();
  if (warp == 0) {
    s = lane < kWarps ? load_state<Full>(shared[lane], 1) : Stats{};
    for (int offset = kWarps / 2; offset > 0; offset /= 2) {
      const Stats other = shuffle_down<Full>(s, offset);
      if (lane + offset < kWarps) s = merge<Full>(s, other);
    }
  }
}

// Extremes and counts of a thread's values; NaN is flagged rather than compared.
template <typename Acc>
struct Extremes {
  Acc min = static_cast<Acc>(INFINITY);
  Acc max = static_cast<Acc>(-INFINITY);
  bool nan = false;
  int64_t near_zero = 0;
  int64_t nonfinite = 0;
};

template <typename Acc>
__device__ Acc finite_or_zero(Acc v) {
  return v - v == Acc(0) ? v : Acc(0);  // an infinite or NaN shift would poison every value
}

// Counts v's bin in the block's shared histogram: lanes that share a bin add once, together.
template <typename Acc>
__device__ void count_bin(Acc v, const BinTable<Acc>& table, unsigned int* hist) {
  const int64_t bin = bin_of(v, table);
  const unsigned int peers = __match_any_sync(__activemask(), static_cast<int>(bin));
  if ((threadIdx.x % 32) == __ffs(peers) - 1 && bin < table.bins) {
    atomicAdd(hist + bin, static_cast<unsigned int>(__popc(peers)));
  }
}

// The mean of one load, the first shift of a thread: within about a standard deviation of the
// data unless the data are adversarial, which the far-shift check below catches.
template <typename Acc, typename T, int Width>
__device__ Acc load_mean(const Load<T, Width>& v) {
  Acc sum = 0;
  for (int k = 0; k < Width; ++k) sum += static_cast<Acc>(v.val[k]);
  return finite_or_zero(sum / Width);
}

// Moments of one segment's values (loads begin, begin + step, ... before end) in double, around
// their own mean: for a segment whose float sums overflowed or whose shift proved far from it.
template <typename Acc, bool Full, typename T, int Width>
__device__ Stats segment_in_double(const Load<T, Width>* x, int64_t begin, int64_t end,
                                   int64_t step) {
  double sum = 0.0, count = 0.0;
  for (int64_t i = begin; i < end; i += step) {
    const Load<T, Width> v = x[i];
    for (int k = 0; k < Width; ++k) sum += static_cast<double>(static_cast<Acc>(v.val[k]));
    count += Width;
  }
  Stats s;
  s.count = count;
  s.mean = sum / count;  // kept as is: an infinite mean stays infinite
  for (int64_t i = begin; i < end; i += step) {
    const Load<T, Width> v = x[i];
    for (int k = 0; k < Width; ++k) {
      const double d = static_cast<double>(static_cast<Acc>(v.val[k])) - s.mean;
      s.m2 += d * d;
      if constexpr (Full) {
        s.m3 += d * d * d;
        s.m4 += d * d * d * d;
      }
    }
  }
  return s;
}

// A thread's share of `loads` loads of Width values: loads first, first + step, ... Each segment
// of kSegmentLoads is summed in working precision around the thread's running mean (at first,
// the mean of its first load) and merged into `moments` in double, so no choice of first values
// spoils the rest; extremes, counts and the histogram are taken on the way.
template <typename Acc, bool Full, bool Hist, typename T, int Width>
__device__ void thread_pass(const Load<T, Width>* x, int64_t loads, int64_t first, int64_t step,
                            Acc near_zero, const BinTable<Acc>& table, unsigned int* hist,
                            Stats& moments, Extremes<Acc>& e) {
  for (int64_t begin = first; begin < loads; begin += kSegmentLoads * step) {
    const Acc shift = moments.count > 0.0 ? finite_or_zero(static_cast<Acc>(moments.mean))
                                          : load_mean<Acc>(x[begin]);
    const int64_t rest = (loads - begin + step - 1) / step;
    const int64_t end = begin + (rest < kSegmentLoads ? rest : kSegmentLoads) * step;
    double s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0, count = 0.0;
    for (int64_t i = begin; i < end; i += step) {
      const Load<T, Width> v = x[i];
      Acc a1 = 0, a2 = 0, a3 = 0, a4 = 0;
#pragma unroll
      for (int k = 0; k < Width; ++k) {
        const Acc value = static_cast<Acc>(v.val[k]);
        const Acc d = value - shift;
        const Acc d2 = d * d;
        a1 += d;
        a2 += d2;
        if constexpr (Full) {
          a3 += d2 * d;
          a4 += d2 * d2;
          e.min = fmin(e.min, value);  // NaN is ignored here and flagged instead
          e.max = fmax(e.max, value);
          e.nan |= value != value;
          e.near_zero += value <= near_zero;
          e.nonfinite += !(value - value == Acc(0));
        }
        if constexpr (Hist) count_bin(value, table, hist);
      }
      s1 += a1;
      s2 += a2;
      s3 += a3;
      s4 += a4;
      count += Width;
    }
    Stats segment;
    moments_from_shifted_sums<Full>(segment, count, shift, s1, s2, s3, s4);
    // The rounding error of the float sums grows with (mean - shift)^2 / variance: beyond two
    // standard deviations it could exceed 1e-7 of m2 (or more of m4).
    const double d = s1 / count;
    const bool far = count * d * d > 4.0 * segment.m2 && isfinite(segment.mean);
    if (far || !isfinite(s1 + s2 + s3 + s4)) {
      segment = segment_in_double<Acc, Full>(x, begin, end, step);
    }
    moments = merge<Full>(moments, segment);
  }
}

template <typename T, typename Acc, bool Full, bool Hist>
__global__ void __launch_bounds__(kThreads)
    accumulate_stats_kernel(const T* __restrict__ x, int64_t n, bool vectorised, Buffers b) {
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  auto* lower = reinterpret_cast<Acc*>(dynamic_shared);
  auto* hist = reinterpret_cast<unsigned int*>(lower + kMaxBins + 1);
  const BinTable<Acc> table = bin_table(lower, b.bins, b.hist_min, b.hist_max);
  if constexpr (Hist) {
    for (int64_t k = threadIdx.x; k <= b.bins; k += blockDim.x) {
      lower[k] = lower_edge<Acc>(k, b.bins, b.hist_min, b.hist_max);
      if (k < b.bins) hist[k] = 0;
    }
    __syncthreads();
  }

  const Acc near_zero = static_cast<Acc>(b.near_zero);
  Stats moments;
  Extremes<Acc> e;
  constexpr int kVec = kVecBytes / sizeof(T);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vectorised ? n / kVec : 0;
  thread_pass<Acc, Full, Hist>(reinterpret_cast<const Load<T, kVec>*>(x), n_vec, tid, step,
                               near_zero, table, hist, moments, e);
  thread_pass<Acc, Full, Hist>(reinterpret_cast<const Load<T, 1>*>(x + n_vec * kVec),
                               n - n_vec * kVec, tid, step, near_zero, table, hist, moments, e);

  const int64_t column = *b.cursor;
  CUDA_KERNEL_ASSERT(column >= 0 && column < b.capacity);
  const int64_t cell = b.slot * b.capacity + column;
  if constexpr (Hist) {
    __syncthreads();
    int64_t* row = b.hist + cell * b.bins;
    for (int64_t k = threadIdx.x; k < b.bins; k += blockDim.x) {
      if (hist[k] != 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(row + k),
                  static_cast<unsigned long long>(hist[k]));
      }
    }
  }

  if constexpr (Full) {
    moments.min = e.nan ? NAN : static_cast<double>(e.min);
    moments.max = e.nan ? NAN : static_cast<double>(e.max);
    moments.near_zero = static_cast<double>(e.near_zero);
    moments.nonfinite = static_cast<double>(e.nonfinite);
  }
  block_reduce<Full>(moments);
  __shared__ bool last_block;
  if (threadIdx.x == 0) {
    store_state<Full>(b.partials + kPartials * blockIdx.x, 1, moments);
    __threadfence();  // the partials are visible before the ticket is taken
    last_block = atomicAdd(b.finished, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;

  Stats total;
  for (int blk = threadIdx.x; blk < gridDim.x; blk += blockDim.x) {
    double v[kPartials];
    for (int f = 0; f < (Full ? kFullPlanes : kBasicPlanes); ++f) {
      v[f] = __ldcg(b.partials + kPartials * blk + f);
    }
    total = merge<Full>(total, load_state<Full>(v, 1));
  }
  block_reduce<Full>(total);
  if (threadIdx.x == 0) {
    const int64_t plane = b.modules * b.capacity;
    const SlotPointers slot{b.state + cell, plane, b.stats + cell, plane,
                            Full ? b.extra + cell : nullptr};
    store_slot<Full>(slot, merge<Full>(load_slot<Full>(slot), total));
    *b.finished = 0;  // ready for the next call: no memset needed
  }
}

template <typename T, bool Full, bool Hist>
void launch(const Tensor& dense, const Buffers& buffers, int64_t max_blocks) {
  using Acc = typename Accumulator<T>::type;
  const auto kernel = accumulate_stats_kernel<T, Acc, Full, Hist>;
  const size_t shared_bytes =
      Hist ? (kMaxBins + 1) * sizeof(Acc) + kMaxBins * sizeof(unsigned int) : 0;
  // As many blocks as can be resident at once: the grid-stride loop covers the rest.
  static const int blocks_per_sm = [&] {
    int blocks = 0;
    check_cuda(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, shared_bytes),
        "reading the kernel's occupancy");
    return blocks;
  }();
  const int64_t n = dense.numel();
  const int64_t per_block = static_cast<int64_t>(kThreads) * (kVecBytes / sizeof(T));
  const int device = dense.get_device_index();
  const int64_t resident = multiprocessors(device) * blocks_per_sm;
  int64_t blocks = (n + per_block - 1) / per_block;
  blocks = blocks < resident ? blocks : resident;
  blocks = blocks < max_blocks ? blocks : max_blocks;

  const T* x = static_cast<const T*>(dense.const_data_ptr());
  const bool vectorised = reinterpret_cast<uintptr_t>(x) % kVecBytes == 0;
  kernel<<<static_cast<int>(blocks), kThreads, shared_bytes, current_stream(device)>>>(
      x, n, vectorised, buffers);
  check_cuda(cudaGetLastError(), "kernel launch");
}

template <typename T>
void dispatch(const Tensor& dense, const Buffers& buffers, bool full, int64_t max_blocks) {
  const bool hist = buffers.bins > 0;
  if (full && hist) return launch<T, true, true>(dense, buffers, max_blocks);
  if (full) return launch<T, true, false>(dense, buffers, max_blocks);
  if (hist) return launch<T, false, true>(dense, buffers, max_blocks);
  launch<T, false, false>(dense, buffers, max_blocks);
}

void accumulate_stats_cuda(const Tensor& x, const Tensor& state, const Tensor& stats,
                           const Tensor& extra, const Tensor& hist, const Tensor& workspace,
                           const Tensor& cursor, int64_t slot, double near_zero, double hist_min,
                           double hist_max) {
  const bool full = check_accumulate_args(x, state, stats, extra, hist, workspace, cursor, slot,
                                          hist_min, hist_max);
  const int64_t max_blocks = (workspace.numel() - 1) / kPartials;
  FASTHOOKS_CHECK(
      dtype_of(workspace) == ScalarType::Double && workspace.is_contiguous() && max_blocks >= 1,
      "accumulate_stats: workspace must be a zeroed contiguous float64 tensor of at least ",
      kPartials + 1, " elements on CUDA, got ", workspace.scalar_type(), " of shape ",
      shape_of(workspace));
  const int64_t bins = hist.numel() > 0 ? hist.size(2) : 0;
  FASTHOOKS_CHECK(bins <= kMaxBins, "accumulate_stats: at most ", kMaxBins, " bins on CUDA, got ",
                  bins);
  if (x.numel() == 0) return;
  const torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  double* partials = static_cast<double*>(workspace.mutable_data_ptr());
  const Buffers buffers{static_cast<double*>(state.mutable_data_ptr()),
                        static_cast<float*>(stats.mutable_data_ptr()),
                        full ? static_cast<float*>(extra.mutable_data_ptr()) : nullptr,
                        bins > 0 ? static_cast<int64_t*>(hist.mutable_data_ptr()) : nullptr,
                        static_cast<const int64_t*>(cursor.const_data_ptr()),
                        partials,
                        reinterpret_cast<unsigned int*>(partials + kPartials * max_blocks),
                        slot,
                        state.size(1),
                        state.size(2),
                        bins,
                        near_zero,
                        hist_min,
                        hist_max};
  const Tensor dense = dense_values(x);
  switch (dtype_of(dense)) {
    case ScalarType::Float:
      return dispatch<float>(dense, buffers, full, max_blocks);
    case ScalarType::Double:
      return dispatch<double>(dense, buffers, full, max_blocks);
    case ScalarType::Half:
      return dispatch<torch::headeronly::Half>(dense, buffers, full, max_blocks);
    case ScalarType::BFloat16:
      return dispatch<torch::headeronly::BFloat16>(dense, buffers, full, max_blocks);
    default:
      fail("accumulate_stats: unsupported dtype ", dense.scalar_type());
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fasthooks, CUDA, m) {
  m.impl("accumulate_stats", TORCH_BOX(&accumulate_stats_cuda));
}

}  // namespace fasthooks
