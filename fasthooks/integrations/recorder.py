"""What every framework callback does, framework aside: one `ActivationStats` per fit, hooked at
its start, one column per optimizer step, the newest column as metrics every few steps, hooks
removed at its end or on an error, and a fit stopped cleanly by `on_nonfinite="raise"`."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from ..arguments import count_argument
from ..export import newest_metrics
from ..nonfinite import NonFiniteError
from ..stats import ActivationStats


class FitRecorder:
    """The `ActivationStats` of one fit at a time, driven by a framework's events."""

    def __init__(self, options: dict[str, Any], log_every_n_steps: Any) -> None:
        if "model" in options:
            raise TypeError("model: the callback hooks the model that the trainer fits; omit it")
        ActivationStats(nn.Module(), **options)  # every argument checked now, not at fit start
        self.options = options
        self.log_every_n_steps = (
            None
            if log_every_n_steps is None
            else count_argument(log_every_n_steps, "log_every_n_steps", 0)
        )
        self.activation_stats: ActivationStats | None = None
        self.resume: dict[str, Any] | None = None  # a saved state to continue at the next fit
        # The NonFiniteError of `on_nonfinite="raise"`: the framework is asked to stop, and the
        # error is raised at the end of the fit, once the hooks are removed.
        self.stopped_by: NonFiniteError | None = None
        self._steps = 0

    def begin(
        self, model: nn.Module, estimated_steps: float | None, log_dir: str | None = None
    ) -> None:
        """Hook `model` for a new fit; the buffers hold the framework's estimate of its steps.
        With `window=` and no `sink=`, the columns go to a folder under the framework's
        `log_dir` (when it has one): `<log_dir>/fasthooks/activations` (or `gradients`)."""
        self.abort()
        options = dict(self.options)
        if "expected_batches" not in options and _usable(estimated_steps):
            every = options.get("every", 1)
            options["expected_batches"] = max(1, math.ceil(estimated_steps / every))
        if options.get("window") is not None and options.get("sink") is None and log_dir:
            what = "activations" if options.get("is_forward", True) else "gradients"
            options["sink"] = Path(log_dir) / "fasthooks" / what
        self.activation_stats = ActivationStats(model, **options)
        if self.resume is not None:
            self.activation_stats.load_state_dict(self.resume)
            self.resume = None
        self.activation_stats.on_train_begin()
        self._steps = 0
        self.stopped_by = None

    def step(self, default_log_every: int) -> dict[str, float]:
        """Close the column of an optimizer step; its metrics when they are due, else {}."""
        act = self.activation_stats
        if act is None or self.stopped_by is not None:
            return {}
        try:
            act.on_batch_end(train=True)
        except NonFiniteError as error:
            self.stopped_by = error
            return {}
        self._steps += 1
        every = self.log_every_n_steps
        every = default_log_every if every is None else every
        if every <= 0 or self._steps % every:
            return {}
        return newest_metrics(act)

    def end(self) -> None:
        """At the end of a fit: merge every rank's statistics when distributed, remove hooks;
        then raise the NonFiniteError that stopped it, if one did."""
        import torch.distributed as dist

        act = self.activation_stats
        if act is None:
            return
        if dist.is_available() and dist.is_initialized():
            if act.window is None:
                act.all_reduce()
            else:
                warnings.warn(
                    "ActivationStats with window= is not merged across ranks at the end of the "
                    "fit: each rank keeps (and sends its sink) the statistics of its own shard",
                    RuntimeWarning,
                    stacklevel=2,
                )
        act.on_train_end()
        error, self.stopped_by = self.stopped_by, None
        if error is not None:
            raise error

    def abort(self) -> None:
        """After an error: remove the hooks, keep the statistics recorded so far."""
        if self.activation_stats is not None:
            self.activation_stats.on_train_end()


def _usable(steps: float | None) -> bool:
    return steps is not None and math.isfinite(steps) and steps > 0


class RecordingCallback:
    """The user-facing side shared by every framework's callback."""

    _recorder: FitRecorder

    @property
    def activation_stats(self) -> ActivationStats | None:
        """The live `ActivationStats` of the current (or last) fit; None before the first."""
        return self._recorder.activation_stats

    def __enter__(self) -> RecordingCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving a `with` block removes the hooks, also when training raised."""
        self._recorder.abort()
