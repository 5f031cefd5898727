"""Per-channel statistics of a run: running sums over `channel_every` recorded batches, each
period kept as one snapshot.

The operator adds every hooked call's values to the open batch's per-channel sums on the
activations' device (`StatBuffers.channels`, `layout.CHANNEL_PLANES`). A training batch's sums
join those of its period when it closes (a batch closed with `train=False` drops its own), and
every `channel_every` recorded batches `ChannelSnapshots.take` keeps the period's sums, only the
channels each module has, and starts a new period: device work, no host sync. Reading pads
each module to the largest channel count with NaN. The sums (not statistics) are kept, so ranks
merge them exactly.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import torch

from .layout import (
    CHANNEL_ABSMAX,
    CHANNEL_ACTIVE,
    CHANNEL_COUNT,
    CHANNEL_PLANES,
    CHANNEL_SUM,
    CHANNEL_SUM_SQ,
)
from .moments import add_channel_sums


def channel_statistics(sums: torch.Tensor, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Each of `names` (`layout.CHANNEL_STATS`) from per-channel sums `(..., CHANNEL_PLANES,
    channels, ...)` along dim -2 of the planes, float32; NaN where a channel has no value.

    Examples:
        >>> from fasthooks.moments import channel_sums
        >>> sums = channel_sums(torch.tensor([[1.0, -3.0], [0.0, 4.0]]), 1, 2, 0.05)
        >>> {k: v.tolist() for k, v in channel_statistics(sums, ("mean", "rms", "active")).items()}
        {'mean': [0.5, 0.5], 'rms': [0.7071067690849304, 3.535533905029297], 'active': [0.5, 1.0]}
    """
    count = sums.select(-2, CHANNEL_COUNT)
    seen = count > 0
    nan = torch.full_like(count, float("nan"))
    values = {
        "absmax": lambda: sums.select(-2, CHANNEL_ABSMAX),
        "mean": lambda: sums.select(-2, CHANNEL_SUM) / count,
        "rms": lambda: (sums.select(-2, CHANNEL_SUM_SQ) / count).sqrt(),
        "active": lambda: sums.select(-2, CHANNEL_ACTIVE) / count,
    }
    return {name: torch.where(seen, values[name](), nan).float() for name in names}


def kurtosis_over_channels(values: torch.Tensor) -> torch.Tensor:
    """float32 population kurtosis (m4 / m2^2; 3 for a normal distribution) of `(..., channels,
    snapshots)` values over their channels, NaN ones left out; NaN with fewer than two values or
    no spread. Of per-channel RMS, He et al. 2024's measure of outlier features.

    Examples:
        >>> kurtosis_over_channels(torch.tensor([[1.0], [1.0], [1.0], [9.0]])).tolist()
        [2.3333332538604736]
    """
    v = values.double()
    kept = ~v.isnan()
    n = kept.sum(-2)
    zero = torch.zeros_like(v)
    mean = torch.where(kept, v, zero).sum(-2) / n
    d = torch.where(kept, v - mean.unsqueeze(-2), zero)
    m2 = (d * d).sum(-2) / n
    m4 = (d**4).sum(-2) / n
    kurtosis = m4 / (m2 * m2)
    return torch.where(
        (n > 1) & (m2 > 0), kurtosis, torch.full_like(kurtosis, float("nan"))
    ).float()


def dead_channels(active: torch.Tensor) -> torch.Tensor:
    """bool, the shape of `active` (`(..., channels, snapshots)` active fractions): channels with
    values, none of them above `near_zero`, over a whole snapshot."""
    return active == 0


class Snapshot(NamedTuple):
    """The per-channel sums of the recorded batches `first` to `last` (indices of training
    batches), `batches` of them: float64 `(CHANNEL_PLANES, kept)` on the run's device, the
    channels of `index` (positions in a `(modules, width)` grid) in order."""

    sums: torch.Tensor
    index: torch.Tensor
    width: int
    first: int
    last: int
    batches: int


