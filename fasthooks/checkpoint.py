"""Saving and resuming an ActivationStats run with a training checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .buffers import StatBuffers
from .moments import finalise

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
    }


def state_dict(act: ActivationStats, buffers: StatBuffers | None) -> dict[str, Any]:
    """The recorded columns and the sampling position, as CPU tensors and plain values."""
    n = act.num_batches
    empty = buffers is None
    return {
        "version": VERSION,
        **settings(act),
        "num_batches": n,
        "seen": act._seen,
        "batches": act.batches,
        "state": torch.empty(0) if empty else buffers.state[:, :, :n].cpu(),
        "hist": torch.empty(0) if empty or not act.hist_bins else buffers.hist[:, :n].cpu(),
        "order": torch.empty(0, dtype=torch.int64) if empty else buffers.order[:, :, :n].cpu(),
    }


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


def restore(saved: dict[str, Any], buffers: StatBuffers) -> None:
    """Writes the saved columns into fresh buffers and puts the cursor after them."""
    n = saved["num_batches"]
    if n == 0:
        return
    state = saved["state"].to(buffers.state.device)
    buffers.state[:, :, :n].copy_(state)
    stats, extra = finalise(state)
    buffers.stats[:, :, :n].copy_(stats)
    if extra is not None:
        buffers.extra[:, :, :n].copy_(extra)
    if buffers.hist_bins:
        buffers.hist[:, :n].copy_(saved["hist"])
    if "order" in saved:
        buffers.order[:, :, :n].copy_(saved["order"])
    buffers.cursor.fill_(n)
