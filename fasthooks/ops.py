"""The one door to the kernels: loads `fasthooks._C` softly and picks a statistics backend.

`import fasthooks` never fails because the extension is missing; the reason is kept and
shown when the fused backend is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Callable

import torch

from . import cuda_setup
from .layout import TENSOR_ARGUMENTS, AccumulateArgs
from .moments import accumulate_stats_list_python, accumulate_stats_python
from .torch_support import MIN_TORCH, MIN_TORCH_TEXT, torch_version

# Takes `layout.AccumulateArgs`.
Accumulate = Callable[..., None]
BACKENDS = ("auto", "fused", "python")
BUILD_HINT = (
    "build it with `pip install --no-build-isolation .` (or `make test`) in an environment "
    "that has torch and a C++ compiler"
)


UPGRADE_HINT = f"upgrade torch to {MIN_TORCH_TEXT} or later"


def _load_extension() -> str | None:
    """Import fasthooks._C (which registers the torch.ops.fasthooks operators); the error if not."""
    if torch_version(torch.__version__) < MIN_TORCH:
        if importlib.util.find_spec("fasthooks._C") is None:
            return "ModuleNotFoundError: no fasthooks._C"
        return (
            f"fasthooks._C is built on torch's stable ABI, which needs torch >= {MIN_TORCH_TEXT}; "
            f"this is torch {torch.__version__}"
        )
    try:
        importlib.import_module("fasthooks._C")
    except (ImportError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return None


_LOAD_ERROR = _load_extension()
_HINT = UPGRADE_HINT if torch_version(torch.__version__) < MIN_TORCH else BUILD_HINT

if _LOAD_ERROR is None:

    @torch.library.register_fake("fasthooks::accumulate_stats")
    def _accumulate_stats_fake(*args: object) -> None:
        # Also the Meta kernel: a meta tensor among real ones must not silently skip the update.
        state = args[1]
        for name, t in zip(TENSOR_ARGUMENTS, args, strict=False):
            if t.device != state.device:
                raise RuntimeError(
                    f"accumulate_stats: {name} must be on the state's device {state.device}, "
                    f"got {t.device}"
                )

    @torch.library.register_fake("fasthooks::accumulate_stats_list")
    def _accumulate_stats_list_fake(xs, bases, *args: object) -> None:
        state = args[0]
        for name, tensors in (("xs", xs), ("bases", bases)):
            for i, t in enumerate(tensors):
                if t.device != state.device:
                    raise RuntimeError(
                        f"accumulate_stats_list: {name}[{i}] must be on the state's device "
                        f"{state.device}, got {t.device}"
                    )


def extension_available() -> bool:
    """Whether the fused C++/CUDA operators are loaded.

    Examples:
        >>> isinstance(extension_available(), bool)
        True
    """
    return _LOAD_ERROR is None


def extension_error() -> str | None:
    """Why the extension did not load, or None when it did."""
    return _LOAD_ERROR


def cpu_capability() -> str:
    """The vector instruction set the fused CPU kernel runs with.

    "avx512_gfni" (AVX-512 with GFNI, BITALG and VBMI), "avx512", "avx2" or "default".
    """
    _require_extension()
    return torch.ops.fasthooks.cpu_capability()


def accumulate_stats(*args: object, **options: float) -> None:
    """`accumulate_stats` (`layout.AccumulateArgs`: the options have defaults) with the fused
    operator: merge the statistics of all of `x` into slot (`slot`, `cursor`),
    noting the call in the call order (`layout.ORDER_PLANES`) unless `order` is empty.

    Examples:
        >>> from fasthooks.buffers import StatBuffers
        >>> b = StatBuffers(1, 1, "cpu", full=True, hist_bins=0)
        >>> if extension_available():
        ...     accumulate_stats(torch.tensor([1.0, 3.0]), *b.op_args(), 0)
        ...     print(b.stats[:, 0, 0].tolist(), b.extra[:, 0, 0].tolist())
        ... else:
        ...     print([2.0, 1.4142135381698608], [1.0, 3.0, 0.0, 1.0])
        [2.0, 1.4142135381698608] [1.0, 3.0, 0.0, 1.0]
    """
    torch.ops.fasthooks.accumulate_stats(*AccumulateArgs(*args, **options))


def kernel_layout() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The (state planes, extra planes) order the compiled kernels were built with."""
    _require_extension()
    state, extra = torch.ops.fasthooks.layout().split(";")
    return tuple(state.split(",")), tuple(extra.split(","))


