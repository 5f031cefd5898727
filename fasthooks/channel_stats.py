"""Per-channel statistics of a run: running sums over `channel_every` recorded batches, each
period kept as one snapshot.

The operator adds every hooked call's values to the open batch's per-channel sums on the
activations' device (`StatBuffers.channels`, `layout.CHANNEL_PLANES`). A training batch's sums
join those of its period when it closes (a batch closed with `train=False` drops its own), and
every `channel_every` recorded batches `ChannelSnapshots.take` keeps the period's sums, only the
channels each module has, on the host (from a GPU a copy into pinned memory that is not waited
for), and starts a new period: no host sync, and the device holds the running sums alone. Reading
pads
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
    batches), `batches` of them: float64 `(CHANNEL_PLANES, channels)` on the run's device, slot
    i's channels at `offsets[i]`, `counts[i]` of them (0: it never ran); `merged`: already summed
    over the ranks by `all_reduce`."""

    sums: torch.Tensor
    offsets: tuple[int, ...]
    counts: tuple[int, ...]
    first: int
    last: int
    batches: int
    merged: bool = False


class ChannelSnapshots:
    """The snapshots of one run, the newest `keep` of them (None: all), the position in the
    current period, and where each of `slots` modules' channels lie in the running sums.

    Examples:
        >>> from fasthooks.buffers import StatBuffers
        >>> from fasthooks.moments import accumulate_stats_python
        >>> b = StatBuffers(1, 1, "cpu", full=False, hist_bins=0)
        >>> snapshots = ChannelSnapshots(every=2, keep=None, slots=1)
        >>> def record(values):
        ...     x = torch.tensor([values])
        ...     offset, _ = snapshots.offset(b, 0, x.shape[-1])
        ...     accumulate_stats_python(x, *b.op_args(), 0, 0.05, 0.0, 1.0, -1, offset)
        >>> for batch in range(4):
        ...     record([1.0, -2.0])
        ...     snapshots.batch_recorded(b, batch)
        ...     record([5.0, 5.0])
        ...     snapshots.batch_dropped(b)
        >>> snapshots.read(1, 2)[0, :, :, 1].tolist(), snapshots.bounds()
        ([[2.0, 2.0], [2.0, -4.0], [2.0, 8.0], [1.0, 2.0], [2.0, 2.0]], [(0, 1), (2, 3)])
    """

    def __init__(self, every: int, keep: int | None, slots: int) -> None:
        self.every, self.keep = every, keep
        self.held: deque[Snapshot] = deque(maxlen=keep)  # on the host
        self.copying: list[Any] = []  # CUDA events of copies to the host not yet waited for
        self.taken = 0  # snapshots taken, with those the window let go
        self.first: int | None = None  # the first batch of the open period
        self.last = -1  # the last batch of the open period
        self.batches = 0  # recorded batches in the open period
        self.period: torch.Tensor | None = None  # its sums, (CHANNEL_PLANES, room)
        self.offsets, self.counts = [0] * slots, [0] * slots
        self.used = 0  # channels given to slots, holes left by a grown slot among them

    def offset(self, buffers: Any, slot: int, count: int) -> tuple[int, bool]:
        """Where `slot`'s channels start in the running sums, given room for `count` of them,
        and whether `buffers.channels` was replaced to make room (refresh the operator's
        arguments then). A slot with more channels than before moves to the end, its sums with
        it."""
        if count <= self.counts[slot]:
            return self.offsets[slot], False
        start, self.used = self.used, self.used + count
        grew = self.used > buffers.channel_room
        if grew:
            # Doubling: the first batch meets the modules one at a time.
            buffers.resize_channels(max(self.used, 2 * buffers.channel_room))
            if self.period is not None:
                self._period_like(buffers.channels)  # the period has the same room
        old, held = self.offsets[slot], self.counts[slot]
        if held:
            planes = [buffers.channels] + ([self.period] if self.period is not None else [])
            for p in planes:
                p[:, start : start + held].copy_(p[:, old : old + held])
                p[:, old : old + held].zero_()
        self.offsets[slot], self.counts[slot] = start, count
        return start, grew

    def batch_recorded(self, buffers: Any, batch: int) -> None:
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
            self.take()

    def batch_dropped(self, buffers: Any) -> None:
        """Forget the sums of a batch that is not recorded (closed with `train=False`)."""
        buffers.clear_channels()

    def _period_like(self, sums: torch.Tensor) -> torch.Tensor:
        """The period's sums, grown to the room of `sums` (room is only ever added)."""
        if self.period is None or self.period.shape != sums.shape:
            grown = torch.zeros_like(sums)
            if self.period is not None:
                grown[:, : self.period.shape[1]] = self.period
            self.period = grown
        return self.period

    def take(self) -> None:
        """Keep the sums of the open period, if it recorded a batch, and start a new one."""
        if self.batches == 0:
            return
        sums = self.period if self.period is not None else torch.zeros(len(CHANNEL_PLANES), 0)
        self.held.append(
            Snapshot(
                self._to_host(sums[:, : self.used]),
                tuple(self.offsets),
                tuple(self.counts),
                self.first,
                self.last,
                self.batches,
            )
        )
        self.taken += 1
        sums.zero_()
        self.first, self.batches = None, 0

    def _to_host(self, sums: torch.Tensor) -> torch.Tensor:
        """A host copy of a period's sums: the device keeps only the running ones, however many
        snapshots a run takes. From a GPU into pinned memory, without waiting: `ready` does."""
        if sums.device.type != "cuda":
            return sums.to("cpu", copy=True)
        host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.copying = [e for e in self.copying if not e.query()] + [copied]
        return host

    def ready(self) -> deque[Snapshot]:
        """The snapshots held, once every copy to the host has arrived."""
        for copied in self.copying:
            copied.synchronize()
        self.copying = []
        return self.held

    def state(self) -> dict[str, Any]:
        """The snapshots held and the open period, as CPU tensors and plain values (a checkpoint
        is taken between batches: the open batch's sums are not in it)."""
        period = self.period
        if period is None:  # no batch closed yet: the regions given so far, empty
            period = torch.zeros(len(CHANNEL_PLANES), self.used, dtype=torch.float64)
        return {
            "held": [
                {
                    **s._asdict(),
                    "sums": s.sums.cpu(),
                    "offsets": list(s.offsets),
                    "counts": list(s.counts),
                }
                for s in self.ready()
            ],
            "taken": self.taken,
            "period": period[:, : self.used].to("cpu", copy=True),  # take() zeroes the live one
            "first": -1 if self.first is None else self.first,
            "last": self.last,
            "batches": self.batches,
            "offsets": list(self.offsets),
            "counts": list(self.counts),
        }

    def restore(self, saved: dict[str, Any], buffers: Any) -> None:
        """Continue after `state()`'s snapshots and open period, on `buffers`' device."""
        device = buffers.channels.device
        for s in saved["held"]:
            sums = s["sums"]
            offsets, counts = tuple(s["offsets"]), tuple(s["counts"])
            merged = s.get("merged", False)
            self.held.append(
                Snapshot(sums, offsets, counts, s["first"], s["last"], s["batches"], merged)
            )
        self.taken = saved["taken"]
        self.first = None if saved["first"] < 0 else saved["first"]
        self.last, self.batches = saved["last"], saved["batches"]
        self.offsets, self.counts = list(saved["offsets"]), list(saved["counts"])
        period = saved["period"]
        self.used = period.shape[1]
        if self.used:
            buffers.resize_channels(self.used)
            self.period = period.to(device=device, dtype=torch.float64)

    def bounds(self) -> list[tuple[int, int]]:
        """(first, last) training batch of each snapshot held, oldest first (`take` may close a
        period early, at the end of training)."""
        return [(s.first, s.last) for s in self.held]

    def read(self, modules: int, width: int, newest: int | None = None) -> torch.Tensor:
        """float64 CPU `(modules, CHANNEL_PLANES, width, snapshots)` sums of the snapshots held
        (the `newest` of them only, when given), 0 for channels a module does not have (their
        count reads 0)."""
        held = list(self.ready())
        held = held[len(held) - min(newest, len(held)) :] if newest is not None else held
        out = torch.zeros(modules, len(CHANNEL_PLANES), width, len(held), dtype=torch.float64)
        for k, snapshot in enumerate(held):
            sums = snapshot.sums
            regions = zip(snapshot.offsets, snapshot.counts, strict=True)
            for slot, (start, count) in enumerate(regions):
                n = min(count, width)
                if slot < modules and n:
                    out[slot, :, :n, k] = sums[:, start : start + n]
        return out
