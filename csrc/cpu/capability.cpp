#include "capability.h"

#include "../checks.h"

#include <cstdlib>
#include <cstring>

namespace fasthooks {
namespace {

struct Capability {
  const char* name;
  bool (*supported)();
  const ChunkKernels* kernels;
};

bool anywhere() { return true; }

#if defined(__x86_64__) || defined(__i386__)
bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512() {
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}

bool cpu_has_avx512_gfni() {
  return cpu_has_avx512() && __builtin_cpu_supports("gfni") &&
         __builtin_cpu_supports("avx512bitalg") && __builtin_cpu_supports("avx512vbmi");
}

// From the least capable to the most; each runs where the CPU has its instructions.
const Capability kCapabilities[] = {{"default", &anywhere, &default_kernels},
                                    {"avx2", &cpu_has_avx2, &avx2_kernels},
                                    {"avx512", &cpu_has_avx512, &avx512_kernels},
                                    {"avx512_gfni", &cpu_has_avx512_gfni, &avx512_gfni_kernels}};
#else
bool nowhere() { return false; }

// The x86 names stay valid ceilings; nothing here runs above the portable kernels.
const Capability kCapabilities[] = {{"default", &anywhere, &default_kernels},
                                    {"avx2", &nowhere, nullptr},
                                    {"avx512", &nowhere, nullptr},
                                    {"avx512_gfni", &nowhere, nullptr}};
#endif

// The most capable set the CPU supports, up to FASTHOOKS_CPU_CAPABILITY where it is set.
const Capability& choose_capability() {
  const char* ceiling = std::getenv("FASTHOOKS_CPU_CAPABILITY");
  const bool capped = ceiling != nullptr && *ceiling != '\0';
  if (capped) {
    bool known = false;
    for (const Capability& c : kCapabilities) known |= std::strcmp(ceiling, c.name) == 0;
    FASTHOOKS_CHECK(known,
                    "FASTHOOKS_CPU_CAPABILITY must be 'default', 'avx2', 'avx512' or "
                    "'avx512_gfni', got '",
                    ceiling, "'");
  }
  const Capability* chosen = &kCapabilities[0];
  for (const Capability& c : kCapabilities) {
    if (c.supported()) chosen = &c;
    if (capped && std::strcmp(c.name, ceiling) == 0) break;
  }
  return *chosen;
}

const Capability& capability() {
  static const Capability& chosen = choose_capability();
  return chosen;
}

}  // namespace

const char* cpu_capability_name() { return capability().name; }

const ChunkKernels& cpu_kernels() { return *capability().kernels; }

}  // namespace fasthooks
