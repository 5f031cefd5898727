"""The accumulate_stats operator: numerics, layouts, special values and operator hygiene."""

import math
import subprocess
import sys

import cuda_on_cpu
import pytest
import torch
from conftest import (
    CUDA_ON_CPU,
    DEVICES,
    FUSED,
    assert_buffers_close,
    reference_moments,
    subprocess_env,
)

from fasthooks import ops
from fasthooks.buffers import StatBuffers
from fasthooks.layout import AccumulateArgs
from fasthooks.moments import accumulate_stats_python

pytestmark = FUSED
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ACCUMULATORS = {
    "fused": ops.accumulate_stats,
    "python": accumulate_stats_python,
    "cuda_on_cpu": cuda_on_cpu.accumulate,
}
# Every backend of the operator: the CPU kernels, the Python reference and the CUDA kernels' device
# code run on the CPU (tests/cuda_on_cpu/).
BACKENDS = ["fused", "python", pytest.param("cuda_on_cpu", marks=CUDA_ON_CPU)]
KERNELS = ["fused", pytest.param("cuda_on_cpu", marks=CUDA_ON_CPU)]


def _buffers(device="cpu", full=False, bins=0, modules=2, capacity=3, binades=False) -> StatBuffers:
    return StatBuffers(modules, capacity, device, full=full, hist_bins=bins, binades=binades)


def _moments(x: torch.Tensor, backend: str = "fused", calls: int = 1, full: bool = False):
    """(count, mean, unbiased std) in float64 after `calls` accumulations of x into one slot."""
    b = _buffers(x.device, full)
    b.cursor.fill_(1)
    for _ in range(calls):
        ACCUMULATORS[backend](x, *b.op_args(), 1, 0.05, 0.0, 10.0)
    count, mean, m2 = b.state[:3, 1, 1].tolist()
    return count, mean, math.sqrt(m2 / (count - 1)) if count > 1 else math.nan


def _assert_within_bounds(got_mean, got_std, ref_mean, ref_std, rel_std=1e-5, rel_mean=1e-6):
    assert abs(got_std - ref_std) <= rel_std * ref_std, (got_std, ref_std)
    assert abs(got_mean - ref_mean) <= rel_mean * (abs(ref_mean) + ref_std), (got_mean, ref_mean)


def _zero_heads(n, g):
    """N(1e5, 1) whose first 16 values of every 65,536 are 0: a shift taken there is far off."""
    x = torch.randn(n, generator=g) + 1e5
    for start in range(0, n, 1 << 16):
        x[start : start + 16] = 0
    return x


