"""The accumulate_moments operator: numerics, layouts, special values and operator hygiene."""

import math
import subprocess
import sys

import pytest
import torch
from conftest import DEVICES, FUSED, reference_moments, subprocess_env

from fasthooks import ops
from fasthooks.moments import accumulate_moments_python, new_state, state_to_stats

pytestmark = FUSED
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ACCUMULATORS = {"fused": ops.accumulate_moments, "python": accumulate_moments_python}


def _moments(x: torch.Tensor, backend: str = "fused", calls: int = 1):
    """(count, mean, unbiased std) in float64 after `calls` accumulations of x into one slot."""
    state = new_state(2, 3, x.device)
    cursor = torch.tensor(1, device=x.device)
    for _ in range(calls):
        ACCUMULATORS[backend](x, state, cursor, 1)
    count, mean, m2 = state[:, 1, 1].tolist()
    return count, mean, math.sqrt(m2 / (count - 1)) if count > 1 else math.nan


def _assert_within_bounds(got_mean, got_std, ref_mean, ref_std, rel_std=1e-5, rel_mean=1e-6):
    assert abs(got_std - ref_std) <= rel_std * ref_std, (got_std, ref_std)
    assert abs(got_mean - ref_mean) <= rel_mean * (abs(ref_mean) + ref_std), (got_mean, ref_mean)


DISTRIBUTIONS = {
    "N(0,1)": lambda n, g: torch.randn(n, generator=g),
    "N(1e3,1)": lambda n, g: torch.randn(n, generator=g) + 1e3,
    "N(0,1e-3)": lambda n, g: torch.randn(n, generator=g) * 1e-3,
    "relu": lambda n, g: torch.randn(n, generator=g).relu(),
}


