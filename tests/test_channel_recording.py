"""Per-channel statistics through ActivationStats (`channel_stats=`, `channel_every=`): each
snapshot against the same statistics computed by hand from the recorded outputs, on every
backend, through sampling, dropped batches, modules that grow, checkpoints and the readers."""

from __future__ import annotations

import pytest
import torch
from conftest import BACKENDS
from torch import nn

from fasthooks import ActivationStats
from fasthooks.stats import StatisticsError

ALL = ("absmax", "mean", "rms", "active")
NEAR_ZERO = 0.05


class Keep(nn.Module):
    """Every output of the module it wraps, per training batch, kept by a hook of its own."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.outputs: list[list[torch.Tensor]] = [[]]
        module.register_forward_hook(lambda m, i, o: self.outputs[-1].append(o.detach().clone()))

    def close(self, kept: bool = True) -> None:
        if not kept:
            self.outputs[-1] = []
        else:
            self.outputs.append([])


def _by_hand(outputs: list[torch.Tensor], dim: int) -> dict[str, torch.Tensor]:
    """The per-channel statistics of all of `outputs` along `dim`, in float64."""
    values = torch.cat([o.movedim(dim, -1).reshape(-1, o.shape[dim]).double() for o in outputs])
    return {
        "absmax": values.abs().amax(0),
        "mean": values.mean(0),
        "rms": values.square().mean(0).sqrt(),
        "active": (values.abs() > NEAR_ZERO).double().mean(0),
    }


def _assert_snapshot(act, row: int, snapshot: int, outputs, dim: int = -1) -> None:
    want = _by_hand(outputs, dim)
    n = len(want["mean"])
    assert act.channel_counts[row] == n
    for name in act.channel_names:
        got = act.channel_stats[name][row, :, snapshot]
        torch.testing.assert_close(got[:n].double(), want[name], rtol=1e-5, atol=1e-6)
        assert bool(got[n:].isnan().all()), name


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_snapshot_holds_the_statistics_of_its_batches(backend):
    model = _mlp()
    keeps = [Keep(model[0]), Keep(model[2])]
    act = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=2)
    with act:
        for _ in range(5):
            model(torch.randn(8, 4))
            act.on_batch_end()
            for k in keeps:
                k.close()
    assert act.channel_counts == [6, 3]
    assert act.channel_batches.tolist() == [[0, 1], [2, 3], [4, 4]]
    assert {k: tuple(v.shape) for k, v in act.channel_stats.items()} == {
        name: (2, 6, 3) for name in ALL
    }
    for row, keep in enumerate(keeps):
        for snapshot, batches in enumerate(([0, 1], [2, 3], [4])):
            outputs = [o for b in batches for o in keep.outputs[b]]
            _assert_snapshot(act, row, snapshot, outputs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_batches_count_and_batches_closed_as_not_training_do_not(backend):
    model = _mlp()
    keep = Keep(model[0])
    act = ActivationStats(
        model, backend=backend, channel_stats=("rms", "mean"), channel_every=2, every=2
    )
    kept = []
    with act:
        for batch in range(8):
            model(torch.randn(5, 4))
            act.on_batch_end()
            if batch % 2 == 0:
                kept += keep.outputs[-1]
            keep.close()
            model(torch.randn(5, 4) * 100)  # an evaluation batch
            act.on_batch_end(train=False)
            keep.close(kept=False)
    assert act.channel_batches.tolist() == [[0, 2], [4, 6]]
    assert act.channel_names == ("rms", "mean")
    _assert_snapshot(act, 0, 0, kept[:2])
    _assert_snapshot(act, 0, 1, kept[2:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_convolutions_count_channels_along_dim_1_in_either_memory_format(backend):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU(), nn.Conv2d(5, 7, 1))
    keeps = [Keep(model[0]), Keep(model[2])]
    act = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=3)
    with act:
        for memory_format in (torch.contiguous_format, torch.channels_last):
            model.to(memory_format=memory_format)
            model(torch.randn(2, 3, 9, 9).contiguous(memory_format=memory_format))
            act.on_batch_end()
    for row, keep in enumerate(keeps):
        _assert_snapshot(act, row, 0, keep.outputs[0], dim=1)
    assert act.channel_counts == [5, 7]


class Widening(nn.Module):
    """A layer whose output has as many channels as its input: a module that grows."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_that_shows_more_channels_keeps_its_sums(backend):
    model = nn.Sequential(Widening(), nn.Linear(3, 2), Widening())
    inputs = [torch.randn(4, 3), torch.randn(4, 3), torch.randn(4, 3)]
    act = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=10)
    first = Keep(model[0])
    with act:
        for x in inputs:
            model[0](x[:, :2])  # only two channels in the first call
            model(x)
            act.on_batch_end()
            first.close()
    outputs = [o for batch in first.outputs for o in batch]
    counts = torch.tensor([sum(o.shape[-1] > c for o in outputs) for c in range(3)])
    values = [o.double() for o in outputs]
    want_mean = torch.stack(
        [torch.cat([v[:, c] for v in values if v.shape[-1] > c]).mean() for c in range(3)]
    )
    assert act.channel_counts == [3, 2, 2]
    torch.testing.assert_close(act.channel_stats["mean"][0, :, 0].double(), want_mean)
    assert counts.tolist() == [6, 6, 3]
    rms = act.channel_stats["rms"][2, :, 0]
    assert bool(rms[:2].isfinite().all()) and bool(rms[2:].isnan().all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_channels_and_the_kurtosis_of_channel_rms(backend):
    torch.manual_seed(2)
    layer = nn.Linear(8, 16)
    with torch.no_grad():
        layer.weight[3:5] = 0
        layer.bias[3:5] = 0
        layer.weight[9] *= 200  # one channel far larger than the others: an outlier feature
    model = nn.Sequential(layer)
    keep = Keep(layer)
    act = ActivationStats(model, backend=backend, channel_stats=("rms",), channel_every=4)
    with act:
        for _ in range(4):
            model(torch.randn(32, 8))
            act.on_batch_end()
    dead = act.dead_channels
    assert dead.shape == (1, 16, 1)
    assert dead[0, :, 0].nonzero().flatten().tolist() == [3, 4]
    rms = _by_hand(keep.outputs[0], -1)
    d = rms["rms"] - rms["rms"].mean()
    want = (d**4).mean() / (d**2).mean() ** 2
    torch.testing.assert_close(act.channel_rms_kurtosis[0, 0].double(), want, rtol=1e-4, atol=0)
    assert float(want) > 10


def test_the_options_are_checked_and_readers_need_channel_stats():
    model = _mlp()
    with pytest.raises(ValueError, match="channel_stats: unknown statistic 'max'"):
        ActivationStats(model, channel_stats=("max",))
    with pytest.raises(ValueError, match="channel_every"):
        ActivationStats(model, channel_stats=ALL, channel_every=0)
    act = ActivationStats(model, backend="python")
    for reader in ("channel_stats", "channel_counts", "channel_batches", "dead_channels"):
        with pytest.raises(AttributeError, match="only with channel_stats="):
            getattr(act, reader)


def test_before_any_batch_the_readers_are_empty():
    act = ActivationStats(_mlp(), backend="python", channel_stats=ALL)
    assert act.channel_counts == [0, 0]
    assert act.channel_stats["rms"].shape == (2, 0, 0)
    assert act.channel_batches.shape == (0, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_channel_dim_the_output_lacks_is_an_error_naming_the_module(backend):
    model = _mlp()
    act = ActivationStats(model, backend=backend, channel_stats=ALL, channel_dim={"2": 3})
    with pytest.raises(StatisticsError, match=r"2 \(Linear\).*channel_dim"), act:
        model(torch.randn(2, 4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_mid_period_continues_as_one_run(backend):
    inputs = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(7)]

    def run(act, batches):
        with act:
            for x in batches:
                model(x)
                act.on_batch_end()

    model = _mlp()
    whole = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=3)
    run(whole, inputs)
    first = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=3)
    with first:
        for x in inputs[:4]:
            model(x)
            first.on_batch_end()
        state = first.state_dict()
    second = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=3)
    second.load_state_dict(state)
    run(second, inputs[4:])
    assert (
        second.channel_batches.tolist()
        == whole.channel_batches.tolist()
        == [
            [0, 2],
            [3, 5],
            [6, 6],
        ]
    )
    for name in ALL:
        torch.testing.assert_close(
            second.channel_stats[name], whole.channel_stats[name], equal_nan=True
        )
    other = ActivationStats(model, backend=backend, channel_stats=("rms",), channel_every=3)
    with pytest.raises(ValueError, match="channel_stats"):
        other.load_state_dict(state)


