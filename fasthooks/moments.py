"""The reference statistics: per-slot statistics merged with tensor ops (the Python backend).

`accumulate_stats_python` has the fused operator's signature and writes the same buffers
(see `layout.py`): it merges the statistics of a tensor into one (module, batch) slot and
finalises that slot. Everything is a tensor op on the state's device: nothing waits for it.
"""

from __future__ import annotations

import torch

from .layout import (
    BINADE_ABOVE,
    BINADE_BELOW,
    BINADE_BINS,
    BINADE_FIRST,
    BINADE_MIN,
    BINADE_NONFINITE,
    BINADE_ZERO,
    CHANNEL_ABSMAX,
    CHANNEL_ACTIVE,
    CHANNEL_COUNT,
    CHANNEL_SUM,
    CHANNEL_SUM_SQ,
    COUNT,
    M2,
    M3,
    M4,
    MAX,
    MEAN,
    MIN,
    NEAR_ZERO,
    NONFINITE,
    STATE_PLANES,
    TOP_CHANNEL,
    TOP_VALUE,
    AccumulateArgs,
)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype accumulates in float32."""
    if not dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got dtype {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def bin_edges(bins: int, lo: float, hi: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """The `bins + 1` float64 edges of equal bins over [lo, hi], as every backend computes them.

    Examples:
        >>> bin_edges(4, 0.0, 1.0).tolist()
        [0.0, 0.25, 0.5, 0.75, 1.0]
    """
    k = torch.arange(bins + 1, dtype=torch.float64, device=device)
    # A tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal, which
    # rounds some edges differently from the CPU. `where` with a scalar copies nothing to the
    # device, so no host sync and nothing a CUDA graph capture refuses.
    edges = lo + (hi - lo) * k / torch.full_like(k, bins)
    return torch.where(k == bins, hi, edges)


def histogram(x: torch.Tensor, bins: int, lo: float, hi: float) -> torch.Tensor:
    """int64 counts of x in `bins` equal bins over [lo, hi]: the top edge falls in the last bin,
    values outside the range and NaN in none, as `torch.histc`.

    Examples:
        >>> histogram(torch.tensor([0.0, 0.5, 1.0, 2.0, float("nan")]), 2, 0.0, 1.0).tolist()
        [1, 2]
    """
    values = x.reshape(-1).to(accumulation_dtype(x.dtype)).double().contiguous()
    edges = bin_edges(bins, lo, hi, x.device)
    index = torch.bucketize(values, edges, right=True) - 1
    index = torch.where(values == hi, bins - 1, index)
    index = torch.where((index >= 0) & (index < bins), index, bins)  # bin `bins`: outside
    counts = torch.zeros(bins + 1, dtype=torch.int64, device=x.device)
    return counts.scatter_add_(0, index, torch.ones_like(index))[:bins]


def binade_counts(x: torch.Tensor) -> torch.Tensor:
    """int64 counts of x's values in each bin of `layout.BINADE_NAMES`: zero, below 2^-126, one
    bin per binade [2^e, 2^(e + 1)) for e in [-126, 127], finite from 2^128 on, non-finite.

    Examples:
        >>> counts = binade_counts(torch.tensor([0.0, 1.0, 1.5, -3.0, float("inf")]))
        >>> from fasthooks.layout import BINADE_NAMES
        >>> {BINADE_NAMES[k]: int(c) for k, c in enumerate(counts) if c}
        {'zero': 1, '2^0': 2, '2^1': 1, 'nonfinite': 1}
    """
    values = x.detach().reshape(-1)
    if values.dtype != torch.float64:
        values = values.float()  # float16 and bfloat16 exactly, their binades unchanged
    magnitude = values.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2^exponent, m in [0.5, 1)
    binade = (exponent - 1).long()
    index = (binade - BINADE_MIN + BINADE_FIRST).clamp(BINADE_BELOW, BINADE_ABOVE)
    index = torch.where(magnitude == 0, BINADE_ZERO, index)
    index = torch.where(magnitude.isfinite(), index, BINADE_NONFINITE)
    counts = torch.zeros(BINADE_BINS, dtype=torch.int64, device=x.device)
    return counts.scatter_add_(0, index, torch.ones_like(index))


def channel_of_each(x: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """int64 channel index of each of x's values along `channel_dim` (torch's convention:
    negative counts from the end), flattened as `x.reshape(-1)`; all 0 for a 0-d x.

    Examples:
        >>> channel_of_each(torch.zeros(2, 3), 1).tolist()
        [0, 1, 2, 0, 1, 2]
    """
    if x.dim() == 0:
        return torch.zeros(1, dtype=torch.int64, device=x.device)
    dim = channel_dim % x.dim()
    shape = [1] * x.dim()
    shape[dim] = -1
    channels = torch.arange(x.shape[dim], dtype=torch.int64, device=x.device)
    return channels.view(shape).expand(x.shape).reshape(-1)


def top_of(values: torch.Tensor, channels: torch.Tensor, k: int) -> torch.Tensor:
    """The k (value, channel) pairs of largest magnitude among `values` (float64) and their
    `channels` (int64, each in [0, 2^32)), float64 `(k, 2)`, in the one order every backend
    keeps: larger magnitude first; of equal magnitude, positive (sign bit clear) first; then the
    lower channel. NaN values are never taken; NaN pairs fill the rows past the values there are.
    The order is total on (value, channel) pairs, so the pairs taken do not depend on the order
    the values come in, and merging the tops of parts gives the top of the whole.

    Examples:
        >>> values = torch.tensor([1.0, -3.0, 3.0, float("nan"), 2.0], dtype=torch.float64)
        >>> top_of(values, torch.tensor([0, 1, 2, 3, 4]), 4).tolist()
        [[3.0, 2.0], [-3.0, 1.0], [2.0, 4.0], [1.0, 0.0]]
        >>> top_of(values[:2], torch.tensor([5, 6]), 3)[2].isnan().all().item()
        True
    """
    magnitude = torch.where(values.isnan(), -1.0, values.abs())
    kept = min(k, magnitude.numel())
    top = torch.full((k, 2), float("nan"), dtype=torch.float64, device=values.device)
    if kept == 0:
        return top
    # Without a host sync: every magnitude above the kept-th largest is taken; of those equal
    # to it, the best by sign and channel, through one integer key.
    floor = magnitude.topk(kept).values[-1]
    rank = (magnitude > floor).long() * 2 + (magnitude == floor).long()
    positive = (~values.signbit()).long()
    key = (rank << 33) | (positive << 32) | ((1 << 32) - 1 - channels)
    taken = key.topk(kept).indices
    value, channel, size = values[taken], channels[taken], magnitude[taken]
    order = torch.argsort(channel, stable=True)
    order = order[torch.argsort(positive[taken][order], descending=True, stable=True)]
    order = order[torch.argsort(size[order], descending=True, stable=True)]
    empty = size[order] < 0
    top[:kept, TOP_VALUE] = torch.where(empty, float("nan"), value[order])
    top[:kept, TOP_CHANNEL] = torch.where(empty, float("nan"), channel[order].double())
    return top


def merged_top(held: torch.Tensor, values: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """The top `(k, 2)` of the pairs `held` and of `values` with their `channels`, as `top_of`.

    Examples:
        >>> held = top_of(torch.tensor([5.0, 1.0], dtype=torch.float64), torch.tensor([0, 1]), 2)
        >>> merged_top(held, torch.tensor([-7.0], dtype=torch.float64), torch.tensor([2])).tolist()
        [[-7.0, 2.0], [5.0, 0.0]]
    """
    held_channels = held[:, TOP_CHANNEL].nan_to_num(0.0).long()
    return top_of(
        torch.cat((held[:, TOP_VALUE], values)), torch.cat((held_channels, channels)), len(held)
    )


def merged_top_pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The top `(..., k, 2)` of each slot of two sets of top pairs `(..., k, 2)` together, in
    `top_of`'s order (every slot at once: sorted on the last axis but one).

    Examples:
        >>> a = torch.tensor([[[2.0, 0.0], [1.0, 5.0]]], dtype=torch.float64)
        >>> b = torch.tensor([[[-2.0, 1.0], [float("nan"), float("nan")]]], dtype=torch.float64)
        >>> merged_top_pairs(a, b)[0].tolist()
        [[2.0, 0.0], [-2.0, 1.0]]
    """
    pairs = torch.cat((a, b), dim=-2)
    values, channels = pairs[..., TOP_VALUE], pairs[..., TOP_CHANNEL]
    magnitude = torch.where(values.isnan(), -1.0, values.abs())
    order = torch.argsort(channels.nan_to_num(0.0), dim=-1, stable=True)
    for key, descending in ((values.signbit(), False), (magnitude, True)):
        taken = key.gather(-1, order).to(torch.float64)
        order = order.gather(-1, torch.argsort(taken, dim=-1, descending=descending, stable=True))
    k = a.shape[-2]
    return pairs.gather(-2, order[..., :k, None].expand(*order.shape[:-1], k, 2))


