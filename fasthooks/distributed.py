"""Merging the statistics that each rank of a distributed run recorded from its own shard."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .moments import finalise, merge

if TYPE_CHECKING:
    from .buffers import StatBuffers


def process_group_rank(group: Any = None) -> int:
    """This process's rank in `group` (default: the world), refused without a process group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("all_reduce needs an initialised process group (torch.distributed)")
    return dist.get_rank(group)


def all_reduce(
    buffers: StatBuffers, n: int, group: Any = None, replicas: Any = ()
) -> tuple[torch.Tensor, int]:
    """Replace the first `n` columns of every buffer by the merge of all ranks' columns, on every
    rank; returns every rank's call order `(ranks, 2, rows, n)` on the CPU (empty without one),
    and this rank.

    Four collectives: a small shape check (so that ranks that recorded different columns fail
    with a clear error instead of hanging), one all-gather of the float64 merge state (merged in
    rank order with the operator's pairwise rule: exact counts, means and central moments for
    shards of any size), one of the call order when it is kept, and one sum of the histogram
    counts when a histogram is recorded. The rows in `replicas` (this rank's copy of a tensor
    that another rank holds too) add nothing, so each piece counts once.
    """
    import torch.distributed as dist

    rank = process_group_rank(group)
    state = buffers.state
    shape = (n, state.shape[0], state.shape[1], buffers.hist_bins)
    world = dist.get_world_size(group)
    header = torch.tensor(shape, dtype=torch.int64, device=state.device)
    headers = [torch.empty_like(header) for _ in range(world)]
    dist.all_gather(headers, header, group=group)
    shapes = [tuple(h.tolist()) for h in headers]
    if any(s != shapes[0] for s in shapes):
        raise ValueError(
            "all_reduce: ranks recorded different statistics (batches, state planes, rows, "
            f"histogram bins) by rank: {shapes}; every rank must record the same modules (or "
            "parameters) with the same options and close the same number of columns"
        )
    rank_orders = torch.zeros((world, 2, state.shape[1], n), dtype=torch.int64)
    if n == 0:
        return rank_orders, rank
    if buffers.ordered:
        order = buffers.order[:, :, :n].contiguous()
        orders = [torch.empty_like(order) for _ in range(world)]
        dist.all_gather(orders, order, group=group)
        rank_orders = torch.stack(orders).cpu()
    rows = torch.tensor(sorted(replicas), dtype=torch.int64, device=state.device)
    recorded = state[:, :, :n].clone().index_fill_(1, rows, 0.0)
    gathered = [torch.empty_like(recorded) for _ in range(world)]
    dist.all_gather(gathered, recorded, group=group)
    merged = gathered[0]
    for other in gathered[1:]:
        merged = merge(merged, other)
    stats, extra = finalise(merged)
    state[:, :, :n] = merged
    buffers.stats[:, :, :n] = stats
    if extra is not None:
        buffers.extra[:, :, :n] = extra
    if buffers.hist_bins:
        counts = buffers.hist[:, :n].clone().index_fill_(0, rows, 0)
        dist.all_reduce(counts, group=group)
        buffers.hist[:, :n] = counts
    return rank_orders, rank
