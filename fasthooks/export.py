"""Recorded statistics in other shapes for other tools: a pandas table and TensorBoard (neither is
imported by fasthooks itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .moments import bin_edges

if TYPE_CHECKING:
    from .parameters import ParameterStats
    from .stats import ActivationStats


def _pandas(what: str) -> Any:
    try:
        import pandas as pd
    except ImportError as error:
        raise ImportError(f"{what}.to_dataframe needs pandas: `pip install pandas`") from error
    return pd


def _long_columns(
    planes: dict[str, Any], names: list[str], columns: list[int], row: str, column: str
) -> dict[str, list]:
    """One row per (column, name, statistic) of `(names, columns)` planes."""
    table: dict[str, list] = {column: [], row: [], "stat": [], "value": []}
    for stat, values in planes.items():
        for m, name in enumerate(names):
            table[column] += columns
            table[row] += [name] * len(columns)
            table["stat"] += [stat] * len(columns)
            table["value"] += values[m].double().tolist()
    return table


def long_table(act: ActivationStats) -> Any:
    """A pandas DataFrame with one row per (batch, module, statistic): columns `batch`,
    `module`, `stat`, `value`; `batch` is the training batch's 0-based index."""
    pd = _pandas("ActivationStats")
    planes = {"mean": act.stats[0], "std": act.stats[1], **act.extra}
    return pd.DataFrame(
        _long_columns(planes, act.module_names, act.batches.tolist(), "module", "batch")
    )


def parameter_table(ps: ParameterStats) -> Any:
    """A pandas DataFrame with one row per (step, parameter, kind, statistic): columns `step`,
    `param`, `kind`, `stat`, `value`; `step` is the optimizer step's 0-based index."""
    pd = _pandas("ParameterStats")
    stats, extra, steps = ps.stats, ps.extra, ps.steps.tolist()
    frames = []
    for kind in ps.kinds:
        planes = {"mean": stats[kind][0], "std": stats[kind][1], **extra[kind]}
        table = _long_columns(planes, ps.param_names, steps, "param", "step")
        frames.append(pd.DataFrame({**table, "kind": [kind] * len(table["step"])}))
    return pd.concat(frames, ignore_index=True)[["step", "param", "kind", "stat", "value"]]


def log_parameters_to_tensorboard(ps: ParameterStats, writer: Any, step: int | None = None) -> None:
    """The newest recorded column of every statistic of every kind as scalars tagged
    `parameters/<kind>/<name>/<stat>`, and the histograms where recorded."""
    if ps.num_steps == 0:
        return
    column = ps.num_steps - 1
    step = int(ps.steps[column]) if step is None else step
    stats, extra = ps.stats, ps.extra
    hist = ps.hist if ps.hist_bins else {}
    for kind in ps.kinds:
        planes = {"mean": stats[kind][0], "std": stats[kind][1], **extra[kind]}
        newest = {stat: values[:, column].double().tolist() for stat, values in planes.items()}
        for m, name in enumerate(ps.param_names):
            for stat, values in newest.items():
                writer.add_scalar(f"parameters/{kind}/{name}/{stat}", values[m], step)
            if kind in hist:
                _add_histogram(
                    writer, f"parameters/{kind}/{name}/hist", ps, hist[kind][m, column], step
                )


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


def _add_histogram(
    writer: Any, tag: str, act: ActivationStats | ParameterStats, counts: Any, step: int
) -> None:
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