def batch_stats(x: torch.Tensor, full: bool, near_zero: float) -> torch.Tensor:
    """The float64 state planes of the values of a non-empty x (all planes, or the first three).

    Examples:
        >>> batch_stats(torch.tensor([1.0, 3.0]), False, 0.05).tolist()
        [2.0, 2.0, 2.0]
    """
    x = x.reshape(-1).to(accumulation_dtype(x.dtype))
    n = torch.full((), x.numel(), dtype=torch.float64, device=x.device)  # a fill: no copy
    # In float64: a float32 variance loses digits when |mean| >> std (2e-5 on N(1e5, 1)).
    values = x.double()
    # torch.mean rather than var_mean's Welford mean, which turns an infinite mean into NaN.
    mean = values.mean()
    if not full:
        return torch.stack((n, mean, values.var(correction=0) * n))
    d = values - mean
    d2 = d * d
    return torch.stack(
        (
            n,
            mean,
            d2.sum(),
            (d2 * d).sum(),
            (d2 * d2).sum(),
            x.amin().double(),
            x.amax().double(),
            (x <= near_zero).sum().double(),
            (~x.isfinite()).sum().double(),
        )
    )


def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pairwise merge of two stacks of state planes (leading axis), as the kernels merge them.

    Examples:
        >>> one, two = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 3.0, 0.0])
        >>> merge(one, two).tolist()
        [2.0, 2.0, 2.0]
    """
    na, nb = a[COUNT], b[COUNT]
    n = na + nb
    delta = b[MEAN] - a[MEAN]
    ab = na * nb / n
    planes = [n, (na * a[MEAN] + nb * b[MEAN]) / n, a[M2] + b[M2] + delta * delta * ab]
    if a.shape[0] == len(STATE_PLANES):
        d_n = delta / n
        planes += [
            a[M3]
            + b[M3]
            + delta * delta * d_n * ab * (na - nb)
            + 3.0 * d_n * (na * b[M2] - nb * a[M2]),
            a[M4]
            + b[M4]
            + delta * delta * d_n * d_n * ab * (na * na - na * nb + nb * nb)
            + 6.0 * d_n * d_n * (na * na * b[M2] + nb * nb * a[M2])
            + 4.0 * d_n * (na * b[M3] - nb * a[M3]),
            torch.minimum(a[MIN], b[MIN]),
            torch.maximum(a[MAX], b[MAX]),
            a[NEAR_ZERO] + b[NEAR_ZERO],
            a[NONFINITE] + b[NONFINITE],
        ]
    merged = torch.stack(planes)
    # An empty side leaves the other as it is (and no inf - inf can creep in from it).
    return torch.where(na == 0, b, torch.where(nb == 0, a, merged))


def finalise(
    state: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mean, std) and, for a full state, (min, max, near_zero, kurtosis) of state planes, as
    `dtype` (float32: what a run keeps; float64: what a sink file writes).

    A slot with no element reads NaN; std and kurtosis need two elements, kurtosis a spread.

    Examples:
        >>> stats, extra = finalise(torch.tensor([2.0, 2.0, 2.0]))
        >>> stats.tolist(), extra
        ([2.0, 1.4142135381698608], None)
    """
    count = state[COUNT]
    nan = torch.full_like(count, float("nan"))
    some, several = count > 0, count > 1
    stats = torch.stack(
        (
            torch.where(some, state[MEAN], nan),
            torch.where(several, (state[M2] / (count - 1)).sqrt(), nan),
        )
    ).to(dtype)
    if state.shape[0] != len(STATE_PLANES):
        return stats, None
    m2 = state[M2]
    extra = torch.stack(
        (
            torch.where(some, state[MIN], nan),
            torch.where(some, state[MAX], nan),
            torch.where(some, state[NEAR_ZERO] / count, nan),
            torch.where(several & (m2 > 0), count * state[M4] / (m2 * m2), nan),
        )
    ).to(dtype)
    return stats, extra


