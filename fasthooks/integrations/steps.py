"""Stand-ins for an optimizer's `step` while a `ParameterStats` records through torch's step
hooks: fastai's own optimizers are not torch ones, so they have no such hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class StepPatch:
    """Stands in for `owner.step` while attached, calling `step`; detached, the owner's own step
    is back. One patch at a time per owner, so that detaching puts back the owner's own."""

    def __init__(self, owner: Any, step: Callable[..., Any]) -> None:
        self.owner, self.step = owner, step
        self.attached = False
        self._shadowed = None  # an instance attribute `step` of the owner (an LR scheduler's)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.step(*args, **kwargs)

    def attach(self) -> None:
        if self.attached:
            return
        shadowed = vars(self.owner).get("step")
        if isinstance(shadowed, StepPatch):
            raise RuntimeError(
                f"the step of the {type(self.owner).__name__} is already recorded by another "
                "ParameterStatsCallback (or by one whose fit raised outside `with callback:`): "
                "record each optimizer with one callback, its parameters= choosing what it records"
            )
        self._shadowed = shadowed
        self.owner.step = self
        self.attached = True

    def detach(self) -> None:
        if not self.attached:
            return
        if self._shadowed is None:
            del self.owner.step
        else:
            self.owner.step = self._shadowed
        self.attached = False


class StepRelay(torch.optim.Optimizer):
    """A torch optimizer over the parameters of another optimizer that is not one (fastai's),
    whose step is the other's: with `relay.patch` attached, every step of the other runs torch's
    step hooks of the relay around it."""

    def __init__(self, stepped: Any) -> None:
        super().__init__([p for group in stepped.param_groups for p in group["params"]], {})
        self._step = stepped.step
        self.patch = StepPatch(stepped, self.step)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._step(closure)
