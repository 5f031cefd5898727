// Moments of a set of values and Chan's merge of two such sets; shared by the CPU and CUDA kernels.
#pragma once

#include <c10/macros/Macros.h>

namespace fasthooks {

struct Moments {
  double count;
  double mean;
  double m2;  // sum of squared deviations from the mean
};

// Moments from sums of (x - shift) and (x - shift)^2 over `count` values.
C10_HOST_DEVICE inline Moments moments_from_shifted_sums(double count, double shift, double s1,
                                                         double s2) {
  const double m2 = s2 - s1 * s1 / count;
  // Rounding can leave a tiny negative m2 for constant data; NaN must pass through untouched.
  return {count, shift + s1 / count, m2 < 0.0 ? 0.0 : m2};
}

// Chan's parallel combination. The mean is a weighted average so that an infinite mean stays
// infinite, as torch.mean does, rather than turning into inf - inf.
C10_HOST_DEVICE inline Moments merge(const Moments& a, const Moments& b) {
  if (b.count == 0.0) return a;
  if (a.count == 0.0) return b;
  const double count = a.count + b.count;
  const double delta = b.mean - a.mean;
  return {count, (a.count * a.mean + b.count * b.mean) / count,
          a.m2 + b.m2 + delta * delta * (a.count * b.count / count)};
}

}  // namespace fasthooks
