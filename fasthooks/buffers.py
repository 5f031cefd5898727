"""The preallocated buffers of one statistics run, and their host copies for reading.

Layout in `layout.py`. The hooks write into these buffers on the activations' device; the
training loop moves the batch cursor; reading copies to the host only what was not copied
before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .layout import (
    BUFFERS,
    CHANNEL_PLANES,
    COUNTED_EXTRAS,
    CUDA_DROPPED_CALLS,
    DERIVED_EXTRAS,
    EXTRA_PLANES,
    NONFINITE,
    buffer_shape,
    cuda_workspace_doubles,
)
from .moments import derived_extra

_clocks: dict[torch.device, torch.Tensor] = {}


def call_clock(device: torch.device | str) -> torch.Tensor:
    """The device's call clock: a one-element int64 tensor that every hooked call of every run on
    the device advances, so that calls of different runs (a forward and a backward one) compare.

    Examples:
        >>> call_clock("cpu") is call_clock(torch.device("cpu"))
        True
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _clocks:
        with torch.inference_mode(False):
            _clocks[device] = torch.zeros(1, dtype=torch.int64, device=device)
    return _clocks[device]


class StatBuffers:
    """Every buffer the operator writes for `num_modules` modules and `capacity` batch columns,
    as `layout.BUFFERS` declares them; with `ordered=False` no call order
    (`accumulate_stats_list`, which keeps none), with `binades=True` the binade counts, with
    `top_k=k` the k values of largest magnitude and their channels. `channels` (running
    per-channel sums, not per column or row) starts empty: `resize_channels` gives it room.

    Examples:
        >>> b = StatBuffers(3, 8, "cpu", full=True, hist_bins=40)
        >>> [tuple(t.shape) for t in b.columned().values()]
        [(9, 3, 8), (2, 3, 8), (4, 3, 8), (3, 8, 40), (0,), (0,), (2, 3, 8)]
    """

    state: torch.Tensor
    stats: torch.Tensor
    extra: torch.Tensor
    hist: torch.Tensor
    binades: torch.Tensor
    top: torch.Tensor
    order: torch.Tensor

    def __init__(
        self,
        num_modules: int,
        capacity: int,
        device: torch.device | str,
        full: bool,
        hist_bins: int,
        ordered: bool = True,
        binades: bool = False,
        top_k: int = 0,
    ) -> None:
        device = torch.device(device)
        self.full, self.hist_bins, self.ordered = full, hist_bins, ordered
        self.binned, self.top_k = binades, top_k
        self.num_modules = num_modules
        # Buffers made under torch.inference_mode could not be updated once training resumes.
        with torch.inference_mode(False):
            self.cursor = torch.zeros((), dtype=torch.int64, device=device)
            # Partial results of the CUDA kernels; the zeroed counter is reset by the kernel.
            self.workspace = torch.zeros(
                cuda_workspace_doubles(top_k) if device.type == "cuda" else 0,
                dtype=torch.float64,
                device=device,
            )
            self.clock = call_clock(device)
            self.channels = torch.zeros(0, dtype=torch.float64, device=device)
            self._allocate(capacity, device)

    def _allocate(self, capacity: int, device: torch.device) -> None:
        for spec in BUFFERS:
            shape = buffer_shape(
                spec.name,
                self.num_modules,
                capacity,
                self.full,
                self.hist_bins,
                self.ordered,
                self.binned,
                self.top_k,
            )
            setattr(self, spec.name, torch.full(shape, spec.fill, dtype=spec.dtype, device=device))
        self.capacity = capacity

    def columned(self) -> dict[str, torch.Tensor]:
        """Every buffer by name, in `layout.BUFFERS` order."""
        return {spec.name: getattr(self, spec.name) for spec in BUFFERS}

    def op_args(self) -> tuple[torch.Tensor, ...]:
        """(state, stats, extra, hist, binades, top, channels, workspace, order, clock, cursor):
        `accumulate_stats`'s buffer arguments."""
        return (
            self.state,
            self.stats,
            self.extra,
            self.hist,
            self.binades,
            self.top,
            self.channels,
            self.workspace,
            self.order,
            self.clock,
            self.cursor,
        )

    def list_op_args(self) -> tuple[torch.Tensor, ...]:
        """(state, stats, extra, hist, workspace, cursor): `accumulate_stats_list`'s, which keeps
        no call order, no binades and no top values."""
        return self.state, self.stats, self.extra, self.hist, self.workspace, self.cursor

    @property
    def channel_room(self) -> int:
        """How many channels, of every module together, the running per-channel sums have room
        for (0: none kept)."""
        return self.channels.shape[1] if self.channels.dim() == 2 else 0

    def resize_channels(self, room: int) -> None:
        """Room for `room` channels in the running per-channel sums, those so far kept."""
        old = self.channels
        with torch.inference_mode(False):
            self.channels = torch.zeros(
                len(CHANNEL_PLANES), room, dtype=torch.float64, device=old.device
            )
        if old.dim() == 2:
            kept = min(old.shape[1], room)
            self.channels[:, :kept].copy_(old[:, :kept])

    def clear_channels(self) -> None:
        """Start the running per-channel sums again (magnitudes are at least 0, so every plane
        starts at 0)."""
        self.channels.zero_()

    def grow(self) -> None:
        """Double the capacity, keeping every column."""
        old, capacity = self.columned(), self.capacity
        with torch.inference_mode(False):
            self._allocate(2 * capacity, self.state.device)
        for spec in BUFFERS:
            if old[spec.name].numel() > 0:
                getattr(self, spec.name).narrow(spec.axis, 0, capacity).copy_(old[spec.name])

    def moved_to(self, device: torch.device | str) -> StatBuffers:
        """The same buffers, cursor and columns on another device (the call clock is that
        device's own)."""
        moved = StatBuffers(
            self.num_modules,
            self.capacity,
            device,
            self.full,
            self.hist_bins,
            self.ordered,
            self.binned,
            self.top_k,
        )
        moved.cursor.copy_(self.cursor)
        for name, tensor in self.columned().items():
            getattr(moved, name).copy_(tensor)
        moved.channels = self.channels.to(device)
        return moved

    def with_rows(self, rows: int) -> StatBuffers:
        """The same buffers and cursor with `rows` rows: the first ones kept, the others empty."""
        grown = StatBuffers(
            rows,
            self.capacity,
            self.state.device,
            self.full,
            self.hist_bins,
            self.ordered,
            self.binned,
            self.top_k,
        )
        grown.cursor.copy_(self.cursor)
        for spec in BUFFERS:
            old = getattr(self, spec.name)
            if old.numel() > 0:  # the rows are the axis before the columns
                getattr(grown, spec.name).narrow(spec.axis - 1, 0, self.num_modules).copy_(old)
        grown.channels = self.channels  # not per row
        return grown

    def clear_column(self) -> None:
        """Forget every module's statistics at the cursor's column."""
        column = self.cursor.reshape(1)
        for spec in BUFFERS:
            tensor = getattr(self, spec.name)
            if tensor.numel() > 0:
                tensor.index_fill_(spec.axis, column, spec.fill)

    def dropped_calls(self) -> int:
        """How many calls the CUDA kernels dropped because the cursor was past the capacity (a
        CUDA graph replayed past its buffers); reading it waits for the device."""
        if self.workspace.numel() == 0:
            return 0
        return int(self.workspace[CUDA_DROPPED_CALLS : CUDA_DROPPED_CALLS + 1].view(torch.int64))

    def nonfinite(self) -> torch.Tensor:
        """The exact float64 count of NaN and infinite elements per slot, `(modules, capacity)`."""
        return self.state[NONFINITE]


