// The statistics of a set of values, how two such sets merge, and how a merged set is read out.
// Shared by the CPU and CUDA kernels; the plane order mirrors fasthooks/layout.py.
#pragma once

#include "device_base.h"

namespace fasthooks {

// Planes of the float64 merge state. Mean and std need only the first three.
enum StatePlane : int64_t { kCount, kMean, kM2, kM3, kM4, kMin, kMax, kNearZero, kNonFinite };
constexpr int64_t kBasicPlanes = 3;
constexpr int64_t kFullPlanes = 9;
// Planes of the finalised float32 extras buffer ("nonfinite" is read from the state, exactly).
enum ExtraPlane : int64_t { kExtraMin, kExtraMax, kExtraNearZero, kExtraKurtosis };
constexpr int64_t kExtraPlanes = 4;
// Their names, in plane order, as fasthooks/layout.py spells them (a test compares the two).
constexpr const char* kStatePlaneNames[kFullPlanes] = {
    "count", "mean", "m2", "m3", "m4", "min", "max", "near_zero", "nonfinite"};
constexpr const char* kExtraPlaneNames[kExtraPlanes] = {"min", "max", "near_zero", "kurtosis"};

struct Stats {
  double count = 0.0;
  double mean = 0.0;
  double m2 = 0.0;  // sums of the 2nd to 4th powers of the deviations from the mean
  double m3 = 0.0;
  double m4 = 0.0;
  double min = INFINITY;  // NaN once a NaN was seen, as torch.amin
  double max = -INFINITY;
  double near_zero = 0.0;  // how many values were <= the near-zero threshold
  double nonfinite = 0.0;
};

C10_HOST_DEVICE inline double nan_min(double a, double b) {
  return (a != a || b != b) ? NAN : (a < b ? a : b);
}
C10_HOST_DEVICE inline double nan_max(double a, double b) {
  return (a != a || b != b) ? NAN : (a > b ? a : b);
}

// Central moments of `count` values from their power sums s1..s4 about `shift`.
template <bool Full>
C10_HOST_DEVICE inline void moments_from_shifted_sums(Stats& s, double count, double shift,
                                                      double s1, double s2, double s3, double s4) {
  const double d = s1 / count;
  s.count = count;
  s.mean = shift + d;
  const double m2 = s2 - s1 * d;
  // Rounding can leave a tiny negative m2 for constant data; NaN must pass through untouched.
  s.m2 = m2 < 0.0 ? 0.0 : m2;
  if (Full) {
    s.m3 = s3 - 3.0 * d * s2 + 2.0 * count * d * d * d;
    const double m4 = s4 - 4.0 * d * s3 + 6.0 * d * d * s2 - 3.0 * count * d * d * d * d;
    s.m4 = m4 < 0.0 ? 0.0 : m4;
  }
}

// Whether the powers of a set's deviations from its mean leave the normal range of Acc, the type
// they are summed in: a spread this small puts the 4th powers (or, for mean and std only, the
// squares) within 2^24 of the smallest normal number, where they lose their digits and then
// underflow (a float gradient of 1e-11 has 4th powers near 1e-44).
template <typename Acc, bool Full>
C10_HOST_DEVICE inline bool spread_underflows(const Stats& s, double count) {
  constexpr int kPower = Full ? 4 : 2;
  constexpr int kExponent = (std::numeric_limits<Acc>::min_exponent + 24) * 2 / kPower;
  return s.m2 < count * ldexp(1.0, kExponent) && s.mean - s.mean == 0.0;
}

// Pairwise combination of central moments up to the 4th (Chan; Pebay for m3 and m4), extremes
// and counts. The mean is a weighted average so that an infinite mean stays infinite, as
// torch.mean does, rather than turning into inf - inf.
template <bool Full>
C10_HOST_DEVICE inline Stats merge(const Stats& a, const Stats& b) {
  if (b.count == 0.0) return a;
  if (a.count == 0.0) return b;
  Stats s;
  const double na = a.count;
  const double nb = b.count;
  const double n = na + nb;
  const double delta = b.mean - a.mean;
  const double ab = na * nb / n;
  s.count = n;
  s.mean = (na * a.mean + nb * b.mean) / n;
  s.m2 = a.m2 + b.m2 + delta * delta * ab;
  if (Full) {
    const double d_n = delta / n;
    s.m3 = a.m3 + b.m3 + delta * delta * d_n * ab * (na - nb) + 3.0 * d_n * (na * b.m2 - nb * a.m2);
    s.m4 = a.m4 + b.m4 + delta * delta * d_n * d_n * ab * (na * na - na * nb + nb * nb) +
           6.0 * d_n * d_n * (na * na * b.m2 + nb * nb * a.m2) +
           4.0 * d_n * (na * b.m3 - nb * a.m3);
    s.min = nan_min(a.min, b.min);
    s.max = nan_max(a.max, b.max);
    s.near_zero = a.near_zero + b.near_zero;
    s.nonfinite = a.nonfinite + b.nonfinite;
  }
  return s;
}

// Where one (module, batch) slot lives in the state, stats and extras buffers.
struct SlotPointers {
  double* state;
  int64_t state_plane;  // elements between two planes of the state
  float* stats;
  int64_t stats_plane;
  float* extra;  // null without extras
};

// The state planes of a set of values, `plane` elements apart (only the first three without
// extras): the slot's merge state, or any array of them.
template <bool Full>
C10_HOST_DEVICE inline Stats load_state(const double* state, int64_t plane) {
  Stats s;
  s.count = state[kCount * plane];
  s.mean = state[kMean * plane];
  s.m2 = state[kM2 * plane];
  if (Full) {
    s.m3 = state[kM3 * plane];
    s.m4 = state[kM4 * plane];
    s.min = state[kMin * plane];
    s.max = state[kMax * plane];
    s.near_zero = state[kNearZero * plane];
    s.nonfinite = state[kNonFinite * plane];
  }
  return s;
}

template <bool Full>
C10_HOST_DEVICE inline void store_state(double* state, int64_t plane, const Stats& s) {
  state[kCount * plane] = s.count;
  state[kMean * plane] = s.mean;
  state[kM2 * plane] = s.m2;
  if (Full) {
    state[kM3 * plane] = s.m3;
    state[kM4 * plane] = s.m4;
    state[kMin * plane] = s.min;
    state[kMax * plane] = s.max;
    state[kNearZero * plane] = s.near_zero;
    state[kNonFinite * plane] = s.nonfinite;
  }
}

template <bool Full>
C10_HOST_DEVICE inline Stats load_slot(const SlotPointers& p) {
  return load_state<Full>(p.state, p.state_plane);
}

// Stores the merge state and writes every finalised statistic of the slot.
template <bool Full>
C10_HOST_DEVICE inline void store_slot(const SlotPointers& p, const Stats& s) {
  store_state<Full>(p.state, p.state_plane, s);
  const bool any = s.count > 0.0;
  const bool several = s.count > 1.0;
  p.stats[0] = any ? static_cast<float>(s.mean) : NAN;
  p.stats[p.stats_plane] = several ? static_cast<float>(sqrt(s.m2 / (s.count - 1.0))) : NAN;
  if (Full) {
    const int64_t plane = p.stats_plane;
    p.extra[kExtraMin * plane] = any ? static_cast<float>(s.min) : NAN;
    p.extra[kExtraMax * plane] = any ? static_cast<float>(s.max) : NAN;
    p.extra[kExtraNearZero * plane] = any ? static_cast<float>(s.near_zero / s.count) : NAN;
    // m4 / m2^2 of the population moments; undefined without spread.
    p.extra[kExtraKurtosis * plane] =
        several && s.m2 > 0.0 ? static_cast<float>(s.count * s.m4 / (s.m2 * s.m2)) : NAN;
  }
}

// The call order a run keeps (fasthooks/layout.py's ORDER_PLANES), an int64 (2, modules, batches)
// buffer beside the statistics: for each slot, 1 + the clock of the module's first call in that
// batch whose values held a NaN or an infinity (0: none yet), and how many they were (-1 with
// mean and std only, where a non-finite mean is what tells). `position` is the device's call
// clock as this call took it.
template <bool Full>
C10_HOST_DEVICE inline void note_call_order(int64_t* first, int64_t plane, int64_t position,
                                            const Stats& call) {
  const bool nonfinite = Full ? call.nonfinite > 0.0 : !(call.mean - call.mean == 0.0);
  if (!nonfinite || first[0] != 0) return;
  first[0] = position + 1;
  first[plane] = Full ? static_cast<int64_t>(call.nonfinite) : -1;
}

}  // namespace fasthooks
