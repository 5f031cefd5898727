"""Reading recorded statistics: module names, one layer, sampling, pandas, repr."""

import pytest
import torch
from conftest import BACKENDS, reference_stats
from torch import nn

from fasthooks import ActivationStats, hook_outputs
from fasthooks.layout import EXTRAS


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Linear(6, 6)
        self.conv2 = nn.Linear(6, 6)

    def forward(self, x):
        return self.conv2(self.conv1(x).relu())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Sequential(Block(), Block()), nn.Linear(6, 2))


def test_module_names_are_qualified_and_in_column_order():
    model = _model()
    act = ActivationStats(model, backend="python")
    act.on_train_begin()
    assert act.module_names == ["0", "1.0.conv1", "1.0.conv2", "1.1.conv1", "1.1.conv2", "2"]
    act.on_train_end()
    lin = nn.Linear(2, 2)
    assert ActivationStats(lin, modules=[lin]).module_names == ["Linear"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_stats_by_index_or_name(backend):
    model = _model()
    with ActivationStats(model, backend=backend, extra=["max", "nonfinite"]) as act:
        for _ in range(3):
            model(torch.randn(5, 6))
            act.on_batch_end()
    by_name, by_index = act.layer_stats("1.0.conv2"), act.layer_stats(2)
    assert sorted(by_name) == ["max", "mean", "nonfinite", "std"]
    for stat, values in by_name.items():
        assert values.shape == (3,) and torch.equal(values, by_index[stat])
    assert torch.equal(by_name["mean"], act.stats[0, 2])
    assert torch.equal(act.layer_stats(-1)["std"], act.stats[1, 5])
    with pytest.raises(KeyError, match=r"module '1.0' is not hooked; hooked modules: \['0'"):
        act.layer_stats("1.0")
    with pytest.raises(IndexError, match="module index 6 out of range for 6 modules"):
        act.layer_stats(6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_records_every_nth_training_batch(backend):
    model = _model()
    act = ActivationStats(model, backend=backend, every=3, extra=["min"], hist_bins=4)
    seen = []
    with act, hook_outputs([model[0]]) as outputs:
        for b in range(8):
            model(torch.randn(5, 6) * (b + 1))
            seen.append(outputs.stored[0])
            act.on_batch_end()
            if b == 4:  # a validation batch does not count as a training batch
                model(torch.randn(5, 6) * 100)
                act.on_batch_end(train=False)
    assert act.batches.tolist() == [0, 3, 6] and act.batches.dtype == torch.int64
    assert act.stats.shape == (2, 6, 3) and act.hist.shape == (6, 3, 4)
    for column, batch in enumerate((0, 3, 6)):
        assert act.stats[0, 0, column].item() == pytest.approx(seen[batch].mean().item())
        assert act.extra["min"][0, column].item() == seen[batch].min().item()
    with pytest.raises(ValueError, match="every must be an int >= 1, got 0"):
        ActivationStats(model, every=0)


def test_to_dataframe_is_long_format():
    pd = pytest.importorskip("pandas")
    model = _model()
    with ActivationStats(model, backend="python", extra=["near_zero"], every=2) as act:
        for _ in range(4):
            model(torch.randn(5, 6))
            act.on_batch_end()
    frame = act.to_dataframe()
    assert isinstance(frame, pd.DataFrame)
    assert list(frame.columns) == ["batch", "module", "stat", "value"]
    assert len(frame) == 3 * 6 * 2  # statistics x modules x recorded batches
    assert sorted(frame["batch"].unique()) == [0, 2]
    row = frame[(frame.module == "1.1.conv1") & (frame.stat == "std") & (frame.batch == 2)]
    assert row.value.item() == pytest.approx(act.layer_stats("1.1.conv1")["std"][1].item())


def test_to_dataframe_without_pandas_names_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pandas(name, *args, **kwargs):
        if name == "pandas":
            raise ImportError("No module named 'pandas'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pandas)
    with pytest.raises(ImportError, match="to_dataframe needs pandas: `pip install pandas`"):
        ActivationStats(nn.Linear(2, 2), backend="python").to_dataframe()


def test_repr_says_what_is_recorded():
    act = ActivationStats(_model(), backend="python", extra=["max"], hist_bins=8, every=2)
    assert repr(act) == (
        "ActivationStats(backend='python', modules=0, batches=0, "
        "statistics=['mean', 'std', 'max', 'hist(8)'], every=2)"
    )


def _run(act, model, batches):
    with act:
        for x in batches:
            model(x)
            act.on_batch_end()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_run_continues_its_columns(backend, tmp_path):
    batches = [torch.randn(5, 6) * (b + 1) for b in range(7)]
    options = {"backend": backend, "extra": EXTRAS, "hist_bins": 5, "every": 2}
    model = _model()
    whole = ActivationStats(model, expected_batches=2, **options)
    _run(whole, model, batches)
    first = ActivationStats(model, expected_batches=2, **options)
    _run(first, model, batches[:3])
    torch.save(first.state_dict(), tmp_path / "act.pt")
    resumed = ActivationStats(model, expected_batches=2, **options)
    resumed.load_state_dict(torch.load(tmp_path / "act.pt", weights_only=True))
    _run(resumed, model, batches[3:])
    assert resumed.batches.tolist() == whole.batches.tolist() == [0, 2, 4, 6]
    torch.testing.assert_close(resumed.stats, whole.stats, rtol=0, atol=0)
    for name in EXTRAS:
        torch.testing.assert_close(resumed.extra[name], whole.extra[name], rtol=0, atol=0)
    assert torch.equal(resumed.hist, whole.hist)


def test_a_state_from_another_run_is_refused():
    model = _model()
    act = ActivationStats(model, backend="python", hist_bins=5)
    _run(act, model, [torch.randn(5, 6)])
    state = act.state_dict()
    other = ActivationStats(nn.Sequential(nn.Linear(6, 2)), backend="python", hist_bins=5)
    with pytest.raises(ValueError, match=r"saved names \['0', '1.0.conv1'.* does not match"):
        other.load_state_dict(state)
    with pytest.raises(
        ValueError, match="saved hist_bins 5 does not match this ActivationStats' 0"
    ):
        ActivationStats(model, backend="python").load_state_dict(state)


def _conv_net(inplace):
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(inplace=inplace), nn.Conv2d(4, 2, 3), nn.Flatten()
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_statistics_with_an_in_place_relu(backend):
    model, plain = _conv_net(inplace=True), _conv_net(inplace=False)
    batches = [torch.randn(4, 3, 8, 8) * (b + 1) for b in range(3)]
    act = ActivationStats(model, backend=backend, is_forward=False, extra=["max"], hist_bins=4)
    seen = []
    with act, hook_outputs([plain[0], plain[2]], grad=True) as grads:
        for x in batches:
            model(x).pow(2).mean().backward()
            plain(x.clone().requires_grad_()).pow(2).mean().backward()
            seen.append([g[0] for g in grads.stored])
            act.on_batch_end()
        model(batches[0])  # a batch without a backward pass records nothing
        act.on_batch_end()
    want = reference_stats(seen)
    torch.testing.assert_close(act.stats[:, :, :3].double(), want, rtol=1e-5, atol=1e-9)
    assert torch.isnan(act.stats[:, :, 3]).all()
    for b in range(3):
        assert act.extra["max"][1, b].item() == seen[b][1].max().item()


def test_tensorboard_gets_the_newest_column_tagged_with_module_names(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model = _model()
    act = ActivationStats(model, backend="python", extra=["max"], hist_bins=8, hist_range=(-2, 2))
    writer = SummaryWriter(tmp_path)
    with act:
        for _ in range(3):
            model(torch.randn(5, 6))
            act.on_batch_end()
            act.log_to_tensorboard(writer)
    writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0, "scalars": 0})
    events.Reload()
    assert "activations/1.0.conv2/max" in events.Tags()["scalars"]
    means = events.Scalars("activations/1.0.conv2/mean")
    assert [e.step for e in means] == [0, 1, 2]
    assert means[-1].value == pytest.approx(act.stats[0, 2, 2].item())
    hist = events.Histograms("activations/2/hist")[-1].histogram_value
    assert hist.num == act.hist[5, 2].sum().item()
    assert list(hist.bucket) == act.hist[5, 2].double().tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_statistics_under_gradient_checkpointing(backend):
    from torch.utils.checkpoint import checkpoint

    model, plain = _conv_net(inplace=True), _conv_net(inplace=False)
    x = torch.randn(4, 3, 8, 8)
    act = ActivationStats(model, backend=backend, is_forward=False)
    with act, hook_outputs([plain[0], plain[2]], grad=True) as grads:
        checkpoint(model, x, use_reentrant=False).pow(2).mean().backward()
        plain(x.clone().requires_grad_()).pow(2).mean().backward()
        act.on_batch_end()
    want = reference_stats([[g[0] for g in grads.stored]])
    torch.testing.assert_close(act.stats.double(), want, rtol=1e-5, atol=1e-9)
