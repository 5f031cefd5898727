"""One checkpoint schema for both recorders, and every older state of either read into it.

Version 3, what `state_dict()` of `ActivationStats` and `ParameterStats` gives: `version`,
`recorder` (the class name), `settings` (what must match for columns to continue), `num_batches`
(columns recorded), `seen` (batches, or optimizer steps, seen), `batches` (the index of each
held column), `columns` (per kind, the held columns of the merge state, histogram and call
order), and with a sink `sink_sent` and `sink_through` (the batches it already holds).

Older states: ActivationStats version 1 (no call order) and 2, ParameterStats version 1.
"""

from __future__ import annotations

from typing import Any

import torch

from .buffers import HostCopy, StatBuffers
from .layout import BUFFERS, SAVED_BUFFERS
from .moments import finalise
from .window import ColumnWindow

VERSION = 3
# Settings of the older flat layouts, under their names then.
_OLD_NAMES = {"module_names": "names", "param_names": "names"}
_SETTINGS = ("names", "kinds", "extra", "near_zero", "hist_bins", "hist_range", "every", "window")


def state_dict(recorder: str, settings: dict[str, Any], seen: int, store: Any) -> dict[str, Any]:
    """A recorder's state in the current schema, from its `ColumnStore`."""
    return {"version": VERSION, "recorder": recorder, "settings": settings, "seen": seen} | (
        store.state()
    )


def _upgrade(saved: dict[str, Any], kinds: list[str]) -> dict[str, Any]:
    """An older state in the current schema (`kinds`: the resuming run's, for a layout that
    did not name them)."""
    settings = {
        _OLD_NAMES.get(k, k): v for k, v in saved.items() if _OLD_NAMES.get(k, k) in _SETTINGS
    }
    if "num_steps" in saved:  # ParameterStats, version 1
        columns = {kind: dict(held) for kind, held in saved["buffers"].items()}
        if saved["before"].numel():
            columns["before"] = {"state": saved["before"]}
        return {
            "version": VERSION,
            "recorder": "ParameterStats",
            "settings": settings,
            "num_batches": saved["num_steps"],
            "seen": saved["step_count"],
            "batches": saved["steps"],
            "columns": columns,
        }
    held = {name: saved[name] for name in SAVED_BUFFERS if name in saved}
    return {
        "version": VERSION,
        "recorder": "ActivationStats",
        "settings": settings,
        "num_batches": saved["num_batches"],
        "seen": saved["seen"],
        "batches": saved["batches"],
        "columns": {kinds[0]: held},
    }


# Settings added after states were first saved, and the value an older state had.
ADDED_SETTINGS = {"top_k": 0, "channel_dim": None, "channel_stats": [], "channel_every": 100}


def checked(
    saved: dict[str, Any], recorder: str, settings: dict[str, Any], kinds: list[str]
) -> dict[str, Any]:
    """`saved` in the current schema, refused (saying what differs) when it comes from another
    recorder, another model or other statistics."""
    version = saved.get("version")
    if version == VERSION:
        current = saved
    elif version in (1, 2):
        current = _upgrade(saved, kinds)
    else:
        raise ValueError(f"state_dict: version {version!r}, wanted one of (1, 2, {VERSION})")
    if current["recorder"] != recorder:
        raise ValueError(f"state_dict: saved by {current['recorder']}, not by {recorder}")
    for key, want in settings.items():
        got = current["settings"].get(key, ADDED_SETTINGS.get(key))
        if got != want:
            raise ValueError(
                f"state_dict: saved {key} {got!r} does not match this {recorder}' {want!r}"
            )
    return current


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


def restore_columns(
    saved: dict[str, torch.Tensor], n: int, buffers: StatBuffers, window: ColumnWindow
) -> None:
    """Writes saved columns into fresh buffers where `window` places them, and puts the cursor
    after them; the finalised statistics are computed again from the merge state."""
    if n == 0:
        return
    device = buffers.state.device
    columns = torch.tensor(window.columns(n), device=device)
    stats, extra = finalise(saved["state"].to(device))
    values = {**saved, "stats": stats, "extra": extra}
    for spec in BUFFERS:
        target = getattr(buffers, spec.name)
        # A version 1 state kept no call order: its batches resume with none noted.
        if target.numel() > 0 and values.get(spec.name) is not None:
            target.index_copy_(spec.axis, columns, values[spec.name].to(device))
    buffers.cursor.fill_(window.column(n))
