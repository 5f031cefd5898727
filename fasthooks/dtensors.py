"""Distributed tensors (`torch.distributed.tensor.DTensor`: FSDP2's parameters and gradients,
tensor-parallel outputs) are recorded from their local piece, with their placements kept."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import torch


def dtensor_type() -> type | None:
    """The DTensor class once torch.distributed.tensor is imported (before that, no tensor can
    be one), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(t: torch.Tensor) -> bool:
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


def first_replica(t: torch.Tensor) -> bool:
    """Whether this rank holds the first copy of a DTensor's piece: coordinate 0 on every mesh
    dimension that replicates it (so that merging ranks counts the piece once)."""
    coordinate = t.device_mesh.get_coordinate()
    return all(
        not placement.is_replicate() or coordinate[dim] == 0
        for dim, placement in enumerate(t.placements)
    )


def is_partial(t: torch.Tensor) -> bool:
    """Whether a DTensor holds partial values on some mesh dimension (a sum still to be taken)."""
    return any(p.is_partial() for p in t.placements)


class LocalPieces:
    """The local piece of each distributed tensor a recorder measures, with the placements of
    each row remembered (the first seen) and one warning per row for partial values.

    What is recorded for a `Partial` placement: the rank's own partial values (a sum over ranks
    still to be taken), not the values; reducing them would cost a collective on every call.
    """

    def __init__(self, recorder: str) -> None:
        self.recorder = recorder
        self.placements: dict[int, str] = {}  # by row
        self.replicas: set[int] = set()  # rows this rank holds a replica of, not the first

    def local(self, t: torch.Tensor, row: int, name: Callable[[], str]) -> torch.Tensor:
        """`t` itself, or its local piece when it is a DTensor (`name()` names row `row`)."""
        if not is_dtensor(t):
            return t
        if row not in self.placements:
            self.placements[row] = describe_placements(t)
            if not first_replica(t):
                self.replicas.add(row)
            if is_partial(t):
                warnings.warn(
                    f"{self.recorder}: {name()} is a DTensor with partial values "
                    f"{self.placements[row]}: each rank records its own partial values, not "
                    "the reduced ones (redistribute it to Replicate or Shard to record values)",
                    RuntimeWarning,
                    stacklevel=4,
                )
        return t.to_local()

    def by_name(self, names: list[str]) -> dict[str, str]:
        """The placements seen, by the name of their row."""
        return {names[row]: placements for row, placements in sorted(self.placements.items())}
