"""The `ActivationStats` side of the framework callbacks: the model hooked at fit start, a column
closed per optimizer step, and a fit stopped by `on_nonfinite="raise"`."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..export import newest_metrics
from ..nonfinite import NonFiniteError
from ..stats import ActivationStats
from .recorder import FitRecorder, RecordingCallback


class ActivationFitRecorder(FitRecorder):
    """`ActivationStats(model, **options)` over each fit."""

    expected_argument = "expected_batches"

    def checked(self, options: dict[str, Any]) -> dict[str, Any]:
        ActivationStats(nn.Module(), **options)
        return options

    def create(self, model: nn.Module, **options: Any) -> ActivationStats:
        return ActivationStats(model, **options)

    def sink_folder(self, options: dict[str, Any]) -> str:
        return "activations" if options.get("is_forward", True) else "gradients"

    def start(self, act: ActivationStats) -> None:
        act.on_train_begin()

    def close_step(self, act: ActivationStats) -> bool:
        try:
            act.on_batch_end(train=True)
        except NonFiniteError as error:
            self.stopped_by = error
            return False
        return True

    def metrics(self, act: ActivationStats) -> dict[str, float]:
        return newest_metrics(act)

    def stop(self, act: ActivationStats) -> None:
        act.on_train_end()


class RecordsActivations(RecordingCallback):
    """A callback recording `ActivationStats`."""

    @property
    def activation_stats(self) -> ActivationStats | None:
        """The live `ActivationStats` of the current (or last) fit; None before the first."""
        return self._recorder.recording
