"""Statistics beyond mean and std: extremes, near-zero fraction, non-finite counts, kurtosis and
histograms, from the operator up to ActivationStats."""

import math

import cuda_on_cpu
import pytest
import torch
from conftest import BACKENDS, CUDA_ON_CPU, DEVICES, FUSED, every_binade
from torch import nn

from fasthooks import ActivationStats, hook_outputs
from fasthooks.buffers import HostCopy, StatBuffers
from fasthooks.layout import BINADE_BINS, EXTRA_PLANES, EXTRAS, STATE_PLANES
from fasthooks.moments import accumulate_stats_python, binade_counts
from fasthooks.ops import accumulate_stats, kernel_layout

ACCUMULATORS = {
    "python": accumulate_stats_python,
    "fused": pytest.param(accumulate_stats, marks=FUSED),
    "cuda_on_cpu": pytest.param(cuda_on_cpu.accumulate, marks=CUDA_ON_CPU),
}
ALL = list(EXTRAS)


def _reference_histogram(x: torch.Tensor, bins: int, lo: float, hi: float) -> list[int]:
    """Counts by the float64 edges: e_k <= v < e_k+1, the top edge in the last bin. One binary
    search a value (not a pass a bin), which keeps the tests quick under CPU emulation."""
    v = x.detach().double().cpu().reshape(-1)
    v = v[v.isfinite()]
    k = torch.arange(bins + 1, dtype=torch.float64)
    edges = lo + (hi - lo) * k / bins
    edges[-1] = hi
    bin_of = torch.searchsorted(edges, v, right=True) - 1
    bin_of[v == hi] = bins - 1
    inside = (bin_of >= 0) & (bin_of < bins)
    return torch.bincount(bin_of[inside], minlength=bins).tolist()


def _reference_extras(tensors: list[torch.Tensor], near_zero: float) -> dict[str, float]:
    v = torch.cat([t.detach().float().cpu().reshape(-1) for t in tensors])
    d = v.double() - v.double().mean()
    return {
        "min": v.amin().item(),
        "max": v.amax().item(),
        "near_zero": (v <= near_zero).sum().item() / v.numel(),
        "nonfinite": int((~v.isfinite()).sum()),
        "kurtosis": ((d**4).mean() / (d**2).mean() ** 2).item(),
    }


@FUSED
def test_kernels_share_the_layout():
    assert kernel_layout() == (STATE_PLANES, EXTRA_PLANES)


