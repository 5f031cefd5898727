"""A recording read back from a sink folder: every batch of the run, with the reading API of the
recorder that wrote it."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .parquet import read_folder
from .reading import Reading, stepped_call_order


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
    ) -> None:
        self.kind = settings["kind"]
        self.recorder = settings["recorder"]
        self.module_names = list(settings["names"])
        self.module_types = list(settings.get("types", [""] * len(self.module_names)))
        self.extra_names = tuple(settings["extra"])
        self.hist_bins = int(settings.get("hist_bins", 0))
        self.hist_min, self.hist_max = (float(v) for v in settings.get("hist_range", (0, 1)))
        self.is_forward = self.kind != "backward"
        self.nonfinite_ranks: dict[tuple[int, str], int] = {}
        self.batches, self.stats, self.extra = batches, stats, extra
        if self.recorder == "ParameterStats" and "nonfinite" in extra:
            order = stepped_call_order(extra["nonfinite"])
        self.call_order = order
        self._hist = hist

    @property
    def num_batches(self) -> int:
        return len(self.batches)

    @property
    def hist(self) -> torch.Tensor:
        if self._hist is None:
            raise AttributeError("hist is recorded only with hist_bins > 0")
        return self._hist

    def __repr__(self) -> str:
        return (
            f"Recording(kind={self.kind!r}, rows={len(self.module_names)}, "
            f"batches={self.num_batches}, extra={list(self.extra_names)})"
        )


def _columns(table: Any) -> dict[str, np.ndarray]:
    """A file's columns, dictionary columns as their values' positions."""
    out = {}
    for name in ("batch", "bin", "value"):
        out[name] = table.column(name).to_numpy(zero_copy_only=False)
    for name in ("name", "stat"):
        column = table.column(name).combine_chunks()
        out[name] = column.indices.to_numpy(zero_copy_only=False)
        out[name + "s"] = column.dictionary.to_pylist()
    return out


def _assemble(settings: dict[str, Any], tables: list[Any]) -> Recording:
    files = [_columns(t) for t in tables]
    batches = np.unique(np.concatenate([f["batch"] for f in files]))
    names, extra_names = settings["names"], settings["extra"]
    rows, columns, bins = len(names), len(batches), int(settings.get("hist_bins", 0))
    stats = torch.full((2, rows, columns), float("nan"))
    extra = {
        name: torch.zeros(rows, columns, dtype=torch.int64)
        if name == "nonfinite"
        else torch.full((rows, columns), float("nan"))
        for name in extra_names
    }
    hist = torch.zeros(rows, columns, bins, dtype=torch.int64) if bins else None
    order = torch.zeros(2, rows, columns, dtype=torch.int64)
    planes = {
        "mean": stats[0],
        "std": stats[1],
        **extra,
        "first_nonfinite_call": order[0],
        "nonfinite_in_call": order[1],
    }
    position = {name: i for i, name in enumerate(names)}
    for f in files:
        row_of = np.array([position[n] for n in f["names"]], dtype=np.int64)
        for s, stat in enumerate(f["stats"]):
            chosen = f["stat"] == s
            r = torch.from_numpy(row_of[f["name"][chosen]])
            c = torch.from_numpy(np.searchsorted(batches, f["batch"][chosen]))
            values = torch.from_numpy(f["value"][chosen])
            if stat == "hist":
                hist[r, c, torch.from_numpy(f["bin"][chosen].astype(np.int64))] = values.long()
            elif stat in planes:
                planes[stat][r, c] = values.to(planes[stat].dtype)
    return Recording(settings, torch.from_numpy(batches), stats, extra, hist, order)


def load(path: str | os.PathLike, kind: str | None = None) -> Recording:
    """Every recorded batch of a run from its sink folder (`sink="folder"`), read-only, with the
    reading API of `ActivationStats`. `kind` picks one of several kinds in the folder ("weight",
    "grad", "update" of a `ParameterStats` run, or a forward and a backward run side by side).

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
    """
    kinds = read_folder(path)
    if kind is None:
        if len(kinds) > 1:
            raise ValueError(
                f"load: {os.fspath(path)!r} holds the kinds {sorted(kinds)}; pick one with kind="
            )
        kind = next(iter(kinds))
    if kind not in kinds:
        raise KeyError(
            f"load: kind {kind!r} is not in {os.fspath(path)!r}; it holds {sorted(kinds)}"
        )
    return _assemble(*kinds[kind])
