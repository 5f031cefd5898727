"""Builds fasthooks' operator extension fasthooks._C (the metadata is in pyproject.toml).

The extension is built for the CPU always and for CUDA when torch is a CUDA build and a CUDA
toolkit is found (no visible GPU needed). Switches, read from the environment:
  FASTHOOKS_NO_EXT=1   install the pure-Python package only
  FASTHOOKS_NO_CUDA=1  skip the CUDA kernels
  FORCE_CUDA=1         build the CUDA kernels or fail saying why
  TORCH_CUDA_ARCH_LIST the GPU architectures to compile for (torch's own switch); when it is
                       unset and no GPU is visible, DEFAULT_CUDA_ARCHS
Build without pip's build isolation (`pip install --no-build-isolation .`) so that the torch
already installed is the one compiled against; an isolated build stops at once saying so.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent


# The extension is compiled for the stable ABI of the oldest torch it serves (fasthooks's own
# definition, read without importing the package).
_spec = importlib.util.spec_from_file_location(
    "torch_support", ROOT / "fasthooks" / "torch_support.py"
)
torch_support = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_support)
MIN_STABLE_ABI_TORCH = torch_support.MIN_TORCH
MIN_TORCH_TEXT = torch_support.MIN_TORCH_TEXT
STABLE_ABI_TARGET = (MIN_STABLE_ABI_TORCH[0] << 56) | (MIN_STABLE_ABI_TORCH[1] << 48)
# Volta to Hopper, and PTX for later GPUs: the kernels need sm_70 (warp match instructions).
DEFAULT_CUDA_ARCHS = "7.0;7.5;8.0;8.6;8.9;9.0+PTX"
NO_TORCH = (
    "fasthooks builds its extension against the torch installed in your environment, but this "
    "build cannot import torch ({error}). pip builds in an isolated environment unless told "
    "otherwise: run `pip install --no-build-isolation .` in the environment that has torch, or "
    "`FASTHOOKS_NO_EXT=1 pip install .` for the pure-Python package."
)


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _say(message: str) -> None:
    print(f"fasthooks setup: {message}", file=sys.stderr)


def _cuda_decision(torch_cuda: str | None, cuda_home: str | None) -> bool:
    if _flag("FASTHOOKS_NO_CUDA"):
        _say("CUDA kernels skipped (FASTHOOKS_NO_CUDA=1)")
        return False
    missing = [
        what
        for what, ok in (("a CUDA build of torch", torch_cuda), ("CUDA_HOME/nvcc", cuda_home))
        if not ok
    ]
    if not missing:
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not _gpu_visible():
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
        _say(
            f"building CUDA kernels (torch CUDA {torch_cuda}, toolkit at {cuda_home}, "
            f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', 'torch default')})"
        )
        return True
    if _flag("FORCE_CUDA"):
        raise RuntimeError(f"FORCE_CUDA=1 but this environment lacks {' and '.join(missing)}")
    _say(f"CUDA kernels skipped: this environment lacks {' and '.join(missing)}")
    return False


def _gpu_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def _pip_cuda_include_dirs() -> list[str]:
    """Headers of the CUDA libraries torch includes, shipped in its nvidia pip packages."""
    try:
        import nvidia
    except ImportError:
        return []
    return [str(p) for base in nvidia.__path__ for p in Path(base).glob("cu*/include")]


def extension_build():
    """(ext_modules, cmdclass) for this environment, printing what was decided."""
    if _flag("FASTHOOKS_NO_EXT"):
        _say("pure-Python install (FASTHOOKS_NO_EXT=1); ActivationStats uses backend='python'")
        return [], {}
    try:
        import torch
    except ImportError as error:
        raise SystemExit(NO_TORCH.format(error=error)) from None
    if torch_support.torch_version(torch.__version__) < MIN_STABLE_ABI_TORCH:
        _say(
            f"torch {torch.__version__} predates the stable ABI (torch >= {MIN_TORCH_TEXT}) that "
            "fasthooks._C is built on: pure-Python install; ActivationStats uses backend='python'"
        )
        return [], {}
    from torch.utils import cpp_extension

    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp"))
    # Only torch's stable C ABI and header-only types, so the binary loads under any later torch.
    target = f"-DTORCH_TARGET_VERSION={STABLE_ABI_TARGET:#x}"
    # C++17, not torch's default C++20: under C++20, torch's headers reach libstdc++ 11 symbols
    # (std::stringbuf's str() overloads) that manylinux_2_28's libstdc++ lacks.
    cxx = ["-O3", "-std=c++17", "-fvisibility=hidden", target]
    # Found before the system's headers: see the header for why (manylinux_2_28).
    compat = [str(ROOT / "csrc" / "compat")]
    if _cuda_decision(torch.version.cuda, cpp_extension.CUDA_HOME):
        sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu"))
        extension = cpp_extension.CUDAExtension(
            "fasthooks._C",
            sources,
            include_dirs=compat + _pip_cuda_include_dirs(),
            # USE_CUDA declares the C shim's CUDA functions (the current stream among them).
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++17", target, "-DUSE_CUDA"]},
            py_limited_api=True,
        )
    else:
        _say(
            f"building CPU kernels with torch {torch.__version__}'s headers, "
            f"for torch >= {MIN_TORCH_TEXT}"
        )
        extension = cpp_extension.CppExtension(
            "fasthooks._C",
            sources,
            include_dirs=compat,
            extra_compile_args={"cxx": cxx},
            py_limited_api=True,
        )
    return [extension], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_build()

# The package's metadata is in pyproject.toml; this file builds only the extension.
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # One wheel for every CPython from 3.10 on (the extension uses the limited API only).
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)
