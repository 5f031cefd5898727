// fasthooks::accumulate_stats on CUDA: the host side (operator_host.h) over the CUDA driver API,
// one launch of a kernel NVRTC compiled for this GPU (kernel_compiler.h) per call, on torch's
// current stream, with no host sync, no allocation and no memset. No CUDA library is linked:
// fasthooks/cuda_setup.py hands over the functions (cuda_api.h) once it has found them.
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>

#include "cuda_api.h"
#include "kernel_compiler.h"
#include "kernel_names.h"
#include "operator_host.h"

namespace fasthooks {
namespace cuda {
namespace {

struct Setup {
  std::mutex mutex;
  std::atomic<bool> ready{false};
  CudaApi api{};
  KernelCache cache;
  std::string unavailable = "fasthooks.cuda_setup has not run";
};

Setup& setup() {
  static Setup s;
  return s;
}

const CudaApi& api() {
  Setup& s = setup();
  if (!s.ready.load(std::memory_order_acquire)) {
    const std::lock_guard<std::mutex> lock(s.mutex);
    fail("fasthooks' CUDA kernels are unavailable: ", s.unavailable,
         " (python -m fasthooks says more; ActivationStats(backend='python') runs without them)");
  }
  return s.api;
}

// NVRTC alone, which needs no GPU and no driver.
const CudaApi& compiler_api() {
  Setup& s = setup();
  const std::lock_guard<std::mutex> lock(s.mutex);
  FASTHOOKS_CHECK(s.api.nvrtcCompileProgram != nullptr, "fasthooks' CUDA kernels: no NVRTC (",
                  s.unavailable, ")");
  return s.api;
}

void check_cu(CUresult status, const char* what) {
  if (status == kCudaSuccess) return;
  const char* text = nullptr;
  api().cuGetErrorString(status, &text);
  fail("accumulate_stats: ", what, ": CUDA error ", status, " (", text ? text : "unknown", ")");
}

constexpr int kMaxDevices = 64;
constexpr int kVariants = 4 * 2 * 2 * 3 * 2 * 2 * 2 * 2;

int variant_index(const KernelVariant& v) {
  return ((((((v.dtype * 2 + v.list) * 2 + v.full) * 3 + v.hist) * 2 + v.diff) * 2 + v.binades) *
              2 +
          v.top) *
             2 +
         v.channels;
}

struct DeviceFacts {
  CUcontext context;
  int arch;
  int multiprocessors;
};

struct LoadedKernel {
  CUfunction function;
  int64_t resident;  // blocks of it resident at once on the device
};

std::mutex load_mutex;
std::atomic<const DeviceFacts*> device_facts[kMaxDevices] = {};
std::atomic<const LoadedKernel*> loaded[kMaxDevices][kVariants] = {};

int attribute(int which, CUdevice device) {
  int value = 0;
  check_cu(api().cuDeviceGetAttribute(&value, which, device), "reading a device attribute");
  return value;
}

const DeviceFacts& facts_of(int device) {
  FASTHOOKS_CHECK(device >= 0 && device < kMaxDevices, "accumulate_stats: CUDA device index ",
                  device, " out of range");
  const DeviceFacts* facts = device_facts[device].load(std::memory_order_acquire);
  if (facts != nullptr) return *facts;
  const std::lock_guard<std::mutex> lock(load_mutex);
  facts = device_facts[device].load(std::memory_order_acquire);
  if (facts == nullptr) {
    CUdevice handle = 0;
    check_cu(api().cuDeviceGet(&handle, device), "finding the device");
    CUcontext context = nullptr;
    check_cu(api().cuDevicePrimaryCtxRetain(&context, handle), "retaining the device's context");
    facts = new DeviceFacts{
        context, attribute(kAttributeMajor, handle) * 10 + attribute(kAttributeMinor, handle),
        attribute(kAttributeMultiprocessors, handle)};
    device_facts[device].store(facts, std::memory_order_release);
  }
  return *facts;
}

// The device's primary context (torch's) current on this thread: threads that never called the
// CUDA runtime (autograd's, say) may have none, or another device's.
void make_current(int device) {
  const CUcontext context = facts_of(device).context;
  CUcontext current = nullptr;
  check_cu(api().cuCtxGetCurrent(&current), "reading the current context");
  if (current != context) check_cu(api().cuCtxSetCurrent(context), "making the context current");
}

// Relaxed stream capture on this thread while it lives: a kernel's first use may come while a
// CUDA graph is being captured, and loading a module is not allowed in the stricter modes.
class RelaxedCapture {
 public:
  RelaxedCapture() {
    check_cu(api().cuThreadExchangeStreamCaptureMode(&mode_), "relaxing capture");
  }
  ~RelaxedCapture() { api().cuThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  int mode_ = kCaptureModeRelaxed;
};

// The module of `image`, or null if the driver refuses it (with `status`).
CUmodule load_module(const KernelImage& image, CUresult& status) {
  CUmodule module = nullptr;
  status = api().cuModuleLoadData(&module, image.image.c_str());
  return status == kCudaSuccess ? module : nullptr;
}

const LoadedKernel& kernel_on(const KernelVariant& v, int device) {
  FASTHOOKS_CHECK(device >= 0 && device < kMaxDevices, "accumulate_stats: CUDA device index ",
                  device, " out of range");
  std::atomic<const LoadedKernel*>& slot = loaded[device][variant_index(v)];
  const LoadedKernel* kernel = slot.load(std::memory_order_acquire);
  if (kernel != nullptr) return *kernel;
  const RelaxedCapture relaxed;
  const DeviceFacts& facts = facts_of(device);
  const std::lock_guard<std::mutex> lock(load_mutex);
  kernel = slot.load(std::memory_order_acquire);
  if (kernel == nullptr) {
    const KernelCache& cache = setup().cache;
    KernelImage image = kernel_image(api(), cache, v, facts.arch, /*log=*/true);
    make_current(device);
    CUresult status = kCudaSuccess;
    CUmodule module = load_module(image, status);
    if (module == nullptr && !image.compiled) {
      // A cached image the driver refuses (damaged, or from an older driver's day): made anew.
      image = kernel_image(api(), cache, v, facts.arch, /*log=*/true, /*refresh=*/true);
      module = load_module(image, status);
    }
    check_cu(status, ("loading the kernel " + variant_label(v) + " (" +
                      (image.path.empty() ? "compiled in memory" : image.path) + ")")
                         .c_str());
    CUfunction function = nullptr;
    check_cu(api().cuModuleGetFunction(&function, module, image.lowered_name.c_str()),
             "finding the kernel");
    int blocks = 0;
    check_cu(api().cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, function, kThreads,
                                                               shared_bytes(v)),
             "reading the kernel's occupancy");
    kernel = new LoadedKernel{function, static_cast<int64_t>(blocks) * facts.multiprocessors};
    slot.store(kernel, std::memory_order_release);
  }
  return *kernel;
}

// What operator_host.h needs of a GPU, from the CUDA driver.
struct CudaDriver {
  using Stream = CUstream;
  using Guard = torch::stable::accelerator::DeviceGuard;

