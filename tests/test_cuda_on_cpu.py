"""The CUDA kernels' device code run on the CPU (tests/cuda_on_cpu/): what only the CUDA path has.

The operator and extras tests run the same code on every dtype, layout and statistic against the
Python backend (their `cuda_on_cpu` cases); here are block orders, lane splits, alignment, calls
at the same time, the workspace and the emulation's own checks.
"""

import threading
import warnings

import cuda_on_cpu
import pytest
import torch
from conftest import CUDA_ON_CPU, assert_buffers_close, every_binade
from torch import nn

from fasthooks import ActivationStats
from fasthooks.buffers import StatBuffers
from fasthooks.layout import (
    BINADE_FIRST,
    BINADE_MIN,
    CUDA_DROPPED_CALLS,
    CUDA_MAX_BLOCKS,
    CUDA_WORKSPACE_DOUBLES,
    CUDA_WORKSPACE_REGIONS,
    MAX_HIST_BINS,
)
from fasthooks.moments import accumulate_stats_python

pytestmark = CUDA_ON_CPU
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _default_options():
    cuda_on_cpu.configure()
    yield
    cuda_on_cpu.configure()


def _results(
    accumulate, calls, full, bins, lo=-3.0, hi=3.0, binades=False, columns=None, **options
):
    """(state, stats, extra, hist, binades) after calls[i] went to column columns[i] of slot 1
    (by default, each call a column of its own)."""
    b = StatBuffers(2, 2, "cpu", full=full, hist_bins=bins, binades=binades)
    for column, x in zip(columns or range(len(calls)), calls, strict=True):
        b.cursor.fill_(column)
        accumulate(x, *b.op_args(), 1, 0.25, lo, hi, **options)
    return [t.clone() for t in b.op_args()[:5]]


def _assert_matches_python(calls, full, bins, binades=False, columns=None, **options):
    got = _results(cuda_on_cpu.accumulate, calls, full, bins, binades=binades, columns=columns)
    want = _results(accumulate_stats_python, calls, full, bins, binades=binades, columns=columns)
    assert torch.equal(got[4], want[4]), "the binades differ"
    # Values of order 1: a mean near 0 is right to float precision, not relatively.
    assert_buffers_close(got[:4], want[:4], rtol=1e-6, atol=1e-6)


def test_the_workspace_layout_is_the_kernels():
    assert cuda_on_cpu.workspace_doubles() == CUDA_WORKSPACE_DOUBLES
    assert cuda_on_cpu.library().harness_max_blocks() == CUDA_MAX_BLOCKS
    assert cuda_on_cpu.library().harness_regions() == CUDA_WORKSPACE_REGIONS


@pytest.mark.parametrize(
    ("which", "said"),
    [(0, "mask"), (1, "deadlock"), (2, "mask"), (3, "48 KB")],
    ids=["shuffle_outside_mask", "deadlock", "lane", "shared_memory"],
)
def test_the_emulation_catches_broken_rules(which, said):
    """Each check of the emulation can fail: a kernel that breaks its rule is reported."""
    message = cuda_on_cpu.break_a_rule(which)
    assert message, "the emulation reported nothing"
    assert said in message


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("full", "bins", "binades"),
    [(False, 0, False), (True, 0, False), (True, 40, False), (False, 2048, False), (True, 0, True)],
)
def test_block_orders_lane_splits_and_workers_give_identical_bits(dtype, full, bins, binades):
    g = torch.Generator().manual_seed(3)
    calls = [(torch.randn(200_003, generator=g) * 2).to(dtype), torch.randn(999, generator=g)]
    runs = []
    before = cuda_on_cpu.counts()["lane_splits"]
    for seed, workers, split in [(1, 4, False), (2, 1, True), (3, 3, True)]:
        cuda_on_cpu.configure(workers=workers, split_lanes=split, seed=seed)
        runs.append(_results(cuda_on_cpu.accumulate, calls, full, bins, binades=binades))
    # Counted per block beyond kThreadBins, and binades: lanes that share a bin find each other.
    if bins > cuda_on_cpu.library().harness_thread_bins() or binades:
        assert cuda_on_cpu.counts()["lane_splits"] > before, "no lanes were ever split"
    for run in runs[1:]:
        for a, b in zip(runs[0], run, strict=True):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("bins", [1, 7, 40, 41, 64, 65, 255, 256, 1000, MAX_HIST_BINS])
