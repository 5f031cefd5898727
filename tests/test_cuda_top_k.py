"""top_k in the CUDA kernels' device code, run on the CPU (tests/cuda_on_cpu/): the top buffer
bit for bit the Python backend's whatever the dtype, layout, channel dimension, ties, non-finite
values, block count and order, and the other extras beside it; the other buffers untouched by it.
"""

import cuda_on_cpu
import pytest
import torch
from conftest import CUDA_ON_CPU, assert_buffers_close

from fasthooks.buffers import StatBuffers
from fasthooks.layout import CUDA_WORKSPACE_DOUBLES, cuda_workspace_doubles
from fasthooks.moments import accumulate_stats_python

pytestmark = CUDA_ON_CPU
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _default_options():
    cuda_on_cpu.configure()
    yield
    cuda_on_cpu.configure()


def _run(accumulate, calls, k, *, bins=0, binades=False, columns=None, **options):
    """The buffers after calls[i] = (x, channel_dim) went to column columns[i] of slot 1 (by
    default, every call to column 1)."""
    b = StatBuffers(2, 3, "cpu", full=True, hist_bins=bins, binades=binades, top_k=k)
    for column, (x, channel_dim) in zip(columns or [1] * len(calls), calls, strict=True):
        b.cursor.fill_(column)
        accumulate(x, *b.op_args(), 1, 0.25, -3.0, 3.0, channel_dim, **options)
    return b


def _assert_same_bits(got, want):
    assert got.shape == want.shape
    differ = (got.view(torch.int64) != want.view(torch.int64)).any(-1).nonzero().tolist()
    assert not differ, f"pairs {differ[:5]} differ: {got[1, 1].tolist()} != {want[1, 1].tolist()}"


def _assert_top_matches_python(calls, k, bins=0, binades=False, columns=None, **options):
    got = _run(
        cuda_on_cpu.accumulate, calls, k, bins=bins, binades=binades, columns=columns, **options
    )
    want = _run(accumulate_stats_python, calls, k, bins=bins, binades=binades, columns=columns)
    _assert_same_bits(got.top, want.top)
    return got, want


def _ties(n, dtype, g):
    """Few magnitudes, each many times with both signs: zeros of both signs, ones, twos,
    infinities and NaN."""
    pool = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, float("inf"), -float("inf")])
    x = pool[torch.randint(len(pool), (n,), generator=g)]
    x[torch.randint(n, (n // 50,), generator=g)] = float("nan")
    return x.to(dtype)


def _layouts(dtype, g):
    """(name, x, channel_dim) of every layout the kernel reads in place."""
    plain = torch.randn(48, 37, generator=g).to(dtype)
    last = (
        torch.randn(3, 7, 9, 11, generator=g)
        .to(dtype)
        .contiguous(memory_format=torch.channels_last)
    )
    transposed = torch.randn(29, 41, generator=g).to(dtype).t()
    return [
        ("contiguous, channels last", plain, -1),
        ("contiguous, channels first", plain, 1),
        ("channels_last 4-D", last, 1),
        ("channels_last 4-D, last dim", last, -1),
        ("transposed", transposed, -1),
        ("transposed, dim 0", transposed, 0),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_of_every_layout_and_channel_dim_is_python_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    for name, x, channel_dim in _layouts(dtype, g):
        for k in (1, 5, 16):
            try:
                _assert_top_matches_python([(x, channel_dim)], k)
            except AssertionError as error:
                raise AssertionError(f"{name}, k = {k}: {error}") from error


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_zeros_infinities_and_nan_across_blocks_and_calls(dtype):
    """Many equal magnitudes of both signs (the order settles by sign, then channel), over many
    blocks, a few resident blocks and split lanes, three calls merging into one slot."""
    g = torch.Generator().manual_seed(2)
    big = _ties(300_006, dtype, g).reshape(-1, 7)  # 7 channels: many ties share a channel
    calls = [
        (big, 1),
        (_ties(1000, dtype, g).reshape(10, 100), 0),
        (_ties(40, dtype, g)[1:], 0),
    ]  # a misaligned head
    for k in (1, 5, 16):
        _assert_top_matches_python(calls, k)
    cuda_on_cpu.configure(workers=3, split_lanes=True, seed=5)
    _assert_top_matches_python(calls, 16, resident=5)


def test_only_nan_and_fewer_values_than_k_leave_nan_pairs():
    nan = torch.full((40,), float("nan"))
    calls = [(nan, 0), (torch.tensor([3.0, -0.0, 0.0]), 0)]
    got, _ = _assert_top_matches_python(calls, 16)
    assert got.top[1, 1, :3, 0].tolist() == [3.0, 0.0, -0.0]
    assert got.top[1, 1, 3:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_increasing_magnitudes_make_every_value_a_candidate(dtype):
    """The worst case: each thread's next value beats its warp's list, in both directions."""
    n = 100_003
    up = torch.linspace(0.0, 1000.0, n).to(dtype) * torch.tensor([1.0, -1.0]).repeat(n)[:n].to(
        dtype
    )
    down = up.flip(0)
    for k in (1, 16):
        _assert_top_matches_python([(up.reshape(-1, 1), 0), (down, 0)], k)
        _assert_top_matches_python([(up, 0)], k, resident=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_beside_binades_and_a_histogram_leaves_the_rest_unchanged(dtype):
    """With binades and either histogram kernel, top_k is the Python backend's and every other
    buffer holds the same bits as without it."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(64, 1001, generator=g) * 2).to(dtype)
    x.view(-1)[::613] = float("nan")
    x.view(-1)[::997] = -float("inf")
    calls = [(x, 0), (x[:5, :30].t(), 1), (torch.randn(9, generator=g).to(dtype), 0)]
    for bins in (40, 256):
        got, want = _assert_top_matches_python(calls, 5, bins=bins, binades=True, columns=[1, 2, 1])
        without = _run(cuda_on_cpu.accumulate, calls, 0, bins=bins, binades=True, columns=[1, 2, 1])
        for name in ("state", "stats", "extra", "hist", "binades"):
            a, b = getattr(got, name), getattr(without, name)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), name
            assert torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(got.binades, want.binades)
        assert_buffers_close(
            [got.state, got.stats, got.extra, got.hist],
            [want.state, want.stats, want.extra, want.hist],
            rtol=1e-6,
            atol=1e-6,
        )


def test_the_workspace_grows_only_with_top_k():
    assert StatBuffers(1, 1, "cpu", full=True, hist_bins=0).workspace.numel() == 0
    assert cuda_workspace_doubles(0) == CUDA_WORKSPACE_DOUBLES
    assert cuda_workspace_doubles(16) > cuda_workspace_doubles(5) > CUDA_WORKSPACE_DOUBLES
    b = StatBuffers(1, 1, "cpu", full=True, hist_bins=0, top_k=5)
    x = torch.randn(100)
    # Room for fewer pairs than the call keeps is refused; more serves it.
    small = torch.zeros(cuda_workspace_doubles(4), dtype=torch.float64)
    args = list(b.op_args())
    args[7] = small
    with pytest.raises(RuntimeError, match="cuda_workspace_doubles"):
        cuda_on_cpu.accumulate(x, *args, 0)
    args[7] = torch.zeros(cuda_workspace_doubles(16), dtype=torch.float64)
    cuda_on_cpu.accumulate(x, *args, 0)
    want = StatBuffers(1, 1, "cpu", full=True, hist_bins=0, top_k=5)
    accumulate_stats_python(x, *want.op_args(), 0)
    _assert_same_bits(b.top, want.top)
