// Histogram bins: `bins` equal bins over [lo, hi]. The top edge belongs to the last bin; values
// outside the range, and NaN, belong to none (as torch.histc). Shared by the CPU and CUDA kernels;
// fasthooks/moments.py follows the same definition.
#pragma once

#include "device_base.h"

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

// Bins must be wide enough for a float32 first guess to land within one bin of the right one.
C10_HOST_DEVICE inline bool bins_resolvable(int64_t bins, double lo, double hi) {
  const double scale = fabs(lo) > fabs(hi) ? fabs(lo) : fabs(hi);
  return (hi - lo) / static_cast<double>(bins) >= ldexp(scale, -16);
}

// What a kernel needs to place a value: lower[k] is edge k rounded up for k in [0, bins), and
// lower[bins] is +inf, so that the step up from the last bin needs no bounds check.
template <typename Acc>
struct BinTable {
  const Acc* lower;
  Acc bottom;  // lower[0], kept beside the table: every value is compared with it
  Acc top;     // the top edge rounded down
  Acc lo;      // for the first guess of the bin
  Acc scale;   // bins / (hi - lo)
  int64_t bins;
};

template <typename Acc>
C10_HOST_DEVICE inline Acc lower_edge(int64_t k, int64_t bins, double lo, double hi) {
  return k == bins ? static_cast<Acc>(INFINITY) : round_up<Acc>(hist_edge(k, bins, lo, hi));
}

// The table over `lower` (edges from lower_edge) of `bins` bins over [lo, hi].
template <typename Acc>
C10_HOST_DEVICE inline BinTable<Acc> bin_table(const Acc* lower, int64_t bins, double lo,
                                               double hi) {
  return {lower,
          lower_edge<Acc>(0, bins, lo, hi),
          round_down<Acc>(hi),
          static_cast<Acc>(lo),
          static_cast<Acc>(bins / (hi - lo)),
          bins};
}

// The bin of v, or `bins` for a value that belongs to no bin. The first guess is within one bin
// of the right one (bins_resolvable); comparing with the exact edges settles it. No branch
// depends on where v falls. In int32: bins are at most a few thousand (fasthooks/layout.py).
template <typename Acc>
C10_HOST_DEVICE inline int32_t bin_of(Acc v, const BinTable<Acc>& t) {
  Acc guess = (v - t.lo) * t.scale;
  guess = guess > Acc(0) ? guess : Acc(0);  // NaN becomes 0 here
  const auto bins = static_cast<int32_t>(t.bins);
  const auto last = static_cast<Acc>(bins - 1);
  guess = guess < last ? guess : last;
  auto pos = static_cast<int32_t>(guess);
  pos -= v < t.lower[pos];  // -1 only for a value below the range
  pos += v >= t.lower[pos + 1];
  const int32_t keep = -static_cast<int32_t>((v >= t.bottom) & (v <= t.top));
  return (pos & keep) | (bins & ~keep);
}

}  // namespace fasthooks
