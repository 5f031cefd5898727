import gc
import math
import weakref

import pytest
import torch
from conftest import BACKENDS, DEVICES, reference_moments, reference_stats
from torch import nn

import fasthooks
from fasthooks import ActivationStats, hook_outputs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3, stride=2),
        nn.Flatten(),
        nn.Linear(4 * 7 * 7, 10),
    )


def _train(model, act, batches, device="cpu", train=True):
    """Run batches through model, returning each hooked module's outputs per batch."""
    seen = []
    with hook_outputs(act.modules) as hooks:
        for x in batches:
            loss = model(x.to(device)).pow(2).mean()
            loss.backward()
            seen.append(list(hooks.stored))
            act.on_batch_end(train=train)
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_match_float64_reference(backend, device):
    model = _net().to(device)
    batches = [torch.randn(16, 3, 16, 16) * (b + 1) + b for b in range(5)]
    with ActivationStats(model, backend=backend) as act:
        seen = _train(model, act, batches, device)
    assert act.backend == backend
    stats = act.stats
    assert stats.dtype == torch.float32 and stats.device.type == "cpu"
    assert stats.shape == (2, 3, 5)
    torch.testing.assert_close(stats.double(), reference_stats(seen), rtol=2e-6, atol=1e-7)
    # The seed's example: the std of the 2nd last module for each batch.
    torch.testing.assert_close(stats[1][-2], reference_stats(seen)[1][-2].float())


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_forwards_and_validation_batches_are_not_recorded(backend):
    model = _net()
    train_batches = [torch.randn(4, 3, 16, 16) for _ in range(3)]
    with ActivationStats(model, backend=backend) as act:
        seen = _train(model, act, train_batches[:2])
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 3, 16, 16) * 100)
        model.train()
        _train(model, act, [torch.randn(4, 3, 16, 16) * 50], train=False)
        seen += _train(model, act, train_batches[2:])
    assert act.num_batches == 3
    torch.testing.assert_close(act.stats.double(), reference_stats(seen), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_called_twice_per_batch_gets_merged_moments(backend):
    shared = nn.Linear(6, 6)
    outputs = []
    shared.register_forward_hook(lambda m, i, o: outputs.append(o.detach()))
    with ActivationStats(shared, modules=[shared], backend=backend) as act:
        for _ in range(2):
            outputs.clear()
            h = shared(torch.randn(5, 6) + 3)
            shared(h * 10)
            act.on_batch_end(train=True)
    mean, std = reference_moments(*outputs)
    torch.testing.assert_close(
        act.stats[:, 0, 1].double(),
        torch.tensor([mean, std], dtype=torch.float64),
        rtol=2e-6,
        atol=0,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_accumulation_merges_micro_batches_into_one_column(backend):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    options = {"extra": ("min", "max", "near_zero", "kurtosis"), "hist_bins": 8}
    micro = ActivationStats(model, backend=backend, **options)
    steps = [[torch.randn(4, 5), torch.randn(7, 5)] for _ in range(3)]
    with micro:
        for step in steps:
            for x in step:  # forward and backward of each micro-batch, one optimizer step
                model(x).sum().backward()
            micro.on_batch_end(train=True)  # once per optimizer step
    whole = ActivationStats(model, backend=backend, **options)
    with whole:
        for step in steps:
            model(torch.cat(step))
            whole.on_batch_end(train=True)
    assert micro.num_batches == 3
    torch.testing.assert_close(micro.stats, whole.stats, rtol=1e-6, atol=1e-7)
    for name, values in whole.extra.items():
        torch.testing.assert_close(micro.extra[name], values, rtol=1e-5, atol=1e-7)
    assert torch.equal(micro.hist, whole.hist)


@pytest.mark.parametrize("backend", BACKENDS)
def test_buffer_grows_past_capacity_without_losing_batches(backend):
    model = _net()
    batches = [torch.randn(2, 3, 16, 16) + i for i in range(11)]
    with ActivationStats(model, backend=backend, expected_batches=3) as act:
        seen = _train(model, act, batches)
    assert act.stats.shape == (2, 3, 11)
    torch.testing.assert_close(act.stats.double(), reference_stats(seen), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_that_did_not_run_reads_nan(backend):
    used, unused = nn.Linear(3, 3), nn.Linear(3, 3)
    model = nn.ModuleList([used, unused])
    with ActivationStats(model, backend=backend) as act:
        out = used(torch.randn(4, 3))
        act.on_batch_end(train=True)
    stats = act.stats
    assert math.isnan(stats[0, 1, 0]) and math.isnan(stats[1, 1, 0])
    torch.testing.assert_close(
        stats[:, 0, 0].double(), torch.tensor(reference_moments(out), dtype=torch.float64)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_tuple_outputs_use_first_tensor(backend):
    lstm = nn.LSTM(4, 5, batch_first=True)
    with ActivationStats(lstm, backend=backend) as act:
        out, _ = lstm(torch.randn(2, 7, 4))
        act.on_batch_end(train=True)
    torch.testing.assert_close(
        act.stats[:, 0, 0].double(), torch.tensor(reference_moments(out), dtype=torch.float64)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_on_train_begin_starts_fresh(backend):
    model = _net()
    act = ActivationStats(model, backend=backend)
    act.on_train_begin()
    _train(model, act, [torch.randn(2, 3, 16, 16)] * 3)
    act.on_train_end()
    act.on_train_begin()
    seen = _train(model, act, [torch.randn(2, 3, 16, 16)])
    act.on_train_end()
    assert act.stats.shape == (2, 3, 1)
    torch.testing.assert_close(act.stats.double(), reference_stats(seen), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_activation_kept_alive_after_batch(backend):
    lin = nn.Linear(8, 8)
    refs = []
    lin.register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    with ActivationStats(lin, backend=backend) as act:
        lin(torch.randn(4, 8)).sum().backward()
        act.on_batch_end(train=True)
        gc.collect()
        assert refs and refs[0]() is None
    assert act.num_batches == 1


def test_backend_errors_are_clear(monkeypatch):
    with pytest.raises(ValueError, match=r"backend must be one of .* got 'gpu'"):
        ActivationStats(nn.Linear(2, 2), backend="gpu")
    monkeypatch.setattr(fasthooks.ops, "_LOAD_ERROR", "ImportError: no _C")
    with pytest.raises(
        RuntimeError, match="did not load .*no _C.*pip install --no-build-isolation"
    ):
        ActivationStats(nn.Linear(2, 2), backend="fused")
    monkeypatch.setattr(fasthooks.ops, "_warned_broken", False)
    with pytest.warns(RuntimeWarning, match=r"fasthooks._C is installed but did not load"):
        assert ActivationStats(nn.Linear(2, 2), backend="auto").backend == "python"


def test_auto_prefers_fused_when_built():
    expected = "fused" if fasthooks.extension_available() else "python"
    assert ActivationStats(nn.Linear(2, 2)).backend == expected


def test_bad_arguments():
    with pytest.raises(ValueError, match="expected_batches must be an int >= 1, got 0"):
        ActivationStats(nn.Linear(2, 2), expected_batches=0)
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"modules\[1\] repeats modules\[0\]"):
        ActivationStats(lin, modules=[lin, lin])
    with pytest.raises(RuntimeError, match=r"on_batch_end\(\) called before the hooks were"):
        ActivationStats(lin).on_batch_end()


def test_stats_before_training_is_empty():
    act = ActivationStats(nn.Linear(2, 2), modules=[])
    assert act.stats.shape == (2, 0, 0)


def test_python_backend_names_a_device_mismatch():
    from fasthooks.buffers import StatBuffers
    from fasthooks.moments import accumulate_stats_python

    buffers = StatBuffers(1, 1, "cpu", full=False, hist_bins=0)
    with pytest.raises(ValueError, match="x is on meta but the statistics state is on cpu"):
        accumulate_stats_python(torch.empty(3, device="meta"), *buffers.op_args(), 0, 0.05, 0, 1)
