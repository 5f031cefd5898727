"""What watching parameters costs a training step, side by side in one run.

Variants, interleaved in rounds (`timing.py`): no statistics; `ParameterStats` (weights, gradients
and updates, fused and python backends); and the usual way, a norm and an absmax per parameter
and gradient read with `.item()` each step (what per-parameter loggers do). Prints a markdown
table of the step time over the bare step's.

    python benchmarks/parameter_overhead.py [--steps 30] [--rounds 5] [--device cuda] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from timing import interleaved, machine_line, markdown_table, report
from torch import nn

from fasthooks import ParameterStats


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):  # 48 parameters, about 1.6 M values
        layers += [nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def _trainer(variant: str, device: str):
    model = _model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
    ps = None
    if variant.startswith("ParameterStats"):
        backend = "fused" if "fused" in variant else "python"
        ps = ParameterStats(model, opt, backend=backend, expected_steps=4096)
        ps.start()

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        if variant == "item per parameter":
            for p in model.parameters():
                for t in (p, p.grad):
                    t.norm().item(), t.abs().max().item()
        opt.step()
        opt.zero_grad()
        if device != "cpu":
            torch.cuda.synchronize(device)  # the step's time, not its launches'

    return step


VARIANTS = ["no statistics", "ParameterStats fused", "ParameterStats python", "item per parameter"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    steps = {v: _trainer(v, args.device) for v in VARIANTS}
    timings = interleaved(steps, rounds=args.rounds, calls=args.steps)
    base = timings["no statistics"].median
    rows = [
        [name, f"{t.median * 1e3:.2f}", f"{t.median / base:.3f}"] for name, t in timings.items()
    ]
    table = markdown_table(["variant", "ms per step", "over no statistics"], rows)
    text = f"{machine_line()}, device {args.device}\n\n{table}\n"
    report(text, args.out)


if __name__ == "__main__":
    main()
