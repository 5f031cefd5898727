"""Activation checkpointing: the backward recompute calls modules again, and is not recorded."""

import pytest
import torch
from conftest import BACKENDS, assert_same_recording
from torch import nn
from torch.utils.checkpoint import checkpoint

from fasthooks import ActivationStats


class Checkpointed(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 2)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "none":
            return self.head(self.body(x))
        return self.head(checkpoint(self.body, x, use_reentrant=self.mode == "reentrant"))


def _record(mode: str, backend: str, is_forward: bool) -> ActivationStats:
    model = Checkpointed(mode)
    act = ActivationStats(
        model,
        backend=backend,
        extra=("nonfinite", "kurtosis"),
        hist_bins=6,
        hist_range=(-100, 100),
        is_forward=is_forward,
    )
    g = torch.Generator().manual_seed(1)
    with act:
        for _ in range(3):
            model(torch.randn(32, 8, generator=g, requires_grad=True)).pow(2).sum().backward()
            act.on_batch_end()
    return act


@pytest.mark.parametrize("is_forward", [True, False], ids=["forward", "gradients"])
@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_recompute_is_not_recorded_again(backend, mode, is_forward):
    got, want = _record(mode, backend, is_forward), _record("none", backend, is_forward)
    assert_same_recording(got, want)
    assert got.hist.sum(-1).eq(32 * torch.tensor([16, 16, 2])[:, None]).all()
