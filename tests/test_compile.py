"""ActivationStats inside torch.compile(fullgraph=True): no graph break, no recompile per batch
(with channel_stats, one more graph once the first batch has given each module its channels)."""

import pytest
import torch
from conftest import BACKENDS, FUSED
from torch import nn

from fasthooks import ActivationStats


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10), nn.LayerNorm(10)
    )


def _run(model, act, batches, step):
    with act:
        for x in batches:
            step(x)
            act.on_batch_end(train=True)
    return act.stats


OPTIONS = {
    "mean_std": {},
    "every_stat": {"extra": ("min", "max", "near_zero", "nonfinite", "kurtosis"), "hist_bins": 8},
    "binades_top_k": {"extra": ("binades",), "top_k": 4},
    "channel_stats": {"channel_stats": ("absmax", "mean", "rms", "active"), "channel_every": 4},
}


@pytest.mark.parametrize("watched", ["eager_module", "compiled_wrapper"])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_records_same_stats_without_recompiling(backend, compiler, options, watched):
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(compiler)(gm, example_inputs)

    batches = [torch.randn(4, 3, 8, 8) * (i + 1) for i in range(6)]
    kwargs = {"backend": backend, **OPTIONS[options]}
    eager_model = _net()
    eager_act = ActivationStats(eager_model, **kwargs)
    eager = _run(eager_model, eager_act, batches, eager_model)

    model = _net()
    compiled = torch.compile(model, backend=counting, fullgraph=True)
    # Users hold either the module or the wrapper torch.compile returned (frameworks pass that).
    act = ActivationStats(model if watched == "eager_module" else compiled, **kwargs)
    stats = _run(model, act, batches, lambda x: compiled(x).sum().backward())

    # The first batch's graph gives each module its channels; the next one finds them given.
    want = 2 if act.channel_names else 1
    assert len(graphs) == want, f"compiled {len(graphs)} graphs for 6 batches"
    assert act.module_names == eager_act.module_names == ["0", "3", "4"]
    torch.testing.assert_close(stats, eager, rtol=1e-5, atol=1e-6)
    assert not torch.isnan(stats).any()
    for name, values in act.extra.items():
        torch.testing.assert_close(values, eager_act.extra[name], rtol=1e-4, atol=1e-6)
    if act.hist_bins:
        # Values exactly on an edge may move one bin between compiled and eager arithmetic.
        assert (act.hist - eager_act.hist).abs().sum() <= 2 * act.hist.shape[1]
        assert act.hist.sum() > 0
    if "binades" in act.extra_names:
        # The exponents of values as compiled arithmetic rounds them: a value may cross a binade.
        assert (act.binades - eager_act.binades).abs().sum() <= 2 * act.binades.shape[1]
        assert act.binades.sum() == eager_act.binades.sum() > 0
    if act.top_k:
        # The largest values and their channels, as compiled arithmetic rounds them.
        torch.testing.assert_close(act.top_values, eager_act.top_values, rtol=1e-5, atol=1e-6)
        assert torch.equal(act.top_channels, eager_act.top_channels)
        assert (act.top_channels >= 0).all()
    if act.channel_names:
        assert act.channel_counts == eager_act.channel_counts == [8, 10, 10]
        for name, values in act.channel_stats.items():
            torch.testing.assert_close(values, eager_act.channel_stats[name], equal_nan=True)


@FUSED
@pytest.mark.filterwarnings("ignore:ActivationStats. the hooks recorded:RuntimeWarning")
def test_compiled_graph_calls_the_fused_operator():
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = _net()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    with ActivationStats(model, backend="fused"):
        compiled(torch.randn(2, 3, 8, 8))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    op = torch.ops.fasthooks.accumulate_stats
    assert sum(t in (op, op.default) for t in targets) == 3