KURTOSIS_CASES = {
    "N(0,1)": lambda g: torch.randn(1_000_000, generator=g),
    "N(1e3,1)": lambda g: torch.randn(1_000_000, generator=g) + 1e3,
    "uniform": lambda g: torch.rand(1_000_000, generator=g),
    "relu": lambda g: torch.randn(1_000_000, generator=g).relu(),
}


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize("case", KURTOSIS_CASES)
def test_kurtosis_against_float64(accumulate, case, device):
    x = KURTOSIS_CASES[case](torch.Generator().manual_seed(5))
    b = StatBuffers(1, 1, device, full=True, hist_bins=0)
    accumulate(x.to(device), *b.op_args(), 0, 0.05, 0.0, 1.0)
    want = _reference_extras([x], 0.05)["kurtosis"]
    got = b.extra[EXTRA_PLANES.index("kurtosis"), 0, 0].item()
    assert abs(got - want) <= 1e-4 * want, (got, want)


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
# The CPU kernels count up to 64 bins one way and more another, and skip the check against the
# edges where the bin width is a power of two and lo a multiple of it.
@pytest.mark.parametrize(
    "bins, lo, hi",
    [
        (7, -1.3, 2.9),
        (64, -1.3, 2.9),
        (65, -1.3, 2.9),
        (40, 0.0, 10.0),
        (16, 2.0, 6.0),
        (16, -2.0, 2.0),
        (8, 0.0, 1024.0),
        (24, -48.0, 48.0),
    ],
)
def test_extremes_counts_and_histograms_are_exact(accumulate, dtype, bins, lo, hi, device):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(300_001, generator=g, dtype=torch.float64) * 2
    edges = lo + (hi - lo) * torch.arange(bins + 1, dtype=torch.float64) / bins
    x[:3000] = edges[torch.randint(0, bins + 1, (3000,), generator=g)]  # values on the edges
    x[3000:3005] = math.inf
    x[3005:3007] = -math.inf
    # Just above the top edge (in no bin, but in the bin after the last one as the kernels first
    # count it), and subnormal values either side of zero (a product that rounds to zero).
    x[3007:3015] = torch.tensor([hi + (hi - lo) / bins / 2, hi * (1 + 2**-20), 1e-45, -1e-45] * 2)
    x[200_000:200_003] = 0.05
    x = x.to(dtype)
    b = StatBuffers(1, 1, device, full=True, hist_bins=bins)
    accumulate(x.to(device), *b.op_args(), 0, 0.05, lo, hi)
    want = _reference_extras([x], 0.05)
    extra = dict(zip(EXTRA_PLANES, b.extra[:, 0, 0].tolist(), strict=True))
    assert extra["min"] == -math.inf and extra["max"] == math.inf
    assert extra["near_zero"] == pytest.approx(want["near_zero"], rel=1e-7)
    assert b.nonfinite()[0, 0].item() == 7
    assert b.hist[0, 0].tolist() == _reference_histogram(x, bins, lo, hi)
    finite = x[3007:]
    b = StatBuffers(1, 1, device, full=True, hist_bins=bins)
    accumulate(finite.to(device), *b.op_args(), 0, 0.05, lo, hi)
    assert b.extra[0, 0, 0].item() == finite.float().amin().item()
    assert b.extra[1, 0, 0].item() == finite.float().amax().item()


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize("bins", [1, 7, 40, 41, 256, 2048])
@pytest.mark.parametrize("lo", [1000.0, -3.3e5, 0.0])
def test_values_beside_every_edge_at_the_finest_bins_allowed(accumulate, bins, lo, device):
    # Bins barely wider than the 2^-16 of the range's magnitude that float32 must resolve, where a
    # kernel's first guess of the bin is least accurate: every edge, rounded to float32, and the
    # floats either side of it, counted as the float64 edges say.
    width = 2.0**-15 * abs(lo) if lo else 0.37
    hi = lo + bins * width
    edges = (lo + (hi - lo) * torch.arange(bins + 1, dtype=torch.float64) / bins).float()
    up, down = torch.full_like(edges, math.inf), torch.full_like(edges, -math.inf)
    x = torch.cat([edges, torch.nextafter(edges, up), torch.nextafter(edges, down)])
    b = StatBuffers(1, 1, device, full=False, hist_bins=bins)
    accumulate(x.to(device), *b.op_args(), 0, 0.05, lo, hi)
    assert b.hist[0, 0].tolist() == _reference_histogram(x, bins, lo, hi)


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize("bins, lo, hi", [(40, 0.0, 10.0), (7, -1.3, 2.9), (100, 0.0, 10.0)])
def test_histogram_with_most_values_in_one_bin_is_exact(accumulate, bins, lo, hi, device):
    # A ReLU output: half of the values are 0, and every lane of a vector often lands in one bin.
    x = torch.randn(1_000_003, generator=torch.Generator().manual_seed(4)).relu()
    x[:70_000] = 0.5
    b = StatBuffers(1, 1, device, full=False, hist_bins=bins)
    accumulate(x.to(device), *b.op_args(), 0, 0.05, lo, hi)
    assert b.hist[0, 0].tolist() == _reference_histogram(x, bins, lo, hi)


