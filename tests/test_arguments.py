"""Both recorders check their shared arguments in one place: the same input, the same refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fasthooks import ActivationStats, ParameterStats

BAD = [
    ({"near_zero": float("nan")}, ValueError, "near_zero must not be NaN"),
    ({"near_zero": "0.1"}, TypeError, "near_zero must be a number, got str"),
    ({"near_zero": True}, TypeError, "near_zero must be a number, got bool"),
    ({"every": 0}, ValueError, "every must be an int >= 1, got 0"),
    ({"extra": ["median"]}, ValueError, "extra: unknown statistic 'median'"),
    ({"hist_bins": 4096}, ValueError, r"hist_bins must be in \[0, 2048\], got 4096"),
    ({"hist_range": (1.0, 1.0)}, ValueError, "hist_range must be finite with lo < hi"),
    ({"window": 0}, ValueError, "window must be an int >= 1, got 0"),
    ({"sink": 3}, TypeError, "sink must be None, a folder path or a callable"),
]


def _activation_stats(**options):
    return ActivationStats(nn.Linear(2, 2), **options)


def _parameter_stats(**options):
    model = nn.Linear(2, 2)
    return ParameterStats(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)


@pytest.mark.parametrize("make", [_activation_stats, _parameter_stats], ids=["act", "params"])
@pytest.mark.parametrize("options, error, message", BAD, ids=[str(b[0]) for b in BAD])
def test_both_recorders_refuse_the_same_arguments(make, options, error, message):
    with pytest.raises(error, match=message):
        make(**options)
