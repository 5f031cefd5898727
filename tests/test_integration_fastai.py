"""The fastai callback, with a real fastai v2 `Learner` on plain PyTorch data loaders."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from conftest import (
    assert_same_parameter_recording,
    assert_same_recording,
    framework,
    record_parameter_steps,
    record_steps,
)
from test_distributed import _free_port
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

framework("fastai")
from fastai.callback.core import Callback, CancelStepException  # noqa: E402
from fastai.callback.training import GradientAccumulation, GradientClip  # noqa: E402
from fastai.data.core import DataLoaders  # noqa: E402
from fastai.learner import Learner  # noqa: E402
from fastai.optimizer import SGD, OptimWrapper  # noqa: E402

from fasthooks import NonFinite, NonFiniteError  # noqa: E402
from fasthooks.integrations.fastai import (  # noqa: E402
    ActivationStatsCallback,
    ParameterStatsCallback,
)

ROWS, BATCH = 64, 8  # 8 batches an epoch


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(ROWS, 4, generator=generator), torch.randn(ROWS, 1, generator=generator)
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _learner(lr: float = 0.0, cbs=(), **options) -> Learner:
    loaders = DataLoaders(
        DataLoader(_data(), batch_size=BATCH), DataLoader(_data(), batch_size=BATCH)
    )
    learn = Learner(loaders, _model(), loss_func=nn.MSELoss(), lr=lr, cbs=list(cbs), **options)
    learn.recorder.silent = True
    return learn


def _fit(learn: Learner, epochs: int = 2, cbs=()) -> None:
    with learn.no_bar(), learn.no_logging():
        learn.fit(epochs, lr=learn.lr, cbs=list(cbs))


class CancelOddSteps(Callback):
    def before_step(self):
        if self.train_iter % 2 == 0:
            raise CancelStepException()


@pytest.mark.parametrize("skipping", [None, "accumulation", "cancelled step"])
def test_one_column_per_optimizer_step_merging_skipped_ones(skipping):
    options = {"extra": ("max",), "hist_bins": 4, "hist_range": (-3.0, 3.0)}
    callback = ActivationStatsCallback(**options)
    others = {
        None: [],
        "accumulation": [GradientAccumulation(2 * BATCH)],
        "cancelled step": [CancelOddSteps()],
    }[skipping]
    learn = _learner(cbs=[callback])
    _fit(learn, cbs=others)
    act = callback.activation_stats
    per_step = 1 if skipping is None else 2
    assert act.num_batches == 2 * ROWS // (BATCH * per_step)
    assert act.expected_batches == 2 * ROWS // BATCH
    learn.model.train()  # fastai leaves it in eval mode after validating
    steps = _data().tensors[0].split(BATCH * per_step)
    assert_same_recording(act, record_steps(learn.model, steps * 2, **options))
    assert all(hook.removed for hook in act.hooks)
    assert learn.fasthooks is callback


def test_newest_column_goes_to_fastais_tensorboard_writer(tmp_path):
    framework("tensorboard")
    from fastai.callback.tensorboard import TensorBoardCallback
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = ActivationStatsCallback(log_every_n_steps=3, hist_bins=4)
    board = TensorBoardCallback(str(tmp_path), trace_model=False, log_preds=False)
    _fit(_learner(), epochs=1, cbs=[callback, board])
    events = EventAccumulator(str(next(tmp_path.glob("events.out.tfevents.*"))))
    events.Reload()
    means = events.Scalars("activations/0/mean")
    assert [e.step for e in means] == [2, 5]  # fastai's train_iter of steps 3 and 6
    stats = callback.activation_stats.stats
    assert [e.value for e in means] == pytest.approx([float(stats[0, 0, 2]), float(stats[0, 0, 5])])
    assert "activations/2/hist" in events.Tags()["histograms"]


def test_with_block_removes_the_hooks_when_training_raises():
    class Fail(Callback):
        def after_batch(self):
            if self.train_iter == 3:
                raise ValueError("injected failure")

    callback = ActivationStatsCallback()
    with pytest.raises(ValueError, match="injected failure"), callback:
        _fit(_learner(), cbs=[callback, Fail()])
    act = callback.activation_stats
    assert act.num_batches == 3  # train_iter counts batches already ended
    assert all(hook.removed for hook in act.hooks)


class Poison(Callback):
    def before_batch(self):
        if self.training and self.train_iter == 3:
            with torch.no_grad():
                self.learn.model[2].weight.fill_(float("nan"))


def test_raise_on_nonfinite_stops_the_fit_cleanly():
    callback = ActivationStatsCallback(on_nonfinite="raise")
    learn = _learner(lr=0.1)
    with pytest.raises(NonFiniteError) as caught:
        _fit(learn, cbs=[callback, Poison()])
    assert caught.value.report.where == NonFinite(3, "2", "forward", None)
    act = callback.activation_stats
    assert act.num_batches == 4 and learn.train_iter == 3  # cancelled in batch 3
    assert all(hook.removed for hook in act.hooks)


def test_arguments_are_checked_when_the_callback_is_made():
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        ActivationStatsCallback(every=0)


def test_a_compiled_model_records_what_eager_records():
    torch._dynamo.reset()
    options = {"extra": ("max", "kurtosis"), "hist_bins": 4, "hist_range": (-3.0, 3.0)}
    callback = ActivationStatsCallback(**options)
    learn = _learner(cbs=[callback])
    eager = learn.model
    learn.model = torch.compile(eager, backend="aot_eager")
    _fit(learn, epochs=1)
    act = callback.activation_stats
    assert act.module_names == ["0", "2"]
    eager.train()  # fastai leaves it in eval mode after validating
    assert_same_recording(act, record_steps(eager, _data().tensors[0].split(BATCH), **options))


def test_a_window_sinks_every_step_under_the_learners_path(tmp_path):
    pytest.importorskip("pyarrow")
    from fasthooks import load

    callback = ActivationStatsCallback(window=3)
    learn = _learner(cbs=[callback])
    learn.path = tmp_path
    _fit(learn)
    act = callback.activation_stats
    loaded = load(tmp_path / "fasthooks" / "activations")
    assert loaded.batches.tolist() == list(range(act.num_batches))
    assert torch.equal(loaded.stats[:, :, -3:], act.stats)


# ParameterStatsCallback ------------------------------------------------------------------------

PARAMETERS = ["0.weight", "0.bias", "2.weight", "2.bias"]
PARAMETER_OPTIONS = {"extra": ("max",), "hist_bins": 4, "hist_range": (-1.0, 1.0)}
TORCH_SGD = functools.partial(OptimWrapper, opt=torch.optim.SGD)


def _by_hand(rows_per_step: int, epochs: int = 2, **options):
    """ParameterStats over a plain loop doing what the learner does with SGD at lr=0.1: the
    loss of each BATCH rows scaled by its share of the step's rows."""
    model = _model()
    x, y = _data().tensors

    def backward(model, rows):
        for xb, yb in zip(rows[0].split(BATCH), rows[1].split(BATCH), strict=True):
            (nn.functional.mse_loss(model(xb), yb) * len(xb) / rows_per_step).backward()

    steps = list(zip(x.split(rows_per_step), y.split(rows_per_step), strict=True)) * epochs
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return record_parameter_steps(model, optimizer, steps, backward, **options)


