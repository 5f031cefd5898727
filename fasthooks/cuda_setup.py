"""What the CUDA operator of fasthooks._C needs at run time, found here and handed over once.

The binary links no CUDA library. Its CUDA kernels are compiled at first use by the NVRTC of the
CUDA torch beside it, for the GPU's own architecture, and launched through the CUDA driver: this
module finds the driver (libcuda.so.1), NVRTC (the copy torch's CUDA packages install) and
torch's current-stream function, and the disk cache where compiled kernels are kept.

Environment:
    FASTHOOKS_NVRTC: the NVRTC library to use (a path), in place of the one found beside torch.
    FASTHOOKS_CACHE_DIR: where compiled kernels are kept (default:
        $XDG_CACHE_HOME/fasthooks/cuda-kernels, or ~/.cache/fasthooks/cuda-kernels).
    FASTHOOKS_CACHE_LOCK_WAIT: seconds a process waits for another that is compiling the same
        kernel before it compiles the kernel itself (default 120).
"""

from __future__ import annotations

import ctypes
import math
import os
import re
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

# Positions of the dtypes the kernels read (csrc/dtype_dispatch.h, dtype_position).
DTYPE_POSITIONS = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
_OUT_SIZE = 4096
LOCK_WAIT_SECONDS = 120.0


@dataclass(frozen=True)
class CudaSetup:
    """What was found: the NVRTC library and its version, the cache directory, and why the CUDA
    kernels cannot run here (None when they can)."""

    nvrtc: str | None
    nvrtc_version: str | None
    cache_dir: str
    unavailable: str | None


def cache_dir() -> str:
    """Where compiled kernels are kept: FASTHOOKS_CACHE_DIR, else the user's cache directory."""
    if os.environ.get("FASTHOOKS_CACHE_DIR"):
        return os.path.abspath(os.environ["FASTHOOKS_CACHE_DIR"])
    home = os.path.expanduser("~")
    if home == "~":  # no home directory (a container user without a passwd entry)
        home = os.path.join(tempfile.gettempdir(), f"fasthooks-{os.getuid()}")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return os.path.join(base, "fasthooks", "cuda-kernels")


def lock_wait() -> float:
    """Seconds to wait for another process's compile of a kernel: FASTHOOKS_CACHE_LOCK_WAIT, or
    LOCK_WAIT_SECONDS (with a warning where the variable is not a number of seconds)."""
    given = os.environ.get("FASTHOOKS_CACHE_LOCK_WAIT")
    if not given:
        return LOCK_WAIT_SECONDS
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not (0.0 <= seconds < math.inf):
        warnings.warn(
            f"FASTHOOKS_CACHE_LOCK_WAIT must be a number of seconds, 0 or more, not {given!r}: "
            f"waiting {LOCK_WAIT_SECONDS:g} s",
            RuntimeWarning,
            stacklevel=2,
        )
        return LOCK_WAIT_SECONDS
    return seconds


def nvrtc_candidates() -> list[Path]:
    """NVRTC libraries where CUDA builds of torch put them (their nvidia packages, torch/lib),
    then a CUDA toolkit's; those of torch's own CUDA major version first."""
    found: list[Path] = []
    for entry in filter(None, sys.path):  # not the working directory ("")
        base = Path(entry)
        for pattern in ("nvidia/cu*/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*"):
            found += sorted(base.glob(pattern))
        found += sorted((base / "torch" / "lib").glob("libnvrtc*.so*"))
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            found += sorted(Path(home, "lib64").glob("libnvrtc.so.*"))
    found = [p for p in dict.fromkeys(found) if "builtins" not in p.name and ".alt." not in p.name]
    major = (torch.version.cuda or "").split(".")[0]
    return sorted(found, key=lambda p: not re.search(rf"\.so\.{major}(\.|$)", p.name))


def _load_nvrtc(path: Path) -> ctypes.CDLL:
    # NVRTC opens its builtins library by name: loaded first, from beside it, it is found.
    for builtins in sorted(path.parent.glob("libnvrtc-builtins.so.*")):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(path))


def _find_nvrtc() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    """(library, path, why not found)."""
    paths = [Path(os.environ["FASTHOOKS_NVRTC"])] if os.environ.get("FASTHOOKS_NVRTC") else []
    paths += nvrtc_candidates()
    errors = []
    for path in paths:
        try:
            return _load_nvrtc(path), str(path), None
        except OSError as error:
            errors.append(f"{path}: {error}")
    where = "; ".join(errors) or "none beside torch, in its nvidia packages or in CUDA_HOME"
    return None, None, f"no NVRTC library could be loaded ({where}; set FASTHOOKS_NVRTC)"


def _torch_cuda_library() -> ctypes.CDLL | None:
    path = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    return ctypes.CDLL(str(path)) if torch.version.cuda and path.exists() else None


