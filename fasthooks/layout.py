"""The set of statistics and the layout of their buffers: the one place every backend reads.

For `modules` hooked modules and a capacity of `batches` columns, a run owns, on the
activations' device:

- `state`, float64 `(planes, modules, batches)`: the merge state of every (module, batch) slot,
  `STATE_PLANES[:BASIC_PLANES]` when only mean and std are asked for, all of `STATE_PLANES`
  with extras;
- `stats`, float32 `(2, modules, batches)`: mean and unbiased std, finalised on every call;
- `extra`, float32 `(len(EXTRA_PLANES), modules, batches)` with extras, else empty: finalised
  min, max, near-zero fraction and kurtosis (the non-finite count is the state's own plane);
- `hist`, int64 `(modules, batches, bins)` with a histogram, else empty;
- `binades`, int32 `(modules, batches, BINADE_BINS)` with the "binades" extra, else empty: how
  many values have each power-of-two exponent (`BINADE_NAMES`);
- `top`, float64 `(modules, batches, k, 2)` with `top_k=k`, else empty: the k values of largest
  magnitude of each slot and their channels, as (value, channel) pairs in the order of
  `moments.top_of`; NaN pairs where a slot holds fewer than k values that are not NaN;
- `channels`, float64 `(len(CHANNEL_PLANES), room)` with channel statistics, else empty: not
  per batch or module but running sums over every call since they were last cleared, per
  channel (the coordinate along the channel dimension plus the operator's `channel_region`,
  where the module's region of the one buffer starts, and `channel_offset`): how many values,
  their sum, their sum of squares, their largest magnitude (NaN once a NaN was seen) and how
  many have a magnitude above `near_zero`;
- `order`, int64 `(len(ORDER_PLANES), modules, batches)`: the call order. Every hooked call of
  every run on a device advances that device's call clock (one int64, shared); a slot holds 1 +
  the clock of the module's first call in that batch whose values held a NaN or an infinity (0:
  none), and how many they were (-1 with mean and std only, where a non-finite mean tells).

The C++ kernels carry the same plane order (`csrc/stats.h`); `torch.ops.fasthooks.layout()`
reports it and a test compares the two.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The extras of one number per slot, each read as `act.extra[name]`.
EXTRAS = ("min", "max", "near_zero", "nonfinite", "kurtosis", "norm", "absmax")
# Extras read from the merge state rather than a finalised plane: the L2 norm and the largest
# magnitude.
DERIVED_EXTRAS = ("norm", "absmax")
# Extras kept in a buffer of their own, read as `act.<name>`; `extra=` takes any of ALL_EXTRAS.
COUNTED_EXTRAS = ("binades",)
ALL_EXTRAS = EXTRAS + COUNTED_EXTRAS
# The bins of the "binades" extra (csrc/binades.h): zero; magnitudes below 2^BINADE_MIN (float32's
# subnormals, and smaller float64 values); one bin per binade [2^e, 2^(e + 1)) for e from
# BINADE_MIN to BINADE_MAX (float32's normal exponents); finite magnitudes of 2^(BINADE_MAX + 1)
# or more (float64 only); infinities and NaN.
BINADE_MIN = -126
BINADE_MAX = 127
BINADE_NAMES = (
    "zero",
    "below",
    *(f"2^{e}" for e in range(BINADE_MIN, BINADE_MAX + 1)),
    "above",
    "nonfinite",
)
BINADE_BINS = len(BINADE_NAMES)
BINADE_ZERO, BINADE_BELOW = 0, 1
BINADE_FIRST = 2  # the bin of binade BINADE_MIN
BINADE_ABOVE, BINADE_NONFINITE = BINADE_BINS - 2, BINADE_BINS - 1
# `top_k` keeps at most this many values per slot.
MAX_TOP_K = 16
TOP_VALUE, TOP_CHANNEL = 0, 1
# The running per-channel sums of the `channels` buffer, and the statistics read from them.
CHANNEL_PLANES = ("count", "sum", "sum_sq", "absmax", "active")
CHANNEL_COUNT, CHANNEL_SUM, CHANNEL_SUM_SQ, CHANNEL_ABSMAX, CHANNEL_ACTIVE = range(5)
CHANNEL_STATS = ("absmax", "mean", "rms", "active")
STATE_PLANES = ("count", "mean", "m2", "m3", "m4", "min", "max", "near_zero", "nonfinite")
BASIC_PLANES = 3
STATS_PLANES = ("mean", "std")
EXTRA_PLANES = ("min", "max", "near_zero", "kurtosis")
ORDER_PLANES = ("first_nonfinite", "nonfinite_count")
# A CUDA block keeps its histogram and the bin edges in shared memory: this many fit on any GPU.
MAX_HIST_BINS = 2048
# The CUDA kernels' workspace (csrc/cuda/accumulate_kernel.cuh): per-block partial results (the
# state planes of up to CUDA_MAX_BLOCKS blocks) in one region for each stream a run's hooks are
# called from, up to CUDA_WORKSPACE_REGIONS; each region's finished-blocks counters, one for each
# of the CUDA_LIST_TENSORS tensors a launch of the list kernel takes; and the count of calls
# dropped because the cursor was past the buffers' capacity (a CUDA graph replayed past
# `expected_batches`), read back as CUDA_DROPPED_CALLS.
CUDA_MAX_BLOCKS = 2048
CUDA_WORKSPACE_REGIONS = 8
CUDA_LIST_TENSORS = 64
CUDA_WORKSPACE_DOUBLES = (
    CUDA_WORKSPACE_REGIONS * (len(STATE_PLANES) * CUDA_MAX_BLOCKS + CUDA_LIST_TENSORS) + 1
)
CUDA_DROPPED_CALLS = CUDA_WORKSPACE_DOUBLES - 1


def cuda_workspace_doubles(top_k: int = 0) -> int:
    """The CUDA workspace of a run keeping `top_k` pairs per slot (0: none): with top_k, each
    region goes on with a list of top_k (value, channel) pairs for each of its blocks.

    Examples:
        >>> cuda_workspace_doubles() == CUDA_WORKSPACE_DOUBLES
        True
        >>> cuda_workspace_doubles(4) - CUDA_WORKSPACE_DOUBLES == 8 * 2048 * 4 * 2
        True
    """
    return CUDA_WORKSPACE_DOUBLES + CUDA_WORKSPACE_REGIONS * CUDA_MAX_BLOCKS * top_k * 2


COUNT, MEAN, M2, M3, M4, MIN, MAX, NEAR_ZERO, NONFINITE = range(len(STATE_PLANES))


class AccumulateArgs(NamedTuple):
    """The arguments of `accumulate_stats` in order, as `csrc/schemas.h` declares them (a test
    compares the two): the tensor, the run's buffers (`StatBuffers.op_args()`), the slot and the
    options. Every backend's entry point takes these.

    Examples:
        >>> names = "x state stats extra hist binades top channels workspace order clock".split()
        >>> names.append("cursor")
        >>> AccumulateArgs(*names, 0)
        ... # doctest: +ELLIPSIS
        AccumulateArgs(x='x', ..., slot=0, near_zero=0.05, hist_min=0.0, ..., channel_region=0)
    """

    x: torch.Tensor
    state: torch.Tensor
    stats: torch.Tensor
    extra: torch.Tensor
    hist: torch.Tensor
    binades: torch.Tensor
    top: torch.Tensor
    channels: torch.Tensor
    workspace: torch.Tensor
    order: torch.Tensor
    clock: torch.Tensor
    cursor: torch.Tensor
    slot: int
    near_zero: float = 0.05
    hist_min: float = 0.0
    hist_max: float = 10.0
    channel_dim: int = -1
    channel_offset: int = 0
    channel_region: int = 0


# The operator's tensor arguments; its scalars follow.
TENSOR_ARGUMENTS = AccumulateArgs._fields[:12]


class BufferSpec(NamedTuple):
    """One buffer of a run: its name, dtype, column axis, the value of an empty column, and how
    ranks merge it ("moments": the pairwise rule; "finalised": computed again from the merged
    state; "sum"; "gathered": every rank's kept apart; "top": the k largest of the union)."""

    name: str
    dtype: torch.dtype
    axis: int
    fill: float
    merge: str


# Every buffer a run owns, in the operator's argument order: allocation, growth, clearing a
# column, moving, host copies, checkpoints and sinks are loops over this table.
BUFFERS = (
    BufferSpec("state", torch.float64, 2, 0.0, "moments"),
    BufferSpec("stats", torch.float32, 2, float("nan"), "finalised"),
    BufferSpec("extra", torch.float32, 2, float("nan"), "finalised"),
    BufferSpec("hist", torch.int64, 1, 0, "sum"),
    BufferSpec("binades", torch.int32, 1, 0, "sum"),
    BufferSpec("top", torch.float64, 1, float("nan"), "top"),
    BufferSpec("order", torch.int64, 2, 0, "gathered"),
)
# A checkpoint keeps these; the finalised ones are computed again from the state.
SAVED_BUFFERS = tuple(spec.name for spec in BUFFERS if spec.merge != "finalised")


def buffer_shape(
    name: str,
    modules: int,
    columns: int,
    full: bool,
    hist_bins: int,
    ordered: bool,
    binades: bool = False,
    top_k: int = 0,
) -> tuple[int, ...]:
    """The shape of one buffer; `(0,)` for one the run does not keep.

    Examples:
        >>> buffer_shape("hist", 3, 8, True, 40, True), buffer_shape("extra", 3, 8, False, 0, True)
        ((3, 8, 40), (0,))
        >>> buffer_shape("binades", 3, 8, True, 0, True, binades=True)
        (3, 8, 258)
        >>> buffer_shape("top", 3, 8, True, 0, True, top_k=4)
        (3, 8, 4, 2)
    """
    if name == "binades":
        return (modules, columns, BINADE_BINS) if binades else (0,)
    if name == "top":
        return (modules, columns, top_k, 2) if top_k else (0,)
    planes = {
        "state": state_planes(full),
        "stats": len(STATS_PLANES),
        "extra": len(EXTRA_PLANES) if full else 0,
        "order": len(ORDER_PLANES) if ordered else 0,
    }
    if name == "hist":
        return (modules, columns, hist_bins) if hist_bins else (0,)
    return (planes[name], modules, columns) if planes[name] else (0,)


def state_planes(full: bool) -> int:
    """How many state planes a run keeps: all of them with extras, else mean and std's three.

    Examples:
        >>> state_planes(False), state_planes(True)
        (3, 9)
    """
    return len(STATE_PLANES) if full else BASIC_PLANES
