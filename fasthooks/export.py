"""Recorded statistics in other shapes for other tools: a pandas table and TensorBoard (neither is
imported by fasthooks itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .moments import bin_edges

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


# The first part of every metric tag, by what was recorded.
METRIC_KINDS = {True: "activations", False: "gradients"}


def is_metric_tag(tag: str) -> bool:
    """Whether `tag` names a statistic of `newest_metrics`."""
    return tag.split("/", 1)[0] in METRIC_KINDS.values()


def newest_metrics(act: ActivationStats) -> dict[str, float]:
    """The newest recorded column of every statistic as scalars tagged
    `activations/<module>/<stat>` (`gradients/...` for gradient statistics); empty before the
    first column."""
    if act.num_batches == 0:
        return {}
    column = act.num_batches - 1
    kind = METRIC_KINDS[act.is_forward]
    planes = {"mean": act.stats[0], "std": act.stats[1], **act.extra}
    # One conversion per statistic, not one per module and statistic.
    newest = {stat: values[:, column].double().tolist() for stat, values in planes.items()}
    return {
        f"{kind}/{name}/{stat}": values[m]
        for m, name in enumerate(act.module_names)
        for stat, values in newest.items()
    }


def log_to_tensorboard(act: ActivationStats, writer: Any, step: int | None = None) -> None:
    """Writes the newest recorded column of every statistic to a `SummaryWriter`, as scalars
    tagged as `newest_metrics` tags them, and the histograms where recorded; `step` defaults to
    that column's training batch."""
    if act.num_batches == 0:
        return
    column = act.num_batches - 1
    step = int(act.batches[column]) if step is None else step
    for tag, value in newest_metrics(act).items():
        writer.add_scalar(tag, value, step)
    if act.hist_bins:
        kind = METRIC_KINDS[act.is_forward]
        for m, name in enumerate(act.module_names):
            _add_histogram(writer, f"{kind}/{name}/hist", act, act.hist[m, column], step)


def _add_histogram(writer: Any, tag: str, act: ActivationStats, counts: Any, step: int) -> None:
    """One recorded histogram, its summary figures taken from the bins themselves."""
    edges = bin_edges(act.hist_bins, act.hist_min, act.hist_max)
    centers = (edges[:-1] + edges[1:]) / 2
    counts = counts.double()
    filled = counts.nonzero().flatten()
    if filled.numel() == 0:
        return
    writer.add_histogram_raw(
        tag,
        min=float(edges[filled[0]]),
        max=float(edges[filled[-1] + 1]),
        num=int(counts.sum()),
        sum=float((counts * centers).sum()),
        sum_squares=float((counts * centers * centers).sum()),
        bucket_limits=edges[1:].tolist(),
        bucket_counts=counts.tolist(),
        global_step=step,
    )
