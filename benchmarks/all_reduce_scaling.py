"""What `all_reduce` costs for 2, 4 and 8 gloo processes on this machine: a run of 100 modules
over 1,000 batches with every extra and a 40-bin histogram, merged; seconds (median of 3) and the
bytes each rank puts into collectives, none of which grows with the number of ranks (an
all-gather of the merge state did); and the merge of the newest column alone (`batches=`), as a
logger does at each log step.

    python benchmarks/all_reduce_scaling.py --out results/all_reduce_scaling
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fasthooks import ActivationStats
from fasthooks.layout import EXTRAS

MODULES, BATCHES, BINS, ROUNDS = 100, 1000, 40, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recorded() -> ActivationStats:
    """A run with every column filled, without training for it: the merge state written
    directly (its size is what all_reduce moves)."""
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(MODULES)))
    act = ActivationStats(
        model, backend="python", extra=EXTRAS, hist_bins=BINS, expected_batches=BATCHES + 1
    )
    act.on_train_begin()
    buffers = act._buffers
    torch.manual_seed(dist.get_rank())
    buffers.state[0].fill_(64.0)
    buffers.state[1:].copy_(torch.rand_like(buffers.state[1:]))
    buffers.hist.copy_(torch.randint(0, 10, buffers.hist.shape))
    for _ in range(BATCHES):
        act.on_batch_end()
    return act


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seconds, newest = [], []
    for _ in range(ROUNDS):
        act = _recorded()
        dist.barrier()
        start = time.perf_counter()
        act.all_reduce(batches=act.batches[-1:])
        newest.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        act.all_reduce()
        seconds.append(time.perf_counter() - start)
    b = act._buffers
    state_bytes = b.state[:, :, :BATCHES].numel() * 8
    if rank == 0:
        result = {
            "seconds": statistics.median(seconds),
            "newest_column_ms": 1e3 * statistics.median(newest),
            # reduce_state's reductions: 6 planes of counts and sums, 3 of power sums, 2 extremes.
            "state_reduced_bytes": 11 * MODULES * BATCHES * 8,
            "state_all_gathered_before_bytes": world * state_bytes,
            "histogram_bytes": b.hist[:, :BATCHES].numel() * 8,
            # The earliest call (one minimum) and the non-finite counts (one sum).
            "order_reduced_bytes": b.order[:, :, :BATCHES].numel() * 8,
        }
        Path(out, f"world{world}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", type=Path, default=Path("results/all_reduce_scaling"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp()
    torch.set_num_threads(1)
    lines = [
        f"all_reduce of {MODULES} modules x {BATCHES} batches, every extra and a {BINS}-bin "
        f"histogram, gloo on this machine's CPU ({os.cpu_count()} cores); median of {ROUNDS}",
        "",
        "| ranks | seconds | merge state reduced, MB | (all-gathered before, MB) | histogram "
        "summed, MB | call order reduced, MB | newest column alone, ms |",
        "|---|---|---|---|---|---|---|",
    ]
    results = {}
    for world in args.worlds:
        mp.spawn(_worker, args=(world, _free_port(), scratch), nprocs=world, join=True)
        r = json.loads(Path(scratch, f"world{world}.json").read_text())
        results[world] = r
        megabytes = [
            r[key] / 1e6
            for key in (
                "state_reduced_bytes",
                "state_all_gathered_before_bytes",
                "histogram_bytes",
                "order_reduced_bytes",
            )
        ]
        lines.append(
            f"| {world} | {r['seconds']:.3f} | "
            + " | ".join(f"{m:.1f}" for m in megabytes)
            + f" | {r['newest_column_ms']:.1f} |"
        )
    text = "\n".join(lines)
    print(text)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
