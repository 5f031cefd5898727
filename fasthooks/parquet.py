"""The Parquet layout of a sink folder: one file per drained chunk of one kind, each a long table
that `pandas.read_parquet(folder)` reads without fasthooks.

Columns: `batch` (int64: the training batch, or optimizer step), `name` (the module or
parameter), `kind` ("forward", "backward", "weight", "grad", "update"), `stat` ("mean", "std",
each extra, "count": the elements recorded, "hist": one row per bin, "first_nonfinite_call" and
"nonfinite_in_call": the call order, only for calls that held a NaN or an infinity), `bin`
(int32: the histogram bin of a "hist" row, else null) and `value` (float64). Each file's schema
metadata keeps the run's settings under the key "fasthooks".

A file is written under a hidden name and renamed into place, so a process killed while writing
leaves no partial file: the folder always loads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .sink import SinkChunk

FORMAT_VERSION = 1
METADATA_KEY = b"fasthooks"


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


def _table_parts(chunk: SinkChunk) -> list[tuple[str, dict[str, Any], Any]]:
    """(stat, its batch, name and value columns, its bins or None) for each statistic."""
    batches = chunk.batches.numpy()
    planes = {"mean": chunk.stats[0], "std": chunk.stats[1], **chunk.extra, "count": chunk.count}
    parts: list[tuple[str, dict[str, Any], Any]] = [
        (stat, _repeat_rows(values.numpy(), batches), None) for stat, values in planes.items()
    ]
    if chunk.hist is not None:
        rows, columns, bins = chunk.hist.shape
        part = {
            "batch": np.tile(np.repeat(batches, bins), rows),
            "name": np.repeat(np.arange(rows, dtype=np.int32), columns * bins),
            "value": chunk.hist.numpy().reshape(-1).astype(np.float64),
        }
        parts.append(("hist", part, np.tile(np.arange(bins, dtype=np.int32), rows * columns)))
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
    return {
        kind: (json.loads(tables[0].schema.metadata[METADATA_KEY]), tables)
        for kind, tables in by_kind.items()
    }