@pytest.mark.isa
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize("bins, lo, hi", [(40, -5.0, 5.0), (100, -5.0, 5.0), (40, 0.0, 10.0)])
def test_histogram_matches_torch_histc_off_the_edges(accumulate, bins, lo, hi):
    x = torch.randn(500_000, generator=torch.Generator().manual_seed(2)) * 4
    b = StatBuffers(1, 1, "cpu", full=False, hist_bins=bins)
    accumulate(x, *b.op_args(), 0, 0.05, lo, hi)
    assert torch.equal(b.hist[0, 0], torch.histc(x.double(), bins, lo, hi).long())


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize("bins, lo, hi", [(4, -1.0, 1.0), (7, -1.3, 2.9), (100, -1.3, 2.9)])
def test_nan_makes_min_and_max_nan_and_is_counted(accumulate, bins, lo, hi, device):
    for where in (0, 70_000, 99_999):
        x = torch.randn(100_000)
        x[where] = math.nan
        b = StatBuffers(1, 1, device, full=True, hist_bins=bins)
        accumulate(x.to(device), *b.op_args(), 0, 0.05, lo, hi)
        assert math.isnan(b.extra[0, 0, 0].item()) and math.isnan(b.extra[1, 0, 0].item())
        assert b.nonfinite()[0, 0].item() == 1
        assert b.hist[0, 0].tolist() == _reference_histogram(x, bins, lo, hi)


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 1e30])
def test_nonfinite_values_scattered_among_huge_ones_are_counted_exactly(
    accumulate, dtype, scale, device
):
    # Non-finite values in some stretches and not in others, among finite values whose powers
    # overflow float32 (1e30: the CUDA kernels count non-finite values only where their float
    # sums are not finite, which such values make them too).
    g = torch.Generator().manual_seed(11)
    x = torch.randn(200_003, generator=g, dtype=torch.float64) * min(scale, 1e4)
    x[:50_000] *= scale / min(scale, 1e4)
    x[150_000:] *= scale / min(scale, 1e4)
    where = torch.randint(0, 120_000, (400,), generator=g)
    x[where[:150]] = math.inf
    x[where[150:250]] = -math.inf
    x[where[250:]] = math.nan
    x = x.to(dtype)
    b = StatBuffers(1, 1, device, full=True, hist_bins=0)
    accumulate(x.to(device), *b.op_args(), 0, 0.05, 0.0, 1.0)
    assert b.nonfinite()[0, 0].item() == _reference_extras([x], 0.05)["nonfinite"]
    finite = x[120_000:]
    b = StatBuffers(1, 1, device, full=True, hist_bins=0)
    accumulate(finite.to(device), *b.op_args(), 0, 0.05, 0.0, 1.0)
    assert b.nonfinite()[0, 0].item() == _reference_extras([finite], 0.05)["nonfinite"]


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lane", [0, 1, 6, 7])
def test_16_bit_extremes_in_every_lane_of_a_load(accumulate, dtype, lane, device):
    # The CUDA kernels take a 16-bit load's extremes two lanes at a time, by their bits: the
    # extremes at each lane, of either sign, among negative zeros and subnormals, and a NaN.
    tiny = torch.finfo(dtype).smallest_normal / 4
    x = torch.tensor([-0.0, 0.0, tiny, -tiny] * 25_000, dtype=torch.float64)
    x[: x.numel() // 2] *= -1
    for low, high in ((-3.5, 2.25), (-1e-3, -1e-4), (7.0, 9.0)):
        y = x.clone()
        y[8 * 777 + lane] = low
        y[8 * 9_000 + 7 - lane] = high
        y = y.to(dtype)
        b = StatBuffers(1, 1, device, full=True, hist_bins=0)
        accumulate(y.to(device), *b.op_args(), 0, 0.05, 0.0, 1.0)
        assert b.extra[0, 0, 0].item() == y.float().amin().item()
        assert b.extra[1, 0, 0].item() == y.float().amax().item()
    y = x.to(dtype)
    y[8 * 5_000 + lane] = math.nan
    b = StatBuffers(1, 1, device, full=True, hist_bins=0)
    accumulate(y.to(device), *b.op_args(), 0, 0.05, 0.0, 1.0)
    assert math.isnan(b.extra[0, 0, 0].item()) and math.isnan(b.extra[1, 0, 0].item())
    assert b.nonfinite()[0, 0].item() == 1


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
def test_calls_merge_exactly(accumulate, device):
    g = torch.Generator().manual_seed(4)
    parts = [
        torch.randn(1000, generator=g) * 5 + 1,
        torch.randn(70_000, generator=g).relu(),
        torch.tensor([math.inf]),
        torch.randn(1, generator=g),
        torch.rand(123_457, generator=g) * 8 - 2,
    ]
    b = StatBuffers(2, 2, device, full=True, hist_bins=10)
    b.cursor.fill_(1)
    for p in parts:
        accumulate(p.to(device), *b.op_args(), 1, 0.05, -3.0, 6.0)
    finite = [p for p in parts if p.isfinite().all()]
    merged = StatBuffers(2, 2, device, full=True, hist_bins=10)
    merged.cursor.fill_(1)
    accumulate(torch.cat(finite).to(device), *merged.op_args(), 1, 0.05, -3.0, 6.0)
    want = _reference_extras(parts, 0.05)
    extra = dict(zip(EXTRA_PLANES, b.extra[:, 1, 1].tolist(), strict=True))
    assert extra["max"] == math.inf and extra["min"] == want["min"]
    assert extra["near_zero"] == pytest.approx(want["near_zero"], rel=1e-7)
    assert b.nonfinite()[1, 1].item() == 1
    assert b.hist[1, 1].tolist() == _reference_histogram(torch.cat(parts), 10, -3.0, 6.0)
    # The finite calls alone merge to the statistics of their concatenation.
    finite_only = StatBuffers(2, 2, device, full=True, hist_bins=10)
    finite_only.cursor.fill_(1)
    for p in finite:
        accumulate(p.to(device), *finite_only.op_args(), 1, 0.05, -3.0, 6.0)
    torch.testing.assert_close(finite_only.extra, merged.extra, rtol=2e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(finite_only.stats, merged.stats, rtol=2e-6, atol=0, equal_nan=True)
    assert torch.equal(finite_only.hist, merged.hist)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_stats_records_every_statistic(backend, device):
    model = _net().to(device)
    act = ActivationStats(
        model,
        backend=backend,
        extra=ALL,
        near_zero=0.1,
        hist_bins=16,
        hist_range=(-2, 2),
        expected_batches=2,
    )
    seen = []
    with act, hook_outputs(act.modules) as outputs:
        for b in range(5):  # past expected_batches: growth keeps every statistic
            model(torch.randn(8, 3, 8, 8, device=device) * (b + 1)).sum().backward()
            seen.append(list(outputs.stored))
            act.on_batch_end(train=True)
        model(torch.randn(8, 3, 8, 8, device=device) * 100)
        act.on_batch_end(train=False)  # a validation batch leaves no trace
        model.eval()
        model(torch.randn(8, 3, 8, 8, device=device) * 100)
    assert set(act.extra) == set(ALL)
    for name, values in act.extra.items():
        assert values.shape == (2, 5) and values.device.type == "cpu"
        assert values.dtype == (torch.int64 if name == "nonfinite" else torch.float32)
    assert act.hist.shape == (2, 5, 16) and act.hist.dtype == torch.int64
    for m in range(2):
        for b in range(5):
            want = _reference_extras([seen[b][m]], 0.1)
            for name in ("min", "max", "nonfinite"):
                assert act.extra[name][m, b].item() == want[name]
            assert act.extra["near_zero"][m, b].item() == pytest.approx(want["near_zero"])
            assert act.extra["kurtosis"][m, b].item() == pytest.approx(want["kurtosis"], rel=1e-4)
            assert act.hist[m, b].tolist() == _reference_histogram(seen[b][m], 16, -2, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_that_did_not_run_reads_nan_and_counts_zero(backend):
    skipped = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4))
    with ActivationStats(
        model, modules=[model[0], skipped], backend=backend, extra=ALL, hist_bins=3
    ) as act:
        model(torch.randn(2, 4))
        act.on_batch_end()
    for name in ("min", "max", "near_zero", "kurtosis"):
        assert math.isnan(act.extra[name][1, 0].item())
    assert act.extra["nonfinite"][1, 0].item() == 0 and act.hist[1, 0].tolist() == [0, 0, 0]


def test_only_requested_extras_are_returned_and_hist_needs_bins():
    act = ActivationStats(_net(), backend="python", extra="max")
    assert list(act.extra) == ["max"] and act.extra["max"].shape == (0, 0)  # modules not yet known
    with pytest.raises(AttributeError, match="hist is recorded only with hist_bins > 0"):
        act.hist  # noqa: B018
    assert ActivationStats(_net(), backend="python").extra == {}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"extra": ["max", "l2"]}, ValueError, r"extra: unknown statistic 'l2'; valid ones are \("),
        ({"hist_bins": -1}, ValueError, "hist_bins must be an int >= 0, got -1"),
        ({"hist_bins": 4096}, ValueError, r"hist_bins must be in \[0, 2048\], got 4096"),
        ({"hist_bins": 2.5}, TypeError, "hist_bins must be an int, got float"),
        ({"hist_bins": True}, TypeError, "hist_bins must be an int, got bool"),
        (
            {"hist_range": (1, 1)},
            ValueError,
            r"hist_range must be finite with lo < hi, got \(1, 1\)",
        ),
        ({"hist_range": (0, math.inf)}, ValueError, "hist_range must be finite with lo < hi"),
        ({"hist_range": 3}, ValueError, "hist_range must be two numbers"),
        (
            {"hist_bins": 10, "hist_range": (1e6, 1e6 + 1e-3)},
            ValueError,
            "hist_range: 10 bins over",
        ),
        (
            {"hist_bins": 4, "hist_range": (-1e39, 1e39)},
            ValueError,
            r"hist_range must lie within float32's range and span at most 3.403e\+38",
        ),
        ({"hist_range": (-3e38, 3e38)}, ValueError, "hist_range must lie within float32's"),
        ({"near_zero": "small"}, TypeError, "near_zero must be a number, got str"),
        ({"near_zero": math.nan}, ValueError, "near_zero must not be NaN"),
    ],
)
def test_bad_options_name_the_argument(kwargs, error, message):
    with pytest.raises(error, match=message):
        ActivationStats(_net(), backend="python", **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reading_stats_on_the_cpu_is_a_view(backend):
    model = _net()
    with ActivationStats(model, backend=backend, extra=["max"], hist_bins=4) as act:
        for _ in range(3):
            model(torch.randn(2, 3, 8, 8))
            act.on_batch_end()
        stats, extra, hist = act.stats, act.extra["max"], act.hist
    buffers = act._buffers
    assert stats.untyped_storage().data_ptr() == buffers.stats.untyped_storage().data_ptr()
    assert extra.untyped_storage().data_ptr() == buffers.extra.untyped_storage().data_ptr()
    assert hist.untyped_storage().data_ptr() == buffers.hist.untyped_storage().data_ptr()
    assert stats.shape == (2, 2, 3)


def test_host_copy_copies_each_column_once():
    source = torch.arange(12.0).reshape(2, 6)
    copy = HostCopy(axis=1, dtype=torch.float32)
    assert copy.read(source, 2).tolist() == [[0, 1], [6, 7]]
    source[:, :2] = -1  # already copied: not read again
    assert copy.read(source, 5).tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]
    assert copy.read(source, 6)[:, 5].tolist() == [5, 11]


