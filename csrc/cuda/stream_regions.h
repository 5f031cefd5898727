// Which region of a run's CUDA workspace a call uses. Calls on one stream run one after another
// and can share a region; calls that can overlap must not, or their per-block partials mix and
// the finished-blocks counter of the region is left wrong for every later call. Each run's
// workspace gives every origin of calls it meets (a stream, eagerly or while a CUDA graph is
// captured on it) a region of its own, first come first served. Plain C++: the host harness of
// tests/cuda_on_cpu/ runs it too.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "../checks.h"

namespace fasthooks {
namespace cuda {

struct CallOrigin {
  uintptr_t stream;
  bool capturing;  // a graph's calls replay later, beside whatever runs then
  bool operator==(const CallOrigin& other) const {
    return stream == other.stream && capturing == other.capturing;
  }
};

class StreamRegions {
 public:
  explicit StreamRegions(int64_t regions) : regions_(regions) {}

  int64_t region_of(const void* workspace, CallOrigin origin) {
    const std::lock_guard<std::mutex> lock(mutex_);
    std::vector<CallOrigin>& seen = seen_[workspace];
    for (size_t i = 0; i < seen.size(); ++i) {
      if (seen[i] == origin) return static_cast<int64_t>(i);
    }
    FASTHOOKS_CHECK(static_cast<int64_t>(seen.size()) < regions_,
                    "accumulate_stats: one run's hooks were called from more than ", regions_,
                    " CUDA streams (a stream capturing a CUDA graph counts apart from its eager "
                    "calls); hook the modules of each further stream with an ActivationStats of "
                    "its own");
    seen.push_back(origin);
    return static_cast<int64_t>(seen.size()) - 1;
  }

 private:
  const int64_t regions_;
  std::mutex mutex_;
  // By the workspace's address: a workspace freed and reallocated at the same address keeps the
  // table, which still gives distinct origins distinct regions.
  std::unordered_map<const void*, std::vector<CallOrigin>> seen_;
};

}  // namespace cuda
}  // namespace fasthooks
