"""Merging the statistics that ranks recorded from their own pieces: the rule that merges merge
states (over a process group, or in one process for sinks read back), and the few collectives
that agree on what is merged."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .layout import COUNT, M2, M3, M4, MAX, MEAN, MIN, NEAR_ZERO, NONFINITE, STATE_PLANES

Reduce = Callable[[torch.Tensor], torch.Tensor]


def merge_state(state: torch.Tensor, total: Reduce, least: Reduce) -> torch.Tensor:
    """The merge of merge states `(planes, ...)` through `total` (a sum over the pieces) and
    `least` (a minimum over them): one sum of the counts and sums (with the near-zero and
    non-finite counts, and which extremes are NaN), one sum of the central power sums taken
    about the merged mean (the parallel-axis rule: exact as merging pairwise, within float64
    rounding), one minimum of the minima and negated maxima. An empty piece adds nothing."""
    full = state.shape[0] == len(STATE_PLANES)
    count = state[COUNT]
    empty = count == 0
    mean = torch.where(empty, 0.0, state[MEAN])
    first = [count, count * mean]
    if full:
        low, high = state[MIN], state[MAX]
        first += [state[NEAR_ZERO], state[NONFINITE], low.isnan().double(), high.isnan().double()]
    totals = total(torch.stack(first))
    whole = totals[0]
    center = torch.where(whole > 0, totals[1] / whole, 0.0)
    d = torch.where(empty, 0.0, mean - center)
    m2 = state[M2]
    powers = [m2 + count * d * d]
    if full:
        m3 = state[M3]
        powers += [
            m3 + 3.0 * d * m2 + count * d**3,
            state[M4] + 4.0 * d * m3 + 6.0 * d * d * m2 + count * d**4,
        ]
    sums = total(torch.stack(powers))
    planes = [whole, center, sums[0]]
    if full:
        inf = torch.full_like(low, float("inf"))
        extremes = least(
            torch.stack(
                [
                    torch.where(empty | low.isnan(), inf, low),
                    torch.where(empty | high.isnan(), inf, -high),
                ]
            )
        )
        nan = torch.full_like(whole, float("nan"))
        planes += [
            sums[1],
            sums[2],
            torch.where(totals[4] > 0, nan, extremes[0]),
            torch.where(totals[5] > 0, nan, -extremes[1]),
            totals[2],
            totals[3],
        ]
    merged = torch.stack(planes)
    return torch.where(whole > 0, merged, torch.zeros_like(merged))


def merge_states(states: Sequence[torch.Tensor]) -> torch.Tensor:
    """The merge of several pieces' merge states `(planes, rows, columns)`, in this process.

    Examples:
        >>> from fasthooks.moments import accumulate_stats_python as accumulate
        >>> from fasthooks.buffers import StatBuffers
        >>> x = torch.randn(100, dtype=torch.float64)
        >>> parts = []
        >>> for piece in (x[:30], x[30:]):
        ...     b = StatBuffers(1, 1, "cpu", full=True, hist_bins=0)
        ...     accumulate(piece, *b.op_args(), 0)
        ...     parts.append(b.state)
        >>> merged = merge_states(parts)
        >>> whole = x.var() * 99
        >>> bool(torch.isclose(merged[2, 0, 0], whole)), merged[0, 0, 0].item()
        (True, 100.0)
    """
    stacked = torch.stack(list(states), 1)
    return merge_state(stacked, lambda t: t.sum(1), lambda t: t.amin(1))


def reduce_state(state: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The merge of every rank's merge states `(planes, ...)` over `group`, on every rank, in
    three reductions the size of the state, whatever the number of ranks (tested against one
    process in tests/test_distributed.py)."""
    import torch.distributed as dist

    def total(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    def least(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return t

    return merge_state(state, total, least)


def process_group_rank(group: Any = None) -> int:
    """This process's rank in `group` (default: the world), refused without a process group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("all_reduce needs an initialised process group (torch.distributed)")
    return dist.get_rank(group)


def merge_groups(group: Any = None, mesh: Any = None, mesh_dims: Any = None) -> list[Any]:
    """The process groups to merge over, one after another: `group` (default: the world), or
    one per chosen dimension of `mesh` (names or indices; default: every dimension).

    Merging over each dimension in turn merges over all of them: merges are associative."""
    process_group_rank()
    if mesh is None:
        if mesh_dims is not None:
            raise ValueError("mesh_dims: give it with mesh=, the DeviceMesh it names dimensions of")
        return [group]
    if group is not None:
        raise ValueError("give group= or mesh=, not both")
    names = list(mesh.mesh_dim_names or ())
    chosen = range(mesh.ndim) if mesh_dims is None else mesh_dims
    chosen = [chosen] if isinstance(chosen, str | int) else list(chosen)
    dims = []
    for dim in chosen:
        if isinstance(dim, str) and dim in names:
            dims.append(names.index(dim))
        elif isinstance(dim, int) and not isinstance(dim, bool) and -mesh.ndim <= dim < mesh.ndim:
            dims.append(dim % mesh.ndim)
        else:
            raise ValueError(
                f"mesh_dims: {dim!r} is not a dimension of the mesh (names {names}, "
                f"{mesh.ndim} dimensions)"
            )
    if len(set(dims)) != len(dims) or not dims:
        raise ValueError(f"mesh_dims: give each dimension once, at least one; got {chosen}")
    return [mesh.get_group(d) for d in dims]


def group_ranks(group: Any) -> list[int]:
    """The global ranks of `group` (None: the world), in group order."""
    import torch.distributed as dist

    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def digest(value: Any) -> int:
    """A 56-bit digest of a JSON-able value or a tensor's bytes, to compare over ranks."""
    data = (
        value.contiguous().cpu().numpy().tobytes()
        if isinstance(value, torch.Tensor)
        else json.dumps(value, sort_keys=True).encode()
    )
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def differ(keys: list[int], device: torch.device, group: Any) -> list[bool]:
    """Whether each key differs over the ranks of `group`: one small reduction."""
    import torch.distributed as dist

    both = torch.tensor(keys + [-k for k in keys], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    lowest, highest = both[: len(keys)], -both[len(keys) :]
    return (lowest != highest).tolist()


def gathered(value: Any, group: Any) -> list[Any]:
    """Every rank's `value` (a small Python object), in group order."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def union_of_ranks(ranks: set[int], device: torch.device, group: Any) -> frozenset[int]:
    """The union over the ranks of `group` of sets of global ranks: one reduction of a bit per
    rank of the world."""
    import torch.distributed as dist

    bits = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    bits[sorted(ranks)] = 1
    dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=group)
    return frozenset(torch.nonzero(bits).reshape(-1).tolist())
