"""fasthooks.load of several ranks' sink folders: one recording, merged exactly as all_reduce
merges the ranks, with no collective during training."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import _free_port
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from fasthooks import ActivationStats, ParameterStats, load
from fasthooks.layout import EXTRAS
from fasthooks.parquet import file_settings

pq = pytest.importorskip("pyarrow.parquet")

DATA = Path(__file__).resolve().parent / "data"
OPTIONS = {"extra": EXTRAS, "hist_bins": 16, "hist_range": (-2.0, 2.0)}
# Rows of each batch on rank 0 and rank 1: uneven, rank 1's half of batch 2 empty, and batch 3
# recorded by rank 0 alone.
SPLITS = [(7, 5), (3, 9), (6, 0), (4,)]
# Float32 readings of float64 values merged in another order: within a rounding of float32.
CLOSE = {"rtol": 2.5e-7, "atol": 1e-10}
# Readings of counts and extremes, which merge without rounding.
EXACT = ("batches", "min", "max", "absmax", "near_zero", "nonfinite", "hist")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


class Affine(nn.Module):
    """An elementwise layer: each element's output is the same whatever the batch around it
    (a matrix product's last bits depend on the rows it is computed with)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6))
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


def _elementwise_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Affine(), nn.Tanh(), nn.PReLU(6), Affine())


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(sum(s), 6, generator=generator) * 3 + 1 for s in SPLITS]


def _readings(run) -> dict[str, torch.Tensor]:
    out = {"batches": run.batches, "stats": run.stats, **run.extra}
    return {**out, "hist": run.hist} if run.hist_bins else out


def _assert_same(got, expected) -> None:
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        tolerance = {"rtol": 0, "atol": 0} if name in EXACT else CLOSE
        torch.testing.assert_close(got[name], want, equal_nan=True, msg=name, **tolerance)


def _record(model: nn.Module, xs: list[torch.Tensor], sink=None, **options) -> ActivationStats:
    act = ActivationStats(model, backend="python", sink=sink, **{**OPTIONS, **options})
    with act:
        for x in xs:
            model(x)
            act.on_batch_end()
    return act


def _halves(tmp_path: Path, xs: list[torch.Tensor], **options) -> list[Path]:
    """Two simulated ranks, each recording its rows of every batch it has into its own folder."""
    folders = [tmp_path / "rank0", tmp_path / "rank1"]
    for rank, folder in enumerate(folders):
        mine = []
        for x, split in zip(xs, SPLITS, strict=True):
            if rank < len(split):
                start = sum(split[:rank])
                mine.append(x[start : start + split[rank]])
        _record(_elementwise_model(), mine, sink=folder, window=2, **options)
    return folders


def test_two_ranks_folders_load_as_one_run_over_whole_batches(tmp_path):
    xs = _batches()
    folders = _halves(tmp_path, xs)
    whole = _record(_elementwise_model(), xs)
    merged = load(folders)
    assert merged.module_names == whole.module_names
    _assert_same(_readings(merged), _readings(whole))
    assert merged.to_dataframe().shape == whole.to_dataframe().shape
    assert merged.first_nonfinite() is None


def test_mean_and_std_alone_merge_too(tmp_path):
    xs = _batches()
    folders = _halves(tmp_path, xs, extra=(), hist_bins=0)
    alone = _record(_elementwise_model(), xs, extra=(), hist_bins=0)
    _assert_same(_readings(load(folders)), _readings(alone))


def test_the_files_keep_the_merge_state_for_pandas(tmp_path):
    pd = pytest.importorskip("pandas")
    folder = _halves(tmp_path, _batches())[0]
    table = pd.read_parquet(folder)
    for stat in ("count", "mean", "std", "m2", "m3", "m4", "min", "max", "near_zero_count"):
        assert stat in set(table["stat"]), stat
    settings = file_settings(pq.read_table(next(folder.glob("*.parquet"))))
    assert settings["format"] == 2 and settings["rank"] is None and settings["pieces"] == {}


