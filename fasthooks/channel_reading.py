"""What `ActivationStats` reads of its per-channel snapshots (`channel_stats=`)."""

from __future__ import annotations

from typing import Any

import torch

from .channel_stats import channel_statistics, dead_channels, kurtosis_over_channels
from .layout import CHANNEL_PLANES, CHANNEL_STATS


class ChannelReading:
    """The per-channel readers of a recorder with `_snapshots` (`ChannelSnapshots` or None),
    `channel_names` and `module_names`."""

    _snapshots: Any
    channel_names: tuple[str, ...]

    def _check_channels(self) -> None:
        if not self.channel_names:
            raise AttributeError(
                'per-channel statistics are recorded only with channel_stats=("absmax", ...)'
            )

    def _channel_sums(self, newest: int | None = None) -> torch.Tensor:
        """float64 `(modules, CHANNEL_PLANES, max_channels, snapshots)` of the snapshots held
        (the `newest` of them only, when given)."""
        modules = len(self.module_names)
        if self._snapshots is None:
            return torch.zeros(modules, len(CHANNEL_PLANES), 0, 0, dtype=torch.float64)
        return self._snapshots.read(modules, max(self.channel_counts, default=0), newest)

    def newest_channel_figures(self) -> dict[str, torch.Tensor]:
        """Of the newest snapshot only (empty without one): per row, "dead_channels" (how many,
        float64) and "channel_rms_kurtosis"; what logging reads at every log step."""
        self._check_channels()
        if self._snapshots is None or not self._snapshots.held:
            return {}
        stats = channel_statistics(self._channel_sums(newest=1).movedim(1, -2), ("active", "rms"))
        return {
            "dead_channels": dead_channels(stats["active"])[:, :, 0].sum(1).double(),
            "channel_rms_kurtosis": kurtosis_over_channels(stats["rms"])[:, 0].double(),
        }

    @property
    def channel_counts(self) -> list[int]:
        """How many channels each module's output has along its channel dimension, in row
        order (0: it has not run)."""
        self._check_channels()
        modules = len(self.module_names)
        counts = [0] * modules
        if self._snapshots is not None:
            # The snapshots held too: a merge gives rows of modules only other ranks hook.
            for seen in (self._snapshots.counts, *(s.counts for s in self._snapshots.held)):
                for row, count in enumerate(seen[:modules]):
                    counts[row] = max(counts[row], count)
        return counts

    @property
    def channel_batches(self) -> torch.Tensor:
        """int64 `(snapshots, 2)`: the first and last training batch each snapshot covers."""
        self._check_channels()
        bounds = [] if self._snapshots is None else self._snapshots.bounds()
        return torch.tensor(bounds, dtype=torch.int64).reshape(-1, 2)

    @property
    def channel_stats(self) -> dict[str, torch.Tensor]:
        """Each of `channel_stats` as float32 CPU `(modules, max_channels, snapshots)`: one column
        per `channel_every` recorded batches (the last may hold fewer), NaN past a module's
        channel count and where a module did not run."""
        self._check_channels()
        return channel_statistics(self._channel_sums().movedim(1, -2), self.channel_names)

    def _all_channel_stats(self) -> dict[str, torch.Tensor]:
        return channel_statistics(self._channel_sums().movedim(1, -2), CHANNEL_STATS)

    @property
    def dead_channels(self) -> torch.Tensor:
        """bool CPU `(modules, max_channels, snapshots)`: channels none of whose values, over a
        whole snapshot, had a magnitude above `near_zero` (whatever `channel_stats` names)."""
        self._check_channels()
        return dead_channels(self._all_channel_stats()["active"])

    @property
    def channel_rms_kurtosis(self) -> torch.Tensor:
        """float32 CPU `(modules, snapshots)`: the kurtosis over each module's channels of their
        RMS (He et al. 2024's outlier-feature measure; 3 for normal RMS, large when a few
        channels dominate)."""
        self._check_channels()
        return kurtosis_over_channels(self._all_channel_stats()["rms"])
