"""A run that diverges: a small MLP regressing scikit-learn's 8x8 digits' values, at a learning
rate far too high.

Forward and backward `ActivationStats` watch every layer; the guard names the first module that
went non-finite as soon as it happens, and the summaries list the layers that looked worst.
    python examples/diverging.py [--lr 0.2] [--steps 30]
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import fasthooks
from fasthooks import ActivationStats


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    x, y = digits()
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    extra = ["near_zero", "nonfinite", "kurtosis"]
    guard = {"on_nonfinite": lambda report: print(f"guard: {report}\n")}
    forward = ActivationStats(model, extra=extra, **guard)
    backward = ActivationStats(model, extra=extra, is_forward=False, **guard)
    generator = torch.Generator().manual_seed(0)
    finite = True
    with forward, backward:
        for step in range(args.steps):
            rows = torch.randint(0, len(x), (128,), generator=generator)
            loss = nn.functional.mse_loss(model(x[rows]).squeeze(1), y[rows].float())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            forward.on_batch_end()
            backward.on_batch_end()
            if step % 5 == 0 or loss.isfinite() != finite:
                print(f"step {step:3d}  loss {loss.item():.4g}")
            finite = loss.isfinite()
    print(f"\nfirst non-finite call: {fasthooks.first_nonfinite(forward, backward)}")
    print(f"\nforward, worst modules:\n{forward.summary(top=5)}")
    print(f"\nbackward, worst modules:\n{backward.summary(top=5)}")


if __name__ == "__main__":
    main()
