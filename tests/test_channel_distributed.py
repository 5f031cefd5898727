"""all_reduce of per-channel snapshots: two gloo ranks' shards merged equal one process seeing
every batch, by module name; mismatches fail with the same error on every rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_channel_recording import Widening
from test_distributed import _free_port
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fasthooks
from fasthooks import ActivationStats
from fasthooks.channel_merging import _disagreement
from fasthooks.channel_sources import Sources, places, silent
from fasthooks.layout import CHANNEL_COUNT

# Rows of each batch given to rank 0 and rank 1: uneven, and the last leaves rank 1 empty.
SPLITS = [(7, 5), (3, 9), (6, 0)]
OPTIONS = {"channel_stats": ("absmax", "mean", "rms", "active"), "channel_every": 2, "top_k": 2}
BACKENDS = ["python", "fused"] if fasthooks.extension_available() else ["python"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 5))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(sum(s), 6, generator=g) * 3 for s in SPLITS]
    batches[2][1, 0] = float("nan")  # rank 0's: a NaN largest magnitude merges as NaN
    return batches


def _channels(act: ActivationStats) -> dict:
    return {
        "names": act.module_names,
        "counts": act.channel_counts,
        "batches": act.channel_batches.clone(),
        # How many values each channel's sums hold: merged twice, they would double.
        "values": act._channel_sums()[:, CHANNEL_COUNT].clone(),
        **{name: values.clone() for name, values in act.channel_stats.items()},
    }


def _record(model, act, rank, step) -> None:
    with act:
        for x, split in zip(_batches(), SPLITS, strict=True):
            start = sum(split[:rank])
            step(x[start : start + split[rank]])
            act.on_batch_end()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for backend in BACKENDS:
        model = _model()
        ddp = DistributedDataParallel(model)
        act = ActivationStats(model, backend=backend, **OPTIONS)
        _record(model, act, rank, lambda x, ddp=ddp: ddp(x).sum().backward())
        act.all_reduce()
        act.all_reduce()  # snapshots merged before stay as they are
        results[backend] = _channels(act)
    # Pipeline stages: each rank hooks one module; both end with both rows.
    model = _model()
    stage = ActivationStats(model, modules=[model[2 * rank]], backend="python", **OPTIONS)
    _record(model, stage, rank, model)
    stage.all_reduce()
    results["stages"] = _channels(stage)
    # Another channel_every on rank 1, or another channel count: every rank raises the same.
    results["mismatch"] = []
    for every, width in ((2 + rank, 6), (2, 6 + rank)):
        model = nn.Sequential(Widening())
        act = ActivationStats(model, backend="python", channel_stats=("rms",), channel_every=every)
        with act:
            model(torch.randn(4, width))
            act.on_batch_end()
        try:
            act.all_reduce()
            results["mismatch"].append(None)
        except ValueError as error:
            results["mismatch"].append(str(error))
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("channel_ranks")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _whole(backend: str, **options) -> dict:
    model = _model()
    act = ActivationStats(model, backend=backend, **{**OPTIONS, **options})
    with act:
        for x in _batches():
            model(x)
            act.on_batch_end()
    return _channels(act)


def _assert_same(got: dict, want: dict) -> None:
    assert got["counts"] == want["counts"]
    assert torch.equal(got["batches"], want["batches"])
    assert torch.equal(got["values"], want["values"])
    for name in OPTIONS["channel_stats"]:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merged_snapshots_equal_one_process_seeing_every_batch(ranks, backend):
    want = _whole(backend)
    assert bool(want["absmax"][:, :, -1].isnan().any())
    for rank in ranks:
        _assert_same(rank[backend], want)


def test_pipeline_stages_end_with_every_module_by_name(ranks):
    # Each stage's module as one process records it from that rank's shards.
    model = _model()
    want = {}
    for rank, module in enumerate(("0", "2")):
        act = ActivationStats(model, modules=[model[int(module)]], backend="python", **OPTIONS)
        _record(model, act, rank, model)
        want[module] = _channels(act)
    for me, rank in enumerate(ranks):
        got = rank["stages"]
        assert got["names"] == (["0", "2"] if me == 0 else ["2", "0"])
        for row, module in enumerate(got["names"]):
            n = want[module]["counts"][0]
            assert got["counts"][row] == n
            for name in OPTIONS["channel_stats"]:
                torch.testing.assert_close(
                    got[name][row, :n], want[module][name][0], rtol=1e-5, atol=1e-6, equal_nan=True
                )


def test_ranks_with_other_options_or_channel_counts_fail_with_the_same_error(ranks):
    options, counts = zip(*(rank["mismatch"] for rank in ranks), strict=True)
    assert options[0] == options[1] and "channel_every" in options[0]
    assert counts[0] == counts[1]
    assert "all_reduce: 0 has 6 channels on rank 0 and 7 on rank 1" in counts[0], counts[0]


def _merge(sources: dict[int, Sources], groups: list[list[int]], held: dict[int, list[str]]):
    """Each group of `groups` (a partition of the ranks) merged in turn, as `merge_snapshots`
    does it, rank r holding sums of the names `held[r]` (then of every name its group held);
    returns the ranks each group's merge left silent, and the places each split."""
    silent_ranks: set[int] = set()
    split: dict[str, int] = {}
    for ranks in groups:
        told = [
            {
                "bounds": [(0, 1)],
                "counts": dict.fromkeys(held[r], 4),
                **sources[r].told(dict.fromkeys(held[r], 4)),
            }
            for r in ranks
        ]
        assert _disagreement(told, ranks) is None
        silent_ranks |= {r for r in ranks if silent(told, ranks, r)}
        split |= places(told)
        together = sorted(set().union(*(held[r] for r in ranks)))
        for r in ranks:
            sources[r].merged(told)
            held[r] = together
    return silent_ranks, split


