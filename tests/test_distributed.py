"""all_reduce: statistics recorded on the shards of a distributed run equal those of the whole."""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import BACKENDS, CUDA
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.nn.parallel import DistributedDataParallel

import fasthooks
from fasthooks import ActivationStats
from fasthooks.layout import EXTRAS

# Rows of each batch given to rank 0 and rank 1: uneven, and the last batch leaves rank 1 empty.
SPLITS = [(7, 5), (3, 9), (6, 0)]
OPTIONS = {
    "extra": (*EXTRAS, "binades"),
    "hist_bins": 16,
    "hist_range": (-2.0, 2.0),
    "top_k": 5,
}
BACKEND_NAMES = ["python", "fused"] if fasthooks.extension_available() else ["python"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(sum(s), 6, generator=generator) * 3 + 1 for s in SPLITS]


def _recorded(act: ActivationStats) -> dict[str, torch.Tensor]:
    counts = {"hist": act.hist.clone(), "binades": act.binades.clone(), "top": act.top.clone()}
    return {"stats": act.stats.clone(), **counts, **act.extra}


def _data_parallel(rank: int) -> dict:
    """Each backend's recording of DDP's shards, before and after the merge (DDP, which holds
    the process group, is gone when this returns: before the group is destroyed)."""
    results = {}
    for backend in BACKEND_NAMES:
        model = _model()
        ddp = DistributedDataParallel(model)
        act = ActivationStats(model, backend=backend, **OPTIONS)
        with act:
            for x, split in zip(_batches(), SPLITS, strict=True):
                start = sum(split[:rank])
                ddp(x[start : start + split[rank]]).sum().backward()
                act.on_batch_end(train=True)
        before = act.stats.clone()  # read before merging: the host copy must not go stale
        act.all_reduce()
        results[backend] = {"before": before, **_recorded(act)}
    return results


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = _data_parallel(rank)
    results["nonfinite"] = _locate_nonfinite(rank)
    results["fsdp"] = _record_fully_sharded(rank)
    results["fsdp1"] = _record_flat_parameters(rank)
    model = _model()
    act = ActivationStats(model, backend="python")
    with act:
        for _ in range(rank + 1):  # rank 1 closes one batch more than rank 0
            model(torch.randn(2, 6))
            act.on_batch_end()
    try:
        act.all_reduce()
    except ValueError as error:
        results["mismatch"] = str(error)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _locate_nonfinite(rank: int) -> tuple[Any, Any]:
    """Rank 1's shard goes non-finite in batch 1, rank 0's in batch 2: the first non-finite
    call on this rank before all_reduce, and over both ranks after it."""
    model = _model()
    act = ActivationStats(model, extra=["nonfinite"])
    with act:
        for batch in range(3):
            x = torch.randn(4, 6)
            if batch == 2 - rank:
                x[0, 0] = float("nan")
            model(x)
            act.on_batch_end()
    before = act.first_nonfinite()
    act.all_reduce()
    return tuple(before), tuple(act.first_nonfinite())


def _record_fully_sharded(rank: int) -> dict[str, torch.Tensor]:
    """FSDP2: parameters sharded, each wrapped module gathers them back for its forward."""
    model = _model()
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    act = _record_shards(model, ActivationStats(model, **OPTIONS), rank)
    return {"modules": len(act.module_names), **_recorded(act)}


def _record_flat_parameters(rank: int) -> dict[str, Any]:
    """FSDP1's flat parameters leave the leaf modules none: the default finds nothing to hook."""
    model = _model()
    wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ActivationStats(wrapped, backend="python"):
            pass
    act = ActivationStats(wrapped, modules=[model[0], model[2], model[4]], **OPTIONS)
    _record_shards(wrapped, act, rank)
    return {"warnings": [str(w.message) for w in caught], **_recorded(act)}