def test_every_histogram_size_with_split_lanes(bins):
    cuda_on_cpu.configure(split_lanes=True, seed=bins)
    g = torch.Generator().manual_seed(bins)
    x = torch.randn(150_001, generator=g) * 1.5
    x[::97] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0, -3.0]).repeat(310)[
        : x[::97].numel()
    ]
    _assert_matches_python([x, x[:1000].bfloat16()], True, bins)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", range(8))
def test_misaligned_input_peels_its_head_and_loads_vectors(dtype, offset):
    base = (torch.randn(10_000, generator=torch.Generator().manual_seed(offset)) + 1).to(dtype)
    x = base[offset:]
    head, _ = cuda_on_cpu.plan(x)
    per_vector = 16 // x.element_size()
    assert head == (per_vector - (x.data_ptr() % 16) // x.element_size()) % per_vector
    _assert_matches_python([x, x[1:5]], True, 40)


@pytest.mark.parametrize("n", [*range(1, 20), 1023, 1024, 1025, 4095, 4096, 4097, 262_145])
def test_tails(n):
    g = torch.Generator().manual_seed(n)
    _assert_matches_python([torch.randn(n, generator=g), torch.randn(n, generator=g)[1:]], True, 40)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("full", "bins"), [(False, 0), (True, 0), (True, 40), (False, 2048)])
@pytest.mark.parametrize("binades", [True, False], ids=["binades", "no_binades"])
def test_binades_count_every_kind_of_value_exactly(dtype, full, bins, binades):
    """Against the Python backend, bin for bin: many blocks, misaligned heads and tails, a call
    of one block, and three calls into one column adding up; without binades (an empty buffer)
    the kernels that count none give the same statistics."""
    x = every_binade(200_003, dtype, seed=bins)
    calls, columns = [x, x[1:], x[3:1000], x[:5]], [0, 1, 1, 1]
    _assert_matches_python(calls, full, bins, binades=binades, columns=columns)


def test_binade_counts_wrap_as_int32_as_on_the_cpu():
    x = torch.ones(100_000)  # every value in the bin of 2^0
    runs = []
    for accumulate in (cuda_on_cpu.accumulate, accumulate_stats_python):
        b = StatBuffers(1, 1, "cpu", full=False, hist_bins=0, binades=True)
        b.binades.fill_(torch.iinfo(torch.int32).max - 10)
        accumulate(x, *b.op_args(), 0)
        runs.append(b.binades[0, 0].clone())
    assert runs[0][BINADE_FIRST - BINADE_MIN] == torch.iinfo(torch.int32).min + 100_000 - 11
    assert torch.equal(runs[0], runs[1])


def test_launches_use_the_blocks_the_gpu_holds():
    resident = cuda_on_cpu.resident_blocks()
    assert resident == 132 * 3  # an H100 or H200 at three blocks a multiprocessor
    assert cuda_on_cpu.plan(torch.empty(10_000_000))[1] == resident
    assert cuda_on_cpu.plan(torch.empty(1000))[1] == 1
    assert cuda_on_cpu.plan(torch.empty(10_000_000), resident=100_000)[1] == CUDA_MAX_BLOCKS


