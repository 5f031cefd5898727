// The "binades" extra: how many values have each power-of-two exponent, read from the float's own
// exponent bits. Shared by the CPU and CUDA kernels; fasthooks/layout.py (BINADE_NAMES) names the
// bins and fasthooks/moments.py follows the same definition.
#pragma once

#include "device_base.h"

namespace fasthooks {

// Bin 0: zero. Bin 1: magnitudes below 2^kBinadeMin (float32's subnormals, smaller float64
// values). Bins 2 + e - kBinadeMin: magnitudes in [2^e, 2^(e + 1)) for e in [kBinadeMin,
// kBinadeMax], float32's normal exponents. Then finite magnitudes of 2^(kBinadeMax + 1) or more
// (float64 only), and last infinities and NaN.
constexpr int kBinadeMin = -126;
constexpr int kBinadeMax = 127;
constexpr int kBinadeBins = kBinadeMax - kBinadeMin + 5;
constexpr int kBinadeAbove = kBinadeBins - 2;
constexpr int kBinadeNonFinite = kBinadeBins - 1;

// The bin of a float32 value from its bits: a biased exponent E of 1 to 254 is binade E - 127,
// bin E + 1; E = 0 holds zero and the subnormals, E = 255 infinities and NaN.
C10_HOST_DEVICE inline int binade_of_bits(uint32_t bits) {
  const uint32_t magnitude = bits & 0x7fffffffu;
  const int exponent = static_cast<int>(magnitude >> 23);
  if (exponent == 0) return magnitude != 0u ? 1 : 0;
  return exponent == 255 ? kBinadeNonFinite : exponent + 1;
}

// The bin of a float64 value from its bits (biased by 1023, 11 bits).
C10_HOST_DEVICE inline int binade_of_bits(uint64_t bits) {
  const uint64_t magnitude = bits & 0x7fffffffffffffffull;
  const int exponent = static_cast<int>(magnitude >> 52);
  if (exponent == 2047) return kBinadeNonFinite;
  const int binade = exponent - 1023;
  if (binade < kBinadeMin) return magnitude != 0u ? 1 : 0;
  return binade > kBinadeMax ? kBinadeAbove : binade - kBinadeMin + 2;
}

// The bin of a float16 value from its bits (biased by 15, 5 bits): its subnormals m * 2^-24 are
// normal in float32, binade floor(log2(m)) - 24.
C10_HOST_DEVICE inline int binade_of_half_bits(uint32_t bits) {
  const uint32_t magnitude = bits & 0x7fffu;
  const int exponent = static_cast<int>(magnitude >> 10);
  if (exponent == 31) return kBinadeNonFinite;
  if (exponent != 0) return exponent - 15 - kBinadeMin + 2;
  if (magnitude == 0u) return 0;
  int top = 0;  // floor(log2(magnitude)), magnitude < 2^10
  for (uint32_t m = magnitude >> 1; m != 0u; m >>= 1) ++top;
  return top - 24 - kBinadeMin + 2;
}

// The bin of a bfloat16 value from its bits: the upper half of a float32's.
C10_HOST_DEVICE inline int binade_of_bfloat16_bits(uint32_t bits) {
  return binade_of_bits(static_cast<uint32_t>(bits << 16));
}

}  // namespace fasthooks