def _require_extension() -> None:
    if _LOAD_ERROR is not None:
        raise RuntimeError(
            f"the fused backend needs the compiled extension fasthooks._C, which did not load "
            f"({_LOAD_ERROR}); {_HINT}, or use backend='python'"
        )


_warned_broken = False


def _warn_broken_extension() -> None:
    """Once: an extension that is there but does not load (built for another torch, say)."""
    global _warned_broken
    if _warned_broken or (_LOAD_ERROR or "").startswith("ModuleNotFoundError"):
        return
    _warned_broken = True
    warnings.warn(
        f"fasthooks._C is installed but did not load ({_LOAD_ERROR}); ActivationStats uses the "
        f"python backend, which gives the same numbers more slowly. To use the fused backend, "
        f"{_HINT}",
        RuntimeWarning,
        stacklevel=4,
    )


_warned_no_device_kernel: set[str] = set()


_cuda_setup: cuda_setup.CudaSetup | None = None


def cuda_status() -> cuda_setup.CudaSetup:
    """What the CUDA kernels found (NVRTC, the driver, the cache), set up on first use."""
    global _cuda_setup
    _require_extension()
    if _cuda_setup is None:
        _cuda_setup = cuda_setup.configure()
    return _cuda_setup


_cuda_prepared: dict[int, str | None] = {}


def _cuda_failure(device: torch.device) -> str | None:
    """Why the CUDA kernels cannot run on `device`, or None: what is missing, else what failed
    when the first of them was compiled and loaded there (once per device)."""
    if cuda_status().unavailable:
        return cuda_status().unavailable
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _cuda_prepared:
        _cuda_prepared[index] = cuda_setup.prepare(index)
    return _cuda_prepared[index]


def has_kernel_for(device_type: str) -> bool:
    """Whether the loaded extension registered `accumulate_stats` for a device type ("cuda")."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(
        "fasthooks::accumulate_stats", device_type.upper()
    )


def backend_for_device(backend: str, requested: str, device: torch.device) -> str:
    """The backend to use on `device`: `backend` unless it is "fused" and the build has no kernel
    for the device, or its CUDA kernels cannot run here (no NVRTC or no driver); then "auto"
    falls back to "python" with one warning saying what is missing, and "fused" asked for by
    name is refused with the same message.

    Examples:
        >>> backend_for_device("fused", "auto", torch.device("cpu"))
        'fused'
    """
    if backend != "fused" or device.type in ("cpu", "meta"):
        return backend
    if not has_kernel_for(device.type):
        why = f"this build of fasthooks._C has no {device.type} kernel"
    elif device.type == "cuda" and (failure := _cuda_failure(device)):
        why = f"its CUDA kernels cannot run here: {failure}"
    else:
        return backend
    if requested == "fused":
        raise RuntimeError(f"backend='fused' on {device}: {why}; use backend='python'")
    if device.type not in _warned_no_device_kernel:
        _warned_no_device_kernel.add(device.type)
        warnings.warn(
            f"fasthooks: {why}. The python backend runs instead, with the same numbers",
            RuntimeWarning,
            stacklevel=3,
        )
    return "python"


def resolve_list_backend(backend: str) -> Accumulate:
    """`accumulate_stats_list` of the backend that `resolve_backend(backend)` picks."""
    name, _ = resolve_backend(backend)
    if name == "python":
        return accumulate_stats_list_python
    return torch.ops.fasthooks.accumulate_stats_list.default


def resolve_backend(backend: str) -> tuple[str, Accumulate]:
    """The backend name in use and its accumulate function for `backend` in BACKENDS.

    Examples:
        >>> resolve_backend("python")[0]
        'python'
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto" and _LOAD_ERROR is not None:
        _warn_broken_extension()
    if backend == "python" or (backend == "auto" and _LOAD_ERROR is not None):
        return "python", accumulate_stats_python
    _require_extension()
    # The operator itself, not a Python wrapper around it: one call less on every hook.
    return "fused", torch.ops.fasthooks.accumulate_stats.default


# A CUDA torch's users get the CUDA kernels set up at import, so that calling the operator
# directly works too.
if _LOAD_ERROR is None and torch.version.cuda:
    cuda_status()
