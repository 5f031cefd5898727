// The CUDA device API that csrc/cuda/accumulate_kernel.cuh uses, emulated on the CPU so that its
// device code runs here unchanged.
//
// - Each CUDA thread is a fiber (started with ucontext, switched with _setjmp/_longjmp, which
//   leave the signal mask alone and so make no system call); the fibers of a block take turns on
//   one OS thread, so
//   `__shared__` variables are thread_local statics (they keep what the previous block on that OS
//   thread left, never zeroed), and dynamic shared memory is refilled with random bytes at every
//   block start.
// - Blocks run concurrently on several OS threads, taken from a shuffled order.
// - __syncthreads() waits for every thread of the block that has not exited. __shfl_down_sync and
//   __match_any_sync wait for every lane of their mask, at the same intrinsic with the same mask;
//   a lane outside the mask that calls one, or reads from one, is an error, and so is a block
//   whose threads all wait for something that cannot happen (a deadlock). __activemask() returns
//   the lanes of the warp waiting at that same call, optionally split at random into up to three
//   groups, as divergent lanes would be.
// - Global atomics are std::atomic_ref, __threadfence() a sequentially consistent fence.
//
// What it cannot show: x86's memory ordering is stronger than the GPU's, so a missing fence does
// not fail here; warps are scheduled as fibers, not in lockstep; nothing here measures time,
// occupancy or registers.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define FASTHOOKS_NOINLINE __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) alignas(n)
#define __shared__ static thread_local
#define FASTHOOKS_DYNAMIC_SHARED(name) unsigned char* name = ::cuda_on_cpu::dynamic_shared()

using std::fmax;
using std::fmin;
using std::isfinite;

namespace cuda_on_cpu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// How launches run; set from Python before a launch.
struct Options {
  int workers = 4;           // OS threads running blocks at once
  bool split_lanes = false;  // __activemask() splits the waiting lanes at random
  uint64_t seed = 1;
};

inline Options& options() {
  static Options o;
  return o;
}

// What the emulation saw since the last reset; `errors` must stay 0.
struct Counts {
  std::atomic<int64_t> launches{0}, blocks{0}, barriers{0}, warp_ops{0}, lane_splits{0};
  std::atomic<int64_t> errors{0};
};

inline Counts& counts() {
  static Counts c;
  return c;
}

inline std::mutex& error_mutex() {
  static std::mutex m;
  return m;
}

inline std::string& last_error() {
  static std::string e;
  return e;
}

inline void report(const std::string& what) {
  const std::lock_guard<std::mutex> lock(error_mutex());
  counts().errors++;
  last_error() = what;
}

enum class Wait { kNone, kBarrier, kShuffle, kMatch, kActiveMask, kExited };

struct Fiber {
  ucontext_t context;
  jmp_buf jump;
  bool started = false;
  std::vector<char> stack;
  Wait wait = Wait::kExited;
  unsigned mask = 0;
  int site = 0;  // the source line of an __activemask() call
  int delta = 0;
  uint64_t value = 0;
  uint64_t result = 0;
  Dim3 thread;
};

struct Block {
  Dim3 index, dim, grid;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  jmp_buf scheduler;
  std::vector<unsigned char> shared;
  std::function<void()> body;
  std::mt19937_64 random;
  bool failed = false;
};

inline thread_local Block* running = nullptr;

inline unsigned char* dynamic_shared() { return running->shared.data(); }

// Back to the block's scheduler until what the fiber waits for has happened.
inline void wait_for(Wait what) {
  Fiber& f = *running->current;
  f.wait = what;
  if (_setjmp(f.jump) == 0) _longjmp(running->scheduler, 1);
}

inline void fiber_main() {
  running->body();
  running->current->wait = Wait::kExited;
  _longjmp(running->scheduler, 1);
}

// Runs fiber f until it waits or exits.
inline void resume(Block& b, Fiber& f) {
  b.current = &f;
  if (_setjmp(b.scheduler) != 0) return;
  if (f.started) _longjmp(f.jump, 1);
  f.started = true;
  setcontext(&f.context);
}

template <typename T>
T warp_op(Wait op, unsigned mask, T value, int delta) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  Fiber& f = *running->current;
  if (!(mask >> (f.thread.x % 32) & 1u)) {
    report("a lane called a warp intrinsic with a mask that leaves it out");
    return value;  // no lane of the mask waits for it
  }
  f.mask = mask;
  f.delta = delta;
  f.value = 0;
  std::memcpy(&f.value, &value, sizeof(T));
  wait_for(op);
  T out;
  std::memcpy(&out, &f.result, sizeof(T));
  return out;
}

