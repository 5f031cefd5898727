"""window=N keeps memory flat; sink= sends every column out first; fasthooks.load reads it back
equal, bit for bit, to a run that kept every batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import BACKENDS, DEVICES
from torch import nn

from fasthooks import ActivationStats, ParameterStats, SinkChunk, load

pytest.importorskip("pyarrow")

EVERY_EXTRA = ["min", "max", "near_zero", "nonfinite", "kurtosis", "norm", "absmax"]
OPTIONS = {"extra": EVERY_EXTRA, "hist_bins": 7, "hist_range": (-1.0, 1.0)}


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)


def _inputs(n: int, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 4, generator=g).to(device) for _ in range(n)]
    xs[n // 2][0, 0] = float("nan")  # one non-finite batch for first_nonfinite
    return xs


def _record(model: nn.Module, xs: list[torch.Tensor], **options) -> ActivationStats:
    act = ActivationStats(model, **options)
    with act:
        for x in xs:
            model(x)
            act.on_batch_end()
    return act


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN where NaN."""
    return a.shape == b.shape and torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, 4, 9])
def test_window_holds_the_newest_batches_in_buffers_allocated_once(backend, window, device):
    model, xs = _model(device), _inputs(23, device)
    every = _record(model, xs, backend=backend, **OPTIONS)
    act = ActivationStats(model, backend=backend, window=window, **OPTIONS)
    with act:
        buffers = act._buffers
        pointers = [t.data_ptr() for t in (buffers.state, buffers.stats, buffers.hist)]
        for x in xs:
            model(x)
            act.on_batch_end()
        assert act._buffers is buffers
        assert [t.data_ptr() for t in (buffers.state, buffers.stats, buffers.hist)] == pointers
        assert buffers.capacity == window + 1
    held = min(window, len(xs))
    assert act.num_batches == len(xs)
    assert act.batches.tolist() == list(range(len(xs) - held, len(xs)))
    assert _same(act.stats, every.stats[:, :, -held:])
    for name in EVERY_EXTRA:
        assert _same(act.extra[name], every.extra[name][:, -held:]), name
    assert torch.equal(act.hist, every.hist[:, -held:])
    assert _same(act.layer_stats("2")["std"], every.layer_stats("2")["std"][-held:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("every", [1, 3])
def test_a_sink_folder_loads_equal_to_a_run_that_kept_every_batch(backend, every, tmp_path):
    model, xs = _model(), _inputs(31)
    kept = _record(model, xs, backend=backend, every=every, **OPTIONS)
    act = _record(model, xs, backend=backend, every=every, window=4, sink=tmp_path, **OPTIONS)
    loaded = load(tmp_path)
    assert loaded.num_batches == kept.num_batches == act.num_batches
    assert torch.equal(loaded.batches, kept.batches)
    assert _same(loaded.stats, kept.stats)
    for name in EVERY_EXTRA:
        assert _same(loaded.extra[name], kept.extra[name]), name
    assert torch.equal(loaded.hist, kept.hist)
    # The call clock is shared by every run on a device: compare which calls it noted.
    assert torch.equal(loaded.call_order[0] > 0, kept.call_order[0] > 0)
    assert torch.equal(loaded.call_order[1], kept.call_order[1])
    assert loaded.first_nonfinite() == kept.first_nonfinite() is not None
    assert str(loaded.summary()) == str(kept.summary())
    assert loaded.module_names == kept.module_names
    assert loaded.to_dataframe().equals(kept.to_dataframe())


def test_the_folder_is_a_long_table_for_pandas(tmp_path):
    pd = pytest.importorskip("pandas")
    model, xs = _model(), _inputs(6)
    act = _record(model, xs, backend="python", window=2, sink=tmp_path, **OPTIONS)
    table = pd.read_parquet(tmp_path)
    assert list(table.columns) == ["batch", "name", "kind", "stat", "bin", "value"]
    assert set(table["kind"]) == {"forward"}
    means = table[(table["stat"] == "mean") & (table["name"] == "2")].sort_values("batch")
    assert means["batch"].tolist() == list(range(6))
    assert means["value"].iloc[-1] == pytest.approx(act.stats[0, 1, -1].item())
    hist = table[(table["stat"] == "hist") & (table["batch"] == 5) & (table["name"] == "0")]
    assert hist.sort_values("bin")["value"].tolist() == act.hist[0, -1].double().tolist()
    assert table.loc[table["stat"] != "hist", "bin"].isna().all()


def test_a_callable_sink_gets_every_column_once_in_order():
    chunks: list[SinkChunk] = []
    model, xs = _model(), _inputs(17)
    act = _record(model, xs, backend="python", window=5, sink=chunks.append, **OPTIONS)
    batches = torch.cat([c.batches for c in chunks])
    assert batches.tolist() == list(range(17))
    assert all(c.kind == "forward" and c.names == act.module_names for c in chunks)
    tail = chunks[-1]
    width = len(tail.batches)
    assert _same(tail.stats, act.stats[:, :, -width:])
    assert torch.equal(tail.hist, act.hist[:, -width:])
    assert _same(tail.extra["kurtosis"], act.extra["kurtosis"][:, -width:])


def test_a_failing_sink_warns_once_and_recording_goes_on():
    calls = []

    def broken(chunk: SinkChunk) -> None:
        calls.append(chunk)
        raise OSError("no space left on device")

    model, xs = _model(), _inputs(12)
    with pytest.warns(RuntimeWarning, match="no space left on device") as caught:
        act = _record(model, xs, backend="python", window=2, sink=broken)
    assert sum("sink" in str(w.message) for w in caught) == 1
    assert len(calls) > 1  # later columns are still offered
    assert act.num_batches == 12 and act.stats.shape == (2, 2, 2)


def test_a_vanished_folder_warns_and_recording_goes_on(tmp_path):
    folder = tmp_path / "sink"
    model, xs = _model(), _inputs(12)
    act = ActivationStats(model, backend="python", window=2, sink=folder)
    with pytest.warns(RuntimeWarning, match="sink"), act:
        for i, x in enumerate(xs):
            if i == 4:
                act.flush()
                for f in folder.iterdir():
                    f.unlink()
                folder.rmdir()
            model(x)
            act.on_batch_end()
    assert act.num_batches == 12 and act.batches.tolist() == [10, 11]


@pytest.mark.parametrize("window", [None, 3])
def test_a_resumed_run_continues_the_sink_without_gaps_or_repeats(window, tmp_path):
    model, xs = _model(), _inputs(20)
    kept = _record(model, xs, backend="python", **OPTIONS)
    first = ActivationStats(model, backend="python", window=window, sink=tmp_path, **OPTIONS)
    with first:
        for x in xs[:9]:
            model(x)
            first.on_batch_end()
        saved = first.state_dict()
        for x in xs[9:13]:  # recorded after the checkpoint, then lost with the process
            model(x)
            first.on_batch_end()
    second = ActivationStats(model, backend="python", window=window, sink=tmp_path, **OPTIONS)
    second.load_state_dict(saved)
    with second:
        for x in xs[9:]:
            model(x)
            second.on_batch_end()
    loaded = load(tmp_path)
    assert loaded.batches.tolist() == list(range(20))
    assert _same(loaded.stats, kept.stats)
    pd = pytest.importorskip("pandas")
    means = pd.read_parquet(tmp_path).query("stat == 'mean'")
    assert not means.duplicated(["batch", "name"]).any()  # no batch written twice
    assert len(means) == 20 * len(kept.module_names)
    assert torch.equal(loaded.hist, kept.hist)
    held = min(window or 20, 20)
    assert _same(second.stats, kept.stats[:, :, -held:])


def test_parameter_stats_window_and_sink(tmp_path):
    def run(**options) -> ParameterStats:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ps = ParameterStats(model, opt, hist_bins=5, extra=["kurtosis"], **options)
        g = torch.Generator().manual_seed(2)
        with ps:
            for _ in range(13):
                model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        return ps

    kept, ps = run(), run(window=3, sink=tmp_path)
    assert all(b.capacity == 4 for b in ps._store.buffers.values())  # allocated once
    assert ps.num_steps == 13 and ps.steps.tolist() == [10, 11, 12]
    assert _same(ps.stats["grad"], kept.stats["grad"][:, :, -3:])
    assert _same(ps.update_ratio, kept.update_ratio[:, -3:])
    with pytest.raises(ValueError, match="pick one with kind="):
        load(tmp_path)
    for kind in ps.kinds:
        loaded = load(tmp_path, kind=kind)
        assert loaded.module_names == ps.param_names
        assert _same(loaded.stats, kept.stats[kind])
        assert torch.equal(loaded.hist, kept.hist[kind])
        for name, values in kept.extra[kind].items():
            assert _same(loaded.extra[name], values), (kind, name)


def test_arguments_are_checked():
    model = _model()
    with pytest.raises(ValueError, match="window must be an int >= 1, got 0"):
        ActivationStats(model, window=0)
    with pytest.raises(TypeError, match="window must be an int, got float"):
        ActivationStats(model, window=2.5)
    with pytest.raises(TypeError, match="sink must be None, a folder path or a callable"):
        ActivationStats(model, sink=3)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load("/nonexistent/fasthooks-sink")


KILLED_RUN = """
import sys, torch
from torch import nn
from fasthooks import ActivationStats
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
act = ActivationStats(model, backend="python", window=4, sink=sys.argv[1], hist_bins=4)
with act:
    for step in range(10**9):
        model(torch.randn(16, 4))
        act.on_batch_end()
        print(step, flush=True)  # closed
"""


def test_a_killed_process_leaves_a_sink_that_loads(tmp_path):
    folder = tmp_path / "sink"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_RUN), str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        bufsize=1,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(folder.glob("*.parquet"))) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    closed = int(child.stdout.read().split()[-1]) + 1  # batches closed before the kill
    loaded = load(folder)
    n = loaded.num_batches
    assert n >= 40
    assert loaded.batches.tolist() == list(range(n))  # every batch up to the last file
    window, chunk = 4, 2
    assert n >= closed - window - chunk - 1  # at most the window and one chunk (and one racing)
    assert not loaded.stats.isnan().any()  # no partial file: every loaded column is whole