# N(0, 1) at every power of ten from 1e-30 to 1e30, in the dtypes that represent it: where a
# float's powers of the deviations leave its range (gradients near 1e-11 have 4th powers near
# 1e-44; values near 1e20 have 4th powers beyond 3e38) every statistic must still be right.
SCALES = [10.0**k for k in range(-30, 31)]
SCALE_DTYPES = {
    torch.float32: (1e-30, 1e30),
    torch.bfloat16: (1e-30, 1e30),
    torch.float16: (1e-3, 1e3),
}


def _scale_cases():
    for dtype, (low, high) in SCALE_DTYPES.items():
        for scale in SCALES:
            if low <= scale <= high:
                yield pytest.param(dtype, scale, id=f"{str(dtype)[6:]}-{scale:.0e}")


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize(("dtype", "scale"), list(_scale_cases()))
def test_every_statistic_at_every_scale(accumulate, dtype, scale, device):
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(20_011, generator=g, dtype=torch.float64) * scale).to(dtype)
    b = StatBuffers(1, 1, device, full=True, hist_bins=0)
    near_zero = 0.3 * scale
    accumulate(x.to(device), *b.op_args(), 0, near_zero, 0.0, 1.0)
    v = x.double()
    mean, std = v.mean().item(), v.std().item()
    got_mean, got_std = b.stats[:, 0, 0].tolist()
    assert abs(got_std - std) <= 1e-5 * std, (got_std, std)
    assert abs(got_mean - mean) <= 1e-6 * (abs(mean) + std), (got_mean, mean)
    want = _reference_extras([x], near_zero)
    extra = dict(zip(EXTRA_PLANES, b.extra[:, 0, 0].tolist(), strict=True))
    assert extra["min"] == want["min"] and extra["max"] == want["max"]
    assert extra["near_zero"] == pytest.approx(want["near_zero"], rel=1e-6)
    assert abs(extra["kurtosis"] - want["kurtosis"]) <= 1e-4 * want["kurtosis"], extra
    assert b.nonfinite()[0, 0].item() == 0