// Completes a warp intrinsic whose every lane is waiting at it; returns whether one was.
inline bool resolve_warp_ops(Block& b) {
  const unsigned threads = b.dim.x;
  for (unsigned warp = 0; warp < threads; warp += 32) {
    for (unsigned lane = 0; lane < 32 && warp + lane < threads; ++lane) {
      const Fiber& f = b.fibers[warp + lane];
      if (f.wait != Wait::kShuffle && f.wait != Wait::kMatch) continue;
      bool ready = true;
      for (unsigned k = 0; k < 32 && ready; ++k) {
        if (!(f.mask >> k & 1u)) continue;
        ready = warp + k < threads && b.fibers[warp + k].wait == f.wait &&
                b.fibers[warp + k].mask == f.mask;
      }
      if (!ready) continue;
      const Wait op = f.wait;
      const unsigned mask = f.mask;
      for (unsigned k = 0; k < 32; ++k) {
        if (!(mask >> k & 1u)) continue;
        Fiber& g = b.fibers[warp + k];
        if (op == Wait::kShuffle) {
          const unsigned source = k + static_cast<unsigned>(g.delta);
          if (source < 32 && !(mask >> source & 1u)) {
            report("__shfl_down_sync read a lane outside its mask");
          }
          g.result = source < 32 ? b.fibers[warp + source].value : g.value;
        } else {
          unsigned peers = 0;
          for (unsigned j = 0; j < 32; ++j) {
            const bool same =
                static_cast<uint32_t>(b.fibers[warp + j].value) == static_cast<uint32_t>(g.value);
            if ((mask >> j & 1u) && same) peers |= 1u << j;
          }
          g.result = peers;
        }
      }
      for (unsigned k = 0; k < 32; ++k) {
        if (mask >> k & 1u) b.fibers[warp + k].wait = Wait::kNone;
      }
      counts().warp_ops++;
      return true;
    }
  }
  return false;
}

inline bool resolve_barrier(Block& b) {
  unsigned waiting = 0, exited = 0;
  for (const Fiber& f : b.fibers) {
    waiting += f.wait == Wait::kBarrier;
    exited += f.wait == Wait::kExited;
  }
  if (waiting == 0 || waiting + exited != b.fibers.size()) return false;
  for (Fiber& f : b.fibers) {
    if (f.wait == Wait::kBarrier) f.wait = Wait::kNone;
  }
  counts().barriers++;
  return true;
}

// Gives the lanes of each warp waiting at one __activemask() their mask (or, split, a group's).
inline bool resolve_active_mask(Block& b) {
  const unsigned threads = b.dim.x;
  for (unsigned warp = 0; warp < threads; warp += 32) {
    for (unsigned lane = 0; lane < 32 && warp + lane < threads; ++lane) {
      if (b.fibers[warp + lane].wait != Wait::kActiveMask) continue;
      const int site = b.fibers[warp + lane].site;
      const unsigned groups = options().split_lanes ? 1 + b.random() % 3 : 1;
      unsigned masks[3] = {0, 0, 0};
      unsigned group_of[32] = {};
      for (unsigned k = lane; k < 32 && warp + k < threads; ++k) {
        const Fiber& g = b.fibers[warp + k];
        if (g.wait != Wait::kActiveMask || g.site != site) continue;
        group_of[k] = static_cast<unsigned>(b.random() % groups);
        masks[group_of[k]] |= 1u << k;
      }
      for (unsigned k = lane; k < 32; ++k) {
        if (!((masks[0] | masks[1] | masks[2]) >> k & 1u)) continue;
        b.fibers[warp + k].result = masks[group_of[k]];
        b.fibers[warp + k].wait = Wait::kNone;
      }
      counts().lane_splits += (masks[0] != 0) + (masks[1] != 0) + (masks[2] != 0) > 1;
      return true;
    }
  }
  return false;
}

inline void run_block(Block& b) {
  for (unsigned t = 0; t < b.dim.x; ++t) {
    Fiber& f = b.fibers[t];
    f.thread = Dim3{t, 0, 0};
    f.wait = Wait::kNone;
    f.started = false;
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_main, 0);
  }
  for (unsigned char& byte : b.shared) byte = static_cast<unsigned char>(b.random());
  running = &b;
  while (true) {
    bool ran = false;
    for (Fiber& f : b.fibers) {
      if (f.wait != Wait::kNone) continue;
      resume(b, f);
      ran = true;
    }
    if (ran) continue;
    if (std::all_of(b.fibers.begin(), b.fibers.end(),
                    [](const Fiber& f) { return f.wait == Wait::kExited; })) {
      break;
    }
    if (resolve_warp_ops(b) || resolve_barrier(b) || resolve_active_mask(b)) continue;
    report("deadlock in block " + std::to_string(b.index.x) +
           ": its threads wait for what no thread will do");
    b.failed = true;  // its fibers are abandoned; the next block starts them afresh
    break;
  }
  running = nullptr;
  counts().blocks++;
}

