"""ActivationStats in a Lightning `Trainer`: `pip install fasthooks[lightning]`.

Examples:
    >>> import lightning.pytorch as pl
    >>> from fasthooks.integrations.lightning import ActivationStatsCallback
    >>> callback = ActivationStatsCallback(extra=["max"], hist_bins=40)
    >>> trainer = pl.Trainer(callbacks=[callback], logger=False, enable_progress_bar=False)
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from .recorder import FitRecorder, RecordingCallback


class ActivationStatsCallback(RecordingCallback, pl.Callback):
    """Records `ActivationStats(pl_module, **kwargs)` over each `trainer.fit`.

    One column per optimizer step: the micro-batches of a step accumulated with
    `accumulate_grad_batches` merge into it. `expected_batches` defaults to the trainer's
    `estimated_stepping_batches`. Every `log_every_n_steps` optimizer steps (default: the
    trainer's own) the newest column goes to every logger of the trainer, tagged
    `activations/<module>/<stat>`; 0 logs nothing. At fit end, hooks are removed and, when a
    process group is initialised, every rank's statistics are merged (`all_reduce`); on an
    exception, hooks are removed and the statistics so far kept. With `on_nonfinite="raise"`
    the fit stops after the step where it was found and `trainer.fit` raises `NonFiniteError`.
    The statistics are saved in the trainer's checkpoints, and a fit resumed from one
    (`ckpt_path=`) continues their columns. With `window=` and no `sink=`, every column also
    goes to `<trainer.log_dir>/fasthooks/activations` (`fasthooks.load` reads it). The live
    object is `.activation_stats`.
    """

    def __init__(self, log_every_n_steps: int | None = None, **kwargs: Any) -> None:
        super().__init__()
        self._recorder = FitRecorder(kwargs, log_every_n_steps)
        self._last_step = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recorder.begin(pl_module, trainer.estimated_stepping_batches, trainer.log_dir)
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
            trainer.should_stop = True  # NonFiniteError, raised from on_fit_end
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._recorder.end()

    def state_dict(self) -> dict[str, Any]:
        act = self.activation_stats
        return {} if act is None else {"activation_stats": act.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._recorder.resume = state_dict.get("activation_stats")

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._recorder.abort()
