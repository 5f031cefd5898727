// Per-chunk moment kernels, one table per instruction set.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "../moments.h"

namespace fasthooks {

struct ChunkKernels {
  Moments (*f32)(const float*, int64_t);
  Moments (*f64)(const double*, int64_t);
  Moments (*f16)(const c10::Half*, int64_t);
  Moments (*bf16)(const c10::BFloat16*, int64_t);
};

extern const ChunkKernels default_kernels;
#if defined(__x86_64__) || defined(__i386__)
extern const ChunkKernels avx2_kernels;
#endif

}  // namespace fasthooks
