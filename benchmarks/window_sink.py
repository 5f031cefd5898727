"""A long run with window= and a Parquet sink beside one that keeps every batch: buffer memory,
host memory, time per batch, the training thread's cost per closed column, and the sink's size.

    python benchmarks/window_sink.py --batches 100000 --out results/window_sink
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from fasthooks import ActivationStats, load

EVERY_EXTRA = ["min", "max", "near_zero", "nonfinite", "kurtosis", "norm", "absmax"]
MODULES = 50


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(MODULES)))


def _buffer_bytes(act: ActivationStats) -> int:
    b = act._buffers
    tensors = (b.state, b.stats, b.extra, b.hist, b.order)
    return sum(t.numel() * t.element_size() for t in tensors)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run(batches: int, window: int | None, sink: str | None) -> dict[str, float]:
    model, g = _model(), torch.Generator().manual_seed(1)
    act = ActivationStats(
        model, extra=EVERY_EXTRA, hist_bins=40, hist_range=(-1.0, 1.0), window=window, sink=sink
    )
    closing, memory, resident = 0.0, [], []
    start = time.perf_counter()
    with act, torch.no_grad():
        for step in range(batches):
            model(torch.randn(8, 32, generator=g))  # new values each batch, as in training
            t = time.perf_counter()
            act.on_batch_end()
            closing += time.perf_counter() - t
            if step in (0, batches // 2, batches - 1):
                memory.append(_buffer_bytes(act))
                resident.append(_resident_bytes())
    total = time.perf_counter() - start
    return {
        "batches": act.num_batches,
        "buffer_bytes": memory,
        "resident_mb": [r / 2**20 for r in resident],
        "us_per_batch": 1e6 * total / batches,
        "us_per_close": 1e6 * closing / batches,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("results/window_sink"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="fasthooks-sink-")
    results = {
        "window=None": _run(args.batches, None, None),
        f"window={args.window}, Parquet sink": _run(args.batches, args.window, folder),
    }
    files = list(Path(folder).glob("*.parquet"))
    size = sum(f.stat().st_size for f in files)
    loaded = load(folder)
    assert loaded.num_batches == args.batches
    lines = [
        f"{args.batches:,} batches of a {MODULES}-module model (Linear 32x32 + Tanh, batch 8, "
        "CPU), every extra and a 40-bin histogram; fasthooks backend "
        f"{ActivationStats(_model()).backend}",
        "",
        "| variant | buffer bytes at batch 1 / middle / last | resident MB at batch 1 / middle "
        "/ last | us per batch | us per on_batch_end |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        memory = " / ".join(f"{m:,}" for m in r["buffer_bytes"])
        resident = " / ".join(f"{m:.0f}" for m in r["resident_mb"])
        lines.append(
            f"| {name} | {memory} | {resident} | {r['us_per_batch']:.1f} | "
            f"{r['us_per_close']:.1f} |"
        )
    per = size / (args.batches * MODULES)
    lines += [
        "",
        f"Sink: {len(files)} Parquet files, {size / 2**20:.1f} MiB, {per:.1f} bytes per "
        "module-batch; `fasthooks.load` read back every batch.",
    ]
    text = "\n".join(lines)
    print(text)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps({**results, "sink_bytes": size}, indent=1))


if __name__ == "__main__":
    main()
