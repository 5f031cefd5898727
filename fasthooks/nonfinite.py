"""Where a run first went non-finite, read from the call order the operator keeps on the device,
and the watch that reports it during training without waiting for the device."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from .stats import ActivationStats

POLICIES = (None, "warn", "raise")
# Recorded batches of the module's statistics a report shows, up to the non-finite one.
REPORT_FRAMES = 5
_NONE = torch.iinfo(torch.int64).max


class NonFinite(NamedTuple):
    """The first hooked call that held a NaN or an infinity.

    `batch`: the training batch (its 0-based index, as `act.batches`); `module`: the hooked
    module's qualified name; `direction`: "forward" (its output) or "backward" (its output's
    gradient), or for a kind of ParameterStats its name ("weight", "grad", "update", with the
    parameter's name in `module` and the optimizer step in `batch`); `count`: how many elements
    of that call were NaN or infinite (None when only mean and std are recorded, which do not
    count them); `rank`: after `all_reduce`, the rank it was found on (else None).
    """

    batch: int
    module: str
    direction: str
    count: int | None
    rank: int | None = None


class NonFiniteError(RuntimeError):
    """Raised by `on_batch_end` with `on_nonfinite="raise"`; `.report` is the NonFiniteReport."""

    def __init__(self, report: NonFiniteReport) -> None:
        super().__init__(str(report))
        self.report = report


class NonFiniteWarning(RuntimeWarning):
    """Warned once by a run with `on_nonfinite="warn"`."""


class NonFiniteReport(NamedTuple):
    """What `on_nonfinite` reports: where (a NonFinite), and that module's statistics over its
    last recorded batches up to that one (`frames`: "batch", "mean", "std" and each extra, as
    CPU tensors)."""

    where: NonFinite
    module_type: str
    frames: dict[str, torch.Tensor]

    def __str__(self) -> str:
        w = self.where
        count = "an unknown number of" if w.count is None else f"{w.count}"
        rank = "" if w.rank is None else f" on rank {w.rank}"
        lines = [
            f"non-finite values in training batch {w.batch}{rank}: first in module {w.module!r} "
            f"({self.module_type}), {w.direction}, with {count} NaN or infinite elements. "
            f"Its statistics over its last {len(self.frames['batch'])} recorded batches:",
            "".join(f"{name:>12}" for name in self.frames),
        ]
        for row in zip(*(values.tolist() for values in self.frames.values()), strict=True):
            lines.append("".join(f"{v:>12}" if isinstance(v, int) else f"{v:>12.4g}" for v in row))
        return "\n".join(lines)


def check_policy(policy: Any) -> Any:
    """`on_nonfinite` as given, when it is one of POLICIES or a callable."""
    if policy in POLICIES or callable(policy):
        return policy
    raise ValueError(
        f"on_nonfinite must be None, 'warn', 'raise' or a callable taking the report, got "
        f"{policy!r}"
    )


def earliest(order: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(column, module, clock, count) of the earliest call noted in an int64 CPU order buffer
    `(2, modules, columns)` (`layout.ORDER_PLANES`): its first column with a non-finite call,
    and the call of that column that took the clock first; None when there is none.

    Examples:
        >>> order = torch.zeros(2, 3, 4, dtype=torch.int64)
        >>> order[:, 2, 1] = torch.tensor([8, 5]); order[:, 0, 1] = torch.tensor([9, 1])
        >>> earliest(order)
        (1, 2, 7, 5)
    """
    first = order[0]
    columns = (first > 0).any(0).nonzero()
    if len(columns) == 0:
        return None
    column = int(columns[0])
    positions = first[:, column]
    module = int(torch.where(positions > 0, positions, _NONE).argmin())
    return column, module, int(positions[module]) - 1, int(order[1, module, column])


def candidates(act: ActivationStats) -> list[tuple[tuple[int, int, int], NonFinite]]:
    """A run's earliest non-finite call, with the key that orders runs: (batch, clock, rank);
    after `all_reduce`, the earliest over the ranks merged, naming the rank."""
    hit = earliest(act.call_order)
    if hit is None:
        return []
    column, module, clock, count = hit
    batch, name = int(act.batches[column]), act.module_names[module]
    rank = act.nonfinite_ranks.get((batch, name))
    where = NonFinite(batch, name, act.kind, None if count < 0 else count, rank)
    return [((batch, clock, -1 if rank is None else rank), where)]


def first_nonfinite(*runs: ActivationStats) -> NonFinite | None:
    """The first call that held a NaN or an infinity over several runs of one model (a forward
    and a backward `ActivationStats`, say): the earliest batch, then within it the call that ran
    first (every hooked call on a device takes a position on that device's call clock).

    Examples:
        >>> from torch import nn
        >>> from fasthooks import ActivationStats
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> forward = ActivationStats(model, backend="python")
        >>> backward = ActivationStats(model, backend="python", is_forward=False)
        >>> with forward, backward:
        ...     model(torch.tensor([[1.0, float("inf")]])).sum().backward()
        ...     forward.on_batch_end(); backward.on_batch_end()
        >>> first_nonfinite(backward, forward)
        NonFinite(batch=0, module='0', direction='forward', count=None, rank=None)
    """
    found = [hit for run in runs for hit in candidates(run)]
    return min(found, key=lambda hit: hit[0])[1] if found else None


def report_for(act: ActivationStats, where: NonFinite) -> NonFiniteReport:
    """The report of a run's first non-finite call: where, and that module's last frames."""
    index = act.module_index(where.module)
    column = act.batches.tolist().index(where.batch)
    start = max(0, column - REPORT_FRAMES + 1)
    frames = {"batch": act.batches[start : column + 1]}
    frames.update({name: v[start : column + 1] for name, v in act.layer_stats(index).items()})
    module_type = act.module_types[index]
    return NonFiniteReport(where, module_type, frames)


class NonFiniteWatch:
    """Looks at each recorded batch's call order for `on_nonfinite` without stalling the device.

    On CUDA, each closed batch's column of first positions (an int64 per module) is copied
    without blocking into pinned host memory behind an event; the next `on_batch_end` looks at
    every copy whose event has completed, so a report comes a batch late and the device never
    waits. On the CPU the column is looked at as the batch closes.
    """

    def __init__(self, policy: str | Callable[[NonFiniteReport], Any] | None) -> None:
        self.policy = check_policy(policy)
        self.reset()

    def reset(self) -> None:
        self.fired = False
        self._pending: deque[tuple[torch.Tensor, torch.cuda.Event]] = deque()
        self._free: list[torch.Tensor] = []

    def batch_closed(self, act: ActivationStats, order: torch.Tensor, column: int) -> None:
        """Called as a training batch's column closes (before the cursor moves past it)."""
        if self.policy is None or self.fired:
            return
        if order.device.type == "cpu":
            # Through numpy: a tenth of the cost of tensor ops on a few values, on every batch.
            self._look(act, order.numpy()[0, :, column])
            return
        positions = order[0, :, column]
        if order.device.type != "cuda":  # no events to wait on: looked at now
            self._look(act, positions.cpu())
            return
        self.poll(act)
        if self._free:
            host = self._free.pop()
        else:
            host = torch.empty(positions.shape, dtype=positions.dtype, pin_memory=True)
        host.copy_(positions, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event))

    def poll(self, act: ActivationStats, wait: bool = False) -> None:
        """Look at the copies that have arrived (all of them, waiting, with `wait`)."""
        while self._pending and not self.fired and (wait or self._pending[0][1].query()):
            host, event = self._pending.popleft()
            event.synchronize()
            self._look(act, host)
            self._free.append(host)
        if self.fired:
            self._pending.clear()

    def _look(self, act: ActivationStats, positions: Any) -> None:
        """Report when `positions` (a tensor or an array of first positions) notes a call."""
        if self.fired or not (positions > 0).any():
            return
        self.fired = True
        report = report_for(act, act.first_nonfinite())
        if self.policy == "raise":
            raise NonFiniteError(report)
        if self.policy == "warn":
            warnings.warn(f"ActivationStats: {report}", NonFiniteWarning, stacklevel=4)
        else:
            self.policy(report)
