#include "capability.h"

#include "../checks.h"

#include <cstdlib>
#include <cstring>

namespace fasthooks {
namespace {

// From the least capable to the most; each runs where the CPU has its instructions.
constexpr const char* kCapabilities[] = {"default", "avx2", "avx512"};

bool cpu_supports(const char* capability) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (std::strcmp(capability, "avx2") == 0) return avx2;
  if (std::strcmp(capability, "avx512") == 0) {
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }
#endif
  return std::strcmp(capability, "default") == 0;
}

// The most capable set the CPU supports, up to FASTHOOKS_CPU_CAPABILITY where it is set.
const char* choose_capability() {
  const char* ceiling = std::getenv("FASTHOOKS_CPU_CAPABILITY");
  const bool capped = ceiling != nullptr && *ceiling != '\0';
  if (capped) {
    bool known = false;
    for (const char* name : kCapabilities) known |= std::strcmp(ceiling, name) == 0;
    FASTHOOKS_CHECK(known, "FASTHOOKS_CPU_CAPABILITY must be 'default', 'avx2' or 'avx512', got '",
                    ceiling, "'");
  }
  const char* chosen = kCapabilities[0];
  for (const char* name : kCapabilities) {
    if (cpu_supports(name)) chosen = name;
    if (capped && std::strcmp(name, ceiling) == 0) break;
  }
  return chosen;
}

}  // namespace

const char* cpu_capability_name() {
  static const char* name = choose_capability();
  return name;
}

const ChunkKernels& cpu_kernels() {
#if defined(__x86_64__) || defined(__i386__)
  static const ChunkKernels& kernels =
      std::strcmp(cpu_capability_name(), "avx512") == 0 ? avx512_kernels
      : std::strcmp(cpu_capability_name(), "avx2") == 0 ? avx2_kernels
                                                        : default_kernels;
  return kernels;
#else
  return default_kernels;
#endif
}

}  // namespace fasthooks
