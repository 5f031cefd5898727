"""The "binades" extra (counts by power-of-two exponent) on every backend, and format_fit checked
against casting the values with torch's own low-precision dtypes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import BACKENDS, FUSED
from torch import nn

from fasthooks import FORMATS, ActivationStats, format_fit, load
from fasthooks.buffers import StatBuffers
from fasthooks.export import newest_metrics
from fasthooks.layout import BINADE_BINS, BINADE_MAX, BINADE_MIN, BINADE_NAMES
from fasthooks.moments import accumulate_stats_python, binade_counts
from fasthooks.ops import accumulate_stats

ACCUMULATORS = {
    "python": accumulate_stats_python,
    "fused": pytest.param(accumulate_stats, marks=FUSED),
}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
CAST_DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def reference_binades(x: torch.Tensor) -> list[int]:
    """Counts by the definition, value by value through numpy's frexp of the float64 value."""
    v = x.detach().double().reshape(-1).numpy()
    counts = [0] * BINADE_BINS
    finite = np.isfinite(v)
    counts[-1] = int((~finite).sum())
    v = np.abs(v[finite])
    counts[0] = int((v == 0).sum())
    _, exponent = np.frexp(v[v != 0])
    for e, n in zip(*np.unique(exponent - 1, return_counts=True), strict=True):
        if e < BINADE_MIN:
            counts[1] += int(n)
        elif e > BINADE_MAX:
            counts[-2] += int(n)
        else:
            counts[BINADE_NAMES.index(f"2^{e}")] += int(n)
    return counts


def wide_values(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values of every sign and of exponents across the dtype's whole range (its subnormals too),
    with zeros, infinities and NaN."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    low = math.log2(info.smallest_normal) + math.log2(info.eps)  # the smallest subnormal
    high = math.log2(info.max)
    exponents = torch.rand(n, generator=g, dtype=torch.float64) * (high - low) + low
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    x = (signs * torch.exp2(exponents)).to(dtype)
    if n >= 8:
        x[::5] = 0.0
        x[1], x[2], x[3] = float("inf"), float("-inf"), float("nan")
    return x


def recorded_binades(accumulate, x: torch.Tensor, calls: int = 1) -> torch.Tensor:
    b = StatBuffers(2, 3, "cpu", full=True, hist_bins=4, binades=True)
    b.cursor.fill_(1)
    for _ in range(calls):
        accumulate(x, *b.op_args(), 1, 0.05, -1.0, 1.0)
    untouched = b.binades.clone()
    untouched[1, 1] = 0
    assert (untouched == 0).all()  # only the slot's row is written
    return b.binades[1, 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, pytest.param(1000, marks=pytest.mark.isa), 300_000])
@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=ACCUMULATORS.keys())
def test_binades_count_every_value_by_its_exponent(accumulate, n, dtype):
    x = wide_values(n, dtype)
    got = recorded_binades(accumulate, x)
    assert got.dtype == torch.int32
    assert got.tolist() == reference_binades(x)


@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=ACCUMULATORS.keys())
def test_binades_of_float64_values_beyond_float32s_range(accumulate):
    x = torch.tensor(
        [1e-300, -1e-40, 2.0**-126, 2.0**127, 3e38, 1e300, 5e-324], dtype=torch.float64
    )
    counts = recorded_binades(accumulate, x).tolist()
    assert counts == reference_binades(x)
    named = {BINADE_NAMES[k]: c for k, c in enumerate(counts) if c}
    assert named == {"below": 3, "2^-126": 1, "2^127": 2, "above": 1}


@pytest.mark.parametrize("accumulate", ACCUMULATORS.values(), ids=ACCUMULATORS.keys())
@pytest.mark.parametrize(
    "layout",
    ["offset", "channels_last", "transposed"],
)
def test_binades_of_any_layout_and_two_calls_adding_up(accumulate, layout):
    x = wide_values(2 * 3 * 17 * 19 + 1, torch.bfloat16, seed=3)
    if layout == "offset":
        x = x[1:]
    else:
        x = x[1:].reshape(2, 3, 17, 19)
        x = x.to(memory_format=torch.channels_last) if layout == "channels_last" else x.mT
    twice = [2 * c for c in reference_binades(x)]
    assert recorded_binades(accumulate, x, calls=2).tolist() == twice


