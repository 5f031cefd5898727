"""Train a small CNN on scikit-learn's bundled 8x8 digits with ActivationStats watching every layer.

Prints the per-layer statistics (mean, std, near-zero fraction, largest activation, non-finite
count and a 40-bin histogram, all from one fused pass per layer and batch) as a table and saves a
plot of mean and std over the batches.
    python examples/demo.py --out results/demo
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

from fasthooks import ActivationStats, model_summary, plot_stats


def digits(generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The 1,797 digits as (N, 1, 8, 8) floats scaled to [0, 1], split 80/20 into train/valid."""
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=generator)
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def small_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def stats_table(names: list[str], act: ActivationStats) -> str:
    """Per layer: mean and std at the first and last batch, then the last batch's near-zero
    fraction, largest activation and most populated histogram bin, and the non-finite count."""
    stats, extra, hist = act.stats, act.extra, act.hist
    columns = ["mean first", "mean last", "std first", "std last", "near-0 last", "max last"]
    header = f"{'layer':<20}" + "".join(f"{c:>12}" for c in columns)
    header += f"{'fullest bin':>16}{'nonfinite':>10}"
    rows = [header, "-" * len(header)]
    width = (act.hist_max - act.hist_min) / act.hist_bins
    for i, name in enumerate(names):
        mean, std = stats[0, i], stats[1, i]
        values = [
            mean[0],
            mean[-1],
            std[0],
            std[-1],
            extra["near_zero"][i, -1],
            extra["max"][i, -1],
        ]
        low = act.hist_min + width * int(hist[i, -1].argmax())
        rows.append(
            f"{name:<20}"
            + "".join(f"{v:>12.4f}" for v in values)
            + f"{f'[{low:.2f}, {low + width:.2f})':>16}{extra['nonfinite'][i].sum().item():>10d}"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--backend", default="auto", choices=["auto", "fused", "python"])
    parser.add_argument("--out", type=Path, default=Path("results/demo"))
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x_train, y_train, x_valid, y_valid = digits(generator)
    model = small_cnn()
    print(model_summary(model, size=(1, 8, 8)), "\n")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()
    batches_per_epoch = -(-len(x_train) // args.batch_size)
    act = ActivationStats(
        model,
        backend=args.backend,
        expected_batches=args.epochs * batches_per_epoch,
        extra=("near_zero", "max", "nonfinite"),
        hist_bins=40,
        hist_range=(-5.0, 5.0),
    )

    with act, tqdm(total=args.epochs * batches_per_epoch, unit="batch") as progress:
        for epoch in range(args.epochs):
            model.train()
            order = torch.randperm(len(x_train), generator=generator)
            for idx in order.split(args.batch_size):
                loss = loss_fn(model(x_train[idx]), y_train[idx])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                act.on_batch_end(train=True)
                progress.update()
            model.eval()
            with torch.no_grad():
                accuracy = (model(x_valid).argmax(1) == y_valid).float().mean().item()
            progress.set_postfix(
                epoch=epoch + 1, loss=f"{loss.item():.3f}", valid_acc=f"{accuracy:.3f}"
            )

    names = [f"{n}: {type(m).__name__}" for n, m in zip(act.module_names, act.modules, strict=True)]
    stats = act.stats
    print(
        f"\nActivationStats ({act.backend} backend): {stats.shape[2]} training batches, "
        f"{stats.shape[1]} layers, final validation accuracy {accuracy:.3f}\n"
    )
    print(stats_table(names, act))
    args.out.mkdir(parents=True, exist_ok=True)
    paths = [plot_stats(stats, args.out / "activation_stats.png", names)]
    pictures = {
        "overview.png": lambda path: act.plot(path),
        "layer_stats.png": lambda path: act.plot_layer_stats(act.module_names[-2], path),
        "color_dim.png": lambda path: act.color_dim(act.module_names[1], path),
    }
    for name, draw in pictures.items():
        draw(args.out / name)
        paths.append(args.out / name)
    print("\npictures saved to " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
