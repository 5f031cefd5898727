"""Reproductions of fastai's activation-statistics hooks, for comparison only.

These are written here from fastai's documented behaviour; they are not fastai's code.
"""

from __future__ import annotations

import torch


def fastai_v1_hook(m: torch.nn.Module, i: object, o: torch.Tensor) -> tuple[float, float]:
    """fastai v1 ActivationStats.hook (reproduction): two .item() syncs per module per batch."""
    o = o[0] if isinstance(o, tuple) else o  # attention layers return (output, weights)
    return o.mean().item(), o.std().item()


def fastai_v2_hook(m: torch.nn.Module, i: object, o: torch.Tensor) -> dict[str, float]:
    """fastai v2 ActivationStats.hook without histograms (reproduction): activation copied to
    the CPU, then mean, std and near-zero fraction, each with .item()."""
    o = (o[0] if isinstance(o, tuple) else o).detach().cpu().float()
    return {
        "mean": o.mean().item(),
        "std": o.std().item(),
        "near_zero": (o <= 0.05).long().sum().item() / o.numel(),
    }


def fastai_v2_hook_with_hist(m: torch.nn.Module, i: object, o: torch.Tensor) -> dict[str, object]:
    """fastai v2 ActivationStats.hook with `with_hist=True` (reproduction): the same statistics
    plus a 40-bin histogram over [0, 10] of every activation."""
    result: dict[str, object] = dict(fastai_v2_hook(m, i, o))
    result["hist"] = o.detach().cpu().float().histc(40, 0, 10)
    return result
