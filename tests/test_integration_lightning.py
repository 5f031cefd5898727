"""The Lightning callback, with a real `lightning.Trainer` fitting a tiny model on the CPU."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from conftest import (
    assert_same_parameter_recording,
    assert_same_recording,
    framework,
    record_parameter_steps,
    record_steps,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fasthooks import ActivationStats, NonFinite, NonFiniteError, ParameterStats, load

pl = framework("lightning.pytorch")
from fasthooks.integrations.lightning import (  # noqa: E402
    ActivationStatsCallback,
    ParameterStatsCallback,
)

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
    return TensorDataset(
        torch.randn(ROWS, 4, generator=generator), torch.randn(ROWS, 2, generator=generator)
    )


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


def test_per_channel_snapshots_are_recorded_and_logged(tmp_path):
    callback = ActivationStatsCallback(log_every_n_steps=5, channel_stats=("rms",), channel_every=5)
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    _fit(callback, logger=logger, max_epochs=1)
    act = callback.activation_stats
    assert act.channel_batches.tolist() == [[0, 4], [5, 9], [10, 14]]
    assert act.channel_counts == [8, 2]
    tag = "activations/net.0/channel_rms_kurtosis"
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get(tag)]
    assert [int(row["step"]) for row in rows] == [5, 10, 15]
    logged = [float(row[tag]) for row in rows]
    assert logged == pytest.approx(act.channel_rms_kurtosis[0].tolist())
    dead = [float(row["activations/net.0/dead_channels"]) for row in rows]
    assert dead == act.dead_channels[0].sum(0).tolist()


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


@pytest.mark.parametrize("callback", [ActivationStatsCallback, ParameterStatsCallback])
def test_fit_end_merges_ranks_only_when_several_processes_train(tmp_path, monkeypatch, callback):
    import torch.distributed as dist

    calls = []
    recording = ActivationStats if callback is ActivationStatsCallback else ParameterStats
    monkeypatch.setattr(recording, "all_reduce", lambda self: calls.append(type(self)))
    _fit(callback(), max_epochs=1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        _fit(callback(), max_epochs=1)
        assert calls == []  # one process: nothing to merge
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        _fit(callback(), max_epochs=1)
    finally:
        dist.destroy_process_group()
    assert calls == [recording]


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


# ParameterStatsCallback ------------------------------------------------------------------------

PARAMETERS = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
PARAMETER_OPTIONS = {"extra": ("max",), "hist_bins": 4, "hist_range": (-1.0, 1.0)}


def _by_hand(steps, accumulate: int = 1, micro_batch: int = BATCH, **options) -> ParameterStats:
    """ParameterStats over a plain loop doing what the trainer does: Tiny(lr=0.1), one SGD step
    per item of `steps`, the loss of each `micro_batch` rows divided by `accumulate`."""
    module = Tiny(lr=0.1)

    def backward(model, rows):
        for x, y in zip(rows[0].split(micro_batch), rows[1].split(micro_batch), strict=True):
            (nn.functional.mse_loss(model.net(x), y) / accumulate).backward()

    optimizer = module.configure_optimizers()
    return record_parameter_steps(module, optimizer, steps, backward, **options)


def _steps(rows_per_step: int, epochs: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _data().tensors
    return list(zip(x.split(rows_per_step), y.split(rows_per_step), strict=True)) * epochs


@pytest.mark.parametrize("accumulate", [1, 2])
def test_parameter_stats_record_each_optimizer_step_as_by_hand(accumulate):
    callback = ParameterStatsCallback(**PARAMETER_OPTIONS)
    trainer, _ = _fit(callback, Tiny(lr=0.1), max_epochs=1, accumulate_grad_batches=accumulate)
    ps = callback.parameter_stats
    assert ps.param_names == PARAMETERS
    assert ps.num_steps == trainer.global_step == -(-ROWS // (BATCH * accumulate))
    assert ps.expected_steps == trainer.estimated_stepping_batches
    want = _by_hand(_steps(BATCH * accumulate), accumulate, **PARAMETER_OPTIONS)
    assert_same_parameter_recording(ps, want)
    assert ps.update_ratio.gt(0).all()  # lr=0.1 moved every parameter
    assert "step" not in vars(ps.optimizer)  # the optimizer's own step is back
    ps.optimizer.step()  # the hooks are gone: no column
    assert ps.num_steps == trainer.global_step


class Scheduled(Tiny):
    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5)]


def test_parameter_stats_keep_the_lr_schedulers_own_step_wrapper():
    callback = ParameterStatsCallback(of="update")
    trainer, _ = _fit(callback, Scheduled(lr=0.1), max_epochs=1)
    optimizer = callback.parameter_stats.optimizer
    assert vars(optimizer)["step"]._wrapped_by_lr_sched  # put back after the fit
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 1  # stepped once an epoch
    assert callback.parameter_stats.num_steps == 15


def test_parameter_metrics_go_to_the_trainers_logger_every_n_steps(tmp_path):
    callback = ParameterStatsCallback(log_every_n_steps=4)
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    _fit(callback, Tiny(lr=0.1), logger=logger, max_epochs=1)
    ps = callback.parameter_stats
    with open(logger.log_dir + "/metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("parameters/grad/global_norm")]
    assert [int(row["step"]) for row in rows] == [4, 8, 12]
    tags = [tag for tag in rows[0] if tag.startswith("parameters/")]
    # A norm per kind and parameter, a global norm per kind, an update ratio per parameter.
    assert len(tags) == 3 * 4 + 3 + 4
    global_norms = ps.global_norm("grad")
    for row in rows:
        column = int(row["step"]) - 1
        for i, name in enumerate(PARAMETERS):
            for kind in ("weight", "grad", "update"):
                norm = float(ps.extra[kind]["norm"][i, column])
                assert float(row[f"parameters/{kind}/{name}/norm"]) == pytest.approx(norm)
            ratio = float(ps.update_ratio[i, column])
            assert float(row[f"parameters/update_ratio/{name}"]) == pytest.approx(ratio)
        assert float(row["parameters/grad/global_norm"]) == pytest.approx(
            float(global_norms[column])
        )


def test_parameter_stats_resume_from_a_checkpoint_as_if_never_stopped(tmp_path):
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = ParameterStatsCallback(**PARAMETER_OPTIONS)
    _fit(first, Tiny(lr=0.1), checkpoints, max_epochs=1)
    resumed = ParameterStatsCallback(**PARAMETER_OPTIONS)
    trainer, _ = _fit(resumed, Tiny(lr=0.1), ckpt_path=tmp_path / "last.ckpt")
    ps = resumed.parameter_stats
    assert ps.num_steps == trainer.global_step == 30
    assert ps.steps.tolist() == list(range(30))
    assert_same_parameter_recording(ps, _by_hand(_steps(BATCH, epochs=2), **PARAMETER_OPTIONS))


def test_an_exception_removes_the_parameter_hooks_and_keeps_the_statistics():
    callback = ParameterStatsCallback()
    with pytest.raises(RuntimeError, match="injected failure"):
        _fit(callback, Tiny(lr=0.1, fail_at=5))
    ps = callback.parameter_stats
    assert ps.num_steps == 5
    assert_same_parameter_recording(ps, _by_hand(_steps(BATCH)[:5]))
    ps.optimizer.step()
    assert ps.num_steps == 5


class TwoOptimizers(Tiny):
    """Each layer its own optimizer, stepped by hand."""

    def __init__(self) -> None:
        super().__init__(lr=0.1)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        for optimizer in (first, second):
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net[i].parameters(), lr=self.lr) for i in (0, 2)]


def test_several_optimizers_need_the_index_of_the_one_to_record():
    with pytest.raises(ValueError, match="optimizer_index: the module configures 2 optimizers"):
        _fit(ParameterStatsCallback(), TwoOptimizers(), max_epochs=1)
    with pytest.raises(ValueError, match="optimizer_index: 2 is out of range"):
        _fit(ParameterStatsCallback(optimizer_index=2), TwoOptimizers(), max_epochs=1)
    callbacks = [ParameterStatsCallback(optimizer_index=i) for i in (0, 1)]
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(TwoOptimizers(), DataLoader(_data(), batch_size=BATCH))
    first, second = (callback.parameter_stats for callback in callbacks)
    assert first.param_names == PARAMETERS[:2] and second.param_names == PARAMETERS[2:]
    assert first.num_steps == second.num_steps == 15
    want = _by_hand(_steps(BATCH))
    torch.testing.assert_close(first.stats["grad"], want.stats["grad"][:, :2])
    torch.testing.assert_close(second.stats["weight"], want.stats["weight"][:, 2:])
    assert callbacks[0].state_key != callbacks[1].state_key  # apart in a checkpoint


def test_parameter_callback_arguments_are_checked_when_it_is_made():
    with pytest.raises(ValueError, match="of: unknown kind 'bogus'"):
        ParameterStatsCallback(of=["bogus"])
    with pytest.raises(TypeError, match="optimizer: the callback hooks the optimizer"):
        ParameterStatsCallback(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(ValueError, match="optimizer_index must be an int >= 0"):
        ParameterStatsCallback(optimizer_index=-1)
    assert ParameterStatsCallback().parameter_stats is None


def test_parameter_stats_with_a_window_sink_under_the_log_dir(tmp_path):
    pytest.importorskip("pyarrow")
    callback = ParameterStatsCallback(of="grad", window=3)
    logger = pl.loggers.CSVLogger(tmp_path, name="run")
    trainer, _ = _fit(callback, Tiny(lr=0.1), logger=logger, max_epochs=1)
    ps = callback.parameter_stats
    assert ps.num_steps == 15 and ps.steps.tolist() == [12, 13, 14]
    loaded = load(Path(trainer.log_dir) / "fasthooks" / "parameters", kind="grad")
    assert loaded.batches.tolist() == list(range(15))
    assert torch.equal(loaded.stats[:, :, -3:], ps.stats["grad"])


class SavingParameterCallback(ParameterStatsCallback):
    """Writes each rank's statistics after the fit, and whether they were merged."""

    def __init__(self, out: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out
        self.merges = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        super().on_fit_start(trainer, pl_module)
        ps = self.parameter_stats
        merge = ps.all_reduce

        def counted(group=None):
            self.merges += 1
            merge(group)

        ps.all_reduce = counted

    def on_fit_end(self, trainer, pl_module) -> None:
        super().on_fit_end(trainer, pl_module)
        ps = self.parameter_stats
        saved = {
            "merges": self.merges,
            "stats": ps.stats,
            "extra": ps.extra,
            "hist": ps.hist,
            "update_ratio": ps.update_ratio,
            "steps": ps.steps,
        }
        torch.save(saved, Path(self.out) / f"rank{trainer.global_rank}.pt")


def test_ddp_ranks_merge_parameter_stats_into_those_of_one_process(tmp_path):
    callback = SavingParameterCallback(str(tmp_path), **PARAMETER_OPTIONS)
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
    trainer.fit(Tiny(lr=0.1), DataLoader(_data(), batch_size=BATCH, sampler=EveryOtherRow()))
    # A step of both ranks averages the gradients of the 2 * BATCH rows in a row they hold.
    whole = _by_hand(_steps(2 * BATCH), micro_batch=2 * BATCH, **PARAMETER_OPTIONS)
    for rank in range(2):
        merged = torch.load(tmp_path / f"rank{rank}.pt")
        assert merged["merges"] == 1
        assert merged["steps"].tolist() == whole.steps.tolist()
        for kind in whole.kinds:
            torch.testing.assert_close(merged["stats"][kind], whole.stats[kind])
            for name, values in whole.extra[kind].items():
                torch.testing.assert_close(merged["extra"][kind][name], values)
            assert torch.equal(merged["hist"][kind], whole.hist[kind])
        torch.testing.assert_close(merged["update_ratio"], whole.update_ratio)
