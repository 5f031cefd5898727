"""The call order the operator keeps, first_nonfinite(), on_nonfinite and summary()."""

import warnings

import cuda_on_cpu
import pytest
import torch
from conftest import BACKENDS, CUDA_ON_CPU, FUSED
from torch import nn

import fasthooks
from fasthooks import ActivationStats, NonFinite, NonFiniteError, NonFiniteWarning
from fasthooks.buffers import StatBuffers
from fasthooks.layout import AccumulateArgs
from fasthooks.moments import accumulate_stats_python
from fasthooks.ops import accumulate_stats

ACCUMULATORS = {
    "python": accumulate_stats_python,
    "fused": pytest.param(accumulate_stats, marks=FUSED),
    "cuda_on_cpu": pytest.param(cuda_on_cpu.accumulate, marks=CUDA_ON_CPU),
}
NAN, INF = float("nan"), float("inf")


def _calls() -> list[tuple[int, torch.Tensor]]:
    """(slot, values) in call order: slot 2 first goes non-finite, then slot 0; slot 1 never."""
    g = torch.Generator().manual_seed(0)
    finite = torch.randn(5000, generator=g)
    bad = finite.clone()
    bad[::1000] = NAN
    bad[7] = -INF
    return [(0, finite), (1, finite), (2, bad), (0, bad[:3000]), (2, bad), (1, finite)]


# The clock's place among StatBuffers.op_args(), which start after x.
CLOCK = AccumulateArgs._fields.index("clock") - 1


@pytest.mark.parametrize("full", [False, True], ids=["mean_std", "every_stat"])
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=ACCUMULATORS)
def test_the_order_notes_each_modules_first_nonfinite_call(accumulate, full):
    b = StatBuffers(3, 2, "cpu", full=full, hist_bins=0)
    clock = torch.zeros(1, dtype=torch.int64)  # a clock of this test's own
    args = list(b.op_args())
    args[CLOCK] = clock
    b.cursor.fill_(1)
    for slot, x in _calls():
        accumulate(x, *args, slot, 0.05, 0.0, 1.0)
    accumulate(torch.empty(0), *args, 1, 0.05, 0.0, 1.0)  # an empty call takes no position
    assert clock.item() == 6
    # 1 + the clock position of each slot's first non-finite call, then its non-finite count:
    # bad holds 5 NaN and an -inf, bad[:3000] 3 NaN and the -inf; -1 where they are not counted.
    counts = [4, 0, 6] if full else [-1, 0, -1]
    assert b.order[:, :, 1].tolist() == [[4, 0, 3], counts]
    assert (b.order[:, :, 0] == 0).all()


