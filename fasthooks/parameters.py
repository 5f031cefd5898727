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
from .buffers import HostCopy, StatBuffers, host_copies
from .layout import COUNT, DERIVED_EXTRAS, M2, MEAN
from .ops import backend_for_device, resolve_backend, resolve_list_backend
from .sink import ColumnDrain
from .stats import read_extras
from .window import ColumnWindow

KINDS = ("weight", "grad", "update")
VERSION = 1


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
    `torch.amp.GradScaler`) and its update (`"update"`, after the step minus before it), one
    column per `optimizer.step()`, through the optimizer's step hooks: any `torch.optim`
    optimizer, and no call in the training loop.

    `ps.stats[kind]` is a float32 CPU tensor `(2, parameters, steps)` (mean and unbiased std);
    `ps.extra[kind][name]` `(parameters, steps)` holds "norm" (L2) and "absmax" always and any of
    `ActivationStats`'s extras; `ps.hist[kind]` the histograms with `hist_bins`.
    `ps.update_ratio` is the update's L2 norm over the weight's before the step and
    `ps.global_norm(kind)` the L2 norm over all recorded parameters per step (for "grad" the
    number `clip_grad_norm_` computes).

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
        self._window = ColumnWindow(self.window, self.expected_steps)
        self._drain: ColumnDrain | None = None
        self.extra_names = tuple(dict.fromkeys((*DERIVED_EXTRAS, *check_extra(extra))).keys())
        self.hist_bins, self.hist_min, self.hist_max = check_hist(hist_bins, hist_range)
        self.near_zero = check_near_zero(near_zero)
        self._accumulate = resolve_list_backend(backend)
        self._backend = (backend, resolve_backend(backend)[0])  # as asked for, and resolved
        self.param_names, self._params = _stepped_parameters(model, optimizer, parameters)
        self._buffers: dict[str, StatBuffers] = {}
        self._handles: list[Any] = []
        self._resume: dict[str, Any] | None = None
        self._start()

    def _start(self) -> None:
        self._num_steps = 0
        self._step_count = 0  # optimizer steps seen
        self._step_ids = self._window.batch_ids()
        self._recording = False
        self._host = {kind: host_copies() for kind in self.kinds}
        self._host_before = HostCopy(2, torch.float64)

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
        capacity = self._window.capacity
        if resume is not None and self.window is None:
            capacity = max(capacity, resume["num_steps"] + 1)
        device = self._params[0].device if self._params else torch.device("cpu")
        requested, resolved = self._backend
        if backend_for_device(resolved, requested, device) != resolved:
            self._accumulate = resolve_list_backend("python")
        full = True  # norm and absmax need the extremes
        self._buffers = {
            kind: StatBuffers(
                len(self._params), capacity, device, full, self.hist_bins, ordered=False
            )
            for kind in self.kinds
        }
        if "update" in self.kinds:  # the weights before the step, for update_ratio
            self._before = StatBuffers(len(self._params), capacity, device, False, 0, ordered=False)
        with torch.inference_mode(False):
            self._weights = [p.detach() for p in self._params]  # views: in place steps show
            self._snapshots = [w.clone() for w in self._weights] if "update" in self.kinds else []
            self._no_grad = torch.empty(0, device=device)
        if resume is not None:
            for kind in self.kinds:
                saved = {"num_batches": resume["num_steps"], **resume["buffers"][kind]}
                checkpoint.restore(saved, self._buffers[kind], self._window)
            if "update" in self.kinds:
                saved = {"num_batches": resume["num_steps"], "state": resume["before"]}
                checkpoint.restore(saved, self._before, self._window)
            self._num_steps, self._step_count = resume["num_steps"], resume["step_count"]
            self._step_ids.extend(resume["steps"].tolist())
        if self._drain is not None:
            self._drain.close()
            self._drain = None
        if self.sink is not None:
            describe = {
                "recorder": "ParameterStats",
                "kinds": list(self.kinds),
                "names": list(self.param_names),
                "types": [type(p).__name__ for p in self._params],
                "extra": list(self.extra_names),
                "hist_bins": self.hist_bins,
                "hist_range": [self.hist_min, self.hist_max],
                "near_zero": self.near_zero,
                "every": self.every,
            }
            sent = resume.get("sink_sent", 0) if resume is not None else 0
            through = resume.get("sink_through", -1) if resume is not None else -1
            self._drain = ColumnDrain(self.sink, self._window, describe, sent, through)
        self._handles = [
            self.optimizer.register_step_pre_hook(self._before_step),
            self.optimizer.register_step_post_hook(self._after_step),
        ]

    def stop(self) -> None:
        """Remove the step hooks and send the sink what it lacks; the statistics stay
        readable."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.flush()
        if self._drain is not None:
            self._drain.close()  # its thread; a later flush starts it again

    def flush(self) -> None:
        """Send every recorded column not yet in the sink to it, and wait until it has them."""
        if self._drain is not None:
            self._drain.flush(self._buffers, self._step_ids, self._num_steps)

    # Recording ------------------------------------------------------------------------------

    def _call(self, b: StatBuffers, xs: list[torch.Tensor], bases: list[torch.Tensor]) -> None:
        self._accumulate(xs, bases, *b.list_op_args(), self.near_zero, self.hist_min, self.hist_max)

    def _all_buffers(self) -> list[StatBuffers]:
        return [*self._buffers.values(), *([self._before] if "update" in self.kinds else [])]

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._recording = self._step_count % self.every == 0
        if not self._recording:
            return
        with torch.no_grad():
            if "grad" in self.kinds:
                grads = [p.grad if p.grad is not None else self._no_grad for p in self._params]
                self._call(self._buffers["grad"], [g.detach() for g in grads], [])
            if "update" in self.kinds:
                torch._foreach_copy_(self._snapshots, self._weights)
                self._call(self._before, self._weights, [])

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._recording:
            with torch.no_grad():
                if "weight" in self.kinds:
                    self._call(self._buffers["weight"], self._weights, [])
                if "update" in self.kinds:
                    self._call(self._buffers["update"], self._weights, self._snapshots)
            self._close_column()
        self._recording = False
        self._step_count += 1

    def _close_column(self) -> None:
        self._step_ids.append(self._step_count)
        self._num_steps += 1
        if self._drain is not None:
            self._drain.closed(self._buffers, self._step_ids, self._num_steps)
        self._window.advance(self._all_buffers(), self._num_steps)

    # Reading --------------------------------------------------------------------------------

    def _read(self, kind: str, name: str, source: torch.Tensor) -> torch.Tensor:
        return self._window.read(self._host[kind][name], source, self._num_steps)

    @property
    def num_steps(self) -> int:
        """How many optimizer steps have been recorded (with `window`, more than are held)."""
        return self._num_steps

    @property
    def steps(self) -> torch.Tensor:
        """int64 `(steps,)`: for each column held, the 0-based index of its optimizer step."""
        return torch.tensor(self._step_ids, dtype=torch.int64)

    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """Per kind, float32 CPU `(2, parameters, steps)`: mean and unbiased std."""
        return {k: self._read(k, "stats", b.stats) for k, b in self._buffers.items()}

    @property
    def extra(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per kind, each extra statistic ("norm", "absmax", and those asked for) as a CPU
        tensor `(parameters, steps)`."""
        return {
            kind: read_extras(
                self.extra_names, lambda name, t, kind=kind: self._read(kind, name, t), b
            )
            for kind, b in self._buffers.items()
        }

    @property
    def hist(self) -> dict[str, torch.Tensor]:
        """Per kind, int64 CPU `(parameters, steps, hist_bins)`; only with `hist_bins > 0`."""
        if not self.hist_bins:
            raise AttributeError("hist is recorded only with hist_bins > 0")
        return {k: self._read(k, "hist", b.hist) for k, b in self._buffers.items()}

    @property
    def update_ratio(self) -> torch.Tensor:
        """float32 `(parameters, steps)`: the update's L2 norm over the weight's before the step
        (the learning-rate diagnostic; around 1e-3 is the usual rule of thumb)."""
        if "update" not in self.kinds:
            raise AttributeError('update_ratio needs "update" among the kinds recorded (of=)')
        state = self._window.read(self._host_before, self._before.state, self._num_steps)
        before = (state[M2] + state[COUNT] * state[MEAN] * state[MEAN]).sqrt()
        return (self.extra["update"]["norm"].double() / before).float()

    def global_norm(self, kind: str = "grad") -> torch.Tensor:
        """float32 `(steps,)`: the L2 norm over all recorded parameters of `kind` per step;
        parameters without a value in a step (no gradient) count as absent, as in
        `clip_grad_norm_`."""
        if kind not in self.kinds:
            raise KeyError(f"kind {kind!r} is not recorded; recorded kinds: {self.kinds}")
        norms = self.extra[kind]["norm"].double()
        return norms.nan_to_num(0.0).pow(2).sum(0).sqrt().float()

    def param_index(self, param: int | str) -> int:
        """The row of a parameter, given its qualified name or an index (negative too)."""
        return module_position(self.param_names, param)

    def layer_stats(self, param: int | str) -> dict[str, dict[str, torch.Tensor]]:
        """Every recorded statistic of one parameter, per kind: `(steps,)` CPU tensors "mean",
        "std" and each extra."""
        index = self.param_index(param)
        stats, extra = self.stats, self.extra
        return {
            kind: {
                "mean": stats[kind][0, index],
                "std": stats[kind][1, index],
                **{name: values[index] for name, values in extra[kind].items()},
            }
            for kind in self.kinds
        }

    def to_dataframe(self) -> Any:
        """Every recorded statistic as a pandas DataFrame in long format: columns `step`,
        `param`, `kind`, `stat`, `value` (needs pandas)."""
        from .export import parameter_table

        return parameter_table(self)

    def plot(self, kind: str = "grad", path: str | Path | None = None) -> Any:
        """A heat map per statistic of one kind over parameters and steps (a Figure, saved as a
        PNG at `path` when given); readable at 300 parameters and more."""
        from .plot import parameter_overview

        return parameter_overview(self, kind, path)

    def log_to_tensorboard(self, writer: Any, step: int | None = None) -> None:
        """Write the newest recorded column of every statistic of every kind to a
        `SummaryWriter`, tagged `parameters/<kind>/<name>/<stat>`; `step` defaults to that
        column's optimizer step."""
        from .export import log_parameters_to_tensorboard

        log_parameters_to_tensorboard(self, writer, step)

    # Saving ---------------------------------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        return {
            "param_names": list(self.param_names),
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
        n = self._num_steps
        buffers = {}
        for kind, b in self._buffers.items():
            held = checkpoint.held_columns(b, self._window, n)
            buffers[kind] = {"state": held["state"], "hist": held["hist"]}
        position = {}
        if self._drain is not None:
            self.flush()  # the sink then holds every step the state does
            position = {"sink_sent": n, "sink_through": self._step_ids[-1] if n else -1}
        return {
            "version": VERSION,
            **self._settings(),
            "num_steps": n,
            "step_count": self._step_count,
            "steps": self.steps,
            "buffers": buffers,
            "before": checkpoint.held_columns(self._before, self._window, n)["state"]
            if self._buffers and "update" in self.kinds
            else torch.empty(0),
            **position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the columns of a saved run at the next `start()` (the next `with ps:`); a
        state from other parameters or with other statistics is refused."""
        if state.get("version") != VERSION:
            raise ValueError(f"state_dict: version {state.get('version')!r}, wanted {VERSION}")
        for key, want in self._settings().items():
            if state.get(key) != want:
                raise ValueError(
                    f"state_dict: saved {key} {state.get(key)!r} does not match this "
                    f"ParameterStats' {want!r}"
                )
        self._resume = state
        if self._handles:
            self.start()

    def __repr__(self) -> str:
        statistics = ["mean", "std", *self.extra_names] + (
            [f"hist({self.hist_bins})"] if self.hist_bins else []
        )
        return (
            f"ParameterStats(parameters={len(self.param_names)}, kinds={list(self.kinds)}, "
            f"steps={self._num_steps}, statistics={statistics}, every={self.every})"
        )