def host_copies() -> dict[str, HostCopy]:
    """Empty host copies of every buffer reading may copy from a device, and of the non-finite
    counts read as int64."""
    copies = {spec.name: HostCopy(spec.axis, spec.dtype) for spec in BUFFERS}
    return {**copies, "nonfinite": HostCopy(1, torch.int64)}


def read_extras(
    names: Iterable[str], read: Callable[[str, torch.Tensor], torch.Tensor], buffers: StatBuffers
) -> dict[str, torch.Tensor]:
    """Each extra of `names` as a CPU tensor `(slots, columns)`, through `read(name, buffer)`
    (the recorded columns of a buffer on the CPU); those kept in a buffer of their own
    (`layout.COUNTED_EXTRAS`) are left out."""
    out = {}
    for name in names:
        if name in COUNTED_EXTRAS:
            continue
        if name == "nonfinite":
            out[name] = read("nonfinite", buffers.nonfinite())
        elif name in DERIVED_EXTRAS:
            out[name] = derived_extra(name, read("state", buffers.state))
        else:
            out[name] = read("extra", buffers.extra)[EXTRA_PLANES.index(name)]
    return out


class HostCopy:
    """A CPU copy of the first columns of a device buffer; each column is copied once.

    Columns before the cursor never change again, so only new ones cross from the device.

    Examples:
        >>> copy = HostCopy(axis=1, dtype=torch.int64)
        >>> copy.read(torch.tensor([[1.0, 2.0, 3.0]]), 2).tolist()
        [[1, 2]]
    """

    def __init__(self, axis: int, dtype: torch.dtype) -> None:
        self.axis, self.dtype = axis, dtype
        self.host: torch.Tensor | None = None
        self.done = 0

    def read(self, source: torch.Tensor, columns: int) -> torch.Tensor:
        """The first `columns` columns of `source` on the CPU, copying only the unseen ones."""
        if self.host is None or self.host.shape[self.axis] < columns:
            shape = list(source.shape)
            shape[self.axis] = max(columns, 2 * (0 if self.host is None else self.done))
            host = torch.empty(shape, dtype=self.dtype)
            if self.host is not None:
                host.narrow(self.axis, 0, self.done).copy_(
                    self.host.narrow(self.axis, 0, self.done)
                )
            self.host = host
        if self.done < columns:
            fresh = source.narrow(self.axis, self.done, columns - self.done)
            self.host.narrow(self.axis, self.done, columns - self.done).copy_(fresh)
            self.done = columns
        return self.host.narrow(self.axis, 0, columns)
