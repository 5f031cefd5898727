#include "checks.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "binades.h"
#include "channels.h"
#include "histogram.h"
#include "stats.h"

namespace fasthooks {
namespace {

std::string shape_string(std::initializer_list<int64_t> shape) {
  std::string out = "[";
  for (const int64_t* s = shape.begin(); s != shape.end(); ++s) {
    out += text(s == shape.begin() ? "" : ", ", *s);
  }
  return out + "]";
}

void check_buffer(const Tensor& t, const char* name, ScalarType dtype,
                  std::initializer_list<int64_t> shape) {
  const auto sizes = t.sizes();
  const bool same_shape = std::equal(sizes.begin(), sizes.end(), shape.begin(), shape.end());
  // The message is formatted only on failure: these checks run on every hooked call.
  FASTHOOKS_CHECK(dtype_of(t) == dtype && same_shape && t.is_contiguous(),
                  "accumulate_stats: ", name, " must be a contiguous ", dtype, " tensor of shape ",
                  shape_string(shape), ", got ", t.scalar_type(), " of shape ", shape_of(t));
}

void check_shim(AOTITorchError status) {
  FASTHOOKS_CHECK(status == AOTI_TORCH_SUCCESS, "accumulate_stats: reading a tensor failed");
}

}  // namespace

ScalarType dtype_of(const Tensor& t) {
  static const std::pair<int32_t, ScalarType> known[] = {
      {aoti_torch_dtype_float32(), ScalarType::Float},
      {aoti_torch_dtype_float64(), ScalarType::Double},
      {aoti_torch_dtype_float16(), ScalarType::Half},
      {aoti_torch_dtype_bfloat16(), ScalarType::BFloat16},
      {aoti_torch_dtype_int64(), ScalarType::Long},
      {aoti_torch_dtype_int32(), ScalarType::Int}};
  int32_t code = 0;
  check_shim(aoti_torch_get_dtype(t.get(), &code));
  for (const auto& [known_code, dtype] : known) {
    if (code == known_code) return dtype;
  }
  return t.scalar_type();
}

Place place_of(const Tensor& t) {
  Place place{};
  check_shim(aoti_torch_get_device_type(t.get(), &place.type));
  check_shim(aoti_torch_get_device_index(t.get(), &place.index));
  return place;
}

std::string shape_of(const Tensor& t) {
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) out += text(d ? ", " : "", t.size(d));
  return out + "]";
}

std::string device_of(const Tensor& t) {
  const auto device = t.device();
  std::string name = device.is_cpu() ? "cpu" : device.is_cuda() ? "cuda" : "another device";
  if (device.has_index() && !device.is_cpu()) name += ":" + std::to_string(device.index());
  return name;
}