# A 2x2 mesh (data, tensor): ranks 0 and 1 are the tensor-parallel ranks of one batch, 2 and 3
# of another.
DATA, TENSOR = [[0, 2], [1, 3]], [[0, 1], [2, 3]]


@pytest.mark.parametrize("order", ["data_first", "tensor_first"])
def test_a_replica_over_one_mesh_dimension_counts_once_merging_in_either_order(order):
    # An output replicated over the tensor-parallel ranks: 0 and 1 hold the same values.
    sources = {r: Sources(["m"], {}, r, {"m"}, {}, r - r % 2) for r in range(4)}
    held = {r: ["m"] for r in range(4)}
    first, second = (DATA, TENSOR) if order == "data_first" else (TENSOR, DATA)
    silent_first, _ = _merge(sources, first, held)
    silent_second, _ = _merge(sources, second, held)
    assert all(s.held["m"] == frozenset({0, 2}) for s in sources.values())
    # One rank of each pair holding the same values stays out: with tensor first, the replicas;
    # with data first, 1 and 3, whose merged sums equal 0's and 2's by then.
    assert (silent_first, silent_second) == (
        (set(), {1, 3}) if order == "data_first" else ({1, 3}, set())
    )


def test_pipeline_stages_on_a_tensor_parallel_mesh_merge_in_either_order():
    # A (pipeline, tensor) mesh: stage 0 (module "a") on ranks 0 and 1, stage 1 ("b") on 2, 3.
    for first, second in ((DATA, TENSOR), (TENSOR, DATA)):
        sources = {r: Sources(["a", "b"], {}, r, set(), {}, None) for r in range(4)}
        held = {0: ["a"], 1: ["a"], 2: ["b"], 3: ["b"]}
        _merge(sources, first, held)
        _merge(sources, second, held)
        for s in sources.values():
            assert (s.held["a"], s.held["b"]) == (frozenset({0, 1}), frozenset({2, 3}))


def test_shards_of_the_features_merge_place_by_place_over_one_group():
    # A plain module on each tensor-parallel rank's shard of the features, merged over the
    # whole 2x2 mesh at once: the data-parallel ranks at one place add up, places stay apart.
    sources = {r: Sources(["act"], {}, r, set(), {"act": r % 2}, None) for r in range(4)}
    held = {r: ["act"] for r in range(4)}
    silent_ranks, split = _merge(sources, [[0, 1, 2, 3]], held)
    assert (silent_ranks, split) == (set(), {"act": 2})
    assert [sources[r].held["act"] for r in range(4)] == [frozenset({0, 2}), frozenset({1, 3})] * 2


def test_groups_whose_sums_overlap_fail_naming_both_ranks():
    told = [
        {"bounds": [], "counts": {"m": 4}, "sources": {"m": source}, "shards": {}}
        for source in ([0], [0, 1])
    ]
    problem = _disagreement(told, [0, 1])
    assert problem is not None
    assert "m's per-channel sums on rank 0 hold the values of ranks [0], on rank 1 of [0, 1]" in (
        problem
    )
