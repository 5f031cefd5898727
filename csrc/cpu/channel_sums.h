// Per-channel running sums on the CPU (channels.h): each thread adds the values of its chunks,
// while they are in cache, to sums of its own (channel_sums_impl.h, in each instruction set's
// kernels), which are added to the module's row once.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../channels.h"
#include "../top.h"

namespace fasthooks {

// A value as float64, exactly: 16-bit values through float.
template <typename T>
double widened(T v) {
  if constexpr (std::is_same_v<T, double>) {
    return v;
  } else {
    return static_cast<float>(v);
  }
}

// One thread's sums of one call: plane p of channel c at plane(p)[c], channels counted from 0.
// The count plane stays 0: every channel of a call has numel / channels values.
class ChannelSums {
 public:
  explicit ChannelSums(int64_t channels)
      : channels_(channels), planes_(static_cast<size_t>(kChannelPlanes * channels)) {}
  double* plane(int p) { return planes_.data() + p * channels_; }
  const double* plane(int p) const { return planes_.data() + p * channels_; }
  int64_t channels() const { return channels_; }

  // Adds another thread's sums to these.
  void add(const ChannelSums& other) {
    for (int p = kChannelSum; p < kChannelPlanes; ++p) {
      double* to = plane(p);
      const double* from = other.plane(p);
      for (int64_t c = 0; c < channels_; ++c) {
        to[c] = p == kChannelAbsmax ? nan_max(from[c], to[c]) : to[c] + from[c];
      }
    }
  }

  // Adds these sums, and each channel's `per_channel` values to its count, to the planes of
  // `room` doubles each at `planes`, from channel `offset`.
  void add_to_planes(double* planes, int64_t room, int64_t offset, double per_channel) const {
    for (int p = 0; p < kChannelPlanes; ++p) {
      double* to = planes + p * room + offset;
      const double* from = plane(p);
      for (int64_t c = 0; c < channels_; ++c) {
        if (p == kChannelCount) {
          to[c] += per_channel;
        } else {
          to[c] = p == kChannelAbsmax ? nan_max(from[c], to[c]) : to[c] + from[c];
        }
      }
    }
  }

 private:
  int64_t channels_;
  std::vector<double> planes_;
};

}  // namespace fasthooks
