"""Whose values each rank's per-channel sums hold, so that `all_reduce` counts every value once:
a DTensor piece's replicas name one source, a plain output the same on every rank of the
tensor-parallel mesh is a replica too, and a plain output that differs there is a rank's own
shard of the features, whose channels are its own and do not merge with another shard's."""

from __future__ import annotations

from typing import Any

import torch

from .dtensors import Piece


class Sources:
    """For each row's name: the ranks whose values this rank's sums hold (`held`; none for a
    name it holds no sums of), and for a plain output that is a shard of the features, this
    rank's place on the tensor-parallel mesh (`shards`)."""

    def __init__(
        self,
        names: list[str],
        pieces: dict[int, Piece],
        me: int,
        replicas: set[str],
        shards: dict[str, int],
        mesh_lowest: int | None,
    ) -> None:
        self.held: dict[str, frozenset[int]] = {}
        for row, name in enumerate(names):
            piece = pieces.get(row)
            lowest = mesh_lowest if name in replicas else None
            if piece is not None:
                lowest = piece.lowest(me)
            self.held[name] = frozenset({me if lowest is None else lowest})
        self.shards = shards

    def told(self, counts: dict[str, int]) -> dict[str, Any]:
        """What this rank tells the others of the rows it holds sums of (`counts` by name)."""
        return {
            "sources": {name: sorted(self.held[name]) for name, count in counts.items() if count},
            "shards": {name: self.shards[name] for name in counts if name in self.shards},
        }

    def merged(self, told: list[dict[str, Any]]) -> None:
        """Whose values each name's sums hold once the group's are merged: the union of the
        group's, of those at this rank's place for a shard of the features."""
        mine = self.shards
        union: dict[str, frozenset[int]] = {}
        for t in told:
            for name, source in t["sources"].items():
                if name in mine and t["shards"].get(name) != mine[name]:
                    continue
                union[name] = union.get(name, frozenset()) | frozenset(source)
        self.held.update(union)


def places(told: list[dict[str, Any]]) -> dict[str, int]:
    """The names that are shards of the features at more than one place of the tensor-parallel
    mesh among the group's ranks, with how many places: their channels are each place's own,
    so they merge place by place."""
    seen: dict[str, set[int]] = {}
    for t in told:
        for name, place in t["shards"].items():
            seen.setdefault(name, set()).add(place)
    return {name: max(p) + 1 for name, p in seen.items() if len(p) > 1}


def silent(told: list[dict[str, Any]], ranks: list[int], me: int) -> set[str]:
    """The names whose sums this rank leaves out of the group's merge: a lower rank of the group
    holds the same values (a replica)."""
    mine = told[ranks.index(me)]["sources"]
    lower = [t["sources"] for r, t in zip(ranks, told, strict=True) if r < me]
    return {name for name, s in mine.items() if any(other.get(name) == s for other in lower)}


def overlap(told: list[dict[str, Any]], ranks: list[int]) -> str | None:
    """Why two ranks' sums of a name cannot merge (some values in both, not all), or None."""
    held: dict[str, list[tuple[int, set[int]]]] = {}
    for rank, t in zip(ranks, told, strict=True):
        for name, source in t["sources"].items():
            for other, theirs in held.setdefault(name, []):
                if theirs != set(source) and theirs & set(source):
                    return (
                        f"all_reduce: {name}'s per-channel sums on rank {other} hold the values "
                        f"of ranks {sorted(theirs)}, on rank {rank} of {source}: merging them "
                        "would count some values twice (merge over groups that each hold every "
                        "rank once)"
                    )
            held[name].append((rank, set(source)))
    return None


def plain_outputs(
    flat: torch.Tensor, plain: dict[str, tuple[int, int]], mesh: Any
) -> tuple[set[str], dict[str, int]]:
    """The plain rows the same on every rank of the 1-D tensor-parallel `mesh` (replicas: its
    ranks see the same batch), and the others with this rank's place on it (shards of the
    features). `flat`: the sums of every fresh snapshot in a layout the mesh's ranks share,
    `plain[name]` the start and count of a plain row's channels in it."""
    import torch.distributed as dist

    group = mesh.get_group()
    state = flat.nan_to_num(nan=float("inf"))
    low, high = state.clone(), state.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    # Within a rounding: a GPU's per-channel sums add in no fixed order.
    same = torch.isclose(low, high, rtol=1e-9, atol=0.0).all(0).all(0)  # by channel
    replicas, shards = set(), {}
    place = mesh.get_local_rank()
    for name, (start, count) in plain.items():
        if bool(same[start : start + count].all()):
            replicas.add(name)
        else:
            shards[name] = place
    return replicas, shards
