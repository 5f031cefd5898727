// What the headers shared by the host and the device code need from the C++ library and torch:
// the real headers everywhere but NVRTC, which compiles the CUDA kernels where they run and
// brings no C++ library; there, the few pieces used, spelled out.
#pragma once

#ifdef __CUDACC_RTC__

typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
// size_t is built in.
typedef unsigned long long uintptr_t;

#define INFINITY __int_as_float(0x7f800000)
#define NAN __int_as_float(0x7fffffff)
#define C10_HOST_DEVICE __host__ __device__

namespace std {
template <typename T>
struct numeric_limits;
template <>
struct numeric_limits<float> {
  static constexpr int min_exponent = -125;
};
template <>
struct numeric_limits<double> {
  static constexpr int min_exponent = -1021;
};
}  // namespace std

// torch's 16-bit floats as the kernels read them: the same bits, converted to float.
namespace c10 {
struct alignas(2) Half {
  uint16_t x;
  __device__ operator float() const {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
  }
};
struct alignas(2) BFloat16 {
  uint16_t x;
  __device__ operator float() const { return __uint_as_float(static_cast<uint32_t>(x) << 16); }
};
}  // namespace c10

#else

#include <torch/headeronly/macros/Macros.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>

#endif
