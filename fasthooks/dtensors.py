"""Distributed tensors (`torch.distributed.tensor.DTensor`: FSDP2's parameters and gradients,
tensor-parallel outputs) are recorded from their local piece, with what each piece is kept, so
that a merge over ranks counts every value of the whole tensor once."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch


def dtensor_type() -> type | None:
    """The DTensor class once torch.distributed.tensor is imported (before that, no tensor can
    be one), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a DTensor; one type check for a plain tensor.

    Examples:
        >>> is_dtensor(torch.ones(2))
        False
    """
    if type(t) is torch.Tensor:
        return False
    cls = dtensor_type()
    return cls is not None and isinstance(t, cls)


def describe_placements(t: torch.Tensor) -> str:
    """A DTensor's placements over the shape of its mesh: `"(Shard(dim=0),) on (2,)"`."""
    placements = ", ".join(repr(p) for p in t.placements)
    return f"({placements},) on {tuple(t.device_mesh.shape)}"


def is_partial(t: torch.Tensor) -> bool:
    """Whether a DTensor holds partial values on some mesh dimension (a sum still to be taken)."""
    return any(p.is_partial() for p in t.placements)


def reduced(t: torch.Tensor) -> torch.Tensor:
    """A DTensor with partial values summed over the ranks that hold parts of them (one
    all-reduce): the gradient of a parameter that sequence parallelism replicates."""
    from torch.distributed.tensor import Replicate

    return t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])


class Piece:
    """Which ranks hold the same values as this one: those whose coordinates on the mesh's root
    (the whole `DeviceMesh` it was sliced from) equal this rank's on every dimension that does
    not replicate the tensor.

    `replicated`: the replicating dimensions of `mesh`. The root's other dimensions replicate it
    too when `outside_replicated` (a parameter: FSDP2 shards it over data parallelism, and each
    tensor-parallel rank holds the same shard), else they hold other values (an activation:
    another batch).
    """

    def __init__(self, mesh: Any, replicated: tuple[int, ...], outside_replicated: bool) -> None:
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
        if root is mesh or names is None or root_names is None:
            root, inside = mesh, list(range(mesh.ndim))
        else:
            inside = [root_names.index(n) for n in names]
        same = {inside[d] for d in replicated}
        if outside_replicated:
            same |= set(range(root.ndim)) - set(inside)
        kept = [d for d in range(root.ndim) if d not in same]
        ranks = root.mesh.reshape(-1).tolist()
        coordinates = torch.stack(torch.unravel_index(torch.arange(len(ranks)), root.mesh.shape))
        keys = coordinates[kept].t().tolist() if kept else [[] for _ in ranks]
        self._key = dict(zip(ranks, map(tuple, keys), strict=True))
        self._lowest: dict[int, int | None] = {}

    def same(self, rank: int, other: int) -> bool:
        """Whether `other` holds the same values as `rank`."""
        key = self._key.get(rank)
        return key is not None and self._key.get(other) == key

    def lowest(self, rank: int) -> int | None:
        """The lowest rank holding the same values as `rank` (None: `rank` is not on the mesh);
        ranks with the same lowest one hold the same values."""
        if rank not in self._lowest:  # once per rank: a sink asks at every chunk
            key = self._key.get(rank)
            same = [r for r, k in self._key.items() if key is not None and k == key]
            self._lowest[rank] = min(same, default=None)
        return self._lowest[rank]

    @staticmethod
    def of(t: torch.Tensor, outside_replicated: bool) -> Piece:
        """The piece of a DTensor: replicated over its `Replicate` mesh dimensions."""
        replicated = tuple(d for d, p in enumerate(t.placements) if p.is_replicate())
        return Piece(t.device_mesh, replicated, outside_replicated)


