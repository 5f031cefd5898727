// Run-time choice of the CPU instruction set, so one binary runs on any x86-64 CPU.
#pragma once

#include "kernels.h"

namespace fasthooks {

// "avx512_gfni" where the CPU has GFNI, AVX-512 BITALG and VBMI besides "avx512"'s; "avx512" where
// it has AVX-512 F, BW, DQ and VL besides AVX2; "avx2" where it has AVX2, FMA and F16C; else
// "default". The environment variable FASTHOOKS_CPU_CAPABILITY caps the choice
// ("default" forces the portable kernels; read once, at first use).
const char* cpu_capability_name();
const ChunkKernels& cpu_kernels();

}  // namespace fasthooks
