"""Several ranks' sink folders read back as one recording: their merge states merged exactly as
`all_reduce` merges the ranks' columns, with no collective during training."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .buffers import read_extras
from .distributed import merge_states
from .layout import BINADE_BINS, COUNT, state_planes
from .moments import derived_extra, finalise, merged_top_pairs
from .parquet import MERGEABLE_FORMAT, STATE_STATS, file_columns, file_settings, read_planes
from .recording import Recording, empty_top, top_parts
from .sink import HOST_DTYPES, HostColumns

# What the folders merged must agree on.
AGREED = ("recorder", "extra", "hist_bins", "hist_range", "near_zero")


class Folder(NamedTuple):
    """One rank's folder of one kind: its path, settings (its first file's), rank, the lowest
    rank holding the same values of each DTensor row (over its files) and its files."""

    path: str
    settings: dict[str, Any]
    rank: int | None
    pieces: dict[str, int]
    tables: list[Any]


class Columns(NamedTuple):
    """Columns on the union of rows and batches, of one folder or several merged: float64 merge
    state `(planes, rows, batches)` (zeros where empty), int64 histograms `(rows, batches, bins)`
    or None, int64 call order `(2, rows, batches)`, and the rank of each slot's first
    non-finite call `(rows, batches)`, int32 binade counts or None, and float64 top pairs
    `(rows, batches, k, 2)` (NaN where empty) or None."""

    state: torch.Tensor
    hist: torch.Tensor | None
    order: torch.Tensor
    ranks: torch.Tensor
    binades: torch.Tensor | None
    top: torch.Tensor | None


def merge_folders(paths: list[str], runs: list[tuple[dict[str, Any], list[Any]]]) -> Recording:
    """One recording of one kind from several ranks' folders (each one's settings and files)."""
    folders = _ranked([_folder(path, *run) for path, run in zip(paths, runs, strict=True)])
    _check_options(folders)
    first = folders[0].settings
    names, types = _union_of_rows(folders)
    written = [t.column("batch").to_numpy() for folder in folders for t in folder.tables]
    batches = np.unique(np.concatenate(written))
    counted = _counted(folders, names, plain_replicated=first["recorder"] == "ParameterStats")
    merged: Columns | None = None
    # One folder at a time, by rank: memory stays that of two, and ties go to the lower rank.
    for i, folder in sorted(enumerate(folders), key=lambda item: item[1].rank):
        files = [file_columns(t) for t in folder.tables]
        mine = _columns(files, first, names, batches, counted[i], folder.rank)
        merged = mine if merged is None else _merged(merged, mine)
    stats, finalised = finalise(merged.state)
    extra = read_extras(
        first["extra"],
        lambda name, t: t.to(HOST_DTYPES[name]),
        HostColumns({"state": merged.state, "extra": finalised}),
    )
    ranks = {
        (int(batches[b]), names[r]): int(merged.ranks[r, b])
        for r, b in torch.nonzero(merged.order[0] > 0).tolist()
    }
    settings = {**first, "names": names, "types": types}
    batches = torch.from_numpy(batches)
    largest = None if merged.binades is None else derived_extra("absmax", merged.state)
    return Recording(
        settings,
        batches,
        stats,
        extra,
        merged.hist,
        merged.order,
        ranks,
        merged.binades,
        largest,
        merged.top,
    )


def _folder(path: str, settings: dict[str, Any], tables: list[Any]) -> Folder:
    """A folder's kind, refused when a file of it lacks the merge state (sink format 1)."""
    written = [file_settings(t) for t in tables]
    oldest = min(s["format"] for s in written)
    if oldest < MERGEABLE_FORMAT:
        raise ValueError(
            f"load: {path!r} was written in sink format {oldest}, which lacks the merge state "
            f"that merging several folders needs (format {MERGEABLE_FORMAT} on); load it alone"
        )
    # A row's piece is known from its first recorded call on: later files name more rows.
    pieces = {name: rank for s in written for name, rank in s["pieces"].items()}
    return Folder(path, settings, settings["rank"], pieces, tables)


def _ranked(folders: list[Folder]) -> list[Folder]:
    """The folders with their ranks: as written, or without a process group their places in the
    list; each folder and each rank once."""
    resolved = [Path(f.path).resolve() for f in folders]
    for i, folder in enumerate(folders):
        if resolved[i] in resolved[:i]:
            raise ValueError(f"load: paths gives {folder.path!r} twice")
    unranked = [f for f in folders if f.rank is None]
    if len(unranked) == len(folders):
        return [f._replace(rank=i) for i, f in enumerate(folders)]
    if unranked:
        ranked = next(f for f in folders if f.rank is not None)
        raise ValueError(
            f"load: {unranked[0].path!r} was written without a process group and "
            f"{ranked.path!r} by rank {ranked.rank}; merge the folders of one run's ranks"
        )
    by_rank: dict[int, str] = {}
    for folder in folders:
        if folder.rank in by_rank:
            raise ValueError(
                f"load: {by_rank[folder.rank]!r} and {folder.path!r} were both written by rank "
                f"{folder.rank}; give each rank's folder once"
            )
        by_rank[folder.rank] = folder.path
    return folders


