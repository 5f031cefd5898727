"""CUDA-only behaviour: no host synchronisation, CUDA graphs, torch.compile on the GPU."""

import pytest
import torch
from conftest import BACKENDS, CUDA, reference_stats
from torch import nn

from fasthooks import (
    ActivationStats,
    NonFinite,
    NonFiniteError,
    NonFiniteWarning,
    ParameterStats,
    hook_outputs,
    load,
)

pytestmark = [pytest.mark.cuda, CUDA]
EVERY_STAT = {"extra": ("min", "max", "near_zero", "nonfinite", "kurtosis"), "hist_bins": 40}
OPTIONS = {"mean_std": {}, "every_stat": EVERY_STAT}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 8, 3, stride=2),
        nn.Flatten(),
        nn.Linear(8 * 15 * 15, 10),
    ).cuda()


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_training_step_never_synchronises(backend, dtype, options):
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 3, 32, 32, device="cuda")
    act = ActivationStats(
        model, backend=backend, expected_batches=4, on_nonfinite="raise", **OPTIONS[options]
    )
    act.on_train_begin()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(6):  # past expected_batches: growing the buffer must not sync either
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            act.on_batch_end(train=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    act.on_train_end()
    assert act.stats.shape == (2, 4, 6) and not torch.isnan(act.stats).any()
    for values in act.extra.values():
        assert values.shape == (4, 6) and not values.double().isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replays_fill_successive_columns(backend):
    model = _net()
    static_x = torch.randn(16, 3, 32, 32, device="cuda")
    act = ActivationStats(model, backend=backend, expected_batches=16, **EVERY_STAT)
    act.on_train_begin()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the graph, then forgotten
            model(static_x).sum().backward()
            act.on_batch_end(train=False)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with hook_outputs(act.modules) as outputs:
        with torch.cuda.graph(graph):
            model(static_x).sum().backward()
        act.on_batch_end(train=False)  # the capture itself ran no real batch

        seen = []
        for i in range(5):
            static_x.copy_(torch.randn_like(static_x) * (i + 1) + i)
            graph.replay()
            act.on_batch_end(train=True)
            seen.append([o.clone() for o in outputs.stored])
    act.on_train_end()
    torch.testing.assert_close(act.stats.double(), reference_stats(seen), rtol=2e-5, atol=1e-6)
    for m in range(len(act.modules)):
        for b, outputs in enumerate(seen):
            o = outputs[m].float()
            assert act.extra["max"][m, b].item() == o.amax().item()
            assert act.extra["min"][m, b].item() == o.amin().item()
            assert act.extra["nonfinite"][m, b].item() == 0
            assert act.hist[m, b].sum().item() == int(((o >= 0) & (o <= 10)).sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_and_its_sink_never_synchronise(backend, tmp_path):
    pytest.importorskip("pyarrow")
    model = _net()
    xs = [torch.randn(8, 3, 32, 32, device="cuda") for _ in range(11)]
    kept = ActivationStats(model, backend=backend, **EVERY_STAT)
    with kept:
        for x in xs:
            model(x).float().pow(2).mean().backward()
            kept.on_batch_end()
    act = ActivationStats(model, backend=backend, window=3, sink=tmp_path, **EVERY_STAT)
    act.on_train_begin()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs:
            model(x).float().pow(2).mean().backward()
            act.on_batch_end()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    act.on_train_end()
    loaded = load(tmp_path)
    assert torch.equal(loaded.stats.nan_to_num(7), kept.stats.nan_to_num(7))
    assert torch.equal(loaded.hist, kept.hist)
    assert torch.equal(act.stats.nan_to_num(7), kept.stats[:, :, -3:].nan_to_num(7))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replays_go_round_the_window(backend):
    model = _net()
    static_x = torch.randn(16, 3, 32, 32, device="cuda")
    chunks = []
    act = ActivationStats(model, backend=backend, window=3, sink=chunks.append, **EVERY_STAT)
    act.on_train_begin()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_x).sum().backward()
            act.on_batch_end(train=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with hook_outputs(act.modules) as outputs:
        with torch.cuda.graph(graph):
            model(static_x).sum().backward()
        act.on_batch_end(train=False)
        seen = []
        for i in range(8):
            static_x.copy_(torch.randn_like(static_x) * (i + 1) + i)
            graph.replay()
            act.on_batch_end(train=True)
            seen.append([o.clone() for o in outputs.stored])
    act.on_train_end()
    assert act.batches.tolist() == [5, 6, 7]
    torch.testing.assert_close(act.stats.double(), reference_stats(seen[-3:]), rtol=2e-5, atol=1e-6)
    sent = torch.cat([c.stats for c in chunks], 2).double()
    torch.testing.assert_close(sent, reference_stats(seen), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_is_raised_at_most_one_batch_late(backend):
    model = _net()
    x = torch.randn(8, 3, 32, 32, device="cuda")
    act = ActivationStats(model, backend=backend, on_nonfinite="raise")
    raised_at = None
    with act:
        for step in range(6):
            if step == 2:
                with torch.no_grad():
                    model[3].weight.fill_(float("nan"))
            model(x).sum().backward()
            try:
                act.on_batch_end()
            except NonFiniteError as error:
                raised_at, report = step, error.report
                break
    assert raised_at in (2, 3)
    assert report.where == NonFinite(2, "3", "forward", None)
    assert report.frames["batch"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replays_locate_the_first_nonfinite_batch(backend):
    model = _net()
    static_x = torch.randn(16, 3, 32, 32, device="cuda")
    act = ActivationStats(
        model, backend=backend, expected_batches=8, extra=["nonfinite"], on_nonfinite="warn"
    )
    act.on_train_begin()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(static_x).sum().backward()
            act.on_batch_end(train=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(static_x).sum().backward()
    act.on_batch_end(train=False)
    with pytest.warns(NonFiniteWarning, match="training batch 3: first in module '0'"):
        for i in range(6):
            static_x.copy_(torch.randn_like(static_x) * (float("nan") if i >= 3 else 1.0))
            graph.replay()
            act.on_batch_end(train=True)
        act.on_train_end()
    assert act.first_nonfinite() == NonFinite(3, "0", "forward", 16 * 16 * 32 * 32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_cuda_model_matches_eager(backend):
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("inductor")(gm, example_inputs)

    batches = [torch.randn(8, 3, 32, 32, device="cuda") * (i + 1) for i in range(4)]
    stats = []
    for compiled in (False, True):
        model = _net()
        step = torch.compile(model, backend=counting, fullgraph=True) if compiled else model
        with ActivationStats(model, backend=backend) as act:
            for x in batches:
                step(x).sum().backward()
                act.on_batch_end(train=True)
        stats.append(act.stats)
    assert len(graphs) == 1
    torch.testing.assert_close(stats[1], stats[0], rtol=1e-4, atol=1e-5)


def test_cuda_graph_replayed_past_its_buffers_drops_calls_and_says_so():
    """Past the capacity it was captured with, a replay writes nothing and the CUDA context
    stays usable; reading says how many calls were dropped."""
    model = _net()
    static_x = torch.randn(8, 3, 32, 32, device="cuda")
    act = ActivationStats(model, backend="fused", expected_batches=2)
    act.on_train_begin()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(static_x)
        act.on_batch_end(train=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(static_x)
    act.on_batch_end(train=False)
    for _ in range(4):  # the buffers grow after two; the graph keeps the first ones
        graph.replay()
        act.on_batch_end(train=True)
    with pytest.warns(RuntimeWarning, match=r"hooked calls were not recorded.*expected_batches"):
        stats = act.stats
    act.on_train_end()
    assert not stats[:, :, :2].isnan().any()
    assert torch.ones(1, device="cuda").item() == 1.0  # the context still works


def test_hooks_on_two_streams_at_once_stay_apart():
    torch.manual_seed(0)
    first, second = _net(), _net()
    act = ActivationStats(nn.ModuleList([first, second]), backend="fused")
    x = torch.randn(64, 3, 32, 32, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    act.on_train_begin()
    for _ in range(3):
        for stream, net in zip(streams, (first, second), strict=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                net(x)
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        act.on_batch_end()
    act.on_train_end()
    with hook_outputs(act.modules) as outputs:
        first(x), second(x)
        want = reference_stats([list(outputs.stored)])
    torch.testing.assert_close(act.stats.double(), want.expand(-1, -1, 3), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_stats_never_synchronise_and_match_the_cpu(backend):
    model = _net()
    # A parameter that starts at zero (BatchNorm's bias) has an infinite ratio at its first step.
    starts_at_zero = torch.tensor([not p.any() for p in model.parameters()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 3, 32, 32, device="cuda")
    ps = ParameterStats(model, opt, backend=backend, hist_bins=8, expected_steps=2)
    ps.start()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # past expected_steps: growing must not sync either
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ps.stop()
    assert ps.stats["grad"].shape == (2, len(ps.param_names), 3)
    assert ps.stats["update"].isfinite().all()
    assert ps.update_ratio[:, 1:].isfinite().all()
    assert torch.equal(ps.update_ratio[:, 0].isinf(), starts_at_zero)
    weights = [p.detach().double() for p in model.parameters()]
    torch.testing.assert_close(
        ps.extra["weight"]["norm"][:, -1].double(),
        torch.stack([w.norm() for w in weights]).cpu(),
        rtol=1e-5,
        atol=1e-6,
    )
