"""`all_reduce` of per-channel snapshots: those not merged before, summed over the ranks by module
name (largest magnitudes by their maximum, NaN kept), each rank ending with the same sums."""

from __future__ import annotations

import warnings
from itertools import accumulate
from typing import Any

import torch

from .channel_sources import Sources, overlap, places, plain_outputs, silent
from .channel_stats import ChannelSnapshots, Snapshot
from .distributed import group_ranks
from .dtensors import Piece
from .layout import CHANNEL_ABSMAX, CHANNEL_PLANES

_SUMMED = [p for p in range(len(CHANNEL_PLANES)) if p != CHANNEL_ABSMAX]


def _own(snapshots: ChannelSnapshots, names: list[str]) -> dict[str, Any]:
    """What a rank tells the others: the bounds of its unmerged snapshots and each module's
    channel count by name."""
    counts: dict[str, int] = {}
    for s in _fresh(snapshots):
        for row, count in enumerate(s.counts):
            counts[names[row]] = max(counts.get(names[row], 0), count)
    return {"bounds": [(s.first, s.last) for s in _fresh(snapshots)], "counts": counts}


def _fresh(snapshots: ChannelSnapshots) -> list[Snapshot]:
    return [s for s in snapshots.ready() if not s.merged]


def _disagreement(told: list[dict[str, Any]], ranks: list[int]) -> str | None:
    """Why the ranks' snapshots cannot merge, the same words on every rank (None: they can)."""
    for rank, other in zip(ranks[1:], told[1:], strict=True):
        if other["bounds"] != told[0]["bounds"]:
            return (
                "all_reduce: ranks hold different per-channel snapshots to merge: rank "
                f"{ranks[0]} the batches {told[0]['bounds']}, rank {rank} {other['bounds']} "
                "(give every rank the same channel_every and close the same batches)"
            )
    seen: dict[str, tuple[int, int]] = {}
    for rank, t in zip(ranks, told, strict=True):
        for name, count in t["counts"].items():
            first = seen.setdefault(name, (rank, count))
            if count and first[1] and count != first[1]:
                return (
                    f"all_reduce: {name} has {first[1]} channels on rank {first[0]} and {count} "
                    f"on rank {rank}: its per-channel statistics do not merge"
                )
            if count and not first[1]:
                seen[name] = (rank, count)
    return overlap(told, ranks)


def merge_snapshots(
    snapshots: ChannelSnapshots,
    names: list[str],
    pieces: dict[int, Piece],
    groups: list[Any],
    device: torch.device,
    mesh: Any = None,
) -> None:
    """Merge the snapshots not merged before over each of `groups` in turn, on `device` (the
    run's); every rank of a group must hold the same ones (else each raises the same
    ValueError). `names`: the rows, this rank's own first; `pieces`: what each row recorded
    from a DTensor's piece holds, so that replicas count once (a piece sharded along the
    channels holds only its own channels, named as in the whole tensor); `mesh`: the
    tensor-parallel mesh the DTensors came from, over which a plain output is a replica or a
    rank's own shard of the features."""
    import torch.distributed as dist

    me = dist.get_rank()
    spanned = set().union(*(group_ranks(g) for g in groups))
    replicas, shards = _plain_on_mesh(snapshots, names, pieces, mesh, spanned, device)
    lowest = None if mesh is None else int(mesh.mesh.min())
    sources = Sources(names, pieces, me, replicas, shards, lowest)
    own_only: set[str] = set()
    for g in groups:
        ranks = group_ranks(g)
        own = _own(snapshots, names)
        own.update(sources.told(own["counts"]))
        told: list[Any] = [None] * len(ranks)
        dist.all_gather_object(told, own, group=g)
        problem = _disagreement(told, ranks)
        if problem is not None:
            raise ValueError(problem)
        counts: dict[str, int] = {}
        for t in told:
            for name, count in t["counts"].items():
                counts[name] = max(counts.get(name, 0), count)
        split = places(told)
        at = {name: (n, sources.shards.get(name, 0)) for name, n in split.items()}
        _reduce(snapshots, names, counts, silent(told, ranks, me), at, g, device)
        sources.merged(told)
        own_only |= set(split)
    if own_only:
        warnings.warn(
            f"all_reduce: the per-channel statistics of {sorted(own_only)} are each "
            "tensor-parallel rank's own shard of the features, merged with those at the same "
            "place of the mesh only: a plain module fed a rank's shard names its own channels, "
            "not the whole tensor's (hand it a DTensor, use_local_output=False, to merge them)",
            RuntimeWarning,
            stacklevel=3,
        )
    # Merged once over every group: a later all_reduce leaves them as they are.
    snapshots.held = type(snapshots.held)(
        (s._replace(merged=True) for s in snapshots.held), maxlen=snapshots.held.maxlen
    )


