"""Saving and resuming an ActivationStats run with a training checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .buffers import HostCopy, StatBuffers
from .moments import finalise
from .window import ColumnWindow

if TYPE_CHECKING:
    from .stats import ActivationStats

VERSION = 2
# Version 1 had no call order: its batches resume with none noted.
READABLE_VERSIONS = (1, 2)


def settings(act: ActivationStats) -> dict[str, Any]:
    """What must match for columns to continue: modules and the statistics they hold."""
    return {
        "module_names": act.module_names,
        "extra": list(act.extra_names),
        "near_zero": act.near_zero,
        "hist_bins": act.hist_bins,
        "hist_range": [act.hist_min, act.hist_max],
        "every": act.every,
        "window": act.window,
    }


def held_columns(buffers: StatBuffers, window: ColumnWindow, n: int) -> dict[str, torch.Tensor]:
    """CPU copies of the columns the buffers hold after `n` recorded batches, oldest first:
    the merge state, histogram and call order."""

    def held(source: torch.Tensor, axis: int) -> torch.Tensor:
        if source.numel() == 0:
            return torch.empty(0, dtype=source.dtype)
        return window.read(HostCopy(axis, source.dtype), source, n).clone()

    return {
        "state": held(buffers.state, 2),
        "hist": held(buffers.hist, 1),
        "order": held(buffers.order, 2),
    }


def state_dict(
    act: ActivationStats,
    buffers: StatBuffers | None,
    window: ColumnWindow,
    position: dict[str, Any],
) -> dict[str, Any]:
    """The held columns and the position (`num_batches`, and what the recorder adds), as CPU
    tensors and plain values."""
    empty = {
        "state": torch.empty(0),
        "hist": torch.empty(0),
        "order": torch.empty(0, dtype=torch.int64),
    }
    columns = empty if buffers is None else held_columns(buffers, window, act.num_batches)
    return {"version": VERSION, **settings(act), **position, "batches": act.batches, **columns}


def check(act: ActivationStats, saved: dict[str, Any]) -> None:
    """Refuses a state saved from another model or with other statistics, saying what differs."""
    if saved.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"state_dict: version {saved.get('version')!r}, wanted one of {READABLE_VERSIONS}"
        )
    for key, want in settings(act).items():
        got = saved.get(key)
        if got != want:
            raise ValueError(
                f"state_dict: saved {key} {got!r} does not match this ActivationStats' {want!r}"
            )


def restore(saved: dict[str, Any], buffers: StatBuffers, window: ColumnWindow) -> None:
    """Writes the saved columns into fresh buffers where `window` places them, and puts the
    cursor after them."""
    n = saved["num_batches"]
    if n == 0:
        return
    device = buffers.state.device
    columns = torch.tensor(window.columns(n), device=device)
    state = saved["state"].to(device)
    buffers.state.index_copy_(2, columns, state)
    stats, extra = finalise(state)
    buffers.stats.index_copy_(2, columns, stats)
    if extra is not None:
        buffers.extra.index_copy_(2, columns, extra)
    if buffers.hist_bins:
        buffers.hist.index_copy_(1, columns, saved["hist"].to(device))
    if "order" in saved and buffers.ordered:
        buffers.order.index_copy_(2, columns, saved["order"].to(device))
    buffers.cursor.fill_(window.column(n))
