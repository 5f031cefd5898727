"""ActivationStats and ParameterStats in a fastai (v2) `Learner`: `pip install fasthooks[fastai]`.

Examples:
    >>> from fasthooks.integrations.fastai import ActivationStatsCallback, ParameterStatsCallback
    >>> callbacks = [ActivationStatsCallback(extra=["max"]), ParameterStatsCallback(of="grad")]
    >>> # learn.fit(1, cbs=callbacks); callbacks[1].parameter_stats.global_norm("grad")
"""

from __future__ import annotations

from typing import Any

import torch
from fastai.callback.core import Callback, CancelFitException
from fastai.optimizer import OptimWrapper

from .activation_recorder import ActivationFitRecorder, RecordsActivations
from .parameter_recorder import ParameterFitRecorder, RecordsParameters
from .recorder import FitRecorder
from .steps import StepPatch, StepRelay

DEFAULT_LOG_EVERY_N_STEPS = 50


class _LearnerRecording(Callback):
    """The fastai events of a recording callback."""

    _recorder: FitRecorder

    def __init__(self, recorder: FitRecorder) -> None:
        super().__init__()
        self._recorder = recorder
        self._step_cancelled = False

    def _begin(self, estimated_steps: int) -> None:
        raise NotImplementedError

    def _write(self, writer: Any, metrics: dict[str, float]) -> None:
        """Write the newest column to a TensorBoard writer."""
        raise NotImplementedError

    def before_fit(self) -> None:
        learn = self.learn
        self._begin(learn.n_epoch * len(learn.dls.train))
        self._step_cancelled = False

    def after_cancel_step(self) -> None:
        self._step_cancelled = True

    def after_step(self) -> None:
        if self._step_cancelled:  # fastai calls after_step even when the step was cancelled
            self._step_cancelled = False
            return
        metrics = self._recorder.step(DEFAULT_LOG_EVERY_N_STEPS)
        if self._recorder.stopped_by is not None:
            raise CancelFitException  # the error is raised from after_fit
        if not metrics:
            return
        for callback in self.learn.cbs:
            writer = getattr(callback, "writer", None)
            if writer is not None and getattr(callback, "run", False):
                self._write(writer, metrics)

    def after_fit(self) -> None:
        self._recorder.end()


class ActivationStatsCallback(RecordsActivations, _LearnerRecording):
    """Records `ActivationStats(learn.model, **kwargs)` over each `learn.fit`.

    One column per optimizer step: a step cancelled by another callback (`CancelStepException`)
    merges its batch into the next step's column, and a batch skipped before its step
    (`GradientAccumulation`) likewise. `expected_batches` defaults to fastai's count of training
    iterations (`n_epoch * len(dls.train)`). Every `log_every_n_steps` steps (default 50; 0 for
    none) the newest column goes, tagged `activations/<module>/<stat>`, to the writer of each
    fastai TensorBoard callback of the learner. At the end of the fit, hooks are removed and,
    when several processes train (an initialised process group of more than one rank), every
    rank's statistics merged (`all_reduce`). fastai tells callbacks nothing of other
    exceptions: run `learn.fit` inside `with callback:` to remove the hooks then too. With
    `on_nonfinite="raise"` the fit is cancelled after the step where it was found and
    `learn.fit` raises `NonFiniteError`. With `window=` and no `sink=`, every column also goes
    to `<learn.path>/fasthooks/activations` (`fasthooks.load` reads it). On the learner it is
    `learn.fasthooks`; the live object is `.activation_stats`.
    """

    def __init__(self, log_every_n_steps: int = DEFAULT_LOG_EVERY_N_STEPS, **kwargs: Any) -> None:
        super().__init__(ActivationFitRecorder(kwargs, log_every_n_steps))

    @property
    def name(self) -> str:
        return "fasthooks"

    def _begin(self, estimated_steps: int) -> None:
        learn = self.learn
        self._recorder.begin(learn.model, estimated_steps=estimated_steps, log_dir=learn.path)

    def _write(self, writer: Any, metrics: dict[str, float]) -> None:
        self.activation_stats.log_to_tensorboard(writer, step=self.learn.train_iter)


class ParameterStatsCallback(RecordsParameters, _LearnerRecording):
    """Records `ParameterStats(learn.model, optimizer, **kwargs)` over each `learn.fit`, around
    every `learn.opt.step()`.

    `learn.opt` wrapping a torch optimizer (`opt_func=partial(OptimWrapper, opt=...)`) is hooked
    itself; fastai's own optimizers (the default `Adam`, `SGD`, `ranger`...) are not torch ones,
    so for the fit a torch optimizer over the same parameters stands in for `learn.opt.step`:
    either way every step fastai takes records a column, after the callbacks that change the
    gradients before it (`GradientClip`, `MixedPrecision`'s unscaling), and a step cancelled
    (`CancelStepException`, a skipped mixed-precision step) or skipped (`GradientAccumulation`)
    records none. `expected_steps` defaults to fastai's count of training iterations
    (`n_epoch * len(dls.train)`). Every `log_every_n_steps` steps (default 50; 0 for none) the
    newest step goes to the writer of each fastai TensorBoard callback of the learner, as
    `fasthooks.export.newest_parameter_metrics` tags it: each parameter's norm per kind,
    `parameters/<kind>/<param>/norm`, the global norm per kind, `parameters/<kind>/global_norm`,
    and each parameter's update ratio, `parameters/update_ratio/<param>`. At the end of the fit,
    hooks are removed and, when several processes train, every rank's statistics merged
    (`all_reduce`); run `learn.fit` inside `with callback:` to remove them on an exception too.
    With `window=` and no `sink=`, every column also goes to `<learn.path>/fasthooks/parameters`
    (`fasthooks.load(folder, kind="grad")` reads it). On the learner it is
    `learn.fasthooks_parameters`; the live object is `.parameter_stats`.
    """

    def __init__(self, log_every_n_steps: int = DEFAULT_LOG_EVERY_N_STEPS, **kwargs: Any) -> None:
        super().__init__(ParameterFitRecorder(kwargs, log_every_n_steps))

    @property
    def name(self) -> str:
        return "fasthooks_parameters"

    def _begin(self, estimated_steps: int) -> None:
        learn = self.learn
        optimizer, patch = _stepping(learn.opt)
        self._recorder.begin(
            learn.model, optimizer, patch, estimated_steps=estimated_steps, log_dir=learn.path
        )

    def _write(self, writer: Any, metrics: dict[str, float]) -> None:
        for tag, value in metrics.items():
            writer.add_scalar(tag, value, self.learn.train_iter)


def _stepping(opt: Any) -> tuple[torch.optim.Optimizer, StepPatch | None]:
    """The torch optimizer to hook for `learn.opt`, and the patch of `learn.opt.step` that makes
    it step: the one an `OptimWrapper` wraps needs none, fastai's own gets a `StepRelay`."""
    if isinstance(opt, OptimWrapper) and isinstance(opt.opt, torch.optim.Optimizer):
        return opt.opt, None
    relay = StepRelay(opt)
    return relay, relay.patch