class ChannelSnapshots:
    """The snapshots of one run, the newest `keep` of them (None: all), and the position in the
    current period.

    Examples:
        >>> from fasthooks.buffers import StatBuffers
        >>> from fasthooks.moments import accumulate_stats_python
        >>> b = StatBuffers(1, 1, "cpu", full=False, hist_bins=0)
        >>> b.resize_channels(2)
        >>> snapshots = ChannelSnapshots(every=2, keep=None)
        >>> def record(values):
        ...     accumulate_stats_python(torch.tensor([values]), *b.op_args(), 0, 0.05, 0.0, 1.0)
        >>> for batch in range(4):
        ...     record([1.0, -2.0])
        ...     snapshots.batch_recorded(b, batch, [2])
        ...     record([5.0, 5.0])
        ...     snapshots.batch_dropped(b)
        >>> snapshots.read(1, 2)[0, :, 1].tolist(), snapshots.bounds()
        ([[2.0, 2.0], [-4.0, -4.0], [8.0, 8.0], [2.0, 2.0], [2.0, 2.0]], [(0, 1), (2, 3)])
    """

    def __init__(self, every: int, keep: int | None) -> None:
        self.every, self.keep = every, keep
        self.held: deque[Snapshot] = deque(maxlen=keep)
        self.taken = 0  # snapshots taken, with those the window let go
        self.first: int | None = None  # the first batch of the open period
        self.last = -1  # the last batch of the open period
        self.batches = 0  # recorded batches in the open period
        self.period: torch.Tensor | None = None  # its sums, (modules, CHANNEL_PLANES, width)
        self._index: torch.Tensor | None = None
        self._index_of: tuple[tuple[int, ...], int] | None = None

    def batch_recorded(self, buffers: Any, batch: int, counts: list[int]) -> None:
        """Add the closed training batch `batch`'s sums to its period's; at the end of a period,
        take a snapshot."""
        sums = buffers.channels
        if sums.numel() > 0:
            period = self._period_like(sums)
            period.copy_(add_channel_sums(period, sums))
        buffers.clear_channels()
        self.first = batch if self.first is None else self.first
        self.last = batch
        self.batches += 1
        if self.batches == self.every:
            self.take(counts)

    def batch_dropped(self, buffers: Any) -> None:
        """Forget the sums of a batch that is not recorded (closed with `train=False`)."""
        buffers.clear_channels()

    def _period_like(self, sums: torch.Tensor) -> torch.Tensor:
        """The period's sums, grown to the width of `sums` (a module with more channels)."""
        if self.period is None or self.period.shape != sums.shape:
            grown = torch.zeros_like(sums)
            if self.period is not None:
                width = min(self.period.shape[2], sums.shape[2])
                grown[: self.period.shape[0], :, :width] = self.period[: sums.shape[0], :, :width]
            self.period = grown
        return self.period

    def take(self, counts: list[int]) -> None:
        """Keep the sums of the open period (the channels of each module's `counts`), if it
        recorded a batch, and start a new one."""
        if self.batches == 0 or self.period is None:
            return
        sums = self.period
        index = self._grid_index(counts, sums.shape[2], sums.device)
        kept = sums.permute(1, 0, 2).reshape(len(CHANNEL_PLANES), -1).index_select(1, index)
        self.held.append(Snapshot(kept, index, sums.shape[2], self.first, self.last, self.batches))
        self.taken += 1
        sums.zero_()
        self.first, self.batches = None, 0

    def _grid_index(self, counts: list[int], width: int, device: torch.device) -> torch.Tensor:
        key = (tuple(counts), width)
        if self._index_of != key:
            index = [m * width + c for m, n in enumerate(counts) for c in range(n)]
            self._index = torch.tensor(index, dtype=torch.int64, device=device)
            self._index_of = key
        return self._index

    def bounds(self) -> list[tuple[int, int]]:
        """(first, last) training batch of each snapshot held, oldest first (`take` may close a
        period early, at the end of training)."""
        return [(s.first, s.last) for s in self.held]

    def read(self, modules: int, width: int) -> torch.Tensor:
        """float64 CPU `(modules, CHANNEL_PLANES, width, snapshots)` sums of the snapshots held,
        0 for channels a module does not have (their count reads 0)."""
        out = torch.zeros(len(self.held), len(CHANNEL_PLANES), modules * width, dtype=torch.float64)
        for k, snapshot in enumerate(self.held):
            index = snapshot.index.cpu()
            rows, channels = index // snapshot.width, index % snapshot.width
            keep = (rows < modules) & (channels < width)
            out[k][:, (rows * width + channels)[keep]] = snapshot.sums.cpu()[:, keep]
        return out.reshape(len(self.held), len(CHANNEL_PLANES), modules, width).permute(2, 1, 3, 0)