def derived_extra(name: str, state: torch.Tensor) -> torch.Tensor:
    """float32 "norm" (the L2 norm, sqrt(m2 + count * mean^2)) or "absmax" (the largest
    magnitude, NaN once a NaN was seen) of every slot of a full merge state; NaN where a slot
    has no element.

    Examples:
        >>> from fasthooks.buffers import StatBuffers
        >>> b = StatBuffers(1, 1, "cpu", full=True, hist_bins=0)
        >>> accumulate_stats_python(torch.tensor([3.0, -4.0]), *b.op_args(), 0, 0.05, 0.0, 1.0)
        >>> derived_extra("norm", b.state).item(), derived_extra("absmax", b.state).item()
        (5.0, 4.0)
    """
    count = state[COUNT]
    if name == "norm":
        value = (state[M2] + count * state[MEAN] * state[MEAN]).sqrt()
    else:
        value = torch.maximum(state[MIN].abs(), state[MAX].abs())
    return torch.where(count > 0, value, torch.full_like(value, float("nan"))).float()


def accumulate_stats_python(*args: object, **options: float) -> None:
    """`accumulate_stats` (`layout.AccumulateArgs`) in torch ops: merge the statistics of all
    of `x` into slot (`slot`, `cursor`) of the buffers, in place, and note the call in the call
    order (`order`, `clock`) unless `order` is empty.

    Examples:
        >>> from fasthooks.buffers import StatBuffers
        >>> b = StatBuffers(1, 2, "cpu", full=False, hist_bins=0)
        >>> accumulate_stats_python(torch.tensor([1.0, 3.0]), *b.op_args(), 0, 0.05, 0.0, 1.0)
        >>> b.stats[:, 0, 0].tolist()
        [2.0, 1.4142135381698608]
    """
    args = AccumulateArgs(*args, **options)
    x, state, stats, extra, hist, binades, top, channels, _, order, clock, cursor = args[:12]
    slot = args.slot
    call = _merge_into_slot(
        x, state, stats, extra, hist, cursor, slot, args.near_zero, args.hist_min, args.hist_max
    )
    if call is not None and binades.numel() > 0:
        counts = binade_counts(x).to(torch.int32)
        binades[slot].index_add_(0, cursor.reshape(1), counts.unsqueeze(0))
    if call is not None and top.numel() > 0:
        _merge_top(x, top, cursor, slot, args.channel_dim, args.channel_offset)
    if call is not None and channels.numel() > 0:
        start = args.channel_region + args.channel_offset
        _add_channel_sums(x, channels, args.channel_dim, start, args.channel_region, args.near_zero)
    if call is not None and order.numel() > 0:
        note_call_order(order, clock, cursor, slot, call)


