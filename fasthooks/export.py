"""Recorded statistics in other shapes for other tools: a pandas table and TensorBoard (neither is
imported by fasthooks itself)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .moments import bin_edges

if TYPE_CHECKING:
    from .parameters import ParameterStats
    from .reading import Reading


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


# The long table's row and column names, by recorder.
_TABLE_AXES = {"ActivationStats": ("module", "batch"), "ParameterStats": ("param", "step")}


def long_table(reading: Reading) -> Any:
    """A pandas DataFrame with one row per (batch, module, statistic): columns `batch`,
    `module`, `stat`, `value` (`step` and `param` for a kind of ParameterStats); `batch` is the
    training batch's 0-based index. With `channel_stats`, also one row per (snapshot, module)
    of "dead_channels" (how many) and "channel_rms_kurtosis", at the snapshot's last batch."""
    pd = _pandas(reading.recorder)
    row, column = _TABLE_AXES[reading.recorder]
    planes = reading.planes()
    table = _long_columns(planes, reading.module_names, reading.batches.tolist(), row, column)
    if reading.channel_names:
        snapshots = {
            "dead_channels": reading.dead_channels.sum(1),
            "channel_rms_kurtosis": reading.channel_rms_kurtosis,
        }
        last = reading.channel_batches[:, 1].tolist()
        for name, values in _long_columns(
            snapshots, reading.module_names, last, row, column
        ).items():
            table[name] += values
    return pd.DataFrame(table)


def parameter_table(ps: ParameterStats) -> Any:
    """A pandas DataFrame with one row per (step, parameter, kind, statistic): columns `step`,
    `param`, `kind`, `stat`, `value`; `step` is the optimizer step's 0-based index."""
    pd = _pandas("ParameterStats")
    frames = [long_table(ps[kind]).assign(kind=kind) for kind in ps.kinds]
    return pd.concat(frames, ignore_index=True)[["step", "param", "kind", "stat", "value"]]


# The first part of every metric tag.
METRIC_KINDS = ("activations", "gradients", "parameters")


def is_metric_tag(tag: str) -> bool:
    """Whether `tag` names a statistic of `newest_metrics`."""
    return tag.split("/", 1)[0] in METRIC_KINDS


def newest_metrics(reading: Reading) -> dict[str, float]:
    """The newest recorded column of every statistic as scalars tagged
    `activations/<module>/<stat>` (`gradients/...` for gradient statistics,
    `parameters/<kind>/...` for a kind of ParameterStats); with `channel_stats`, the newest
    snapshot's "dead_channels" and "channel_rms_kurtosis" too; empty before the first column."""
    if reading.num_batches == 0:
        return {}
    planes = reading.planes()
    # One conversion per statistic, not one per module and statistic.
    newest = {stat: values[:, -1].double().tolist() for stat, values in planes.items()}
    newest.update(_newest_snapshot(reading))
    return {
        f"{reading.metric_prefix}/{name}/{stat}": values[m]
        for m, name in enumerate(reading.module_names)
        for stat, values in newest.items()
    }


def _newest_snapshot(reading: Reading) -> dict[str, list[float]]:
    """Per row, what the newest per-channel snapshot shows (nothing without one)."""
    if not reading.channel_names:
        return {}
    return {name: values.tolist() for name, values in reading.newest_channel_figures().items()}


def newest_parameter_metrics(ps: ParameterStats) -> dict[str, float]:
    """The newest recorded step of a `ParameterStats` as a few scalars: each parameter's L2 norm
    per kind, tagged `parameters/<kind>/<param>/norm`, the L2 norm over all its parameters per
    kind, `parameters/<kind>/global_norm`, and, with "update" recorded, each parameter's
    update ratio, `parameters/update_ratio/<param>`; empty before the first step."""
    if ps.num_steps == 0:
        return {}
    extra, names = ps.extra, ps.param_names
    metrics = {}
    for kind in ps.kinds:
        norms = extra[kind]["norm"][:, -1].double().tolist()
        metrics.update(zip([f"parameters/{kind}/{n}/norm" for n in names], norms, strict=True))
        metrics[f"parameters/{kind}/global_norm"] = float(ps.global_norm(kind)[-1])
    if "update" in ps.kinds:
        ratios = ps.update_ratio[:, -1].double().tolist()
        metrics.update(zip([f"parameters/update_ratio/{n}" for n in names], ratios, strict=True))
    return metrics


def log_to_tensorboard(reading: Reading, writer: Any, step: int | None = None) -> None:
    """Writes the newest recorded column of every statistic to a `SummaryWriter`, as scalars
    tagged as `newest_metrics` tags them, and the histograms where recorded; `step` defaults to
    that column's batch."""
    if reading.num_batches == 0:
        return
    step = int(reading.batches[-1]) if step is None else step
    for tag, value in newest_metrics(reading).items():
        writer.add_scalar(tag, value, step)
    if reading.hist_bins:
        hist = reading.hist
        for m, name in enumerate(reading.module_names):
            _add_histogram(
                writer, f"{reading.metric_prefix}/{name}/hist", reading, hist[m, -1], step
            )


def _add_histogram(writer: Any, tag: str, reading: Reading, counts: Any, step: int) -> None:
    """One recorded histogram, its summary figures taken from the bins themselves."""
    edges = bin_edges(reading.hist_bins, reading.hist_min, reading.hist_max)
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