def test_window_keeps_the_snapshots_of_its_batches():
    model = _mlp()
    act = ActivationStats(
        model, backend="python", channel_stats=("rms",), channel_every=2, window=4
    )
    with act:
        for _ in range(11):
            model(torch.randn(3, 4))
            act.on_batch_end()
    assert act.batches.tolist() == [7, 8, 9, 10]
    assert act.channel_batches.tolist() == [[6, 7], [8, 9], [10, 10]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_per_channel(backend):
    model = _mlp()
    grads = []
    model[2].register_full_backward_hook(lambda m, gi, go: grads.append(go[0].clone()))
    act = ActivationStats(
        model, backend=backend, is_forward=False, channel_stats=ALL, channel_every=2
    )
    with act:
        for _ in range(2):
            model(torch.randn(5, 4)).square().sum().backward()
            act.on_batch_end()
    _assert_snapshot(act, 1, 0, grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_summary_and_the_long_table_show_dead_channels_and_outlier_features(backend):
    torch.manual_seed(3)
    layer = nn.Linear(8, 64)
    with torch.no_grad():
        layer.weight[3:5] = 0
        layer.bias[3:5] = 0
        layer.weight[9] *= 1000
    model = nn.Sequential(layer, nn.ReLU(), nn.Linear(64, 4))
    act = ActivationStats(model, backend=backend, channel_stats=("rms",), channel_every=2)
    with act:
        for _ in range(4):
            model(torch.randn(16, 8))
            act.on_batch_end()
    finding = act.summary()[0]
    assert (finding.module, finding.kind, finding.batch) == ("0", "dead channels", 0)
    assert "2 of 64 channels" in finding.detail and "channel 3, 4" in finding.detail
    assert finding.also == "outlier features"
    assert float(act.channel_rms_kurtosis[0, -1]) >= 30
    pd = pytest.importorskip("pandas")
    table = act.to_dataframe()
    assert isinstance(table, pd.DataFrame)
    dead = table[(table.stat == "dead_channels") & (table.module == "0")]
    assert dead.batch.tolist() == [1, 3] and dead.value.tolist() == [2.0, 2.0]
    kurtosis = table[(table.stat == "channel_rms_kurtosis") & (table.module == "2")]
    torch.testing.assert_close(
        torch.tensor(kurtosis.value.tolist(), dtype=torch.float64),
        act.channel_rms_kurtosis[1].double(),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_module_first_seen_in_a_dropped_batch_reads_and_resumes(backend):
    model = _mlp()
    act = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=3)
    with act:
        model[0](torch.randn(2, 4))  # the last layer has not run yet
        act.on_batch_end()
        model(torch.randn(2, 4))  # it runs first in a batch that is not recorded
        act.on_batch_end(train=False)
        state = act.state_dict()
    assert act.channel_counts == [6, 3]
    assert bool(act.channel_stats["rms"][1].isnan().all())  # none of its values recorded
    resumed = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=3)
    resumed.load_state_dict(state)
    keep = Keep(model[2])
    with resumed:
        model(torch.randn(5, 4))
        resumed.on_batch_end()
    assert resumed.channel_batches.tolist() == [[0, 1]]
    _assert_snapshot(resumed, 1, 0, keep.outputs[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_before_the_first_recorded_batch_keeps_the_regions(backend):
    inputs = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = _mlp()
    first = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=2)
    with first:
        model(inputs[0] * 50)
        first.on_batch_end(train=False)
        state = first.state_dict()
    resumed = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=2)
    resumed.load_state_dict(state)
    fresh = ActivationStats(model, backend=backend, channel_stats=ALL, channel_every=2)
    for act in (resumed, fresh):
        with act:
            for x in inputs[1:]:
                model(x)
                act.on_batch_end()
    for name in ALL:
        torch.testing.assert_close(
            resumed.channel_stats[name], fresh.channel_stats[name], equal_nan=True
        )
    assert resumed.channel_counts == [6, 3]
    assert not bool(resumed.channel_stats["rms"][0].isnan().any())


def test_logging_reads_the_newest_snapshot_alone():
    model = _mlp()
    act = ActivationStats(model, backend="python", channel_stats=("rms",), channel_every=1)
    with act:
        for _ in range(3):
            model(torch.randn(4, 4))
            act.on_batch_end()
    newest = act.newest_channel_figures()
    torch.testing.assert_close(
        newest["channel_rms_kurtosis"], act.channel_rms_kurtosis[:, -1].double()
    )
    assert newest["dead_channels"].tolist() == act.dead_channels[:, :, -1].sum(1).tolist()
