"""The per-channel running sums of the CPU kernels against the Python backend."""

from __future__ import annotations

import pytest
import torch
from conftest import FUSED

import fasthooks
from fasthooks import ops
from fasthooks.buffers import StatBuffers
from fasthooks.layout import CHANNEL_ABSMAX, CHANNEL_ACTIVE, CHANNEL_COUNT, CHANNEL_SUM
from fasthooks.moments import accumulate_stats_python

pytestmark = pytest.mark.isa  # the CPU kernels of every build: tests/isa_matrix.py
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FUSED_OK = int(fasthooks.extension_available())


def _layouts():
    x = torch.randn(3, 6, 5, 7, generator=torch.Generator().manual_seed(1))
    yield "nchw", x, 1
    yield "channels_last", x.contiguous(memory_format=torch.channels_last), 1
    yield "tokens", x.reshape(-1, 70), -1
    yield "wide rows", torch.randn(2, 70000), -1
    yield "long runs", torch.randn(2, 3, 70000), 1
    yield "0-d", torch.tensor(2.5), 0
    yield "one value", torch.tensor([[-1.5]]), 1


def _sums(accumulate, xs, dim, offset=0, width=None):
    b = StatBuffers(1, 1, "cpu", full=False, hist_bins=0)
    b.resize_channels(width or (xs[0].shape[dim] if xs[0].dim() else 1) + offset)
    for x in xs:
        accumulate(x, *b.op_args(), 0, 0.05, 0.0, 1.0, dim, offset)
    return b.channels


def _assert_same(got, want, xs):
    # Counts, maxima and active counts exactly; sums to within rounding of the magnitudes' sum.
    for plane in (CHANNEL_COUNT, CHANNEL_ABSMAX, CHANNEL_ACTIVE):
        torch.testing.assert_close(got[plane], want[plane], rtol=0, atol=0, equal_nan=True)
    scale = want[CHANNEL_COUNT] * want[CHANNEL_ABSMAX].nan_to_num(0).square()
    for plane, bound in ((CHANNEL_SUM, scale.sqrt() * want[CHANNEL_COUNT].sqrt()), (2, scale)):
        error = (got[plane] - want[plane]).abs()
        assert bool((error <= 1e-5 * bound + 1e-300).all() | error.isnan().all())


@FUSED
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [name for name, _, _ in _layouts()])
def test_cpu_kernels_sum_each_channel_as_the_python_backend(layout, dtype):
    _, x, dim = next(item for item in _layouts() if item[0] == layout)
    xs = [x.to(dtype), (x * 3 - 1).to(dtype)]
    got = _sums(ops.accumulate_stats, xs, dim, offset=2)
    want = _sums(accumulate_stats_python, xs, dim, offset=2)
    assert (got[:, :2] == 0).all()  # channels before the offset untouched
    _assert_same(got, want, xs)


@FUSED
@pytest.mark.parametrize("scale", [1e30, 1e-30])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_channel_sums_hold_at_every_scale(scale, dtype):
    x = (torch.randn(8, 64, 20) * scale).to(dtype)
    for dim in (1, -1):
        got = _sums(ops.accumulate_stats, [x], dim)
        want = _sums(accumulate_stats_python, [x], dim)
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=0)
        assert bool(got[2].isfinite().all() and (got[2] > 0).all())


@FUSED
def test_nan_sticks_to_its_channel_and_is_never_active():
    x = torch.ones(4, 3, 9)
    x[1, 2, 4] = float("nan")
    x[2, 0, 0] = float("inf")
    got = _sums(ops.accumulate_stats, [x], 1)
    want = _sums(accumulate_stats_python, [x], 1)
    assert got[CHANNEL_ABSMAX].tolist()[:2] == [float("inf"), 1.0]
    assert got[CHANNEL_ABSMAX, 2].isnan()
    assert got[CHANNEL_ACTIVE].tolist() == [36.0, 36.0, 35.0]
    torch.testing.assert_close(got, want, equal_nan=True)


@FUSED
def test_without_channels_nothing_is_summed_and_a_short_buffer_is_refused():
    b = StatBuffers(1, 1, "cpu", full=True, hist_bins=0)
    ops.accumulate_stats(torch.randn(4, 5), *b.op_args(), 0)
    assert b.channels.numel() == 0
    b.resize_channels(4)
    with pytest.raises(RuntimeError, match="channels has room for 4 channels"):
        ops.accumulate_stats(torch.randn(4, 5), *b.op_args(), 0)
    with pytest.raises(ValueError, match="channels has room for 4 channels"):
        accumulate_stats_python(torch.randn(4, 5), *b.op_args(), 0)


@pytest.mark.parametrize(
    "accumulate", [accumulate_stats_python, ops.accumulate_stats][: 1 + FUSED_OK]
)
def test_the_region_places_the_sums_and_leaves_the_top_channels_alone(accumulate):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    b = StatBuffers(1, 1, "cpu", full=False, hist_bins=0, top_k=2)
    b.resize_channels(20)
    accumulate(x, *b.op_args(), 0, 0.05, 0.0, 1.0, -1, 3, 10)
    want = _sums(accumulate_stats_python, [x], -1)
    _assert_same(b.channels[:, 13:19], want, [x])
    assert bool((b.channels[:, :13] == 0).all() & (b.channels[:, 19:] == 0).all())
    # Channel 0 of x is channel 3 of the whole tensor, wherever its sums are kept.
    assert set(b.top[0, 0, :, 1].long().tolist()) <= set(range(3, 9))
