"""What activation statistics cost a training loop: fasthooks fused and python vs fastai's hooks.

Trains each model for a fixed number of steps with every variant attached in turn, the variants
interleaved round by round so that machine drift hits them alike, and reports the time per step
(median, min, max; warm-up steps excluded) and the overhead against no hooks. Writes results.md,
results.json (every figure) and overhead.png to --out.
    python benchmarks/training_overhead.py --out results/training_overhead [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
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
from fasthooks.layout import EXTRAS

VARIANTS = [
    "no hooks",
    "fastai v1 hook (reproduced)",
    "fastai v2 hook (reproduced)",
    "fasthooks python",
    "fasthooks fused",
    "fasthooks fused, every stat + 40-bin hist",
]
EVERY_STAT = {"extra": EXTRAS, "hist_bins": 40}


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
    if variant.endswith("hist"):
        return ActivationStats(
            model, backend="fused", expected_batches=expected_batches, **EVERY_STAT
        )
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
    steps: int  # timed steps per turn: about a second of work, so every model gets a fair sample


def _classes(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


WORKLOADS = [
    Workload(
        "ResNet-style CNN, 3x32x32",
        resnet_cnn,
        lambda b: (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))),
        128,
        _classes,
        2,
    ),
    Workload(
        "MLP 784-2048x3-10",
        mlp,
        lambda b: (torch.randn(b, 784), torch.randint(0, 10, (b,))),
        256,
        _classes,
        5,
    ),
    Workload(
        "Transformer encoder, 4 layers d256, seq 128",
        TinyTransformer,
        lambda b: (torch.randint(0, 1000, (b, 128)), torch.randint(0, 1000, (b, 128))),
        32,
        _classes,
        1,
    ),
]


def train_step(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    callback: HookCallback | None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """One optimiser step on `batch`, then the callback's end of a training batch."""
    x, y = batch
    with autocast():
        loss = loss_fn(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    if callback is not None:
        callback.on_batch_end(train=True)


def _time_hooks(callback: HookCallback, seconds: list[float]) -> None:
    """Add the time spent inside callback.hook to `seconds` (its last entry)."""
    hook = callback.hook

    def timed(m: nn.Module, i: object, o: object) -> object:
        start = time.perf_counter()
        result = hook(m, i, o)
        seconds[-1] += time.perf_counter() - start
        return result

    callback.hook = timed


def measure(workload: Workload, rounds: int, steps: int, batch_size: int, progress: tqdm) -> dict:
    """Per-step seconds of every variant; variants take turns of `steps` steps in every round."""
    torch.manual_seed(0)
    model = workload.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batch = workload.make_batch(batch_size)

    def step(callback: HookCallback | None) -> float:
        start = time.perf_counter()
        train_step(model, workload.loss, optimizer, batch, callback)
        progress.update()
        return time.perf_counter() - start

    step_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    hook_s: dict[str, list[float]] = {v: [] for v in VARIANTS}
    paired: dict[str, list[float]] = {v: [] for v in VARIANTS}
    hooked_modules = 0
    for r in range(-1, rounds):  # round -1 is warm-up, not recorded
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        round_mean: dict[str, float] = {}
        for variant in order:
            callback = make_callback(variant, model, expected_batches=steps)
            in_hooks: list[float] = []
            if callback is not None:
                _time_hooks(callback, in_hooks)
                callback.on_train_begin()
                hooked_modules = len(callback.modules)
            times = []
            for _ in range(steps):
                in_hooks.append(0.0)
                times.append(step(callback))
            if callback is not None:
                callback.on_train_end()
            if r >= 0:
                step_s[variant] += times
                hook_s[variant] += in_hooks or [0.0] * steps
                round_mean[variant] = sum(times) / len(times)
        if r >= 0:
            for variant, mean in round_mean.items():
                paired[variant].append(mean / round_mean["no hooks"] - 1.0)

    base = Timing(step_s["no hooks"]).median
    figures = {}
    for variant in VARIANTS:
        t = Timing(step_s[variant])
        hooks = Timing(hook_s[variant])
        figures[variant] = {
            **t.as_dict(),
            "overhead_pct": 100.0 * Timing(paired[variant]).median,
            "hook_median_s": hooks.median,
            "hook_pct": 100.0 * hooks.median / base,
            "samples_s": step_s[variant],
            "hook_samples_s": hook_s[variant],
        }
    return {
        "model": workload.name,
        "batch_size": batch_size,
        "steps_per_turn": steps,
        "hooked_modules": hooked_modules,
        "variants": figures,
    }


def report(results: dict) -> str:
    rows = []
    for m in results["models"]:
        for v in VARIANTS:
            f = m["variants"][v]
            none = v == "no hooks"
            rows.append(
                [
                    f"{m['model']}, batch {m['batch_size']}, {m['steps_per_turn']} step(s) per turn"
                    if none
                    else "",
                    v,
                    f"{f['median_s'] * 1e3:.1f}",
                    f"{f['min_s'] * 1e3:.1f} / {f['max_s'] * 1e3:.1f}",
                    "-" if none else f"{f['overhead_pct']:+.1f}%",
                    "-" if none else f"{f['hook_median_s'] * 1e3:.2f} ({f['hook_pct']:.1f}%)",
                ]
            )
    return (
        f"Machine: {results['machine']}. {results['rounds']} rounds; in each, every variant "
        "runs its turn of timed steps (rotating order), after a warm-up round. "
        "Overhead: median over rounds of the step time against the no-hooks steps of the same "
        "round. Hook time: time spent inside the hooks per step (in parentheses, as a share of "
        "the no-hooks step), the less noisy figure on a shared machine.\n\n"
        + markdown_table(
            ["model", "variant", "step ms (median)", "min / max ms", "overhead", "hook ms / step"],
            rows,
        )
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
        values = [m["variants"][variant]["hook_pct"] for m in results["models"]]
        xs = [i + (k - (len(hooked) - 1) / 2) * width for i in range(len(values))]
        bars = ax.bar(xs, values, width, label=variant)
        ax.bar_label(bars, fmt="%.1f%%", fontsize="x-small")
    ax.set_xticks(range(len(results["models"])))
    ax.set_xticklabels([m["model"].split(",")[0] for m in results["models"]])
    ax.set_ylabel("time inside the hooks (% of a step)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_title(f"Cost of activation statistics per step\n{results['machine']}", fontsize="small")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/training_overhead"))
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument(
        "--quick", action="store_true", help="2 rounds x 1 step at a quarter batch size"
    )
    args = parser.parse_args()
    rounds, scale = (2, 4) if args.quick else (args.rounds, 1)

    def steps(w: Workload) -> int:
        return 1 if args.quick else w.steps

    total = sum((rounds + 1) * len(VARIANTS) * steps(w) for w in WORKLOADS)
    with tqdm(total=total, unit="step", desc="training steps") as progress:
        models = [
            measure(w, rounds, steps(w), max(1, w.batch_size // scale), progress) for w in WORKLOADS
        ]
    results = {
        "machine": machine_line(),
        "quick": args.quick,
        "rounds": rounds,
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
