"""Merging the statistics that each rank of a distributed run recorded from its own shard."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .layout import COUNT, M2, M3, M4, MAX, MEAN, MIN, NEAR_ZERO, NONFINITE, STATE_PLANES
from .moments import finalise

if TYPE_CHECKING:
    from .buffers import StatBuffers


def reduce_state(state: torch.Tensor, group: Any = None) -> torch.Tensor:
    """The merge over every rank of `group` of merge states `(planes, ...)`, on every rank, in
    reductions the size of the state: one sum of the counts and sums (with the near-zero and
    non-finite counts, and which extremes are NaN), one sum of the central power sums taken
    about the global mean (the parallel-axis rule: exact as merging pairwise, within float64
    rounding), and one minimum of the minima and negated maxima. A slot that is empty on a rank
    adds nothing there (tested against one process in tests/test_distributed.py).
    """
    import torch.distributed as dist

    full = state.shape[0] == len(STATE_PLANES)
    count = state[COUNT]
    empty = count == 0
    mean = torch.where(empty, 0.0, state[MEAN])
    first = [count, count * mean]
    if full:
        low, high = state[MIN], state[MAX]
        first += [state[NEAR_ZERO], state[NONFINITE], low.isnan().double(), high.isnan().double()]
    totals = torch.stack(first)
    dist.all_reduce(totals, group=group)
    total = totals[0]
    center = torch.where(total > 0, totals[1] / total, 0.0)
    d = torch.where(empty, 0.0, mean - center)
    m2 = state[M2]
    powers = [m2 + count * d * d]
    if full:
        m3 = state[M3]
        powers += [
            m3 + 3.0 * d * m2 + count * d**3,
            state[M4] + 4.0 * d * m3 + 6.0 * d * d * m2 + count * d**4,
        ]
    sums = torch.stack(powers)
    dist.all_reduce(sums, group=group)
    planes = [total, center, sums[0]]
    if full:
        inf = torch.full_like(low, float("inf"))
        extremes = torch.stack(
            [
                torch.where(empty | low.isnan(), inf, low),
                torch.where(empty | high.isnan(), inf, -high),
            ]
        )
        dist.all_reduce(extremes, op=dist.ReduceOp.MIN, group=group)
        nan = torch.full_like(low, float("nan"))
        planes += [
            sums[1],
            sums[2],
            torch.where(totals[4] > 0, nan, extremes[0]),
            torch.where(totals[5] > 0, nan, -extremes[1]),
            totals[2],
            totals[3],
        ]
    merged = torch.stack(planes)
    return torch.where(total > 0, merged, torch.zeros_like(merged))


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

    A small shape check first, so that ranks that recorded different columns fail with a clear
    error instead of hanging; then reductions whose size is the state's, whatever the number of
    ranks (`reduce_state`), one sum of the histogram counts when a histogram is recorded, and
    one all-gather of the call order when it is kept (an int64 pair per slot). The rows in
    `replicas` (this rank's copy of a tensor that another rank holds too) add nothing, so each
    piece counts once.
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
    merged = reduce_state(state[:, :, :n].clone().index_fill_(1, rows, 0.0), group)
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
