#include "kernel_compiler.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../checks.h"
#include "fasthooks_kernel_source.h"
#include "kernel_names.h"

namespace fasthooks {
namespace cuda {
namespace {

void check_nvrtc(const CudaApi& api, nvrtcResult status, const char* what) {
  FASTHOOKS_CHECK(status == 0, "fasthooks' CUDA kernels: NVRTC failed ", what, ": ",
                  api.nvrtcGetErrorString(status));
}

std::vector<int> supported_archs(const CudaApi& api) {
  int count = 0;
  check_nvrtc(api, api.nvrtcGetNumSupportedArchs(&count), "listing its architectures");
  std::vector<int> archs(static_cast<size_t>(count));
  check_nvrtc(api, api.nvrtcGetSupportedArchs(archs.data()), "listing its architectures");
  return archs;
}

// FNV-1a, 64 bits: names a cache file by everything that makes its contents.
uint64_t fingerprint(const std::vector<std::string>& parts) {
  uint64_t h = 14695981039346656037ull;
  for (const std::string& part : parts) {
    for (const char c : part) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    h = (h ^ 0xffu) * 1099511628211ull;
  }
  return h;
}

// Makes `dir` and its parents; false if it cannot.
bool make_directories(const std::string& dir) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at < dir.size() && dir[at] != '/') continue;
    const std::string part = dir.substr(0, at);
    if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return false;
  }
  return true;
}

bool read_file(const std::string& path, std::string& out) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  out.clear();
  char chunk[1 << 16];
  ssize_t got = 0;
  while ((got = read(fd, chunk, sizeof(chunk))) > 0) out.append(chunk, static_cast<size_t>(got));
  close(fd);
  return got == 0;
}

// Writes `data` to a file of its own (a unique name, even across the nodes of a shared file
// system) and renames it to `path`: a reader sees all of it or none.
bool write_atomically(const std::string& path, const std::string& data) {
  std::string temporary = path + ".tmp.XXXXXX";
  const int fd = mkstemp(temporary.data());
  if (fd < 0) return false;
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t wrote = write(fd, data.data() + done, data.size() - done);
    if (wrote <= 0) break;
    done += static_cast<size_t>(wrote);
  }
  const bool ok = fsync(fd) == 0 && close(fd) == 0 && done == data.size();
  if (ok && chmod(temporary.c_str(), 0644) == 0 && rename(temporary.c_str(), path.c_str()) == 0) {
    return true;
  }
  unlink(temporary.c_str());
  return false;
}

// An exclusive lock on the file at `path` (none for an empty path, or where the file system
// has no locks), waited for at most `wait_seconds`; timed_out() says the wait ran out.
class FileLock {
 public:
  FileLock(const std::string& path, double wait_seconds)
      : fd_(path.empty() ? -1 : open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ < 0) return;
    constexpr double kPollSeconds = 0.02;
    for (double waited = 0.0; flock(fd_, LOCK_EX | LOCK_NB) != 0; waited += kPollSeconds) {
      if (errno != EWOULDBLOCK) return;  // no locks here: go on without one
      if (waited >= wait_seconds) {
        timed_out_ = true;
        return;
      }
      usleep(static_cast<useconds_t>(kPollSeconds * 1e6));
    }
  }
  ~FileLock() {
    if (fd_ >= 0) close(fd_);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  bool timed_out() const { return timed_out_; }

 private:
  int fd_;
  bool timed_out_ = false;
};

// A cache file: a format line, the lowered name, the image's size, each on a line, then the image;
// a file cut short or of another format is not used.
constexpr const char* kFormat = "fasthooks kernel cache 1";

std::string serialise(const KernelImage& image) {
  return std::string(kFormat) + "\n" + image.lowered_name + "\n" +
         std::to_string(image.image.size()) + "\n" + image.image;
}

bool parse(const std::string& contents, KernelImage& out) {
  const size_t name_at = contents.find('\n');
  if (name_at == std::string::npos || contents.compare(0, name_at, kFormat) != 0) return false;
  const size_t size_at = contents.find('\n', name_at + 1);
  const size_t image_at = contents.find('\n', size_at + 1);
  if (size_at == std::string::npos || image_at == std::string::npos) return false;
  out.lowered_name = contents.substr(name_at + 1, size_at - name_at - 1);
  out.image = contents.substr(image_at + 1);
  return !out.lowered_name.empty() && !out.image.empty() &&
         contents.substr(size_at + 1, image_at - size_at - 1) == std::to_string(out.image.size());
}

