// The top_k option: per slot the k values of largest magnitude and their channel indices, kept as
// (value, channel) float64 pairs. Shared by the CPU and CUDA kernels; fasthooks/moments.py
// (top_of) follows the same order.
#pragma once

#include "device_base.h"

namespace fasthooks {

constexpr int kMaxTopK = 16;

// One kept value and the channel it came from; an empty pair is NaN.
struct TopPair {
  double value;
  double channel;
};

// Whether v's sign bit is set (-0.0 among them), in code that both compilers take.
C10_HOST_DEVICE inline bool signbit_of(double v) { return v < 0 || (v == 0 && 1.0 / v < 0); }

// Whether a ranks before b: larger magnitude first; of equal magnitude, a positive sign (the sign
// bit clear) first; then the lower channel. A NaN value ranks after every other. A total order on
// (value, channel), so a merge of the tops of parts in any order gives the top of the whole.
C10_HOST_DEVICE inline bool ranks_before(const TopPair& a, const TopPair& b) {
  if (b.value != b.value) return a.value == a.value;
  if (a.value != a.value) return false;
  const double ma = a.value < 0 ? -a.value : a.value;
  const double mb = b.value < 0 ? -b.value : b.value;
  if (ma != mb) return ma > mb;
  const bool na = signbit_of(a.value);
  const bool nb = signbit_of(b.value);
  if (na != nb) return nb;
  return a.channel < b.channel;
}

// Offers p to a list of k pairs ordered by ranks_before: p takes its place, and the last pair
// drops out, when p ranks before it.
C10_HOST_DEVICE inline void offer_top(TopPair* list, int k, const TopPair& p) {
  if (!ranks_before(p, list[k - 1])) return;
  int i = k - 1;
  for (; i > 0 && ranks_before(p, list[i - 1]); --i) list[i] = list[i - 1];
  list[i] = p;
}

// The channel of the value at position i of a tensor read in memory order, for a channel
// dimension of `size` channels `stride` elements apart: every dense layout (contiguous, channels
// last, any permutation) holds coordinate (i / stride) % size along that dimension, counted from
// `offset` (where a DTensor's local piece starts in the whole tensor).
struct ChannelMap {
  int64_t stride;
  int64_t size;
  int64_t offset;
  C10_HOST_DEVICE int64_t channel(int64_t i) const { return (i / stride) % size + offset; }
};

}  // namespace fasthooks
