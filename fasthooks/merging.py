"""`all_reduce` of a recorder's columns: both recorders' rows merged by name over process groups
(or the dimensions of a device mesh), only the columns asked, each piece of every tensor counted
once, with memory and traffic per rank the size of the merged columns whatever the world size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .buffers import StatBuffers
from .column_store import ColumnStore
from .distributed import (
    differ,
    digest,
    gathered,
    group_ranks,
    merge_groups,
    reduce_state,
    union_of_ranks,
)
from .dtensors import Piece
from .layout import TOP_CHANNEL, TOP_VALUE
from .moments import finalise

_NONE = torch.iinfo(torch.int64).max  # the order key of a slot with no non-finite value


@dataclass
class Rows:
    """What a recorder says of its rows for a merge: their names and types, the piece each DTensor
    row holds, and whether a plain row holds the same values on every rank that has it (a
    parameter under data parallelism) or its own (an activation of its own batch)."""

    names: list[str]
    types: list[str]
    pieces: dict[int, Piece]
    plain_replicated: bool
    settings: dict[str, Any]
    # The mesh of tensor parallelism, whose ranks see the same batch: a plain row whose values
    # there are the same on all of them (its merge states are equal) is one tensor.
    replica_mesh: Any = None


@dataclass
class Merged:
    """The columns merged so far, kept by a recorder between merges: which ranks' values each
    column holds (by batch; absent: this rank's own), and the rank of each merged slot's first
    non-finite call, by (batch, row name)."""

    holders: dict[int, frozenset[int]] = field(default_factory=dict)
    nonfinite_ranks: dict[tuple[int, str], int] = field(default_factory=dict)


def all_reduce(
    store: ColumnStore,
    rows: Rows,
    merged: Merged,
    group: Any = None,
    mesh: Any = None,
    mesh_dims: Any = None,
    batches: Any = None,
) -> None:
    """Merge the columns of `batches` (default: every column held) over `group`, or over the
    chosen `mesh_dims` of `mesh` one after another, on every rank of them. A name that only
    other ranks recorded gets a row here (added to `rows` and the store): the union by name."""
    import torch.distributed as dist

    groups = merge_groups(group, mesh, mesh_dims)
    store.send_closed()
    # A rank's own mistake (a batch it does not hold) is told to the others through the
    # agreement's digests, so that every rank raises instead of some waiting forever.
    try:
        ids, columns = _chosen_columns(store, batches)
        problem = None
    except ValueError as error:
        ids, columns, problem = [], [], str(error)
    me, world = dist.get_rank(), dist.get_world_size()
    device = next(iter(store.buffers.values())).state.device
    merged.holders = {b: merged.holders[b] for b in store.batches.tolist() if b in merged.holders}
    winners = _winners(rows, merged, ids, me, device)
    spanned = set().union(*(group_ranks(g) for g in groups))
    replicas = None
    for step, g in enumerate(groups):
        agreed = _agree(store, rows, merged, ids, g, device, problem)
        if step == 0:  # before any merge; the tensor-parallel ranks check among themselves
            replicas = _plain_replicas(store, rows, columns, spanned, not isinstance(agreed, str))
        if isinstance(agreed, str):
            problem = agreed
            continue
        holders, shared_order = agreed
        chosen = Selection(columns, shared_order, device)
        contributes = _contributions(rows, merged, ids, group_ranks(g), holders, me, replicas)
        contributes = contributes.to(device)
        winners = _grown(winners, len(rows.names), me)
        for b in store.buffers.values():
            winners = _reduce_columns(b, chosen, contributes, winners, g, world)
        _note_holders(merged, ids, me, device, g)
    store.reset_host()
    if problem is not None:
        raise ValueError(problem)
    _note_nonfinite_ranks(store, rows, merged, ids, winners)


def _chosen_columns(store: ColumnStore, batches: Any) -> tuple[list[int], list[int]]:
    """The batch indices to merge and the columns holding them."""
    held = store.batches.tolist()
    physical = store.window.columns(store.num_batches)
    if batches is None:
        return held, physical
    if isinstance(batches, torch.Tensor):
        batches = batches.tolist()
    elif isinstance(batches, int):
        batches = [batches]
    position = {b: i for i, b in enumerate(held)}
    chosen = []
    for b in batches:
        if not isinstance(b, int) or b not in position:
            raise ValueError(
                f"batches: {b!r} is not a batch held (the held ones are act.batches: "
                f"{held[:3]}...{held[-3:]})"
                if len(held) > 6
                else f"batches: {b!r} is not a batch held (the held ones: {held})"
            )
        chosen.append(b)
    if len(set(chosen)) != len(chosen):
        raise ValueError("batches: give each batch once")
    return chosen, [physical[position[b]] for b in chosen]


def _describe(store: ColumnStore, rows: Rows, ids: list[int]) -> dict[str, Any]:
    """What must be the same on every rank for a merge (names aside)."""
    held = f"{len(ids)} batches" + (f" ({ids[0]}..{ids[-1]})" if ids else "")
    mesh = None if rows.replica_mesh is None else list(rows.replica_mesh.shape)
    return {**rows.settings, "kinds": list(store.buffers), "merged": held, "tp_mesh": mesh}


def _agree(
    store: ColumnStore,
    rows: Rows,
    merged: Merged,
    ids: list[int],
    group: Any,
    device: torch.device,
    problem: str | None = None,
) -> tuple[dict[str, list[int]] | None, list[int]] | str:
    """Check that every rank of `group` merges the same columns with the same options, and has
    no `problem` of its own; when their names differ, add a row for each name only others
    recorded. Returns which ranks hold each name (None: every rank holds every name, in the same
    order) and the order of this rank's rows that every rank shares; or, on every rank when they
    disagree, the message that says how (never a hang).

    One reduction of two digests; only when the names differ, one gather of the names."""
    described = {**_describe(store, rows, ids), **({"error": problem} if problem else {})}
    pattern = [_class_index(merged, ids)]
    settings = digest([digest(described), digest(torch.tensor(ids)), pattern])
    settings_differ, names_differ = differ([settings, digest(rows.names)], device, group)
    if settings_differ:
        every = gathered(described, group)
        by_rank = "; ".join(
            f"rank {r}: {d}" for r, d in zip(group_ranks(group), every, strict=True)
        )
        message = (
            "all_reduce: ranks recorded different statistics or merge different batches "
            f"({by_rank}); every rank must record with the same options and merge the same "
            "batches (close the same number of columns, give the same batches=)"
        )
        return message
    if not names_differ:
        return None, list(range(len(rows.names)))
    every = gathered(list(zip(rows.names, rows.types, strict=True)), group)
    holders: dict[str, list[int]] = {}
    for rank, named in zip(group_ranks(group), every, strict=True):
        for name, kind in named:
            if name not in holders and name not in rows.names:
                rows.names.append(name)
                rows.types.append(kind)
            holders.setdefault(name, []).append(rank)
    store.add_rows(len(rows.names))
    row = {name: i for i, name in enumerate(rows.names)}
    return holders, [row[name] for name in holders]  # in order of first holder, on every rank


def _class_index(merged: Merged, ids: list[int]) -> list[int]:
    """For each column, the index of its set of holders among those met so far."""
    seen: dict[frozenset[int] | None, int] = {}
    return [seen.setdefault(merged.holders.get(b), len(seen)) for b in ids]


def _plain_replicas(
    store: ColumnStore, rows: Rows, columns: list[int], spanned: set[int], ready: bool
) -> torch.Tensor | None:
    """bool `(rows, columns)`: the plain rows' slots whose merge state is the same on every
    rank of `rows.replica_mesh` (two reductions the size of the state), or None without one,
    when the merge does not span that mesh, or when its ranks are not all `ready` (one small
    reduction among them says so first)."""
    import torch.distributed as dist

    mesh = rows.replica_mesh
    if mesh is None or mesh.ndim != 1 or not set(mesh.mesh.reshape(-1).tolist()) <= spanned:
        return None
    group = mesh.get_group()
    state = next(b for b in store.buffers.values()).state
    ready_key = digest([ready, len(columns), list(state.shape[:2])])
    if differ([ready_key], state.device, group)[0] or not ready:  # every one of them asks
        return None
    chosen = Selection(columns, [], state.device).take(state, 2).nan_to_num(nan=float("inf"))
    low, high = chosen.clone(), chosen.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    same = (low == high).all(0)
    plain = torch.tensor([row not in rows.pieces for row in range(len(rows.names))])
    return (same & plain.to(same.device)[:, None]).cpu()


def _contributions(
    rows: Rows,
    merged: Merged,
    ids: list[int],
    ranks: list[int],
    holders: dict[str, list[int]] | None,
    me: int,
    replicas: torch.Tensor | None,
) -> torch.Tensor:
    """bool `(rows, columns)`: whether this rank's value of each slot is added to the merge:
    of the ranks holding the same values (the same columns merged before, the same piece of a
    DTensor, a plain parameter's replica, a plain output the same on every rank of the
    tensor-parallel mesh), only the lowest."""
    whole = (
        Piece(rows.replica_mesh, (0,), outside_replicated=False) if replicas is not None else None
    )
    by_class: dict[frozenset[int] | None, tuple[torch.Tensor, torch.Tensor]] = {}
    for b in ids:
        together = merged.holders.get(b)
        if together not in by_class:
            by_class[together] = (
                _lowest(rows, together, ranks, holders, me, None),
                _lowest(rows, together, ranks, holders, me, whole),
            )
    if not ids:
        return torch.zeros(len(rows.names), 0, dtype=torch.bool)
    own = torch.stack([by_class[merged.holders.get(b)][0] for b in ids], 1)
    if replicas is None:
        return own
    replica = torch.stack([by_class[merged.holders.get(b)][1] for b in ids], 1)
    added = own.shape[0] - replicas.shape[0]  # rows of other ranks' names: empty here
    replicas = torch.cat([replicas, replicas.new_zeros(added, replicas.shape[1])])
    return torch.where(replicas, replica, own)


def _lowest(
    rows: Rows,
    together: frozenset[int] | None,
    ranks: list[int],
    holders: dict[str, list[int]] | None,
    me: int,
    plain_piece: Piece | None,
) -> torch.Tensor:
    """bool `(rows,)`: whether this rank is the lowest of those holding each row's values, a
    plain row's being `plain_piece` when given."""
    mask = torch.zeros(len(rows.names), dtype=torch.bool)
    for row, name in enumerate(rows.names):
        piece = rows.pieces.get(row, plain_piece)
        replicated = rows.plain_replicated and piece is None
        same = [
            r
            for r in (ranks if holders is None else holders[name])
            if r == me
            or (together is not None and r in together)
            or (piece is not None and piece.same(me, r))
            or replicated
        ]
        mask[row] = bool(same) and min(same) == me
    return mask


def _winners(
    rows: Rows, merged: Merged, ids: list[int], me: int, device: torch.device
) -> torch.Tensor:
    """int64 `(rows, columns)`: the rank of each slot's first non-finite call so far."""
    winners = torch.full((len(rows.names), len(ids)), me, dtype=torch.int64)
    for column, b in enumerate(ids):
        for row, name in enumerate(rows.names):
            rank = merged.nonfinite_ranks.get((b, name))
            if rank is not None:
                winners[row, column] = rank
    return winners.to(device)


def _grown(winners: torch.Tensor, rows: int, me: int) -> torch.Tensor:
    """`winners` with a row of this rank for each row added since."""
    more = rows - winners.shape[0]
    return (
        winners
        if more == 0
        else torch.cat([winners, winners.new_full((more, winners.shape[1]), me)])
    )


class Selection:
    """The merged columns of a buffer (a view when they are contiguous), and its rows in the
    order of their names, which every rank shares (none to reorder when they already are)."""

    def __init__(self, columns: list[int], canonical: list[int], device: torch.device) -> None:
        first = columns[0] if columns else 0
        contiguous = columns == list(range(first, first + len(columns)))
        self.start, self.length = first, len(columns)
        self.columns = None if contiguous else torch.tensor(columns, device=device)
        ordered = canonical == list(range(len(canonical)))
        self.rows = None if ordered else torch.tensor(canonical, device=device)

    def take(self, t: torch.Tensor, axis: int) -> torch.Tensor:
        """The chosen columns (along `axis`) of `t`, rows in this rank's order."""
        if self.columns is None:
            return t.narrow(axis, self.start, self.length)
        return t.index_select(axis, self.columns)

    def put(self, t: torch.Tensor, axis: int, values: torch.Tensor) -> None:
        """Write `values` into the chosen columns of `t`."""
        if self.columns is None:
            t.narrow(axis, self.start, self.length).copy_(values)
        else:
            t.index_copy_(axis, self.columns, values)

    def reduced(
        self, t: torch.Tensor, axis: int, reduce: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """`reduce` applied to `t` with its rows (along `axis`) in the order of their names."""
        if self.rows is None:
            return reduce(t.contiguous())
        out = reduce(t.index_select(axis, self.rows).contiguous())
        return torch.empty_like(out).index_copy_(axis, self.rows, out)


def _all_reduce(group: Any, op: Any = None) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch.distributed as dist

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=group)
        return t

    return reduce


def _reduce_columns(
    b: StatBuffers,
    chosen: Selection,
    contributes: torch.Tensor,
    winners: torch.Tensor,
    group: Any,
    world: int,
) -> torch.Tensor:
    """Merge the chosen columns of every buffer of `b` over `group`; returns the ranks of the
    first non-finite calls after it (`winners` when `b` keeps no call order)."""
    import torch.distributed as dist

    state = torch.where(contributes, chosen.take(b.state, 2), 0.0)
    state = chosen.reduced(state, 1, lambda t: reduce_state(t, group))
    chosen.put(b.state, 2, state)
    stats, extra = finalise(state)
    chosen.put(b.stats, 2, stats)
    if extra is not None:
        chosen.put(b.extra, 2, extra)
    for counted in ("hist", "binades"):  # summed over the ranks that contribute
        if getattr(b, counted).numel() > 0:
            counts = torch.where(contributes[..., None], chosen.take(getattr(b, counted), 1), 0)
            chosen.put(getattr(b, counted), 1, chosen.reduced(counts, 0, _all_reduce(group)))
    if b.top.numel() > 0:
        top = torch.where(contributes[..., None, None], chosen.take(b.top, 1), float("nan"))
        chosen.put(
            b.top,
            1,
            _reduce_top(top, lambda t, op=None: chosen.reduced(t, 0, _all_reduce(group, op))),
        )
    if not b.ordered:
        return winners
    first, count = chosen.take(b.order, 2)
    found = contributes & (first > 0)
    key = torch.where(found, (first - 1) * world + winners, _NONE)
    key = chosen.reduced(key, 0, _all_reduce(group, dist.ReduceOp.MIN))
    counted = count >= 0
    count = torch.where(contributes & counted, count, 0)
    count = chosen.reduced(count, 0, _all_reduce(group))
    first = torch.where(key == _NONE, 0, key // world + 1)
    chosen.put(b.order, 2, torch.stack([first, torch.where(counted, count, -1)]))
    return torch.where(key == _NONE, winners, key % world)


def _reduce_top(top: torch.Tensor, reduce: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The k pairs of largest rank (`moments.top_of`'s order) of the union of every rank's
    `top` `(rows, columns, k, 2)`, on every rank, in 3k reductions of `(rows, columns)`: each
    round takes the best pair left on any rank (its magnitude, then its sign and channel), with
    as many copies as the ranks hold of it together."""
    import torch.distributed as dist

    k = top.shape[-2]
    values, channels = top[..., TOP_VALUE], top[..., TOP_CHANNEL]
    negative = values.signbit()
    place = torch.arange(k, device=top.device)
    merged = torch.full_like(top, float("nan"))
    taken = torch.zeros(top.shape[:2], dtype=torch.int64, device=top.device)  # by this rank
    filled = torch.zeros_like(taken)
    low_bits = (1 << 32) - 1
    for _ in range(k):
        at = taken.clamp(max=k - 1)[..., None]
        value = torch.where(taken < k, values.gather(2, at)[..., 0], float("nan"))
        channel = channels.gather(2, at)[..., 0].nan_to_num(0.0).long()
        magnitude = torch.where(value.isnan(), -1.0, value.abs())
        best = reduce(magnitude.clone(), dist.ReduceOp.MAX)
        key = (~value.signbit()).long() << 32 | (low_bits - channel)
        key = reduce(torch.where(magnitude == best, key, -1), dist.ReduceOp.MAX)
        positive = (key >> 32) == 1
        win_value = torch.where(positive, best, -best)
        win_channel = (low_bits - (key & low_bits)).double()
        same = (
            (values == win_value[..., None])
            & (negative == ~positive[..., None])
            & (channels == win_channel[..., None])
            & (place >= taken[..., None])
        )
        copies = same.sum(-1)
        total = torch.where(best >= 0, reduce(copies.clone()), 0)
        fill = (place >= filled[..., None]) & (place < (filled + total)[..., None])
        merged[..., TOP_VALUE] = torch.where(fill, win_value[..., None], merged[..., TOP_VALUE])
        merged[..., TOP_CHANNEL] = torch.where(
            fill, win_channel[..., None], merged[..., TOP_CHANNEL]
        )
        filled = (filled + total).clamp(max=k)
        taken += copies
    return merged


def _note_holders(
    merged: Merged, ids: list[int], me: int, device: torch.device, group: Any
) -> None:
    """After a merge over `group`: each column holds the values of every rank its holders did."""
    unions: dict[frozenset[int] | None, frozenset[int]] = {}
    for b in ids:
        together = merged.holders.get(b)
        if together not in unions:
            unions[together] = union_of_ranks(together or {me}, device, group)
        merged.holders[b] = unions[together]


def _note_nonfinite_ranks(
    store: ColumnStore, rows: Rows, merged: Merged, ids: list[int], winners: torch.Tensor
) -> None:
    """Keep the rank of each merged slot's first non-finite call (the only slots it names)."""
    held = set(store.batches.tolist())
    ranks = {k: r for k, r in merged.nonfinite_ranks.items() if k[0] in held}
    ordered = [b for b in store.buffers.values() if b.ordered]
    if ordered and ids:
        first = store.read(next(k for k, b in store.buffers.items() if b.ordered), "order")[0]
        position = {b: i for i, b in enumerate(store.batches.tolist())}
        found = first[:, [position[b] for b in ids]] > 0
        winners = winners.cpu()
        for row, column in torch.nonzero(found).tolist():
            ranks[(ids[column], rows.names[row])] = int(winners[row, column])
    merged.nonfinite_ranks = ranks
