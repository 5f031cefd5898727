"""Which device column holds each recorded batch: every batch (the buffers double when full), or
the newest N in a ring allocated once, so that memory stays flat over a run of any length."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from .buffers import HostCopy, StatBuffers


class ColumnWindow:
    """The placement of recorded batches in the buffers' columns.

    `window=None`: the k-th recorded batch lives in column k and the buffers double when full.
    `window=N`: N + 1 columns allocated once (the newest N closed batches and the open one); the
    k-th batch lives in column k mod (N + 1). The cursor wraps on the device (`remainder_`), so
    a captured step replays into the ring; the column it enters is cleared first, after whatever
    the sink copies out of it (the same stream, so in order, with no wait).

    Examples:
        >>> w = ColumnWindow(3, expected=64)
        >>> w.capacity, [w.column(k) for k in range(6)], w.visible(6)
        (4, [0, 1, 2, 3, 0, 1], 3)
        >>> w.columns(6)
        [3, 0, 1]
    """

    def __init__(self, window: int | None, expected: int) -> None:
        self.size = window
        self.capacity = expected if window is None else window + 1

    def column(self, k: int) -> int:
        """The column of the k-th (0-based) recorded batch."""
        return k if self.size is None else k % self.capacity

    def visible(self, closed: int) -> int:
        """How many of `closed` recorded batches the buffers still hold."""
        return closed if self.size is None else min(closed, self.size)

    def columns(self, closed: int) -> list[int]:
        """The columns of the batches still held, oldest first."""
        return [self.column(k) for k in range(closed - self.visible(closed), closed)]

    def batch_ids(self) -> deque[int]:
        """An empty list of batch indices that keeps what the columns hold (flat on the host):
        with a window, the N + 1 batches of its columns as a batch closes, before one is reused."""
        return deque(maxlen=None if self.size is None else self.capacity)

    def advance(self, buffers: Iterable[StatBuffers], closed: int) -> bool:
        """After the `closed`-th batch closed, move each buffer's cursor to its next column
        (grown, or cleared for reuse); True when the buffers were reallocated."""
        grew = False
        for b in buffers:
            if self.size is None:
                if closed == b.capacity:
                    b.grow()
                    grew = True
                b.cursor.add_(1)
            else:
                b.cursor.add_(1).remainder_(b.capacity)
                if closed >= b.capacity:  # the column held batch closed - capacity
                    b.clear_column()
        return grew

    def read(self, copy: HostCopy, source: torch.Tensor, closed: int) -> torch.Tensor:
        """The held columns of `source` on the CPU, oldest first: a view of a CPU buffer or an
        incremental host copy while the columns are in order, else a gathered copy."""
        if self.size is None or closed <= self.size:
            if source.device.type == "cpu" and source.dtype == copy.dtype:
                return source.narrow(copy.axis, 0, closed)
            return copy.read(source, closed)
        index = torch.tensor(self.columns(closed), device=source.device)
        return source.index_select(copy.axis, index).to("cpu", copy.dtype)
