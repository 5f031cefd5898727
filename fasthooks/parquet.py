"""The Parquet layout of a sink folder: one file per drained chunk of one kind, each a long table
that `pandas.read_parquet(folder)` reads without fasthooks.

Columns: `batch` (int64: the training batch, or optimizer step), `name` (the module or
parameter), `kind` ("forward", "backward", "weight", "grad", "update"), `stat` ("mean", "std",
each extra, "count": the elements recorded, "hist": one row per bin, "binades": one row per bin of
`layout.BINADE_NAMES`, "top_value" and "top_channel": with `top_k`, one row per place of the
k values of largest magnitude (place 0 the largest), "first_nonfinite_call" and
"nonfinite_in_call": the call order, only for calls that held a NaN or an infinity), `bin`
(int32: the bin of a "hist" or "binades" row, the place of a "top_value" or "top_channel" row,
else null) and `value` (float64). Each file's schema metadata keeps the run's settings under the
key "fasthooks".

Format 2 keeps each slot's float64 merge state too, from which `fasthooks.load` merges several
ranks' folders exactly: "mean" and "std" are written from it in float64, with "m2" (the sum of
squared deviations from the mean) and, in a run with extras, "m3" and "m4" (the sums of their
cubes and fourth powers), "min" and "max" (whatever the extras asked), "near_zero_count" (how
many elements were at most the near-zero threshold) and "nonfinite" (how many were NaN or
infinite); a slot with no element has count 0 and NaN mean, std, min and max. The settings add
"rank" (the process's rank, None without a process group) and "pieces": for each row recorded
from a DTensor's local piece, the lowest rank holding the same values. A format 1 folder lacks
all this and loads alone.

A file is written under a hidden name and renamed into place, so a process killed while writing
leaves no partial file: the folder always loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .layout import COUNT, M2, M3, M4, MAX, MEAN, MIN, NEAR_ZERO, NONFINITE
from .moments import finalise

if TYPE_CHECKING:
    from .sink import SinkChunk

FORMAT_VERSION = 2
# The first format that keeps the merge state.
MERGEABLE_FORMAT = 2
METADATA_KEY = b"fasthooks"
# The merge state planes a file keeps, by the stat that names each.
STATE_STATS = {
    "count": COUNT,
    "mean": MEAN,
    "m2": M2,
    "m3": M3,
    "m4": M4,
    "min": MIN,
    "max": MAX,
    "near_zero_count": NEAR_ZERO,
    "nonfinite": NONFINITE,
}


def require_pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError as error:
        raise ImportError(
            "a sink folder is written as Parquet and needs pyarrow: "
            "`pip install fasthooks[sink]` (or pass a callable as sink=)"
        ) from error
    return pyarrow


def _file_name(kind: str, first: int, last: int) -> str:
    return f"{kind}-{first:012d}-{last:012d}.parquet"


def _first_batch(path: Path) -> int:
    return int(path.stem.split("-")[1])


def prepare_folder(folder: str, describe: dict[str, Any], through: int) -> None:
    """Create the folder; drop this run's kinds' files of batches after `through` (-1: all),
    which a resumed run records again (a new run starts its kinds afresh)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    for kind in describe["kinds"]:
        for old in path.glob(f"{kind}-*.parquet"):
            if _first_batch(old) > through:
                old.unlink()


def _repeat_rows(values: np.ndarray, batches: np.ndarray) -> dict[str, Any]:
    rows, columns = values.shape
    return {
        "batch": np.tile(batches, rows),
        "name": np.repeat(np.arange(rows, dtype=np.int32), columns),
        "value": values.reshape(-1).astype(np.float64),
    }


def _planes(chunk: SinkChunk) -> dict[str, torch.Tensor]:
    """Every statistic of each slot but the histogram and the call order, by name: mean and std
    in float64, the extras not in the state, then the merge state."""
    state = chunk.state
    stats, _ = finalise(state, torch.float64)
    planes = {"mean": stats[0], "std": stats[1]}
    planes.update({name: v for name, v in chunk.extra.items() if name not in STATE_STATS})
    empty = state[COUNT] == 0
    for stat, plane in STATE_STATS.items():
        if plane < state.shape[0] and stat not in planes:
            values = state[plane]
            if plane in (MIN, MAX):  # an empty slot's read NaN, as finalised, not the fill 0
                values = values.masked_fill(empty, float("nan"))
            planes[stat] = values
    return planes


def _table_parts(chunk: SinkChunk) -> list[tuple[str, dict[str, Any], Any]]:
    """(stat, its batch, name and value columns, its bins or None) for each statistic."""
    batches = chunk.batches.numpy()
    planes = _planes(chunk)
    parts: list[tuple[str, dict[str, Any], Any]] = [
        (stat, _repeat_rows(values.numpy(), batches), None) for stat, values in planes.items()
    ]
    binned = [("hist", chunk.hist), ("binades", chunk.binades)]
    if chunk.top is not None:
        binned += [("top_value", chunk.top[..., 0]), ("top_channel", chunk.top[..., 1])]
    for stat, counts in binned:
        if counts is None:
            continue
        rows, columns, bins = counts.shape
        part = {
            "batch": np.tile(np.repeat(batches, bins), rows),
            "name": np.repeat(np.arange(rows, dtype=np.int32), columns * bins),
            "value": counts.numpy().reshape(-1).astype(np.float64),
        }
        parts.append((stat, part, np.tile(np.arange(bins, dtype=np.int32), rows * columns)))
    if chunk.order is not None:
        rows, columns = np.nonzero(chunk.order[0].numpy() > 0)
        for stat, plane in (("first_nonfinite_call", 0), ("nonfinite_in_call", 1)):
            part = {
                "batch": batches[columns],
                "name": rows.astype(np.int32),
                "value": chunk.order[plane].numpy()[rows, columns].astype(np.float64),
            }
            parts.append((stat, part, None))
    return parts


