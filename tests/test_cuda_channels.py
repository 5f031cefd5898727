"""Channel statistics in the CUDA kernels' device code, run on the CPU (tests/cuda_on_cpu/): the
running per-channel sums the Python backend's (counts, largest magnitudes and active counts bit
for bit, sums within float rounding) whatever the dtype, layout, channel offset, non-finite values,
block count and order; calls adding up; every other buffer as without them.
"""

import cuda_on_cpu
import pytest
import torch
from conftest import CUDA_ON_CPU

from fasthooks.buffers import StatBuffers
from fasthooks.layout import (
    CHANNEL_ABSMAX,
    CHANNEL_ACTIVE,
    CHANNEL_COUNT,
    CHANNEL_SUM,
    CHANNEL_SUM_SQ,
)
from fasthooks.moments import accumulate_stats_python, channel_sums

pytestmark = CUDA_ON_CPU
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
MAX_CHANNELS = 320
NEAR_ZERO = 0.25


@pytest.fixture(autouse=True)
def _default_options():
    cuda_on_cpu.configure()
    yield
    cuda_on_cpu.configure()


def _run(accumulate, calls, *, channels=True, bins=0, top_k=0, column=1, fresh=False, **options):
    """The buffers after calls[i] = (x, channel_dim, channel_offset) went to slot 1; `fresh`: the
    channels buffer zeros, not running sums from before (those outside the calls' channels must
    stay as they were)."""
    b = StatBuffers(2, 3, "cpu", full=True, hist_bins=bins, binades=bins > 0, top_k=top_k)
    b.resize_channels(MAX_CHANNELS)
    if not fresh:
        # Running sums from before, added to (whole counts, as they are), not overwritten.
        g = torch.Generator().manual_seed(0)
        b.channels.copy_(torch.randint(0, 100, b.channels.shape, generator=g))
    if not channels:
        # An empty buffer keeps none: the same held sums stay beside, untouched.
        held, b.channels = b.channels, b.channels.new_empty(0)
    b.cursor.fill_(column)
    for x, channel_dim, channel_offset in calls:
        accumulate(x, *b.op_args(), 1, NEAR_ZERO, -3.0, 3.0, channel_dim, channel_offset, **options)
    if not channels:
        b.channels = held
    return b


def _assert_channels_match_python(calls, **options):
    got = _run(cuda_on_cpu.accumulate, calls, **options)
    want = _run(accumulate_stats_python, calls)
    g, w = got.channels, want.channels
    for plane in (CHANNEL_COUNT, CHANNEL_ABSMAX, CHANNEL_ACTIVE):
        a, b = g[plane], w[plane]
        differ = (a != b).logical_and(~(a.isnan() & b.isnan())).nonzero().tolist()
        assert torch.equal(a.isnan(), b.isnan()) and not differ, (plane, differ[:5])
    # Sums within float rounding of at most 64 values a lane: relative to the sum of magnitudes.
    scale = torch.zeros(2, MAX_CHANNELS, dtype=torch.float64)
    for x, channel_dim, channel_offset in calls:
        size = x.shape[channel_dim] if x.dim() else 1
        magnitudes = channel_sums(x.abs(), channel_dim, size, 0.0)
        part = scale[:, channel_offset : channel_offset + size]
        part += magnitudes[[CHANNEL_SUM, CHANNEL_SUM_SQ]].nan_to_num(posinf=0.0)
    for k, plane in enumerate((CHANNEL_SUM, CHANNEL_SUM_SQ)):
        a, b = g[plane], w[plane]
        assert torch.equal(a.isnan(), b.isnan()), plane
        assert torch.equal(a.isinf(), b.isinf()) and torch.equal(a[a.isinf()], b[b.isinf()])
        finite = a.isfinite()
        assert ((a - b)[finite].abs() <= 1e-5 * scale[k][finite] + 1e-12).all(), plane
    return got, want


