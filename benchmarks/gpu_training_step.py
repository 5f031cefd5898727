"""One training step of a ResNet-50-sized network under bf16 autocast on a GPU, with and without
activation statistics: none, fastai v1's hook (reproduced), fasthooks python and fused.
    python benchmarks/gpu_training_step.py --out results/gpu_training_step
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from fastai_reference import fastai_v1_hook
from timing import markdown_table
from torch import nn
from training_overhead import ReproducedFastaiStats, train_step

from fasthooks import ActivationStats

VARIANTS = ["no hooks", "fastai v1 hook (reproduced)", "fasthooks python", "fasthooks fused"]


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, c_out, 1, bias=False),
            nn.BatchNorm2d(c_out),
        )
        self.shortcut = (
            nn.Identity()
            if stride == 1 and c_in == c_out
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.body(x) + self.shortcut(x)).relu()


def resnet50_sized(classes: int = 1000) -> nn.Module:
    """The ResNet-50 layout: bottleneck stages of 3, 4, 6 and 3 blocks (about 25.6M parameters)."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    c_in = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(c_in, width, stride if b == 0 else 1))
            c_in = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/gpu_training_step"))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = resnet50_sized().cuda().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.batch_size, 3, 224, 224, device="cuda").to(
        memory_format=torch.channels_last
    )
    y = torch.randint(0, 1000, (args.batch_size,), device="cuda")

    def make(variant: str):
        if variant == "no hooks":
            return None
        if variant.startswith("fastai"):
            return ReproducedFastaiStats(model, fastai_v1_hook)
        total = args.rounds * (args.steps + 2)
        return ActivationStats(model, backend=variant.split()[-1], expected_batches=total)

    def bf16() -> torch.autocast:
        return torch.autocast("cuda", dtype=torch.bfloat16)

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
            cb = make(variant)
            if cb is not None:
                cb.on_train_begin()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for step in range(args.steps + 2):  # two warm-up steps per turn
                if step == 2:
                    torch.cuda.synchronize()
                    start.record()
                train_step(model, nn.functional.cross_entropy, optimizer, (x, y), cb, bf16)
            end.record()
            torch.cuda.synchronize()
            times[variant].append(start.elapsed_time(end) / args.steps)
            if cb is not None:
                cb.on_train_end()

    median = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    base = median["no hooks"]
    fastai_cost = median[VARIANTS[1]] - base
    rows = [
        [
            v,
            f"{median[v]:.2f}",
            "-" if v == "no hooks" else f"{100 * (median[v] - base) / base:+.2f}%",
            "-" if v == "no hooks" else f"{(median[v] - base) / fastai_cost:.3f}",
        ]
        for v in VARIANTS
    ]
    text = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}: ResNet-50-sized network, "
        f"batch {args.batch_size}x3x224x224, bf16 autocast, channels_last; median of "
        f"{args.rounds} rounds of {args.steps} steps\n\n"
        + markdown_table(["variant", "ms / step", "overhead", "cost / fastai v1's cost"], rows)
        + "\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"ms_per_step": times}, indent=2))
    print(text)


if __name__ == "__main__":
    main()
