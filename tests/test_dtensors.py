"""Distributed tensors never crash the step: FSDP2's parameters and gradients and tensor-parallel
outputs are recorded from their local pieces (2 gloo ranks against one process with everything)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import BACKENDS
from test_distributed import _free_port
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

import fasthooks
from fasthooks import ActivationStats, ParameterStats
from fasthooks.layout import CHANNEL_COUNT

BACKEND_NAMES = ["python", "fused"] if fasthooks.extension_available() else ["python"]
STEPS, ROWS = 3, 8  # rows of each step's batch, half on each rank under FSDP2
OPTIONS = {"extra": ("min", "max", "norm", "absmax"), "hist_bins": 8, "hist_range": (-2.0, 2.0)}
CHANNELS = {"channel_stats": ("absmax", "mean", "rms", "active"), "channel_every": 2, "top_k": 3}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, 6, generator=generator) for _ in range(STEPS)]


def _train(model, batches, act, ps, optimizer) -> None:
    with act, ps:
        for x in batches:
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            act.on_batch_end()


def _parameter_readings(ps: ParameterStats) -> dict:
    readings = {kind: {"stats": ps.stats[kind], **ps.extra[kind]} for kind in ps.kinds}
    return {
        **readings,
        "hist": ps.hist,
        "update_ratio": ps.update_ratio,
        "global_norm": ps.global_norm("grad"),
    }


def _readings(act: ActivationStats, ps: ParameterStats) -> dict:
    return {
        "act": {"stats": act.stats.clone(), "hist": act.hist.clone(), **act.extra},
        "ps": _parameter_readings(ps),
        "act_placements": act.placements,
        "ps_placements": ps.placements,
    }


def _merged(act: ActivationStats, ps: ParameterStats) -> dict:
    act.all_reduce()
    ps.all_reduce()
    return {"stats": act.stats.clone(), "hist": act.hist.clone(), "ps": _parameter_readings(ps)}


def _fully_sharded(rank: int, backend: str) -> dict:
    model = _model()
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    act = ActivationStats(model, backend=backend, **OPTIONS)
    ps = ParameterStats(model, optimizer, backend=backend, **OPTIONS)
    half = ROWS // 2
    _train(model, [x[rank * half : (rank + 1) * half] for x in _batches()], act, ps, optimizer)
    return {**_readings(act, ps), "merged": _merged(act, ps)}


def _data_parallel(rank: int, backend: str) -> dict:
    model = _model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    act = ActivationStats(model, backend=backend, **OPTIONS)
    ps = ParameterStats(model, optimizer, backend=backend, **OPTIONS)
    half = ROWS // 2
    _train(ddp, [x[rank * half : (rank + 1) * half] for x in _batches()], act, ps, optimizer)
    return {**_readings(act, ps), "merged": _merged(act, ps)}


def _tensor_parallel(rank: int, backend: str, local: bool = False) -> dict:
    """Tensor parallelism handing on DTensors, or (`local`, the styles' default) local tensors."""
    model = _model()
    mesh = init_device_mesh("cpu", (2,))
    plan = {
        "0": ColwiseParallel(use_local_output=local),
        "2": RowwiseParallel(use_local_output=local),
    }
    parallelize_module(model, mesh, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    act = ActivationStats(model, backend=backend, **OPTIONS)
    ps = ParameterStats(model, optimizer, backend=backend, **OPTIONS)
    _train(model, _batches(), act, ps, optimizer)  # every rank sees the whole batch
    # Layer 0's sharded output merges, layer 2's replicated one counts once; so do parameters.
    return {**_readings(act, ps), "merged": _merged(act, ps)}


def _channel_readings(act: ActivationStats) -> dict:
    return {
        "counts": act.channel_counts,
        # How many values each channel's sums hold: a replica counted twice would double them.
        "values": act._channel_sums()[:, CHANNEL_COUNT].clone(),
        "top_values": act.top_values.clone(),
        "top_channels": act.top_channels.clone(),
        **{name: values.clone() for name, values in act.channel_stats.items()},
    }


def _channel_model() -> nn.Module:
    """A column-wise and a row-wise layer with plain modules after each: under tensor
    parallelism with local outputs, the ReLU sees a rank's shard of the features and the Tanh a
    replica."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4), nn.Tanh())


def _tensor_parallel_channels(rank: int, backend: str, local: bool = False) -> dict:
    """Per-channel statistics and the top channels of tensor-parallel outputs, before and after
    the merge, with DTensors handed on or (`local`) local tensors."""
    model = _channel_model()
    plan = {
        "0": ColwiseParallel(use_local_output=local),
        "2": RowwiseParallel(use_local_output=local),
    }
    parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
    act = ActivationStats(model, modules=list(model), backend=backend, **CHANNELS)
    with act:
        for x in _batches():  # every rank sees the whole batch
            model(x)
            act.on_batch_end()
    own = _channel_readings(act)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        act.all_reduce()
    said = [str(w.message) for w in caught if "per-channel" in str(w.message)]
    return {"own": own, "merged": _channel_readings(act), "warnings": said}


def _windowed(rank: int, backend: str) -> dict:
    """Data parallelism keeping the newest 2 batches: the newest merged at each step, as a logger
    would, then everything held (each column's values counted once still)."""
    model = _model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    act = ActivationStats(model, backend=backend, window=2, **OPTIONS)
    half = ROWS // 2
    newest = []
    with act:
        for x in _batches():
            ddp(x[rank * half : (rank + 1) * half]).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            act.on_batch_end()
            act.all_reduce(batches=act.batches[-1:])
            newest.append(act.stats[:, :, -1].clone())
    act.all_reduce()
    return {"newest": torch.stack(newest, -1), "stats": act.stats.clone(), "hist": act.hist.clone()}


class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up = nn.LayerNorm(8), nn.Linear(8, 16)
        self.act, self.down, self.norm2 = nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm2(self.down(self.act(self.up(self.norm(x)))))


def _sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randn(2, 4, 8, generator=generator, dtype=torch.float64) for _ in range(STEPS)]


def _squared(y: torch.Tensor, step: int) -> torch.Tensor:
    return (y.full_tensor() if isinstance(y, DTensor) else y).pow(2).mean()


def _sequence_run(
    model: nn.Module, batches: list[torch.Tensor], backend: str, merge: bool, loss=_squared
) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    modules = [m for name, m in model.named_modules() if name]
    forward = ActivationStats(model, modules=modules, backend=backend, **OPTIONS)
    backward = ActivationStats(model, modules, backend=backend, is_forward=False, **OPTIONS)
    ps = ParameterStats(model, optimizer, backend=backend, **OPTIONS)
    with forward, backward, ps:
        for step, x in enumerate(batches):
            loss(model(x), step).backward()
            optimizer.step()
            optimizer.zero_grad()
            forward.on_batch_end()
            backward.on_batch_end()
    if merge:
        for recorder in (forward, backward, ps):
            recorder.all_reduce()
    return {
        "forward": {"stats": forward.stats.clone(), "hist": forward.hist.clone()},
        "backward": {"stats": backward.stats.clone(), "hist": backward.hist.clone()},
        "ps": _parameter_readings(ps),
    }


def _sequence_parallel(rank: int, backend: str) -> dict:
    """Sequence parallelism: norms on each rank's half of the sequence (their weights'
    gradients are partial sums), column- and row-wise layers between."""
    torch.manual_seed(0)
    model = NormedMLP().double()
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
    }
    parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
    halves = [x[:, 2 * rank : 2 * rank + 2] for x in _sequences()]
    return _sequence_run(model, halves, backend, merge=True)


class PreparedHead(nn.Module):
    """A norm on each rank's half of the sequence, a block whose input and output layouts are
    prepared for it, and an output layer whose logits stay sharded over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.output = nn.LayerNorm(8), nn.Linear(8, 6)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.block(self.norm(x)))


def _labels() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 6, (2, 4), generator=generator) for _ in range(STEPS)]


def _cross_entropy(logits: torch.Tensor, step: int) -> torch.Tensor:
    labels = _labels()[step].flatten()
    if not isinstance(logits, DTensor):
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels)
    with loss_parallel():  # the loss of logits sharded over the vocabulary, backward too
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels)
        loss.backward()
    return loss.detach().requires_grad_()  # its gradients are in: a no-op backward


def _prepared_loss_parallel(rank: int, backend: str) -> dict:
    """PrepareModuleInputOutput around a column- and row-wise block, and loss parallelism."""
    torch.manual_seed(0)
    model = PreparedHead().double()
    plan = {
        "norm": SequenceParallel(),
        "block": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(Replicate(),),
        ),
        "block.0": ColwiseParallel(),
        "block.2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
    halves = [x[:, 2 * rank : 2 * rank + 2] for x in _sequences()]
    return _sequence_run(model, halves, backend, merge=True, loss=_cross_entropy)


class EmitPartial(nn.Module):
    """Returns its input as a DTensor of partial values: each rank's half of a sum."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> DTensor:
        return DTensor.from_local(x * self.scale, self.mesh, [Partial()])


def _partial(rank: int, backend: str) -> dict:
    mesh = init_device_mesh("cpu", (2,))
    model = nn.Sequential(EmitPartial(mesh))
    x = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ActivationStats(model, backend=backend, extra=["max"]) as act:
            for _ in range(2):
                model(x)
                act.on_batch_end()
    return {
        "warnings": [str(w.message) for w in caught if "partial values" in str(w.message)],
        "stats": act.stats.clone(),
        "max": act.extra["max"].clone(),
        "local": x,
    }


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {
        backend: {
            "fsdp": _fully_sharded(rank, backend),
            "ddp": _data_parallel(rank, backend),
            "tp": _tensor_parallel(rank, backend),
            "tp_local": _tensor_parallel(rank, backend, local=True),
            "tp_channels": _tensor_parallel_channels(rank, backend),
            "tp_local_channels": _tensor_parallel_channels(rank, backend, local=True),
            "window": _windowed(rank, backend),
            "sequence": _sequence_parallel(rank, backend),
            "loss_parallel": _prepared_loss_parallel(rank, backend),
            "partial": _partial(rank, backend),
        }
        for backend in BACKEND_NAMES
    }
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("dtensor-ranks")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _whole(backend: str) -> dict:
    """One process with the whole model and every batch."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    act = ActivationStats(model, backend=backend, **OPTIONS)
    ps = ParameterStats(model, optimizer, backend=backend, **OPTIONS)
    _train(model, _batches(), act, ps, optimizer)
    return _readings(act, ps)


def _pieces_norm(ranks: list[dict], backend: str, setting: str, kind: str) -> torch.Tensor:
    """The norm of each whole parameter from the norms of its disjoint local pieces."""
    norms = torch.stack([r[backend][setting]["ps"][kind]["norm"].double() for r in ranks])
    return norms.pow(2).sum(0).sqrt()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_sharded_parameters_are_recorded_from_their_shards(ranks, backend):
    whole = _whole(backend)
    for rank in ranks:
        placements = rank[backend]["fsdp"]["ps_placements"]
        assert set(placements) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert all(p.startswith("(Shard(dim=0),)") for p in placements.values())
    for kind in ("weight", "grad", "update"):
        want = whole["ps"][kind]["norm"].double()
        got = _pieces_norm(ranks, backend, "fsdp", kind)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
        absmax = torch.maximum(*(r[backend]["fsdp"]["ps"][kind]["absmax"] for r in ranks))
        torch.testing.assert_close(absmax, whole["ps"][kind]["absmax"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_sharded_activations_merge_into_the_whole_batch(ranks, backend):
    whole = _whole(backend)
    for rank in ranks:
        merged = rank[backend]["fsdp"]["merged"]
        _same(merged["stats"], whole["act"]["stats"])
        assert torch.equal(merged["hist"], whole["act"]["hist"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_outputs_and_parameters_are_recorded_from_their_pieces(ranks, backend):
    whole = _whole(backend)
    for rank in ranks:
        tp = rank[backend]["tp"]
        assert tp["act_placements"]["0"].startswith("(Shard(dim=")
        assert tp["act_placements"]["2"].startswith("(Replicate(),)")
        merged = tp["merged"]
        torch.testing.assert_close(merged["stats"], whole["act"]["stats"], rtol=1e-5, atol=1e-6)
        assert torch.equal(merged["hist"], whole["act"]["hist"])
        # The row-wise layer's bias is replicated: each rank holds all of it.
        assert tp["ps_placements"]["2.bias"].startswith("(Replicate(),)")
        torch.testing.assert_close(
            tp["ps"]["weight"]["norm"][3], whole["ps"]["weight"]["norm"][3], rtol=1e-5, atol=0
        )
    sharded = [0, 1, 2]  # the column-wise weight and bias, the row-wise weight
    for kind in ("weight", "grad", "update"):
        got = _pieces_norm(ranks, backend, "tp", kind)[sharded]
        want = whole["ps"][kind]["norm"].double()[sharded]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_values_are_recorded_as_they_are_with_one_warning(ranks, backend):
    for rank in ranks:
        partial = rank[backend]["partial"]
        assert len(partial["warnings"]) == 1
        assert "0 (EmitPartial) is a DTensor with partial values" in partial["warnings"][0]
        local = partial["local"]
        torch.testing.assert_close(partial["stats"][0, 0], local.mean().expand(2))
        assert partial["max"][0].tolist() == [local.max().item()] * 2


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("setting", ["fsdp", "tp", "ddp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_stats_merge_into_the_whole_model(ranks, backend, setting):
    whole = _whole(backend)["ps"]
    for rank in ranks:
        merged = rank[backend][setting]["merged"]["ps"]
        for kind in ("weight", "grad", "update"):
            for name, values in whole[kind].items():
                _same(merged[kind][name], values)
            assert torch.equal(merged["hist"][kind], whole["hist"][kind]), kind
        _same(merged["update_ratio"], whole["update_ratio"])
        _same(merged["global_norm"], whole["global_norm"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_data_parallel_activations_merge_into_the_whole_batch(ranks, backend):
    whole = _whole(backend)
    for rank in ranks:
        merged = rank[backend]["ddp"]["merged"]
        _same(merged["stats"], whole["act"]["stats"])
        assert torch.equal(merged["hist"], whole["act"]["hist"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_local_outputs_count_replicas_once(ranks, backend):
    whole = _whole(backend)
    for rank in ranks:
        tp = rank[backend]["tp_local"]
        assert tp["act_placements"] == {
            "0": "local output, a shard on (2,)",
            "2": "local output, Replicate on (2,)",
        }
        torch.testing.assert_close(
            tp["merged"]["stats"], whole["act"]["stats"], rtol=1e-5, atol=1e-6
        )
        assert torch.equal(tp["merged"]["hist"], whole["act"]["hist"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_merges_its_newest_column_at_each_step_and_then_all_it_holds(ranks, backend):
    whole = _whole(backend)["act"]
    for rank in ranks:
        merged = rank[backend]["window"]
        _same(merged["newest"], whole["stats"])
        _same(merged["stats"], whole["stats"][:, :, -2:])
        assert torch.equal(merged["hist"], whole["hist"][:, -2:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_parallel_merges_into_one_process_with_partial_gradients_reduced(ranks, backend):
    torch.manual_seed(0)
    whole = _sequence_run(NormedMLP().double(), _sequences(), backend, merge=False)
    for rank in ranks:
        got = rank[backend]["sequence"]
        for recorder in ("forward", "backward"):
            _same(got[recorder]["stats"], whole[recorder]["stats"])
            assert torch.equal(got[recorder]["hist"], whole[recorder]["hist"]), recorder
        for kind in ("weight", "grad", "update"):
            for name, values in whole["ps"][kind].items():
                _same(got["ps"][kind][name], values)
        _same(got["ps"]["global_norm"], whole["ps"]["global_norm"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepared_layouts_and_loss_parallel_merge_into_one_process(ranks, backend):
    torch.manual_seed(0)
    whole = _sequence_run(
        PreparedHead().double(), _sequences(), backend, merge=False, loss=_cross_entropy
    )
    for rank in ranks:
        got = rank[backend]["loss_parallel"]
        for recorder in ("forward", "backward"):
            _same(got[recorder]["stats"], whole[recorder]["stats"])
            assert torch.equal(got[recorder]["hist"], whole[recorder]["hist"]), recorder
        for kind in ("weight", "grad", "update"):
            for name, values in whole["ps"][kind].items():
                _same(got["ps"][kind][name], values)
        _same(got["ps"]["global_norm"], whole["ps"]["global_norm"])


def _whole_channels(backend: str) -> dict:
    model = _channel_model()
    act = ActivationStats(model, modules=list(model), backend=backend, **CHANNELS)
    with act:
        for x in _batches():
            model(x)
            act.on_batch_end()
    return _channel_readings(act)


@pytest.mark.parametrize("local", [False, True], ids=["dtensor_outputs", "local_outputs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_parallel_channels_are_named_in_the_whole_tensor_and_merge_into_it(
    ranks, backend, local
):
    whole = _whole_channels(backend)
    # Rows: the column-wise layer (sharded along its channels), the ReLU (a DTensor shard, or
    # with local outputs a plain tensor of the rank's own 8 channels), the row-wise layer and
    # the Tanh (replicas).
    sharded = [0] if local else [0, 1]
    merged_rows = [0, 2, 3] if local else [0, 1, 2, 3]
    for rank, got in enumerate(
        r[backend]["tp_local_channels" if local else "tp_channels"] for r in ranks
    ):
        own, merged = got["own"], got["merged"]
        # Each rank's piece holds its own 8 of the 16 channels, named as in the whole tensor:
        # the others read NaN until merged.
        mine = slice(8 * rank, 8 * rank + 8)
        assert own["counts"] == (whole["counts"] if not local else [16, 8, 4, 4])
        for row in sharded:
            held = ~own["rms"][row].isnan().all(-1)
            assert held.nonzero().flatten().tolist() == list(range(16))[mine]
            _same(own["rms"][row, mine], whole["rms"][row, mine])
            channels = own["top_channels"][row]
            assert bool(((channels >= mine.start) & (channels < mine.stop)).all()), channels
        # Merged: the pieces make the whole tensor, and the replicas count once.
        for key in ("values", *CHANNELS["channel_stats"], "top_values", "top_channels"):
            _same(merged[key][merged_rows].double(), whole[key][merged_rows].double())
        if local:
            # The ReLU's channels are the rank's own: merged with no other place's, and said so.
            _same(merged["rms"][1], own["rms"][1])
            _same(merged["rms"][1, :8], whole["rms"][1, mine])
            assert len(got["warnings"]) == 1
            assert "['1'] are each tensor-parallel rank's own shard" in got["warnings"][0]
        else:
            assert got["warnings"] == []
