"""ActivationStats in a Hugging Face `Trainer`: `pip install fasthooks[transformers]`.

Examples:
    >>> from fasthooks.integrations.transformers import ActivationStatsCallback
    >>> callback = ActivationStatsCallback(extra=["max"], hist_bins=40)
    >>> # Trainer(model, args, train_dataset=..., callbacks=[callback]).train()
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
from .recorder import FitRecorder, RecordingCallback

# Written into each checkpoint folder, one per process.
STATE_FILE = "fasthooks_activation_stats_rank{rank}.pt"


def _state_file(args: TrainingArguments, step: int) -> Path:
    folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
    return folder / STATE_FILE.format(rank=args.process_index)


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


class ActivationStatsCallback(RecordingCallback, TrainerCallback):
    """Records `ActivationStats(model, **kwargs)` over each `Trainer.train()`.

    One column per optimizer step: the micro-batches of `gradient_accumulation_steps` merge into
    it. `expected_batches` defaults to the Trainer's `max_steps`. Every `log_every_n_steps`
    optimizer steps (default: the Trainer's `logging_steps`, 0 for none) the newest column is
    added, tagged `activations/<module>/<stat>`, to that step's logs: `trainer.state.log_history`
    and every callback after this one, so that `report_to` integrations (TensorBoard, wandb, ...)
    receive it when this callback comes first (`trainer.callback_handler.callbacks.insert(0,
    callback)`). At the end of training, hooks are removed and, when a process group is
    initialised, every rank's statistics are merged (`all_reduce`). The Trainer tells callbacks
    nothing of an exception: run `trainer.train()` inside `with callback:` to remove the hooks
    then too. The console line the Trainer prints leaves the statistics out and says how many
    were logged. Each checkpoint folder gets the statistics so far (`STATE_FILE`), and training
    resumed from a checkpoint in `output_dir` continues their columns. With
    `on_nonfinite="raise"` training stops after the step where it was found and
    `trainer.train()` raises `NonFiniteError`. With `window=` and no `sink=`, every column
    also goes to `<logging_dir or output_dir>/fasthooks/activations` (`fasthooks.load` reads
    it). The live
    object is `.activation_stats`.
    """

    def __init__(self, log_every_n_steps: int | None = None, **kwargs: Any) -> None:
        self._recorder = FitRecorder(kwargs, log_every_n_steps)
        _keep_console_readable()
        self._pending: tuple[int, dict[str, float]] | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step > 0:  # resumed from a checkpoint
            saved = _state_file(args, state.global_step)
            if saved.is_file():
                self._recorder.resume = torch.load(saved, weights_only=True)
            else:
                warnings.warn(
                    f"ActivationStatsCallback: training resumes at step {state.global_step} but "
                    f"{saved} is missing, so the statistics start again from this step",
                    RuntimeWarning,
                    stacklevel=2,
                )
        # transformers 5 has no logging_dir: the output folder is the run's own then.
        log_dir = getattr(args, "logging_dir", None) or args.output_dir
        self._recorder.begin(kwargs["model"], state.max_steps, log_dir)
        self._pending = None

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        act = self.activation_stats
        saved = _state_file(args, state.global_step)
        if act is not None and saved.parent.is_dir():
            torch.save(act.state_dict(), saved)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        logging_steps = state.logging_steps if args.logging_strategy == "steps" else 0
        metrics = self._recorder.step(int(logging_steps))
        if self._recorder.stopped_by is not None:
            control.should_training_stop = True  # NonFiniteError, raised from on_train_end
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
