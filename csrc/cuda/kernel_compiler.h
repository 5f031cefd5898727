// The CUDA kernels compiled where they run: the kernel source built into the binary, compiled by
// NVRTC for the device's architecture at first use, one instantiation at a time, and kept in a
// disk cache shared by the processes of a machine.
#pragma once

#include <string>

#include "cuda_api.h"
#include "launch_plan.h"

namespace fasthooks {
namespace cuda {

struct KernelImage {
  std::string lowered_name;  // the kernel's name in the image
  std::string image;         // a cubin, or PTX for a GPU newer than NVRTC knows
  bool compiled = false;     // compiled by this call, not read from the cache
  std::string path;          // where the cache keeps it (empty when it could not)
};

// What NVRTC builds for compute capability `arch` (major * 10 + minor): "sm_90" for an
// architecture it knows, "compute_100" (PTX of the newest it knows, which the driver compiles)
// for a newer one; fails for one older than it or the kernels (sm_70) support.
std::string target_for(const CudaApi& api, int arch);

// "13.0"
std::string nvrtc_version(const CudaApi& api);

// The disk cache: its directory, and how long a process waits for another that is compiling
// the same kernel before it compiles the kernel itself (a stopped or hung process must not hang
// the others; what either writes is whole, so both are right).
struct KernelCache {
  std::string dir;
  double lock_wait_seconds = 0.0;  // fasthooks.cuda_setup.lock_wait() gives it
};

// The image of kernel `v` for `arch`, from `cache` or compiled now (and then stored there, once
// however many processes ask at the same time); with `refresh`, compiled anew whatever the cache
// holds. `log` says so on stderr when it compiles.
KernelImage kernel_image(const CudaApi& api, const KernelCache& cache, const KernelVariant& v,
                         int arch, bool log, bool refresh = false);

}  // namespace cuda
}  // namespace fasthooks
