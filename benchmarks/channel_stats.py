"""What per-channel statistics cost, per layout, side by side on one tensor: the fused operator
with mean and std alone and with every extra, each with the running per-channel sums added
(absmax, mean, rms and the active fraction of every channel); `torch.sum` of the same tensor (the
read floor); and the hand-rolled torch ops a user writes today for the same four vectors
(`amax` of `abs()` over the other dims, a `sum`, a `sum` of squares and a count above the
threshold). Layouts: NCHW (each channel a contiguous run), channels_last and (tokens, channels)
(a stride-1 channel axis). Ratios are against `torch.sum` in the same run.

    python benchmarks/channel_stats.py [--numel 4194304] [--channels 256] [--dtypes float32]
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


def fused(x: torch.Tensor, dim: int, full: bool, channels: bool):
    b = StatBuffers(1, 1, x.device, full=full, hist_bins=0)
    if channels:
        b.resize_channels(x.shape[dim])
    args = b.op_args()
    return lambda: accumulate_stats(x, *args, 0, channel_dim=dim)


def hand_rolled(x: torch.Tensor, dim: int, near_zero: float = 0.05):
    others = [d for d in range(x.dim()) if d != dim % x.dim()]

    def per_channel():
        magnitude = x.abs()
        return (
            magnitude.amax(dim=others),
            x.sum(dim=others),
            (x * x).sum(dim=others),
            (magnitude > near_zero).sum(dim=others),
        )

    return per_channel


def layouts(numel: int, channels: int, dtype: torch.dtype, device: str):
    """(name, tensor, channel dim) of each layout, the same values in each."""
    side = max(1, int((numel // (channels * 16)) ** 0.5))
    x = torch.randn(16, channels, side, side, generator=torch.Generator().manual_seed(0))
    x = x.to(dtype).to(device)
    tokens = x.permute(0, 2, 3, 1).reshape(-1, channels).contiguous()
    return [
        ("NCHW", x, 1),
        ("channels_last", x.contiguous(memory_format=torch.channels_last), 1),
        ("(tokens, channels)", tokens, -1),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--channels", type=int, default=256)
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not extension_available():
        raise SystemExit("fasthooks._C is not built: `make build` first")
    results, rows = {}, []
    for name in args.dtypes:
        for layout, x, dim in layouts(args.numel, args.channels, getattr(torch, name), args.device):
            variants = {
                "torch.sum": lambda x=x: x.sum(),
                "mean and std": fused(x, dim, full=False, channels=False),
                "mean and std + channels": fused(x, dim, full=False, channels=True),
                "every extra": fused(x, dim, full=True, channels=False),
                "every extra + channels": fused(x, dim, full=True, channels=True),
                "hand-rolled: amax, sums, count": hand_rolled(x, dim),
            }
            variants = {v: synchronised(fn, args.device) for v, fn in variants.items()}
            timings = interleaved(variants, rounds=args.rounds, calls=3)
            floor = timings["torch.sum"].median
            results[f"{name} {layout}"] = {v: t.as_dict() for v, t in timings.items()}
            for variant, timing in timings.items():
                rows.append(
                    [name, layout, variant, f"{timing.median * 1e3:.2f}",
                     f"{timing.median / floor:.2f}"]
                )  # fmt: skip
    device = machine_line() if args.device == "cpu" else torch.cuda.get_device_name()
    table = markdown_table(["dtype", "layout", "variant", "ms", "x torch.sum"], rows)
    text = (
        f"{device}; {x.numel():,} values, {args.channels} channels, median of {args.rounds} "
        f"rounds\n\n{table}\n"
    )
    report(text, args.out)
    if args.out is not None:
        (args.out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
