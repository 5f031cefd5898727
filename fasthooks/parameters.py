"""ParameterStats: statistics of parameters, their gradients and their updates, one column per
optimizer step, recorded on the parameters' device without a host sync."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import checkpoint
from .arguments import (
    check_extra,
    check_hist,
    check_near_zero,
    check_sink,
    check_window,
    count_argument,
    module_position,
    uncompiled_name,
)
from .buffers import StatBuffers
from .column_store import ColumnStore
from .dtensors import LocalPieces, sink_origin
from .layout import COUNT, DERIVED_EXTRAS, EXTRAS, M2, MEAN
from .merging import Merged, Rows, all_reduce
from .ops import backend_for_device, resolve_backend, resolve_list_backend
from .reading import KindReading
from .window import ColumnWindow

KINDS = ("weight", "grad", "update")


def _check_kinds(of: Any) -> tuple[str, ...]:
    kinds = (of,) if isinstance(of, str) else tuple(of)
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"of: unknown kind {kind!r}; valid ones are {KINDS}")
    if not kinds:
        raise ValueError(f"of: give at least one of {KINDS}")
    return tuple(k for k in KINDS if k in kinds)


def _stepped_parameters(
    model: nn.Module, optimizer: torch.optim.Optimizer, parameters: Any
) -> tuple[list[str], list[nn.Parameter]]:
    """(qualified names, parameters): those given, else every parameter of `model` that the
    optimizer steps, in `model.named_parameters()` order."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = [(uncompiled_name(n), p) for n, p in model.named_parameters()]
    if parameters is None:
        chosen = [(n, p) for n, p in named if id(p) in stepped]
    else:
        by_name = dict(named)
        by_id = {id(p): n for n, p in named}
        chosen = []
        for i, item in enumerate(parameters):
            if isinstance(item, str):
                if item not in by_name:
                    raise KeyError(f"parameters[{i}]: {item!r} is not a parameter of the model")
                chosen.append((item, by_name[item]))
            elif isinstance(item, torch.Tensor) and id(item) in by_id:
                chosen.append((by_id[id(item)], item))
            else:
                raise TypeError(f"parameters[{i}] must be a parameter of the model or its name")
        for i, (name, p) in enumerate(chosen):
            if id(p) not in stepped:
                raise ValueError(f"parameters[{i}] ({name}) is not stepped by the optimizer")
    devices = {p.device for _, p in chosen}
    if len(devices) > 1:
        raise ValueError(
            f"ParameterStats: the parameters live on several devices "
            f"({', '.join(sorted(map(str, devices)))}); give each device a ParameterStats of its "
            "own, with parameters= those on that device"
        )
    return [n for n, _ in chosen], [p for _, p in chosen]