@pytest.mark.parametrize(
    ("opt_func", "accumulate"),
    [(SGD, False), (TORCH_SGD, False), (SGD, True)],
    ids=["fastai SGD", "torch SGD", "fastai SGD accumulated"],
)
def test_parameter_stats_record_each_step_fastai_takes_as_by_hand(opt_func, accumulate):
    callback = ParameterStatsCallback(**PARAMETER_OPTIONS)
    learn = _learner(lr=0.1, cbs=[callback], opt_func=opt_func)
    _fit(learn, cbs=[GradientAccumulation(2 * BATCH)] if accumulate else [])
    ps = callback.parameter_stats
    rows_per_step = 2 * BATCH if accumulate else BATCH
    assert ps.num_steps == 2 * ROWS // rows_per_step
    assert ps.expected_steps == 2 * ROWS // BATCH
    assert_same_parameter_recording(ps, _by_hand(rows_per_step, **PARAMETER_OPTIONS))
    assert learn.fasthooks_parameters is callback
    assert "step" not in vars(learn.opt)  # fastai's own step is back
    learn.opt.step()  # the hooks are gone: no column
    assert ps.num_steps == 2 * ROWS // rows_per_step


def test_parameter_stats_see_the_gradients_clipped_before_fastais_default_adam():
    callback = ParameterStatsCallback()
    learn = _learner(lr=0.1, cbs=[callback])
    _fit(learn, cbs=[GradientClip(max_norm=0.05)])
    ps = callback.parameter_stats
    assert ps.param_names == PARAMETERS and ps.num_steps == 16
    # Every step's gradient norm exceeds 0.05 here (0.27 and more unclipped).
    torch.testing.assert_close(ps.global_norm("grad"), torch.full((16,), 0.05))
    final = torch.stack([p.detach().norm() for p in learn.model.parameters()])
    torch.testing.assert_close(ps.extra["weight"]["norm"][:, -1], final)
    assert ps.update_ratio.gt(0).all()


def test_one_callback_records_an_optimizer_its_parameters_chosen():
    first = ParameterStatsCallback(parameters=["0.weight", "2.weight"])
    learn = _learner(lr=0.1, cbs=[first])
    _fit(learn, epochs=1)
    assert first.parameter_stats.param_names == ["0.weight", "2.weight"]
    assert first.parameter_stats.num_steps == 8
    second = ParameterStatsCallback()
    with pytest.raises(RuntimeError, match="already recorded by another"), first, second:
        _fit(learn, epochs=1, cbs=[second])
    assert "step" not in vars(learn.opt)