def _plain_on_mesh(
    snapshots: ChannelSnapshots,
    names: list[str],
    pieces: dict[int, Piece],
    mesh: Any,
    spanned: set[int],
    device: torch.device,
) -> tuple[set[str], dict[str, int]]:
    """The plain rows that are replicas over the 1-D tensor-parallel `mesh`, and those that
    are shards of the features with this rank's place on it (none when the merge does not span
    the mesh, or its ranks hold other snapshots: the merge then says so)."""
    import torch.distributed as dist

    if mesh is None or mesh.ndim != 1 or not set(mesh.mesh.reshape(-1).tolist()) <= spanned:
        return set(), {}
    group = mesh.get_group()
    own = _own(snapshots, names)
    plain = {
        n: c for row, n in enumerate(names) if row not in pieces and (c := own["counts"].get(n))
    }
    told: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, (own["bounds"], plain), group=group)
    if any(t != told[0] for t in told):
        return set(), {}
    start = _starts(plain)
    flat = _flat(_fresh(snapshots), names, plain, start, {}, set(), device)
    return plain_outputs(flat, {n: (start[n], c) for n, c in plain.items()}, mesh)


def _starts(counts: dict[str, int]) -> dict[str, int]:
    """Where each name's channels start in the layout every rank shares: the names sorted."""
    shared = sorted(counts)
    return dict(zip(shared, accumulate((counts[n] for n in shared), initial=0), strict=False))


def _flat(
    fresh: list[Snapshot],
    names: list[str],
    widths: dict[str, int],
    start: dict[str, int],
    shift: dict[str, int],
    left_out: set[str],
    device: torch.device,
) -> torch.Tensor:
    """float64 `(snapshots, planes, channels)`: the sums of `fresh` in the shared layout (a
    name's `widths` channels from `start`, this rank's `shift` of them on), zero for names
    `left_out` and those this rank does not hold."""
    flat = torch.zeros(
        len(fresh), len(CHANNEL_PLANES), sum(widths.values()), dtype=torch.float64, device=device
    )
    for i, s in enumerate(fresh):
        for row, (offset, count) in enumerate(zip(s.offsets, s.counts, strict=True)):
            name = names[row]
            if count and name in widths and name not in left_out:
                at = start[name] + shift.get(name, 0)
                flat[i, :, at : at + count] = s.sums[:, offset : offset + count].to(device)
    return flat


def _reduce(
    snapshots: ChannelSnapshots,
    names: list[str],
    counts: dict[str, int],
    silent: set[str],
    split: dict[str, tuple[int, int]],
    group: Any,
    device: torch.device,
) -> None:
    """Sum the unmerged snapshots over `group` in one layout every rank shares (the names
    sorted), this rank's sums of `silent` names left out, and those of each `split` name
    (places, this rank's place) beside the others' places, summed with those at its own; then
    keep each in this rank's row order."""
    import torch.distributed as dist

    held = list(snapshots.ready())
    fresh = [k for k, s in enumerate(held) if not s.merged]
    if not fresh:
        return
    widths = {n: c * split[n][0] if n in split else c for n, c in counts.items()}
    shift = {n: counts[n] * place for n, (_, place) in split.items()}
    start = _starts(widths)
    flat = _flat([held[k] for k in fresh], names, widths, start, shift, silent, device)
    summed = flat[:, _SUMMED].contiguous()
    dist.all_reduce(summed, group=group)
    # Magnitudes are at least 0 or NaN: as int64 bits their order is theirs, NaN above all.
    largest = flat[:, CHANNEL_ABSMAX]
    largest = torch.where(largest.isnan(), float("nan"), largest).contiguous().view(torch.int64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    flat[:, _SUMMED] = summed
    flat[:, CHANNEL_ABSMAX] = largest.view(torch.float64)
    rows = [counts.get(name, 0) for name in names]
    offsets = list(accumulate(rows, initial=0))[:-1]
    order = torch.cat(
        [
            torch.arange(start[n] + shift.get(n, 0), start[n] + shift.get(n, 0) + c)
            for n, c in zip(names, rows, strict=True)
            if c
        ]
        or [torch.zeros(0, dtype=torch.int64)]
    ).to(device)
    for i, k in enumerate(fresh):
        s = held[k]
        sums = flat[i].index_select(1, order).cpu()
        held[k] = Snapshot(sums, tuple(offsets), tuple(rows), s.first, s.last, s.batches)
    snapshots.held.clear()
    snapshots.held.extend(held)
