"""ParameterStats: weights, gradients and updates per optimizer step, against plain torch."""

import math

import pytest
import torch
from conftest import BACKENDS
from torch import nn

from fasthooks import ParameterStats


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)


def _moments(t):
    v = t.detach().double().reshape(-1)
    return v.mean().item(), v.std().item(), v.norm().item(), v.abs().max().item()


def _check(got_mean, got_std, got_norm, got_absmax, want):
    mean, std, norm, absmax = want
    assert got_mean == pytest.approx(mean, rel=1e-5, abs=1e-7)
    assert got_std == pytest.approx(std, rel=1e-5)
    assert got_norm == pytest.approx(norm, rel=1e-5)
    assert got_absmax == pytest.approx(absmax, rel=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_gradients_and_updates_match_plain_torch(backend, optimizer):
    model = _model()
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    }
    opt = make[optimizer](model.parameters())
    seen = []
    with ParameterStats(model, opt, backend=backend, extra=["nonfinite"]) as ps:
        for i in range(4):
            x, y = _batch(i)
            (model(x) - y).pow(2).mean().backward()
            total = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = [p.detach().clone() for p in model.parameters()]
            grads = [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
            after = [p.detach().clone() for p in model.parameters()]
            seen.append((before, grads, after, total.item()))
    assert ps.param_names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert ps.steps.tolist() == [0, 1, 2, 3] and ps.num_steps == 4
    stats, extra = ps.stats, ps.extra
    for step, (before, grads, after, total) in enumerate(seen):
        for kind, tensors in (
            ("weight", after),
            ("grad", grads),
            ("update", [a - b for a, b in zip(after, before, strict=True)]),
        ):
            for i, t in enumerate(tensors):
                _check(
                    stats[kind][0, i, step].item(),
                    stats[kind][1, i, step].item(),
                    extra[kind]["norm"][i, step].item(),
                    extra[kind]["absmax"][i, step].item(),
                    _moments(t),
                )
                assert extra[kind]["nonfinite"][i, step].item() == 0
        for i, (a, b) in enumerate(zip(after, before, strict=True)):
            want = (a - b).double().norm().item() / b.double().norm().item()
            assert ps.update_ratio[i, step].item() == pytest.approx(want, rel=1e-5)
        assert ps.global_norm("grad")[step].item() == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_accumulation_and_missing_gradients(backend):
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _model()
            self.unused = nn.Linear(3, 3)  # stepped, but no gradient ever reaches it

        def forward(self, x):
            return self.net(x)

    model = WithUnused()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with ParameterStats(model, opt, backend=backend, every=2, of=("grad",)) as ps:
        for step in range(5):
            for micro in range(2):  # gradient accumulation: one column per optimizer step
                x, y = _batch(10 * step + micro)
                (model(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert ps.steps.tolist() == [0, 2, 4]
    unused = ps.param_index("unused.weight")
    assert ps.stats["grad"][:, unused].isnan().all()
    assert ps.layer_stats("unused.bias")["grad"]["norm"].isnan().all()
    assert not ps.stats["grad"][:, :unused].isnan().any()
    assert ps.global_norm("grad").isfinite().all()
    with pytest.raises(AttributeError, match='update_ratio needs "update"'):
        _ = ps.update_ratio


def test_a_step_that_the_grad_scaler_skips_records_no_column():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    with ParameterStats(model, opt, backend="python") as ps:
        for step in range(3):
            x, y = _batch(step)
            loss = (model(x) - y).pow(2).mean()
            if step == 1:
                loss = loss * math.inf  # non-finite gradients: the scaler skips this step
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    assert ps.steps.tolist() == [0, 1] and ps.num_steps == 2
    assert ps.stats["grad"].isfinite().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_run_continues_the_columns(backend, tmp_path):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train(ps, steps):
        with ps:
            for i in steps:
                x, y = _batch(i)
                (model(x) - y).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

    first = ParameterStats(model, opt, backend=backend, hist_bins=4, expected_steps=2)
    train(first, range(3))
    torch.save(first.state_dict(), tmp_path / "ps.pt")
    resumed = ParameterStats(model, opt, backend=backend, hist_bins=4, expected_steps=2)
    resumed.load_state_dict(torch.load(tmp_path / "ps.pt", weights_only=True))
    train(resumed, range(3, 5))
    assert resumed.steps.tolist() == [0, 1, 2, 3, 4]
    for kind in resumed.kinds:
        torch.testing.assert_close(resumed.stats[kind][:, :, :3], first.stats[kind], equal_nan=True)
        assert resumed.hist[kind].shape == (4, 5, 4)
    assert resumed.update_ratio[:, :3].equal(first.update_ratio)
    other = ParameterStats(model, opt, backend=backend, hist_bins=8)
    with pytest.raises(ValueError, match="saved hist_bins 4 does not match"):
        other.load_state_dict(first.state_dict())


def test_reading_out_dataframe_plot_and_tensorboard(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("matplotlib")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with ParameterStats(model, opt, backend="python", hist_bins=4) as ps:
        for i in range(2):
            x, y = _batch(i)
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    frame = ps.to_dataframe()
    assert isinstance(frame, pd.DataFrame)
    assert list(frame.columns) == ["step", "param", "kind", "stat", "value"]
    assert len(frame) == 2 * 4 * 3 * 4  # steps x parameters x kinds x (mean, std, norm, absmax)
    row = frame[(frame.kind == "grad") & (frame.param == "2.bias") & (frame.stat == "norm")]
    assert row.value.tolist() == ps.extra["grad"]["norm"][3].double().tolist()
    figure = ps.plot("update", tmp_path / "update.png")
    assert (tmp_path / "update.png").stat().st_size > 0 and len(figure.axes) >= 4

    class Writer:
        def __init__(self):
            self.scalars, self.histograms = {}, []

        def add_scalar(self, tag, value, step):
            self.scalars[tag] = (value, step)

        def add_histogram_raw(self, tag, **kwargs):
            self.histograms.append(tag)

    writer = Writer()
    ps.log_to_tensorboard(writer)
    assert writer.scalars["parameters/grad/0.weight/norm"] == (
        ps.extra["grad"]["norm"][0, 1].item(),
        1,
    )
    assert len(writer.scalars) == 3 * 4 * 4 and "parameters/weight/2.bias/hist" in writer.histograms
    assert repr(ps).startswith("ParameterStats(parameters=4, kinds=['weight', 'grad', 'update']")


def test_three_hundred_parameters_plot_readably(tmp_path):
    pytest.importorskip("matplotlib")
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(150)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ParameterStats(model, opt, backend="python", of="weight") as ps:
        model(torch.randn(4, 2)).sum().backward()
        opt.step()
    assert len(ps.param_names) == 300
    figure = ps.plot("weight")
    labels = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    assert labels[0] == "0.weight" and len(labels) >= 30


def test_bad_arguments_name_the_argument():
    model = _model()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="of: unknown kind 'weights'"):
        ParameterStats(model, opt, of=("weights",))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        ParameterStats(model, object())
    with pytest.raises(ValueError, match=r"parameters\[0\] \(2.weight\) is not stepped"):
        ParameterStats(model, opt, parameters=["2.weight"])
    with pytest.raises(KeyError, match="'nope' is not a parameter of the model"):
        ParameterStats(model, opt, parameters=["nope"])
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        ParameterStats(model, opt, every=0)
    ps = ParameterStats(model, opt, parameters=[model[0].bias], backend="python")
    assert ps.param_names == ["0.bias"]
    split = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\)"):
        ParameterStats(split, torch.optim.SGD(split.parameters(), lr=0.1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_grad_norm_is_of_the_gradients_stepped_with_when_clipping_engages(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    returned = []
    with ParameterStats(model, opt, backend=backend, of="grad") as ps:
        for scale in (100.0, 0.001):  # clipping engages, then it does not
            model(torch.randn(16, 4) * scale).pow(2).mean().backward()
            returned.append(nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0).item())
            opt.step()
            opt.zero_grad()
    assert returned[0] > 1.0 > returned[1]
    recorded = ps.global_norm("grad").tolist()
    assert recorded[0] == pytest.approx(1.0, rel=1e-5)  # max_norm: the clipped gradients
    assert recorded[1] == pytest.approx(returned[1], rel=1e-5)  # unclipped: the same number


def test_a_non_finite_gradient_is_found_and_summarised(tmp_path):
    pytest.importorskip("pyarrow")
    from fasthooks import NonFinite, load

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ParameterStats(model, opt, backend="python", sink=tmp_path) as ps:
        for step in range(3):
            x = torch.randn(16, 4)
            if step == 1:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    found = NonFinite(batch=1, module="0.weight", direction="grad", count=8, rank=None)
    assert ps["grad"].first_nonfinite() == found
    assert load(tmp_path, kind="grad").first_nonfinite() == found
    findings = {f.module: f.kind for f in ps["grad"].summary()}
    assert findings["0.weight"] == "non-finite"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_given_a_closure_records_the_gradients_the_closure_computed(backend):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    seen = []

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        seen.append([p.grad.norm().item() for p in model.parameters()])
        return loss

    with ParameterStats(model, optimizer, of=("grad",), backend=backend) as ps:
        for _ in range(2):
            optimizer.step(closure)
    assert not ps.extra["grad"]["norm"].isnan().any()  # read after the closure ran
    torch.testing.assert_close(ps.extra["grad"]["norm"].t(), torch.tensor(seen), rtol=1e-5, atol=0)
