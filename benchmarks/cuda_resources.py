"""Registers, spills and resident blocks of each CUDA kernel, read from the cubins NVRTC makes.

Compiles every kernel instantiation for each architecture as the extension does at its first use
(fasthooks.cuda_setup.compile_kernel, into its cache, FASTHOOKS_CACHE_DIR; no GPU needed, but
fasthooks._C built and a CUDA build of torch with its NVRTC), disassembles each cubin with
nvdisasm and prints a markdown table: per kernel and architecture the registers a thread uses
(the cubin's EIATTR_REGCOUNT), the bytes its own code (not its subroutines, the slow paths of
division) stores to and loads from local memory (what ptxas -v reports as spills), and how many
blocks of 256 threads a multiprocessor holds by registers (65,536 of them, allocated per warp in
units of 256); "list" marks the kernels that take many tensors in one launch
(accumulate_stats_list).

    python benchmarks/cuda_resources.py [--archs 80 90] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
# The checkout's fasthooks, where no other is importable.
sys.path.append(str(ROOT))
THREADS = 256
REGISTERS_PER_SM = 65536
# A memory access's size modifier in SASS, in bytes (none: 4).
ACCESS_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1, "256": 32}
LOCAL_ACCESS = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?((?:LDL|STL)[\w.]*)", re.M)
# A subroutine's label, where a kernel's own code ends.
SUBROUTINE = re.compile(r"^\$[\w$]+:", re.M)
REGCOUNT = re.compile(r"EIATTR_REGCOUNT\n(?:.*\n)*?.*index@\((\S+)\)\n.*\.word\s+0x([0-9a-f]+)")


def blocks_by_registers(registers: int) -> int:
    per_warp = -(-registers * 32 // 256) * 256
    return REGISTERS_PER_SM // (per_warp * (THREADS // 32))


# A bin count of each way a kernel counts a histogram's bins (kernel_layout.h): none, per thread,
# per block.
HISTOGRAM_BINS = (0, 16, 256)


class Kernel(NamedTuple):
    """One instantiation of the kernel template."""

    dtype: str
    full: bool  # every statistic, or mean and std only
    bins: int  # the histogram's bin count (0: none): up to 40 counted per thread, more per block
    diff: bool  # of a difference from a base
    is_list: bool  # the list kernel (accumulate_stats_list)
    binades: bool = False  # the "binades" extra counted too (one tensor's values only)
    top: bool = False  # the top_k pairs kept too (one tensor's values only)
    channels: bool = False  # the running per-channel sums added to too (one tensor's values only)

    @property
    def what(self) -> str:
        what = ("every statistic" if self.full else "mean and std") + (
            f" + histogram ({self.bins} bins)" if self.bins else ""
        )
        what += " + binades" if self.binades else ""
        what += " + top_k" if self.top else ""
        what += " + channel sums" if self.channels else ""
        what += " of a difference" if self.diff else ""
        return what + (", list" if self.is_list else "")


# Every instantiation the extension can launch: a difference has every statistic; binades are
# counted of one tensor's values, not of a list or a difference.
KERNELS = [
    Kernel(dtype, full, bins, diff, is_list, binades)
    for dtype in ("float32", "float64", "float16", "bfloat16")
    for is_list in (False, True)
    for full, diff in ((False, False), (True, False), (True, True))
    for bins in HISTOGRAM_BINS
    for binades in ((False, True) if not (is_list or diff) else (False,))
]


def access_bytes(opcode: str) -> int:
    """Bytes a load or store instruction moves, from its opcode ("LDG.E.128.CONSTANT")."""
    return next((ACCESS_BYTES[m] for m in opcode.split(".") if m in ACCESS_BYTES), 4)


def nvdisasm() -> str | None:
    """The toolkit's nvdisasm, or the one of the nvidia-cuda-nvdisasm package."""
    found = shutil.which("nvdisasm")
    try:
        import nvidia

        found = found or next(
            (str(p) for b in nvidia.__path__ for p in Path(b).glob("cu*/bin/nvdisasm")), None
        )
    except ImportError:
        pass
    return found


def missing() -> str | None:
    """Why the kernels cannot be compiled and disassembled here (None when they can)."""
    try:
        from fasthooks import ops

        status = ops.cuda_status()
    except (ImportError, RuntimeError) as error:
        return f"fasthooks._C is not usable: {error}"
    if status.nvrtc is None:
        return f"no NVRTC: {status.unavailable}"
    if nvdisasm() is None:
        return "no nvdisasm: install the nvidia-cuda-nvdisasm package (make .venv-cuda)"
    return None


def cubin(kernel: Kernel, arch: str) -> tuple[str, bytes]:
    """(lowered name, cubin) of `kernel` for sm_`arch`, compiled as the extension compiles it."""
    import torch

    from fasthooks import cuda_setup

    _, path = cuda_setup.compile_kernel(
        getattr(torch, kernel.dtype),
        int(arch),
        full=kernel.full,
        bins=kernel.bins,
        diff=kernel.diff,
        list_=kernel.is_list,
        binades=kernel.binades,
        top=kernel.top,
        channels=kernel.channels,
    )
    return cuda_setup.read_kernel(path)


def disassemble(archs: list[str]) -> dict[tuple[Kernel, str], tuple[str, str]]:
    """{(kernel, arch): (its lowered name, nvdisasm's listing of its cubin)} for every kernel."""
    if why := missing():
        raise SystemExit(f"{Path(sys.argv[0]).name}: {why}")
    from fasthooks import cuda_setup

    for arch in archs:
        # A GPU newer than NVRTC knows gets PTX, which nvdisasm cannot read.
        if (target := cuda_setup.target(int(arch))) != f"sm_{arch}":
            raise SystemExit(f"NVRTC builds {target} for sm_{arch}, not a cubin")
    disassembler = nvdisasm()

    def one(job: tuple[Kernel, str]) -> tuple[str, str]:
        kernel, arch = job
        name, image = cubin(kernel, arch)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
            file.write(image)
            file.flush()
            done = subprocess.run([disassembler, file.name], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"nvdisasm failed on {kernel} for sm_{arch}:\n{done.stderr[-4000:]}")
        return name, done.stdout

    jobs = [(kernel, arch) for arch in archs for kernel in KERNELS]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return dict(zip(jobs, pool.map(one, jobs), strict=True))


def registers(name: str, listing: str) -> int:
    """The registers a thread of kernel `name` uses, from nvdisasm's listing of its cubin."""
    return {found: int(count, 16) for found, count in REGCOUNT.findall(listing)}[name]


def spilled_bytes(name: str, listing: str) -> int:
    """Bytes of the local-memory stores and loads in the code of kernel `name` (up to its first
    subroutine), from nvdisasm's listing of its cubin: its spills, as ptxas counts them."""
    code = SUBROUTINE.split(listing.split(f"\n.text.{name}:\n", 1)[1], 1)[0]
    return sum(access_bytes(opcode) for opcode in LOCAL_ACCESS.findall(code))


def resources(
    listings: dict[tuple[Kernel, str], tuple[str, str]],
) -> dict[tuple[str, str], dict[str, tuple[int, int]]]:
    """{(dtype, statistics): {arch: (registers, spill stores + loads in bytes)}}."""
    table: dict[tuple[str, str], dict[str, tuple[int, int]]] = {}
    for (kernel, arch), (name, listing) in listings.items():
        figures = (registers(name, listing), spilled_bytes(name, listing))
        table.setdefault((kernel.dtype, kernel.what), {})[arch] = figures
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
    text = markdown(resources(disassemble(args.archs)), args.archs)
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)


if __name__ == "__main__":
    main()
