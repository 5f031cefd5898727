#include "checks.h"

#include <cmath>

#include "histogram.h"
#include "stats.h"

namespace fasthooks {
namespace {

void check_buffer(const at::Tensor& t, const char* name, at::ScalarType dtype,
                  at::IntArrayRef shape) {
  TORCH_CHECK(t.scalar_type() == dtype && t.sizes() == shape && t.is_contiguous(),
              "accumulate_stats: ", name, " must be a contiguous ", dtype, " tensor of shape ",
              shape, ", got ", t.scalar_type(), " of shape ", t.sizes());
}

}  // namespace

bool check_accumulate_args(const at::Tensor& x, const at::Tensor& state, const at::Tensor& stats,
                           const at::Tensor& extra, const at::Tensor& hist,
                           const at::Tensor& workspace, const at::Tensor& cursor, int64_t slot,
                           double hist_min, double hist_max) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
      "accumulate_stats: x must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(state.scalar_type() == at::kDouble && state.dim() == 3 &&
                  (state.size(0) == kBasicPlanes || state.size(0) == kFullPlanes) &&
                  state.is_contiguous(),
              "accumulate_stats: state must be a contiguous float64 tensor of shape (3 or 9, "
              "modules, batches), got ",
              state.scalar_type(), " of shape ", state.sizes());
  const int64_t modules = state.size(1);
  const int64_t batches = state.size(2);
  const bool full = state.size(0) == kFullPlanes;
  check_buffer(stats, "stats", at::kFloat, {2, modules, batches});
  if (full) {
    check_buffer(extra, "extra", at::kFloat, {kExtraPlanes, modules, batches});
  } else {
    TORCH_CHECK(extra.numel() == 0, "accumulate_stats: extra must be empty with a 3-plane state, ",
                "got shape ", extra.sizes());
  }
  if (hist.numel() > 0) {
    TORCH_CHECK(hist.dim() == 3 && hist.size(2) > 0, "accumulate_stats: hist must have shape ",
                "(modules, batches, bins), got ", hist.sizes());
    check_buffer(hist, "hist", at::kLong, {modules, batches, hist.size(2)});
    TORCH_CHECK(std::isfinite(hist_min) && std::isfinite(hist_max) && hist_min < hist_max,
                "accumulate_stats: hist_min and hist_max must be finite with hist_min < hist_max, "
                "got ",
                hist_min, " and ", hist_max);
    TORCH_CHECK(bins_resolvable(hist.size(2), hist_min, hist_max),
                "accumulate_stats: ", hist.size(2), " bins over [", hist_min, ", ", hist_max,
                "] are narrower than 2^-16 of the range's magnitude");
  }
  TORCH_CHECK(cursor.scalar_type() == at::kLong && cursor.numel() == 1,
              "accumulate_stats: cursor must be a one-element int64 tensor, got ",
              cursor.scalar_type(), " of shape ", cursor.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"x", x},
                                {"stats", stats},
                                {"extra", extra},
                                {"hist", hist},
                                {"workspace", workspace},
                                {"cursor", cursor}}) {
    TORCH_CHECK(t.device() == state.device(), "accumulate_stats: ", name,
                " must be on the state's device ", state.device(), ", got ", t.device());
  }
  TORCH_CHECK(slot >= 0 && slot < modules, "accumulate_stats: slot must be in [0, ", modules,
              "), got ", slot);
  return full;
}

}  // namespace fasthooks