KernelImage compile(const CudaApi& api, const KernelVariant& v, const std::string& target) {
  nvrtcProgram program = nullptr;
  check_nvrtc(
      api,
      api.nvrtcCreateProgram(&program, kKernelSource, "fasthooks_kernels.cu", 0, nullptr, nullptr),
      "creating the program");
  struct Destroy {
    const CudaApi& api;
    nvrtcProgram& program;
    ~Destroy() { api.nvrtcDestroyProgram(&program); }
  } destroy{api, program};
  const std::string expression = name_expression(v);
  check_nvrtc(api, api.nvrtcAddNameExpression(program, expression.c_str()), "naming the kernel");
  const std::string arch = "--gpu-architecture=" + target;
  const char* options[] = {arch.c_str(), "-std=c++17"};
  const nvrtcResult status = api.nvrtcCompileProgram(program, 2, options);
  if (status != 0) {
    size_t size = 0;
    api.nvrtcGetProgramLogSize(program, &size);
    std::string log(size, '\0');
    api.nvrtcGetProgramLog(program, log.data());
    fail("fasthooks' CUDA kernels: NVRTC could not compile ", variant_label(v), " for ", target,
         ": ", api.nvrtcGetErrorString(status), "\n", log);
  }
  KernelImage out;
  const char* lowered = nullptr;
  check_nvrtc(api, api.nvrtcGetLoweredName(program, expression.c_str(), &lowered),
              "naming the compiled kernel");
  out.lowered_name = lowered;
  const bool ptx = target.rfind("compute_", 0) == 0;
  size_t size = 0;
  check_nvrtc(api,
              ptx ? api.nvrtcGetPTXSize(program, &size) : api.nvrtcGetCUBINSize(program, &size),
              "sizing the image");
  out.image.resize(size);
  check_nvrtc(api,
              ptx ? api.nvrtcGetPTX(program, out.image.data())
                  : api.nvrtcGetCUBIN(program, out.image.data()),
              "reading the image");
  out.compiled = true;
  return out;
}

}  // namespace

std::string nvrtc_version(const CudaApi& api) {
  int major = 0, minor = 0;
  check_nvrtc(api, api.nvrtcVersion(&major, &minor), "reporting its version");
  return std::to_string(major) + "." + std::to_string(minor);
}

std::string target_for(const CudaApi& api, int arch) {
  // The kernels' warp match instructions (__match_any_sync) start with Volta.
  FASTHOOKS_CHECK(arch >= 70, "fasthooks' CUDA kernels need sm_70 or later, not this GPU's sm_",
                  arch);
  const std::vector<int> archs = supported_archs(api);
  FASTHOOKS_CHECK(!archs.empty() && arch >= archs.front(), "fasthooks' CUDA kernels: NVRTC ",
                  nvrtc_version(api), " compiles for sm_", archs.empty() ? 0 : archs.front(),
                  " and later, not for this GPU's sm_", arch);
  for (const int known : archs) {
    if (known == arch) return "sm_" + std::to_string(arch);
  }
  int newest = archs.front();
  for (const int known : archs) {
    if (known < arch && known > newest) newest = known;
  }
  return "compute_" + std::to_string(newest);
}

KernelImage kernel_image(const CudaApi& api, const KernelCache& cache, const KernelVariant& v,
                         int arch, bool log, bool refresh) {
  const std::string& cache_dir = cache.dir;
  const std::string target = target_for(api, arch);
  const std::string version = nvrtc_version(api);
  char hash[17];
  std::snprintf(hash, sizeof(hash), "%016llx",
                static_cast<unsigned long long>(
                    fingerprint({kKernelSource, name_expression(v), target, version})));
  const std::string stem =
      cache_dir + "/" + variant_label(v) + "-" + target + "-nvrtc" + version + "-" + hash;
  const std::string path = stem + ".bin";
  KernelImage image;
  std::string contents;
  if (!refresh && read_file(path, contents) && parse(contents, image)) {
    image.path = path;
    return image;
  }
  const bool cached = make_directories(cache_dir);
  const FileLock lock(cached ? stem + ".lock" : std::string(), cache.lock_wait_seconds);
  // Another process may have compiled it while this one waited for the lock.
  if (!refresh && cached && read_file(path, contents) && parse(contents, image)) {
    image.path = path;
    return image;
  }
  if (lock.timed_out()) {
    std::fprintf(stderr,
                 "fasthooks: another process has been compiling the CUDA kernel %s for over %g s "
                 "(it holds %s.lock): compiling it here too\n",
                 variant_label(v).c_str(), cache.lock_wait_seconds, stem.c_str());
  }
  if (log) {
    std::fprintf(stderr, "fasthooks: compiling the CUDA kernel %s for %s with NVRTC %s, once\n",
                 variant_label(v).c_str(), target.c_str(), version.c_str());
  }
  image = compile(api, v, target);
  if (cached && write_atomically(path, serialise(image))) {
    image.path = path;
    return image;
  }
  static std::atomic<bool> said{false};
  if (!said.exchange(true)) {
    std::fprintf(stderr,
                 "fasthooks: could not write the CUDA kernel cache in %s (set FASTHOOKS_CACHE_DIR "
                 "to a writable directory): this process compiles its kernels for itself\n",
                 cache_dir.c_str());
  }
  return image;
}

}  // namespace cuda
}  // namespace fasthooks
