// Argument checks shared by every backend of fasthooks::accumulate_stats, on torch's stable ABI.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace fasthooks {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// The message alone (torch's own check macro prefixes the C++ function, file and line).
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream message;
  (message << ... << args);
  throw std::runtime_error(message.str());
}

#define FASTHOOKS_CHECK(cond, ...)               \
  do {                                           \
    if (!(cond)) ::fasthooks::fail(__VA_ARGS__); \
  } while (false)

std::string shape_of(const Tensor& t);
std::string device_of(const Tensor& t);

// Whether the elements fill a block of memory without gaps or overlaps, in any order.
bool is_non_overlapping_and_dense(const Tensor& t);

// Checks every argument but the cursor's value, which is checked where it can be read. Returns
// whether every statistic is wanted (a 9-plane state with an extras buffer) or mean and std only.
bool check_accumulate_args(const Tensor& x, const Tensor& state, const Tensor& stats,
                           const Tensor& extra, const Tensor& hist, const Tensor& workspace,
                           const Tensor& cursor, int64_t slot, double hist_min, double hist_max);

}  // namespace fasthooks
