"""Saving and resuming an ActivationStats run with a training checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .buffers import HostCopy, StatBuffers
from .layout import BUFFERS, SAVED_BUFFERS
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
    """CPU copies of the saved buffers' columns held after `n` recorded batches, oldest first."""
    held = {}
    for spec in BUFFERS:
        source = getattr(buffers, spec.name)
        if spec.name not in SAVED_BUFFERS:
            continue
        if source.numel() == 0:
            held[spec.name] = torch.empty(0, dtype=source.dtype)
        else:
            held[spec.name] = window.read(HostCopy(spec.axis, spec.dtype), source, n).clone()
    return held


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
    stats, extra = finalise(saved["state"].to(device))
    values = {**saved, "stats": stats, "extra": extra}
    for spec in BUFFERS:
        target = getattr(buffers, spec.name)
        # Version 1 kept no call order: its batches resume with none noted.
        if target.numel() > 0 and values.get(spec.name) is not None:
            target.index_copy_(spec.axis, columns, values[spec.name].to(device))
    buffers.cursor.fill_(window.column(n))
