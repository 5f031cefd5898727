"""ActivationStats: per-batch mean and std of each hooked module's output, never waiting on it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .hook import HookCallback
from .moments import clear_column, new_state, state_to_stats
from .ops import resolve_backend

DEFAULT_CAPACITY = 64


def first_tensor(output: Any) -> torch.Tensor | None:
    """The output itself if it is a tensor, else the first tensor inside (nested) tuples/lists."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


class ActivationStats(HookCallback):
    """Records the mean and std of each hooked module's output for every training batch.

    `stats` is a float32 CPU tensor of shape `(2, modules, batches)`: axis 0 is (mean, std),
    one column per batch ended with `on_batch_end(train=True)`. The hooks only launch
    work on the activations' device; reading `stats` is the one place that waits for it.
    A module whose output is a tuple or list contributes its first tensor.

    The buffer holds `expected_batches` columns and doubles when they run out. A step captured
    in a CUDA graph keeps writing to the buffer it was captured with, so give
    `expected_batches` for the whole run there (past its end a device-side assertion fires).

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        >>> with ActivationStats(model, backend="python") as act:
        ...     for _ in range(3):
        ...         _ = model(torch.randn(32, 8))
        ...         act.on_batch_end(train=True)
        >>> act.stats.shape
        torch.Size([2, 2, 3])
    """

    def __init__(
        self,
        model: Any,
        modules: Iterable[nn.Module] | None = None,
        do_remove: bool = True,
        backend: str = "auto",
        expected_batches: int = DEFAULT_CAPACITY,
    ) -> None:
        super().__init__(model, modules, do_remove)
        if not isinstance(expected_batches, int) or expected_batches < 1:
            raise ValueError(f"expected_batches must be a positive int, got {expected_batches!r}")
        self.backend, self._accumulate = resolve_backend(backend)
        self.expected_batches = expected_batches
        self._slots: dict[nn.Module, int] = {}
        self._state: torch.Tensor | None = None
        self._cursor: torch.Tensor | None = None
        self._num_batches = 0

    def on_train_begin(self, **kwargs: Any) -> None:
        """Register the hooks and start fresh statistics."""
        super().on_train_begin(**kwargs)
        assert self.modules is not None
        self._slots = {}
        for i, m in enumerate(self.modules):
            if m in self._slots:
                raise ValueError(f"modules[{i}] repeats modules[{self._slots[m]}]")
            self._slots[m] = i
        device = next(self.model.parameters(), torch.empty(0)).device
        self._state = new_state(len(self.modules), self.expected_batches, device)
        self._cursor = torch.zeros((), dtype=torch.int64, device=device)
        self._num_batches = 0

    # Runs on every hooked module of every batch: detaching only the tensor it reads is cheaper
    # than the generic detach of inputs and outputs.
    detach = False

    def hook(self, m: nn.Module, i: Any, o: Any) -> None:
        if not m.training:
            return
        x = o if type(o) is torch.Tensor else first_tensor(o)
        if x is None:
            raise TypeError(
                f"ActivationStats needs a tensor output from {type(m).__name__}, "
                f"got {type(o).__name__}"
            )
        self._accumulate(x.detach(), self._state, self._cursor, self._slots[m])

    def on_batch_end(self, train: bool = True, **kwargs: Any) -> None:
        """Close the batch: a training batch gets its column, any other is forgotten."""
        if self._state is None or self._cursor is None:
            raise RuntimeError("on_batch_end() called before on_train_begin()")
        if not train:
            clear_column(self._state, self._cursor)
            return
        self._num_batches += 1
        if self._num_batches == self._state.shape[2]:
            self._grow()
        self._cursor.add_(1)

    def _grow(self) -> None:
        """Double the capacity, keeping every recorded column."""
        assert self._state is not None
        old = self._state
        self._state = new_state(old.shape[1], 2 * old.shape[2], old.device)
        self._state[:, :, : old.shape[2]].copy_(old)

    @property
    def num_batches(self) -> int:
        """How many training batches have been recorded."""
        return self._num_batches

    @property
    def stats(self) -> torch.Tensor:
        """`(2, modules, batches)` float32 CPU (mean, std); NaN where a module did not run."""
        if self._state is None:
            return torch.empty(2, len(self.modules or ()), 0)
        return state_to_stats(self._state[:, :, : self._num_batches].cpu())
