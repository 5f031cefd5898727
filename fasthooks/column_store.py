"""The recorded columns of one run: the core both recorders compose.

`ActivationStats` (hooks -> slots) and `ParameterStats` (optimizer steps -> slots) each own one
`ColumnStore`: a `StatBuffers` per kind on one device, the window that places each recorded
batch in a column, the drain that sends columns to a sink, reading in order, and the columns a
checkpoint keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .buffers import StatBuffers, host_copies, read_extras
from .checkpoint import held_columns, restore_columns
from .sink import ColumnDrain
from .window import ColumnWindow


class ColumnStore:
    """Buffers per kind, allocated once for the window (or growing without one), with the batch
    cursor, the batch indices held and the host copies that reading keeps.

    `kinds` are recorded and sent to a sink; `aux` kinds move with them but stay in the run
    (ParameterStats' weights before the step, for the update ratio).

    Examples:
        >>> store = ColumnStore(ColumnWindow(2, 64), ["forward"], 3, "cpu", False, 0)
        >>> for batch in range(5):
        ...     _ = store.close(batch)
        >>> store.num_batches, store.batches.tolist(), tuple(store.read("forward", "stats").shape)
        (5, [3, 4], (2, 3, 2))
    """

    def __init__(
        self,
        window: ColumnWindow,
        kinds: list[str],
        rows: int,
        device: torch.device | str,
        full: bool,
        hist_bins: int,
        ordered: bool = True,
        aux: tuple[str, ...] = (),
        resume_batches: int = 0,
        binades: bool = False,
        top_k: int = 0,
    ) -> None:
        self.window, self.kinds = window, list(kinds)
        capacity = window.capacity
        if window.size is None:
            capacity = max(capacity, resume_batches + 1)
        self.buffers = {
            kind: StatBuffers(rows, capacity, device, full, hist_bins, ordered, binades, top_k)
            for kind in kinds
        }
        for kind in aux:
            self.buffers[kind] = StatBuffers(rows, capacity, device, False, 0, ordered=False)
        self.num_batches = 0
        self.batch_ids = window.batch_ids()
        self.drain: ColumnDrain | None = None
        self.reset_host()

    def reset_host(self) -> None:
        """Forget the host copies (after the device columns changed: a merge, a move)."""
        self.host = {kind: host_copies() for kind in self.buffers}

    @property
    def sent(self) -> dict[str, StatBuffers]:
        """The buffers of the recorded kinds, which a sink receives."""
        return {kind: self.buffers[kind] for kind in self.kinds}

    @property
    def batches(self) -> torch.Tensor:
        """int64 `(held,)`: the batch index of each column held, oldest first."""
        ids = list(self.batch_ids)
        held = ids[len(ids) - self.window.visible(self.num_batches) :]
        return torch.tensor(held, dtype=torch.int64)

    def close(self, batch_id: int) -> bool:
        """Close the open column as batch `batch_id`: send what a chunk holds, move to the next
        column; True when the buffers were reallocated (the operator's arguments changed)."""
        self.batch_ids.append(batch_id)
        self.num_batches += 1
        if self.drain is not None:
            self.drain.closed(self.sent, self.batch_ids, self.num_batches)
        return self.window.advance(self.buffers.values(), self.num_batches)

    def read(self, kind: str, name: str) -> torch.Tensor:
        """The held columns of one buffer of a kind ("nonfinite": the int64 counts) on the CPU."""
        b = self.buffers[kind]
        source = b.nonfinite() if name == "nonfinite" else getattr(b, name)
        return self.window.read(self.host[kind][name], source, self.num_batches)

    def extra(self, kind: str, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Each extra statistic of `names` of a kind, `(rows, held)` on the CPU."""
        b, host = self.buffers[kind], self.host[kind]
        return read_extras(
            names, lambda name, t: self.window.read(host[name], t, self.num_batches), b
        )

    def moved_to(self, device: torch.device) -> None:
        """Move every buffer (nothing recorded yet, or everything) to another device."""
        self.buffers = {kind: b.moved_to(device) for kind, b in self.buffers.items()}
        self.reset_host()

    def add_rows(self, rows: int) -> None:
        """Grow every buffer to `rows` rows (names that other ranks recorded, after a merge)."""
        self.buffers = {kind: b.with_rows(rows) for kind, b in self.buffers.items()}
        self.reset_host()

    # The sink ---------------------------------------------------------------------------------

    def start_sink(
        self,
        sink: str | Callable[..., Any],
        describe: dict[str, Any],
        saved: dict | None,
        origin: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """Send the columns to `sink` from now on, after those a resumed state had sent;
        `origin()` adds to each chunk's settings what is known only once recorded."""
        self.stop_sink()
        sent, through = 0, -1
        if saved is not None and "sink_sent" in saved:
            sent, through = saved["sink_sent"], saved["sink_through"]
        elif saved is not None:  # saved without a sink: the held columns are what it can have
            sent = saved["num_batches"] - len(saved["batches"])
        describe = {**describe, "kinds": self.kinds}
        self.drain = ColumnDrain(sink, self.window, describe, sent, through, origin)

    def send_closed(self) -> None:
        """Send every closed column not yet sent, without waiting for the sink: before a merge
        changes the columns, so that a rank's sink holds what that rank recorded."""
        if self.drain is not None:
            self.drain.send(self.sent, self.batch_ids, self.num_batches)

    def flush(self) -> None:
        """Send every closed column not yet sent, and wait until the sink has it."""
        if self.drain is not None:
            self.drain.flush(self.sent, self.batch_ids, self.num_batches)

    def stop_sink(self) -> None:
        """End the writer thread (a later flush starts it again)."""
        if self.drain is not None:
            self.drain.close()

    # Checkpoints --------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The position and the held columns of every kind, as CPU tensors and plain values;
        a sink is flushed first, so that it holds every batch the state does."""
        position: dict[str, Any] = {"num_batches": self.num_batches, "batches": self.batches}
        if self.drain is not None:
            self.flush()
            position["sink_sent"] = self.num_batches
            position["sink_through"] = self.batch_ids[-1] if self.batch_ids else -1
        columns = {
            kind: held_columns(b, self.window, self.num_batches) for kind, b in self.buffers.items()
        }
        return {**position, "columns": columns}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue after the columns of a saved state (checked and upgraded by `checkpoint`)."""
        n = saved["num_batches"]
        for kind, b in self.buffers.items():
            restore_columns(saved["columns"][kind], n, b, self.window)
        self.num_batches = n
        self.batch_ids.extend(saved["batches"].tolist())
