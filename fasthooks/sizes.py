"""Shapes and sizes of a model found by running a dummy batch through it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from .hook import hook_outputs


def in_channels(m: nn.Module) -> int:
    """The number of input channels of the first layer of `m` with a weight of 2 or more dims.

    Examples:
        >>> in_channels(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()))
        3
    """
    for layer in m.modules():
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() >= 2:
            return weight.shape[1]
    raise ValueError(f"m has no layer with a weight of 2 or more dims: {type(m).__name__}")


def _model_device(m: nn.Module) -> torch.device:
    return next(m.parameters(), torch.empty(0)).device


def dummy_batch(m: nn.Module, size: Sequence[int] = (64, 64)) -> torch.Tensor:
    """A zero batch of one item with `in_channels(m)` channels and spatial `size`.

    Examples:
        >>> dummy_batch(nn.Conv2d(3, 8, 3), (32, 32)).shape
        torch.Size([1, 3, 32, 32])
    """
    return torch.zeros(1, in_channels(m), *size, device=_model_device(m))


def dummy_eval(m: nn.Module, size: Sequence[int] = (64, 64)) -> object:
    """`m` applied to `dummy_batch(m, size)` in eval mode under no_grad; the mode is restored.

    Examples:
        >>> dummy_eval(nn.Conv2d(3, 8, 3), (32, 32)).shape
        torch.Size([1, 8, 30, 30])
    """
    modes = [(layer, layer.training) for layer in m.modules()]
    try:
        m.eval()
        with torch.no_grad():
            return m(dummy_batch(m, size))
    finally:
        for layer, training in modes:
            layer.training = training


def _children_or_self(m: nn.Module) -> list[nn.Module]:
    children = list(m.children())
    return children if children else [m]


def _shape(stored: object) -> torch.Size | None:
    return stored.shape if isinstance(stored, torch.Tensor) else None


def model_sizes(m: nn.Module, size: Sequence[int] = (64, 64)) -> list[torch.Size | None]:
    """The output shape of each child of `m` for a dummy batch of spatial `size`.

    A child that did not run in the forward pass gets None.

    Examples:
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.Flatten())
        >>> model_sizes(model, (9, 9))
        [torch.Size([1, 8, 4, 4]), torch.Size([1, 8, 4, 4]), torch.Size([1, 128])]
    """
    with hook_outputs(_children_or_self(m)) as hooks:
        dummy_eval(m, size)
        return [_shape(o) for o in hooks.stored]


def num_features_model(m: nn.Module) -> int:
    """The number of features (channels) of the last child's output, trying growing input sizes.

    Examples:
        >>> num_features_model(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 5, 3)))
        5
    """
    sz = 64
    while True:
        try:
            return model_sizes(m, size=(sz, sz))[-1][1]
        except Exception:
            sz *= 2
            if sz > 2048:
                raise


def total_params(m: nn.Module) -> tuple[int, bool]:
    """The number of parameters `m` owns directly, and whether any of them is trainable.

    Examples:
        >>> total_params(nn.Linear(3, 2))
        (8, True)
    """
    params = list(m.parameters(recurse=False))
    return sum(p.numel() for p in params), any(p.requires_grad for p in params)


class LayerInfo(NamedTuple):
    """One row of a model summary."""

    name: str
    output_shape: torch.Size | None
    params: int
    trainable: bool


def _leaves(m: nn.Module) -> list[tuple[str, nn.Module]]:
    leaves = [(name, layer) for name, layer in m.named_modules() if not list(layer.children())]
    return leaves or [("", m)]


def params_size(m: nn.Module, size: Sequence[int] = (3, 64, 64)) -> list[LayerInfo]:
    """Name, output shape, parameter count and trainable flag of each leaf layer of `m`.

    `size` is the shape of one input item, channels first.

    Examples:
        >>> params_size(nn.Sequential(nn.Linear(4, 2)), size=(4,))[0].params
        10
    """
    leaves = _leaves(m)
    with hook_outputs([layer for _, layer in leaves]) as hooks:
        _run_item(m, size)
        shapes = [_shape(o) for o in hooks.stored]
    return [
        LayerInfo(name or type(layer).__name__, shape, *total_params(layer))
        for (name, layer), shape in zip(leaves, shapes, strict=True)
    ]


def _run_item(m: nn.Module, size: Sequence[int]) -> None:
    """One zero item of shape `size` through `m` in eval mode under no_grad; modes restored."""
    if len(size) < 1:
        raise ValueError(f"size must have at least one dim (channels first), got {tuple(size)}")
    channels, *spatial = size
    expected = in_channels(m)
    if channels != expected:
        raise ValueError(f"size[0] must be the model's {expected} input channels, got {channels}")
    dummy_eval(m, spatial)


def model_summary(m: nn.Module, size: Sequence[int] = (3, 64, 64)) -> str:
    """A table of every leaf layer's name, output shape, parameters and trainable flag, with totals.

    Examples:
        >>> print(model_summary(nn.Sequential(nn.Linear(4, 2)), size=(4,)))  # doctest: +ELLIPSIS
        Layer (type) ...
    """
    rows = [
        (
            f"{info.name} ({type(layer).__name__})",
            "-" if info.output_shape is None else str(list(info.output_shape)),
            f"{info.params:,}",
            str(info.trainable),
        )
        for info, (_, layer) in zip(params_size(m, size), _leaves(m), strict=True)
    ]
    header = ("Layer (type)", "Output shape", "Params", "Trainable")
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(4)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    rule = "=" * (sum(widths) + 6)
    total = sum(p.numel() for p in m.parameters())
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    return "\n".join(
        [
            line.format(*header).rstrip(),
            rule,
            *(line.format(*r).rstrip() for r in rows),
            rule,
            f"Total params: {total:,}",
            f"Trainable params: {trainable:,}",
            f"Non-trainable params: {total - trainable:,}",
        ]
    )