@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=ACCUMULATORS)
def test_a_non_finite_mean_is_what_tells_with_mean_and_std_only(accumulate):
    b = StatBuffers(2, 1, "cpu", full=False, hist_bins=0)
    args = list(b.op_args())
    args[CLOCK] = torch.zeros(1, dtype=torch.int64)
    accumulate(torch.tensor([1.0, INF, 2.0]), *args, 1, 0.05, 0.0, 1.0)
    accumulate(torch.tensor([3e38, 3e38]), *args, 0, 0.05, 0.0, 1.0)  # finite, near the max
    assert b.order[:, :, 0].tolist() == [[0, 1], [0, -1]]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def _poison(module: nn.Module, after: int):
    """A forward hook that turns the module's output to NaN from its `after`-th call on."""
    calls = {"n": 0}

    def hook(m, i, o):
        calls["n"] += 1
        return o * NAN if calls["n"] > after else o

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_nonfinite_names_the_module_that_ran_first_not_the_first_column(backend):
    model = _mlp()
    # Hooked in reverse: column 0 is the last layer, which goes NaN after the middle one.
    modules = [model[4], model[2], model[0]]
    act = ActivationStats(model, modules=modules, backend=backend, every=2)
    handle = _poison(model[2], after=2)
    with act:
        for _ in range(8):
            model(torch.randn(16, 4))
            act.on_batch_end()
    handle.remove()
    # Calls of model[2]: batches 0..7; the 3rd on is NaN; recorded batches are 0, 2, 4, 6.
    assert act.first_nonfinite() == NonFinite(2, "2", "forward", None)
    assert act.call_order[0, 2].tolist() == [0, 0, 0, 0]  # the first layer stayed finite
    assert (act.call_order[0, :2, 1:] > 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_and_forward_runs_compare_by_the_call_clock(backend):
    model = _mlp()
    fwd = ActivationStats(model, backend=backend, extra=["nonfinite"])
    bwd = ActivationStats(model, backend=backend, extra=["nonfinite"], is_forward=False)
    with fwd, bwd:
        model(torch.randn(8, 4)).sum().backward()
        fwd.on_batch_end()
        bwd.on_batch_end()
        # Two micro-batches in one column: the first backward goes NaN before the second forward.
        out = model(torch.randn(8, 4))
        (out * torch.tensor(NAN)).sum().backward()
        model(torch.randn(8, 4) * INF)
        fwd.on_batch_end()
        bwd.on_batch_end()
    assert fwd.first_nonfinite() == NonFinite(1, "0", "forward", 64)
    assert bwd.first_nonfinite() == NonFinite(1, "4", "backward", 8)
    assert fasthooks.first_nonfinite(fwd, bwd) == bwd.first_nonfinite()
    assert fasthooks.first_nonfinite() is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_non_finite_reads_none_and_an_empty_summary(backend):
    model = _mlp()
    act = ActivationStats(model, backend=backend)
    assert act.first_nonfinite() is None
    with act:
        for _ in range(3):
            model(torch.randn(16, 4))
            act.on_batch_end()
    assert act.first_nonfinite() is None
    assert len(act.summary()) == 0
    assert str(act.summary()) == "nothing found over 3 recorded batches"


def _run(act, model, batches=6, nan_from=3, eval_nan=False):
    handle = _poison(model[2], after=nan_from)
    try:
        with act:
            for _ in range(batches):
                model(torch.randn(16, 4))
                act.on_batch_end()
                if eval_nan:
                    with torch.no_grad():
                        model(torch.full((2, 4), NAN))
                    act.on_batch_end(train=False)
    finally:
        handle.remove()


@pytest.mark.parametrize("backend", BACKENDS)
def test_raise_stops_at_the_batch_with_a_report(backend):
    model = _mlp()
    act = ActivationStats(model, backend=backend, extra=["max"], on_nonfinite="raise")
    with pytest.raises(NonFiniteError) as caught:
        _run(act, model)
    report = caught.value.report
    assert report.where == NonFinite(3, "2", "forward", 128)  # any extra counts them
    assert act.num_batches == 4  # on the CPU, raised as batch 3 closed
    assert report.module_type == "Linear"
    assert list(report.frames) == ["batch", "mean", "std", "max"]
    assert report.frames["batch"].tolist() == [0, 1, 2, 3]
    assert report.frames["mean"][:3].isfinite().all() and report.frames["mean"][3].isnan()
    text = str(caught.value)
    assert "training batch 3: first in module '2' (Linear), forward" in text
    assert text.splitlines()[1].split() == ["batch", "mean", "std", "max"]
    assert not model[0]._forward_hooks  # leaving the with block removed the hooks


@pytest.mark.parametrize("backend", BACKENDS)
def test_warn_warns_once_and_a_callable_is_called_once(backend):
    model = _mlp()
    with pytest.warns(NonFiniteWarning, match="training batch 3") as caught:
        _run(ActivationStats(model, backend=backend, on_nonfinite="warn"), model)
    assert len([w for w in caught if w.category is NonFiniteWarning]) == 1
    reports = []
    _run(ActivationStats(model, backend=backend, on_nonfinite=reports.append), model)
    assert [r.where for r in reports] == [NonFinite(3, "2", "forward", None)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_validation_batches_are_not_reported(backend):
    model = _mlp()
    act = ActivationStats(model, backend=backend, on_nonfinite="raise")
    _run(act, model, nan_from=100, eval_nan=True)
    assert act.first_nonfinite() is None


def test_a_bad_policy_is_refused_up_front():
    with pytest.raises(
        ValueError, match="on_nonfinite must be None, 'warn', 'raise' or a callable"
    ):
        ActivationStats(_mlp(), on_nonfinite="stop")


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_nonfinite_survives_a_resume(backend, tmp_path):
    model = _mlp()
    act = ActivationStats(model, backend=backend, extra=["nonfinite"])
    _run(act, model, batches=5, nan_from=3)
    torch.save(act.state_dict(), tmp_path / "act.pt")
    resumed = ActivationStats(model, backend=backend, extra=["nonfinite"])
    resumed.load_state_dict(torch.load(tmp_path / "act.pt", weights_only=True))
    with resumed:
        model(torch.randn(16, 4))
        resumed.on_batch_end()
    assert resumed.first_nonfinite() == act.first_nonfinite() == NonFinite(3, "2", "forward", 128)
    saved = act.state_dict()
    columns = saved["columns"]["forward"]
    old = {  # version 1's flat layout, saved before the call order was kept: none noted
        "version": 1,
        "module_names": saved["settings"]["names"],
        **{k: v for k, v in saved["settings"].items() if k not in ("names", "window")},
        "num_batches": saved["num_batches"],
        "seen": saved["seen"],
        "batches": saved["batches"],
        "state": columns["state"],
        "hist": columns["hist"],
    }
    resumed = ActivationStats(model, backend=backend, extra=["nonfinite"])
    resumed.load_state_dict(old)
    with resumed:
        pass
    assert resumed.first_nonfinite() is None and resumed.num_batches == 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_is_located_too(backend):
    torch._dynamo.reset()
    model = _mlp()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    act = ActivationStats(compiled, backend=backend, extra=["nonfinite"], on_nonfinite="raise")
    with pytest.raises(NonFiniteError) as caught, act:
        for i in range(4):
            compiled(torch.randn(16, 4) * (INF if i == 2 else 1.0)).sum().backward()
            act.on_batch_end()
    assert caught.value.report.where == NonFinite(2, "0", "forward", 128)


def _summary_run(backend):
    """Six modules, each with one problem (or none), over 20 batches."""
    torch.manual_seed(0)
    names = ["fine", "dead", "exploding", "collapsing", "spiky", "nan"]
    model = nn.ModuleDict({n: nn.Linear(64, 64, bias=False) for n in names})
    sparse = torch.zeros(32, 64)
    sparse[0, 0] = 1e3  # one row of the output set, the rest zero: a kurtosis near 58
    with torch.no_grad():  # the identity: its output collapses towards 3, far from zero
        model["collapsing"].weight.copy_(torch.eye(64))
    act = ActivationStats(model, backend=backend, extra=["near_zero", "kurtosis"])
    with act:
        for step in range(20):
            x = torch.randn(32, 64)
            if step == 10:
                with torch.no_grad():
                    model["dead"].weight.zero_()
            model["fine"](x)
            model["dead"](x)
            model["exploding"](x * 2.0**step)
            model["collapsing"](x * 0.5**step + 3.0)
            model["spiky"](sparse if step == 12 else x)
            model["nan"](x if step < 15 else x * NAN)
            act.on_batch_end()
    return act


@pytest.mark.parametrize("backend", BACKENDS)
def test_summary_finds_each_kind_of_trouble_most_severe_first(backend):
    summary = _summary_run(backend).summary()
    found = [(f.module, f.kind, f.batch) for f in summary]
    assert found[0] == ("nan", "non-finite", 15)
    assert set(found[1:]) == {
        ("dead", "dead", 10),
        ("exploding", "std exploding", 6),
        ("collapsing", "std collapsing", 6),
        ("spiky", "kurtosis spike", 12),
    }
    assert found[1][1] == "dead" and found[-1][1] == "kurtosis spike"
    assert "fine" not in {f.module for f in summary}
    assert str(summary).splitlines()[0].split()[:3] == ["module", "found", "since"]
    assert len(_summary_run(backend).summary(top=2)) == 2
    with pytest.raises(ValueError, match="top must be an int >= 1"):
        _summary_run(backend).summary(top=0)


def test_the_summary_as_a_dataframe():
    pytest.importorskip("pandas")
    summary = _summary_run("python").summary()
    frame = summary.to_dataframe()
    assert list(frame.columns) == ["module", "kind", "batch", "detail", "also"]
    assert frame["module"].tolist() == [f.module for f in summary]
    assert frame["batch"].tolist() == [f.batch for f in summary]


def test_a_dead_module_without_near_zero_is_one_without_spread():
    model = nn.Sequential(nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        act = ActivationStats(model, backend="python", modules=[model[0]])
        with act:
            for _ in range(3):
                model(torch.full((8, 4), -1.0))
                act.on_batch_end()
    (finding,) = act.summary()
    assert finding.kind == "dead" and "no spread" in finding.detail
