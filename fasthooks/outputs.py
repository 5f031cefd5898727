"""Which tensor of a module's output ActivationStats measures, and why it measures none."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch


def tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """Every tensor in `output`, depth first: tuples, lists, named tuples, dicts in insertion
    order (Hugging Face's ModelOutput among them) and dataclasses."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from tensors_in(item)
    elif isinstance(output, Mapping):
        for item in output.values():
            yield from tensors_in(item)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for field in dataclasses.fields(output):
            yield from tensors_in(getattr(output, field.name))


def _measurable(t: torch.Tensor) -> bool:
    return (
        t.is_floating_point() and t.layout == torch.strided and not t.is_meta and not t.is_quantized
    )


def _describe(t: torch.Tensor) -> str:
    if t.is_meta:
        return "a meta tensor"
    if t.layout != torch.strided:
        return f"a {t.layout} tensor".replace("torch.", "")
    return f"a {t.dtype} tensor".replace("torch.", "")


def measured_tensor(output: Any) -> tuple[torch.Tensor | None, str]:
    """The tensor whose statistics are recorded for `output`, or None and what was there instead.

    The first dense floating-point tensor, depth first; where there is none, the first integer or
    bool tensor as float32. Complex, sparse, quantized and meta tensors, and outputs with no
    tensor, are measured as nothing.

    Examples:
        >>> values, indices = torch.tensor([1.5, 2.5]), torch.tensor([0, 1])
        >>> measured_tensor((indices, {"values": values}))[0].tolist()
        [1.5, 2.5]
        >>> measured_tensor(None)
        (None, 'no tensor (got NoneType)')
    """
    fallback = unsupported = None
    for t in tensors_in(output):
        if _measurable(t):
            return t, ""
        integral = not t.is_complex() and not t.is_floating_point() and not t.is_quantized
        if fallback is None and integral and t.layout == torch.strided and not t.is_meta:
            fallback = t
            continue
        if unsupported is None:
            unsupported = t
    if fallback is not None:
        return fallback.float(), ""
    if unsupported is not None:
        return None, _describe(unsupported)
    return None, f"no tensor (got {type(output).__name__})"
