"""The CUDA operator run on the CPU: its host side and its kernels' device code.

`harness.cpp` compiles `csrc/cuda/operator_host.h` (the host side accumulate_cuda.cpp uses) over an
emulated device and `csrc/cuda/accumulate_kernel.cuh` (the source NVRTC compiles) against
`device_api.h`, an emulation of the CUDA device API, and registers them as
`torch.ops.fasthooks_cuda_on_cpu.accumulate_stats(_list)`, with fasthooks._C's schemas, for CPU
tensors: the CUDA operator's own checks, dense-or-copy choices, grouping by dtype and launch
plans run here. The library is built on first use with the host's C++ compiler into
build/cuda-on-cpu/, named by a hash of its sources.
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

from fasthooks.layout import AccumulateArgs, cuda_workspace_doubles

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SOURCES = [
    HERE / "harness.cpp",
    HERE / "device_api.h",
    ROOT / "csrc" / "checks.cpp",
    *sorted((ROOT / "csrc" / "cuda").glob("*.cuh")),
    *sorted((ROOT / "csrc" / "cuda").glob("*.h")),
    *sorted((ROOT / "csrc").glob("*.h")),
]
BUILD = ROOT / "build" / "cuda-on-cpu"
DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
COUNT_NAMES = ("launches", "blocks", "barriers", "warp_ops", "lane_splits", "errors")

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "harness_workspace_doubles": ([], _I64),
    "harness_max_blocks": ([], _I64),
    "harness_regions": ([], _I64),
    "harness_min_blocks_per_sm": ([], _I64),
    "harness_thread_bins": ([], _I64),
    "harness_resident_blocks": ([], _I64),
    "harness_options": ([_INT, _INT, ctypes.c_ulonglong], None),
    "harness_counts": ([_P], None),
    "harness_last_error": ([], ctypes.c_char_p),
    "harness_break_a_rule": ([_INT], None),
    "harness_plan": ([_INT, _P, _I64, _I64, _P], None),
    "harness_region_of": ([_P, ctypes.c_ulonglong, _INT, ctypes.c_char_p, _I64], _I64),
    "harness_set_stream": ([ctypes.c_ulonglong], None),
    "harness_set_resident": ([_I64], None),
}
_library: ctypes.CDLL | None = None
_workspaces: dict[int, torch.Tensor] = {}


class DeviceCodeError(AssertionError):
    """The emulation saw the device code break a rule of CUDA (see device_api.h)."""


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
    torch_lib = Path(torch.__file__).parent / "lib"
    # Fortified longjmp refuses to jump between stacks, which is how fibers switch.
    flags = ["-O2", "-U_FORTIFY_SOURCE", "-std=c++20", "-shared", "-fPIC", "-pthread"]
    flags.append("-fvisibility=hidden")
    sources = [str(HERE / "harness.cpp"), str(ROOT / "csrc" / "checks.cpp")]
    links = [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-ltorch_cpu", "-lc10"]
    command = [compiler, *flags, *includes, *sources, *links, "-o", str(partial)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the CUDA-on-CPU harness failed:\n{done.stderr[-4000:]}")
    partial.replace(target)
    return target


def library() -> ctypes.CDLL:
    """The harness library, built on first use; loading it registers its operators."""
    global _library
    if _library is None:
        path = str(_build())
        torch.ops.load_library(path)
        lib = ctypes.CDLL(path)
        for name, (args, result) in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = result
        _library = lib
    return _library


def workspace_doubles() -> int:
    return library().harness_workspace_doubles()


def resident_blocks() -> int:
    """The blocks a launch gets on an H100 or H200 at the kernels' occupancy, as on the GPU."""
    return library().harness_resident_blocks()


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


def workspace_for(state: torch.Tensor, top_k: int = 0) -> torch.Tensor:
    """A zeroed CUDA workspace that lives as long as `state` (CPU buffers have an empty one), with
    room for `top_k` pairs per block (`fasthooks.layout.cuda_workspace_doubles`)."""
    key = id(state)
    if key not in _workspaces or len(_workspaces[key]) < cuda_workspace_doubles(top_k):
        if key not in _workspaces:
            weakref.finalize(state, _workspaces.pop, key, None)
        _workspaces[key] = torch.zeros(cuda_workspace_doubles(top_k), dtype=torch.float64)
    return _workspaces[key]


def _run(operator: str, *args: object, stream: int, resident: int | None) -> None:
    """One call of an emulated operator from `stream`, DeviceCodeError when a rule broke."""
    lib = library()
    errors = counts()["errors"]
    lib.harness_set_stream(stream)
    lib.harness_set_resident(resident or 0)
    try:
        getattr(torch.ops.fasthooks_cuda_on_cpu, operator)(*args)
    finally:
        lib.harness_set_resident(0)
    if counts()["errors"] != errors:
        raise DeviceCodeError(lib.harness_last_error().decode())


def accumulate(
    *args: object,
    base: torch.Tensor | None = None,
    stream: int = 0,
    resident: int | None = None,
    **options: float,
) -> None:
    """`accumulate_stats` (`fasthooks.layout.AccumulateArgs`) through the CUDA operator, on CPU
    tensors (with `base`, the statistics of x - base, through `accumulate_stats_list` as
    parameters' updates take them); `stream` stands for the CUDA stream of the call. An empty
    `workspace` (CPU buffers) is replaced by one kept for `state`. Raises DeviceCodeError when
    the emulation saw a rule of CUDA broken."""
    call = AccumulateArgs(*args, **options)
    if call.workspace.numel() == 0:
        top_k = call.top.shape[2] if call.top.numel() > 0 else 0
        call = call._replace(workspace=workspace_for(call.state, top_k))
    if base is None:
        _run("accumulate_stats", *call, stream=stream, resident=resident)
        return
    empty = call.x.new_empty(0)
    xs, bases = [empty] * call.slot + [call.x], [empty] * call.slot + [base]
    buffers = (call.state, call.stats, call.extra, call.hist, call.workspace, call.cursor)
    options = (call.near_zero, call.hist_min, call.hist_max)
    _run("accumulate_stats_list", xs, bases, *buffers, *options, stream=stream, resident=resident)


def accumulate_list(*args: object, stream: int = 0) -> None:
    """`accumulate_stats_list` (its schema's arguments, as `torch.ops.fasthooks` takes them)
    through the CUDA operator's list path, on CPU tensors; an empty workspace (CPU buffers) is
    replaced by one kept for the state."""
    args = list(args)
    if args[6].numel() == 0:  # the workspace, after xs, bases and the four statistics buffers
        args[6] = workspace_for(args[2])
    _run("accumulate_stats_list", *args, stream=stream, resident=None)