@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_stats_binades_of_each_module_and_batch(backend):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    act = ActivationStats(model, backend=backend, extra=["binades", "max"], expected_batches=2)
    inputs = [torch.randn(2, 3, 8, 8) * 10.0 ** (b - 1) for b in range(3)]
    with torch.no_grad():
        outputs = [[model[0](x), model(x)] for x in inputs]
    with act:
        for x in inputs:  # past expected_batches: growth keeps the counts
            model(x)
            act.on_batch_end()
    assert act.binades.shape == (2, 3, BINADE_BINS) and act.binades.dtype == torch.int32
    assert set(act.extra) == {"max"}
    for b, (first, last) in enumerate(outputs):
        assert act.binades[0, b].tolist() == reference_binades(first)
        assert act.binades[1, b].tolist() == reference_binades(last)
    assert "binades" in repr(act)


def test_binades_are_not_kept_unless_asked_for():
    b = StatBuffers(2, 3, "cpu", full=True, hist_bins=0)
    assert b.binades.shape == (0,)
    act = ActivationStats(nn.Linear(2, 2), backend="python", extra=["max"])
    with pytest.raises(AttributeError, match="binades are recorded only with extra"):
        _ = act.binades
    with pytest.raises(AttributeError, match="binades are recorded only with extra"):
        act.format_fit("fp8_e4m3")


# format_fit --------------------------------------------------------------------------------------


def log_uniform(n: int, low: float, high: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    exponents = torch.rand(n, generator=g, dtype=torch.float64) * (high - low) + low
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    return (signs * torch.exp2(exponents)).float()


def fraction(mask: torch.Tensor) -> float:
    return float(mask.double().mean())


@pytest.mark.parametrize("fmt", list(CAST_DTYPES))
@pytest.mark.parametrize("scaling", ["none", "amax", 3, -2])
def test_format_fit_agrees_with_casting(fmt, scaling):
    spec = FORMATS[fmt]
    # float32 values: none below float32's normal range, whose one bin format_fit cannot split
    # at bf16's smallest subnormal (the module's docstring says so), nor past its largest.
    low = max(spec.min_subnormal_exponent - 6, BINADE_MIN)
    x = log_uniform(20_000, low, min(spec.max_exponent + 3, BINADE_MAX + 0.9))
    x[:50] = 0.0
    fit = format_fit(binade_counts(x), x.abs().amax(), fmt, scaling)
    k = int(fit.scale_exponent)
    if scaling == "amax":
        assert x.abs().amax() * 2.0**k <= spec.max_value < x.abs().amax() * 2.0 ** (k + 1)
    else:
        assert k == (0 if scaling == "none" else scaling)
    scaled = x.double() * 2.0**k
    magnitude = scaled.abs()
    cast = scaled.to(CAST_DTYPES[fmt]).double()
    smallest, normal = 2.0**spec.min_subnormal_exponent, 2.0**spec.min_normal_exponent
    nonzero = magnitude > 0
    # What each fraction counts, exactly.
    assert float(fit.underflow) == pytest.approx(fraction(nonzero & (magnitude < smallest)))
    assert float(fit.subnormal) == pytest.approx(
        fraction((magnitude >= smallest) & (magnitude < normal))
    )
    # And what a cast does: zeros at least below half the smallest subnormal, at most below it.
    flushed = fraction(nonzero & (cast == 0))
    assert fraction(nonzero & (magnitude < smallest / 2)) <= flushed <= float(fit.underflow)
    # Past the largest value a cast gives it (float8_e4m3fn saturates) or an infinity.
    overflowed = fraction((magnitude > spec.max_value) & (cast.abs() >= spec.max_value))
    assert fraction(magnitude >= 2.0 ** (spec.max_exponent + 1)) <= overflowed
    assert overflowed <= float(fit.saturate)
    if scaling == "amax":
        assert float(fit.saturate) == 0.0 and overflowed == 0.0
    lowest = int(torch.floor(torch.log2(magnitude[nonzero])).min())
    highest = int(torch.floor(torch.log2(magnitude.max())))
    assert int(fit.dynamic_range) == highest - lowest + 1


def test_format_fit_saturation_bound_of_the_top_binade():
    def saturate(values: list[float]) -> float:
        x = torch.tensor(values)
        return float(format_fit(binade_counts(x), x.abs().amax(), "fp8_e4m3", "none").saturate)

    # Exact where fp8_e4m3's top binade [256, 512) holds nothing, or nothing at most 448.
    assert saturate([1.0, 100.0, 1000.0, 5000.0]) == pytest.approx(2 / 4)
    assert saturate([1.0, 460.0, 1000.0]) == pytest.approx(2 / 3)
    assert saturate([1.0, 300.0, 440.0]) == 0.0
    # Else the whole top binade counts once the largest value is past 448: an upper bound.
    assert saturate([1.0, 300.0, 1000.0]) == pytest.approx(2 / 3)


def test_format_fit_of_empty_slots_and_bad_arguments():
    counts = torch.zeros(2, 3, BINADE_BINS, dtype=torch.int32)
    fit = format_fit(counts, torch.full((2, 3), float("nan")), "bf16")
    assert fit.underflow.shape == (2, 3) and fit.underflow.isnan().all()
    assert fit.dynamic_range.isnan().all() and (fit.scale_exponent == 0).all()
    with pytest.raises(ValueError, match="fmt: unknown format 'fp4'"):
        format_fit(counts, torch.zeros(2, 3), "fp4")
    with pytest.raises(ValueError, match="scaling must be 'none', 'amax' or an int, got 'max'"):
        format_fit(counts, torch.zeros(2, 3), "bf16", scaling="max")
    with pytest.raises(TypeError, match="scaling must be 'none', 'amax' or an int, got float"):
        format_fit(counts, torch.zeros(2, 3), "bf16", scaling=1.5)


# Reading: the table, the summary, pictures, checkpoints and sinks ---------------------------------


def _tiny_values_model() -> nn.Module:
    """A linear layer whose outputs span 40 binades: most of them underflow fp8_e4m3 even
    amax-scaled (it spans 18)."""
    layer = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.diag(torch.exp2(-torch.linspace(0, 40, 64))))
    return nn.Sequential(layer, nn.Linear(64, 8))


