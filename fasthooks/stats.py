"""ActivationStats: per-batch statistics of each hooked module's output, never waiting on them."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from . import checkpoint
from .arguments import (
    check_channel_dim,
    check_channel_stats,
    check_extra,
    check_hist,
    check_near_zero,
    check_sink,
    check_top_k,
    check_window,
    count_argument,
    default_channel_dim,
    uncompiled_name,
)
from .buffers import StatBuffers
from .channel_merging import merge_snapshots
from .channel_reading import ChannelReading
from .channel_stats import ChannelSnapshots
from .column_store import ColumnStore
from .distributed import merge_groups
from .dtensors import LocalPieces, sink_origin
from .hook import HookCallback
from .layout import BINADE_BINS, COUNT, COUNTED_EXTRAS
from .merging import Merged, Rows, all_reduce
from .nonfinite import NonFiniteWatch
from .ops import backend_for_device, resolve_backend
from .outputs import measured_tensor
from .reading import Reading
from .window import ColumnWindow

DEFAULT_CAPACITY = 64
# What the operator and the Python backend raise on input they cannot measure.
_MEASURE_ERRORS = (RuntimeError, TypeError, ValueError, NotImplementedError)


# A compiled graph recomputes in its own backward, without hooks: traced, this is constant False.
@torch.compiler.assume_constant_result
def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing recomputing
    what it did not keep."""
    return torch._C._current_graph_task_id() != -1


def _buffer_device(model: nn.Module, modules: list[nn.Module]) -> torch.device | None:
    """The one device of the hooked modules' parameters (the model's parameters or buffers when
    they have none), where the buffers live; None for a model with neither, whose first hooked
    output tells. Several devices are refused, and so is nn.DataParallel over several GPUs."""
    for m in model.modules():
        if isinstance(m, nn.DataParallel) and len(m.device_ids) > 1:
            raise ValueError(
                "ActivationStats does not support nn.DataParallel over several GPUs: its replicas "
                "run the hooks on other devices and threads. Use DistributedDataParallel (one "
                "ActivationStats per process, then act.all_reduce())"
            )
    devices = {p.device for m in modules for p in m.parameters(recurse=False)}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"ActivationStats: the hooked modules live on several devices ({names}); a run keeps "
            "its buffers on one device. Give each device an ActivationStats of its own, with "
            "modules= the modules on that device"
        )
    if devices:
        device = devices.pop()
    else:
        tensor = next(model.parameters(), None)
        tensor = next(model.buffers(), None) if tensor is None else tensor
        if tensor is None:
            return None
        device = tensor.device
    # A model on the meta device computes nothing to record; its statistics read NaN.
    return torch.device("cpu") if device.type == "meta" else device


class StatisticsError(RuntimeError):
    """Recording a module's statistics failed; the message names the module."""


def _channel_count(x: torch.Tensor, dim: int) -> int:
    """How many channels x has along `dim` (1 for a 0-d x; 0 for a dim it does not have, which
    the operator then refuses by name)."""
    if x.dim() == 0:
        return 1
    return x.shape[dim] if -x.dim() <= dim < x.dim() else 0


