"""Where recorded columns go before a window overwrites them: a callable or a folder of Parquet
files, fed by a background thread from host copies taken behind CUDA events, so that the
training stream never waits and the training thread only enqueues copies."""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .buffers import StatBuffers, host_copies, read_extras
from .layout import BUFFERS, COUNT, NONFINITE
from .window import ColumnWindow

# Chunks waiting for the writer thread at most (besides the one it writes): past this the
# training thread waits for it, so host memory stays flat when the disk is slower than training,
# and a killed process loses at most the window and one chunk.
MAX_PENDING_CHUNKS = 1
# Columns drained at once when every batch is kept on the device (window=None).
UNWINDOWED_CHUNK = 64
# The host dtype each buffer is read as (as `HostCopy` reads it).
HOST_DTYPES = {name: copy.dtype for name, copy in host_copies().items()}


class SinkChunk(NamedTuple):
    """Recorded columns on their way out of the device, as a callable sink receives them.

    `kind`: "forward" or "backward" (ActivationStats), or "weight", "grad", "update"
    (ParameterStats); `names`: the modules or parameters (rows); `batches`: int64 `(k,)`, the
    training batch (or optimizer step) of each column; `stats`: float32 `(2, rows, k)`, mean and
    std; `extra`: each extra statistic `(rows, k)`; `count`: float64 `(rows, k)`, the elements
    recorded; `hist`: int64 `(rows, k, bins)` or None; `order`: int64 `(2, rows, k)`, the call
    order `first_nonfinite` reads, or None; `state`: float64 `(planes, rows, k)`, the merge state
    (`layout.STATE_PLANES`, the first three without extras) that merges exactly; `binades`:
    int32 `(rows, k, layout.BINADE_BINS)` with the "binades" extra, else None; `top`: float64
    `(rows, k, top_k, 2)` (value, channel) pairs with `top_k > 0`, else None.
    """

    kind: str
    names: list[str]
    batches: torch.Tensor
    stats: torch.Tensor
    extra: dict[str, torch.Tensor]
    count: torch.Tensor
    hist: torch.Tensor | None
    order: torch.Tensor | None
    state: torch.Tensor
    binades: torch.Tensor | None = None
    top: torch.Tensor | None = None


class HostColumns:
    """Host copies of some columns of every buffer, read as `read_extras` reads a StatBuffers."""

    def __init__(self, copies: dict[str, torch.Tensor]) -> None:
        for name, tensor in copies.items():
            setattr(self, name, tensor)

    def nonfinite(self) -> torch.Tensor:
        return self.state[NONFINITE]


def _copy_out(source: torch.Tensor, axis: int, start: int, length: int) -> torch.Tensor:
    """Columns [start, start + length) of a buffer on the host: pinned and without blocking
    from CUDA, so the copy is ordered on the stream and nothing waits for it."""
    if source.numel() == 0:
        return source.cpu()
    columns = source.narrow(axis, start, length)
    if source.device.type != "cuda":
        return columns.to("cpu", copy=True)
    host = torch.empty(columns.shape, dtype=columns.dtype, pin_memory=True)
    host.copy_(columns, non_blocking=True)
    return host


