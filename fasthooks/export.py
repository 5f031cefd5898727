"""Recorded statistics in other shapes for other tools (pandas imported only when asked for)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .stats import ActivationStats


def long_table(act: ActivationStats) -> Any:
    """A pandas DataFrame with one row per (batch, module, statistic): columns `batch`,
    `module`, `stat`, `value`; `batch` is the training batch's 0-based index."""
    try:
        import pandas as pd
    except ImportError as error:
        raise ImportError(
            "ActivationStats.to_dataframe needs pandas: `pip install pandas`"
        ) from error
    planes = {"mean": act.stats[0], "std": act.stats[1], **act.extra}
    batches = act.batches.tolist()
    names = act.module_names
    columns: dict[str, list] = {"batch": [], "module": [], "stat": [], "value": []}
    for stat, values in planes.items():
        for m, name in enumerate(names):
            columns["batch"] += batches
            columns["module"] += [name] * len(batches)
            columns["stat"] += [stat] * len(batches)
            columns["value"] += values[m].double().tolist()
    return pd.DataFrame(columns)
