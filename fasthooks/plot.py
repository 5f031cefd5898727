"""Pictures of recorded statistics (matplotlib is imported only when a picture is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def plot_stats(stats: torch.Tensor, path: str | Path, names: Sequence[str] | None = None) -> Path:
    """Save a PNG of the mean (left) and std (right) of each module over the batches.

    Example:
        >>> plot_stats(torch.rand(2, 3, 10), "/tmp/stats.png")  # doctest: +SKIP
    """
    if stats.dim() != 3 or stats.shape[0] != 2:
        raise ValueError(f"stats must have shape (2, modules, batches), got {tuple(stats.shape)}")
    names = list(names) if names is not None else [f"module {i}" for i in range(stats.shape[1])]
    if len(names) != stats.shape[1]:
        raise ValueError(f"names must have {stats.shape[1]} entries, got {len(names)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, values, title in zip(axes, stats, ("mean", "std"), strict=True):
        for name, series in zip(names, values, strict=True):
            ax.plot(series.numpy(), label=name)
        ax.set_title(f"activation {title} per batch")
        ax.set_xlabel("training batch")
    axes[1].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