def test_calls_from_two_streams_at_once_stay_apart():
    """Two streams calling into one run at the same time: each gets its own workspace region,
    so both calls are exact, and the run's later calls too."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3_000_000, generator=g) + 10, torch.randn(2_000_000, generator=g) - 4
    buffers = StatBuffers(2, 2, "cpu", full=True, hist_bins=40)
    workspace = torch.zeros(CUDA_WORKSPACE_DOUBLES, dtype=torch.float64)
    args = (*buffers.op_args()[:7], workspace, *buffers.op_args()[8:])
    errors = []

    def call(x, slot, stream):
        try:
            cuda_on_cpu.accumulate(x, *args, slot, 0.05, -20.0, 20.0, stream=stream)
        except Exception as error:  # reported below, from the main thread
            errors.append(error)

    for _ in range(3):
        threads = [
            threading.Thread(target=call, args=(a, 0, 101)),
            threading.Thread(target=call, args=(b, 1, 202)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    cuda_on_cpu.accumulate(a[:1000], *args, 0, 0.05, -20.0, 20.0)
    reference = StatBuffers(2, 2, "cpu", full=True, hist_bins=40)
    for _ in range(3):
        accumulate_stats_python(a, *reference.op_args(), 0, 0.05, -20.0, 20.0)
        accumulate_stats_python(b, *reference.op_args(), 1, 0.05, -20.0, 20.0)
    accumulate_stats_python(a[:1000], *reference.op_args(), 0, 0.05, -20.0, 20.0)
    for got, want in zip(args[:4], reference.op_args()[:4], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, equal_nan=True)
    counters = workspace[CUDA_WORKSPACE_REGIONS * 9 * CUDA_MAX_BLOCKS : CUDA_DROPPED_CALLS + 1]
    assert not counters.view(torch.int64).any(), "a finished-blocks counter was left non-zero"


def test_each_stream_and_each_capture_gets_a_region_of_its_own():
    run, other_run = 0x10000, 0x20000  # workspaces, by address
    regions = [cuda_on_cpu.region_of(run, s) for s in (0, 7, 9, 0, 7)]
    assert regions == [0, 1, 2, 0, 1]
    assert cuda_on_cpu.region_of(run, 7, capturing=True) == 3
    assert cuda_on_cpu.region_of(other_run, 9) == 0
    for stream in range(100, 104):
        cuda_on_cpu.region_of(run, stream)
    with pytest.raises(RuntimeError, match="more than 8 CUDA streams.*ActivationStats of its own"):
        cuda_on_cpu.region_of(run, 999)


def test_a_call_past_the_capacity_is_counted_not_written():
    b = StatBuffers(1, 2, "cpu", full=True, hist_bins=10, binades=True)
    workspace = torch.zeros(CUDA_WORKSPACE_DOUBLES, dtype=torch.float64)
    b.workspace = workspace
    b.cursor.fill_(2)  # as a CUDA graph captured at capacity 2 finds it after two more batches
    before = [t.clone() for t in b.op_args()[:5]]
    for _ in range(3):
        cuda_on_cpu.accumulate(torch.randn(5000), *b.op_args(), 0)
    for now, then in zip(b.op_args()[:5], before, strict=True):
        assert torch.equal(now.nan_to_num(), then.nan_to_num())
    assert b.dropped_calls() == 3
    assert not workspace[:CUDA_DROPPED_CALLS].any()


def test_reading_reports_dropped_calls_naming_expected_batches():
    model = nn.Sequential(nn.Linear(4, 4))
    act = ActivationStats(model, backend="python", expected_batches=2)
    with act:
        model(torch.randn(3, 4))
        act.on_batch_end()
        # The CUDA kernels' workspace, after a replay found the cursor past the capacity.
        act._buffers.workspace = torch.zeros(CUDA_WORKSPACE_DOUBLES, dtype=torch.float64)
        act._buffers.cursor.fill_(act._buffers.capacity)
        cuda_on_cpu.accumulate(torch.randn(10), *act._buffers.op_args(), 0)
        act._buffers.cursor.fill_(1)
    with pytest.warns(RuntimeWarning, match=r"1 hooked calls were not recorded.*expected_batches"):
        assert act.stats.shape == (2, 1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _ = act.stats  # said once


@pytest.mark.slow
def test_more_than_two_to_the_31_elements():
    n = 2**31 + 13
    x = torch.full((n,), 1.5, dtype=torch.bfloat16)
    x[::3] = -0.5
    x[-13:] = 4.0
    b = StatBuffers(1, 1, "cpu", full=False, hist_bins=0)
    cuda_on_cpu.accumulate(x, *b.op_args(), 0)
    count, mean, m2 = b.state[:, 0, 0].tolist()
    thirds = (n - 13 + 2) // 3  # -0.5 at 0, 3, 6, ... before the last 13
    total = -0.5 * thirds + 1.5 * (n - 13 - thirds) + 4.0 * 13
    assert count == n
    assert mean == pytest.approx(total / n, rel=1e-9)
    want_m2 = thirds * (-0.5 - total / n) ** 2 + (n - 13 - thirds) * (1.5 - total / n) ** 2
    want_m2 += 13 * (4.0 - total / n) ** 2
    assert m2 == pytest.approx(want_m2, rel=1e-6)
