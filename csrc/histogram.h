// Histogram bins: `bins` equal bins over [lo, hi]. The top edge belongs to the last bin; values
// outside the range, and NaN, belong to none (as torch.histc). Shared by the CPU and CUDA kernels;
// fasthooks/moments.py follows the same definition.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace fasthooks {

// Edge k of the bins in float64: the definition every backend follows exactly.
C10_HOST_DEVICE inline double hist_edge(int64_t k, int64_t bins, double lo, double hi) {
  return k == bins ? hi : lo + (hi - lo) * static_cast<double>(k) / static_cast<double>(bins);
}

C10_HOST_DEVICE inline float step(float r, float toward) { return nextafterf(r, toward); }
C10_HOST_DEVICE inline double step(double r, double toward) { return nextafter(r, toward); }

// The smallest Acc value >= e and the largest <= e: comparing an Acc value with them is exactly
// comparing it with the float64 edge.
template <typename Acc>
C10_HOST_DEVICE inline Acc round_up(double e) {
  const Acc r = static_cast<Acc>(e);
  return static_cast<double>(r) < e ? step(r, static_cast<Acc>(INFINITY)) : r;
}
template <typename Acc>
C10_HOST_DEVICE inline Acc round_down(double e) {
  const Acc r = static_cast<Acc>(e);
  return static_cast<double>(r) > e ? step(r, static_cast<Acc>(-INFINITY)) : r;
}

// What a kernel needs to place a value: lower[k] is edge k rounded up, for k in [0, bins).
template <typename Acc>
struct BinTable {
  const Acc* lower;
  Acc top;    // the top edge rounded down
  Acc lo;     // for the first guess of the bin
  Acc scale;  // bins / (hi - lo)
  int64_t bins;
};

// The bin of v, or `bins` for a value that belongs to no bin. The first guess can be off by
// rounding near an edge; comparing with the exact edges settles it.
template <typename Acc>
C10_HOST_DEVICE inline int64_t bin_of(Acc v, const BinTable<Acc>& t) {
  if (!(v >= t.lower[0] && v <= t.top)) return t.bins;
  const Acc guess = (v - t.lo) * t.scale;
  const Acc last = static_cast<Acc>(t.bins - 1);
  int64_t pos = static_cast<int64_t>(guess < last ? (guess > Acc(0) ? guess : Acc(0)) : last);
  while (pos > 0 && v < t.lower[pos]) --pos;
  while (pos + 1 < t.bins && v >= t.lower[pos + 1]) ++pos;
  return pos;
}

}  // namespace fasthooks