def _record(act: ActivationStats, model: nn.Module, batches: int = 4) -> None:
    with act:
        for _ in range(batches):
            model(torch.randn(16, 64))
            act.on_batch_end()


@pytest.mark.parametrize("backend", BACKENDS)
def test_summary_table_and_pictures_show_the_fp8_fit(backend, tmp_path):
    model = _tiny_values_model()
    act = ActivationStats(model, backend=backend, extra=["binades"])
    _record(act, model)
    summary = act.summary()
    assert [(f.module, f.kind) for f in summary] == [("0", "would underflow in fp8")]
    fit = act.format_fit("fp8_e4m3")
    assert f"{float(fit.underflow[0].median()):.1%}" in summary[0].detail
    table = act.to_dataframe()
    rows = table[(table.module == "0") & (table.stat == "fp8_e4m3_underflow")]
    assert rows.value.tolist() == pytest.approx(fit.underflow[0].tolist())
    assert set(table.stat) >= {"dynamic_range", "fp8_e5m2_underflow"}
    metrics = newest_metrics(act)  # what log_to_tensorboard and the framework callbacks log
    assert metrics["activations/0/fp8_e4m3_underflow"] == pytest.approx(float(fit.underflow[0, -1]))
    figure = act.plot(tmp_path / "overview.png")
    titles = [ax.get_title() for ax in figure.axes]
    assert "fp8_e4m3_underflow" in titles
    assert (tmp_path / "overview.png").stat().st_size > 0


def test_checkpoints_and_sinks_keep_the_binades(tmp_path):
    model = _tiny_values_model()
    whole = ActivationStats(model, backend="python", extra=["binades"], window=2, sink=tmp_path)
    _record(whole, model, batches=5)
    recording = load(tmp_path)
    assert recording.binades.shape == (2, 5, BINADE_BINS)
    assert torch.equal(recording.binades[:, -2:], whole.binades)
    torch.testing.assert_close(
        recording.format_fit("fp8_e5m2").underflow[:, -2:], whole.format_fit("fp8_e5m2").underflow
    )
    resumed = ActivationStats(model, backend="python", extra=["binades"], window=2)
    resumed.load_state_dict(whole.state_dict())
    _record(resumed, model, batches=1)
    assert torch.equal(resumed.binades[:, 0], whole.binades[:, 1])
    assert resumed.binades[:, 1].sum(-1).tolist() == [16 * 64, 16 * 8]


def test_parameter_stats_refuses_binades_by_name():
    from fasthooks import ParameterStats

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="extra: unknown statistic 'binades'; valid ones are"):
        ParameterStats(model, opt, backend="python", extra=["binades"])


def test_gradient_binades_and_their_fp8_finding():
    model = _tiny_values_model()
    act = ActivationStats(model, backend="python", extra=["binades"], is_forward=False)
    grads = []

    def keep_gradient(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        output.register_hook(lambda g: grads.append(g.clone()))

    model[0].register_forward_hook(keep_gradient)
    with act:
        for _ in range(3):
            (model(torch.randn(16, 64)) * 1e-6).sum().backward()
            act.on_batch_end()
    assert [act.binades[0, b].tolist() for b in range(3)] == [reference_binades(g) for g in grads]
    kinds = {f.module: f.kind for f in act.summary()}
    underflow = act.format_fit("fp8_e5m2").underflow[0]
    assert (kinds.get("0") == "would underflow in fp8") == bool(underflow.median() >= 0.01)
