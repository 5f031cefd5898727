"""The `ParameterStats` side of the framework callbacks: the optimizer's steps recorded through
its step hooks from fit start, so a column closes by itself at each step."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..export import newest_parameter_metrics
from ..parameters import ParameterStats
from .recorder import FitRecorder, RecordingCallback
from .steps import StepPatch


class ParameterFitRecorder(FitRecorder):
    """`ParameterStats(model, optimizer, **options)` over each fit, with the framework's
    `StepPatch` (if it needs one) attached while it records."""

    from_trainer = (
        ("model", "the model that the trainer fits"),
        ("optimizer", "the optimizer that the trainer steps"),
    )
    expected_argument = "expected_steps"
    _step_patch: StepPatch | None = None

    def checked(self, options: dict[str, Any]) -> dict[str, Any]:
        options = dict(options)
        if options.get("parameters") is not None:
            options["parameters"] = tuple(options["parameters"])  # the same at every fit
        # `parameters=` names those of the trainer's model: checked at fit start.
        probe = {name: value for name, value in options.items() if name != "parameters"}
        stepping = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)
        ParameterStats(nn.Module(), stepping, **probe)
        return options

    def create(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        step_patch: StepPatch | None = None,
        **options: Any,
    ) -> ParameterStats:
        ps = ParameterStats(model, optimizer, **options)
        self._step_patch = step_patch
        return ps

    def sink_folder(self, options: dict[str, Any]) -> str:
        return "parameters"

    def start(self, ps: ParameterStats) -> None:
        if self._step_patch is not None:
            self._step_patch.attach()
        ps.start()

    def metrics(self, ps: ParameterStats) -> dict[str, float]:
        return newest_parameter_metrics(ps)

    def stop(self, ps: ParameterStats) -> None:
        ps.stop()
        if self._step_patch is not None:
            self._step_patch.detach()


class RecordsParameters(RecordingCallback):
    """A callback recording `ParameterStats`."""

    @property
    def parameter_stats(self) -> ParameterStats | None:
        """The live `ParameterStats` of the current (or last) fit; None before the first."""
        return self._recorder.recording
