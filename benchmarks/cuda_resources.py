"""Registers, spills and resident blocks of each CUDA kernel, as ptxas reports them.

Compiles csrc/cuda/accumulate_cuda.cu with `nvcc -Xptxas -v` for each architecture (no GPU
needed; torch must be a CUDA build) and prints a markdown table: per kernel and architecture the
registers a thread uses, the bytes it spills, and how many blocks of 256 threads a multiprocessor
holds by registers (65,536 of them, allocated per warp in units of 256); "list" marks the kernels
that take many tensors in one launch (accumulate_stats_list).

    python benchmarks/cuda_resources.py [--archs 80 90] [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "cuda" / "accumulate_cuda.cu"
THREADS = 256
REGISTERS_PER_SM = 65536
DTYPES = {"f": "float32", "d": "float64", "N3c104HalfE": "float16", "N3c108BFloat16E": "bfloat16"}
KERNEL = re.compile(
    r"accumulate_(stats|list)_kernelI(f|d|N3c104HalfE|N3c108BFloat16E)[fd]Lb([01])ELb([01])ELb([01])E"
)
ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\d+)'")
SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def blocks_by_registers(registers: int) -> int:
    per_warp = -(-registers * 32 // 256) * 256
    return REGISTERS_PER_SM // (per_warp * (THREADS // 32))


class Kernel(NamedTuple):
    """One instantiation of the kernel template, read from its mangled name."""

    dtype: str
    full: bool  # every statistic, or mean and std only
    hist: bool
    diff: bool  # of a difference from a base
    is_list: bool  # the list kernel (accumulate_stats_list)

    @property
    def what(self) -> str:
        what = ("every statistic" if self.full else "mean and std") + (
            " + histogram" if self.hist else ""
        )
        what += " of a difference" if self.diff else ""
        return what + (", list" if self.is_list else "")


def kernel_of(name: str) -> Kernel | None:
    """The kernel a (mangled) function name is, or None for another function."""
    match = KERNEL.search(name)
    if match is None:
        return None
    family, dtype, full, hist, diff = match.groups()
    return Kernel(DTYPES[dtype], full == "1", hist == "1", diff == "1", family == "list")


def nvcc_command() -> list[str]:
    """nvcc with the flags and include paths that compile SOURCE as the extension's build does;
    the caller adds what to produce and for which architectures."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        raise SystemExit(
            f"{Path(sys.argv[0]).name} needs a CUDA build of torch and a CUDA toolkit (nvcc)"
        )
    sys.path.insert(0, str(ROOT))
    from fasthooks.torch_support import MIN_TORCH

    target = (MIN_TORCH[0] << 56) | (MIN_TORCH[1] << 48)
    includes = [f"-I{p}" for p in cpp_extension.include_paths(device_type="cuda")]
    try:
        import nvidia

        includes += [f"-I{p}" for b in nvidia.__path__ for p in Path(b).glob("cu*/include")]
    except ImportError:
        pass
    nvcc = shutil.which("nvcc") or str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc")
    command = [nvcc, str(SOURCE), "-O3", "-std=c++17", f"-DTORCH_TARGET_VERSION={target:#x}"]
    return [*command, "-DUSE_CUDA", *includes]


def ptxas_report(archs: list[str]) -> str:
    """nvcc's resource report for every kernel of SOURCE."""
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    with tempfile.TemporaryDirectory() as scratch:
        command = [*nvcc_command(), "-c", "-o", f"{scratch}/kernels.o", "-Xptxas", "-v"]
        done = subprocess.run(command + gencode, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"nvcc failed:\n{done.stderr[-4000:]}")
    return done.stderr


def resources(report: str) -> dict[tuple[str, str], dict[str, tuple[int, int]]]:
    """{(dtype, statistics): {arch: (registers, spill stores + loads in bytes)}}."""
    table: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
    kernel = arch = None
    spilled = 0
    for line in report.splitlines():
        if entry := ENTRY.search(line):
            found = kernel_of(entry.group(1))
            kernel = (found.dtype, found.what) if found else None
            arch, spilled = entry.group(2), 0
        elif (spills := SPILLS.search(line)) and kernel:
            spilled = int(spills.group(1)) + int(spills.group(2))
        elif (used := USED.search(line)) and kernel:
            table.setdefault(kernel, {})[arch] = (int(used.group(1)), spilled)
    return table


def markdown(table: dict[tuple[str, str], dict[str, tuple[int, int]]], archs: list[str]) -> str:
    head = "| kernel | " + " | ".join(f"sm_{a} registers (spilled bytes)" for a in archs)
    lines = [head + " | blocks/SM by registers |", "|---|" + "---|" * (len(archs) + 1)]
    for (dtype, what), per_arch in sorted(table.items()):
        cells = [f"{per_arch[a][0]} ({per_arch[a][1]})" for a in archs]
        blocks = min(blocks_by_registers(per_arch[a][0]) for a in archs)
        lines.append(f"| {dtype}, {what} | " + " | ".join(cells) + f" | {blocks} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["80", "90"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = markdown(resources(ptxas_report(args.archs)), args.archs)
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)


if __name__ == "__main__":
    main()