@pytest.mark.parametrize("backend", ["fused", "python"])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize(
    "n", [1_000, 123_457, 5_000_000, pytest.param(50_000_000, marks=pytest.mark.slow)]
)
def test_float32_numerics_against_float64_two_pass(backend, dist, n):
    x = DISTRIBUTIONS[dist](n, torch.Generator().manual_seed(n))
    count, mean, std = _moments(x, backend)
    assert count == n
    _assert_within_bounds(mean, std, *reference_moments(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_match_reference(dtype, device):
    x = (torch.randn(300_001, dtype=torch.float64) * 3 + 7).to(dtype).to(device)
    count, mean, std = _moments(x)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", _layouts("cpu"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts_give_the_same_moments(layout, dtype, device):
    x = _layouts(device)[layout].to(dtype)
    count, mean, std = _moments(x)
    ref_mean, ref_std = reference_moments(x)
    assert count == x.numel()
    if x.numel() == 1:
        assert mean == ref_mean and math.isnan(std)
    else:
        _assert_within_bounds(mean, std, ref_mean, ref_std)


def _copies_made(x: torch.Tensor) -> list[str]:
    """Names of the copying aten ops that one accumulate call on x dispatches."""
    state, cursor = new_state(1, 1), torch.tensor(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.accumulate_moments(x, state, cursor, 0)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["fused", "python"])
def test_merging_calls_equals_concatenation(backend, device):
    g = torch.Generator().manual_seed(3)
    parts = [
        torch.randn(1000, generator=g) * 5 + 100,
        torch.randn(70_000, generator=g) * 0.1,
        torch.randn(1, generator=g),
        torch.empty(0),
        torch.randn(333_333, generator=g) - 40,
    ]
    state = new_state(1, 1, device)
    cursor = torch.tensor(0, device=device)
    for p in parts:
        ACCUMULATORS[backend](p.to(device), state, cursor, 0)
    count, mean, m2 = state[:, 0, 0].tolist()
    assert count == sum(p.numel() for p in parts)
    _assert_within_bounds(mean, math.sqrt(m2 / (count - 1)), *reference_moments(*parts))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["fused", "python"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_and_single_element(backend, dtype, device):
    state = new_state(1, 2, device)
    ACCUMULATORS[backend](
        torch.empty(0, 3, dtype=dtype, device=device), state, torch.tensor(0, device=device), 0
    )
    ACCUMULATORS[backend](
        torch.tensor([2.5], dtype=dtype, device=device), state, torch.tensor(1, device=device), 0
    )
    stats = state_to_stats(state.cpu())
    assert torch.isnan(stats[:, 0, 0]).all()
    assert stats[0, 0, 1].item() == 2.5 and math.isnan(stats[1, 0, 1].item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["fused", "python"])
@pytest.mark.parametrize(
    ("special", "expected_mean", "expected_std"),
    [
        ([math.nan], math.nan, math.nan),
        ([math.inf], math.inf, math.nan),
        ([-math.inf], -math.inf, math.nan),
        ([math.inf, -math.inf], math.nan, math.nan),
    ],
)
def test_nan_and_inf_propagate(backend, special, expected_mean, expected_std, device):
    for where in (0, 70_000, 199_998):  # first chunk, a later chunk, the very end
        x = torch.randn(200_000)
        x[where : where + len(special)] = torch.tensor(special)
        # torch.mean and torch.std, not std_mean, whose Welford mean turns inf into NaN.
        torch_mean, torch_std = x.double().mean(), x.double().std()
        _, mean, std = _moments(x.to(device), backend)
        for got, want, from_torch in (
            (mean, expected_mean, torch_mean),
            (std, expected_std, torch_std),
        ):
            assert (math.isnan(got) and math.isnan(want)) or got == want, (where, got, want)
            assert (math.isnan(got) and from_torch.isnan()) or got == from_torch.item()


def test_portable_kernels_give_the_same_numbers():
    script = (
        "import torch, fasthooks.ops as ops\n"
        "from fasthooks.moments import new_state\n"
        "print(ops.cpu_capability())\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):\n"
        "    x = (torch.randn(1_000_003, generator=g, dtype=torch.float64) * 2 + 50).to(dtype)\n"
        "    s = new_state(1, 1); ops.accumulate_moments(x, s, torch.tensor(0), 0)\n"
        "    print(*s[:, 0, 0].tolist())\n"
    )
    env = subprocess_env(FASTHOOKS_CPU_CAPABILITY="default")
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    lines = out.stdout.splitlines()
    assert lines[0] == "default"
    g = torch.Generator().manual_seed(0)
    for dtype, line in zip(DTYPES, lines[1:], strict=True):
        x = (torch.randn(1_000_003, generator=g, dtype=torch.float64) * 2 + 50).to(dtype)
        count, mean, m2 = map(float, line.split())
        assert count == x.numel()
        _assert_within_bounds(mean, math.sqrt(m2 / (count - 1)), *reference_moments(x))


def test_unknown_capability_is_refused():
    env = subprocess_env(FASTHOOKS_CPU_CAPABILITY="avx9000")
    out = subprocess.run(
        [sys.executable, "-c", "import fasthooks.ops as ops; ops.cpu_capability()"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert "FASTHOOKS_CPU_CAPABILITY must be 'default' or 'avx2', got 'avx9000'" in out.stderr


def test_argument_errors_name_the_argument():
    x, state, cursor = torch.randn(10), new_state(2, 4), torch.tensor(0)
    with pytest.raises(
        RuntimeError, match="x must be float32, float64, float16 or bfloat16, got Long"
    ):
        ops.accumulate_moments(torch.arange(4), state, cursor, 0)
    with pytest.raises(
        RuntimeError, match=r"state must be a contiguous float64 tensor .* got Float"
    ):
        ops.accumulate_moments(x, state.float(), cursor, 0)
    with pytest.raises(
        RuntimeError,
        match=r"state must be .* of shape \(3, modules, batches\), got Double of shape \[2, 2, 4\]",
    ):
        ops.accumulate_moments(x, state[:2], cursor, 0)
    with pytest.raises(RuntimeError, match="cursor must be a one-element int64 tensor, got Int"):
        ops.accumulate_moments(x, state, cursor.int(), 0)
    with pytest.raises(RuntimeError, match=r"slot must be in \[0, 2\), got 2"):
        ops.accumulate_moments(x, state, cursor, 2)
    with pytest.raises(RuntimeError, match=r"cursor must be in \[0, 4\), got 4"):
        ops.accumulate_moments(x, state, torch.tensor(4), 0)
    assert (state == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", _layouts("cpu"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(layout, dtype, device):
    x = _layouts(device)[layout].to(dtype)
    state = new_state(2, 3, device)
    accumulate_moments_python(
        torch.randn(5, device=device), state, torch.tensor(1, device=device), 0
    )
    torch.library.opcheck(
        torch.ops.fasthooks.accumulate_moments.default,
        (x, state, torch.tensor(1, device=device), 0),
    )


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_callable_from_torchscript():
    @torch.jit.script
    def record(x: torch.Tensor, state: torch.Tensor, cursor: torch.Tensor) -> None:
        torch.ops.fasthooks.accumulate_moments(x, state, cursor, 0)

    x, state = torch.randn(1000) + 4, new_state(1, 2)
    record(x, state, torch.tensor(1))
    count, mean, m2 = state[:, 0, 1].tolist()
    assert count == 1000
    _assert_within_bounds(mean, math.sqrt(m2 / 999), *reference_moments(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_matches_the_python_reference(dtype, device):
    g = torch.Generator().manual_seed(11)
    calls = [torch.randn(4, 16, 9, 9, generator=g) * 3 + 1, torch.randn(70_001, generator=g).relu()]
    states = {}
    for backend, accumulate in ACCUMULATORS.items():
        state = new_state(2, 2, device)
        for column, x in enumerate(calls):
            accumulate(x.to(dtype).to(device), state, torch.tensor(column, device=device), 1)
            accumulate(x.to(dtype).to(device) * 2, state, torch.tensor(column, device=device), 1)
        states[backend] = state.cpu()
    torch.testing.assert_close(states["fused"], states["python"], rtol=1e-6, atol=1e-9)
