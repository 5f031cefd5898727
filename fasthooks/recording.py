"""A recording read back from a sink folder: every batch of the run, with the reading API of the
recorder that wrote it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .layout import BINADE_BINS, COUNTED_EXTRAS
from .parquet import file_columns, read_folder, read_planes
from .reading import Reading, stepped_call_order

Paths = str | os.PathLike | Sequence[str | os.PathLike]


class Recording(Reading):
    """Recorded statistics of one kind held on the host, read-only: what `fasthooks.load` gives.

    The reading API is `ActivationStats`': `stats` `(2, rows, batches)`, `extra[name]`,
    `hist`, `batches`, `num_batches`, `module_names` (the modules, or the parameters of a
    `ParameterStats` run), `module_index`, `layer_stats`, `call_order`, `first_nonfinite`,
    `summary`, `to_dataframe`, `plot`, `plot_layer_stats`, `color_dim`.
    """

    def __init__(
        self,
        settings: dict[str, Any],
        batches: torch.Tensor,
        stats: torch.Tensor,
        extra: dict[str, torch.Tensor],
        hist: torch.Tensor | None,
        order: torch.Tensor,
        nonfinite_ranks: dict[tuple[int, str], int] | None = None,
        binades: torch.Tensor | None = None,
        largest: torch.Tensor | None = None,
        top: torch.Tensor | None = None,
    ) -> None:
        self.kind = settings["kind"]
        self.recorder = settings["recorder"]
        self.module_names = list(settings["names"])
        self.module_types = list(settings.get("types", [""] * len(self.module_names)))
        self.extra_names = tuple(settings["extra"])
        self.hist_bins = int(settings.get("hist_bins", 0))
        self.hist_min, self.hist_max = (float(v) for v in settings.get("hist_range", (0, 1)))
        self.is_forward = self.kind != "backward"
        self.nonfinite_ranks = {} if nonfinite_ranks is None else nonfinite_ranks
        self.batches, self.stats, self.extra = batches, stats, extra
        if self.recorder == "ParameterStats" and "nonfinite" in extra:
            order = stepped_call_order(extra["nonfinite"])
        self.call_order = order
        self._hist, self._binades, self._largest = hist, binades, largest
        self.top_k = int(settings.get("top_k", 0))
        self._top = top

    @property
    def num_batches(self) -> int:
        return len(self.batches)

    @property
    def hist(self) -> torch.Tensor:
        if self._hist is None:
            raise AttributeError("hist is recorded only with hist_bins > 0")
        return self._hist

    def _largest_magnitude(self) -> torch.Tensor:
        return super()._largest_magnitude() if self._largest is None else self._largest

    @property
    def binades(self) -> torch.Tensor:
        if self._binades is None:
            raise AttributeError('binades are recorded only with extra=("binades", ...)')
        return self._binades

    @property
    def top(self) -> torch.Tensor:
        if self._top is None:
            raise AttributeError("top values are recorded only with top_k > 0")
        return self._top

    def __repr__(self) -> str:
        return (
            f"Recording(kind={self.kind!r}, rows={len(self.module_names)}, "
            f"batches={self.num_batches}, extra={list(self.extra_names)})"
        )


def _assemble(settings: dict[str, Any], tables: list[Any]) -> Recording:
    """One folder's recording, from the finalised statistics its files keep (any format)."""
    files = [file_columns(t) for t in tables]
    batches = np.unique(np.concatenate([f["batch"] for f in files]))
    names, extra_names = settings["names"], settings["extra"]
    rows, columns, bins = len(names), len(batches), int(settings.get("hist_bins", 0))
    stats = torch.full((2, rows, columns), float("nan"))
    extra = {
        name: torch.zeros(rows, columns, dtype=torch.int64)
        if name == "nonfinite"
        else torch.full((rows, columns), float("nan"))
        for name in extra_names
        if name not in COUNTED_EXTRAS
    }
    hist = torch.zeros(rows, columns, bins, dtype=torch.int64) if bins else None
    binades = largest = None
    extremes = {}
    if "binades" in extra_names:  # format_fit reads the largest magnitude too
        binades = torch.zeros(rows, columns, BINADE_BINS, dtype=torch.int32)
        extremes = {name: torch.full((rows, columns), float("nan")) for name in ("min", "max")}
    order = torch.zeros(2, rows, columns, dtype=torch.int64)
    planes = {
        "mean": stats[0],
        "std": stats[1],
        **extremes,
        **extra,
        "first_nonfinite_call": order[0],
        "nonfinite_in_call": order[1],
    }
    top = empty_top(rows, columns, int(settings.get("top_k", 0)))
    read_planes(files, names, batches, planes, {"hist": hist, "binades": binades, **top_parts(top)})
    if extremes:
        largest = torch.maximum(planes["min"].abs(), planes["max"].abs())
    batches = torch.from_numpy(batches)
    return Recording(settings, batches, stats, extra, hist, order, None, binades, largest, top)