def _merge_into_slot(
    x: torch.Tensor,
    state: torch.Tensor,
    stats: torch.Tensor,
    extra: torch.Tensor,
    hist: torch.Tensor,
    cursor: torch.Tensor,
    slot: int,
    near_zero: float,
    hist_min: float,
    hist_max: float,
) -> torch.Tensor | None:
    """x's statistics merged into the slot; returns the call's own state planes (None when x is
    empty)."""
    if x.device != state.device:
        raise ValueError(f"x is on {x.device} but the statistics state is on {state.device}")
    if x.numel() == 0:
        return None
    x = x.detach()
    full = state.shape[0] == len(STATE_PLANES)
    column = cursor.reshape(1)
    slot_state = state[:, slot]
    call = batch_stats(x, full, near_zero)
    merged = merge(slot_state.index_select(1, column)[:, 0], call)
    slot_state.index_copy_(1, column, merged.unsqueeze(1))
    new_stats, new_extra = finalise(merged)
    stats[:, slot].index_copy_(1, column, new_stats.unsqueeze(1))
    if new_extra is not None:
        extra[:, slot].index_copy_(1, column, new_extra.unsqueeze(1))
    if hist.numel() > 0:
        counts = histogram(x, hist.shape[2], hist_min, hist_max)
        hist[slot].index_add_(0, column, counts.unsqueeze(0))
    return call