@FUSED
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_histogram_range_beyond_float32_is_refused_for_reduced_precision(dtype):
    """Reduced-precision values are binned in float32, which cannot hold such edges (the check is
    the CPU and CUDA kernels' own)."""
    b = StatBuffers(1, 1, "cpu", full=True, hist_bins=4)
    with pytest.raises(RuntimeError, match="hist_min and hist_max must lie within float32's"):
        accumulate_stats(torch.randn(100).to(dtype), *b.op_args(), 0, 0.05, -1e39, 1e39)
    assert (b.hist == 0).all()


@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
def test_float64_values_are_binned_right_beyond_float32(accumulate):
    b = StatBuffers(1, 1, "cpu", full=True, hist_bins=4)
    x = torch.randn(1000, dtype=torch.float64)
    accumulate(x, *b.op_args(), 0, 0.05, -1e39, 1e39)
    assert b.hist[0, 0].tolist() == [0, int((x < 0).sum()), int((x >= 0).sum()), 0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("full", [False, True], ids=["mean_std", "every_stat"])
def test_binades_count_every_value_in_its_binade(accumulate, dtype, full, device):
    x = every_binade(50_001, dtype, seed=11)
    b = StatBuffers(2, 2, device, full=full, hist_bins=0, binades=True)
    b.cursor.fill_(1)
    accumulate(x.to(device), *b.op_args(), 1, 0.05, 0.0, 1.0)
    accumulate(x[1:].to(device), *b.op_args(), 1, 0.05, 0.0, 1.0)  # a second call adds
    got = b.binades.cpu()
    assert torch.equal(got[1, 1].long(), binade_counts(x) + binade_counts(x[1:]))
    assert not got[0].any() and not got[1, 0].any(), "a count landed in another slot or column"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=list(ACCUMULATORS))