// Runs kernel(args...) over `grid` blocks of `threads` threads with `shared` bytes of dynamic
// shared memory, blocks started in a shuffled order on options().workers OS threads.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, unsigned grid, unsigned threads, size_t shared, Args... args) {
  // CUDA refuses more dynamic shared memory than this to a kernel that did not opt in to more.
  constexpr size_t kDynamicSharedLimit = 48 * 1024;
  if (shared > kDynamicSharedLimit) {
    report("a launch asked for " + std::to_string(shared) +
           " bytes of dynamic shared memory, over the 48 KB CUDA allows by default");
    return;
  }
  std::mt19937_64 random(options().seed++);
  std::vector<unsigned> order(grid);
  for (unsigned i = 0; i < grid; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), random);
  std::atomic<unsigned> next{0};
  const unsigned workers = std::max(1u, std::min<unsigned>(options().workers, grid));
  const uint64_t seed = random();
  std::vector<std::thread> pool;
  for (unsigned w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      Block b;
      b.fibers.resize(threads);
      for (Fiber& f : b.fibers) {
        f.stack.resize(128 * 1024);
        getcontext(&f.context);
      }
      b.shared.resize(shared + 16);
      b.dim = Dim3{threads, 1, 1};
      b.grid = Dim3{grid, 1, 1};
      b.random.seed(seed + w);
      b.body = [&] { kernel(args...); };
      for (unsigned i; (i = next.fetch_add(1)) < grid;) {
        b.index = Dim3{order[i], 0, 0};
        run_block(b);
      }
    });
  }
  for (std::thread& t : pool) t.join();
  counts().launches++;
}

}  // namespace cuda_on_cpu

#define threadIdx (::cuda_on_cpu::running->current->thread)
#define blockIdx (::cuda_on_cpu::running->index)
#define blockDim (::cuda_on_cpu::running->dim)
#define gridDim (::cuda_on_cpu::running->grid)
#define __syncthreads() ::cuda_on_cpu::wait_for(::cuda_on_cpu::Wait::kBarrier)
#define __activemask() ::cuda_on_cpu::active_mask(__LINE__)

namespace cuda_on_cpu {
inline unsigned active_mask(int site) {
  running->current->site = site;
  wait_for(Wait::kActiveMask);
  return static_cast<unsigned>(running->current->result);
}
}  // namespace cuda_on_cpu

template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta) {
  return ::cuda_on_cpu::warp_op<T>(::cuda_on_cpu::Wait::kShuffle, mask, value,
                                   static_cast<int>(delta));
}
inline unsigned __match_any_sync(unsigned mask, int value) {
  return static_cast<unsigned>(
      ::cuda_on_cpu::warp_op<int>(::cuda_on_cpu::Wait::kMatch, mask, value, 0));
}
// Conversions to an unsigned integer rounding toward zero, saturating as the hardware's do:
// NaN and negative values give 0, values past the range UINT32_MAX.
template <typename F>
unsigned saturated_unsigned(F v) {
  if (!(v > F(0))) return 0u;
  return v >= F(4294967296.0) ? 0xffffffffu : static_cast<unsigned>(v);
}
inline unsigned __float2uint_rz(float v) { return saturated_unsigned(v); }
inline unsigned __double2uint_rz(double v) { return saturated_unsigned(v); }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline unsigned __float_as_uint(float v) { return std::bit_cast<unsigned>(v); }
inline float __uint_as_float(unsigned v) { return std::bit_cast<float>(v); }
inline long long __double_as_longlong(double v) { return std::bit_cast<long long>(v); }
inline double __longlong_as_double(long long v) { return std::bit_cast<double>(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return std::atomic_ref<unsigned long long>(*p).fetch_add(v);
}
inline double atomicAdd(double* p, double v) { return std::atomic_ref<double>(*p).fetch_add(v); }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  std::atomic_ref<unsigned long long> at(*p);
  unsigned long long seen = at.load();
  while (seen < v && !at.compare_exchange_weak(seen, v)) {
  }
  return seen;
}
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned v) {
  std::atomic_ref<unsigned>(*p).compare_exchange_strong(compare, v);
  return compare;
}
inline unsigned atomicExch(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).exchange(v);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// A load that bypasses L1: here, a load no compiler may cache or tear.
inline double __ldcg(const double* p) {
  return std::atomic_ref<double>(*const_cast<double*>(p)).load(std::memory_order_relaxed);
}
