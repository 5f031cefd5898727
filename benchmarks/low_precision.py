"""What the "binades" extra and `top_k` cost, side by side on one tensor: the fused operator with
every other extra, with binades or the 16 largest values added, with either beside mean and std
alone; `torch.sum` of the same tensor (the read floor); and what a user hand-rolls today for the
same answers (`torch.histc` of `log2|x|`, the `frexp` + `bincount` a careful one writes, and
`torch.topk` of `abs()` with the channels of its indices). The tensor is read as (tokens, 1024
channels) for the channels. Ratios are against `torch.sum` in the same run.

    python benchmarks/low_precision.py [--numel 4194304] [--dtypes float32 bfloat16]
        [--rounds 7] [--device cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from timing import interleaved, machine_line, markdown_table, report, synchronised

from fasthooks.buffers import StatBuffers
from fasthooks.ops import accumulate_stats, extension_available

CHANNELS = 1024


def fused(x: torch.Tensor, binades: bool, full: bool = True, top_k: int = 0):
    b = StatBuffers(1, 1, x.device, full=full, hist_bins=0, binades=binades, top_k=top_k)
    args = b.op_args()
    return lambda: accumulate_stats(x, *args, 0)


def hand_rolled_topk(x: torch.Tensor, k: int = 16):
    def top():
        _, index = torch.topk(x.abs().reshape(-1), k)
        return x.reshape(-1)[index], index % CHANNELS

    return top


def hand_rolled_histc(x: torch.Tensor):
    # One bin a binade over float32's normal range, as a user would bin log2|x|.
    return lambda: torch.histc(torch.log2(x.float().abs()), bins=254, min=-126, max=128)


def hand_rolled_frexp(x: torch.Tensor):
    return lambda: torch.bincount(torch.frexp(x.float())[1].reshape(-1) + 160, minlength=320)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not extension_available():
        raise SystemExit("fasthooks._C is not built: `make build` first")
    results, rows = {}, []
    for name in args.dtypes:
        x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(
            getattr(torch, name)
        )
        x = x.reshape(-1, CHANNELS) if args.numel % CHANNELS == 0 else x
        x = x.to(args.device)
        variants = {
            "torch.sum": lambda x=x: x.sum(),
            "mean and std": fused(x, binades=False, full=False),
            "every extra": fused(x, binades=False),
            "every extra + binades": fused(x, binades=True),
            "mean and std + binades": fused(x, binades=True, full=False),
            "every extra + top_k=16": fused(x, binades=False, top_k=16),
            "mean and std + top_k=16": fused(x, binades=False, full=False, top_k=16),
            "hand-rolled: histc of log2|x|": hand_rolled_histc(x),
            "hand-rolled: frexp + bincount": hand_rolled_frexp(x),
            "hand-rolled: topk of abs() (k=16)": hand_rolled_topk(x),
        }
        variants = {v: synchronised(fn, args.device) for v, fn in variants.items()}
        timings = interleaved(variants, rounds=args.rounds, calls=3)
        floor = timings["torch.sum"].median
        results[name] = {v: t.as_dict() for v, t in timings.items()}
        for variant, timing in timings.items():
            gbps = args.numel * x.element_size() / timing.median / 1e9
            rows.append(
                [name, variant, f"{timing.median * 1e3:.2f}", f"{gbps:.1f}",
                 f"{timing.median / floor:.2f}"]
            )  # fmt: skip
    text = (
        f"{machine_line() if args.device == 'cpu' else torch.cuda.get_device_name()}; "
        f"{args.numel:,} values, median of {args.rounds} rounds\n\n"
        + markdown_table(["dtype", "variant", "ms", "GB/s read", "x torch.sum"], rows)
        + "\n"
    )
    report(text, args.out)
    if args.out is not None:
        (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
