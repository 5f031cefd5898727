"""What activation statistics cost a training loop: fasthooks fused and python vs fastai's hooks.

Trains each model for a fixed number of steps with every variant attached in turn, the variants
interleaved round by round so that machine drift hits them alike, and reports the time per step
(median, min, max; warm-up steps excluded) and the overhead against no hooks. Writes results.md,
results.json (every figure) and overhead.png to --out.
    python benchmarks/training_overhead.py --out results/training_overhead [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from fastai_reference import fastai_v1_hook, fastai_v2_hook
from timing import Timing, machine_line, markdown_table
from torch import nn
from tqdm import tqdm

from fasthooks import ActivationStats, HookCallback

VARIANTS = [
    "no hooks",
    "fastai v1 hook (reproduced)",
    "fastai v2 hook (reproduced)",
    "fasthooks python",
    "fasthooks fused",
]


class ReproducedFastaiStats(HookCallback):
    """fastai's ActivationStats pattern: a hook returning Python floats, appended every batch."""

    def __init__(self, model: nn.Module, hook_func: Callable) -> None:
        super().__init__(model)
        self.hook_func = hook_func
        self.stats: list = []

    def hook(self, m: nn.Module, i: object, o: torch.Tensor) -> object:
        return self.hook_func(m, i, o)

    def on_batch_end(self, train: bool = True, **kwargs: object) -> None:
        if train:
            self.stats.append(self.hooks.stored)


def make_callback(variant: str, model: nn.Module, expected_batches: int) -> HookCallback | None:
    if variant == "no hooks":
        return None
    if variant.startswith("fastai v1"):
        return ReproducedFastaiStats(model, fastai_v1_hook)
    if variant.startswith("fastai v2"):
        return ReproducedFastaiStats(model, fastai_v2_hook)
    backend = variant.removeprefix("fasthooks ")
    return ActivationStats(model, backend=backend, expected_batches=expected_batches)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (
            nn.Identity()
            if stride == 1 and c_in == c_out
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
        return (y + self.shortcut(x)).relu()


def resnet_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 1, 1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        BasicBlock(32, 32, 1),
        BasicBlock(32, 64, 2),
        BasicBlock(64, 128, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 10),
    )


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 1000, d_model: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    batch_size: int
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _classes(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


WORKLOADS = [
    Workload(
        "ResNet-style CNN, 3x32x32",
        resnet_cnn,
        lambda b: (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))),
        128,
        _classes,
    ),
    Workload(
        "MLP 784-2048x3-10",
        mlp,
        lambda b: (torch.randn(b, 784), torch.randint(0, 10, (b,))),
        256,
        _classes,
    ),
    Workload(
        "Transformer encoder, 4 layers d256, seq 128",
        TinyTransformer,
        lambda b: (torch.randint(0, 1000, (b, 128)), torch.randint(0, 1000, (b, 128))),
        32,
        _classes,
    ),
]


def measure(workload: Workload, rounds: int, steps: int, batch_size: int, progress: tqdm) -> dict:
    """Per-step seconds of every variant, interleaved round by round."""
    torch.manual_seed(0)
    model = workload.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = workload.make_batch(batch_size)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    recorded: dict[str, int] = {}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            callback = make_callback(variant, model, expected_batches=steps + 1)
            if callback is not None:
                callback.on_train_begin()
            for step in range(steps + 1):  # the first step of each turn is warm-up
                start = time.perf_counter()
                loss = workload.loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if callback is not None:
                    callback.on_batch_end(train=True)
                if step > 0:
                    samples[variant].append(time.perf_counter() - start)
                progress.update()
            if isinstance(callback, ActivationStats):
                recorded[variant] = int(callback.stats.shape[1])
            if callback is not None:
                callback.on_train_end()
    timings = {v: Timing(s) for v, s in samples.items()}
    base = timings["no hooks"].median
    return {
        "model": workload.name,
        "batch_size": batch_size,
        "hooked_modules": recorded.get("fasthooks fused", recorded.get("fasthooks python", 0)),
        "variants": {
            v: {
                **t.as_dict(),
                "overhead_pct": 100.0 * (t.median - base) / base,
                "samples_s": samples[v],
            }
            for v, t in timings.items()
        },
    }


def report(results: dict) -> str:
    rows = []
    for m in results["models"]:
        for v in VARIANTS:
            f = m["variants"][v]
            rows.append(
                [
                    f"{m['model']}, batch {m['batch_size']}" if v == VARIANTS[0] else "",
                    v,
                    f"{f['median_s'] * 1e3:.1f}",
                    f"{f['min_s'] * 1e3:.1f} / {f['max_s'] * 1e3:.1f}",
                    "-" if v == "no hooks" else f"{f['overhead_pct']:+.1f}%",
                ]
            )
    return (
        f"Machine: {results['machine']}; {results['rounds']} rounds x {results['steps']} timed "
        f"steps per variant and model (after one warm-up step per turn).\n\n"
        + markdown_table(["model", "variant", "step ms (median)", "min / max ms", "overhead"], rows)
        + "\n"
    )


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hooked = VARIANTS[1:]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(hooked)
    for k, variant in enumerate(hooked):
        values = [m["variants"][variant]["overhead_pct"] for m in results["models"]]
        xs = [i + (k - (len(hooked) - 1) / 2) * width for i in range(len(values))]
        bars = ax.bar(xs, values, width, label=variant)
        ax.bar_label(bars, fmt="%.1f%%", fontsize="x-small")
    ax.set_xticks(range(len(results["models"])))
    ax.set_xticklabels([m["model"].split(",")[0] for m in results["models"]])
    ax.set_ylabel("added time per training step (%)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_title(f"Cost of activation statistics per step\n{results['machine']}", fontsize="small")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/training_overhead"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    parser.add_argument(
        "--quick", action="store_true", help="2 rounds x 1 step at a quarter batch size"
    )
    args = parser.parse_args()
    rounds, steps, scale = (2, 1, 4) if args.quick else (args.rounds, args.steps, 1)

    total = len(WORKLOADS) * rounds * len(VARIANTS) * (steps + 1)
    with tqdm(total=total, unit="step", desc="training steps") as progress:
        models = [
            measure(w, rounds, steps, max(1, w.batch_size // scale), progress) for w in WORKLOADS
        ]
    results = {
        "machine": machine_line(),
        "quick": args.quick,
        "rounds": rounds,
        "steps": steps,
        "variants": VARIANTS,
        "models": models,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (args.out / "results.md").write_text(text)
    plot(results, args.out / "overhead.png")
    print("\n" + text)
    print(f"written to {args.out}/results.md, results.json and overhead.png")


if __name__ == "__main__":
    main()