DISTRIBUTIONS = {
    "N(0,1)": lambda n, g: torch.randn(n, generator=g),
    "N(1e3,1)": lambda n, g: torch.randn(n, generator=g) + 1e3,
    "N(0,1e-3)": lambda n, g: torch.randn(n, generator=g) * 1e-3,
    "relu": lambda n, g: torch.randn(n, generator=g).relu(),
    "N(1e5,1) zero heads": _zero_heads,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("full", [False, True], ids=["mean_std", "every_stat"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize(
    "n",
    [
        pytest.param(1_000, marks=pytest.mark.isa),
        pytest.param(123_457, marks=pytest.mark.isa),
        5_000_000,
        pytest.param(50_000_000, marks=pytest.mark.slow),
    ],
)
def test_float32_numerics_against_float64_two_pass(backend, dist, n, full, device):
    x = DISTRIBUTIONS[dist](n, torch.Generator().manual_seed(n))
    count, mean, std = _moments(x.to(device), backend, full=full)
    assert count == n
    _assert_within_bounds(mean, std, *reference_moments(x), rel_std=1e-6)


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", KERNELS)
def test_dtypes_match_reference(dtype, device, backend):
    x = (torch.randn(300_001, dtype=torch.float64) * 3 + 7).to(dtype).to(device)
    count, mean, std = _moments(x, backend)
    assert count == x.numel()
    _assert_within_bounds(mean, std, *reference_moments(x))


def _layouts(device):
    base = torch.randn(8, 6, 20, 30, device=device) + 2
    return {
        "contiguous": base,
        "channels_last": base.to(memory_format=torch.channels_last),
        "transposed": base.transpose(1, 3),
        "strided_slice": base[:, ::2, 3:, ::3],
        "expanded": torch.randn(1, 6, 1, 30, device=device).expand(8, 6, 20, 30),
        "scalar": torch.tensor(3.5, device=device),
    }


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", _layouts("cpu"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", KERNELS)
def test_layouts_give_the_same_moments(layout, dtype, device, backend):
    x = _layouts(device)[layout].to(dtype)
    count, mean, std = _moments(x, backend)
    ref_mean, ref_std = reference_moments(x)
    assert count == x.numel()
    if x.numel() == 1:
        assert mean == ref_mean and math.isnan(std)
    else:
        _assert_within_bounds(mean, std, ref_mean, ref_std)


def _copies_made(x: torch.Tensor) -> list[str]:
    """Names of the copying aten ops that one accumulate call on x dispatches."""
    b = _buffers(full=True, bins=40)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.accumulate_stats(x, *b.op_args(), 0)
    return [
        e.name
        for e in prof.events()
        if e.name in ("aten::clone", "aten::copy_", "aten::contiguous")
    ]


def test_dense_layouts_are_read_in_place_and_others_copied():
    x = torch.randn(4, 8, 16, 16)
    assert _copies_made(x) == []
    assert _copies_made(x.to(memory_format=torch.channels_last)) == []
    assert _copies_made(x.permute(3, 1, 0, 2)) == []  # any dense permutation reads in place
    assert "aten::clone" in _copies_made(x[:, :, ::2])


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_merging_calls_equals_concatenation(backend, device):
    g = torch.Generator().manual_seed(3)
    parts = [
        torch.randn(1000, generator=g) * 5 + 100,
        torch.randn(70_000, generator=g) * 0.1,
        torch.randn(1, generator=g),
        torch.empty(0),
        torch.randn(333_333, generator=g) - 40,
    ]
    b = _buffers(device, modules=1, capacity=1)
    for p in parts:
        ACCUMULATORS[backend](p.to(device), *b.op_args(), 0, 0.05, 0.0, 10.0)
    count, mean, m2 = b.state[:, 0, 0].tolist()
    assert count == sum(p.numel() for p in parts)
    _assert_within_bounds(mean, math.sqrt(m2 / (count - 1)), *reference_moments(*parts))


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_single_element(backend, dtype, device):
    b = _buffers(device, full=True, bins=4, modules=1, capacity=2)
    ACCUMULATORS[backend](
        torch.empty(0, 3, dtype=dtype, device=device), *b.op_args(), 0, 0.05, 0, 4
    )
    b.cursor.fill_(1)
    ACCUMULATORS[backend](
        torch.tensor([2.5], dtype=dtype, device=device), *b.op_args(), 0, 0.05, 0, 4
    )
    stats, extra, hist = b.stats.cpu(), b.extra.cpu(), b.hist.cpu()
    assert torch.isnan(stats[:, 0, 0]).all() and torch.isnan(extra[:, 0, 0]).all()
    assert hist[0, 0].tolist() == [0, 0, 0, 0] and b.state[:, 0, 0].eq(0).all()
    assert stats[0, 0, 1].item() == 2.5 and math.isnan(stats[1, 0, 1].item())
    min_, max_, near_zero, kurtosis = extra[:, 0, 1].tolist()
    assert (min_, max_, near_zero) == (2.5, 2.5, 0.0) and math.isnan(kurtosis)
    assert hist[0, 1].tolist() == [0, 0, 1, 0]


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("special", "expected_mean", "expected_std"),
    [
        ([math.nan], math.nan, math.nan),
        ([math.inf], math.inf, math.nan),
        ([-math.inf], -math.inf, math.nan),
        ([math.inf, -math.inf], math.nan, math.nan),
    ],
)
@pytest.mark.parametrize("full", [False, True], ids=["mean_std", "every_stat"])
def test_nan_and_inf_propagate(backend, special, expected_mean, expected_std, device, full):
    for where in (0, 70_000, 199_998):  # first chunk, a later chunk, the very end
        x = torch.randn(200_000)
        x[where : where + len(special)] = torch.tensor(special)
        # torch.mean and torch.std, not std_mean, whose Welford mean turns inf into NaN.
        torch_mean, torch_std = x.double().mean(), x.double().std()
        _, mean, std = _moments(x.to(device), backend, full=full)
        for got, want, from_torch in (
            (mean, expected_mean, torch_mean),
            (std, expected_std, torch_std),
        ):
            assert (math.isnan(got) and math.isnan(want)) or got == want, (where, got, want)
            assert (math.isnan(got) and from_torch.isnan()) or got == from_torch.item()


# Over (1, 9): 32 and 64 bins take the kernels' exact first guess, 7 the checked one; 64 is the most
# that are counted from byte codes (in four reads of sixteen bins with GFNI), 100 the other way.
CAPABILITY_BINS = (7, 32, 64, 100)


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512", "avx512_gfni"])
def test_every_cpu_capability_gives_the_same_numbers(capability):
    script = (
        "import torch, fasthooks.ops as ops\n"
        "from fasthooks.buffers import StatBuffers\n"
        "print(ops.cpu_capability())\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):\n"
        "    x = (torch.randn(1_000_003, generator=g, dtype=torch.float64) * 2 + 5).to(dtype)\n"
        "    for y in (x, x.clamp(min=3)):\n"
        f"        for bins in {CAPABILITY_BINS}:\n"
        "            b = StatBuffers(1, 1, 'cpu', full=True, hist_bins=bins)\n"
        "            ops.accumulate_stats(y, *b.op_args(), 0, 4.5, 1.0, 9.0)\n"
        "            print(*b.state[:, 0, 0].tolist(), *b.hist[0, 0].tolist())\n"
    )
    env = subprocess_env(FASTHOOKS_CPU_CAPABILITY=capability)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    lines = out.stdout.splitlines()
    if lines[0] != capability:  # the variable is a ceiling: a CPU without these instructions
        assert capability != "default"
        pytest.skip(f"this CPU lacks {capability} (the kernels run as {lines[0]})")
    g = torch.Generator().manual_seed(0)
    cases = []
    for dtype in DTYPES:
        x = (torch.randn(1_000_003, generator=g, dtype=torch.float64) * 2 + 5).to(dtype)
        # Clamped: a sixth of the values share one bin, often in every lane of a vector.
        cases += [(y, bins) for y in (x, x.clamp(min=3)) for bins in CAPABILITY_BINS]
    for (x, bins), line in zip(cases, lines[1:], strict=True):
        b = StatBuffers(1, 1, "cpu", full=True, hist_bins=bins)
        accumulate_stats_python(x, *b.op_args(), 0, 4.5, 1.0, 9.0)
        values = [float(v) for v in line.split()]
        got, want = torch.tensor(values[:9], dtype=torch.float64), b.state[:, 0, 0]
        # m3 of symmetric data is a near-cancellation: measure its error on the scale n * std^3.
        m3_scale = want[2] ** 1.5 / want[0] ** 0.5
        assert abs(got[3] - want[3]) <= 1e-7 * m3_scale
        got[3] = want[3]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert values[9:] == b.hist[0, 0].tolist()


def test_unknown_capability_is_refused():
    env = subprocess_env(FASTHOOKS_CPU_CAPABILITY="avx9000")
    out = subprocess.run(
        [sys.executable, "-c", "import fasthooks.ops as ops; ops.cpu_capability()"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert (
        "FASTHOOKS_CPU_CAPABILITY must be 'default', 'avx2', 'avx512' or 'avx512_gfni', "
        "got 'avx9000'" in out.stderr
    )


def test_argument_errors_name_the_argument():
    x = torch.randn(10)
    basic, full = _buffers(modules=2, capacity=4), _buffers(full=True, bins=3, capacity=4)

    def call(b=basic, lo=0.0, hi=1.0, **replaced):
        """The operator on x and b's buffers at slot 0, with the named arguments replaced."""
        args = AccumulateArgs(x, *b.op_args(), 0, 0.05, lo, hi)._replace(**replaced)
        ops.accumulate_stats(*args)

    refused = [
        ({"x": torch.arange(4)}, "x must be float32, float64, float16 or bfloat16, got Long"),
        ({"state": basic.state.float()}, r"state must be a contiguous float64 tensor .* got Float"),
        (
            {"state": basic.state[:2]},
            r"state must be .* of shape \(3 or 9, modules, batches\), got Double of shape "
            r"\[2, 2, 4\]",
        ),
        ({"stats": basic.stats[:, :, :2]}, r"stats must be a contiguous Float tensor of shape"),
        (
            {"state": full.state, "stats": full.stats, "hist": full.hist},
            r"extra must be a contiguous Float tensor of shape \[4",
        ),
        ({"extra": full.extra}, r"extra must be empty with a 3-plane state"),
        (
            {"b": full, "hist": full.hist.int()},
            r"hist must be a contiguous Long tensor of shape",
        ),
        ({"b": full, "lo": 1.0, "hi": 1.0}, "hist_min and hist_max must be finite"),
        ({"b": full, "lo": 1e6, "hi": 1e6 + 1e-3}, r"3 bins over \[1e\+06, 1e\+06\] are narrower"),
        ({"cursor": basic.cursor.int()}, "cursor must be a one-element int64 tensor, got Int"),
        (
            {"order": basic.order[:, :1]},
            r"order must be a contiguous Long tensor of shape \[2, 2, 4\]",
        ),
        ({"clock": torch.zeros(2, dtype=torch.long)}, "clock must be a one-element int64 tensor"),
        ({"clock": basic.clock.to("meta")}, "clock must be on the state's device cpu, got meta"),
        ({"stats": basic.stats.to("meta")}, "stats must be on the state's device cpu, got meta"),
        (
            {"binades": torch.zeros(2, 4, 257, dtype=torch.int32)},
            r"binades must be a contiguous Int tensor of shape \[2, 4, 258\]",
        ),
        (
            {"binades": torch.zeros(2, 4, 258).long()},
            r"binades must be a contiguous Int tensor of shape \[2, 4, 258\]",
        ),
        (
            {"top": torch.zeros(2, 4, 17, 2, dtype=torch.float64)},
            r"top must .*shape \(modules, batches, k, 2\)",
        ),
        (
            {"top": torch.zeros(2, 4, 3, 2)},
            r"top must be a contiguous Double tensor of shape \[2, 4, 3, 2\]",
        ),
        (
            {
                "top": torch.full((2, 4, 3, 2), float("nan"), dtype=torch.float64),
                "channel_offset": -1,
            },
            "channel_offset must be at least 0, got -1",
        ),
        (
            {"channels": torch.zeros(5, 9, dtype=torch.float64), "channel_dim": 1},
            r"channel_dim must be in \[-1, 1\) for x of shape \[10\], got 1",
        ),
        (
            {"channels": torch.zeros(4, 10, dtype=torch.float64)},
            r"channels must be a contiguous Double tensor of shape \[5, 10\]",
        ),
        (
            {"channels": torch.zeros(2, 5, 10, dtype=torch.float64)},
            r"channels must have shape \(5, channels\)",
        ),
        (
            {"channels": torch.zeros(5, 11, dtype=torch.float64), "channel_offset": 2},
            r"channels has room for 11 channels, x of shape \[10\] has 10 along channel_dim -1 "
            r"from channel_region 0 \+ channel_offset 2",
        ),
        (
            {"channels": torch.zeros(5, 11, dtype=torch.float64), "channel_region": 3},
            r"channels has room for 11 channels, x of shape \[10\] has 10 along channel_dim -1 "
            r"from channel_region 3 \+ channel_offset 0",
        ),
        (
            {"channels": torch.zeros(5, 11, dtype=torch.float64), "channel_region": -1},
            "channel_region must be at least 0, got -1",
        ),
        ({"channels": torch.zeros(5, 10)}, r"channels must be a contiguous Double tensor"),
        ({"slot": 2}, r"slot must be in \[0, 2\), got 2"),
        ({"cursor": torch.tensor(4)}, r"cursor must be in \[0, 4\), got 4"),
    ]
    for replaced, message in refused:
        with pytest.raises(RuntimeError, match=message):
            call(**replaced)
    assert (basic.state == 0).all() and (full.state == 0).all() and (full.hist == 0).all()
    assert (basic.order == 0).all() and (full.order == 0).all()


def _opcheck_cases():
    for layout in _layouts("cpu"):
        for dtype in DTYPES:
            for full, bins, binades in (
                (False, 0, False),
                (True, 0, False),
                (False, 5, False),
                (True, 5, False),
                (True, 0, True),
            ):
                yield layout, dtype, full, bins, binades


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("layout", "dtype", "full", "bins", "binades"), list(_opcheck_cases()))
def test_opcheck(layout, dtype, full, bins, binades, device):
    x = _layouts(device)[layout].to(dtype)
    b = _buffers(device, full, bins, binades=binades)
    b.cursor.fill_(1)
    accumulate_stats_python(torch.randn(5, device=device), *b.op_args(), 0, 0.05, -1.0, 4.0)
    torch.library.opcheck(
        torch.ops.fasthooks.accumulate_stats.default, (x, *b.op_args(), 0, 0.05, -1.0, 4.0)
    )


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_callable_from_torchscript():
    @torch.jit.script
    def record(
        x: torch.Tensor,
        state: torch.Tensor,
        stats: torch.Tensor,
        extra: torch.Tensor,
        hist: torch.Tensor,
        binades: torch.Tensor,
        top: torch.Tensor,
        channels: torch.Tensor,
        workspace: torch.Tensor,
        order: torch.Tensor,
        clock: torch.Tensor,
        cursor: torch.Tensor,
    ) -> None:
        torch.ops.fasthooks.accumulate_stats(
            x,
            state,
            stats,
            extra,
            hist,
            binades,
            top,
            channels,
            workspace,
            order,
            clock,
            cursor,
            0,
            0.05,
            0.0,
            10.0,
        )

    x, b = torch.randn(1000) + 4, _buffers(modules=1, capacity=2)
    b.cursor.fill_(1)
    record(x, *b.op_args())
    count, mean, m2 = b.state[:, 0, 1].tolist()
    assert count == 1000
    _assert_within_bounds(mean, math.sqrt(m2 / 999), *reference_moments(x))


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("full", "bins"), [(False, 0), (True, 40)])
@pytest.mark.parametrize("backend", KERNELS)
def test_fused_matches_the_python_reference(dtype, device, full, bins, backend):
    g = torch.Generator().manual_seed(11)
    calls = [torch.randn(4, 16, 9, 9, generator=g) * 3 + 1, torch.randn(70_001, generator=g).relu()]
    results = {}
    for name in (backend, "python"):
        b = _buffers(device, full, bins, capacity=2)
        for column, x in enumerate(calls):
            b.cursor.fill_(column)
            for scale in (1, 2):
                ACCUMULATORS[name](x.to(dtype).to(device) * scale, *b.op_args(), 1, 0.5, 0.0, 4.0)
        results[name] = [t.cpu().clone() for t in b.op_args()[:4]]
    assert_buffers_close(results[backend], results["python"])


EXTREMES = {
    "float32 near its maximum": lambda g: (torch.rand(100_000, generator=g) * 2 - 1) * 3e38,
    "float32 at its maximum": lambda g: torch.full((70_000,), 3.3e38),
    "float16 near 65504": lambda g: (torch.rand(70_000, generator=g) * 2 - 1).mul(65000).half(),
}


@pytest.mark.isa
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("full", [False, True], ids=["mean_std", "every_stat"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", EXTREMES)
def test_values_near_the_largest_finite_stay_finite(backend, case, full, device):
    x = EXTREMES[case](torch.Generator().manual_seed(8))
    count, mean, std = _moments(x.to(device), backend, full=full)
    ref_mean, ref_std = reference_moments(x)
    assert count == x.numel() and math.isfinite(mean) and math.isfinite(std)
    _assert_within_bounds(mean, std, ref_mean, ref_std, rel_std=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fused", "python"])
def test_hundred_million_elements(backend):
    x = torch.randn(100_000_000, generator=torch.Generator().manual_seed(9)) + 3
    count, mean, std = _moments(x, backend)
    assert count == x.numel()
    _assert_within_bounds(mean, std, *reference_moments(x), rel_std=1e-6)


@FUSED
def test_the_python_declaration_of_the_arguments_is_the_schemas():
    schema = torch.ops.fasthooks.accumulate_stats.default._schema
    assert [a.name for a in schema.arguments] == list(AccumulateArgs._fields)
    defaults = {
        "near_zero": 0.05,
        "hist_min": 0.0,
        "hist_max": 10.0,
        "channel_dim": -1,
        "channel_offset": 0,
        "channel_region": 0,
    }
    assert AccumulateArgs._field_defaults == defaults
    assert [a.default_value for a in schema.arguments[-3:]] == [-1, 0, 0]


@FUSED
@CUDA_ON_CPU
def test_the_harness_registers_the_same_schemas():
    cuda_on_cpu.library()
    for name in ("accumulate_stats", "accumulate_stats_list"):
        ours = getattr(torch.ops.fasthooks_cuda_on_cpu, name).default._schema
        theirs = getattr(torch.ops.fasthooks, name).default._schema
        assert [(a.name, str(a.type)) for a in ours.arguments] == [
            (a.name, str(a.type)) for a in theirs.arguments
        ]
