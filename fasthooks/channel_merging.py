"""`all_reduce` of per-channel snapshots: those not merged before, summed over the ranks by module
name (largest magnitudes by their maximum, NaN kept), each rank ending with the same sums."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch

from .channel_stats import ChannelSnapshots, Snapshot
from .distributed import group_ranks
from .layout import CHANNEL_ABSMAX, CHANNEL_PLANES

_SUMMED = [p for p in range(len(CHANNEL_PLANES)) if p != CHANNEL_ABSMAX]


def _own(snapshots: ChannelSnapshots, names: list[str], sharded: set[int]) -> dict[str, Any]:
    """What a rank tells the others: the bounds of its unmerged snapshots, each module's channel
    count by name, and the modules whose outputs were DTensors."""
    fresh = [s for s in snapshots.ready() if not s.merged]
    counts: dict[str, int] = {}
    for s in fresh:
        for row, count in enumerate(s.counts):
            counts[names[row]] = max(counts.get(names[row], 0), count)
    return {
        "bounds": [(s.first, s.last) for s in fresh],
        "counts": counts,
        "sharded": sorted(names[row] for row in sharded if row < len(names)),
    }


def _disagreement(told: list[dict[str, Any]], ranks: list[int]) -> str | None:
    """Why the ranks' snapshots cannot merge, the same words on every rank (None: they can)."""
    for rank, other in zip(ranks[1:], told[1:], strict=True):
        if other["bounds"] != told[0]["bounds"]:
            return (
                "all_reduce: ranks hold different per-channel snapshots to merge: rank "
                f"{ranks[0]} the batches {told[0]['bounds']}, rank {rank} {other['bounds']} "
                "(give every rank the same channel_every and close the same batches)"
            )
    sharded = sorted(set().union(*(t["sharded"] for t in told)))
    if sharded:
        return (
            "all_reduce: per-channel statistics of DTensor outputs do not merge yet: "
            f"{sharded}; leave them out of modules=, or record without channel_stats"
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
    return None


def merge_snapshots(
    snapshots: ChannelSnapshots,
    names: list[str],
    sharded: set[int],
    groups: list[Any],
    device: torch.device,
) -> None:
    """Merge the snapshots not merged before over each of `groups` in turn, on `device` (the
    run's); every rank of a group must hold the same ones (else each raises the same
    ValueError). `names`: the rows, this rank's own first; `sharded`: the rows recorded from
    DTensor pieces."""
    import torch.distributed as dist

    for g in groups:
        ranks = group_ranks(g)
        told: list[Any] = [None] * len(ranks)
        dist.all_gather_object(told, _own(snapshots, names, sharded), group=g)
        problem = _disagreement(told, ranks)
        if problem is not None:
            raise ValueError(problem)
        counts: dict[str, int] = {}
        for t in told:
            for name, count in t["counts"].items():
                counts[name] = max(counts.get(name, 0), count)
        _reduce(snapshots, names, counts, g, device)
    # Merged once over every group: a later all_reduce leaves them as they are.
    snapshots.held = type(snapshots.held)(
        (s._replace(merged=True) for s in snapshots.held), maxlen=snapshots.held.maxlen
    )


def _reduce(
    snapshots: ChannelSnapshots,
    names: list[str],
    counts: dict[str, int],
    group: Any,
    device: torch.device,
) -> None:
    """Sum the unmerged snapshots over `group` in one layout every rank shares (the names
    sorted), then keep each in this rank's row order."""
    import torch.distributed as dist

    held = list(snapshots.ready())
    fresh = [k for k, s in enumerate(held) if not s.merged]
    if not fresh:
        return
    shared = sorted(counts)
    start = dict(zip(shared, accumulate((counts[n] for n in shared), initial=0), strict=False))
    total = sum(counts.values())
    flat = torch.zeros(len(fresh), len(CHANNEL_PLANES), total, dtype=torch.float64, device=device)
    for i, k in enumerate(fresh):
        s = held[k]
        for row, (offset, count) in enumerate(zip(s.offsets, s.counts, strict=True)):
            if count:
                at = start[names[row]]
                flat[i, :, at : at + count] = s.sums[:, offset : offset + count].to(device)
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
        [torch.arange(start[n], start[n] + c) for n, c in zip(names, rows, strict=True) if c]
        or [torch.zeros(0, dtype=torch.int64)]
    ).to(device)
    for i, k in enumerate(fresh):
        s = held[k]
        sums = flat[i].index_select(1, order).cpu()
        held[k] = Snapshot(sums, tuple(offsets), tuple(rows), s.first, s.last, s.batches)
    snapshots.held.clear()
    snapshots.held.extend(held)
