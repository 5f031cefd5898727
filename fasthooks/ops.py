"""The one door to the kernels: loads `fasthooks._C` softly and picks a statistics backend.

`import fasthooks` never fails because the extension is missing; the reason is kept and
shown when the fused backend is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from .moments import accumulate_moments_python

Accumulate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]
BACKENDS = ("auto", "fused", "python")
BUILD_HINT = (
    "build it with `pip install --no-build-isolation .` (or `make test`) in an environment "
    "that has torch and a C++ compiler"
)


def _load_extension() -> str | None:
    """Import fasthooks._C (which registers the torch.ops.fasthooks operators); the error if not."""
    try:
        importlib.import_module("fasthooks._C")
    except (ImportError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return None


_LOAD_ERROR = _load_extension()

if _LOAD_ERROR is None:

    @torch.library.register_fake("fasthooks::accumulate_moments")
    def _accumulate_moments_fake(
        x: torch.Tensor, state: torch.Tensor, cursor: torch.Tensor, slot: int
    ) -> None:
        return None


def extension_available() -> bool:
    """Whether the fused C++/CUDA operators are loaded.

    Example:
        >>> isinstance(extension_available(), bool)
        True
    """
    return _LOAD_ERROR is None


def extension_error() -> str | None:
    """Why the extension did not load, or None when it did."""
    return _LOAD_ERROR


def cpu_capability() -> str:
    """The vector instruction set the fused CPU kernel runs with ("avx2" or "default")."""
    _require_extension()
    return torch.ops.fasthooks.cpu_capability()


def accumulate_moments(
    x: torch.Tensor, state: torch.Tensor, cursor: torch.Tensor, slot: int
) -> None:
    """Merge the moments of all of `x` into `state[:, slot, cursor]` with the fused operator.

    Example:
        >>> from fasthooks.moments import new_state
        >>> state = new_state(1, 1)
        >>> if extension_available():
        ...     accumulate_moments(torch.tensor([1.0, 3.0]), state, torch.tensor(0), 0)
        ...     print(state[:, 0, 0].tolist())
        ... else:
        ...     print([2.0, 2.0, 2.0])
        [2.0, 2.0, 2.0]
    """
    torch.ops.fasthooks.accumulate_moments(x, state, cursor, slot)


def _require_extension() -> None:
    if _LOAD_ERROR is not None:
        raise RuntimeError(
            f"the fused backend needs the compiled extension fasthooks._C, which did not load "
            f"({_LOAD_ERROR}); {BUILD_HINT}, or use backend='python'"
        )


def resolve_backend(backend: str) -> tuple[str, Accumulate]:
    """The backend name in use and its accumulate function for `backend` in BACKENDS.

    Example:
        >>> resolve_backend("python")[0]
        'python'
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "python" or (backend == "auto" and _LOAD_ERROR is not None):
        return "python", accumulate_moments_python
    _require_extension()
    # The operator itself, not a Python wrapper around it: one call less on every hook.
    return "fused", torch.ops.fasthooks.accumulate_moments.default