namespace {

bool is_non_overlapping_and_dense(const Tensor& t) {
  if (t.is_contiguous()) return true;
  const int64_t dims = t.dim();
  std::vector<int64_t> order(dims);
  std::iota(order.begin(), order.end(), 0);
  // Sizes of 1 may carry any stride; order the others by stride and require them to tile.
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::pair(t.size(a) != 1, t.stride(a)) < std::pair(t.size(b) != 1, t.stride(b));
  });
  int64_t expected = 1;
  for (const int64_t d : order) {
    if (t.size(d) == 1) continue;
    if (t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

}  // namespace

Tensor dense_values(const Tensor& x) {
  return is_non_overlapping_and_dense(x) ? x : torch::stable::contiguous(x);
}

namespace {

// No more tensors than slots, and bases empty or one per tensor.
void check_list_lengths(const std::vector<Tensor>& xs, const std::vector<Tensor>& bases,
                        const Tensor& state) {
  FASTHOOKS_CHECK(state.dim() == 3 && static_cast<int64_t>(xs.size()) <= state.size(1),
                  "accumulate_stats_list: xs has ", xs.size(),
                  " tensors, more than the state's slots (", state.dim() == 3 ? state.size(1) : 0,
                  ")");
  FASTHOOKS_CHECK(bases.empty() || bases.size() == xs.size(),
                  "accumulate_stats_list: bases must be empty or hold one tensor per xs, got ",
                  bases.size(), " for ", xs.size());
  FASTHOOKS_CHECK(bases.empty() || xs.empty() || state.size(0) == kFullPlanes,
                  "accumulate_stats_list: differences from bases need every statistic (a 9-plane "
                  "state), got a ",
                  state.size(0), "-plane state");
}

}  // namespace

DensePair dense_pair(const Tensor& x, const Tensor& base, size_t index) {
  const auto sizes = x.sizes();
  const auto base_sizes = base.sizes();
  FASTHOOKS_CHECK(dtype_of(base) == dtype_of(x) && place_of(base) == place_of(x) &&
                      std::equal(sizes.begin(), sizes.end(), base_sizes.begin(), base_sizes.end()),
                  "accumulate_stats_list: bases[", index, "] must match xs[", index,
                  "] in dtype, shape and device: got ", base.scalar_type(), " of shape ",
                  shape_of(base), " on ", device_of(base), " for ", x.scalar_type(), " of shape ",
                  shape_of(x), " on ", device_of(x));
  const auto strides = x.strides();
  const auto base_strides = base.strides();
  const bool same_order =
      std::equal(strides.begin(), strides.end(), base_strides.begin(), base_strides.end());
  if (same_order && is_non_overlapping_and_dense(x)) return {x, base};
  return {torch::stable::contiguous(x), torch::stable::contiguous(base)};
}

bool check_accumulate_args(const Tensor& x, const Tensor& state, const Tensor& stats,
                           const Tensor& extra, const Tensor& hist, const Tensor* binades,
                           const Tensor& workspace, const Tensor& cursor, int64_t slot,
                           double hist_min, double hist_max) {
  const auto dtype = dtype_of(x);
  FASTHOOKS_CHECK(dtype == ScalarType::Float || dtype == ScalarType::Double ||
                      dtype == ScalarType::Half || dtype == ScalarType::BFloat16,
                  "accumulate_stats: x must be float32, float64, float16 or bfloat16, got ", dtype);
  FASTHOOKS_CHECK(dtype_of(state) == ScalarType::Double && state.dim() == 3 &&
                      (state.size(0) == kBasicPlanes || state.size(0) == kFullPlanes) &&
                      state.is_contiguous(),
                  "accumulate_stats: state must be a contiguous float64 tensor of shape (3 or 9, "
                  "modules, batches), got ",
                  state.scalar_type(), " of shape ", shape_of(state));
  const int64_t modules = state.size(1);
  const int64_t batches = state.size(2);
  const bool full = state.size(0) == kFullPlanes;
  check_buffer(stats, "stats", ScalarType::Float, {2, modules, batches});
  if (full) {
    check_buffer(extra, "extra", ScalarType::Float, {kExtraPlanes, modules, batches});
  } else {
    FASTHOOKS_CHECK(extra.numel() == 0,
                    "accumulate_stats: extra must be empty with a 3-plane state, got shape ",
                    shape_of(extra));
  }
  if (hist.numel() > 0) {
    FASTHOOKS_CHECK(hist.dim() == 3 && hist.size(2) > 0,
                    "accumulate_stats: hist must have shape (modules, batches, bins), got ",
                    shape_of(hist));
    check_buffer(hist, "hist", ScalarType::Long, {modules, batches, hist.size(2)});
    FASTHOOKS_CHECK(std::isfinite(hist_min) && std::isfinite(hist_max) && hist_min < hist_max,
                    "accumulate_stats: hist_min and hist_max must be finite with hist_min < "
                    "hist_max, got ",
                    hist_min, " and ", hist_max);
    // Values of a reduced-precision input are binned in float: its range must hold the edges.
    constexpr double kFloatMax = std::numeric_limits<float>::max();
    FASTHOOKS_CHECK(dtype == ScalarType::Double ||
                        (std::fabs(hist_min) <= kFloatMax && std::fabs(hist_max) <= kFloatMax &&
                         hist_max - hist_min <= kFloatMax),
                    "accumulate_stats: hist_min and hist_max must lie within float32's range "
                    "and at most ",
                    kFloatMax, " apart for ", dtype, " input, got ", hist_min, " and ", hist_max);
    FASTHOOKS_CHECK(bins_resolvable(hist.size(2), hist_min, hist_max),
                    "accumulate_stats: ", hist.size(2), " bins over [", hist_min, ", ", hist_max,
                    "] are narrower than 2^-16 of the range's magnitude");
  }
  if (binades != nullptr && binades->numel() > 0) {
    check_buffer(*binades, "binades", ScalarType::Int, {modules, batches, kBinadeBins});
    FASTHOOKS_CHECK(place_of(*binades) == place_of(state),
                    "accumulate_stats: binades must be on the state's device ", device_of(state),
                    ", got ", device_of(*binades));
  }
  FASTHOOKS_CHECK(dtype_of(cursor) == ScalarType::Long && cursor.numel() == 1,
                  "accumulate_stats: cursor must be a one-element int64 tensor, got ",
                  cursor.scalar_type(), " of shape ", shape_of(cursor));
  const Place place = place_of(state);
  for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"x", &x},
                                {"stats", &stats},
                                {"extra", &extra},
                                {"hist", &hist},
                                {"workspace", &workspace},
                                {"cursor", &cursor}}) {
    FASTHOOKS_CHECK(place_of(*t) == place, "accumulate_stats: ", name,
                    " must be on the state's device ", device_of(state), ", got ", device_of(*t));
  }
  FASTHOOKS_CHECK(slot >= 0 && slot < modules, "accumulate_stats: slot must be in [0, ", modules,
                  "), got ", slot);
  return full;
}

