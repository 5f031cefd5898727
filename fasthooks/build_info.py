"""What this installation holds and whether its kernels agree with the python backend: the first
thing to run on a new machine, and what a bug report should hold (`python -m fasthooks`)."""

from __future__ import annotations

import platform
from typing import Any

import torch

from . import cuda_setup, ops
from ._version import __version__
from .buffers import StatBuffers
from .moments import accumulate_stats_python

SELF_CHECK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The fused kernels and the float64 reference agree to float32 rounding on a million values.
SELF_CHECK_RTOL = 1e-5


def build_info() -> dict[str, Any]:
    """The package and torch versions, whether the extension loaded (and why not), the CPU
    kernels picked, which device types have a fused kernel registered, and what the CUDA
    kernels found: NVRTC, what it compiles for each GPU, the cache, and why they cannot run.

    Examples:
        >>> info = build_info()
        >>> info["fasthooks"] == __version__ and "torch" in info
        True
    """
    loaded = ops.extension_available()
    return {
        "fasthooks": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "extension": loaded,
        "extension_error": ops.extension_error(),
        "cpu_kernels": ops.cpu_capability() if loaded else None,
        "fused_kernels": {
            device: loaded and ops.has_kernel_for(device) for device in ("cpu", "cuda")
        },
        "devices": devices(),
        **(cuda_info() if loaded else {}),
    }


def cuda_info() -> dict[str, Any]:
    """NVRTC (path and version), the cache directory, what NVRTC compiles for each CUDA device,
    and why the CUDA kernels cannot run here (None when they can)."""
    setup = ops.cuda_status()
    targets = {}
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        try:
            targets[f"cuda:{i}"] = cuda_setup.target(major * 10 + minor)
        except RuntimeError as error:
            targets[f"cuda:{i}"] = str(error)
    return {
        "nvrtc": setup.nvrtc,
        "nvrtc_version": setup.nvrtc_version,
        "kernel_cache": setup.cache_dir,
        "cuda_targets": targets,
        "cuda_unavailable": setup.unavailable,
    }


def devices() -> list[str]:
    """The devices present: the CPU and each CUDA device."""
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def self_check(device: str, dtype: torch.dtype) -> float:
    """The largest relative difference between the fused operator and the python backend over
    a million values of `dtype` on `device` (every statistic and a histogram); histograms and
    counts must agree exactly, else infinity."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1_000_000, generator=g) * 3 + 1).to(device, dtype)
    results = []
    for accumulate in (torch.ops.fasthooks.accumulate_stats.default, accumulate_stats_python):
        b = StatBuffers(1, 1, device, full=True, hist_bins=40)
        accumulate(x, *b.op_args(), 0, 0.05, -5.0, 5.0)
        results.append((b.stats.cpu(), b.extra.cpu(), b.hist.cpu()))
    (fused_stats, fused_extra, fused_hist), (want_stats, want_extra, want_hist) = results
    if not torch.equal(fused_hist, want_hist):
        return float("inf")
    got, want = torch.cat([fused_stats, fused_extra]), torch.cat([want_stats, want_extra])
    return float(((got - want).abs() / want.abs().clamp_min(1e-12)).max())


def main() -> int:
    """Print what this installation holds, then check the fused kernels on every device against
    the python backend; 1 on a mismatch (or when the extension did not load), else 0."""
    info = build_info()
    for key, value in info.items():
        print(f"{key:>16}: {value}")
    if not info["extension"]:
        print("self-check: the fused operator did not load; the python backend runs instead")
        return 1
    failed = False
    for device in info["devices"]:
        if not ops.has_kernel_for(torch.device(device).type):
            print(f"self-check {device}: no fused kernel for this device type")
            failed = True
            continue
        if device.startswith("cuda") and info["cuda_unavailable"]:
            print(f"self-check {device}: the CUDA kernels cannot run: {info['cuda_unavailable']}")
            failed = True
            continue
        for dtype in SELF_CHECK_DTYPES:
            difference = self_check(device, dtype)
            ok = difference <= SELF_CHECK_RTOL
            failed |= not ok
            verdict = "ok" if ok else "MISMATCH"
            print(f"self-check {device} {dtype}: {verdict} (largest difference {difference:.2e})")
    return 1 if failed else 0
