"""Shared fixtures: devices, backends and the float64 two-pass reference."""

from __future__ import annotations

import functools
import importlib
import math
import os
from pathlib import Path

import pytest
import torch

import fasthooks
from fasthooks.moments import accumulate_stats_python as python_backend

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]
FUSED = pytest.mark.skipif(
    not fasthooks.extension_available(),
    reason=f"fasthooks._C not built: {fasthooks.extension_error()}",
)
BACKENDS = ["python", pytest.param("fused", marks=FUSED)]
# The CUDA kernels' device code run on the CPU (tests/cuda_on_cpu/), on CPU tensors only.
CUDA_ON_CPU = pytest.mark.cuda_on_cpu


def pytest_sessionstart(session: pytest.Session) -> None:
    # A build that silently failed must not turn every fused test into a skip.
    if os.environ.get("FASTHOOKS_REQUIRE_EXT") == "1" and not fasthooks.extension_available():
        raise pytest.UsageError(
            f"FASTHOOKS_REQUIRE_EXT=1 but fasthooks._C did not load: {fasthooks.extension_error()}"
        )


def _deselected(item: pytest.Item, isa_run: bool) -> bool:
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    emulated = item.get_closest_marker("cuda_on_cpu") is not None
    if emulated and params.get("device") == "cuda":
        return True
    # An ISA matrix run (make test-isa) exercises the CPU kernels: tests of the Python backend or
    # of the CUDA device code would only repeat the native run, far slower under emulation.
    python = params.get("backend") == "python" or params.get("accumulate") is python_backend
    return isa_run and (python or emulated)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    isa_run = bool(os.environ.get("FASTHOOKS_EXPECT_CPU_CAPABILITY"))
    keep, drop = [], []
    for item in items:
        (drop if _deselected(item, isa_run) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def framework(name: str):
    """Import a training framework for its integration tests: skipped where it is not installed,
    unless FASTHOOKS_REQUIRE_FRAMEWORKS=1 (the main test run installs every one)."""
    if os.environ.get("FASTHOOKS_REQUIRE_FRAMEWORKS") == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python that must import this same fasthooks build."""
    package_root = str(Path(fasthooks.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def reference_moments(*tensors: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased std of all values of `tensors`, two passes in float64."""
    values = torch.cat([t.detach().double().cpu().reshape(-1) for t in tensors])
    n = values.numel()
    if n == 0:
        return math.nan, math.nan
    mean = values.sum().item() / n
    if n == 1:
        return mean, math.nan
    return mean, math.sqrt(((values - mean) ** 2).sum().item() / (n - 1))


def reference_stats(batches: list[list[torch.Tensor]]) -> torch.Tensor:
    """`(2, modules, batches)` float64 reference from, per batch, one tensor per module."""
    out = torch.empty(2, len(batches[0]), len(batches), dtype=torch.float64)
    for b, outputs in enumerate(batches):
        for m, output in enumerate(outputs):
            out[:, m, b] = torch.tensor(reference_moments(output))
    return out


def record_steps(model, steps, **options):
    """The reference for a callback: `ActivationStats(model, backend="python")` with each step's
    inputs run at once, one column per step (the model must be in training mode)."""
    whole = fasthooks.ActivationStats(model, backend="python", **options)
    with whole:
        for step in steps:
            model(step)
            whole.on_batch_end(train=True)
    return whole


def assert_same_recording(got, want) -> None:
    """Two ActivationStats recorded the same statistics (within float32 rounding)."""
    torch.testing.assert_close(got.stats, want.stats, rtol=1e-6, atol=1e-7)
    for name, values in want.extra.items():
        torch.testing.assert_close(got.extra[name], values, rtol=1e-5, atol=1e-7, msg=name)
    if want.hist_bins:
        assert torch.equal(got.hist, want.hist)


def record_parameter_steps(model, optimizer, steps, backward, **options):
    """The reference for a parameter callback: `ParameterStats(model, optimizer, **options)` over
    a plain loop, one optimizer step per item of `steps` after `backward(model, item)`."""
    with fasthooks.ParameterStats(model, optimizer, **options) as ps:
        for step in steps:
            backward(model, step)
            optimizer.step()
            optimizer.zero_grad()
    return ps


def assert_same_parameter_recording(got, want) -> None:
    """Two ParameterStats recorded the same parameters and statistics (within float32
    rounding; the std of a one-element parameter is NaN in both)."""
    assert got.param_names == want.param_names and got.kinds == want.kinds
    assert got.steps.tolist() == want.steps.tolist()
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-7, equal_nan=True)
    for kind in want.kinds:
        close(got.stats[kind], want.stats[kind])
        for name, values in want.extra[kind].items():
            close(got.extra[kind][name], values)
        if want.hist_bins:
            assert torch.equal(got.hist[kind], want.hist[kind])
    if "update" in want.kinds:
        torch.testing.assert_close(got.update_ratio, want.update_ratio, rtol=1e-5, atol=1e-9)


def assert_buffers_close(got, want, rtol: float = 1e-6, atol: float = 1e-9) -> None:
    """(state, stats, extra, hist) of two runs alike. m3 of near-symmetric data is a
    near-cancellation, so it is compared on its own scale, n * std^3, within max(rtol, 1e-6)."""
    got, want = [t.clone() for t in got], list(want)
    if got[0].shape[0] > 3:
        count, m2 = want[0][0], want[0][2]
        m3_scale = (m2.clamp(min=0) ** 1.5 / count.clamp(min=1) ** 0.5).nan_to_num()
        assert ((got[0][3] - want[0][3]).nan_to_num().abs() <= max(rtol, 1e-6) * m3_scale).all()
        got[0][3] = want[0][3]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)


def every_binade(n, dtype, seed):
    """n values of `dtype` over all its binades and past both ends (so zeros and subnormals from
    underflow, infinities from overflow), both signs, and every 101st a special value: zeros, the
    smallest subnormal, the largest finite value, infinities, NaN and, for float64, values beyond
    float32's range both ways."""
    info = torch.finfo(dtype)
    g = torch.Generator().manual_seed(seed)
    mantissa_bits = -round(math.log2(info.eps))
    low = round(math.log2(info.smallest_normal)) - mantissa_bits - 4
    high = round(math.log2(info.max)) + 4
    exponents = torch.randint(low, high, (n,), generator=g)
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    x = torch.ldexp((1 + torch.rand(n, generator=g, dtype=torch.float64)) * signs, exponents)
    specials = [0.0, -0.0, math.inf, -math.inf, math.nan, info.smallest_normal * info.eps]
    specials += [-info.max, 1e300, -1e-300]
    x[::101] = torch.tensor(specials, dtype=torch.float64).repeat(n // 101 // len(specials) + 1)[
        : x[::101].numel()
    ]
    return x.to(dtype)
