"""ActivationStats and ParameterStats in a Lightning `Trainer`: `pip install fasthooks[lightning]`.

Examples:
    >>> import lightning.pytorch as pl
    >>> from fasthooks.integrations.lightning import ActivationStatsCallback, ParameterStatsCallback
    >>> activations = ActivationStatsCallback(extra=["max"], hist_bins=40)
    >>> parameters = ParameterStatsCallback(of=["grad", "update"])
    >>> callbacks = [activations, parameters]
    >>> trainer = pl.Trainer(callbacks=callbacks, logger=False, enable_progress_bar=False)
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from ..arguments import count_argument
from .activation_recorder import ActivationFitRecorder, RecordsActivations
from .parameter_recorder import ParameterFitRecorder, RecordsParameters
from .recorder import FitRecorder


class _LightningRecording(pl.Callback):
    """The Lightning events of a recording callback."""

    _recorder: FitRecorder
    # The key of the statistics in the callback's state in a checkpoint.
    _state_name: str

    def __init__(self, recorder: FitRecorder) -> None:
        super().__init__()
        self._recorder = recorder
        self._last_step = 0

    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._begin(trainer, pl_module)
        self._last_step = trainer.global_step

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # a micro-batch: its statistics merge into the step's column
        self._last_step = trainer.global_step
        metrics = self._recorder.step(trainer.log_every_n_steps)
        if self._recorder.stopped_by is not None:
            trainer.should_stop = True  # the error is raised from on_fit_end
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recorder.end()

    def state_dict(self) -> dict[str, Any]:
        recording = self._recorder.recording
        return {} if recording is None else {self._state_name: recording.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._recorder.resume = state_dict.get(self._state_name)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._recorder.abort()


class ActivationStatsCallback(RecordsActivations, _LightningRecording):
    """Records `ActivationStats(pl_module, **kwargs)` over each `trainer.fit`.

    One column per optimizer step: the micro-batches of a step accumulated with
    `accumulate_grad_batches` merge into it. `expected_batches` defaults to the trainer's
    `estimated_stepping_batches`. Every `log_every_n_steps` optimizer steps (default: the
    trainer's own) the newest column goes to every logger of the trainer, tagged
    `activations/<module>/<stat>`; 0 logs nothing. At fit end, hooks are removed and, when
    several processes train (an initialised process group of more than one rank), every rank's
    statistics are merged (`all_reduce`); on an exception, hooks are removed and the statistics
    so far kept. With `on_nonfinite="raise"` the fit stops after the step where it was found
    and `trainer.fit` raises `NonFiniteError`. The statistics are saved in the trainer's
    checkpoints, and a fit resumed from one (`ckpt_path=`) continues their columns. With
    `window=` and no `sink=`, every column also goes to `<trainer.log_dir>/fasthooks/activations`
    (`fasthooks.load` reads it). The live object is `.activation_stats`.
    """

    _state_name = "activation_stats"

    def __init__(self, log_every_n_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__(ActivationFitRecorder(kwargs, log_every_n_steps))

    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recorder.begin(
            pl_module, estimated_steps=trainer.estimated_stepping_batches, log_dir=trainer.log_dir
        )


class ParameterStatsCallback(RecordsParameters, _LightningRecording):
    """Records `ParameterStats(pl_module, optimizer, **kwargs)` over each `trainer.fit`, where
    `optimizer` is the one the module configures (`trainer.optimizers`): with several, give
    `optimizer_index` (one callback per optimizer records each).

    One column per optimizer step, through the optimizer's step hooks: the micro-batches of
    `accumulate_grad_batches` make one step. `expected_steps` defaults to the trainer's
    `estimated_stepping_batches`. Every `log_every_n_steps` optimizer steps (default: the
    trainer's own; 0 for none) the newest step goes to every logger of the trainer as
    `fasthooks.export.newest_parameter_metrics` tags it: each parameter's norm per kind,
    `parameters/<kind>/<param>/norm`, the global norm per kind, `parameters/<kind>/global_norm`,
    and each parameter's update ratio, `parameters/update_ratio/<param>` (the other statistics
    stay in `.parameter_stats`). At fit end, hooks are removed and, when several processes train
    (an initialised process group of more than one rank), every rank's statistics are merged
    (`all_reduce`); on an exception, hooks are removed and the statistics so far kept. The
    statistics are saved in the trainer's checkpoints, and a fit resumed from one (`ckpt_path=`)
    continues their columns. With `window=` and no `sink=`, every column also goes to
    `<trainer.log_dir>/fasthooks/parameters` (`fasthooks.load(folder, kind="grad")` reads it).
    The live object is `.parameter_stats`.
    """

    _state_name = "parameter_stats"

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        optimizer_index: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(ParameterFitRecorder(kwargs, log_every_n_steps))
        if optimizer_index is not None:
            optimizer_index = count_argument(optimizer_index, "optimizer_index", 0)
        self.optimizer_index = optimizer_index

    @property
    def state_key(self) -> str:
        # Callbacks of several optimizers keep apart in a checkpoint.
        if self.optimizer_index is None:
            return super().state_key
        return self._generate_state_key(optimizer_index=self.optimizer_index)

    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = self._optimizer(trainer.optimizers)
        self._recorder.begin(
            pl_module,
            optimizer,
            None,  # Lightning's closure runs inside the step: ParameterStats reads after it
            estimated_steps=trainer.estimated_stepping_batches,
            log_dir=trainer.log_dir,
        )

    def _optimizer(self, optimizers: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
        index = self.optimizer_index
        if index is None:
            if len(optimizers) != 1:
                raise ValueError(
                    f"optimizer_index: the module configures {len(optimizers)} optimizers; give "
                    "the index of the one to record (one callback per optimizer records each)"
                )
            return optimizers[0]
        if index >= len(optimizers):
            raise ValueError(
                f"optimizer_index: {index} is out of range, the module configures "
                f"{len(optimizers)} optimizers"
            )
        return optimizers[index]
