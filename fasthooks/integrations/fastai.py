"""ActivationStats in a fastai (v2) `Learner`: `pip install fasthooks[fastai]`.

Examples:
    >>> from fasthooks.integrations.fastai import ActivationStatsCallback
    >>> callback = ActivationStatsCallback(extra=["max"], hist_bins=40)
    >>> # learn.fit(1, cbs=[callback]); callback.activation_stats.stats
"""

from __future__ import annotations

from typing import Any

from fastai.callback.core import Callback, CancelFitException

from .recorder import FitRecorder, RecordingCallback

DEFAULT_LOG_EVERY_N_STEPS = 50


class ActivationStatsCallback(RecordingCallback, Callback):
    """Records `ActivationStats(learn.model, **kwargs)` over each `learn.fit`.

    One column per optimizer step: a step cancelled by another callback (`CancelStepException`)
    merges its batch into the next step's column, and a batch skipped before its step
    (`GradientAccumulation`) likewise. `expected_batches` defaults to fastai's count of training
    iterations (`n_epoch * len(dls.train)`). Every `log_every_n_steps` steps (default 50; 0 for
    none) the newest column goes, tagged `activations/<module>/<stat>`, to the writer of each
    fastai TensorBoard callback of the learner. At the end of the fit, hooks are removed and,
    when a process group is initialised, every rank's statistics merged (`all_reduce`). fastai
    tells callbacks nothing of other exceptions: run `learn.fit` inside `with callback:` to
    remove the hooks then too. With `on_nonfinite="raise"` the fit is cancelled after the step
    where it was found and `learn.fit` raises `NonFiniteError`. With `window=` and no `sink=`,
    every column also goes to `<learn.path>/fasthooks/activations` (`fasthooks.load` reads it).
    On the learner it is `learn.fasthooks`; the live object is `.activation_stats`.
    """

    def __init__(self, log_every_n_steps: int = DEFAULT_LOG_EVERY_N_STEPS, **kwargs: Any) -> None:
        super().__init__()
        self._recorder = FitRecorder(kwargs, log_every_n_steps)
        self._step_cancelled = False

    @property
    def name(self) -> str:
        return "fasthooks"

    def before_fit(self) -> None:
        learn = self.learn
        self._recorder.begin(learn.model, learn.n_epoch * len(learn.dls.train), learn.path)
        self._step_cancelled = False

    def after_cancel_step(self) -> None:
        self._step_cancelled = True

    def after_step(self) -> None:
        if self._step_cancelled:  # fastai calls after_step even when the step was cancelled
            self._step_cancelled = False
            return
        logged = self._recorder.step(DEFAULT_LOG_EVERY_N_STEPS)
        if self._recorder.stopped_by is not None:
            raise CancelFitException  # NonFiniteError, raised from after_fit
        if not logged:
            return
        for callback in self.learn.cbs:
            writer = getattr(callback, "writer", None)
            if writer is not None and getattr(callback, "run", False):
                self.activation_stats.log_to_tensorboard(writer, step=self.learn.train_iter)

    def after_fit(self) -> None:
        self._recorder.end()
