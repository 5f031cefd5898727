#include "capability.h"

#include "../checks.h"

#include <cstdlib>
#include <cstring>

namespace fasthooks {
namespace {

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

const char* choose_capability() {
  const char* forced = std::getenv("FASTHOOKS_CPU_CAPABILITY");
  if (forced != nullptr && *forced != '\0') {
    FASTHOOKS_CHECK(std::strcmp(forced, "default") == 0 || std::strcmp(forced, "avx2") == 0,
                    "FASTHOOKS_CPU_CAPABILITY must be 'default' or 'avx2', got '", forced, "'");
    if (std::strcmp(forced, "default") == 0) return "default";
  }
  return cpu_has_avx2() ? "avx2" : "default";
}

}  // namespace

const char* cpu_capability_name() {
  static const char* name = choose_capability();
  return name;
}

const ChunkKernels& cpu_kernels() {
#if defined(__x86_64__) || defined(__i386__)
  static const ChunkKernels& kernels =
      std::strcmp(cpu_capability_name(), "avx2") == 0 ? avx2_kernels : default_kernels;
  return kernels;
#else
  return default_kernels;
#endif
}

}  // namespace fasthooks
