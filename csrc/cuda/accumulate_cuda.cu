// CUDA kernel of fasthooks::accumulate_stats: one launch on the current stream, no host sync, no
// allocation, no memset.
//
// Every thread sums powers of (x - shift) and keeps extremes and counts over a grid-stride range;
// blocks reduce to partials in the workspace, and the last block to finish combines them in
// block order (so the result is deterministic), merges them into the state slot at the
// device-side cursor, writes the finalised statistics and resets the finished-blocks counter for
// the next call. Histograms are counted per block in shared memory, with one atomic per group of
// lanes that share a bin, and added to the slot's row at the end of the block.
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
// Per-block partials: power sums s1..s4, min, max, near-zero count, non-finite count.
constexpr int kPartials = 8;
enum Partial { kS1, kS2, kS3, kS4, kPMin, kPMax, kPNearZero, kPNonFinite };
// Shared memory is sized for the most bins fasthooks/layout.py allows.
constexpr int64_t kMaxBins = 2048;

template <typename T>
struct alignas(kVecBytes) Vec {
  T val[kVecBytes / sizeof(T)];
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

// Only the first Fields entries are combined; the rest stay zero.
template <int Fields>
struct Partials {
  double v[kPartials] = {};
};

template <int Fields>
__device__ void combine(Partials<Fields>& a, const Partials<Fields>& b) {
  for (int f = 0; f < Fields; ++f) {
    if (f == kPMin) {
      a.v[f] = nan_min(a.v[f], b.v[f]);
    } else if (f == kPMax) {
      a.v[f] = nan_max(a.v[f], b.v[f]);
    } else {
      a.v[f] += b.v[f];
    }
  }
}

// Combines p over the block in a fixed order; the result is valid in thread 0.
template <int Fields>
__device__ void block_reduce(Partials<Fields>& p) {
  __shared__ double shared[kWarps][Fields];
  for (int offset = 16; offset > 0; offset /= 2) {
    Partials<Fields> other;
    for (int f = 0; f < Fields; ++f) other.v[f] = __shfl_down_sync(0xffffffffu, p.v[f], offset);
    combine(p, other);
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  __syncthreads();  // the shared array may still be read by an earlier call
  if (lane == 0) {
    for (int f = 0; f < Fields; ++f) shared[warp][f] = p.v[f];
  }
  __syncthreads();
  if (warp == 0) {
    if (lane < kWarps) {
      for (int f = 0; f < Fields; ++f) p.v[f] = shared[lane][f];
    }
    for (int offset = kWarps / 2; offset > 0; offset /= 2) {
      Partials<Fields> other;
      for (int f = 0; f < Fields; ++f) other.v[f] = __shfl_down_sync(0xffffffffu, p.v[f], offset);
      if (lane + offset < kWarps) combine(p, other);
    }
  }
}

template <typename Acc, bool Full, bool Hist>
struct ThreadState {
  double s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0;
  Acc min = static_cast<Acc>(INFINITY);
  Acc max = static_cast<Acc>(-INFINITY);
  bool nan = false;
  int64_t near_zero = 0;
  int64_t nonfinite = 0;
};

// Counts v's bin in the block's shared histogram: lanes that share a bin add once, together.
template <typename Acc>
__device__ void count_bin(Acc v, const BinTable<Acc>& table, unsigned int* hist) {
  const int64_t bin = bin_of(v, table);
  const unsigned int peers = __match_any_sync(__activemask(), static_cast<int>(bin));
  if ((threadIdx.x % 32) == __ffs(peers) - 1 && bin < table.bins) {
    atomicAdd(hist + bin, static_cast<unsigned int>(__popc(peers)));
  }
}

template <typename T, typename Acc, bool Full, bool Hist>
__global__ void __launch_bounds__(kThreads)
    accumulate_stats_kernel(const T* __restrict__ x, int64_t n, bool vectorised, Buffers b) {
  constexpr int Fields = Full ? kPartials : 2;
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

  // A shift near the data keeps the sums well conditioned when |mean| >> std; every thread reads
  // the same first element, so all partial sums share it.
  const Acc first = static_cast<Acc>(x[0]);
  const Acc shift = first - first == Acc(0) ? first : Acc(0);
  const Acc near_zero = static_cast<Acc>(b.near_zero);

  ThreadState<Acc, Full, Hist> t;
  auto add = [&](Acc v, Acc& a1, Acc& a2, Acc& a3, Acc& a4) {
    const Acc d = v - shift;
    const Acc d2 = d * d;
    a1 += d;
    a2 += d2;
    if constexpr (Full) {
      a3 += d2 * d;
      a4 += d2 * d2;
      t.min = fmin(t.min, v);  // NaN is ignored here and flagged instead
      t.max = fmax(t.max, v);
      t.nan |= v != v;
      t.near_zero += v <= near_zero;
      t.nonfinite += !(v - v == Acc(0));
    }
    if constexpr (Hist) count_bin(v, table, hist);
  };

  constexpr int kVec = kVecBytes / sizeof(T);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t n_vec = vectorised ? n / kVec : 0;
  const Vec<T>* xv = reinterpret_cast<const Vec<T>*>(x);
  for (int64_t i = tid; i < n_vec; i += stride) {
    const Vec<T> v = xv[i];
    Acc a1 = 0, a2 = 0, a3 = 0, a4 = 0;
#pragma unroll
    for (int k = 0; k < kVec; ++k) add(static_cast<Acc>(v.val[k]), a1, a2, a3, a4);
    t.s1 += a1;
    t.s2 += a2;
    t.s3 += a3;
    t.s4 += a4;
  }
  for (int64_t i = n_vec * kVec + tid; i < n; i += stride) {
    Acc a1 = 0, a2 = 0, a3 = 0, a4 = 0;
    add(static_cast<Acc>(x[i]), a1, a2, a3, a4);
    t.s1 += a1;
    t.s2 += a2;
    t.s3 += a3;
    t.s4 += a4;
  }

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

  Partials<Fields> p;
  p.v[kS1] = t.s1;
  p.v[kS2] = t.s2;
  if constexpr (Full) {
    p.v[kS3] = t.s3;
    p.v[kS4] = t.s4;
    p.v[kPMin] = t.nan ? NAN : static_cast<double>(t.min);
    p.v[kPMax] = t.nan ? NAN : static_cast<double>(t.max);
    p.v[kPNearZero] = static_cast<double>(t.near_zero);
    p.v[kPNonFinite] = static_cast<double>(t.nonfinite);
  }
  block_reduce(p);
  __shared__ bool last_block;
  if (threadIdx.x == 0) {
    for (int f = 0; f < Fields; ++f) b.partials[kPartials * blockIdx.x + f] = p.v[f];
    __threadfence();  // the partials are visible before the ticket is taken
    last_block = atomicAdd(b.finished, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last_block) return;

  Partials<Fields> total;
  for (int f = 0; f < Fields; ++f) total.v[f] = 0.0;
  if constexpr (Full) {
    total.v[kPMin] = INFINITY;
    total.v[kPMax] = -INFINITY;
  }
  for (int blk = threadIdx.x; blk < gridDim.x; blk += blockDim.x) {
    Partials<Fields> q;
    for (int f = 0; f < Fields; ++f) q.v[f] = __ldcg(b.partials + kPartials * blk + f);
    combine(total, q);
  }
  block_reduce(total);
  if (threadIdx.x == 0) {
    Stats batch;
    moments_from_shifted_sums<Full>(batch, static_cast<double>(n), shift, total.v[kS1],
                                    total.v[kS2], Full ? total.v[kS3] : 0.0,
                                    Full ? total.v[kS4] : 0.0);
    if constexpr (Full) {
      batch.min = total.v[kPMin];
      batch.max = total.v[kPMax];
      batch.near_zero = total.v[kPNearZero];
      batch.nonfinite = total.v[kPNonFinite];
    }
    const int64_t plane = b.modules * b.capacity;
    const SlotPointers slot{b.state + cell, plane, b.stats + cell, plane,
                            Full ? b.extra + cell : nullptr};
    store_slot<Full>(slot, merge<Full>(load_slot<Full>(slot), batch));
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
