"""Pictures of recorded statistics. matplotlib is imported only when a picture is drawn, and only
its object API: the global backend (a notebook's inline one, say) is never touched."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .reading import Reading

# The least height of a labelled row, in inches (x-small labels are about 0.08 in tall).
LABEL_ROW_INCHES = 0.11
# The overview's height in inches: titles and axes, then a row per module, within bounds.
OVERVIEW_FRAME_INCHES, OVERVIEW_ROW_INCHES = 2.0, 0.16


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, path: str | Path | None) -> Figure:
    if path is not None:
        fig.savefig(Path(path), dpi=100)
    return fig


def plot_stats(stats: torch.Tensor, path: str | Path, names: Sequence[str] | None = None) -> Path:
    """Save a PNG of the mean (left) and std (right) of each module over the batches.

    Examples:
        >>> plot_stats(torch.rand(2, 3, 10), "/tmp/stats.png")  # doctest: +SKIP
    """
    if stats.dim() != 3 or stats.shape[0] != 2:
        raise ValueError(f"stats must have shape (2, modules, batches), got {tuple(stats.shape)}")
    names = list(names) if names is not None else [f"module {i}" for i in range(stats.shape[1])]
    if len(names) != stats.shape[1]:
        raise ValueError(f"names must have {stats.shape[1]} entries, got {len(names)}")
    fig = _figure(13, 4.5)
    axes = fig.subplots(1, 2)
    for ax, values, title in zip(axes, stats, ("mean", "std"), strict=True):
        for name, series in zip(names, values, strict=True):
            ax.plot(series.numpy(), label=name)
        ax.set_title(f"activation {title} per batch")
        ax.set_xlabel("training batch")
    axes[1].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    path = Path(path)
    _save(fig, path)
    return path


def _robust_limits(values: torch.Tensor) -> tuple[float, float]:
    """The colour range: the 1st to 99th percentile of the finite values; for a constant panel,
    a narrow band around its value (see _constant_colour_bar)."""
    finite = values[torch.isfinite(values)].double()
    if finite.numel() == 0:
        return 0.0, 1.0
    low, high = torch.quantile(finite, torch.tensor([0.01, 0.99], dtype=torch.float64)).tolist()
    if high > low:
        return low, high
    pad = max(abs(low) * 1e-3, 1e-12)
    return low - pad, high + pad


def _module_ticks(ax: Any, names: list[str], row_inches: float) -> None:
    step = max(1, math.ceil(LABEL_ROW_INCHES / row_inches))
    ticks = list(range(0, len(names), step))
    ax.set_yticks(ticks, [names[i] for i in ticks], fontsize="x-small")
    ax.tick_params(labelleft=True)  # on every panel, not only the first of a shared axis


def overview(reading: Reading, path: str | Path | None = None) -> Figure:
    """A heat map per statistic over rows (modules or parameters, by name) and recorded batches
    (columns). Every panel names its rows; a constant panel's colour bar shows its one value;
    cells without a value (a module that did not run, a step without a gradient, or NaN) are
    grey, and the title says so."""
    planes = reading.planes()
    if reading.recorder == "ParameterStats":
        note = " (grey: no value, no gradient that step or NaN)"
        title, xlabel = f"{reading.kind} statistics per parameter", "optimizer step"
    else:
        note = " (grey: no value, the module did not run or gave NaN)"
        kind = "activation" if reading.is_forward else "gradient"
        title, xlabel = f"{kind} statistics per module", "training batch"
    return _heat_maps(planes, reading.module_names, reading.batches, xlabel, title, note, path)


def _heat_maps(
    planes: dict[str, torch.Tensor],
    names: list[str],
    batches: torch.Tensor,
    xlabel: str,
    title: str,
    note: str,
    path: str | Path | None,
) -> Figure:
    from matplotlib import colormaps
    from matplotlib.ticker import MaxNLocator

    height = min(14.0, max(3.5, OVERVIEW_FRAME_INCHES + OVERVIEW_ROW_INCHES * len(names)))
    row_inches = (height - OVERVIEW_FRAME_INCHES) / max(1, len(names))
    fig = _figure(1.5 + 3.6 * len(planes), height)
    axes = fig.subplots(1, len(planes), sharey=True, squeeze=False)[0]
    extent = None
    if batches.numel() > 0:
        extent = (batches[0].item() - 0.5, batches[-1].item() + 0.5, len(names) - 0.5, -0.5)
    cmap = colormaps["viridis"].with_extremes(bad="lightgrey")
    missing = False
    for ax, (stat, values) in zip(axes, planes.items(), strict=True):
        values = values.double()
        missing |= bool(values.isnan().any())
        low, high = _robust_limits(values)
        image = ax.imshow(
            values.numpy(),
            aspect="auto",
            interpolation="nearest",
            vmin=low,
            vmax=high,
            extent=extent,
            cmap=cmap,
        )
        ax.set_title(stat)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        bar = fig.colorbar(image, ax=ax, shrink=0.8)
        finite = values[values.isfinite()]
        if finite.numel() and bool((finite == finite[0]).all()):
            bar.set_ticks([finite[0].item()])  # constant: its value, not a made-up range
        _module_ticks(ax, names, row_inches)
    fig.suptitle(title + (note if missing else ""))
    return _save(fig, path)


def layer_stats(reading: Reading, module: int | str, path: str | Path | None = None) -> Figure:
    """Mean, std and (where recorded) near-zero fraction of one module over the batches."""
    stats = reading.layer_stats(module)
    shown = [s for s in ("mean", "std", "near_zero") if s in stats]
    fig = _figure(4.2 * len(shown), 3.6)
    axes = fig.subplots(1, len(shown), squeeze=False)[0]
    batches = reading.batches.numpy()
    for ax, stat in zip(axes, shown, strict=True):
        ax.plot(batches, stats[stat].numpy())
        ax.set_title(stat.replace("_", "-"))
        ax.set_xlabel("training batch")
        ax.grid(alpha=0.3)
    fig.suptitle(_module_title(reading, module))
    return _save(fig, path)


def color_dim(reading: Reading, module: int | str, path: str | Path | None = None) -> Figure:
    """The histogram of one module over the batches as an image, counts on a log scale."""
    counts = reading.hist[reading.module_index(module)].double().T  # bins x batches
    batches = reading.batches
    fig = _figure(8, 4)
    ax = fig.subplots()
    extent = (
        (batches[0].item() - 0.5 if batches.numel() else 0),
        (batches[-1].item() + 0.5 if batches.numel() else 1),
        reading.hist_min,
        reading.hist_max,
    )
    image = ax.imshow(
        torch.log1p(counts).numpy(),
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        extent=extent,
    )
    fig.colorbar(image, ax=ax, label="log(1 + count)")
    ax.set_xlabel("training batch")
    ax.set_ylabel("value")
    ax.set_title(f"histogram over batches: {_module_title(reading, module)}")
    return _save(fig, path)


def _module_title(reading: Reading, module: int | str) -> str:
    index = reading.module_index(module)
    return f"{reading.module_names[index]} ({reading.module_types[index]})"
