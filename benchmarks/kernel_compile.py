"""What the first use of the CUDA kernels costs: each kernel compiled by NVRTC for one
architecture into an empty cache, then found in the cache, with no GPU needed.

A typical run is ActivationStats with every statistic and a histogram on bfloat16 activations
and float32 gradients, beside ParameterStats (the list kernel over float32 parameters, and its
difference kernel for the updates): four kernels.

    python benchmarks/kernel_compile.py --arch 90 --out results/kernel_compile
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
from pathlib import Path

import torch

from fasthooks import cuda_setup, ops

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# (name, full, histogram bins, diff): up to 40 bins are counted per thread, more per block
STATISTICS = (
    ("mean and std", False, 0, False),
    ("mean and std + histogram (40 bins)", False, 40, False),
    ("mean and std + histogram (256 bins)", False, 256, False),
    ("every extra", True, 0, False),
    ("every extra + histogram (40 bins)", True, 40, False),
    ("every extra + histogram (256 bins)", True, 256, False),
    ("difference", True, 0, True),
    ("difference + histogram (40 bins)", True, 40, True),
    ("difference + histogram (256 bins)", True, 256, True),
)
TYPICAL = (
    ("bfloat16", False, "every extra + histogram (40 bins)"),
    ("float32", False, "every extra + histogram (40 bins)"),
    ("float32", True, "every extra"),
    ("float32", True, "difference"),
)


def timed_compile(dtype: str, list_: bool, statistics: str, arch: int) -> tuple[float, bool]:
    _, full, bins, diff = next(s for s in STATISTICS if s[0] == statistics)
    start = time.perf_counter()
    compiled, _ = cuda_setup.compile_kernel(
        DTYPES[dtype], arch, full=full, bins=bins, diff=diff, list_=list_
    )
    return time.perf_counter() - start, compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    setup = ops.cuda_status()
    if setup.nvrtc is None:
        raise SystemExit(f"no NVRTC: {setup.unavailable}")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["FASTHOOKS_CACHE_DIR"] = cache
        cuda_setup.configure()
        kernels = list(itertools.product(DTYPES, (False, True), (s[0] for s in STATISTICS)))
        for dtype, list_, statistics in kernels:
            first, compiled = timed_compile(dtype, list_, statistics, args.arch)
            again, compiled_again = timed_compile(dtype, list_, statistics, args.arch)
            assert compiled and not compiled_again
            rows.append((dtype, list_, statistics, first, again))
    by_kernel = {(d, lst, s): first for d, lst, s, first, _ in rows}
    typical = sum(by_kernel[k] for k in TYPICAL)
    target = cuda_setup.target(args.arch)
    lines = [
        f"NVRTC {setup.nvrtc_version}, {target}, {os.cpu_count()} CPUs: seconds per kernel",
        "",
        "| dtype | kernel | statistics | compile (s) | from the cache (ms) |",
        "|---|---|---|---|---|",
    ]
    for dtype, list_, statistics, first, again in rows:
        kind = "list" if list_ else "one tensor"
        lines.append(f"| {dtype} | {kind} | {statistics} | {first:.2f} | {again * 1e3:.2f} |")
    firsts = sorted(r[3] for r in rows)
    lines += [
        "",
        f"{len(rows)} kernels: median {firsts[len(firsts) // 2]:.2f} s, "
        f"longest {firsts[-1]:.2f} s, all {sum(firsts):.1f} s.",
        f"A typical run ({len(TYPICAL)} kernels: bfloat16 and float32 with every extra and a "
        "histogram of 40 bins, ParameterStats' list and difference kernels): "
        f"{typical:.2f} s, once.",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_compile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