def _resolve(library: ctypes.CDLL | None, name: str) -> int | None:
    if library is None:
        return None
    try:
        return ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    except AttributeError:
        return None


def _extension() -> ctypes.CDLL:
    import fasthooks._C as extension

    return ctypes.CDLL(extension.__file__)


def configure() -> CudaSetup:
    """Finds what the CUDA kernels need and hands it to the extension (which must be loaded)."""
    lib = _extension()
    lib.fasthooks_cuda_api_name.restype = ctypes.c_char_p
    names = []
    while (name := lib.fasthooks_cuda_api_name(len(names))) is not None:
        names.append(name.decode())
    missing = []
    if not torch.version.cuda:
        kind = "ROCm" if torch.version.hip else "CPU"
        missing.append(f"torch {torch.__version__} is a {kind} build")
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        driver, _ = None, missing.append(f"no CUDA driver ({error})")
    nvrtc, nvrtc_path, nvrtc_missing = _find_nvrtc()
    if nvrtc_missing:
        missing.append(nvrtc_missing)
    torch_cuda = _torch_cuda_library()
    libraries = {"cu": driver, "nvrtc": nvrtc, "aoti": torch_cuda}
    addresses = []
    for name in names:
        library = next(lib_ for prefix, lib_ in libraries.items() if name.startswith(prefix))
        address = _resolve(library, name)
        if address is None and library is not None:
            missing.append(f"{name} not found")
        addresses.append(address)
    unavailable = "; ".join(missing) or None
    directory = cache_dir()
    table = (ctypes.c_void_p * len(addresses))(*addresses)
    lib.fasthooks_cuda_setup(
        table,
        directory.encode(),
        ctypes.c_double(lock_wait()),
        unavailable.encode() if unavailable else None,
    )
    return CudaSetup(nvrtc_path, _version(nvrtc), directory, unavailable)


def _version(nvrtc: ctypes.CDLL | None) -> str | None:
    if nvrtc is None:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def target(arch: int) -> str:
    """What NVRTC builds for compute capability `arch` (90 for sm_90): "sm_90", or "compute_N"
    (PTX the driver compiles) for a GPU newer than NVRTC knows.

    Raises RuntimeError when NVRTC is missing or too new for `arch`.
    """
    out = ctypes.create_string_buffer(_OUT_SIZE)
    if _extension().fasthooks_cuda_target(arch, out, ctypes.c_size_t(_OUT_SIZE)) != 0:
        raise RuntimeError(out.value.decode())
    return out.value.decode().split(" ")[1]


def prepare(device: int) -> str | None:
    """Makes the CUDA kernels ready on CUDA device `device` (the smallest one compiled or found in
    the cache, and loaded, as every other needs): None, or why they cannot run there."""
    out = ctypes.create_string_buffer(_OUT_SIZE)
    if _extension().fasthooks_cuda_prepare(device, out, ctypes.c_size_t(_OUT_SIZE)) != 0:
        return out.value.decode()
    return None


def compile_kernel(
    dtype: torch.dtype,
    arch: int,
    *,
    full: bool,
    bins: int = 0,
    diff: bool = False,
    list_: bool = False,
    binades: bool = False,
    top: bool = False,
    channels: bool = False,
) -> tuple[bool, str]:
    """Compiles one kernel for compute capability `arch` into the cache, with no GPU needed:
    (whether it was compiled now rather than found in the cache, its cache file). `bins` is the
    histogram's bin count (0: none), which picks how the kernel counts them; `binades` counts the
    "binades" extra too, `top` keeps the top_k pairs and `channels` the per-channel sums (each
    only by a kernel of one tensor's values, not a list's or a difference's)."""
    if binades and (diff or list_):
        raise ValueError("binades are counted by the kernel of one tensor's values only")
    if top and (diff or list_):
        raise ValueError("top_k is kept by the kernel of one tensor's values only")
    if channels and (diff or list_):
        raise ValueError("channel statistics are kept by the kernel of one tensor's values only")
    out = ctypes.create_string_buffer(_OUT_SIZE)
    done = _extension().fasthooks_cuda_compile(
        DTYPE_POSITIONS[dtype],
        list_,
        full,
        bins,
        diff,
        binades,
        top,
        channels,
        arch,
        out,
        ctypes.c_size_t(_OUT_SIZE),
    )
    if done < 0:
        raise RuntimeError(out.value.decode())
    return done == 1, out.value.decode()


def read_kernel(path: str) -> tuple[str, bytes]:
    """(lowered name, image: a cubin or PTX) of a kernel cache file (kernel_compiler.cpp)."""
    header, name, size, image = Path(path).read_bytes().split(b"\n", 3)
    if not header.startswith(b"fasthooks kernel cache") or int(size) != len(image):
        raise ValueError(f"{path} is not a whole kernel cache file")
    return name.decode(), image