class ParameterStats:
    """Records statistics of each parameter (`"weight"`, after the step), its gradient
    (`"grad"`, the one the optimizer steps with: after clipping, unscaled under
    `torch.amp.GradScaler`; read after the step when the step is given a closure, as LBFGS and
    Lightning's are, since the closure computes it inside the step) and its update (`"update"`,
    after the step minus before it), one column per `optimizer.step()`, through the optimizer's
    step hooks: any `torch.optim` optimizer, and no call in the training loop.

    `ps.stats[kind]` is a float32 CPU tensor `(2, parameters, steps)` (mean and unbiased std);
    `ps.extra[kind][name]` `(parameters, steps)` holds "norm" (L2) and "absmax" always and any of
    `ActivationStats`'s extras; `ps.hist[kind]` the histograms with `hist_bins`.
    `ps.update_ratio` is the update's L2 norm over the weight's before the step and
    `ps.global_norm(kind)` the L2 norm over all recorded parameters per step. For "grad" that
    is the total norm of the gradients the optimizer stepped with: what `clip_grad_norm_`
    returns when clipping did not engage, and `max_norm` (to rounding) when it did, since the
    loop clips before `optimizer.step()`; the unclipped total is `clip_grad_norm_`'s own return
    value, which the loop holds.

    Each recorded step makes one call of the fused operator per kind for all parameters
    (`accumulate_stats_list`), on the parameters' device, with no host sync. The update is the
    difference of the parameters and a snapshot taken before the step, computed inside that
    call; the snapshot is one copy of the recorded parameters, kept for the run (its memory:
    as much as the parameters), taken only on recorded steps, with one more pass (mean and std)
    over the weights before the step for `update_ratio`. Nothing is allocated per step but
    the buffers' doubling. A parameter without a gradient
    in a step reads NaN and counts 0 there. Gradient accumulation gives one column per optimizer
    step by construction. A step that `GradScaler` skips (non-finite gradients) calls no
    `optimizer.step()` and so records no column.

    Args:
        model: the `nn.Module` whose parameters to watch (their names come from it).
        optimizer: the optimizer that steps them.
        parameters: parameters of the model, or their qualified names; default: every parameter
            of `model` the optimizer steps, in `model.named_parameters()` order.
        of: the kinds to record, from "weight", "grad", "update".
        every: record every N-th optimizer step (default 1).
        extra: extra statistics, as for `ActivationStats`.
        near_zero: the threshold of "near_zero", as for `ActivationStats`.
        hist_bins: histogram bins, as for `ActivationStats`.
        hist_range: the histogram's (lo, hi), as for `ActivationStats`.
        backend: "auto", "fused" or "python", as for `ActivationStats`.
        expected_steps: columns allocated up front (default 64); more double the buffers.
        window: keep only the newest N steps on the device, as for `ActivationStats`.
        sink: where each recorded column goes, as for `ActivationStats` (one kind per
            "weight", "grad", "update"; `fasthooks.load(folder, kind="grad")` reads one back).

    Examples:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with ParameterStats(model, opt, backend="python") as ps:
        ...     for _ in range(3):
        ...         model(torch.randn(16, 4)).pow(2).mean().backward()
        ...         opt.step()
        ...         opt.zero_grad()
        >>> ps.param_names[:2], ps.stats["grad"].shape, ps.update_ratio.shape
        (['0.weight', '0.bias'], torch.Size([2, 4, 3]), torch.Size([4, 3]))
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        parameters: Iterable[nn.Parameter | str] | None = None,
        of: Iterable[str] = KINDS,
        every: int = 1,
        extra: Iterable[str] = (),
        hist_bins: int = 0,
        hist_range: tuple[float, float] = (-1.0, 1.0),
        expected_steps: int = 64,
        backend: str = "auto",
        near_zero: float = 0.05,
        window: int | None = None,
        sink: Any = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self.model, self.optimizer = model, optimizer
        self.kinds = _check_kinds(of)
        self.every = count_argument(every, "every", 1)
        self.expected_steps = count_argument(expected_steps, "expected_steps", 1)
        self.window = check_window(window)
        self.sink = check_sink(sink)
        self._placement = ColumnWindow(self.window, self.expected_steps)
        self.extra_names = tuple(dict.fromkeys((*DERIVED_EXTRAS, *check_extra(extra, EXTRAS))))
        self.hist_bins, self.hist_min, self.hist_max = check_hist(hist_bins, hist_range)
        self.near_zero = check_near_zero(near_zero)
        self._accumulate = resolve_list_backend(backend)
        self._backend = (backend, resolve_backend(backend)[0])  # as asked for, and resolved
        self._names, self._params = _stepped_parameters(model, optimizer, parameters)
        self._store: ColumnStore | None = None
        self._pieces = LocalPieces("ParameterStats", parameters=True)
        self._handles: list[Any] = []
        self._resume: dict[str, Any] | None = None
        self._start()

    def _start(self) -> None:
        self._step_count = 0  # optimizer steps seen
        self._recording = False
        self._grads_after = False  # whether this step's gradients are read after it (a closure)
        self._merged = Merged()
        self._others: list[tuple[str, str]] = []  # (name, type) of rows only other ranks hold

    @property
    def param_names(self) -> list[str]:
        """The qualified name of each recorded parameter, in row order (after `all_reduce`,
        those only other ranks hold follow)."""
        return self._names + [name for name, _ in self._others]

    @property
    def param_types(self) -> list[str]:
        """The class name of each recorded parameter (a DTensor's is "DTensor"), in row order."""
        return [type(p).__name__ for p in self._params] + [t for _, t in self._others]

    # Lifecycle ------------------------------------------------------------------------------

    def __enter__(self) -> ParameterStats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Allocate the buffers and register the optimizer's step hooks (the `with` block's
        start); a saved state given to `load_state_dict` continues here."""
        self.stop()
        self._start()
        resume, self._resume = self._resume, None
        device = self._params[0].device if self._params else torch.device("cpu")
        requested, resolved = self._backend
        if backend_for_device(resolved, requested, device) != resolved:
            self._accumulate = resolve_list_backend("python")
        if self._store is not None:
            self._store.stop_sink()
        self._store = ColumnStore(
            self._placement,
            list(self.kinds),
            len(self._params),
            device,
            True,  # norm and absmax need the extremes
            self.hist_bins,
            ordered=False,
            # The weights before the step, for update_ratio.
            aux=("before",) if "update" in self.kinds else (),
            resume_batches=0 if resume is None else resume["num_batches"],
        )
        with torch.inference_mode(False):
            # Views (in place steps show); a DTensor's local piece (FSDP2, tensor parallelism).
            self._weights = [
                self._pieces.local(p.detach(), i, lambda i=i: self.param_names[i])
                for i, p in enumerate(self._params)
            ]
            self._snapshots = [w.clone() for w in self._weights] if "update" in self.kinds else []
            self._no_grad = torch.empty(0, device=device)
        if resume is not None:
            self._store.restore(resume)
            self._step_count = resume["seen"]
        if self.sink is not None:
            describe = {
                "recorder": "ParameterStats",
                **self._settings(),
                # The non-finite counts always go: a loaded run's first_nonfinite reads them.
                "extra": list(dict.fromkeys((*self.extra_names, "nonfinite"))),
                "types": self.param_types,
            }
            self._store.start_sink(self.sink, describe, resume, self._sink_origin)
        self._handles = [
            self.optimizer.register_step_pre_hook(self._before_step),
            self.optimizer.register_step_post_hook(self._after_step),
        ]

    def _sink_origin(self) -> dict[str, Any]:
        return sink_origin(self._pieces.pieces, self.param_names)

    def stop(self) -> None:
        """Remove the step hooks and send the sink what it lacks; the statistics stay
        readable."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._store is not None:
            self._store.flush()
            self._store.stop_sink()

    def flush(self) -> None:
        """Send every recorded column not yet in the sink to it, and wait until it has them."""
        if self._store is not None:
            self._store.flush()

    # Recording ------------------------------------------------------------------------------

    def _call(self, b: StatBuffers, xs: list[torch.Tensor], bases: list[torch.Tensor]) -> None:
        self._accumulate(xs, bases, *b.list_op_args(), self.near_zero, self.hist_min, self.hist_max)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._recording = self._step_count % self.every == 0
        if not self._recording:
            return
        # A step given a closure (LBFGS, Lightning) computes its gradients inside the step:
        # they are read after it.
        self._grads_after = kwargs.get("closure", args[0] if args else None) is not None
        with torch.no_grad():
            if "grad" in self.kinds and not self._grads_after:
                self._record_grads()
            if "update" in self.kinds:
                torch._foreach_copy_(self._snapshots, self._weights)
                self._call(self._store.buffers["before"], self._weights, [])

    def _record_grads(self) -> None:
        grads = [
            self._no_grad
            if p.grad is None
            else self._pieces.local(p.grad, i, lambda i=i: self.param_names[i])
            for i, p in enumerate(self._params)
        ]
        self._call(self._store.buffers["grad"], [g.detach() for g in grads], [])

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._recording:
            with torch.no_grad():
                if "grad" in self.kinds and self._grads_after:
                    self._record_grads()
                if "weight" in self.kinds:
                    self._call(self._store.buffers["weight"], self._weights, [])
                if "update" in self.kinds:
                    self._call(self._store.buffers["update"], self._weights, self._snapshots)
            self._close_column()
        self._recording = False
        self._step_count += 1

    def _close_column(self) -> None:
        self._store.close(self._step_count)

    # Reading --------------------------------------------------------------------------------

    def _kinds(self) -> list[str]:
        """The recorded kinds once started (reading before `start()` finds none)."""
        return [] if self._store is None else self.kinds

    @property
    def num_steps(self) -> int:
        """How many optimizer steps have been recorded (with `window`, more than are held)."""
        return 0 if self._store is None else self._store.num_batches

    @property
    def steps(self) -> torch.Tensor:
        """int64 `(steps,)`: for each column held, the 0-based index of its optimizer step."""
        if self._store is None:
            return torch.zeros(0, dtype=torch.int64)
        return self._store.batches

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """Per kind, float32 CPU `(2, parameters, steps)`: mean and unbiased std."""
        return {k: self._store.read(k, "stats") for k in self._kinds()}

    @property
    def extra(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per kind, each extra statistic ("norm", "absmax", and those asked for) as a CPU
        tensor `(parameters, steps)`."""
        return {k: self._store.extra(k, self.extra_names) for k in self._kinds()}

    @property
    def hist(self) -> dict[str, torch.Tensor]:
        """Per kind, int64 CPU `(parameters, steps, hist_bins)`; only with `hist_bins > 0`."""
        if not self.hist_bins:
            raise AttributeError("hist is recorded only with hist_bins > 0")
        return {k: self._store.read(k, "hist") for k in self._kinds()}

    @property
    def update_ratio(self) -> torch.Tensor:
        """float32 `(parameters, steps)`: the update's L2 norm over the weight's before the step
        (the learning-rate diagnostic; around 1e-3 is the usual rule of thumb)."""
        if "update" not in self.kinds:
            raise AttributeError('update_ratio needs "update" among the kinds recorded (of=)')
        if self._store is None:
            return torch.zeros(len(self.param_names), 0)
        state = self._store.read("before", "state")
        before = (state[M2] + state[COUNT] * state[MEAN] * state[MEAN]).sqrt()
        return (self.extra["update"]["norm"].double() / before).float()

    def global_norm(self, kind: str = "grad") -> torch.Tensor:
        """float32 `(steps,)`: the L2 norm over all recorded parameters of `kind` per step;
        parameters without a value in a step (no gradient) count as absent, as in
        `clip_grad_norm_`. For "grad", the gradients the optimizer stepped with: after any
        clipping (`max_norm` when clipping engaged)."""
        if kind not in self.kinds:
            raise KeyError(f"kind {kind!r} is not recorded; recorded kinds: {self.kinds}")
        norms = self.extra[kind]["norm"].double()
        return norms.nan_to_num(0.0).pow(2).sum(0).sqrt().float()

    def param_index(self, param: int | str) -> int:
        """The row of a parameter, given its qualified name or an index (negative too)."""
        return module_position(self.param_names, param)

    def all_reduce(
        self, group: Any = None, mesh: Any = None, mesh_dims: Any = None, batches: Any = None
    ) -> None:
        """Merge every rank's columns into the statistics of whole parameters, on every rank of
        `group` (default: the world), or of each of the chosen `mesh_dims` of `mesh`: call it on
        every rank after training (or before reading, or at a log step with `batches=`, the step
        indices as `ps.steps` names them). Arguments as `ActivationStats.all_reduce`.

        A sharded parameter (FSDP2's, a tensor-parallel one) merges its pieces into the whole;
        a replicated one counts once: a DTensor `Replicate` piece from one of the ranks holding
        it, and a plain parameter (the same on every rank under `DistributedDataParallel`) from
        the lowest rank that holds it. Parameters merge by name: pipeline stages end with every
        stage's. Then `stats`, `extra`, `hist`, `update_ratio` and `global_norm` are those of
        the whole model, as one process holding it all records them.
        """
        if self._store is None:
            raise RuntimeError("all_reduce() called before start() (the `with ps:` block)")
        rows = Rows(
            self.param_names,
            self.param_types,
            self._pieces.pieces,
            plain_replicated=True,
            settings=self._options_settings(),
        )
        own = len(self._names)
        all_reduce(self._store, rows, self._merged, group, mesh, mesh_dims, batches)
        self._others = list(zip(rows.names[own:], rows.types[own:], strict=True))

    @property
    def placements(self) -> dict[str, str]:
        """The placements of each parameter that is a DTensor (FSDP2, tensor parallelism), by
        name: its local piece is what is recorded."""
        return self._pieces.by_name(self.param_names)

    def __getitem__(self, kind: str) -> KindReading:
        """One recorded kind with `ActivationStats`' reading API (`stats`, `extra`, `hist`,
        `layer_stats`, `summary`, `plot`, `color_dim`, `to_dataframe`, ...): rows are the
        parameters, columns the optimizer steps."""
        if kind not in self.kinds:
            raise KeyError(f"kind {kind!r} is not recorded; recorded kinds: {self.kinds}")
        if self._store is None:
            raise RuntimeError(f'ps["{kind}"] is read after start() (the `with ps:` block)')
        settings = {**self._settings(), "types": self.param_types}
        return KindReading(self._store, kind, settings)

    def layer_stats(self, param: int | str) -> dict[str, dict[str, torch.Tensor]]:
        """Every recorded statistic of one parameter, per kind: `(steps,)` CPU tensors "mean",
        "std" and each extra."""
        index = self.param_index(param)
        return {kind: self[kind].layer_stats(index) for kind in self._kinds()}

    def to_dataframe(self) -> Any:
        """Every recorded statistic as a pandas DataFrame in long format: columns `step`,
        `param`, `kind`, `stat`, `value` (needs pandas)."""
        from .export import parameter_table

        return parameter_table(self)

    def plot(self, kind: str = "grad", path: str | Path | None = None) -> Any:
        """A heat map per statistic of one kind over parameters and steps (a Figure, saved as a
        PNG at `path` when given); readable at 300 parameters and more."""
        return self[kind].plot(path)

    def log_to_tensorboard(self, writer: Any, step: int | None = None) -> None:
        """Write the newest recorded column of every statistic of every kind to a
        `SummaryWriter`, tagged `parameters/<kind>/<name>/<stat>`; `step` defaults to that
        column's optimizer step."""
        for kind in self._kinds():
            self[kind].log_to_tensorboard(writer, step)

    # Saving ---------------------------------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        return {"names": self.param_names, **self._options_settings()}

    def _options_settings(self) -> dict[str, Any]:
        return {
            "kinds": list(self.kinds),
            "extra": list(self.extra_names),
            "near_zero": self.near_zero,
            "hist_bins": self.hist_bins,
            "hist_range": [self.hist_min, self.hist_max],
            "every": self.every,
            "window": self.window,
        }

    def state_dict(self) -> dict[str, Any]:
        """The recorded columns and position, as CPU tensors and plain values, to save with a
        training checkpoint (`torch.load(..., weights_only=True)` reads it)."""
        store = self._store
        if store is None:
            store = ColumnStore(
                self._placement, list(self.kinds), len(self._params), "cpu", True, 0
            )
        return checkpoint.state_dict("ParameterStats", self._settings(), self._step_count, store)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the columns of a saved run at the next `start()` (the next `with ps:`); a
        state from other parameters or with other statistics is refused."""
        self._resume = checkpoint.checked(state, "ParameterStats", self._settings(), self.kinds)
        if self._handles:
            self.start()

    def __repr__(self) -> str:
        statistics = ["mean", "std", *self.extra_names] + (
            [f"hist({self.hist_bins})"] if self.hist_bins else []
        )
        return (
            f"ParameterStats(parameters={len(self.param_names)}, kinds={list(self.kinds)}, "
            f"steps={self.num_steps}, statistics={statistics}, every={self.every})"
        )