def test_activation_stats_counts_the_binades_of_every_output(accumulate, device):
    """ActivationStats(extra=["binades"]) over each operator, the CUDA kernels' device code run on
    the CPU among them in the fused operator's place."""
    model = _net().to(device)
    act = ActivationStats(model, backend="python", extra=["binades", "max"], expected_batches=2)
    act._accumulate = accumulate
    seen = []
    with act, hook_outputs(act.modules) as outputs:
        for b in range(3):  # past expected_batches: growth keeps every count
            x = torch.randn(8, 3, 8, 8, device=device) * 10.0 ** (8 * b - 8)
            model(x)
            first = [o.clone() for o in outputs.stored]
            model(x[:3])  # two calls in a batch add up
            seen.append(
                [
                    torch.cat([o1.reshape(-1), o2.reshape(-1)])
                    for o1, o2 in zip(first, outputs.stored, strict=True)
                ]
            )
            act.on_batch_end(train=True)
    assert act.binades.shape == (2, 3, BINADE_BINS)
    for b, outputs_of_batch in enumerate(seen):
        for m, values in enumerate(outputs_of_batch):
            assert act.binades[m, b].tolist() == binade_counts(values.cpu()).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_and_absmax_of_activations(backend):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batches = [torch.randn(32, 8) * (i + 1) for i in range(3)]
    with ActivationStats(model, backend=backend, extra=["norm", "absmax"]) as act:
        for x in batches:
            model(x)
            model(x[:5])  # two calls in a batch merge
            act.on_batch_end()
    with hook_outputs(act.modules) as outputs:
        for b, x in enumerate(batches):
            model(x)
            first = [o.clone() for o in outputs.stored]
            model(x[:5])
            for m, (o1, o2) in enumerate(zip(first, outputs.stored, strict=True)):
                values = torch.cat([o1.reshape(-1), o2.reshape(-1)]).double()
                norm = act.extra["norm"][m, b].item()
                assert norm == pytest.approx(values.norm().item(), rel=1e-5)
                assert act.extra["absmax"][m, b].item() == values.abs().max().item()
