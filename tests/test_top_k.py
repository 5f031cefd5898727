"""top_k: the values of largest magnitude of each module and batch and their channels, in one
order every backend keeps (fasthooks.moments.top_of), through every reader."""

import math

import pytest
import torch
from conftest import FUSED
from torch import nn

import fasthooks
from fasthooks import ActivationStats, ops
from fasthooks.buffers import StatBuffers
from fasthooks.moments import accumulate_stats_python, merged_top_pairs, top_of
from fasthooks.stats import StatisticsError

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FUSED_OK = int(fasthooks.extension_available())


def _awkward(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values with ties of both signs, zeros of both signs, NaN and infinities."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    flat = x.view(-1)
    n = flat.numel()
    flat[:: max(n // 7, 1)] = 2.5
    flat[3 :: max(n // 5, 1)] = -2.5
    flat[1 :: max(n // 3, 1)] = -0.0
    flat[2 :: max(n // 3, 1)] = 0.0
    if n > 40:
        flat[11], flat[17], flat[23] = float("nan"), float("inf"), -float("inf")
    return x


def _top(accumulate, xs, k, channel_dim):
    b = StatBuffers(1, 1, "cpu", full=True, hist_bins=0, top_k=k)
    for x in xs:
        accumulate(x, *b.op_args(), 0, channel_dim=channel_dim)
    return b.top[0, 0]


def _layouts(dtype):
    yield "nchw", _awkward((4, 6, 5, 5), dtype, 0), 1
    cl = _awkward((4, 6, 5, 5), dtype, 1).contiguous(memory_format=torch.channels_last)
    yield "channels_last", cl, 1
    yield "transposed", _awkward((9, 7), dtype, 2).t(), -1
    yield "tokens", _awkward((2, 33, 12), dtype, 3), -1
    yield "strided", _awkward((8, 10), dtype, 4)[:, ::2], 0
    yield "large", _awkward((40_000, 3), dtype, 5), -1  # two chunks, on several threads
    yield "scalar", torch.tensor(-3.0, dtype=dtype), -1


@FUSED
@pytest.mark.isa
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fused_top_is_the_python_backends_bit_for_bit(dtype):
    for name, x, dim in _layouts(dtype):
        for k in (1, 5, 16):
            calls = [x, x.flip(0)]  # a second call into the slot merges
            got = _top(ops.accumulate_stats, calls, k, dim)
            want = _top(accumulate_stats_python, calls, k, dim)
            assert torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0)), (name, k)
            assert torch.equal(got.signbit(), want.signbit()), (name, k)  # -0.0 kept as such


@pytest.mark.parametrize(
    "accumulate", [accumulate_stats_python, ops.accumulate_stats][: 1 + FUSED_OK]
)
def test_channels_count_from_the_channel_offset(accumulate):
    x = _awkward((3, 10), torch.float32, 6)
    b = StatBuffers(1, 1, "cpu", full=False, hist_bins=0, top_k=4)
    accumulate(x, *b.op_args(), 0, channel_dim=1, channel_offset=30)
    want = _top(accumulate_stats_python, [x], 4, 1)
    assert torch.equal(b.top[0, 0, :, 1], want[:, 1] + 30)
    assert torch.equal(b.top[0, 0, :, 0], want[:, 0])


def _by_sorting(values: list[float], channels: list[int], k: int) -> list[tuple[float, int]]:
    """The order top_of documents, by Python's sort."""
    pairs = [(v, c) for v, c in zip(values, channels, strict=True) if not math.isnan(v)]
    pairs.sort(key=lambda p: (-abs(p[0]), math.copysign(1.0, p[0]) < 0, p[1]))
    return pairs[:k]


@pytest.mark.parametrize("seed", range(6))
def test_top_of_takes_the_documented_order(seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-3, 4, (40,), generator=g).double() / 2  # many ties
    values[::9] = float("nan")
    values[5] = -0.0
    channels = torch.randint(0, 6, (40,), generator=g)
    for k in (1, 7, 16):
        top = top_of(values, channels, k)
        want = _by_sorting(values.tolist(), channels.tolist(), k)
        got = [(v, int(c)) for v, c in top.tolist() if not math.isnan(v)]
        assert got == want
        assert [math.copysign(1.0, v) for v, _ in got] == [math.copysign(1.0, v) for v, _ in want]


def test_merging_tops_gives_the_top_of_the_union():
    g = torch.Generator().manual_seed(3)
    values = torch.randint(-4, 5, (2, 3, 30), generator=g).double()
    channels = torch.randint(0, 4, (2, 3, 30), generator=g)
    k = 6
    parts = [
        torch.stack([top_of(values[r, c, s], channels[r, c, s], k) for c in range(3)])
        for r in range(2)
        for s in (slice(0, 13), slice(13, 30))
    ]
    merged = [merged_top_pairs(parts[2 * r], parts[2 * r + 1]) for r in range(2)]
    for r in range(2):
        for c in range(3):
            assert torch.equal(merged[r][c], top_of(values[r, c], channels[r, c], k))


def test_fewer_values_than_k_leave_empty_places():
    for accumulate in (accumulate_stats_python, *((ops.accumulate_stats,) * FUSED_OK)):
        top = _top(accumulate, [torch.tensor([1.0, float("nan"), -2.0])], 4, -1)
        assert top[:2].tolist() == [[-2.0, 2.0], [1.0, 0.0]]
        assert top[2:].isnan().all()


class _Massive(nn.Module):
    """Adds a large value at channel 7 of every sample's first token."""

    def forward(self, y):
        y = y.clone()
        y[:, 0, 7] += 5000.0
        return y


def _massive_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), _Massive(), nn.Linear(128, 4))


def test_activation_stats_reads_top_values_and_finds_a_massive_activation():
    model = _massive_model()
    with ActivationStats(model, modules=list(model), top_k=4, extra=["absmax"]) as act:
        for _ in range(3):
            model(torch.randn(8, 128, 128))
            act.on_batch_end()
    assert act.top_values.shape == act.top_channels.shape == (3, 3, 4)
    assert act.top_values.dtype == torch.float64 and act.top_channels.dtype == torch.int64
    assert (act.top_channels[1] == 7).all()  # all four largest at the massive channel
    torch.testing.assert_close(act.top_values[..., 0].abs().float(), act.extra["absmax"])
    findings = [f for f in act.summary() if f.kind == "massive activation"]
    assert findings and findings[0].module == "1"
    assert "channel 7 (3 of 3 batches)" in findings[0].detail
    planes = act.layer_stats("1")
    assert (planes["top_channel"] == 7).all() and (planes["top_to_rms"] > 100).all()
    table = act.to_dataframe()
    assert {"top_value", "top_channel", "top_to_rms"} <= set(table["stat"])


def test_a_model_without_massive_values_has_no_such_finding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    with ActivationStats(model, top_k=2) as act:
        for _ in range(3):
            model(torch.randn(16, 64))
            act.on_batch_end()
    assert not [f for f in act.summary() if f.kind == "massive activation"]


def test_channels_follow_channel_dim_by_default_by_int_and_by_name():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.Flatten(), nn.Linear(5 * 4 * 4, 6))
    x = torch.randn(2, 3, 6, 6)
    conv = model[0](x).detach()

    def channel_of_largest(t, dim):
        index = t.abs().flatten().argmax()
        return torch.unravel_index(index, t.shape)[dim % t.dim()].item()

    for channels_last in (False, True):
        inputs = x.contiguous(memory_format=torch.channels_last) if channels_last else x
        with ActivationStats(model, top_k=1) as act:
            model(inputs)
            act.on_batch_end()
        # The default: dim 1 of the 4-D output whatever its memory format, the last of the 2-D.
        assert act.top_channels[0, 0, 0] == channel_of_largest(conv, 1)
        out = model(x).detach()
        assert act.top_channels[1, 0, 0] == channel_of_largest(out, -1)
    with ActivationStats(model, top_k=1, channel_dim={"0": 3}) as act:
        model(x)
        act.on_batch_end()
    assert act.top_channels[0, 0, 0] == channel_of_largest(conv, 3)
    with ActivationStats(model, top_k=1, channel_dim=0) as act:
        model(x)
        act.on_batch_end()
    assert act.top_channels[0, 0, 0] == channel_of_largest(conv, 0)


def test_top_k_arguments_are_checked():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"top_k must be in \[0, 16\], got 17"):
        ActivationStats(model, top_k=17)
    with pytest.raises(TypeError, match="top_k must be an int, got bool"):
        ActivationStats(model, top_k=True)
    with pytest.raises(TypeError, match="channel_dim must be an int, got str"):
        ActivationStats(model, channel_dim="last")
    act = ActivationStats(model, top_k=2, channel_dim={"1": 0})
    with pytest.raises(ValueError, match=r"channel_dim names modules that are not hooked: \['1'\]"):
        act.on_train_begin()
    with pytest.raises(AttributeError, match="top_k > 0"):
        _ = ActivationStats(model).top_values
    watching = ActivationStats(model, top_k=2, channel_dim=2)
    message = r"0 \(Linear\).*channel_dim must be in \[-2, 2\)"
    with watching, pytest.raises(StatisticsError, match=message):
        model(torch.randn(3, 4))


def test_gradients_and_every_record_top_values():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    grads = []
    with ActivationStats(model, is_forward=False, top_k=3, every=2) as act:
        for _ in range(4):
            hidden = model[0](torch.randn(7, 6))
            hidden.register_hook(grads.append)
            model[2](model[1](hidden)).square().sum().backward()
            act.on_batch_end()
    assert act.num_batches == 2
    for column, grad in zip(range(2), grads[::2], strict=True):
        want = top_of(grad.reshape(-1).double(), torch.arange(5).repeat(7), 3)
        torch.testing.assert_close(act.top[0, column], want)


def test_sinks_checkpoints_and_load_keep_the_top_values(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    with ActivationStats(model, top_k=3, sink=tmp_path, window=2) as act:
        for _ in range(5):
            model(torch.randn(4, 8))
            act.on_batch_end()
    loaded = fasthooks.load(tmp_path)
    assert loaded.top_k == 3 and loaded.top.shape == (2, 5, 3, 2)
    assert torch.equal(loaded.top[:, -2:].nan_to_num(), act.top.nan_to_num())
    assert torch.equal(loaded.top_channels[:, -2:], act.top_channels)
    resumed = ActivationStats(model, top_k=3, window=2)
    resumed.load_state_dict(act.state_dict())
    with resumed:
        model(torch.randn(4, 8))
        resumed.on_batch_end()
    assert torch.equal(resumed.top[:, 0], act.top[:, 1])
    with pytest.raises(ValueError):
        ActivationStats(model, top_k=2, window=2).load_state_dict(act.state_dict())
