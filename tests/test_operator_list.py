"""accumulate_stats_list: many tensors into their slots in one call, or their differences from
bases (parameters' updates), on every backend."""

import cuda_on_cpu
import pytest
import torch
from conftest import CUDA_ON_CPU, FUSED, assert_buffers_close

from fasthooks.buffers import StatBuffers
from fasthooks.moments import accumulate_stats_list_python, accumulate_stats_python

LISTS = {
    "fused": pytest.param(lambda *a: torch.ops.fasthooks.accumulate_stats_list(*a), marks=FUSED),
    "python": accumulate_stats_list_python,
    "cuda_on_cpu": pytest.param(cuda_on_cpu.accumulate_list, marks=CUDA_ON_CPU),
}
ARGS = (0.05, -0.02, 0.02)  # near_zero and a histogram range that fits updates


def _pairs():
    g = torch.Generator().manual_seed(4)

    def pair(shape, dtype=torch.float32, scale=1.0):
        before = (torch.randn(shape, generator=g) * scale).to(dtype)
        step = torch.randn(shape, generator=g) * 1e-2 * scale
        return (before.float() + step).to(dtype), before

    conv_after, conv_before = pair((16, 8, 3, 3))
    wide_after, wide_before = pair((300_003,))
    square_after, square_before = pair((40, 40))
    return [
        pair((64, 32)),
        pair((10,), torch.float64),
        pair((4096,), torch.bfloat16, 3.0),
        pair((999,), torch.float16),
        # channels_last weights and their snapshots share strides: read in place
        (
            conv_after.to(memory_format=torch.channels_last),
            conv_before.to(memory_format=torch.channels_last),
        ),
        # starts off a 16-byte boundary, each by another amount
        (wide_after[1:300_001], wide_before[3:]),
        # strides that differ: both read as contiguous copies
        (square_after.t(), square_before.t().contiguous()),
        pair((0,)),
    ]


def _buffers(xs, full, bins):
    b = StatBuffers(len(xs) + 1, 2, "cpu", full=full, hist_bins=bins)
    b.cursor.fill_(1)
    return b


@pytest.mark.parametrize(
    ("with_bases", "full", "bins"),
    [(False, False, 0), (False, True, 16), (True, True, 0), (True, True, 16)],
    ids=["values-mean_std", "values-every_stat", "differences", "differences-hist"],
)
@pytest.mark.parametrize("accumulate_list", LISTS.values(), ids=list(LISTS))
def test_each_tensor_or_difference_lands_in_its_slot(accumulate_list, with_bases, full, bins):
    pairs = _pairs()
    xs = [after for after, _ in pairs]
    bases = [before for _, before in pairs] if with_bases else []
    got, want = _buffers(xs, full, bins), _buffers(xs, full, bins)
    for _ in range(2):  # a second call merges into the same column
        accumulate_list(xs, bases, *got.list_op_args(), *ARGS)
        for slot, x in enumerate(xs):
            if bases:
                working = torch.float64 if x.dtype == torch.float64 else torch.float32
                x = x.to(working) - bases[slot].to(working)
            accumulate_stats_python(x, *want.op_args(), slot, *ARGS)
    assert_buffers_close(got.op_args()[:4], want.op_args()[:4], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("accumulate_list", LISTS.values(), ids=list(LISTS))
def test_an_update_of_half_values_is_taken_in_float(accumulate_list):
    """bfloat16 weights moved by less than their spacing at 1.0: the difference is exact."""
    before = torch.ones(1000, dtype=torch.bfloat16)
    after = before + torch.full((1000,), 2.0**-7, dtype=torch.bfloat16)
    b = StatBuffers(1, 1, "cpu", full=True, hist_bins=0)
    accumulate_list([after], [before], *b.list_op_args(), *ARGS)
    assert b.stats[:, 0, 0].tolist() == [2.0**-7, 0.0]


@pytest.mark.parametrize(
    "accumulate_list", [LISTS["fused"], LISTS["python"]], ids=["fused", "python"]
)
def test_list_errors_name_the_argument(accumulate_list):
    b = StatBuffers(2, 1, "cpu", full=False, hist_bins=0)
    x = torch.randn(4)
    errors = (RuntimeError, ValueError)
    with pytest.raises(errors, match=r"xs has 3 tensors, more than the state's slots \(2\)"):
        accumulate_list([x, x, x], [], *b.list_op_args(), *ARGS)
    with pytest.raises(errors, match="bases must be empty or hold one tensor per xs, got 1 for 2"):
        accumulate_list([x, x], [x], *b.list_op_args(), *ARGS)
    with pytest.raises(errors, match="differences from bases need every statistic"):
        accumulate_list([x, x], [x, x], *b.list_op_args(), *ARGS)
    full = StatBuffers(2, 1, "cpu", full=True, hist_bins=0)
    with pytest.raises(errors, match=r"bases\[1\] must match xs\[1\] in dtype, shape and device"):
        accumulate_list([x, x], [x, x.double()], *full.list_op_args(), *ARGS)
    with pytest.raises(errors, match=r"bases\[0\] must match xs\[0\]"):
        accumulate_list([x], [x[:3]], *full.list_op_args(), *ARGS)
    assert (b.state == 0).all() and (full.state == 0).all()


@FUSED
@pytest.mark.parametrize("with_bases", [True, False])
def test_opcheck(with_bases):
    pairs = _pairs()[:3]
    b = StatBuffers(3, 2, "cpu", full=True, hist_bins=8)
    xs = [after for after, _ in pairs]
    bases = [before for _, before in pairs] if with_bases else []
    torch.library.opcheck(
        torch.ops.fasthooks.accumulate_stats_list.default, (xs, bases, *b.list_op_args(), *ARGS)
    )


@pytest.mark.parametrize("accumulate_list", LISTS.values(), ids=list(LISTS))
def test_more_tensors_than_one_launch_takes_with_empty_ones_between(accumulate_list):
    """150 tensors of three dtypes, a few empty: the CUDA list kernel takes 64 a launch."""
    g = torch.Generator().manual_seed(9)
    dtypes = [torch.float32, torch.bfloat16, torch.float64]
    xs = [
        (torch.randn(1 + 37 * (i % 11), generator=g) * (1 + i)).to(dtypes[i % 3])
        if i % 17
        else torch.empty(0)
        for i in range(150)
    ]
    bases = [x * 0.5 for x in xs]
    got = StatBuffers(150, 1, "cpu", full=True, hist_bins=8)
    want = StatBuffers(150, 1, "cpu", full=True, hist_bins=8)
    accumulate_list(xs, bases, *got.list_op_args(), *ARGS)
    accumulate_stats_list_python(xs, bases, *want.list_op_args(), *ARGS)
    assert_buffers_close(got.op_args()[:4], want.op_args()[:4], rtol=1e-5, atol=1e-7)
    assert got.state[0, ::17].eq(0).all()  # the empty ones count nothing
