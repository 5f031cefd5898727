"""all_reduce at the scale of 2-D meshes, with 4 gloo ranks against one process holding the whole
model and batch: a Llama-style model with FSDP2 over one mesh dimension and tensor parallelism
(the built-in styles, local outputs) over the other; HSDP; pipeline stages merged by name; the
newest column merged at each log step; ranks that disagree."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import _free_port
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fasthooks
from fasthooks import ActivationStats, ParameterStats
from fasthooks.layout import EXTRAS

WORLD, STEPS, ROWS, SEQ, VOCAB, WIDTH = 4, 2, 4, 6, 32, 16
# No bin edge at 0, where the sign of a gradient summed in another order can flip.
OPTIONS = {"extra": EXTRAS, "hist_bins": 12, "hist_range": (-2.9, 3.1)}
BACKEND = "fused" if fasthooks.extension_available() else "python"


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(width, width, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under tensor parallelism each rank holds some of the heads: -1 finds how many.
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in self.projections)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    @property
    def projections(self) -> tuple[nn.Module, ...]:
        return self.q_proj, self.k_proj, self.v_proj


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, 2 * width, bias=False)
        self.up_proj = nn.Linear(width, 2 * width, bias=False)
        self.down_proj = nn.Linear(2 * width, width, bias=False)
        self.act_fn = nn.SiLU()  # a plain module on each rank's shard of the hidden features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(width)
        self.self_attn = Attention(width, heads=4)
        self.post_attention_layernorm = nn.RMSNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """The blocks of transformers' LlamaForCausalLM, by hand, small."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.norm = nn.RMSNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return Llama().double()


def _tokens() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator) for _ in range(STEPS)]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The whole batch's mean loss, of which a share of its rows gives its part: so activation
    gradients equal the whole batch's, and summing parameter gradients over ranks gives its."""
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:].reshape(-1)
    summed = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets, reduction="sum")
    return summed / (ROWS * (SEQ - 1))


def _summing_gradients(model: nn.Module) -> None:
    """FSDP2 averages gradients over its ranks; each rank's part of the loss needs their sum."""
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)


def _called(model: nn.Module) -> list[nn.Module]:
    """Every module a forward calls, parameterless ones too (the attention, the SiLU)."""
    return [m for name, m in model.named_modules() if name and name != "layers"]


def _recorders(
    model: nn.Module, optimizer
) -> tuple[ActivationStats, ActivationStats, ParameterStats]:
    modules = _called(model)
    forward = ActivationStats(model, modules=modules, backend=BACKEND, **OPTIONS)
    backward = ActivationStats(model, modules, backend=BACKEND, is_forward=False, **OPTIONS)
    params = ParameterStats(model, optimizer, backend=BACKEND, **OPTIONS)
    return forward, backward, params


def _readings(forward, backward, params) -> dict:
    out = {}
    for name, act in (("forward", forward), ("backward", backward)):
        out[name] = {
            "names": list(act.module_names),
            "stats": act.stats.clone(),
            "hist": act.hist.clone(),
            **{k: v.clone() for k, v in act.extra.items()},
        }
    out["params"] = {
        "names": list(params.param_names),
        **{kind: params.stats[kind].clone() for kind in params.kinds},
        **{
            f"{kind}.{k}": v.clone() for kind in params.kinds for k, v in params.extra[kind].items()
        },
        **{f"{kind}.hist": params.hist[kind].clone() for kind in params.kinds},
        "update_ratio": params.update_ratio.clone(),
        "global_norm": params.global_norm("grad"),
    }
    return out


def _run(model, optimizer, batches, merge) -> dict:
    forward, backward, params = _recorders(model, optimizer)
    with forward, backward, params:
        for tokens in batches:
            _loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
            forward.on_batch_end()
            backward.on_batch_end()
            if merge is not None:  # a logger merging the newest column at each step
                merge(forward, batches=forward.batches[-1:])
    if merge is not None:
        for recorder in (forward, backward, params):
            merge(recorder)  # the forward's columns are merged already: counted once still
    return _readings(forward, backward, params)


