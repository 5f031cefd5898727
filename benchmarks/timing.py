"""Side-by-side timing: variants interleaved in rounds so that machine drift hits them alike."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Timing:
    """Seconds per call of one variant over every timed call."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def as_dict(self) -> dict[str, float]:
        return {
            "median_s": self.median,
            "min_s": self.min,
            "max_s": self.max,
            "n": len(self.samples),
        }


def time_call(fn: Callable[[], object], calls: int) -> float:
    """Mean seconds per call of `calls` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def synchronised(fn: Callable[[], object], device: str) -> Callable[[], object]:
    """`fn`, waiting for the GPU after each call on a CUDA device (so that a call's time is its
    work's, not its launch's)."""
    if device == "cpu":
        return fn
    import torch

    def call() -> None:
        fn()
        torch.cuda.synchronize()

    return call


def interleaved(
    variants: dict[str, Callable[[], object]],
    rounds: int,
    calls: int,
    warmup: int = 1,
    on_round: Callable[[], None] | None = None,
) -> dict[str, Timing]:
    """Time every variant once per round, rotating their order; warm-up calls are not timed."""
    names = list(variants)
    for name in names:
        for _ in range(warmup):
            variants[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            samples[name].append(time_call(variants[name], calls))
        if on_round is not None:
            on_round()
    return {name: Timing(s) for name, s in samples.items()}


def geometric_mean(values: Iterable[float]) -> float:
    values = list(values)
    product = 1.0
    for v in values:
        product *= v
    return product ** (1.0 / len(values))


def report(text: str, out: Path | None) -> None:
    """Print a run's results and, when `out` is given, write them to `out/results.md`."""
    print(text, end="")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(text)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line() -> str:
    """The machine a run was on, for the header of a results table."""
    import torch  # only here: the timing helpers themselves need no torch

    from fasthooks.ops import cpu_capability, extension_available

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), "
        f"fasthooks CPU kernels {cpu_capability() if extension_available() else 'absent'}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