  static Stream current_stream(int device) {
    void* stream = nullptr;
    FASTHOOKS_CHECK(api().aoti_torch_get_current_cuda_stream(device, &stream) == 0,
                    "accumulate_stats: could not get the current CUDA stream of device ", device);
    return static_cast<Stream>(stream);
  }

  // Where a call comes from, for its workspace region (stream_regions.h).
  static CallOrigin origin_of(Stream stream) {
    int status = kCaptureStatusNone;
    check_cu(api().cuStreamIsCapturing(stream, &status), "asking whether the stream is capturing");
    return {reinterpret_cast<uintptr_t>(stream), status != kCaptureStatusNone};
  }

  static int64_t resident_blocks(const KernelVariant& v, int device) {
    return kernel_on(v, device).resident;
  }

  template <typename... Args>
  static void launch(const KernelVariant& v, int64_t blocks, Stream stream, int device,
                     Args... args) {
    const LoadedKernel& kernel = kernel_on(v, device);
    make_current(device);
    void* params[] = {static_cast<void*>(&args)...};
    check_cu(
        api().cuLaunchKernel(kernel.function, static_cast<unsigned>(blocks), 1, 1, kThreads, 1, 1,
                             static_cast<unsigned>(shared_bytes(v)), stream, params, nullptr),
        "kernel launch");
  }
};

using Host = OperatorHost<CudaDriver>;

void copy_out(const std::string& text, char* out, size_t size) {
  if (size > 0) std::snprintf(out, size, "%s", text.c_str());
}

}  // namespace
}  // namespace cuda
}  // namespace fasthooks

