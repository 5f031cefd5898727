"""The Lightning callback, with a real `lightning.Trainer` fitting a tiny model on the CPU."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import assert_same_recording, framework, record_steps
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fasthooks import ActivationStats, NonFinite, NonFiniteError, load

pl = framework("lightning.pytorch")
from fasthooks.integrations.lightning import ActivationStatsCallback  # noqa: E402

ROWS, BATCH = 60, 4  # 15 batches an epoch


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.0, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.lr, self.fail_at = lr, fail_at

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("injected failure")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(ROWS, 4, generator=generator), torch.randn(ROWS, 2))


def _fit(callback, module=None, checkpoints=None, ckpt_path=None, **trainer_args):
    module = module or Tiny()
    options = {
        "max_epochs": 2,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": checkpoints is not None,
        **trainer_args,
    }
    callbacks = [callback] if checkpoints is None else [callback, checkpoints]
    trainer = pl.Trainer(callbacks=callbacks, **options)
    trainer.fit(module, DataLoader(_data(), batch_size=BATCH), ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_column_per_optimizer_step_merging_micro_batches(accumulate):
    options = {"extra": ("max", "near_zero"), "hist_bins": 4, "hist_range": (-3.0, 3.0)}
    callback = ActivationStatsCallback(**options)
    trainer, module = _fit(callback, accumulate_grad_batches=accumulate)
    act = callback.activation_stats
    steps_per_epoch = -(-ROWS // (BATCH * accumulate))
    assert act.num_batches == trainer.global_step == 2 * steps_per_epoch
    assert act.expected_batches == trainer.estimated_stepping_batches
    # lr=0 keeps the weights: each column must equal the statistics of its step's rows at once.
    steps = _data().tensors[0].split(BATCH * accumulate)
    assert_same_recording(act, record_steps(module.net, steps * 2, **options))
    assert all(hook.removed for hook in act.hooks)


def test_newest_column_goes_to_the_trainers_logger_every_n_steps(tmp_path):
    callback = ActivationStatsCallback(log_every_n_steps=4, extra=["max"])
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    _fit(callback, logger=logger, max_epochs=1)
    act = callback.activation_stats
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("activations/net.2/max")]
    assert [int(row["step"]) for row in rows] == [4, 8, 12]
    for row in rows:
        column = int(row["step"]) - 1
        assert float(row["activations/net.0/mean"]) == pytest.approx(float(act.stats[0, 0, column]))
        assert float(row["activations/net.2/max"]) == pytest.approx(
            float(act.extra["max"][1, column])
        )


def test_a_window_logs_its_newest_column_and_sinks_under_the_log_dir(tmp_path):
    pytest.importorskip("pyarrow")
    callback = ActivationStatsCallback(log_every_n_steps=4, extra=["max"], window=3)
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    trainer, _ = _fit(callback, logger=logger, max_epochs=1)
    act = callback.activation_stats
    assert act.num_batches == 15 and act.batches.tolist() == [12, 13, 14]
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("activations/net.2/max")]
    assert [int(row["step"]) for row in rows] == [4, 8, 12]
    loaded = load(Path(trainer.log_dir) / "fasthooks" / "activations")
    assert loaded.batches.tolist() == list(range(15))
    assert float(rows[-1]["activations/net.2/max"]) == pytest.approx(
        float(loaded.extra["max"][1, 11])
    )
    assert torch.equal(loaded.stats[:, :, -3:], act.stats)


def test_log_every_zero_logs_nothing(tmp_path):
    callback = ActivationStatsCallback(log_every_n_steps=0)
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    _fit(callback, logger=logger, max_epochs=1)
    assert callback.activation_stats.num_batches == 15
    metrics = Path(logger.log_dir) / "metrics.csv"  # written only when something was logged
    assert not metrics.exists() or "activations/" not in metrics.read_text()


def test_an_exception_removes_the_hooks_and_keeps_the_statistics():
    callback = ActivationStatsCallback()
    with pytest.raises(RuntimeError, match="injected failure"):
        _fit(callback, Tiny(fail_at=5))
    act = callback.activation_stats
    assert act.num_batches == 5
    assert all(hook.removed for hook in act.hooks)
    assert act.stats[:, :, :5].isfinite().all()


class Diverging(Tiny):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x * (float("inf") if batch_idx >= 4 else 1.0)), y)


def test_raise_on_nonfinite_stops_the_fit_cleanly():
    callback = ActivationStatsCallback(on_nonfinite="raise")
    with pytest.raises(NonFiniteError) as caught:
        _fit(callback, Diverging(lr=0.1))
    assert caught.value.report.where == NonFinite(4, "net.0", "forward", None)
    act = callback.activation_stats
    assert act.num_batches == 5  # stopped after the step it was found in (at once on the CPU)
    assert all(hook.removed for hook in act.hooks)


def test_fit_end_merges_ranks_when_a_process_group_is_initialised(tmp_path, monkeypatch):
    import torch.distributed as dist

    calls = []
    real = ActivationStats.all_reduce
    monkeypatch.setattr(ActivationStats, "all_reduce", lambda self: calls.append(real(self)))
    callback = ActivationStatsCallback()
    _fit(callback, max_epochs=1)
    assert calls == []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        _fit(callback, max_epochs=1)
    finally:
        dist.destroy_process_group()
    assert calls == [None]


def test_arguments_are_checked_when_the_callback_is_made():
    with pytest.raises(ValueError, match="extra: unknown statistic 'bogus'"):
        ActivationStatsCallback(extra=["bogus"])
    with pytest.raises(TypeError, match="model: the callback hooks the model"):
        ActivationStatsCallback(model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="log_every_n_steps must be an int >= 0"):
        ActivationStatsCallback(log_every_n_steps=-1)
    assert ActivationStatsCallback().activation_stats is None


def test_a_fit_resumed_from_a_checkpoint_continues_the_columns(tmp_path):
    options = {"extra": ("max",), "hist_bins": 4, "hist_range": (-3.0, 3.0)}
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = ActivationStatsCallback(**options)
    _fit(first, Tiny(lr=0.1), checkpoints, max_epochs=1)
    resumed = ActivationStatsCallback(**options)
    trainer, _ = _fit(resumed, Tiny(lr=0.1), ckpt_path=tmp_path / "last.ckpt")
    act = resumed.activation_stats
    assert act.num_batches == trainer.global_step == 30
    assert act.batches.tolist() == list(range(30))
    assert torch.equal(act.stats[:, :, :15], first.activation_stats.stats)
    assert torch.equal(act.hist[:, :15], first.activation_stats.hist)
    assert act.stats.isfinite().all()


class SavingCallback(ActivationStatsCallback):
    """Writes each rank's statistics after the fit (spawned ranks share no memory with the test)."""

    def __init__(self, out: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out

    def on_fit_end(self, trainer, pl_module) -> None:
        super().on_fit_end(trainer, pl_module)
        act = self.activation_stats
        path = Path(self.out) / f"rank{trainer.global_rank}.pt"
        torch.save({"stats": act.stats.clone(), "hist": act.hist.clone(), **act.extra}, path)


class EveryOtherRow(torch.utils.data.Sampler):
    """Rank r of 2 takes rows r, r + 2, ...: a step of both ranks covers 2 * BATCH rows in a row."""

    def __iter__(self):
        return iter(range(torch.distributed.get_rank(), ROWS, 2))

    def __len__(self) -> int:
        return ROWS // 2


def test_ddp_ranks_merge_their_shards_at_fit_end(tmp_path):
    options = {"extra": ("max",), "hist_bins": 4, "hist_range": (-3.0, 3.0)}
    callback = SavingCallback(str(tmp_path), **options)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        use_distributed_sampler=False,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Tiny(), DataLoader(_data(), batch_size=BATCH, sampler=EveryOtherRow()))
    module = Tiny()
    whole = record_steps(module.net, _data().tensors[0].split(2 * BATCH), **options)
    for rank in range(2):
        merged = torch.load(tmp_path / f"rank{rank}.pt")
        assert merged["stats"].shape == whole.stats.shape
        torch.testing.assert_close(merged["stats"], whole.stats, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(merged["max"], whole.extra["max"])
        assert torch.equal(merged["hist"], whole.hist)


class CompiledTiny(Tiny):
    """The usual way to compile in Lightning: the network inside the module."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.compile(self.net, backend="aot_eager")


def test_a_compiled_network_records_what_eager_records():
    torch._dynamo.reset()
    options = {"extra": ("max", "kurtosis"), "hist_bins": 4, "hist_range": (-3.0, 3.0)}
    callback = ActivationStatsCallback(**options)
    _, module = _fit(callback, module=CompiledTiny(), max_epochs=1)
    act = callback.activation_stats
    assert act.module_names == ["net.0", "net.2"]
    steps = _data().tensors[0].split(BATCH)
    assert_same_recording(act, record_steps(module.net._orig_mod, steps, **options))