def write_chunk(folder: str, chunk: SinkChunk, describe: dict[str, Any]) -> None:
    """Write one chunk as a Parquet file of the folder, renamed into place once complete."""
    pa = require_pyarrow()
    import pyarrow.parquet as pq

    parts = _table_parts(chunk)
    stats = [stat for stat, _, _ in parts]
    columns: dict[str, list] = {k: [] for k in ("batch", "name", "stat", "bin", "value")}
    for index, (_, part, bins) in enumerate(parts):
        n = len(part["batch"])
        columns["batch"].append(part["batch"].astype(np.int64))
        columns["name"].append(part["name"])
        columns["stat"].append(np.full(n, index, dtype=np.int32))
        columns["bin"].append(pa.nulls(n, pa.int32()) if bins is None else pa.array(bins))
        columns["value"].append(part["value"])
    names = pa.array(chunk.names, pa.string())
    n = sum(len(b) for b in columns["batch"])
    table = pa.table(
        {
            "batch": pa.array(np.concatenate(columns["batch"])),
            "name": pa.DictionaryArray.from_arrays(
                pa.array(np.concatenate(columns["name"])), names
            ),
            "kind": pa.DictionaryArray.from_arrays(
                pa.array(np.zeros(n, dtype=np.int32)), pa.array([chunk.kind])
            ),
            "stat": pa.DictionaryArray.from_arrays(
                pa.array(np.concatenate(columns["stat"])), pa.array(stats)
            ),
            "bin": pa.concat_arrays(columns["bin"]),
            "value": pa.array(np.concatenate(columns["value"])),
        }
    )
    settings = {"format": FORMAT_VERSION, **describe, "kind": chunk.kind}
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(settings).encode()})
    batches = chunk.batches.tolist()
    final = Path(folder) / _file_name(chunk.kind, batches[0], batches[-1])
    hidden = final.with_name(f".{final.name}.partial")
    pq.write_table(table, hidden, compression="zstd")
    os.replace(hidden, final)


def file_settings(table: Any) -> dict[str, Any]:
    """The run's settings a file keeps (its "format" among them)."""
    return json.loads(table.schema.metadata[METADATA_KEY])


def file_columns(table: Any) -> dict[str, np.ndarray]:
    """A file's columns as arrays, its dictionary columns ("name", "stat") as the positions of
    their values, which "names" and "stats" list."""
    out = {}
    for name in ("batch", "bin", "value"):
        out[name] = table.column(name).to_numpy(zero_copy_only=False)
    for name in ("name", "stat"):
        column = table.column(name).combine_chunks()
        out[name] = column.indices.to_numpy(zero_copy_only=False)
        out[name + "s"] = column.dictionary.to_pylist()
    return out


def read_planes(
    files: list[dict[str, np.ndarray]],
    names: list[str],
    batches: np.ndarray,
    planes: dict[str, torch.Tensor],
    binned: dict[str, torch.Tensor | None],
) -> None:
    """Place the values of a kind's files (`file_columns`) by stat into `planes`, each
    `(rows, batches)` and cast to its dtype, and the rows of the stats with bins ("hist",
    "binades") into `binned[stat]` `(rows, batches, bins)`; rows by `names`, columns by the
    sorted `batches`. Other stats are left out."""
    position = {name: i for i, name in enumerate(names)}
    for f in files:
        row_of = np.array([position[n] for n in f["names"]], dtype=np.int64)
        for s, stat in enumerate(f["stats"]):
            target = binned.get(stat) if stat in binned else planes.get(stat)
            if target is None:
                continue
            chosen = f["stat"] == s
            r = torch.from_numpy(row_of[f["name"][chosen]])
            c = torch.from_numpy(np.searchsorted(batches, f["batch"][chosen]))
            values = torch.from_numpy(f["value"][chosen]).to(target.dtype)
            if stat in binned:
                target[r, c, torch.from_numpy(f["bin"][chosen].astype(np.int64))] = values
            else:
                target[r, c] = values


def read_folder(folder: str | os.PathLike) -> dict[str, tuple[dict[str, Any], list[Any]]]:
    """Per kind, (the run's settings, the pyarrow tables of its files), from a sink folder."""
    require_pyarrow()
    import pyarrow.parquet as pq

    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"load: {os.fspath(folder)!r} is not a folder")
    by_kind: dict[str, list[Any]] = {}
    for file in sorted(path.glob("*-*-*.parquet")):
        by_kind.setdefault(file.name.split("-")[0], []).append(pq.read_table(file))
    if not by_kind:
        raise FileNotFoundError(f"load: no recorded columns in {os.fspath(folder)!r}")
    for tables in by_kind.values():
        written = max(file_settings(t)["format"] for t in tables)
        if written > FORMAT_VERSION:
            raise ValueError(
                f"load: {os.fspath(folder)!r} was written in sink format {written}, newer than "
                f"this fasthooks reads ({FORMAT_VERSION}): upgrade fasthooks"
            )
    return {kind: (file_settings(tables[0]), tables) for kind, tables in by_kind.items()}