class LocalPieces:
    """The local piece of each distributed tensor a recorder measures, with what each row's
    piece is (`Piece`, the first seen) and its placements, and one warning per row for partial
    values.

    What is recorded for a `Partial` placement: for a module's output, the rank's own partial
    values (a sum over ranks still to be taken), not the values, since reducing them would cost
    a collective on every call; for a parameter's gradient (sequence parallelism's norm
    weights), the reduced values, at one all-reduce of those gradients per recorded step.
    A tensor-parallel module that hands on a plain local tensor (`use_local_output=True`, the
    default of the built-in styles) is seen as a DTensor just before it does (`probe`): its
    output is a replica when the local tensor has the whole shape, else a shard.
    """

    def __init__(self, recorder: str, parameters: bool) -> None:
        self.recorder, self.parameters = recorder, parameters
        self.placements: dict[int, str] = {}  # by row
        self.pieces: dict[int, Piece] = {}  # by row: the ranks holding the same values
        self.mesh: Any = None  # the mesh of the first distributed tensor seen
        # Where each row's local piece lies in the whole tensor: its whole shape and the
        # piece's offset on every dimension, by row (rows recorded from DTensors only).
        self.extents: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        # A tensor-parallel module's DTensor output, by row: its mesh and whole shape.
        self._raw: dict[int, tuple[Any, tuple[int, ...]]] = {}

    @property
    def pending(self) -> bool:
        """Whether a tensor-parallel module's DTensor output awaits its local tensor: then a
        plain tensor goes through `local` too."""
        return bool(self._raw)

    def local(self, t: torch.Tensor, row: int, name: Callable[[], str]) -> torch.Tensor:
        """`t` itself, or its local piece when it is a DTensor (`name()` names row `row`)."""
        if not is_dtensor(t):
            if row in self._raw and row not in self.pieces:
                self._seen_local(t, row)
            return t
        self._raw.pop(row, None)
        if self.parameters and is_partial(t):
            t = reduced(t)
        if row not in self.placements:
            self.mesh = t.device_mesh if self.mesh is None else self.mesh
            self.placements[row] = describe_placements(t)
            self.pieces[row] = Piece.of(t, outside_replicated=self.parameters)
            self.extents[row] = extent(t)
            if is_partial(t):
                warnings.warn(
                    f"{self.recorder}: {name()} is a DTensor with partial values "
                    f"{self.placements[row]}: each rank records its own partial values, not "
                    "the reduced ones (redistribute it to Replicate or Shard to record values)",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return t.to_local()

    def probe(self, row: int) -> Callable[..., None]:
        """A forward hook, to run before a tensor-parallel module's own output hook, that keeps
        the module's first DTensor output (its mesh and whole shape)."""

        def seen(m: Any, i: Any, o: Any) -> None:
            if row not in self.pieces and row not in self._raw and is_dtensor(o):
                self._raw[row] = (o.device_mesh, tuple(o.shape))
                self.extents[row] = extent(o)

        return seen

    def _seen_local(self, t: torch.Tensor, row: int) -> None:
        mesh, shape = self._raw.pop(row)
        self.mesh = mesh if self.mesh is None else self.mesh
        whole = tuple(t.shape) == shape
        self.pieces[row] = Piece(mesh, tuple(range(mesh.ndim)) if whole else (), False)
        what = "Replicate" if whole else "a shard"
        self.placements[row] = f"local output, {what} on {tuple(mesh.shape)}"

    def channel_extent(self, row: int, t: torch.Tensor, dim: int) -> tuple[int, int] | None:
        """Row `row`'s channels along `dim` when its local piece `t` came from a DTensor: how
        many the whole tensor has, and where the piece's first one lies among them (None for a
        plain tensor, or a dim `t` does not have)."""
        whole = self.extents.get(row)
        if whole is None or len(whole[0]) != t.dim() or not -t.dim() <= dim < t.dim():
            return None
        shape, offset = whole
        return shape[dim], offset[dim]

    def by_name(self, names: list[str]) -> dict[str, str]:
        """The placements seen, by the name of their row."""
        return {names[row]: placements for row, placements in sorted(self.placements.items())}


def extent(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's whole shape and its local piece's offset on each dimension (0 on a rank that
    holds none of it)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(t.shape), tuple(int(o) for o in offset)


def sink_origin(pieces: dict[int, Piece], names: list[str]) -> dict[str, Any]:
    """What a sink folder keeps of where its values come from, for `fasthooks.load` to merge
    several ranks' folders: "rank", this process's (None without a process group), and
    "pieces": for each row recorded from a DTensor's local piece (by name), the lowest rank
    holding the same values; the folders of ranks with the same one hold the same values.

    Examples:
        >>> sink_origin({}, ["0"])
        {'rank': None, 'pieces': {}}
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {"rank": None, "pieces": {}}
    me = dist.get_rank()
    lowest = {names[row]: piece.lowest(me) for row, piece in sorted(pieces.items())}
    return {"rank": me, "pieces": {name: r for name, r in lowest.items() if r is not None}}
