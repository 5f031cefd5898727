// Per-chunk statistics kernels, one table per instruction set.
#pragma once

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#include "../histogram.h"
#include "../stats.h"
#include "channel_sums.h"

namespace fasthooks {

// What a chunk kernel needs besides the values; `bins` is null without a histogram. A first
// guess of a bin whose fractional part is within `bin_margin` of an integer may be off by one,
// unless `exact_origin` is not kNoExactOrigin: then every guess is exact (see exact_origin in
// accumulate_cpu.cpp).
constexpr int64_t kNoExactOrigin = INT64_MIN;
template <typename Acc>
struct ChunkParams {
  Acc near_zero;
  const BinTable<Acc>* bins;
  Acc bin_margin;
  int64_t exact_origin;
};

// How a kernel counts the byte codes of a block's bins (see count_codes in chunk_stats_impl.h).
enum class CodeCounting { kComparison, kNibbleLookup, kBitTranspose };

// Statistics of n contiguous values; with a histogram, each value's bin is counted in one of
// kHistLanes lane-private rows of (bins + 1) counters (the last one takes values in no bin).
template <typename T, typename Acc>
using ChunkFn = Stats (*)(const T*, int64_t, const ChunkParams<Acc>&, uint32_t*);
constexpr int64_t kHistLanes = 8;

// Adds n values (positions start.. of a tensor in memory order) to the sums of their channels,
// the magnitudes above near_zero counted.
template <typename T>
using ChannelFn = void (*)(const T*, int64_t, int64_t, const ChannelMap&, double, ChannelSums&);

// Index 0: mean and std only; index 1: every statistic.
struct ChunkKernels {
  ChunkFn<float, float> f32[2];
  ChunkFn<double, double> f64[2];
  ChunkFn<torch::headeronly::Half, float> f16[2];
  ChunkFn<torch::headeronly::BFloat16, float> bf16[2];
  ChannelFn<float> channels_f32;
  ChannelFn<double> channels_f64;
  ChannelFn<torch::headeronly::Half> channels_f16;
  ChannelFn<torch::headeronly::BFloat16> channels_bf16;
};

// The contract of a kernel unit (kernels_<isa>.cpp). It includes every header before its target
// pragma, so that no inline function shared with another unit is compiled for its instructions;
// inside the pragma, in a namespace of its own, it defines kVectorBytes, kCodeCounting,
// half_to_float() and the vector primitives that chunk_stats_impl.h lists, then includes that
// file; after the pragma it defines its table with FASTHOOKS_KERNEL_TABLE. Nothing else in the
// unit has external linkage, and nothing of it runs before capability.cpp has checked the CPU.
//
// A table is constant-initialised (C++20's constinit, which GCC and Clang give C++17 too):
// its pointers are fixed when the library is linked, so no code of the unit runs when the
// library loads. A dynamic initialiser in a unit compiled for AVX-512 would run AVX-512
// instructions at import, on any CPU.
#if defined(__clang__)
#define FASTHOOKS_CONSTINIT [[clang::require_constant_initialization]]
#else
#define FASTHOOKS_CONSTINIT __constinit
#endif
#define FASTHOOKS_KERNEL_TABLE(name, table) FASTHOOKS_CONSTINIT const ChunkKernels name = table

extern const ChunkKernels default_kernels;
#if defined(__x86_64__) || defined(__i386__)
extern const ChunkKernels avx2_kernels;
extern const ChunkKernels avx512_kernels;
extern const ChunkKernels avx512_gfni_kernels;
#endif

}  // namespace fasthooks