def _dp_share(tokens: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    share = ROWS // parts
    return tokens[index * share : (index + 1) * share]


def _two_dimensional(rank: int) -> dict:
    """FSDP2 over "dp", tensor parallelism over "tp": the ranks of a "tp" group see one batch."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _llama()
    for block in model.layers:
        parallelize_module(block, mesh["tp"], TP_PLAN)
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    _summing_gradients(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dp = mesh.get_coordinate()[0]
    batches = [_dp_share(t, dp, 2) for t in _tokens()]

    def merge(recorder, batches=None) -> None:
        if isinstance(recorder, ParameterStats):  # the dimensions in the other order
            recorder.all_reduce(mesh=mesh, mesh_dims=("tp", "dp"))
        elif not recorder.is_forward:  # one dimension, then the other
            recorder.all_reduce(mesh=mesh, mesh_dims="dp")
            recorder.all_reduce(mesh=mesh, mesh_dims=1)
        else:
            recorder.all_reduce(mesh=mesh, batches=batches)

    return _run(model, optimizer, batches, merge)


CHANNELS = {"channel_stats": ("absmax", "mean", "rms", "active"), "channel_every": 1}


def _channel_run(model: nn.Module, batches: list[torch.Tensor], merge: bool) -> dict:
    act = ActivationStats(model, modules=_called(model), backend=BACKEND, **CHANNELS)
    with act:
        for tokens in batches:
            model(tokens[:, :-1])
            act.on_batch_end()
    if merge:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            act.all_reduce()  # the whole world at once, both mesh dimensions together
    said = [str(w.message) for w in caught if "per-channel" in str(w.message)] if merge else []
    return {"names": list(act.module_names), "warnings": said, **act.channel_stats}


def _two_dimensional_channels(rank: int) -> dict:
    """Per-channel statistics on the 2-D mesh's tensor-parallel Llama (local outputs)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _llama()
    for block in model.layers:
        parallelize_module(block, mesh["tp"], TP_PLAN)
    dp = mesh.get_coordinate()[0]
    return _channel_run(model, [_dp_share(t, dp, 2) for t in _tokens()], merge=True)


def _hybrid_sharded(rank: int) -> dict:
    """HSDP: replicated over "replicate", sharded over "shard"; every rank sees its own rows."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _llama()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _summing_gradients(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [_dp_share(t, rank, WORLD) for t in _tokens()]
    return _run(model, optimizer, batches, lambda recorder, batches=None: recorder.all_reduce())


def _pipeline_stages(rank: int) -> dict:
    """Ranks 0 and 2 hold the first stage (embedding and first block), 1 and 3 the rest, and
    each pair shares the batch by data parallelism: each rank hooks and watches only its own
    stage's modules and parameters, then all merge by name. (Every rank runs the whole model,
    so that the stages' values are what a pipeline computes.)"""
    model = _llama()
    first = [model.embed_tokens, model.layers[0]]
    mine = first if rank % 2 == 0 else [model.layers[1], model.norm, model.lm_head]
    modules = [m for part in mine for m in part.modules()]
    params = [p for part in mine for p in part.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    act = ActivationStats(model, modules=modules, backend=BACKEND, **OPTIONS)
    ps = ParameterStats(model, optimizer, parameters=params, backend=BACKEND, **OPTIONS)
    with act, ps:
        for tokens in _tokens():
            _loss(model, _dp_share(tokens, rank // 2, 2)).backward()
            for p in model.parameters():  # data parallelism's gradients: the whole batch's
                dist.all_reduce(p.grad, group=_DATA_PARALLEL[rank % 2])
            optimizer.step()
            optimizer.zero_grad()
            act.on_batch_end()
    # Within the stage first, over its process group of two: the stage's names, whole batches.
    act.all_reduce(group=_DATA_PARALLEL[rank % 2])
    stage = {"names": list(act.module_names), "stats": act.stats.clone(), "hist": act.hist.clone()}
    act.all_reduce()  # then over every rank: what the pair merged counts once
    ps.all_reduce()
    return {
        "stage": stage,
        "act": {"names": act.module_names, "stats": act.stats.clone(), "hist": act.hist.clone()},
        "ps": {
            "names": ps.param_names,
            "stats": ps.stats["grad"].clone(),
            "ratio": ps.update_ratio,
        },
    }


_DATA_PARALLEL: list = []  # the process groups of ranks 0 and 2, and of ranks 1 and 3


def _disagreeing(rank: int) -> dict[str, str]:
    """Rank 3 records 13 histogram bins where the others record 12; then rank 2 asks for a batch
    it does not hold, on a 2x2 mesh: every rank raises, none waits."""
    model = nn.Sequential(nn.Linear(4, 4))
    act = ActivationStats(model, backend="python", hist_bins=13 if rank == 3 else 12)
    errors = {}
    with act:
        model(torch.randn(2, 4))
        act.on_batch_end()
    for name, call in (
        ("options", lambda: act.all_reduce()),
        ("batches", lambda: act.all_reduce(mesh=MESH[0], batches=[7] if rank == 2 else None)),
    ):
        try:
            call()
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    return errors


MESH: list = []  # the worker's 2x2 mesh


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    _DATA_PARALLEL.extend([dist.new_group([0, 2]), dist.new_group([1, 3])])
    MESH.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")))
    results = {
        "2d": _two_dimensional(rank),
        "2d_channels": _two_dimensional_channels(rank),
        "hsdp": _hybrid_sharded(rank),
        "pipeline": _pipeline_stages(rank),
        "disagreeing": _disagreeing(rank),
    }
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("mesh")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _whole() -> dict:
    model = _llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return _run(model, optimizer, _tokens(), None)


def _assert_same(got: dict, want: dict, where: str) -> None:
    for key, expected in want.items():
        value = got[key]
        if isinstance(expected, list):
            assert value == expected, f"{where}: {key}"
        elif expected.is_floating_point():
            torch.testing.assert_close(
                value, expected, rtol=1e-9, atol=1e-9, msg=lambda m, key=key: f"{where}: {key}: {m}"
            )
        else:
            assert torch.equal(value, expected), f"{where}: {key}"


@pytest.mark.parametrize("setting", ["2d", "hsdp"])
def test_every_statistic_of_every_recorder_equals_one_process_holding_everything(ranks, setting):
    whole = _whole()
    for rank, results in enumerate(ranks):
        for recorder in ("forward", "backward", "params"):
            _assert_same(results[setting][recorder], whole[recorder], f"rank {rank} {recorder}")


def test_replicated_outputs_count_once_and_sharded_ones_add_up(ranks):
    whole = _whole()["forward"]
    merged = ranks[0]["2d"]["forward"]
    names = merged["names"]
    for name in ("layers.0.self_attn.o_proj", "layers.0.input_layernorm", "layers.0.mlp.act_fn"):
        row = names.index(name)
        assert torch.equal(merged["hist"][row].sum(-1), whole["hist"][row].sum(-1)), name


def test_pipeline_stages_end_with_every_name_merged_over_the_ranks_holding_it(ranks):
    model = _llama()
    act = ActivationStats(model, modules=_called(model), backend=BACKEND, **OPTIONS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ps = ParameterStats(model, optimizer, backend=BACKEND, **OPTIONS)
    with act, ps:
        for tokens in _tokens():
            _loss(model, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
            act.on_batch_end()
    for rank, results in enumerate(ranks):
        got = results["pipeline"]
        assert sorted(got["act"]["names"]) == sorted(act.module_names), rank
        assert sorted(got["ps"]["names"]) == sorted(ps.param_names), rank
        for name in act.module_names:
            row, want = got["act"]["names"].index(name), act.module_names.index(name)
            torch.testing.assert_close(got["act"]["stats"][:, row], act.stats[:, want])
            assert torch.equal(got["act"]["hist"][row], act.hist[want]), name
        for name in ps.param_names:
            row, want = got["ps"]["names"].index(name), ps.param_names.index(name)
            torch.testing.assert_close(got["ps"]["stats"][:, row], ps.stats["grad"][:, want])
            torch.testing.assert_close(got["ps"]["ratio"][row], ps.update_ratio[want])
    own = ranks[0]["pipeline"]["act"]["names"]
    assert own[0] == "embed_tokens" and "lm_head" in own[own.index("layers.0.mlp.act_fn") :]
    first_stage = [m for m in act.module_names if m == "embed_tokens" or ".0." in f"{m}."]
    for rank, results in enumerate(ranks):
        stage = results["pipeline"]["stage"]
        mine = [m for m in act.module_names if (m in first_stage) == (rank % 2 == 0)]
        assert stage["names"] == mine, rank  # a group's merge: its ranks' names only
        for row, name in enumerate(mine):
            want = act.module_names.index(name)
            torch.testing.assert_close(stage["stats"][:, row], act.stats[:, want])
            assert torch.equal(stage["hist"][row], act.hist[want]), name


def test_ranks_that_disagree_all_raise_naming_each_rank(ranks):
    for results in ranks:
        message = results["disagreeing"]["options"]
        assert "ranks recorded different statistics" in message
        assert "rank 3: " in message and "'hist_bins': 13" in message
        assert "'hist_bins': 12" in message


def test_a_batch_one_rank_does_not_hold_fails_on_every_rank_without_a_hang(ranks):
    for rank, results in enumerate(ranks):
        message = results["disagreeing"]["batches"]
        assert "batches: 7 is not a batch held" in message, (rank, message)


def test_per_channel_statistics_on_a_2d_mesh_equal_one_process_holding_everything(ranks):
    whole = _channel_run(_llama(), _tokens(), merge=False)
    shards = ("layers.0.mlp.act_fn", "layers.1.mlp.act_fn")
    for rank, results in enumerate(ranks):
        got = results["2d_channels"]
        assert got["names"] == whole["names"]
        # The SiLU on each rank's shard of the gate's 32 features: merged over the data-parallel
        # ranks at its place (the column-wise split gives place p the features 16p..16p+16).
        place = rank % 2
        assert len(got["warnings"]) == 1 and str(list(shards)) in got["warnings"][0]
        for stat in CHANNELS["channel_stats"]:
            for row, name in enumerate(whole["names"]):
                want = whole[stat][row]
                if name in shards:
                    got_row, want = got[stat][row, :16], want[16 * place : 16 * place + 16]
                else:
                    got_row = got[stat][row]
                torch.testing.assert_close(
                    got_row, want, equal_nan=True, msg=lambda m, n=name, s=stat: f"{n} {s}: {m}"
                )