def _check_options(folders: list[Folder]) -> None:
    first = folders[0]
    for folder in folders[1:]:
        for key in AGREED:
            mine, theirs = folder.settings.get(key), first.settings.get(key)
            if mine != theirs:
                raise ValueError(
                    f"load: {folder.path!r} differs from {first.path!r} in {key} ({mine!r} "
                    f"against {theirs!r}); the folders merged must be the ranks of one run, "
                    "recorded with the same options"
                )


def _union_of_rows(folders: list[Folder]) -> tuple[list[str], list[str]]:
    """The row names and types: the first folder's, then those only later ones hold."""
    types: dict[str, str] = {}
    for folder in folders:
        names = folder.settings["names"]
        for name, kind in zip(names, folder.settings.get("types", [""] * len(names)), strict=True):
            types.setdefault(name, kind)
    return list(types), list(types.values())


def _columns(
    files: list[dict[str, np.ndarray]],
    settings: dict[str, Any],
    names: list[str],
    batches: np.ndarray,
    counted: torch.Tensor,
    rank: int,
) -> Columns:
    """One folder's columns on the union of rows and batches; the rows not `counted` (bool
    `(rows,)`: another folder counts their values) empty, adding nothing."""
    rows, planes, bins = len(names), state_planes(bool(settings["extra"])), settings["hist_bins"]
    state = torch.zeros(planes, rows, len(batches), dtype=torch.float64)
    hist = torch.zeros(rows, len(batches), bins, dtype=torch.int64) if bins else None
    binades = None
    if "binades" in settings["extra"]:
        binades = torch.zeros(rows, len(batches), BINADE_BINS, dtype=torch.int32)
    order = torch.zeros(2, rows, len(batches), dtype=torch.int64)
    targets = {stat: state[plane] for stat, plane in STATE_STATS.items() if plane < planes}
    targets.update(first_nonfinite_call=order[0], nonfinite_in_call=order[1])
    top = empty_top(rows, len(batches), int(settings.get("top_k", 0)))
    read_planes(
        files, names, batches, targets, {"hist": hist, "binades": binades, **top_parts(top)}
    )
    keep = counted[:, None]
    # An empty slot's mean and extremes were written NaN: its state is zeros, as a run keeps it.
    state = torch.where(keep & (state[COUNT] > 0), state, 0.0)
    hist = None if hist is None else torch.where(keep[..., None], hist, 0)
    binades = None if binades is None else torch.where(keep[..., None], binades, 0)
    order = torch.where(keep, order, 0)
    top = None if top is None else torch.where(keep[..., None, None], top, float("nan"))
    return Columns(state, hist, order, torch.full_like(order[0], rank), binades, top)


def _counted(folders: list[Folder], names: list[str], plain_replicated: bool) -> torch.Tensor:
    """bool `(folders, rows)`: whether each folder's values of each row count. Of the folders
    holding the same values only the lowest rank's do: those of a DTensor piece with the same
    lowest rank, and with `plain_replicated` (a plain parameter, the same on every rank holding
    it) every folder holding a plain row; a plain activation row is each rank's own."""
    counted = torch.zeros(len(folders), len(names), dtype=torch.bool)
    by_rank = sorted(range(len(folders)), key=lambda i: folders[i].rank)
    held = [set(folder.settings["names"]) for folder in folders]
    for row, name in enumerate(names):
        taken: set[Any] = set()
        for i in by_rank:
            if name not in held[i]:
                continue
            if name in folders[i].pieces:
                same = ("piece", folders[i].pieces[name])
            else:
                same = "plain" if plain_replicated else ("own", i)
            counted[i, row] = same not in taken
            taken.add(same)
    return counted


def _merged(a: Columns, b: Columns) -> Columns:
    """Two folders' columns merged, as `all_reduce` merges ranks, `b` of the higher rank: the
    merge states by the pairwise rule, histograms summed, and in each slot the earlier first
    non-finite call (a tie: `a`'s) with the sum of the counts (-1 where mean and std alone were
    recorded, which count none)."""
    state = merge_states([a.state, b.state])
    hist = None if a.hist is None else a.hist + b.hist
    binades = None if a.binades is None else a.binades + b.binades
    top = None if a.top is None else merged_top_pairs(a.top, b.top)
    first_a, first_b = a.order[0], b.order[0]
    earlier = (first_b > 0) & ((first_a == 0) | (first_b < first_a))
    uncounted = (a.order[1] < 0) | (b.order[1] < 0)
    order = torch.stack(
        [
            torch.where(earlier, first_b, first_a),
            torch.where(uncounted, -1, a.order[1] + b.order[1]),
        ]
    )
    return Columns(state, hist, order, torch.where(earlier, b.ranks, a.ranks), binades, top)