class ActivationStats(HookCallback, Reading, ChannelReading):
    """Records statistics of each hooked module's output for every training batch.

    `stats` is a float32 CPU tensor of shape `(2, modules, batches)`: axis 0 is (mean, std),
    one column per batch ended with `on_batch_end(train=True)`. The hooks only launch
    work on the activations' device; reading is the one place that waits for it.
    A module whose output is a tuple or list contributes its first tensor.

    `extra` asks for more statistics from the same read pass, each read from `act.extra[name]`
    as a CPU tensor `(modules, batches)`: "min" and "max" (float32; NaN when a NaN is among
    the elements, as `torch.amin`/`amax`), "near_zero" (float32, the fraction of elements
    `<= near_zero`), "nonfinite" (int64, how many elements are NaN or infinite) and
    "kurtosis" (float32, m4 / m2**2 of the population central moments: 3.0 for a normal
    distribution; NaN with fewer than 2 elements or no spread), "norm" (float32, the L2 norm of
    the elements) and "absmax" (float32, their largest magnitude).

    With `is_forward=False` the statistics are those of each module's output gradient (its
    first floating-point tensor), one column per training batch, from a hook on the output
    tensor: an in-place op after the module (`nn.ReLU(inplace=True)`) is fine, and a batch
    without a backward pass records nothing.

    `hist_bins > 0` adds `act.hist`, int64 `(modules, batches, hist_bins)`: exact counts of the
    elements in `hist_bins` equal bins over `hist_range`. As in `torch.histc`, the top edge is
    counted in the last bin and values outside the range, and NaN, in none.

    A module that runs several times in a batch gets the statistics of all its calls (merged
    exactly); one that did not run reads NaN and counts 0. Forward calls in eval mode and
    batches closed with `train=False` are not recorded.

    The buffers hold `expected_batches` columns and double when they run out. A step captured
    in a CUDA graph keeps writing to the buffers it was captured with, so give
    `expected_batches` for the whole run there: calls past its end are not recorded, and
    reading says how many were dropped.

    On CUDA the hooks launch their kernels on the current stream. Hooks called from several
    streams at once are safe (each stream gets its own scratch space, up to 8 per run); call
    `on_batch_end` on the stream the step ran on, or after that stream's work (say
    `torch.cuda.current_stream().wait_stream(s)`), since it moves the batch cursor. A copy of a
    hooked module (`copy.deepcopy`, an EMA model) carries its hook along and is not recorded
    (a warning says so); `nn.DataParallel` over several GPUs and hooked modules on several
    devices are refused: use one `ActivationStats` per device or process.

    Args:
        model: the `nn.Module` to watch, or any object with one at `.model` (a learner).
        modules: the modules to hook (a single module, or an iterable); default: every module
            with parameters of its own (`modules_with_own_params`), in `model.modules()` order.
        do_remove: remove the hooks at `on_train_end` (default True).
        backend: "auto" (the fused operator when built, else "python"), "fused" or "python".
        expected_batches: columns allocated up front (default 64); more double the buffers.
        window: keep only the newest N batches on the device, in N + 1 columns allocated once
            (the open batch has one): memory flat over a run of any length. Default None: every
            batch is kept. `num_batches` counts every recorded batch; reading shows those held.
        sink: where each recorded column goes before the window overwrites it (and the rest at
            `flush()`, `on_train_end` or the end of the `with` block): a folder (Parquet files,
            read back with `fasthooks.load`; a new run replaces the folder's files of its kind)
            or a callable taking each `SinkChunk`, called on a background thread.
        extra: names from "min", "max", "near_zero", "nonfinite", "kurtosis", "norm", "absmax".
        near_zero: the threshold of "near_zero" (default 0.05, fastai v2's).
        hist_bins: histogram bins, 0 (default) for none, at most 2048.
        hist_range: the histogram's (lo, hi), default (0.0, 10.0), within float32's range.
        every: record every N-th training batch (default 1: all of them).
        is_forward: False records the statistics of each module's output gradient.
        skip_frozen: True leaves out modules in eval mode inside a training model (frozen
            layers), which are recorded by default.
        top_k: keep, per module and batch, the k values of largest magnitude (signed) and their
            channels, k up to 16 (default 0: none); read as `act.top_values` and
            `act.top_channels`, `(modules, batches, k)`.
        channel_dim: the dimension `top_k` and `channel_stats` name channels along: None
            (default) takes dim 1 of a 4-D or 5-D output (NCHW, NCDHW, whatever the memory
            format) and the last dim of any other; an int for every module; or a dict of module
            names to dims (the rest by default).
        channel_stats: per-channel statistics from "absmax", "mean", "rms" and "active" (the
            fraction of values whose magnitude exceeds `near_zero`), summed over every
            `channel_every` recorded batches into one snapshot: `act.channel_stats[name]` is
            float32 `(modules, max_channels, snapshots)`, NaN past a module's channel count
            (`act.channel_counts`); `act.channel_batches` gives each snapshot's batches, and
            `act.dead_channels` and `act.channel_rms_kurtosis` what they show. The running sums
            take 40 bytes per channel of all the modules together, whatever the number of
            batches. With `window`, the snapshots covering its batches are kept.
        channel_every: recorded batches per snapshot (default 100).
        on_nonfinite: what to do when a recorded call held a NaN or an infinity: None (default:
            nothing; `first_nonfinite()` still tells), "warn" (once), "raise"
            (`NonFiniteError` from `on_batch_end`) or a callable, called once with the
            `NonFiniteReport`. Checked without waiting for the device: on CUDA it comes at the
            `on_batch_end` after the batch's, or at `on_train_end`.
    The recorded std is unbiased, as `torch.std`. What is recorded follows the model's training
    mode, not each module's.

    Examples:
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        >>> act = ActivationStats(model, backend="python", extra=["max"], hist_bins=10)
        >>> with act:
        ...     for _ in range(3):
        ...         _ = model(torch.randn(32, 8))
        ...         act.on_batch_end(train=True)
        >>> act.stats.shape, act.extra["max"].shape, act.hist.shape
        (torch.Size([2, 2, 3]), torch.Size([2, 3]), torch.Size([2, 3, 10]))
    """

    def __init__(
        self,
        model: Any,
        modules: Iterable[nn.Module] | None = None,
        do_remove: bool = True,
        backend: str = "auto",
        expected_batches: int = DEFAULT_CAPACITY,
        extra: Iterable[str] = (),
        near_zero: float = 0.05,
        hist_bins: int = 0,
        hist_range: tuple[float, float] = (0.0, 10.0),
        every: int = 1,
        is_forward: bool = True,
        skip_frozen: bool = False,
        on_nonfinite: Any = None,
        window: int | None = None,
        sink: Any = None,
        top_k: int = 0,
        channel_dim: int | dict[str, int] | None = None,
        channel_stats: Iterable[str] = (),
        channel_every: int = 100,
    ) -> None:
        super().__init__(model, modules, do_remove, is_forward)
        expected_batches = count_argument(expected_batches, "expected_batches", 1)
        self.every = count_argument(every, "every", 1)
        if not isinstance(skip_frozen, bool):
            raise TypeError(f"skip_frozen must be a bool, got {type(skip_frozen).__name__}")
        self.skip_frozen = skip_frozen
        self._watch = NonFiniteWatch(on_nonfinite)
        self.backend, self._accumulate = resolve_backend(backend)
        self._requested_backend = backend
        self.expected_batches = expected_batches
        self.window = check_window(window)
        self.sink = check_sink(sink)
        self._placement = ColumnWindow(self.window, expected_batches)
        self.extra_names = check_extra(extra)
        self.near_zero = check_near_zero(near_zero)
        self.hist_bins, self.hist_min, self.hist_max = check_hist(hist_bins, hist_range)
        self.top_k = check_top_k(top_k)
        self.channel_dim = check_channel_dim(channel_dim)
        self._channel_dims: list[int | None] = []  # by slot: None takes default_channel_dim
        self.channel_names = check_channel_stats(channel_stats)
        self.channel_every = count_argument(channel_every, "channel_every", 1)
        self._snapshots: ChannelSnapshots | None = None
        # The operator's arguments after the slot, the same on every call.
        self._options = (self.near_zero, self.hist_min, self.hist_max)
        self._slots: dict[nn.Module, int] = {}
        self._warned: set[nn.Module] = set()
        if self.modules is not None:
            self._slots = self._check_unique(self.modules)
        self._store: ColumnStore | None = None
        self._pieces = LocalPieces("ActivationStats", parameters=False)
        self._device_pending = False
        self._args: tuple[torch.Tensor, ...] = ()
        self._dropped_reported = 0
        self._resume: dict[str, Any] | None = None
        self._leaving_on_error = False
        self._merged = Merged()
        self._others: list[tuple[str, str]] = []  # (name, type) of rows only other ranks hook
        self._probes: list[Any] = []
        self._start_sampling()

    def _start_sampling(self) -> None:
        self._seen = 0  # training batches closed so far
        self._sampled = True  # whether the current training batch is recorded

    @property
    def _buffers(self) -> StatBuffers | None:
        return None if self._store is None else self._store.buffers[self.kind]

    @staticmethod
    def _check_unique(modules: list[nn.Module]) -> dict[nn.Module, int]:
        slots: dict[nn.Module, int] = {}
        for i, m in enumerate(modules):
            if m in slots:
                raise ValueError(f"modules[{i}] repeats modules[{slots[m]}]")
            slots[m] = i
        return slots

    def on_train_begin(self, **kwargs: Any) -> None:
        """Start fresh statistics and register the hooks (everything is checked first)."""
        modules = self.resolve_modules()
        if not modules:
            warnings.warn(
                f"ActivationStats: nothing to hook in {type(self.model).__name__}: no module below "
                "it has parameters of its own (FSDP1's flat parameters, say); pass modules=",
                RuntimeWarning,
                stacklevel=2,
            )
        slots = self._check_unique(modules)
        channel_dims = self._slot_channel_dims(modules)
        device = _buffer_device(self.model, modules)
        # A model without parameters or buffers: the buffers follow its first hooked output.
        self._device_pending = device is None
        device = torch.device("cpu") if device is None else device
        if backend_for_device(self.backend, self._requested_backend, device) != self.backend:
            self.backend, self._accumulate = resolve_backend("python")
        resume, self._resume = self._resume, None
        if self._store is not None:
            self._store.stop_sink()
        store = self._new_store(len(modules), device, resume)
        if device.type == "cuda":
            # Ready for the hooks on whichever stream they run.
            torch.cuda.current_stream(device).synchronize()
        super().on_train_begin(**kwargs)
        self._slots, self._store = slots, store
        self._channel_dims = channel_dims
        self._snapshots = self._new_snapshots(len(modules), resume)
        self._args = store.buffers[self.kind].op_args()
        self._warned = set()
        self._pieces = LocalPieces("ActivationStats", parameters=False)
        self._probes = [
            m.register_forward_hook(self._pieces.probe(slots[m]), prepend=True)
            for m in modules
            if getattr(m, "_distribute_module_applied", False)
        ]
        self._dropped_reported = 0
        self._merged, self._others = Merged(), []
        self._watch.reset()
        self._start_sampling()
        if resume is not None:
            self._seen = resume["seen"]
            self._sampled = self._seen % self.every == 0
        if self.sink is not None:
            store.start_sink(self.sink, self._sink_description(), resume, self._sink_origin)

    def _slot_channel_dims(self, modules: list[nn.Module]) -> list[int | None]:
        """The `channel_dim` of each slot (None: by the output's dimensions); names the
        `channel_dim` dict gives that no hooked module has are refused."""
        if not isinstance(self.channel_dim, dict):
            return [self.channel_dim] * len(modules)
        names = {m: uncompiled_name(n) for n, m in self.model.named_modules() if n}
        slot_names = [names.get(m, type(m).__name__) for m in modules]
        unknown = sorted(set(self.channel_dim) - set(slot_names))
        if unknown:
            raise ValueError(
                f"channel_dim names modules that are not hooked: {unknown}; hooked modules: "
                f"{slot_names}"
            )
        return [self.channel_dim.get(name) for name in slot_names]

    def _new_snapshots(self, rows: int, resume: dict[str, Any] | None) -> ChannelSnapshots | None:
        """The run's per-channel snapshots (None without `channel_stats`): with `window`, as many
        as cover its batches."""
        if not self.channel_names:
            return None
        keep = None if self.window is None else -(-self.window // self.channel_every) + 1
        snapshots = ChannelSnapshots(self.channel_every, keep, rows)
        if resume is not None and "channel_snapshots" in resume:
            snapshots.restore(resume["channel_snapshots"], self._buffers)
        return snapshots

    def _new_store(
        self, rows: int, device: torch.device, resume: dict[str, Any] | None = None
    ) -> ColumnStore:
        n = 0 if resume is None else resume["num_batches"]
        full = bool(self.extra_names)
        store = ColumnStore(
            self._placement,
            [self.kind],
            rows,
            device,
            full,
            self.hist_bins,
            resume_batches=n,
            binades="binades" in self.extra_names,
            top_k=self.top_k,
        )
        if resume is not None:
            store.restore(resume)
        return store

    def _settings(self) -> dict[str, Any]:
        """What must match for a saved state's columns to continue."""
        return {"names": self.module_names, **self._options_settings()}

    def _options_settings(self) -> dict[str, Any]:
        """What must match for columns to merge: the options."""
        return {
            "extra": list(self.extra_names),
            "near_zero": self.near_zero,
            "hist_bins": self.hist_bins,
            "hist_range": [self.hist_min, self.hist_max],
            "every": self.every,
            "window": self.window,
            "top_k": self.top_k,
            "channel_dim": self.channel_dim,
            "channel_stats": list(self.channel_names),
            "channel_every": self.channel_every,
        }

    def _sink_description(self) -> dict[str, Any]:
        return {
            "recorder": "ActivationStats",
            **self._settings(),
            "types": self.module_types,
        }

    def _sink_origin(self) -> dict[str, Any]:
        return sink_origin(self._pieces.pieces, self.module_names)

    recorder = "ActivationStats"

    @property
    def kind(self) -> str:
        """ "forward" (outputs) or "backward" (output gradients): what a sink calls this run."""
        return "forward" if self.is_forward else "backward"

    @property
    def placements(self) -> dict[str, str]:
        """The placements of each module whose output (or its gradient) was a DTensor, by
        name: its local piece is what is recorded."""
        return self._pieces.by_name(self.module_names)

    @property
    def module_types(self) -> list[str]:
        """The class name of each hooked module, in column order."""
        return [type(m).__name__ for m in self.resolve_modules()] + [t for _, t in self._others]

    def flush(self) -> None:
        """Send every recorded column not yet in the sink to it, and wait until it has them."""
        if self._store is not None:
            self._store.flush()

    def state_dict(self) -> dict[str, Any]:
        """The recorded statistics and sampling position, to save with a training checkpoint:
        CPU tensors and plain values only (`torch.load(..., weights_only=True)` reads it)."""
        store = self._store
        if store is None:
            store = self._new_store(len(self.resolve_modules()), torch.device("cpu"))
        state = checkpoint.state_dict("ActivationStats", self._settings(), self._seen, store)
        if self._snapshots is not None:
            state["channel_snapshots"] = self._snapshots.state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the columns of a saved run at the next `on_train_begin` (the next `with act:`);
        a state from another model, or with other statistics, is refused.

        Examples:
            >>> model = nn.Sequential(nn.Linear(4, 4))
            >>> with ActivationStats(model, backend="python") as act:
            ...     _ = model(torch.randn(2, 4))
            ...     act.on_batch_end()
            >>> resumed = ActivationStats(model, backend="python")
            >>> resumed.load_state_dict(act.state_dict())
            >>> with resumed:
            ...     _ = model(torch.randn(2, 4))
            ...     resumed.on_batch_end()
            >>> resumed.num_batches, resumed.batches.tolist()
            (2, [0, 1])
        """
        self._resume = checkpoint.checked(state, "ActivationStats", self._settings(), [self.kind])

    # Runs on every hooked module of every batch: detaching only the tensor it reads is cheaper
    # than the generic detach of inputs and outputs.
    detach = False

    def hook(self, m: nn.Module, i: Any, o: Any) -> None:
        # A batch left out by `every` costs this one check. Then the model's mode, not the
        # module's: a frozen layer of a training model is recorded.
        if not self._sampled or not self.model.training or (self.skip_frozen and not m.training):
            return
        if self.is_forward and _recomputing():
            return  # a checkpoint's recompute: this call's output was recorded in the forward
        x = o if type(o) is torch.Tensor else measured_tensor(o)[0]
        if not self.is_forward:
            # A hook on the output tensor sees its gradient even when an in-place op follows
            # the module, where a full module backward hook fails.
            if x is not None and x.requires_grad:
                x.register_hook(functools.partial(self._record_gradient, m))
            return
        try:
            self._record(m, x, o)
        except _MEASURE_ERRORS as error:
            self._record_otherwise(m, o, error)

    def registers_forward(self) -> bool:
        return True  # gradients are reached through the outputs, see hook()

    def _record_gradient(self, m: nn.Module, grad: torch.Tensor) -> None:
        try:
            self._record(m, grad, grad)
        except _MEASURE_ERRORS as error:
            self._record_otherwise(m, grad, error)

    def _record(self, m: nn.Module, x: torch.Tensor | None, o: Any) -> None:
        if x is None:
            self._skip(m, measured_tensor(o)[1])
            return
        slot = self._slots.get(m)
        if slot is None:
            self._foreign(m)
            return
        if self._device_pending:
            self._adopt_device(x.device)
        if type(x) is not torch.Tensor or self._pieces.pending:  # a DTensor: its local piece
            x = self._pieces.local(x, slot, lambda: self._name(m))
        if self.top_k or self._snapshots is not None:
            dim = self._channel_dims[slot]
            dim = default_channel_dim(x.dim()) if dim is None else dim
            # A DTensor's piece: its channels placed (and named) among the whole tensor's.
            whole = self._pieces.channel_extent(slot, x, dim) if self._pieces.extents else None
            count, first = (_channel_count(x, dim), 0) if whole is None else whole
            region = 0
            if self._snapshots is not None:
                region, grew = self._snapshots.offset(self._buffers, slot, count)
                if grew:
                    self._args = self._buffers.op_args()
            self._accumulate(x.detach(), *self._args, slot, *self._options, dim, first, region)
        else:
            self._accumulate(x.detach(), *self._args, slot, *self._options)

    def _adopt_device(self, device: torch.device) -> None:
        """Move the still empty buffers to the device of the first hooked output (a model
        without parameters or buffers gave none at `on_train_begin`)."""
        self._device_pending = False
        if device == self._buffers.state.device:
            return
        if backend_for_device(self.backend, self._requested_backend, device) != self.backend:
            self.backend, self._accumulate = resolve_backend("python")
        self._store.moved_to(device)
        self._args = self._buffers.op_args()

    def _foreign(self, m: nn.Module) -> None:
        """A module this run did not hook called its hook: a copy of a hooked one."""
        if m not in self._warned:
            self._warned.add(m)
            warnings.warn(
                f"ActivationStats: a {type(m).__name__} that this run did not hook called its "
                "hook: a copy of a hooked module (copy.deepcopy, an EMA model, an nn.DataParallel "
                "replica) carries the hook along. Its outputs are not recorded",
                RuntimeWarning,
                stacklevel=3,
            )

    def _record_otherwise(self, m: nn.Module, o: Any, error: Exception) -> None:
        """After the operator refused an output: measure what can be measured, else say why."""
        x, why = measured_tensor(o)
        if x is None:
            self._skip(m, why)
            return
        if x is not o:  # an integer or bool output, now as float
            try:
                self._record(m, x, o)
                return
            except _MEASURE_ERRORS as again:
                error = again
        raise StatisticsError(
            f"ActivationStats could not record {self._name(m)}: {type(error).__name__}: {error}"
        ) from error

    def _skip(self, m: nn.Module, why: str) -> None:
        if m not in self._warned:
            self._warned.add(m)
            warnings.warn(
                f"ActivationStats: {self._name(m)} returned {why}, which has no statistics; "
                "it reads NaN for those batches",
                RuntimeWarning,
                stacklevel=3,
            )

    def _name(self, m: nn.Module) -> str:
        return f"{self.module_names[self._slots[m]]} ({type(m).__name__})"

    def _remove_hooks(self) -> None:
        super()._remove_hooks()
        for probe in self._probes:
            probe.remove()
        self._probes = []

    def on_train_end(self, **kwargs: Any) -> None:
        """Remove the hooks when `do_remove`; warn when statistics were never closed in a batch;
        report a non-finite batch not yet reported (`on_nonfinite`)."""
        super().on_train_end(**kwargs)
        if self._snapshots is not None:
            self._snapshots.take()
        self.flush()
        if self._store is not None:
            self._store.stop_sink()
        if self._buffers is not None and not self._leaving_on_error:
            self._watch.poll(self, wait=True)
        if self._buffers is not None and self.num_batches == 0 and not self._leaving_on_error:
            column = self._buffers.state[COUNT].index_select(1, self._buffers.cursor.reshape(1))
            if bool(column.any()):
                warnings.warn(
                    "ActivationStats: the hooks recorded statistics but no batch was closed, so "
                    "act.stats is empty: call act.on_batch_end() after each training step",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def __exit__(self, exc_type: object, *rest: object) -> None:
        # An exception before the first on_batch_end explains the empty run: no warning then.
        self._leaving_on_error = exc_type is not None
        try:
            super().__exit__(exc_type, *rest)
        finally:
            self._leaving_on_error = False

    def on_batch_end(self, train: bool = True, **kwargs: Any) -> None:
        """Close the batch: a training batch gets its column, any other is forgotten."""
        if self._buffers is None:
            raise RuntimeError(
                "on_batch_end() called before the hooks were registered: run the training loop "
                "inside `with act:` (or call act.on_train_begin() first)"
            )
        if not train:
            self._buffers.clear_column()
            if self._snapshots is not None:
                self._snapshots.batch_dropped(self._buffers)
            return
        if self._sampled and self._snapshots is not None:
            self._snapshots.batch_recorded(self._buffers, self._seen)
        if self._sampled and self._store.close(self._seen):
            self._args = self._buffers.op_args()
        self._seen += 1
        closed, self._sampled = self._sampled, self._seen % self.every == 0
        if closed:
            column = self._placement.column(self.num_batches - 1)
            self._watch.batch_closed(self, self._buffers.order, column)

    def all_reduce(
        self, group: Any = None, mesh: Any = None, mesh_dims: Any = None, batches: Any = None
    ) -> None:
        """Merge every rank's recorded columns into statistics of the whole batch, on every rank.

        Under data parallelism each rank records its own shard, with no communication per batch;
        call this (at the end of training, before reading, or at a log step) on every rank of
        `group` (default: the whole world), or of each of the chosen `mesh_dims` of a
        `DeviceMesh` `mesh` (names or indices; default: all of them). Counts, extremes and
        histograms add up exactly, and means and central moments merge by the operator's rule,
        so uneven shards are right. See `docs/frameworks.md` for what each kind of
        parallelism records.

        - Modules merge by name: ranks that hook different modules (pipeline stages) all end
          with the union of the names, each merged over the ranks that hook it; a module only
          other ranks hook gets a row here, after this rank's own.
        - `batches`: the batch indices (as `act.batches` names them) to merge; default every
          column held, with `window=` too. A column merged before counts each rank's values
          once when merged again (over the same ranks, or more of them).
        - A module whose output is a DTensor merges its pieces: `Shard` pieces into the whole
          tensor, a `Replicate` piece counted once; a tensor-parallel module that returns a
          local tensor is a replica when it holds the whole shape, else a shard.

        Every rank must record with the same options and merge the same batches: if not, every
        rank raises the same `ValueError`. The open column is left as it is. Memory and traffic
        per rank are those of the merged columns, whatever the number of ranks.
        """
        if self._buffers is None:
            raise RuntimeError(
                "all_reduce() called before any statistics were recorded: call it after the "
                "training loop (or inside `with act:`)"
            )
        rows = Rows(
            self.module_names,
            self.module_types,
            self._pieces.pieces,
            plain_replicated=False,
            settings=self._options_settings(),
            replica_mesh=self._pieces.mesh,
        )
        own = len(rows.names) - len(self._others)
        all_reduce(self._store, rows, self._merged, group, mesh, mesh_dims, batches)
        self._others = list(zip(rows.names[own:], rows.types[own:], strict=True))
        if self._snapshots is not None:
            groups = merge_groups(group, mesh, mesh_dims)
            device = self._buffers.channels.device
            pieces = self._pieces.pieces
            merge_snapshots(
                self._snapshots, self.module_names, pieces, groups, device, self._pieces.mesh
            )
        self._args = self._buffers.op_args()  # a merge that added rows made new buffers

    @property
    def nonfinite_ranks(self) -> dict[tuple[int, str], int]:
        """After `all_reduce`: the rank of each merged slot's first non-finite call, by (batch,
        module name); slots without one are absent."""
        return self._merged.nonfinite_ranks

    @property
    def num_batches(self) -> int:
        """How many training batches have been recorded (with `window`, more than are held)."""
        return 0 if self._store is None else self._store.num_batches

    @property
    def batches(self) -> torch.Tensor:
        """int64 `(batches,)`: for each column held, the 0-based index of its training batch."""
        if self._store is None:
            return torch.zeros(0, dtype=torch.int64)
        return self._store.batches

    @property
    def module_names(self) -> list[str]:
        """Qualified names of the hooked modules (`"layer1.0.conv1"`), in column order; the
        model itself is named by its class. A `torch.compile`d part of the model is named as
        before it was compiled (`"net.0"`, not `"net._orig_mod.0"`)."""
        names = {m: uncompiled_name(name) for name, m in self.model.named_modules() if name}
        own = [names.get(m, type(m).__name__) for m in self.resolve_modules()]
        return own + [name for name, _ in self._others]

    def __repr__(self) -> str:
        statistics = ["mean", "std", *self.extra_names] + (
            [f"hist({self.hist_bins})"] if self.hist_bins else []
        )
        return (
            f"ActivationStats(backend={self.backend!r}, modules={len(self.modules or ())}, "
            f"batches={self.num_batches}, statistics={statistics}, every={self.every})"
        )

    def _read(self, name: str) -> torch.Tensor:
        """The held columns of a buffer on the CPU, oldest first."""
        self._report_dropped()
        return self._store.read(self.kind, name)

    def _report_dropped(self) -> None:
        dropped = self._buffers.dropped_calls() if self._buffers is not None else 0
        if dropped > self._dropped_reported:
            self._dropped_reported = dropped
            warnings.warn(
                f"ActivationStats: {dropped} hooked calls were not recorded: they found every "
                f"column of the buffers used ({self._buffers.capacity}), as a CUDA graph replayed "
                f"past its buffers does. Give expected_batches (now {self.expected_batches}) for "
                "the whole run when the step is captured in a CUDA graph",
                RuntimeWarning,
                stacklevel=4,
            )

    @property
    def call_order(self) -> torch.Tensor:
        """int64 `(2, modules, batches)` CPU: for each module and recorded batch, 1 + the call
        clock of the module's first call in it whose values held a NaN or an infinity (0: none),
        and how many they were (-1 with mean and std only). `layout.py` describes the clock."""
        if self._buffers is None:
            return torch.zeros(2, len(self.modules or ()), 0, dtype=torch.int64)
        return self._read("order")

    @property
    def stats(self) -> torch.Tensor:
        """`(2, modules, batches)` float32 CPU (mean, std); NaN where a module did not run.

        On the CPU this is a view of the live buffer (clone it to keep it past the run's end).
        """
        if self._buffers is None:
            return torch.empty(2, len(self.modules or ()), 0)
        return self._read("stats")

    @property
    def extra(self) -> dict[str, torch.Tensor]:
        """Each requested extra statistic as a CPU tensor `(modules, batches)` ("binades" is read
        from `act.binades`)."""
        names = tuple(n for n in self.extra_names if n not in COUNTED_EXTRAS)
        if not names:
            return {}
        if self._buffers is None:
            empty = torch.empty(len(self.modules or ()), 0)
            return {n: empty.long() if n == "nonfinite" else empty for n in names}
        self._report_dropped()
        return self._store.extra(self.kind, names)

    @property
    def binades(self) -> torch.Tensor:
        """`(modules, batches, BINADE_BINS)` int32 CPU counts of the values in each binade
        (`fasthooks.layout.BINADE_NAMES`); only with the "binades" extra."""
        if "binades" not in self.extra_names:
            raise AttributeError('binades are recorded only with extra=("binades", ...)')
        if self._buffers is None:
            return torch.zeros(len(self.modules or ()), 0, BINADE_BINS, dtype=torch.int32)
        return self._read("binades")

    @property
    def top(self) -> torch.Tensor:
        """`(modules, batches, top_k, 2)` float64 CPU (value, channel) pairs, largest magnitude
        first (`top_values` and `top_channels` read them); only with `top_k > 0`."""
        if not self.top_k:
            raise AttributeError("top values are recorded only with top_k > 0")
        if self._buffers is None:
            return torch.zeros(len(self.modules or ()), 0, self.top_k, 2, dtype=torch.float64)
        return self._read("top")

    def _largest_magnitude(self) -> torch.Tensor:
        if self._store is None:
            return torch.empty(len(self.modules or ()), 0)
        return self._store.extra(self.kind, ("absmax",))["absmax"]

    @property
    def hist(self) -> torch.Tensor:
        """`(modules, batches, hist_bins)` int64 CPU counts; only with `hist_bins > 0`."""
        if not self.hist_bins:
            raise AttributeError("hist is recorded only with hist_bins > 0")
        if self._buffers is None:
            return torch.zeros(len(self.modules or ()), 0, self.hist_bins, dtype=torch.int64)
        return self._read("hist")