CheckedList check_list(const std::vector<Tensor>& xs, const std::vector<Tensor>& bases,
                       const Tensor& state, const Tensor& stats, const Tensor& extra,
                       const Tensor& hist, const Tensor& workspace, const Tensor& cursor,
                       double hist_min, double hist_max) {
  check_list_lengths(xs, bases, state);
  CheckedList checked{false, {}, {}};
  for (size_t i = 0; i < xs.size(); ++i) {
    checked.full = check_accumulate_args(xs[i], state, stats, extra, hist, nullptr, workspace,
                                         cursor, static_cast<int64_t>(i), hist_min, hist_max);
    if (bases.empty()) {
      checked.xs.push_back(dense_values(xs[i]));
    } else {
      DensePair pair = dense_pair(xs[i], bases[i], i);
      checked.xs.push_back(pair.x);
      checked.bases.push_back(pair.base);
    }
  }
  return checked;
}

namespace {

// channel_dim a dimension of x and channel_offset at least 0; returns x's channel count.
int64_t check_channel_args(const Tensor& x, int64_t channel_dim, int64_t channel_offset) {
  const int64_t dims = x.dim() > 0 ? x.dim() : 1;
  FASTHOOKS_CHECK(channel_dim >= -dims && channel_dim < dims,
                  "accumulate_stats: channel_dim must be in [", -dims, ", ", dims,
                  ") for x of shape ", shape_of(x), ", got ", channel_dim);
  FASTHOOKS_CHECK(channel_offset >= 0, "accumulate_stats: channel_offset must be at least 0, got ",
                  channel_offset);
  if (x.dim() == 0) return 1;
  return x.size(channel_dim < 0 ? channel_dim + x.dim() : channel_dim);
}

}  // namespace

void check_top(const Tensor& top, const Tensor& x, const Tensor& state, int64_t channel_dim,
               int64_t channel_offset) {
  if (top.numel() == 0) return;
  FASTHOOKS_CHECK(top.dim() == 4 && top.size(2) >= 1 && top.size(2) <= kMaxTopK,
                  "accumulate_stats: top must have shape (modules, batches, k, 2) with k in [1, ",
                  kMaxTopK, "], got ", shape_of(top));
  check_buffer(top, "top", ScalarType::Double, {state.size(1), state.size(2), top.size(2), 2});
  FASTHOOKS_CHECK(place_of(top) == place_of(state),
                  "accumulate_stats: top must be on the state's device ", device_of(state),
                  ", got ", device_of(top));
  check_channel_args(x, channel_dim, channel_offset);
}

void check_channels(const Tensor& channels, const Tensor& x, const Tensor& state,
                    int64_t channel_dim, int64_t channel_offset, int64_t channel_region) {
  if (channels.numel() == 0) return;
  FASTHOOKS_CHECK(channel_region >= 0, "accumulate_stats: channel_region must be at least 0, got ",
                  channel_region);
  FASTHOOKS_CHECK(channels.dim() == 2, "accumulate_stats: channels must have shape (",
                  kChannelPlanes, ", channels), got ", shape_of(channels));
  check_buffer(channels, "channels", ScalarType::Double, {kChannelPlanes, channels.size(1)});
  FASTHOOKS_CHECK(place_of(channels) == place_of(state),
                  "accumulate_stats: channels must be on the state's device ", device_of(state),
                  ", got ", device_of(channels));
  const int64_t size = check_channel_args(x, channel_dim, channel_offset);
  FASTHOOKS_CHECK(channel_region + channel_offset + size <= channels.size(1),
                  "accumulate_stats: channels has room for ", channels.size(1),
                  " channels, x of shape ", shape_of(x), " has ", size, " along channel_dim ",
                  channel_dim, " from channel_region ", channel_region, " + channel_offset ",
                  channel_offset);
}

ChannelMap channel_map(const Tensor& dense, int64_t channel_dim, int64_t channel_offset) {
  if (dense.dim() == 0) return {1, 1, channel_offset};
  const int64_t dim = channel_dim < 0 ? channel_dim + dense.dim() : channel_dim;
  const int64_t size = dense.size(dim);
  // A dimension of one channel may have any stride; every position is its channel 0.
  return {size > 1 ? dense.stride(dim) : 1, size > 0 ? size : 1, channel_offset};
}

bool check_call_order(const Tensor& order, const Tensor& clock, const Tensor& state) {
  if (order.numel() == 0) return false;
  check_buffer(order, "order", ScalarType::Long, {2, state.size(1), state.size(2)});
  FASTHOOKS_CHECK(dtype_of(clock) == ScalarType::Long && clock.numel() == 1,
                  "accumulate_stats: clock must be a one-element int64 tensor, got ",
                  clock.scalar_type(), " of shape ", shape_of(clock));
  const Place place = place_of(state);
  FASTHOOKS_CHECK(place_of(order) == place && place_of(clock) == place,
                  "accumulate_stats: order and clock must be on the state's device ",
                  device_of(state), ", got ", device_of(order), " and ", device_of(clock));
  return true;
}

}  // namespace fasthooks
