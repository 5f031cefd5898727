// The C++ name of the kernel instantiation a KernelVariant names, as NVRTC is asked for it
// (nvrtcAddNameExpression), and a file-name-safe description of it for the disk cache and logs.
#pragma once

#include <string>

#include "launch_plan.h"

namespace fasthooks {
namespace cuda {

inline const char* value_type_name(const KernelVariant& v) {
  constexpr const char* kNames[] = {"float", "double", "c10::Half", "c10::BFloat16"};
  return kNames[v.dtype];
}

inline std::string name_expression(const KernelVariant& v) {
  const auto flag = [](bool on) { return on ? "true" : "false"; };
  return std::string("&fasthooks::cuda::") +
         (v.list ? "accumulate_list_kernel<" : "accumulate_stats_kernel<") + value_type_name(v) +
         ", " + (sums_in_double(v) ? "double" : "float") + ", " + flag(v.full) + ", " +
         std::to_string(v.hist) + ", " + flag(v.diff) +
         (v.list ? std::string()
                 : std::string(", ") + flag(v.binades) + ", " + flag(v.top) + ", " +
                       flag(v.channels)) +
         ">";
}

// For example "bfloat16-list-full-hist" (bins per block), "float32-basic-threadhist" or
// "float16-full-binades-top-channels".
inline std::string variant_label(const KernelVariant& v) {
  constexpr const char* kDtypes[] = {"float32", "float64", "float16", "bfloat16"};
  std::string label = kDtypes[v.dtype];
  if (v.list) label += "-list";
  label += v.full ? "-full" : "-basic";
  if (v.hist == kBinsPerThread) label += "-threadhist";
  if (v.hist == kBinsPerBlock) label += "-hist";
  if (v.diff) label += "-diff";
  if (v.binades) label += "-binades";
  if (v.top) label += "-top";
  if (v.channels) label += "-channels";
  return label;
}

}  // namespace cuda
}  // namespace fasthooks