def test_parameter_metrics_go_to_fastais_tensorboard_writer(tmp_path):
    framework("tensorboard")
    from fastai.callback.tensorboard import TensorBoardCallback
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = ParameterStatsCallback(log_every_n_steps=3)
    board = TensorBoardCallback(str(tmp_path), trace_model=False, log_preds=False)
    _fit(_learner(lr=0.1), epochs=1, cbs=[callback, board])
    events = EventAccumulator(str(next(tmp_path.glob("events.out.tfevents.*"))))
    events.Reload()
    tags = [tag for tag in events.Tags()["scalars"] if tag.startswith("parameters/")]
    assert len(tags) == 3 * 4 + 3 + 4  # norms per kind and parameter, global norms, ratios
    norms = events.Scalars("parameters/grad/2.weight/norm")
    assert [e.step for e in norms] == [2, 5]  # fastai's train_iter of steps 3 and 6
    want = callback.parameter_stats.extra["grad"]["norm"][2, [2, 5]].tolist()
    assert [e.value for e in norms] == pytest.approx(want)
    ratios = events.Scalars("parameters/update_ratio/0.bias")
    want = callback.parameter_stats.update_ratio[1, [2, 5]].tolist()
    assert [e.value for e in ratios] == pytest.approx(want)


def test_with_block_removes_the_parameter_hooks_when_training_raises():
    class Fail(Callback):
        def after_batch(self):
            if self.train_iter == 3:
                raise ValueError("injected failure")

    callback = ParameterStatsCallback(of="grad")
    learn = _learner(lr=0.1)
    with pytest.raises(ValueError, match="injected failure"), callback:
        _fit(learn, cbs=[callback, Fail()])
    ps = callback.parameter_stats
    assert ps.num_steps == 3  # train_iter counts batches already ended
    assert "step" not in vars(learn.opt)
    learn.opt.step()
    assert ps.num_steps == 3


def test_parameter_callback_arguments_are_checked_when_it_is_made():
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        ParameterStatsCallback(every=0)
    with pytest.raises(ValueError, match="log_every_n_steps must be an int >= 0"):
        ParameterStatsCallback(log_every_n_steps=-1)


# Several processes ------------------------------------------------------------------------------


def _broadcast_on_the_cpu(self, indices, rank):
    """fastai's `DistributedDL._broadcast` sends its batch order as a CUDA tensor (nccl); the
    same broadcast of a CPU tensor, over gloo."""
    indices = torch.tensor(indices)
    torch.distributed.broadcast(indices, rank)
    return indices.tolist()


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """One of 2 ranks of fastai's own distributed training (`distrib_ctx`, accelerate's DDP) on
    the CPU, as `accelerate launch` would start it."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    from fastai.distributed import DistributedDL

    DistributedDL._broadcast = _broadcast_on_the_cpu
    activations = ActivationStatsCallback(
        extra=("max",), hist_bins=4, hist_range=(-2.0, 2.0), sink=f"{out}/activations{rank}"
    )
    parameters = ParameterStatsCallback(hist_bins=4, sink=f"{out}/parameters{rank}")
    learn = _learner(lr=0.1, cbs=[activations, parameters])
    with learn.distrib_ctx(cpu=True, sync_bn=False):
        _fit(learn, epochs=1)
    assert torch.distributed.get_world_size() == 2  # fastai did train in two processes
    act, ps = activations.activation_stats, parameters.parameter_stats
    saved = {"stats": act.stats, "max": act.extra["max"], "hist": act.hist}
    saved["parameter_stats"] = {"stats": ps.stats, "extra": ps.extra, "hist": ps.hist}
    torch.save(saved, Path(out) / f"rank{rank}.pt")


def test_ddp_ranks_merge_both_recorders_at_the_end_of_the_fit(tmp_path):
    pytest.importorskip("pyarrow")
    from fasthooks import load

    mp.spawn(_ddp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    own = [load(tmp_path / f"activations{rank}") for rank in range(2)]
    loaded = load([tmp_path / "activations0", tmp_path / "activations1"])
    steps = ROWS // (2 * BATCH)
    assert not torch.equal(own[0].hist, own[1].hist)  # each sink holds its rank's batches
    for got in ranks:
        assert got["stats"].shape[-1] == steps
        torch.testing.assert_close(got["stats"], loaded.stats, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["max"], loaded.extra["max"])
        # Every value of a step's two batches counted once: each rank's own counts, summed.
        assert torch.equal(got["hist"], own[0].hist + own[1].hist)
        # DDP's weights, gradients and updates are the same on every rank: counted once, the
        # merged statistics are those each rank recorded alone.
        merged = got["parameter_stats"]
        for kind, stats in merged["stats"].items():
            alone = load(tmp_path / "parameters0", kind=kind)
            assert alone.stats.shape[-1] == steps
            torch.testing.assert_close(stats, alone.stats, equal_nan=True)  # std of 1 value
            torch.testing.assert_close(merged["extra"][kind]["norm"], alone.extra["norm"])
            assert torch.equal(merged["hist"][kind], alone.hist)
