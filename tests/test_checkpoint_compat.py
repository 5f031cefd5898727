"""Both recorders save one checkpoint schema and read every older state of either: states saved
by fasthooks at d7635ec (ActivationStats version 2, ParameterStats version 1) are kept here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import BACKENDS
from torch import nn

from fasthooks import ActivationStats, NonFinite, ParameterStats

SAVED = Path(__file__).parent / "data" / "states_d7635ec.pt"
EVERY_EXTRA = ["min", "max", "near_zero", "nonfinite", "kurtosis", "norm", "absmax"]


def _saved() -> dict:
    return torch.load(SAVED, weights_only=True)


def _model_and_optimizer(saved: dict) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.load_state_dict(saved["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.load_state_dict(saved["optimizer"])
    return model, opt


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.nan_to_num(9.0), b.nan_to_num(9.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_older_activation_state_resumes(backend):
    saved = _saved()
    model, _ = _model_and_optimizer(saved)
    act = ActivationStats(
        model, backend=backend, extra=EVERY_EXTRA, hist_bins=6, hist_range=(-1.0, 1.0)
    )
    act.load_state_dict(saved["activation_stats"])
    with act:
        model(torch.randn(16, 4))
        act.on_batch_end()
    read = saved["read"]
    assert act.num_batches == 6 and act.batches.tolist() == list(range(6))
    assert _same(act.stats[:, :, :5], read["stats"])
    for name, values in read["extra"].items():
        assert _same(act.extra[name][:, :5], values), name
    assert torch.equal(act.hist[:, :5], read["hist"])
    assert act.first_nonfinite() == NonFinite(*read["first_nonfinite"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_older_parameter_state_resumes(backend):
    saved = _saved()
    model, opt = _model_and_optimizer(saved)
    ps = ParameterStats(model, opt, backend=backend, hist_bins=5, extra=["kurtosis"])
    ps.load_state_dict(saved["parameter_stats"])
    with ps:
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
    read = saved["read"]
    assert ps.num_steps == 6 and ps.steps.tolist() == list(range(6))
    for kind in ps.kinds:
        assert _same(ps.stats[kind][:, :, :5], read["ps_stats"][kind]), kind
        assert torch.equal(ps.hist[kind][:, :5], read["ps_hist"][kind]), kind
    assert _same(ps.update_ratio[:, :5], read["update_ratio"])


def test_both_recorders_save_one_schema():
    saved = _saved()
    model, opt = _model_and_optimizer(saved)
    act = ActivationStats(model, backend="python", hist_bins=3)
    ps = ParameterStats(model, opt, backend="python", of=("grad",))
    with act, ps:
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        act.on_batch_end()
    states = [act.state_dict(), ps.state_dict()]
    keys = {"version", "recorder", "settings", "num_batches", "seen", "batches", "columns"}
    assert [set(s) for s in states] == [keys, keys]
    assert [s["version"] for s in states] == [3, 3]
    assert list(states[0]["columns"]) == ["forward"] and list(states[1]["columns"]) == ["grad"]
    with pytest.raises(ValueError, match="saved by ParameterStats, not by ActivationStats"):
        ActivationStats(model, backend="python").load_state_dict(states[1])