READING_API = (
    "stats",
    "extra",
    "hist",
    "batches",
    "num_batches",
    "module_names",
    "module_types",
    "call_order",
    "metric_prefix",
)


def test_every_recording_has_the_same_reading_api(tmp_path):
    pytest.importorskip("pandas")
    try:
        import matplotlib  # noqa: F401

        plotting = True
    except ImportError:
        plotting = False
    model, xs = _model(), _inputs(6)
    act = _record(model, xs, backend="python", window=4, sink=tmp_path / "act", **OPTIONS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ps = ParameterStats(model, opt, hist_bins=7, window=4, sink=tmp_path / "ps")
    with ps:
        for x in xs:
            model(x).nan_to_num().sum().backward()
            opt.step()
            opt.zero_grad()
    readings = {
        "act": act,
        "ps": ps["grad"],
        "loaded act": load(tmp_path / "act"),
        "loaded ps": load(tmp_path / "ps", kind="grad"),
    }
    for name, reading in readings.items():
        for attribute in READING_API:
            assert getattr(reading, attribute) is not None, (name, attribute)
        rows = len(reading.module_names)
        held = len(reading.batches)
        assert reading.stats.shape == (2, rows, held), name
        assert reading.hist.shape == (rows, held, 7), name
        assert set(reading.layer_stats(0)) >= {"mean", "std"}, name
        assert len(reading.to_dataframe()) > 0, name
        assert reading.summary() is not None, name
        reading.first_nonfinite()
        if plotting:
            for figure in (reading.plot(), reading.plot_layer_stats(0), reading.color_dim(0)):
                assert figure.axes, name
    assert readings["ps"].metric_prefix == "parameters/grad"
    assert readings["loaded ps"].metric_prefix == "parameters/grad"
    assert _same(readings["loaded ps"].stats[:, :, -4:], readings["ps"].stats)
    assert readings["act"].first_nonfinite() == readings["loaded act"].first_nonfinite()


def test_newest_metrics_and_tensorboard_read_the_newest_held_column():
    from fasthooks.export import newest_metrics

    model, xs = _model(), _inputs(9)
    act = _record(model, xs, backend="python", window=2, **OPTIONS)
    metrics = newest_metrics(act)
    assert metrics["activations/2/mean"] == act.stats[0, 1, -1].item()

    class Writer:
        def __init__(self):
            self.scalars, self.histograms = {}, {}

        def add_scalar(self, tag, value, step):
            self.scalars[tag] = (value, step)

        def add_histogram_raw(self, tag, global_step, **figures):
            self.histograms[tag] = (figures["num"], global_step)

    writer = Writer()
    act.log_to_tensorboard(writer)
    assert writer.scalars["activations/0/std"] == (act.stats[1, 0, -1].item(), 8)
    assert writer.histograms["activations/0/hist"] == (int(act.hist[0, -1].sum()), 8)


def test_a_state_saved_without_a_sink_resumes_into_one(tmp_path):
    model, xs = _model(), _inputs(13)
    first = _record(model, xs[:10], backend="python", window=2)
    second = ActivationStats(model, backend="python", window=2, sink=tmp_path)
    second.load_state_dict(first.state_dict())
    with second:
        for x in xs[10:]:
            model(x)
            second.on_batch_end()
    # Batches 0-7 had left the window unsent; the held ones and the new ones are in the sink.
    assert load(tmp_path).batches.tolist() == list(range(8, 13))
