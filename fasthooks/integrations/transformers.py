"""ActivationStats and ParameterStats in a Hugging Face `Trainer`:
`pip install fasthooks[transformers]`.

Examples:
    >>> from fasthooks.integrations.transformers import (
    ...     ActivationStatsCallback,
    ...     ParameterStatsCallback,
    ... )
    >>> callbacks = [ActivationStatsCallback(extra=["max"]), ParameterStatsCallback(of="grad")]
    >>> # Trainer(model, args, train_dataset=..., callbacks=callbacks).train()
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..export import is_metric_tag
from .activation_recorder import ActivationFitRecorder, RecordsActivations
from .parameter_recorder import ParameterFitRecorder, RecordsParameters
from .recorder import FitRecorder

# Written into each checkpoint folder, one per process.
STATE_FILE = "fasthooks_activation_stats_rank{rank}.pt"
PARAMETER_STATE_FILE = "fasthooks_parameter_stats_rank{rank}.pt"


def _console_without_statistics(on_log: Any) -> Any:
    """A console callback's on_log that prints the logs without the statistics (thousands of
    characters a line for a few dozen modules), saying how many went to the loggers instead."""
    if getattr(on_log, "leaves_out_statistics", False):
        return on_log

    @functools.wraps(on_log)
    def printed(self, args, state, control, logs=None, **kwargs):
        if logs:
            shown = {tag: value for tag, value in logs.items() if not is_metric_tag(tag)}
            if len(shown) < len(logs):
                shown["fasthooks"] = f"{len(logs) - len(shown)} statistics logged"
            logs = shown
        return on_log(self, args, state, control, logs=logs, **kwargs)

    printed.leaves_out_statistics = True
    return printed


def _keep_console_readable() -> None:
    # The Trainer hands every callback the same logs: the loggers after this callback need the
    # statistics, the console printers (the Trainer adds one, last) a line a person can read.
    for console in (ProgressCallback, PrinterCallback):
        console.on_log = _console_without_statistics(console.on_log)


class _TrainerRecording(TrainerCallback):
    """The Trainer events of a recording callback."""

    _recorder: FitRecorder
    # The file of each checkpoint folder that holds the statistics, per process.
    _state_file: str

    def __init__(self, recorder: FitRecorder) -> None:
        self._recorder = recorder
        _keep_console_readable()
        self._pending: tuple[int, dict[str, float]] | None = None

    def _begin(self, log_dir: str, estimated_steps: int, events: dict[str, Any]) -> None:
        """Start recording what the Trainer hands callbacks (`events`: model, optimizer...)."""
        raise NotImplementedError

    def _saved_state(self, args: TrainingArguments, step: int) -> Path:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        return folder / self._state_file.format(rank=args.process_index)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step > 0:  # resumed from a checkpoint
            saved = self._saved_state(args, state.global_step)
            if saved.is_file():
                self._recorder.resume = torch.load(saved, weights_only=True)
            else:
                warnings.warn(
                    f"{type(self).__name__}: training resumes at step {state.global_step} but "
                    f"{saved} is missing, so the statistics start again from this step",
                    RuntimeWarning,
                    stacklevel=2,
                )
        # transformers 5 has no logging_dir: the output folder is the run's own then.
        log_dir = getattr(args, "logging_dir", None) or args.output_dir
        self._begin(log_dir, state.max_steps, kwargs)
        self._pending = None

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        recording = self._recorder.recording
        saved = self._saved_state(args, state.global_step)
        if recording is not None and saved.parent.is_dir():
            torch.save(recording.state_dict(), saved)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        logging_steps = state.logging_steps if args.logging_strategy == "steps" else 0
        metrics = self._recorder.step(int(logging_steps))
        if self._recorder.stopped_by is not None:
            control.should_training_stop = True  # the error is raised from on_train_end
        if metrics:
            self._pending = (state.global_step, metrics)
            control.should_log = True  # the Trainer logs this step, and on_log adds the metrics

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._pending is None or logs is None:
            return
        step, metrics = self._pending
        self._pending = None
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == step:
            state.log_history[-1].update(metrics)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._recorder.end()


class ActivationStatsCallback(RecordsActivations, _TrainerRecording):
    """Records `ActivationStats(model, **kwargs)` over each `Trainer.train()`.

    One column per optimizer step: the micro-batches of `gradient_accumulation_steps` merge into
    it. `expected_batches` defaults to the Trainer's `max_steps`. Every `log_every_n_steps`
    optimizer steps (default: the Trainer's `logging_steps`, 0 for none) the newest column is
    added, tagged `activations/<module>/<stat>`, to that step's logs: `trainer.state.log_history`
    and every callback after this one, so that `report_to` integrations (TensorBoard, wandb, ...)
    receive it when this callback comes first (`trainer.callback_handler.callbacks.insert(0,
    callback)`). At the end of training, hooks are removed and, when several processes train (an
    initialised process group of more than one rank), every rank's statistics are merged
    (`all_reduce`). The Trainer tells callbacks nothing of an exception: run `trainer.train()`
    inside `with callback:` to remove the hooks then too. The console line the Trainer prints
    leaves the statistics out and says how many were logged. Each checkpoint folder gets the
    statistics so far (`STATE_FILE`), and training resumed from a checkpoint in `output_dir`
    continues their columns. With `on_nonfinite="raise"` training stops after the step where it
    was found and `trainer.train()` raises `NonFiniteError`. With `window=` and no `sink=`, every
    column also goes to `<logging_dir or output_dir>/fasthooks/activations` (`fasthooks.load`
    reads it). The live object is `.activation_stats`.
    """

    _state_file = STATE_FILE

    def __init__(self, log_every_n_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__(ActivationFitRecorder(kwargs, log_every_n_steps))

    def _begin(self, log_dir: str, estimated_steps: int, events: dict[str, Any]) -> None:
        self._recorder.begin(events["model"], estimated_steps=estimated_steps, log_dir=log_dir)


class ParameterStatsCallback(RecordsParameters, _TrainerRecording):
    """Records `ParameterStats(model, optimizer, **kwargs)` over each `Trainer.train()`: the
    Trainer's model and the torch optimizer it steps (the one inside accelerate's wrapper).

    One column per optimizer step, through the optimizer's step hooks: the micro-batches of
    `gradient_accumulation_steps` make one step, and a step that the mixed-precision scaler
    skips records none. `expected_steps` defaults to the Trainer's `max_steps`. Every
    `log_every_n_steps` optimizer steps (default: the Trainer's `logging_steps`, 0 for none)
    the newest step is added to that step's logs, as for `ActivationStatsCallback`, tagged as
    `fasthooks.export.newest_parameter_metrics` tags it: each parameter's norm per kind,
    `parameters/<kind>/<param>/norm`, the global norm per kind, `parameters/<kind>/global_norm`
    (for "grad", after any clipping: `max_grad_norm` when it engaged), and each parameter's
    update ratio, `parameters/update_ratio/<param>` (the other statistics stay in
    `.parameter_stats`). At the end of training, hooks are removed and, when several processes
    train, every rank's statistics are merged (`all_reduce`); run `trainer.train()` inside
    `with callback:` to remove the hooks on an exception too. Each checkpoint folder gets the
    statistics so far (`PARAMETER_STATE_FILE`), and training resumed from a checkpoint in
    `output_dir` continues their columns. With `window=` and no `sink=`, every column also goes
    to `<logging_dir or output_dir>/fasthooks/parameters` (`fasthooks.load(folder, kind="grad")`
    reads it). The live object is `.parameter_stats`.
    """

    _state_file = PARAMETER_STATE_FILE

    def __init__(self, log_every_n_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__(ParameterFitRecorder(kwargs, log_every_n_steps))

    def _begin(self, log_dir: str, estimated_steps: int, events: dict[str, Any]) -> None:
        self._recorder.begin(
            events["model"],
            _stepping_optimizer(events.get("optimizer")),
            estimated_steps=estimated_steps,
            log_dir=log_dir,
        )


def _stepping_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that takes the steps: accelerate's wrapper (`.optimizer` inside)
    calls its `step`, and only that one runs the step hooks."""
    if optimizer is None:
        raise RuntimeError(
            "ParameterStatsCallback: the Trainer handed callbacks no optimizer at on_train_begin"
        )
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer
