"""Every argument check the recorders share: one place, so both refuse the same input with the
same words (each names the argument, what it got and what it wanted)."""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Callable
from typing import Any

import torch

from .layout import ALL_EXTRAS, CHANNEL_STATS, MAX_HIST_BINS, MAX_TOP_K

FLOAT32_MAX = torch.finfo(torch.float32).max


def uncompiled_name(name: str) -> str:
    """A module's name as before `torch.compile` wrapped it (`_orig_mod` parts dropped)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def count_argument(value: Any, name: str, low: int) -> int:
    """An integer argument with `operator.index` semantics (bools refused), at least `low`."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if count < low:
        raise ValueError(f"{name} must be an int >= {low}, got {count}")
    return count


def module_position(names: list[str], module: int | str) -> int:
    """The row of a module among `names`, given its qualified name or an index (negative too).

    Examples:
        >>> module_position(["0", "2"], "2"), module_position(["0", "2"], -2)
        (1, 0)
    """
    if isinstance(module, str):
        if module not in names:
            raise KeyError(f"module {module!r} is not hooked; hooked modules: {names}")
        return names.index(module)
    index = count_argument(module, "module", -len(names))
    if index >= len(names):
        raise IndexError(f"module index {index} out of range for {len(names)} modules")
    return index % len(names)


def check_extra(extra: Any, valid: tuple[str, ...] = ALL_EXTRAS) -> tuple[str, ...]:
    """`extra=` as names from `valid`, each once, in the order given."""
    names = (extra,) if isinstance(extra, str) else tuple(extra)
    for name in names:
        if name not in valid:
            raise ValueError(f"extra: unknown statistic {name!r}; valid ones are {valid}")
    return tuple(dict.fromkeys(names))


def check_hist(hist_bins: Any, hist_range: Any) -> tuple[int, float, float]:
    hist_bins = count_argument(hist_bins, "hist_bins", 0)
    if hist_bins > MAX_HIST_BINS:
        raise ValueError(f"hist_bins must be in [0, {MAX_HIST_BINS}], got {hist_bins}")
    try:
        lo, hi = (float(v) for v in hist_range)
    except (TypeError, ValueError):
        raise ValueError(f"hist_range must be two numbers (lo, hi), got {hist_range!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"hist_range must be finite with lo < hi, got {hist_range!r}")
    # float32, float16 and bfloat16 activations are binned in float32, whose range must hold it.
    if max(abs(lo), abs(hi), hi - lo) > FLOAT32_MAX:
        raise ValueError(
            f"hist_range must lie within float32's range and span at most {FLOAT32_MAX:.4g}, "
            f"got {hist_range!r}"
        )
    # float32 values must resolve the bins: each spans at least 2^-16 of the range's magnitude.
    if hist_bins and (hi - lo) / hist_bins < math.ldexp(max(abs(lo), abs(hi)), -16):
        raise ValueError(
            f"hist_range: {hist_bins} bins over {hist_range!r} are narrower than 2^-16 of the "
            "range's magnitude, finer than float32 activations resolve"
        )
    return int(hist_bins), lo, hi


def check_top_k(top_k: Any) -> int:
    """`top_k=` as an int in [0, MAX_TOP_K] (0: off)."""
    k = count_argument(top_k, "top_k", 0)
    if k > MAX_TOP_K:
        raise ValueError(f"top_k must be in [0, {MAX_TOP_K}], got {k}")
    return k


def default_channel_dim(dims: int) -> int:
    """The channel dimension of an output of `dims` dimensions: dim 1 of a 4-D or 5-D one (NCHW
    and NCDHW, whatever their memory format), else the last.

    Examples:
        >>> default_channel_dim(4), default_channel_dim(3), default_channel_dim(2)
        (1, -1, -1)
    """
    return 1 if dims in (4, 5) else -1


def check_channel_dim(channel_dim: Any) -> int | dict[str, int] | None:
    """`channel_dim=` as given: None (`default_channel_dim` for every module), an int for every
    module, or a mapping of module names to ints (the others by default)."""
    if channel_dim is None:
        return None
    if isinstance(channel_dim, dict):
        for name, dim in channel_dim.items():
            if not isinstance(name, str):
                raise TypeError(f"channel_dim: keys must be module names, got {name!r}")
            count_argument(dim, f"channel_dim[{name!r}]", -(2**31))
        return {name: int(dim) for name, dim in channel_dim.items()}
    return count_argument(channel_dim, "channel_dim", -(2**31))


def check_channel_stats(channel_stats: Any) -> tuple[str, ...]:
    """`channel_stats=` as names from `layout.CHANNEL_STATS`, each once, in the order given.

    Examples:
        >>> check_channel_stats(["rms", "absmax", "rms"]), check_channel_stats("active")
        (('rms', 'absmax'), ('active',))
    """
    names = (channel_stats,) if isinstance(channel_stats, str) else tuple(channel_stats)
    for name in names:
        if name not in CHANNEL_STATS:
            raise ValueError(
                f"channel_stats: unknown statistic {name!r}; valid ones are {CHANNEL_STATS}"
            )
    return tuple(dict.fromkeys(names))


def check_near_zero(near_zero: Any) -> float:
    """The near-zero threshold: a real number, not NaN."""
    if isinstance(near_zero, bool) or not isinstance(near_zero, numbers.Real):
        raise TypeError(f"near_zero must be a number, got {type(near_zero).__name__}")
    if math.isnan(near_zero):
        raise ValueError("near_zero must not be NaN")
    return float(near_zero)


def check_window(window: Any) -> int | None:
    """`window=` as given: None (every batch kept) or an int >= 1."""
    if window is None:
        return None
    return count_argument(window, "window", 1)


def check_sink(sink: Any) -> str | Callable[..., Any] | None:
    """`sink=` as given: None, a folder path (str or PathLike) or a callable."""
    if sink is None or callable(sink):
        return sink
    if isinstance(sink, (str, os.PathLike)):
        from .parquet import require_pyarrow

        require_pyarrow()
        return os.fspath(sink)
    raise TypeError(
        f"sink must be None, a folder path or a callable taking a SinkChunk, got "
        f"{type(sink).__name__}"
    )