def test_the_first_nonfinite_call_names_the_rank_it_was_on(tmp_path):
    """Rank 0 goes non-finite in batch 2, rank 1 in batch 1: the merge finds rank 1's."""
    folders = []
    for rank in range(2):
        xs = [torch.randn(4, 6) for _ in range(3)]
        xs[2 - rank][0, 0] = float("nan")
        folders.append(tmp_path / f"rank{rank}")
        _record(_model(), xs, sink=folders[-1], extra=["nonfinite"], hist_bins=0)
        assert load(folders[-1]).first_nonfinite().rank is None
    found = load(folders).first_nonfinite()
    assert (found.batch, found.module, found.direction, found.rank) == (1, "0", "forward", 1)
    assert found.count == 16  # row 0 of layer 0's output: 16 features
    assert load(folders).nonfinite_ranks[(2, "0")] == 0


def _parameter_run(folder: Path, parameters=None) -> ParameterStats:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ps = ParameterStats(model, opt, parameters, backend="python", sink=folder, **OPTIONS)
    with ps:
        for x in _batches():
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return ps


def test_plain_parameters_that_several_folders_hold_count_once(tmp_path):
    """Data parallelism: every rank holds the same parameters; pipeline stages: each its own."""
    one = _parameter_run(tmp_path / "one")
    for rank in range(2):
        _parameter_run(tmp_path / f"replica{rank}")
    _parameter_run(tmp_path / "stage0", ["0.weight", "0.bias"])
    _parameter_run(tmp_path / "stage1", ["2.weight", "4.weight", "0.bias"])
    for kind in ("weight", "grad", "update"):
        alone = load(tmp_path / "one", kind=kind)
        replicas = load([tmp_path / "replica0", tmp_path / "replica1"], kind=kind)
        _assert_same(_readings(replicas), _readings(alone))
        assert _readings(alone)["stats"].shape[1] == len(one.param_names)
        stages = load([tmp_path / "stage0", tmp_path / "stage1"], kind=kind)
        assert stages.module_names == ["0.weight", "0.bias", "2.weight", "4.weight"]
        rows = [alone.module_index(name) for name in stages.module_names]
        expected = {
            "batches": alone.batches,
            "stats": alone.stats[:, rows],
            "hist": alone.hist[rows],
            **{name: values[rows] for name, values in alone.extra.items()},
        }
        _assert_same(_readings(stages), expected)


