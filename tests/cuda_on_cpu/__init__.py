"""The CUDA kernels' device code, run on the CPU: a door with the operator's signature.

`harness.cpp` compiles `csrc/cuda/accumulate_kernel.cuh` (the file nvcc compiles) for the host
against `device_api.h`, an emulation of the CUDA device API; `accumulate` here calls it on CPU
tensors as `torch.ops.fasthooks.accumulate_stats` would on CUDA ones. The library is built on
first use with the host's C++ compiler into build/cuda-on-cpu/, named by a hash of its sources.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SOURCES = [
    HERE / "harness.cpp",
    HERE / "device_api.h",
    *sorted((ROOT / "csrc" / "cuda").glob("*.cuh")),
    *sorted((ROOT / "csrc" / "cuda").glob("*.h")),
    *sorted((ROOT / "csrc").glob("*.h")),
]
BUILD = ROOT / "build" / "cuda-on-cpu"
DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
# An H100 or H200: 132 multiprocessors, each holding kMinBlocksPerSM blocks of the kernels.
MULTIPROCESSORS = 132
COUNT_NAMES = ("launches", "blocks", "barriers", "warp_ops", "lane_splits", "errors")

_P, _I64, _INT, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
_SIGNATURES = {
    "harness_workspace_doubles": ([], _I64),
    "harness_max_blocks": ([], _I64),
    "harness_regions": ([], _I64),
    "harness_min_blocks_per_sm": ([], _I64),
    "harness_options": ([_INT, _INT, ctypes.c_ulonglong], None),
    "harness_counts": ([_P], None),
    "harness_last_error": ([], ctypes.c_char_p),
    "harness_break_a_rule": ([_INT], None),
    "harness_plan": ([_INT, _P, _I64, _I64, _P], None),
    "harness_region_of": ([_P, ctypes.c_ulonglong, _INT, ctypes.c_char_p, _I64], _I64),
    "harness_accumulate_list": (
        [_INT, _P, _P, _P, _P, _I64, *[_P] * 6, *[_I64] * 4, _INT, _D, _D, _D, _I64],
        _INT,
    ),
    "harness_accumulate": (
        [_INT, _P, _P, _I64, *[_P] * 8, *[_I64] * 5, _INT, _D, _D, _D, _I64],
        _INT,
    ),
}
_library: ctypes.CDLL | None = None
_workspaces: dict[int, torch.Tensor] = {}


class DeviceCodeError(AssertionError):
    """The emulation saw the device code break a rule of CUDA (see device_api.h)."""


def _dense(x: torch.Tensor) -> bool:
    """Whether x's elements fill a block of memory, in any order (as csrc/checks.cpp decides)."""
    expected = 1
    for stride, size in sorted((t, s) for s, t in zip(x.shape, x.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _build() -> Path:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]
    target = BUILD / f"harness-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("the CUDA-on-CPU harness needs a C++ compiler (g++) on PATH")
    from torch.utils import cpp_extension  # imports setuptools: only when building

    BUILD.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.tmp")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{ROOT / 'csrc'}"]
    # Fortified longjmp refuses to jump between stacks, which is how fibers switch.
    flags = ["-O2", "-U_FORTIFY_SOURCE", "-std=c++20", "-shared", "-fPIC", "-pthread"]
    command = [compiler, *flags, *includes]
    command += [str(HERE / "harness.cpp"), "-o", str(partial)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the CUDA-on-CPU harness failed:\n{done.stderr[-4000:]}")
    partial.replace(target)
    return target


def library() -> ctypes.CDLL:
    """The harness library, built on first use."""
    global _library
    if _library is None:
        lib = ctypes.CDLL(str(_build()))
        for name, (args, result) in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = result
        _library = lib
    return _library


def workspace_doubles() -> int:
    return library().harness_workspace_doubles()


def resident_blocks() -> int:
    """The blocks a launch gets on an H100 or H200 at the kernels' occupancy, as on the GPU."""
    return MULTIPROCESSORS * library().harness_min_blocks_per_sm()


def configure(workers: int = 4, split_lanes: bool = False, seed: int = 1) -> None:
    """Blocks on `workers` OS threads; `split_lanes`: divergent lanes at `__activemask()`."""
    library().harness_options(workers, int(split_lanes), seed)


def counts() -> dict[str, int]:
    out = (ctypes.c_int64 * len(COUNT_NAMES))()
    library().harness_counts(out)
    return dict(zip(COUNT_NAMES, list(out), strict=True))


def plan(x: torch.Tensor, resident: int | None = None) -> tuple[int, int]:
    """(scalar values before the first 16-byte boundary, blocks) of a launch over x."""
    out = (ctypes.c_int64 * 2)()
    resident = resident or resident_blocks()
    library().harness_plan(DTYPES[x.dtype], x.data_ptr(), x.numel(), resident, out)
    return out[0], out[1]


def break_a_rule(which: int) -> str:
    """Runs a kernel that breaks rule `which` of CUDA; what the emulation reported."""
    errors = counts()["errors"]
    library().harness_break_a_rule(which)
    return library().harness_last_error().decode() if counts()["errors"] > errors else ""


def region_of(workspace: torch.Tensor | int, stream: int, capturing: bool = False) -> int:
    """The region the host gives calls from `stream` in `workspace` (a tensor, or an address)
    (csrc/cuda/stream_regions.h)."""
    error = ctypes.create_string_buffer(1024)
    address = workspace if isinstance(workspace, int) else workspace.data_ptr()
    region = library().harness_region_of(address, stream, int(capturing), error, len(error))
    if region < 0:
        raise RuntimeError(error.value.decode())
    return region


def workspace_for(state: torch.Tensor) -> torch.Tensor:
    """A zeroed CUDA workspace that lives as long as `state` (CPU buffers have an empty one)."""
    key = id(state)
    if key not in _workspaces:
        _workspaces[key] = torch.zeros(workspace_doubles(), dtype=torch.float64)
        weakref.finalize(state, _workspaces.pop, key, None)
    return _workspaces[key]


def accumulate(
    x: torch.Tensor,
    state: torch.Tensor,
    stats: torch.Tensor,
    extra: torch.Tensor,
    hist: torch.Tensor,
    workspace: torch.Tensor,
    order: torch.Tensor,
    clock: torch.Tensor,
    cursor: torch.Tensor,
    slot: int,
    near_zero: float = 0.05,
    hist_min: float = 0.0,
    hist_max: float = 10.0,
    *,
    base: torch.Tensor | None = None,
    stream: int = 0,
    resident: int | None = None,
) -> None:
    """`accumulate_stats` through the CUDA kernels, on CPU tensors (with `base`, the statistics
    of x - base, as `accumulate_stats_list` takes them); `stream` stands for the CUDA stream of
    the call. An empty `workspace` (CPU buffers) is replaced by one kept for `state`. Raises
    DeviceCodeError when the emulation saw a rule of CUDA broken."""
    if workspace.numel() == 0:
        workspace = workspace_for(state)
    if workspace.numel() != workspace_doubles() or workspace.dtype != torch.float64:
        raise ValueError(f"workspace must be {workspace_doubles()} float64 values")
    bins = hist.shape[2] if hist.numel() > 0 else 0
    if x.numel() == 0:
        return
    dense = x if x.is_contiguous() or _dense(x) else x.contiguous()
    if base is not None:  # read in one order, as csrc/checks.cpp's dense_pair
        same_order = base.stride() == x.stride() and dense is x
        dense, base = (x, base) if same_order else (x.contiguous(), base.contiguous())
    full = state.shape[0] == 9
    lib = library()
    errors = counts()["errors"]
    status = lib.harness_accumulate(
        DTYPES[dense.dtype],
        dense.data_ptr(),
        None if base is None else base.data_ptr(),
        dense.numel(),
        state.data_ptr(),
        stats.data_ptr(),
        extra.data_ptr() if full else None,
        hist.data_ptr() if bins else None,
        order.data_ptr() if order.numel() else None,
        clock.data_ptr() if order.numel() else None,
        cursor.data_ptr(),
        workspace.data_ptr(),
        region_of(workspace, stream),
        slot,
        state.shape[1],
        state.shape[2],
        bins,
        int(full),
        near_zero,
        hist_min,
        hist_max,
        resident or resident_blocks(),
    )
    if status != 0:
        raise ValueError(f"unsupported dtype {dense.dtype}")
    if counts()["errors"] != errors:
        raise DeviceCodeError(lib.harness_last_error().decode())


def accumulate_list(
    xs: list[torch.Tensor],
    bases: list[torch.Tensor],
    state: torch.Tensor,
    stats: torch.Tensor,
    extra: torch.Tensor,
    hist: torch.Tensor,
    workspace: torch.Tensor,
    cursor: torch.Tensor,
    near_zero: float = 0.05,
    hist_min: float = 0.0,
    hist_max: float = 10.0,
    *,
    stream: int = 0,
) -> None:
    """`accumulate_stats_list` through the CUDA list kernel: the non-empty tensors grouped by
    dtype, each group in launches of up to 64 tensors, as the host code does."""
    if workspace.numel() == 0:
        workspace = workspace_for(state)
    groups: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor | None, int]]] = {}
    for slot, x in enumerate(xs):
        if x.numel() == 0:
            continue
        base = bases[slot] if bases else None
        if base is not None and not (base.stride() == x.stride() and _dense(x)):
            x, base = x.contiguous(), base.contiguous()
        elif base is None and not (x.is_contiguous() or _dense(x)):
            x = x.contiguous()
        groups.setdefault(x.dtype, []).append((x, base, slot))
    lib = library()
    errors = counts()["errors"]
    region = region_of(workspace, stream)
    for dtype, members in groups.items():
        count = len(members)
        pointers = (ctypes.c_void_p * count)(*[x.data_ptr() for x, _, _ in members])
        base_pointers = (ctypes.c_void_p * count)(
            *[b.data_ptr() for _, b, _ in members if b is not None]
        )
        sizes = (ctypes.c_int64 * count)(*[x.numel() for x, _, _ in members])
        slots = (ctypes.c_int64 * count)(*[slot for _, _, slot in members])
        full = state.shape[0] == 9
        bins = hist.shape[2] if hist.numel() > 0 else 0
        lib.harness_accumulate_list(
            DTYPES[dtype],
            pointers,
            base_pointers if bases else None,
            sizes,
            slots,
            count,
            state.data_ptr(),
            stats.data_ptr(),
            extra.data_ptr() if full else None,
            hist.data_ptr() if bins else None,
            cursor.data_ptr(),
            workspace.data_ptr(),
            region,
            state.shape[1],
            state.shape[2],
            bins,
            int(full),
            near_zero,
            hist_min,
            hist_max,
            resident_blocks(),
        )
    if counts()["errors"] != errors:
        raise DeviceCodeError(lib.harness_last_error().decode())