def _check_channel_dim(x: torch.Tensor, channel_dim: int) -> None:
    if x.dim() > 0 and not -x.dim() <= channel_dim < x.dim():
        raise ValueError(
            f"accumulate_stats: channel_dim must be in [{-x.dim()}, {x.dim()}) for x of shape "
            f"{tuple(x.shape)}, got {channel_dim}"
        )


def channel_sums(
    x: torch.Tensor, channel_dim: int, channels: int, near_zero: float
) -> torch.Tensor:
    """float64 `(len(CHANNEL_PLANES), channels)`: per channel of x along `channel_dim` (channel
    c at column c), how many values, their sum, sum of squares, largest magnitude (NaN when a
    NaN is among them) and how many have a magnitude above `near_zero`.

    Examples:
        >>> channel_sums(torch.tensor([[1.0, -2.0], [3.0, 0.0]]), 1, 2, 0.05).tolist()
        [[2.0, 2.0], [4.0, -2.0], [10.0, 4.0], [3.0, 2.0], [2.0, 1.0]]
    """
    working = x.detach().reshape(-1).to(accumulation_dtype(x.dtype))
    values = working.double()
    index = channel_of_each(x, channel_dim)
    magnitude = values.abs()
    planes = torch.zeros(5, channels, dtype=torch.float64, device=x.device)
    planes[CHANNEL_COUNT].index_add_(0, index, torch.ones_like(values))
    planes[CHANNEL_SUM].index_add_(0, index, values)
    planes[CHANNEL_SUM_SQ].index_add_(0, index, values * values)
    # Compared in the working precision, as the near-zero fraction is.
    planes[CHANNEL_ACTIVE].index_add_(0, index, (working.abs() > near_zero).double())
    largest = planes[CHANNEL_ABSMAX].scatter_reduce(0, index, magnitude, "amax")
    nans = torch.zeros_like(largest).index_add_(0, index, values.isnan().double())
    planes[CHANNEL_ABSMAX] = torch.where(nans > 0, float("nan"), largest)
    return planes