def test_folders_that_differ_are_refused_naming_the_folder(tmp_path):
    xs = _batches()[:2]
    _record(_model(), xs, sink=tmp_path / "a")
    _record(_model(), xs, sink=tmp_path / "b", extra=["max"])
    _record(_model(), xs, sink=tmp_path / "c", hist_range=(-1.0, 1.0))
    with pytest.raises(ValueError, match=r"'.*b' differs from '.*a' in extra"):
        load([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(ValueError, match=r"'.*c' differs from '.*a' in hist_range"):
        load([tmp_path / "a", tmp_path / "c"])
    with pytest.raises(ValueError, match="gives .* twice"):
        load([tmp_path / "a", str(tmp_path / "a")])
    with pytest.raises(ValueError, match="paths is empty"):
        load([])
    _parameter_run(tmp_path / "ps")
    with pytest.raises(KeyError, match="kind 'grad' is not in"):
        load([tmp_path / "ps", tmp_path / "a"], kind="grad")
    model = _model()
    with ActivationStats(model, backend="python", is_forward=False, sink=tmp_path / "back") as act:
        model(xs[0]).sum().backward()
        act.on_batch_end()
    with pytest.raises(KeyError, match="kind 'forward' is not in .*back"):
        load([tmp_path / "a", tmp_path / "back"])  # the first folder's kind is every folder's


def test_a_version_1_folder_loads_alone_and_refuses_to_merge(tmp_path):
    old = DATA / "sink_v1"
    expected = torch.load(DATA / "sink_v1_expected.pt")
    loaded = load(old)
    _assert_same(
        _readings(loaded),
        {k: expected[k] for k in ("batches", "stats", "hist")} | expected["extra"],
    )
    assert tuple(loaded.first_nonfinite()) == expected["first_nonfinite"]
    shutil.copytree(old, tmp_path / "copy")
    with pytest.raises(ValueError, match="sink format 1, which lacks the merge state"):
        load([old, tmp_path / "copy"])


# Two gloo processes, each sinking into its own folder: loading both equals all_reduce. -----------

RANK_SPLITS = [(7, 5), (3, 9), (5, 1)]


def _ranked_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(sum(s), 6, generator=generator) for s in RANK_SPLITS]


def _train(model, forward, rank: int, folder: Path, whole: bool) -> dict:
    """Record activations and parameters into this rank's folder, then merge with all_reduce;
    each rank sees its rows of each batch, or (`whole`) all of them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    act = ActivationStats(model, backend="python", sink=folder, **OPTIONS)
    ps = ParameterStats(model, opt, backend="python", sink=folder, **OPTIONS)
    with act, ps:
        for x, split in zip(_ranked_batches(), RANK_SPLITS, strict=True):
            start = sum(split[:rank])
            forward(x if whole else x[start : start + split[rank]]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            act.on_batch_end()
    act.all_reduce()
    ps.all_reduce()
    merged = {"forward": _readings(act)}
    return merged | {kind: _readings(ps[kind]) for kind in ps.kinds}


def _data_parallel(rank: int, folder: Path) -> dict:
    model = _model()
    return _train(model, DistributedDataParallel(model), rank, folder, whole=False)


def _fully_sharded(rank: int, folder: Path) -> dict:
    """FSDP2: every parameter a shard of its own on each rank."""
    model = _model()
    for layer in (model[0], model[2], model[4], model):
        fully_shard(layer)
    return _train(model, model, rank, folder, whole=False)


def _tensor_parallel(rank: int, folder: Path) -> dict:
    """Layer 0's output and weights are shards, layer 2's output and bias replicas."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (2,))
    plan = {
        "0": ColwiseParallel(use_local_output=False),
        "2": RowwiseParallel(use_local_output=False),
    }
    parallelize_module(model, mesh, plan)
    return _train(model, model, rank, folder, whole=True)


def _nonfinite(rank: int, folder: Path) -> tuple:
    model = _model()
    act = ActivationStats(model, backend="python", extra=["nonfinite"], sink=folder)
    with act:
        for batch in range(3):
            x = torch.randn(4, 6)
            if batch == 2 - rank:
                x[0, 0] = float("nan")
            model(x)
            act.on_batch_end()
    act.all_reduce()
    return tuple(act.first_nonfinite())


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    root = Path(out)
    results = {
        "ddp": _data_parallel(rank, root / "ddp" / f"rank{rank}"),
        "fsdp": _fully_sharded(rank, root / "fsdp" / f"rank{rank}"),
        "tp": _tensor_parallel(rank, root / "tp" / f"rank{rank}"),
        "nonfinite": _nonfinite(rank, root / "nonfinite" / f"rank{rank}"),
    }
    torch.save(results, root / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("ranks")
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    return out, [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "tp"])
@pytest.mark.parametrize("kind", ["forward", "weight", "grad", "update"])
def test_per_rank_folders_load_equal_to_all_reduce(ranks, parallel, kind):
    out, results = ranks
    folders = [out / parallel / "rank0", out / parallel / "rank1"]
    merged = load(folders, kind=kind)
    _assert_same(_readings(merged), results[0][parallel][kind])


def test_the_folders_say_their_rank_and_which_pieces_a_lower_rank_counts(ranks):
    out, _ = ranks
    for rank in range(2):
        forward = next((out / "tp" / f"rank{rank}").glob("forward-*.parquet"))
        settings = file_settings(pq.read_table(forward))
        assert settings["rank"] == rank
        assert settings["pieces"] == {"0": rank, "2": 0}  # layer 2's output is replicated
        weight = next((out / "tp" / f"rank{rank}").glob("weight-*.parquet"))
        pieces = file_settings(pq.read_table(weight))["pieces"]
        assert pieces["2.bias"] == 0 and pieces["0.weight"] == rank


def test_per_rank_folders_name_the_rank_of_the_first_nonfinite_call(ranks):
    out, results = ranks
    found = load([out / "nonfinite" / "rank0", out / "nonfinite" / "rank1"]).first_nonfinite()
    assert tuple(found) == results[0]["nonfinite"] == results[1]["nonfinite"]
    assert found.rank == 1
