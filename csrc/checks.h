// Argument checks shared by every backend of fasthooks::accumulate_stats, on torch's stable ABI.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "top.h"

namespace fasthooks {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// Messages are built with std::string, not std::ostringstream: under C++20 its str() is a
// libstdc++ 11 symbol, which older distributions' libstdc++ (manylinux_2_28's) lacks.
inline void append(std::string& out, const std::string& v) { out += v; }
inline void append(std::string& out, const char* v) { out += v; }
inline void append(std::string& out, char v) { out += v; }
inline void append(std::string& out, ScalarType v) { out += torch::headeronly::toString(v); }
inline void append(std::string& out, double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  out += text;
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& out, T v) {
  out += std::to_string(v);
}

template <typename... Args>
std::string text(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

// The message alone (torch's own check macro prefixes the C++ function, file and line).
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw std::runtime_error(text(args...));
}

#define FASTHOOKS_CHECK(cond, ...)               \
  do {                                           \
    if (!(cond)) ::fasthooks::fail(__VA_ARGS__); \
  } while (false)

// t's dtype when it is one the operator uses, read as the C shim's code: torch::stable's
// scalar_type() translates that code through a chain of shim calls, too slow for checks that run
// on every hooked call. Any other dtype takes that slow path.
ScalarType dtype_of(const Tensor& t);

// Where t lives, as the C shim's device type and index (compared without translating them).
struct Place {
  int32_t type;
  int32_t index;
  bool operator==(const Place& other) const { return type == other.type && index == other.index; }
};
Place place_of(const Tensor& t);

std::string shape_of(const Tensor& t);
std::string device_of(const Tensor& t);

// x itself when its elements fill a block of memory without gaps or overlaps, in any order
// (statistics ignore element order, so channels_last is read in place), else a contiguous copy.
Tensor dense_values(const Tensor& x);

// For the difference of x and base (base's values subtracted from x's): base checked against x
// (same dtype, shape and device), and the two read in one order: in place where their strides
// agree and fill memory without gaps, else both as contiguous copies. `index` names them in errors.
struct DensePair {
  Tensor x;
  Tensor base;
};
DensePair dense_pair(const Tensor& x, const Tensor& base, size_t index);

// accumulate_stats_list's tensors, every one checked before any is counted (check_list_lengths,
// check_accumulate_args, dense_pair), as they are read: xs[i] alone, or with bases[i].
struct CheckedList {
  bool full;
  std::vector<Tensor> xs;
  std::vector<Tensor> bases;
};
CheckedList check_list(const std::vector<Tensor>& xs, const std::vector<Tensor>& bases,
                       const Tensor& state, const Tensor& stats, const Tensor& extra,
                       const Tensor& hist, const Tensor& workspace, const Tensor& cursor,
                       double hist_min, double hist_max);

// Checks every argument but the cursor's value, which is checked where it can be read (binades
// null for the list operator, which keeps none). Returns whether every statistic is wanted (a
// 9-plane state with an extras buffer) or mean and std only.
bool check_accumulate_args(const Tensor& x, const Tensor& state, const Tensor& stats,
                           const Tensor& extra, const Tensor& hist, const Tensor* binades,
                           const Tensor& workspace, const Tensor& cursor, int64_t slot,
                           double hist_min, double hist_max);

// The top buffer (top.h): empty keeps none; else float64 (modules, batches, k, 2) for k in
// [1, kMaxTopK] on the state's device, with channel_dim a dimension of x (negative from the end;
// 0 or -1 for a 0-d x).
// channel_offset, where channel 0 of x lies in a whole tensor, at least 0.
void check_top(const Tensor& top, const Tensor& x, const Tensor& state, int64_t channel_dim,
               int64_t channel_offset);

// The running per-channel sums (channels.h): empty keeps none; else float64
// (kChannelPlanes, room) on the state's device, with room for x's channels
// along channel_dim from channel_region + channel_offset (channel_dim and channel_offset as for
// check_top; channel_region, where the module's channels start, at least 0).
void check_channels(const Tensor& channels, const Tensor& x, const Tensor& state,
                    int64_t channel_dim, int64_t channel_offset, int64_t channel_region);

// Where the channels of a dense tensor (dense_values) lie in its memory order, along
// channel_dim from channel_offset (checked by check_top or check_channels); one channel for a
// 0-d tensor.
ChannelMap channel_map(const Tensor& dense, int64_t channel_dim, int64_t channel_offset);

// The call-order buffer and the call clock (stats.h, note_call_order): an empty order keeps none;
// else int64 (2, modules, batches) beside a one-element int64 clock, both on the state's device.
// Returns whether the call order is kept.
bool check_call_order(const Tensor& order, const Tensor& clock, const Tensor& state);

}  // namespace fasthooks