def empty_top(rows: int, columns: int, k: int) -> torch.Tensor | None:
    """NaN top pairs `(rows, columns, k, 2)` to read a sink's into, None without `top_k`."""
    return torch.full((rows, columns, k, 2), float("nan"), dtype=torch.float64) if k else None


def top_parts(top: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The stats of a sink's top rows ("top_value", "top_channel") as views of `top`."""
    return {} if top is None else {"top_value": top[..., 0], "top_channel": top[..., 1]}


def _kind_of(folder: str | os.PathLike, kind: str | None) -> tuple[dict[str, Any], list[Any]]:
    """(settings, files) of one kind of a sink folder: `kind`, or the only one it holds."""
    kinds = read_folder(folder)
    if kind is None:
        if len(kinds) > 1:
            raise ValueError(
                f"load: {os.fspath(folder)!r} holds the kinds {sorted(kinds)}; pick one with kind="
            )
        kind = next(iter(kinds))
    if kind not in kinds:
        raise KeyError(
            f"load: kind {kind!r} is not in {os.fspath(folder)!r}; it holds {sorted(kinds)}"
        )
    return kinds[kind]


def load(paths: Paths, kind: str | None = None) -> Recording:
    """Every recorded batch of a run from its sink folder (`sink="folder"`), read-only, with the
    reading API of `ActivationStats`. `kind` picks one of several kinds in the folder ("weight",
    "grad", "update" of a `ParameterStats` run, or a forward and a backward run side by side).

    A list of folders, one per rank of a distributed run (`sink=f"run/rank{rank}"`), loads as
    one recording merged exactly as `all_reduce` merges the ranks: rows by name (the first
    folder's, then names only later ones hold), batches the union (a batch a rank lacks is empty
    there), a replicated piece of a DTensor or a plain parameter counted once, and
    `first_nonfinite()` naming the rank (a folder written without a process group counts as the
    rank of its place in the list). The folders must be written with the same options.

    Examples:
        >>> import tempfile
        >>> from torch import nn
        >>> from fasthooks import ActivationStats
        >>> model, folder = nn.Sequential(nn.Linear(4, 4)), tempfile.mkdtemp()
        >>> with ActivationStats(model, backend="python", window=2, sink=folder) as act:
        ...     for _ in range(5):
        ...         _ = model(torch.randn(8, 4))
        ...         act.on_batch_end()
        >>> act.stats.shape, load(folder).stats.shape
        (torch.Size([2, 1, 2]), torch.Size([2, 1, 5]))

        Two ranks' folders, each rank with half of a batch, merge into the whole batch's:

        >>> x, folders = torch.randn(8, 4), [tempfile.mkdtemp(), tempfile.mkdtemp()]
        >>> for half, rank_folder in zip(x.split(4), folders):
        ...     with ActivationStats(model, backend="python", sink=rank_folder) as act:
        ...         _ = model(half)
        ...         act.on_batch_end()
        >>> whole = model(x).detach()
        >>> torch.allclose(load(folders).stats[:, 0, 0], torch.stack([whole.mean(), whole.std()]))
        True
    """
    folders = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not folders:
        raise ValueError("load: paths is empty; give a sink folder or a list of them")
    first = _kind_of(folders[0], kind)
    if len(folders) == 1:
        return _assemble(*first)
    # The first folder's kind is every folder's.
    runs = [first] + [_kind_of(folder, first[0]["kind"]) for folder in folders[1:]]
    from .sink_merge import merge_folders

    return merge_folders([os.fspath(f) for f in folders], runs)