def _layouts(dtype, g):
    """(name, x, channel_dim) of every layout the kernel reads in place."""
    nchw = torch.randn(3, 6, 9, 11, generator=g).to(dtype)
    last = torch.randn(2, 37, 5, 7, generator=g).to(dtype)
    return [
        ("NCHW", nchw, 1),
        ("NCHW, channels as the last dim", nchw, -1),
        ("channels_last", last.contiguous(memory_format=torch.channels_last), 1),
        ("(tokens, C)", torch.randn(333, 48, generator=g).to(dtype), -1),
        ("(tokens, C) of two tiles", torch.randn(40, 300, generator=g).to(dtype), 1),
        ("(C, 7): short runs", torch.randn(29, 7, generator=g).to(dtype), 0),
        ("transposed", torch.randn(29, 41, generator=g).to(dtype).t(), -1),
        ("one channel", torch.randn(1, 2000, generator=g).to(dtype), 0),
        ("0-d", torch.tensor(-1.5).to(dtype), 0),
        ("1 element", torch.tensor([[0.125]]).to(dtype), 1),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_channel_sums_of_every_layout_are_python(dtype):
    g = torch.Generator().manual_seed(1)
    for name, x, channel_dim in _layouts(dtype, g):
        for offset in (0, 7):
            try:
                _assert_channels_match_python([(x, channel_dim, offset)])
            except AssertionError as error:
                raise AssertionError(f"{name}, channel_offset {offset}: {error}") from error


def _scaled_channels(dtype, g):
    """(rows, C) values of dtype: channel k of 61 N(0, 1) times 10**(k - 30), then one of +-max
    and one of small multiples of the smallest normal (float32's whole finite range, bfloat16's
    too: the same exponents)."""
    info = torch.finfo(dtype)
    rows = 300
    scales = torch.tensor([10.0**k for k in range(-30, 31)], dtype=torch.float64)
    x = torch.randn(rows, len(scales), generator=g, dtype=torch.float64) * scales
    signs = torch.randint(0, 2, (rows, 1), generator=g) * 2.0 - 1.0
    tiny = torch.randint(1, 9, (rows, 1), generator=g) * signs.flip(0) * info.tiny
    return torch.cat([x, signs * info.max, tiny], 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_and_rms_from_1e_30_to_1e30(dtype):
    """Squares and sums are taken in double: channels from 1e-30 to 1e30 (and at the ends of
    float's range) read the Python backend's mean and rms, neither inf nor 0."""
    from fasthooks.channel_stats import channel_statistics

    g = torch.Generator().manual_seed(6)
    rows = _scaled_channels(dtype, g)
    nchw = rows.t().reshape(1, -1, 20, 15).repeat(2, 1, 1, 1)
    for name, calls in (
        ("(tokens, C)", [(rows, 1, 0)]),
        ("NCHW", [(nchw, 1, 100)]),
        ("channels_last", [(nchw.contiguous(memory_format=torch.channels_last), 1, 200)]),
    ):
        got = _run(cuda_on_cpu.accumulate, calls, fresh=True).channels
        want = _run(accumulate_stats_python, calls, fresh=True).channels
        for plane in (CHANNEL_COUNT, CHANNEL_ABSMAX, CHANNEL_ACTIVE):
            assert torch.equal(got[plane], want[plane]), (name, plane)
        a = channel_statistics(got, ("mean", "rms"))
        b = channel_statistics(want, ("mean", "rms"))
        seen = want[CHANNEL_COUNT] > 0
        assert seen.sum() == rows.shape[1], name
        rms = b["rms"][seen].double()
        assert (rms > 0).all() and rms.isfinite().all(), name
        for stat in ("mean", "rms"):
            error = (a[stat][seen].double() - b[stat][seen].double()).abs()
            bad = (~(error <= 1e-6 * rms)).nonzero().flatten().tolist()  # NaN is bad
            assert not bad, (name, stat, bad[:5], a[stat][seen][bad[:5]], b[stat][seen][bad[:5]])


def _with_specials(x, g):
    """x with NaN, infinities of both signs, zeros of both signs and values at near_zero."""
    flat = x.view(-1)
    n = flat.numel()
    for value, every in ((float("nan"), 613), (float("inf"), 401), (-float("inf"), 397)):
        flat[torch.randint(n, (max(1, n // every),), generator=g)] = value
    flat[::53] = 0.0
    flat[1::59] = -0.0
    flat[2::61] = NEAR_ZERO
    flat[3::67] = -NEAR_ZERO
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_infinities_and_calls_accumulate_over_many_blocks(dtype):
    """Non-finite values (NaN in some channels only), over many blocks, a few resident blocks and
    split lanes; calls of several layouts and offsets adding to one row."""
    g = torch.Generator().manual_seed(2)
    nchw = _with_specials(torch.randn(8, 16, 40, 40, generator=g).to(dtype), g)
    tokens = _with_specials(torch.randn(2048, 96, generator=g).to(dtype), g)
    calls = [
        (nchw, 1, 0),
        (tokens, -1, 200),
        (nchw.contiguous(memory_format=torch.channels_last), 1, 16),
        (tokens[:5, 1:], 1, 3),  # a misaligned head
    ]
    got, _ = _assert_channels_match_python(calls)
    assert got.channels[CHANNEL_ABSMAX].isnan().any()
    assert not got.channels[CHANNEL_ABSMAX].isnan().all()
    cuda_on_cpu.configure(workers=3, split_lanes=True, seed=5)
    _assert_channels_match_python(calls, resident=5)


def test_only_nan_and_only_infinity_channels():
    x = torch.tensor([[float("nan"), float("inf"), 1.0], [float("nan"), -float("inf"), -2.0]])
    got, _ = _assert_channels_match_python([(x, 1, 0), (x.t().contiguous(), 0, 4)])
    absmax = got.channels[CHANNEL_ABSMAX]
    assert absmax[0].isnan() and absmax[1] == float("inf") and absmax[4].isnan()


@pytest.mark.parametrize("dtype", DTYPES)
def test_channels_off_or_on_leave_every_other_buffer_as_it_was(dtype):
    """With channel statistics, state, stats, extra, hist, binades and top hold the same bits as
    without them; without them, the channels buffer is untouched."""
    g = torch.Generator().manual_seed(4)
    x = _with_specials((torch.randn(64, 1001, generator=g) * 2).to(dtype), g)
    calls = [(x, 0, 0), (x[:5, :30].t(), 1, 2), (torch.randn(9, generator=g).to(dtype), 0, 100)]
    for bins in (0, 40, 256):
        on = _run(cuda_on_cpu.accumulate, calls, bins=bins, top_k=3)
        off = _run(cuda_on_cpu.accumulate, calls, channels=False, bins=bins, top_k=3)
        for name in ("state", "stats", "extra", "hist", "binades", "top"):
            a, b = getattr(on, name), getattr(off, name)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), name
            assert torch.equal(a.isnan(), b.isnan()), name
        untouched = _run(lambda *args, **kw: None, [], channels=False)
        assert torch.equal(off.channels, untouched.channels)
        assert not torch.equal(on.channels, untouched.channels)


def test_a_call_past_the_capacity_adds_nothing():
    """A CUDA graph replayed past its buffers writes nothing, channel sums included."""
    x = torch.randn(10, 4)
    got = _run(cuda_on_cpu.accumulate, [(x, 1, 0)], column=3)
    untouched = _run(lambda *args, **kw: None, [])
    assert torch.equal(got.channels, untouched.channels)


def test_the_region_adds_to_the_channels_position_and_not_to_the_top_channels():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(50, 40, generator=g)
    got = _run(cuda_on_cpu.accumulate, [(x, 1, 7)], top_k=4, channel_region=30)
    want = _run(accumulate_stats_python, [(x, 1, 37)], top_k=4)
    for plane in (CHANNEL_COUNT, CHANNEL_ABSMAX, CHANNEL_ACTIVE):
        assert torch.equal(got.channels[plane], want.channels[plane]), plane
    torch.testing.assert_close(got.channels, want.channels, rtol=1e-6, atol=1e-9)
    shifted = _run(accumulate_stats_python, [(x, 1, 7)], top_k=4)
    assert torch.equal(got.top[1, 1], shifted.top[1, 1])