def add_channel_sums(held: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Per-channel sums `held` and `sums` (planes along dim -2) together, as the kernels add
    them: every plane summed, the largest magnitudes' maximum (NaN-propagating)."""
    added = held + sums
    largest = torch.maximum(held.select(-2, CHANNEL_ABSMAX), sums.select(-2, CHANNEL_ABSMAX))
    added.select(-2, CHANNEL_ABSMAX).copy_(largest)
    return added


def _add_channel_sums(
    x: torch.Tensor, row: torch.Tensor, channel_dim: int, start: int, region: int, near_zero: float
) -> None:
    """x's per-channel sums (`channel_sums`, channel 0 at `start`: the module's `region` plus
    the channel offset) added to `row`, the run's `(len(CHANNEL_PLANES), room)` running sums."""
    _check_channel_dim(x, channel_dim)
    if region < 0:
        raise ValueError(f"accumulate_stats: channel_region must be at least 0, got {region}")
    size = x.shape[channel_dim] if x.dim() > 0 else 1
    if start < 0 or start + size > row.shape[1]:
        raise ValueError(
            f"accumulate_stats: channels has room for {row.shape[1]} channels, x has {size} "
            f"along channel_dim {channel_dim} from channel_region {region} + channel_offset "
            f"{start - region}"
        )
    held = row[:, start : start + size]
    held.copy_(add_channel_sums(held, channel_sums(x, channel_dim, size, near_zero)))


def _merge_top(
    x: torch.Tensor,
    top: torch.Tensor,
    cursor: torch.Tensor,
    slot: int,
    channel_dim: int,
    channel_offset: int,
) -> None:
    """The top pairs of x (`top_of`, channels along `channel_dim` counted from
    `channel_offset`) merged into the slot's."""
    _check_channel_dim(x, channel_dim)
    values = x.detach().reshape(-1).double()
    column = cursor.reshape(1)
    held = top[slot].index_select(0, column)[0]
    merged = merged_top(held, values, channel_of_each(x, channel_dim) + channel_offset)
    top[slot].index_copy_(0, column, merged.unsqueeze(0))


def note_call_order(
    order: torch.Tensor, clock: torch.Tensor, cursor: torch.Tensor, slot: int, call: torch.Tensor
) -> None:
    """Advance the call clock and, when the call held a NaN or an infinity and is the slot's first
    to, note its position (plus one) and count in `order` (`layout.ORDER_PLANES`), as the kernels
    do (csrc/stats.h)."""
    full = call.shape[0] == len(STATE_PLANES)
    nonfinite = call[NONFINITE] > 0 if full else ~call[MEAN].isfinite()
    count = call[NONFINITE].long() if full else torch.full_like(clock.reshape(()), -1)
    position = clock.reshape(()) + 1
    clock.add_(1)
    column = cursor.reshape(1)
    noted = order[:, slot].index_select(1, column)[:, 0]
    first = nonfinite & (noted[0] == 0)
    order[:, slot].index_copy_(
        1, column, torch.where(first, torch.stack((position, count)), noted).unsqueeze(1)
    )


def accumulate_stats_list_python(
    xs: list[torch.Tensor],
    bases: list[torch.Tensor],
    state: torch.Tensor,
    stats: torch.Tensor,
    extra: torch.Tensor,
    hist: torch.Tensor,
    workspace: torch.Tensor,
    cursor: torch.Tensor,
    near_zero: float,
    hist_min: float,
    hist_max: float,
) -> None:
    """`xs[i]` into slot i, as `accumulate_stats_python`; with `bases`, the statistics of
    `xs[i] - bases[i]`, the difference taken in float32 (float64 for float64 tensors), which
    needs a full (9-plane) state.

    Examples:
        >>> from fasthooks.buffers import StatBuffers
        >>> b = StatBuffers(2, 1, "cpu", full=True, hist_bins=0)
        >>> after, before = [torch.tensor([3.0, 5.0])], [torch.tensor([1.0, 1.0])]
        >>> accumulate_stats_list_python(after, before, *b.list_op_args(), 0.05, 0.0, 1.0)
        >>> b.stats[:, 0, 0].tolist()
        [3.0, 1.4142135381698608]
    """
    if len(xs) > state.shape[1]:
        raise ValueError(
            f"accumulate_stats_list: xs has {len(xs)} tensors, more than the state's slots "
            f"({state.shape[1]})"
        )
    if bases and len(bases) != len(xs):
        raise ValueError(
            f"accumulate_stats_list: bases must be empty or hold one tensor per xs, got "
            f"{len(bases)} for {len(xs)}"
        )
    if bases and xs and state.shape[0] != len(STATE_PLANES):
        raise ValueError(
            "accumulate_stats_list: differences from bases need every statistic (a 9-plane "
            f"state), got a {state.shape[0]}-plane state"
        )
    for slot, (x, base) in enumerate(zip(xs, bases, strict=False)):  # all checked first
        if base.dtype != x.dtype or base.shape != x.shape or base.device != x.device:
            raise ValueError(
                f"accumulate_stats_list: bases[{slot}] must match xs[{slot}] in dtype, shape "
                f"and device: got {base.dtype} of shape {tuple(base.shape)} on {base.device} "
                f"for {x.dtype} of shape {tuple(x.shape)} on {x.device}"
            )
    for slot, x in enumerate(xs):
        if bases:
            base = bases[slot]
            working = torch.float64 if x.dtype == torch.float64 else torch.float32
            x = x.detach().to(working) - base.detach().to(working)
        _merge_into_slot(x, state, stats, extra, hist, cursor, slot, near_zero, hist_min, hist_max)