// The C interface fasthooks/cuda_setup.py calls through ctypes.
#pragma GCC visibility push(default)
extern "C" {

// Name i of the functions fasthooks_cuda_setup takes, or null past the last.
const char* fasthooks_cuda_api_name(int i) {
  using fasthooks::cuda::kApiFunctions;
  return i >= 0 && static_cast<size_t>(i) < kApiFunctions ? fasthooks::cuda::kApiNames[i] : nullptr;
}

// Hands over the functions (in fasthooks_cuda_api_name's order; null where not found), the
// cache directory and how long to wait for another process's compile of a kernel, with
// `unavailable` saying why the kernels cannot run (null when they can).
void fasthooks_cuda_setup(void* const* functions, const char* cache_dir, double lock_wait_seconds,
                          const char* unavailable) {
  using namespace fasthooks::cuda;
  Setup& s = setup();
  const std::lock_guard<std::mutex> lock(s.mutex);
  std::memcpy(static_cast<void*>(&s.api), functions, sizeof(CudaApi));
  s.cache = KernelCache{cache_dir, lock_wait_seconds};
  s.unavailable = unavailable != nullptr ? unavailable : "";
  s.ready.store(unavailable == nullptr, std::memory_order_release);
}

// Compiles kernel (dtype position, list, full, histogram bins or 0, diff, binades, top, channels)
// for compute capability `arch` into the cache, or finds it there, with no GPU: 1 compiled, 0
// found; -1 on failure. `out` gets the cache file, or the error.
int fasthooks_cuda_compile(int dtype, int list, int full, int bins, int diff, int binades, int top,
                           int channels, int arch, char* out, size_t out_size) {
  using namespace fasthooks::cuda;
  try {
    const KernelVariant v = variant_of(dtype, list != 0, full != 0, bins, diff != 0, binades != 0,
                                       top != 0, channels != 0);
    const KernelImage image = kernel_image(compiler_api(), setup().cache, v, arch, /*log=*/false);
    copy_out(image.path, out, out_size);
    return image.compiled ? 1 : 0;
  } catch (const std::exception& error) {
    copy_out(error.what(), out, out_size);
    return -1;
  }
}

// Makes the float32 mean-and-std kernel ready on CUDA device `device` (compiled or found in the
// cache, and loaded): what every other kernel needs too. 0, or -1 with the error in `out`.
int fasthooks_cuda_prepare(int device, char* out, size_t out_size) {
  using namespace fasthooks::cuda;
  try {
    kernel_on(variant_of(0, false, false, 0, false, false, false, false), device);
    copy_out("", out, out_size);
    return 0;
  } catch (const std::exception& error) {
    copy_out(error.what(), out, out_size);
    return -1;
  }
}

// What NVRTC builds for `arch` ("sm_90", or "compute_N" PTX) and its version, "13.0 sm_90".
int fasthooks_cuda_target(int arch, char* out, size_t out_size) {
  using namespace fasthooks::cuda;
  try {
    const CudaApi& nvrtc = compiler_api();
    copy_out(nvrtc_version(nvrtc) + " " + target_for(nvrtc, arch), out, out_size);
    return 0;
  } catch (const std::exception& error) {
    copy_out(error.what(), out, out_size);
    return -1;
  }
}

}  // extern "C"
#pragma GCC visibility pop

STABLE_TORCH_LIBRARY_IMPL(fasthooks, CUDA, m) {
  m.impl("accumulate_stats", TORCH_BOX(&fasthooks::cuda::Host::accumulate_stats));
  m.impl("accumulate_stats_list", TORCH_BOX(&fasthooks::cuda::Host::accumulate_stats_list));
}
