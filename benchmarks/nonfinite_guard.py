"""A diverging run, side by side: what each way of watching for NaN and infinity costs a training
step, and what each names first.

The run: an MLP (64-512x3-1, GELU) regressing scikit-learn's digits' values with SGD at a learning
rate far too high; it diverges within a few steps. Each variant trains it from the same weights on
the same batches. Timed (interleaved in rounds, `timing.py`): the steps before the divergence,
where nothing is non-finite yet. Then each is run into the divergence, and what it reports first
is shown: fasthooks' guard (`on_nonfinite="raise"`) on the forward run and on forward and backward
runs; Hugging Face's `DebugUnderflowOverflow` (when transformers is installed); torch's
`detect_anomaly`; and a finite-loss check per step, as torchtitan and Megatron do.

    python benchmarks/nonfinite_guard.py [--rounds 7] [--device cpu] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
from collections.abc import Callable
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from timing import interleaved, machine_line, markdown_table, report
from torch import nn

import fasthooks
from fasthooks import ActivationStats, NonFiniteError

LR, BATCH, HIDDEN = 0.2, 256, 512
EXTRA = ["nonfinite"]


class Run:
    """The diverging training run, restartable from the same weights and batches."""

    def __init__(self, device: str) -> None:
        data = load_digits()
        self.x = (torch.tensor(data.data, dtype=torch.float32) / 16.0).to(device)
        self.y = torch.tensor(data.target, dtype=torch.float32).to(device)
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(64, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
            nn.Linear(HIDDEN, 1),
        ).to(device)  # fmt: skip
        self.initial = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)
        generator = torch.Generator().manual_seed(0)
        self.rows = [
            torch.randint(0, len(self.x), (BATCH,), generator=generator) for _ in range(40)
        ]

    def restart(self) -> None:
        self.model.load_state_dict(self.initial)

    def step(self, i: int) -> torch.Tensor:
        rows = self.rows[i].to(self.x.device)
        loss = nn.functional.mse_loss(self.model(self.x[rows]).squeeze(1), self.y[rows])
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def diverges_at(self) -> int:
        """The first step whose loss is not finite."""
        self.restart()
        return next(i for i in range(len(self.rows)) if not bool(self.step(i).isfinite()))


class Watch:
    """One way of watching: `start()` once, then `around(i, step)` runs step i under it; `first()`
    runs the diverging steps until it names something, and returns what."""

    def __init__(self, run: Run, kind: str) -> None:
        self.run, self.kind = run, kind
        self.runs: list[ActivationStats] = []

    def start(self, policy: str | None) -> None:
        model = self.run.model
        if self.kind.startswith("ActivationStats"):
            self.runs = [ActivationStats(model, extra=EXTRA, on_nonfinite=policy)]
            if "backward" in self.kind:
                self.runs.append(
                    ActivationStats(model, extra=EXTRA, is_forward=False, on_nonfinite=policy)
                )
            for act in self.runs:
                act.on_train_begin()
        if self.kind == "DebugUnderflowOverflow":
            from transformers.debug_utils import DebugUnderflowOverflow

            self.debug = DebugUnderflowOverflow(model)

    def around(self, i: int) -> None:
        anomaly = torch.autograd.detect_anomaly() if self.kind == "detect_anomaly" else None
        with anomaly or contextlib.nullcontext():
            loss = self.run.step(i)
        for act in self.runs:  # forward first: a guard that raises leaves the rest unclosed
            act.on_batch_end()
        if self.kind == "finite loss check" and not loss.isfinite().item():
            raise FloatingPointError(f"loss is {loss.item()}")

    def first(self) -> str:
        self.run.restart()
        self.start("raise")
        printed = io.StringIO()  # DebugUnderflowOverflow prints its frames
        try:
            with contextlib.redirect_stdout(printed):
                for i in range(len(self.run.rows)):
                    self.around(i)
        except NonFiniteError:
            where = fasthooks.first_nonfinite(*self.runs)
            return f"batch {where.batch}: module {where.module!r}, {where.direction}"
        except FloatingPointError as error:
            return f"batch {i}: {error}"
        except RuntimeError as error:  # detect_anomaly: the autograd node
            node = re.search(r"Function '(\w+)' returned nan", str(error))
            return f"batch {i}: autograd node {node[1] if node else str(error)[:60]}"
        except ValueError:  # DebugUnderflowOverflow: the module of the last frame it printed
            text = printed.getvalue()
            batch = re.search(r"Detected inf/nan during batch_number=(\d+)", text)
            frames = re.findall(r"^ +(\S+) ([A-Za-z]\w*)$", text, re.M)
            name, cls = frames[-1]
            return f"batch {batch[1]}: module {name!r} ({cls})"
        finally:
            self.stop()
        return "nothing"

    def stop(self) -> None:
        for act in self.runs:
            act.on_train_end()
        self.runs = []
        if self.kind == "DebugUnderflowOverflow":  # it keeps no handles to its hooks
            for module in self.run.model.modules():
                for key, hook in list(module._forward_hooks.items()):
                    if hook == self.debug.forward_hook:
                        del module._forward_hooks[key]


def _kinds() -> list[str]:
    kinds = [
        "no watching",
        "finite loss check",
        "ActivationStats",
        "ActivationStats, guard",
        "ActivationStats forward and backward, guard",
    ]
    if importlib.util.find_spec("transformers") is not None:
        kinds.append("DebugUnderflowOverflow")
    return [*kinds, "detect_anomaly"]


def _timed(watch: Watch, steps: int) -> Callable[[], None]:
    def train() -> None:
        watch.run.restart()
        for i in range(steps):
            watch.around(i)

    return train


def batch_end_cost(model: nn.Module, rounds: int) -> dict[str, float]:
    """Microseconds per `on_batch_end` with and without the guard: all that the guard adds to a
    step (on CUDA, a copy of one int64 per module behind an event; on the CPU, a look at it)."""
    acts = {
        policy: ActivationStats(model, extra=EXTRA, on_nonfinite=policy, expected_batches=1 << 16)
        for policy in (None, "raise")
    }
    for act in acts.values():
        act.on_train_begin()
    timings = interleaved(
        {str(policy): act.on_batch_end for policy, act in acts.items()}, rounds, calls=2000
    )
    for act in acts.values():
        act.on_train_end()
    return {name: t.median * 1e6 for name, t in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    run = Run(args.device)
    diverges = run.diverges_at()
    steps = diverges - 2  # every weight and gradient still finite
    watches = {kind: Watch(run, kind) for kind in _kinds()}
    named = {kind: watch.first() for kind, watch in watches.items()}
    for kind, watch in watches.items():
        watch.start("raise" if "guard" in kind else None)
    variants = {kind: _timed(watch, steps) for kind, watch in watches.items()}
    timings = interleaved(variants, rounds=args.rounds, calls=1)
    for watch in watches.values():
        watch.stop()
    base = timings["no watching"].median / steps
    rows = [
        [kind, f"{t.median / steps * 1e3:.2f}", f"{t.median / steps / base:.3f}", named[kind]]
        for kind, t in timings.items()
    ]
    header = ["variant", "ms per step", "over no watching", "names first"]
    cost = batch_end_cost(run.model, args.rounds)
    text = (
        f"{machine_line()}, device {args.device}\n\nThe loss is first non-finite at step "
        f"{diverges}; timed: steps 0-{steps - 1}, {args.rounds} rounds.\n\n"
        f"{markdown_table(header, rows)}\n\n"
        f"`on_batch_end`, the one call the guard changes: {cost['None']:.1f} us without it, "
        f"{cost['raise']:.1f} us with it.\n"
    )
    report(text, args.out)


if __name__ == "__main__":
    main()
