"""Each CUDA kernel's measured time over torch.sum beside what its SASS predicts.

The prediction is docs/cuda.md's roofline table (benchmarks/cuda_roofline.py): with an issue
bound b times the bandwidth, the kernel can read at most min(1, b) of the bandwidth, so its time
over torch.sum's (one read at the bandwidth) is at least max(1, 1 / b). The measurement is
benchmarks/op_throughput.py's on this GPU, at its largest tensor.

    python benchmarks/roofline_vs_measured.py OP_RESULTS.json [...] --out FILE
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- cuda_roofline:begin -->", "<!-- cuda_roofline:end -->"
# op_throughput's variants and the roofline table's names for the same kernels.
KERNELS = {
    "mean+std": "mean and std",
    "every extra": "every statistic",
    "every extra + hist": "every statistic + histogram",
}
GPUS = ("A100", "H100", "H200", "B200")


def predicted(page: str) -> dict[tuple[str, str], float]:
    """{(kernel, GPU short name): issue bound / bandwidth} from the roofline table."""
    table = page[page.index(BEGIN) : page.index(END)]
    bounds = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and re.match(r"[\d.]+$", cells[4]):
            gpu = next((g for g in GPUS if g in cells[1]), None)
            if gpu:
                bounds[(cells[0], gpu)] = float(cells[4])
    return bounds


def rows(results: dict, bounds: dict[tuple[str, str], float]) -> list[str]:
    gpu = next((g for g in GPUS if g in results["machine"]), None)
    largest = max(results["sum_vs_fused"], key=lambda r: r["size_mb"])
    out = []
    for mode, name in KERNELS.items():
        kernel = f"{results['dtype']}, {name}"
        bound = bounds.get((kernel, gpu)) if gpu else None
        floor = f"{max(1.0, 1.0 / bound):.2f}" if bound else "n/a"
        measured = largest[f"{mode}_over_sum"]
        out.append(
            f"| {kernel} | {largest['size_mb']} | {bound or 'n/a'} | {floor} | {measured:.2f} |"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="op_throughput's results.json")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bounds = predicted((ROOT / "docs" / "cuda.md").read_text())
    lines = [
        "| kernel | MB | issue bound / bandwidth (SASS) | predicted time / torch.sum, at least "
        "| measured time / torch.sum |",
        "|---|---|---|---|---|",
    ]
    machine = ""
    for path in args.results:
        results = json.loads(path.read_text())
        machine = results["machine"]
        lines += rows(results, bounds)
    text = f"{machine}\n\n" + "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