def _record_shards(model: nn.Module, act: ActivationStats, rank: int) -> ActivationStats:
    """This rank's shard of the first two batches, then every rank's statistics merged."""
    with act:
        for x, split in zip(_batches(), SPLITS[:2], strict=False):
            start = sum(split[:rank])
            model(x[start : start + split[rank]]).sum().backward()
            act.on_batch_end(train=True)
    act.all_reduce()
    return act


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_merged_shards_equal_one_process_seeing_every_batch(ranks, backend):
    model = _model()
    whole = ActivationStats(model, backend=backend, **OPTIONS)
    with whole:
        for x in _batches():
            model(x)
            whole.on_batch_end(train=True)
    expected = _recorded(whole)
    for rank in ranks:
        merged = rank[backend]
        assert not torch.equal(merged["before"], merged["stats"])  # the shards did differ
        _assert_same(merged, expected)
    for name in expected:
        assert torch.equal(ranks[0][backend][name], ranks[1][backend][name]), name


def test_the_first_nonfinite_call_is_the_earliest_over_ranks_naming_the_rank(ranks):
    # Rank r's row 0 turns the whole output of the first layer NaN: 4 rows x 32 features.
    assert ranks[0]["nonfinite"][0] == (2, "0", "forward", 32, None)
    assert ranks[1]["nonfinite"][0] == (1, "0", "forward", 32, None)
    for rank in ranks:
        assert rank["nonfinite"][1] == (1, "0", "forward", 32, 1)


def test_ranks_with_different_columns_fail_clearly_on_every_rank(ranks):
    for rank in ranks:
        assert "ranks recorded different statistics or merge different batches" in rank["mismatch"]
        assert "rank 0: " in rank["mismatch"] and "'merged': '1 batches (0..0)'" in rank["mismatch"]
        assert "'merged': '2 batches (0..1)'" in rank["mismatch"]


def test_all_reduce_needs_a_process_group_and_a_run():
    model = nn.Linear(2, 2)
    act = ActivationStats(model, backend="python")
    with pytest.raises(RuntimeError, match="before any statistics were recorded"):
        act.all_reduce()
    with act, pytest.raises(RuntimeError, match="initialised process group"):
        act.all_reduce()


def _whole_run_of_two_batches() -> dict[str, torch.Tensor]:
    model = _model()
    whole = ActivationStats(model, backend="python", **OPTIONS)
    with whole:
        for x in _batches()[:2]:
            model(x)
            whole.on_batch_end(train=True)
    return _recorded(whole)


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, want in expected.items():
        if want.is_floating_point():
            torch.testing.assert_close(got[name], want, rtol=1e-6, atol=1e-7, msg=name)
        else:
            assert torch.equal(got[name], want), name


def test_fully_sharded_modules_see_whole_activations(ranks):
    expected = _whole_run_of_two_batches()
    for rank in ranks:
        assert rank["fsdp"]["modules"] == 3
        _assert_same(rank["fsdp"], expected)


def test_flat_parameters_need_modules_named_and_say_so(ranks):
    expected = _whole_run_of_two_batches()
    for rank in ranks:
        assert any("nothing to hook" in w for w in rank["fsdp1"]["warnings"])
        _assert_same(rank["fsdp1"], expected)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("backend", BACKENDS)
def test_nccl_merges_buffers_on_the_gpu(backend, tmp_path):
    """One NCCL rank: every collective of a merge runs on CUDA tensors (int64 minima, the names'
    digests), and merging one rank's columns, or its newest alone, leaves them as they were."""
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = _model().cuda()
        act = ActivationStats(model, backend=backend, extra=["nonfinite"], hist_bins=8)
        with act:
            for x in _batches():
                x = x.cuda()
                x[0, 0] = float("nan")
                model(x)
                act.on_batch_end()
        before = _recorded(act)
        act.all_reduce(batches=act.batches[-1:])
        act.all_reduce()
        after = _recorded(act)
        for name, value in before.items():
            assert torch.equal(after[name].nan_to_num(), value.nan_to_num()), name
        assert act.first_nonfinite().rank == 0
    finally:
        dist.destroy_process_group()