class ColumnDrain:
    """Sends each recorded kind's closed columns to a sink in chunks, before the window
    reuses them; `flush()` sends the rest and waits for the writer.

    `describe` holds what every chunk shares: "names", "extra" (the extra names to read),
    "kinds" and the settings a Parquet file keeps for `fasthooks.load`; `origin()`, asked as
    each chunk leaves, adds what is known only once recorded (the rank and the pieces of
    distributed tensors, `dtensors.sink_origin`).
    """

    def __init__(
        self,
        target: str | Callable[[SinkChunk], Any],
        window: ColumnWindow,
        describe: dict[str, Any],
        drained: int = 0,
        drained_through: int = -1,
        origin: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.window, self.describe, self.origin = window, describe, origin
        self.drained = drained
        self.chunk = UNWINDOWED_CHUNK if window.size is None else max(1, window.size // 2)
        self.writer = _Writer(target, describe, drained_through)

    def closed(self, buffers: dict[str, StatBuffers], batch_ids: Any, closed: int) -> None:
        """Called as the `closed`-th batch closes: drain once a chunk is waiting."""
        self.writer.report()
        if closed - self.drained >= self.chunk:
            self._drain(buffers, batch_ids, closed)

    def send(self, buffers: dict[str, StatBuffers], batch_ids: Any, closed: int) -> None:
        """Send every closed column not yet sent: copied out now, written in the background."""
        if closed > self.drained:
            self._drain(buffers, batch_ids, closed)

    def flush(self, buffers: dict[str, StatBuffers], batch_ids: Any, closed: int) -> None:
        """Send every closed column not yet sent and wait until the sink has it."""
        self.send(buffers, batch_ids, closed)
        self.writer.wait()
        self.writer.report()

    def _drain(self, buffers: dict[str, StatBuffers], batch_ids: Any, closed: int) -> None:
        ids = list(batch_ids)[len(batch_ids) - (closed - self.drained) :]
        # On the training thread, which alone changes what the origin reads.
        describe = self.describe if self.origin is None else {**self.describe, **self.origin()}
        first = self.drained
        while first < closed:  # one contiguous run of columns at a time
            start = self.window.column(first)
            length = min(closed - first, buffers[next(iter(buffers))].capacity - start)
            chunk_ids = torch.tensor(ids[first - self.drained : first - self.drained + length])
            for kind, b in buffers.items():
                copies = {
                    spec.name: _copy_out(getattr(b, spec.name), spec.axis, start, length)
                    for spec in BUFFERS
                }
                event = None
                if b.state.device.type == "cuda":
                    event = torch.cuda.Event()
                    event.record()
                self.writer.put((kind, chunk_ids, copies, event, describe))
            first += length
        self.drained = closed

    def close(self) -> None:
        self.writer.stop()


class _Writer:
    """The background thread that turns host copies into chunks and hands them to the sink.
    A failing sink is reported once (by `report()`, on the training thread) and never stops
    training; later chunks are still tried."""

    def __init__(
        self, target: str | Callable[[SinkChunk], Any], describe: dict[str, Any], through: int
    ) -> None:
        self.target, self.describe, self.through = target, describe, through
        self.queue: queue.Queue = queue.Queue(MAX_PENDING_CHUNKS)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.reported = False
        self.prepared = False

    def put(self, item: tuple) -> None:
        if not self.prepared and isinstance(self.target, str):
            from .parquet import prepare_folder

            self.prepared = True
            try:
                prepare_folder(self.target, self.describe, self.through)
            except OSError as error:
                self.error = self.error or error
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="fasthooks-sink", daemon=True)
            self.thread.start()
        self.queue.put(item)

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as error:  # a sink's failure must not end training
                self.error = self.error or error
            finally:
                self.queue.task_done()

    def _write(
        self, kind: str, batches: torch.Tensor, copies: dict, event: Any, describe: dict
    ) -> None:
        if event is not None:
            event.synchronize()
        columns = HostColumns(copies)
        extra = read_extras(
            self.describe["extra"], lambda name, t: t.to(HOST_DTYPES[name]), columns
        )
        chunk = SinkChunk(
            kind,
            self.describe["names"],
            batches,
            columns.stats,
            extra,
            columns.state[COUNT],
            columns.hist if columns.hist.numel() else None,
            columns.order if columns.order.numel() else None,
            columns.state,
            columns.binades if columns.binades.numel() else None,
            columns.top if columns.top.numel() else None,
        )
        if callable(self.target):
            self.target(chunk)
        else:
            from .parquet import write_chunk

            write_chunk(self.target, chunk, describe)

    def wait(self) -> None:
        if self.thread is not None:
            self.queue.join()

    def report(self) -> None:
        """Warn once, on the calling thread, when the sink has failed."""
        if self.error is not None and not self.reported:
            self.reported = True
            where = self.target if isinstance(self.target, str) else repr(self.target)
            warnings.warn(
                f"fasthooks: the sink {where} failed ({type(self.error).__name__}: {self.error}); "
                "recording goes on in the window, and later columns are still sent to it",
                RuntimeWarning,
                stacklevel=4,
            )

    def stop(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
            self.thread = None
