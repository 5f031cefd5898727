"""Throughput of the fused statistics operator against torch.sum and against fastai's hooks.

Three measurements, each side by side in one run:
  1. fused (mean and std; every extra; every extra and a 40-bin histogram) vs torch.sum (the
     one-read-pass bound) on float32 tensors from 1 MB to 200 MB;
  2. fused vs the python backend vs fastai v1's and v2's hooks (reproduced) on conv-sized
     activations;
  3. the whole cost of one hooked call (hook dispatch + op) on a 64x512 output.
Writes results.md, results.json and throughput.png to --out.
    python benchmarks/op_throughput.py --out results/op_throughput [--device cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from fastai_reference import fastai_v1_hook, fastai_v2_hook_with_hist
from timing import geometric_mean, interleaved, machine_line, markdown_table, synchronised
from torch import nn
from tqdm import tqdm

from fasthooks import ActivationStats
from fasthooks.buffers import StatBuffers
from fasthooks.layout import EXTRAS
from fasthooks.moments import accumulate_stats_python
from fasthooks.ops import accumulate_stats

SIZES_MB = [1, 2, 4, 8, 16, 32, 64, 128, 200]
# Conv-sized activations: (shape, after a ReLU). A ReLU output puts every value in the range.
ACTIVATIONS = [((64, 64, 28, 28), False), ((64, 64, 56, 56), False), ((64, 64, 28, 28), True)]
# The three fused variants: (every extra, histogram bins).
MODES = {"mean+std": (False, 0), "every extra": (True, 0), "every extra + hist": (True, 40)}


def _calls_for(nbytes: int) -> int:
    return max(1, int(64e6 // nbytes))


def _recorder(accumulate, mode: str, device: str):
    """A call that merges x into one slot of fresh buffers for `mode`, with fastai's options."""
    full, bins = MODES[mode]
    buffers = StatBuffers(1, 1, device, full=full, hist_bins=bins)
    args = buffers.op_args()
    return lambda x: accumulate(x, *args, 0, 0.05, 0.0, 10.0)


def sum_vs_fused(device: str, dtype: torch.dtype, sizes_mb: list[int], rounds: int) -> list[dict]:
    fused = {mode: _recorder(accumulate_stats, mode, device) for mode in MODES}
    rows = []
    for mb in tqdm(sizes_mb, desc="torch.sum vs fused", unit="size"):
        x = torch.randn(mb * 2**20 // dtype.itemsize, device=device).to(dtype)
        variants = {"torch.sum": synchronised(lambda x=x: x.sum(), device)}
        for mode, record in fused.items():
            variants[mode] = synchronised(lambda x=x, record=record: record(x), device)
        timings = interleaved(variants, rounds=rounds, calls=_calls_for(x.nbytes))
        sum_s = timings["torch.sum"].median
        rows.append(
            {
                "size_mb": mb,
                "sum_gbps": x.nbytes / sum_s / 1e9,
                **{f"{mode}_gbps": x.nbytes / timings[mode].median / 1e9 for mode in MODES},
                # time of each fused variant over the time of torch.sum: 1.0 is the bound
                **{f"{mode}_over_sum": timings[mode].median / sum_s for mode in MODES},
            }
        )
        del x
    return rows


FASTAI_VARIANTS = {
    "fastai v1 hook": lambda x: fastai_v1_hook(None, None, x),
    "fastai v2 hook + hist": lambda x: fastai_v2_hook_with_hist(None, None, x),
}


def against_fastai(device: str, rounds: int) -> list[dict]:
    python = _recorder(accumulate_stats_python, "mean+std", device)
    fused = {mode: _recorder(accumulate_stats, mode, device) for mode in MODES}
    rows = []
    for shape, relu in tqdm(ACTIVATIONS, desc="fastai vs python vs fused", unit="shape"):
        x = torch.randn(shape, device=device)
        if relu:
            x = x.relu()
        variants = {name: (lambda x=x, f=f: f(x)) for name, f in FASTAI_VARIANTS.items()}
        variants["python mean+std"] = synchronised(lambda x=x: python(x), device)
        for mode, record in fused.items():
            variants[f"fused {mode}"] = synchronised(lambda x=x, r=record: r(x), device)
        variants["torch.sum"] = synchronised(lambda x=x: x.sum(), device)
        timings = interleaved(variants, rounds=rounds, calls=_calls_for(x.nbytes))
        ms = {name: t.median * 1e3 for name, t in timings.items()}
        rows.append(
            {
                "shape": "x".join(map(str, shape)) + (" ReLU" if relu else ""),
                **{f"{name}_ms": value for name, value in ms.items()},
                "v1_over_fused": ms["fastai v1 hook"] / ms["fused mean+std"],
                "v2_hist_over_fused_hist": ms["fastai v2 hook + hist"]
                / ms["fused every extra + hist"],
                "fused_hist_over_sum": ms["fused every extra + hist"] / ms["torch.sum"],
            }
        )
    return rows


def hooked_call_cost(device: str, rounds: int) -> dict:
    """Forward time of an identity module with and without the ActivationStats hook."""
    plain, hooked, skipping = nn.Identity(), nn.Identity(), nn.Identity()
    x = torch.randn(64, 512, device=device)
    stats = ActivationStats(hooked, modules=[hooked], backend="fused", expected_batches=2)
    stats.on_train_begin()
    # every=2 after one closed batch: the batch running now is one left out.
    sampled = ActivationStats(skipping, modules=[skipping], backend="fused", every=2)
    sampled.on_train_begin()
    sampled.on_batch_end()
    record = _recorder(accumulate_stats, "mean+std", device)
    timings = interleaved(
        {
            "plain": synchronised(lambda: plain(x), device),
            "hooked": synchronised(lambda: hooked(x), device),
            "left out": synchronised(lambda: skipping(x), device),
            "op alone": synchronised(lambda: record(x), device),
        },
        rounds=5 * rounds,  # short rounds, many of them: the best one is the quiet one
        calls=500,
    )
    stats.on_batch_end()  # close the batch the timed calls recorded into
    stats.on_train_end()
    sampled.on_train_end()
    # Best of the rounds: at microseconds, noise from other work on the machine only adds time.
    return {
        "left_out_cost_us": (timings["left out"].min - timings["plain"].min) * 1e6,
        "plain_us": timings["plain"].min * 1e6,
        "hooked_us": timings["hooked"].min * 1e6,
        "op_alone_us": timings["op alone"].min * 1e6,
        "hook_cost_us": (timings["hooked"].min - timings["plain"].min) * 1e6,
        "hook_cost_median_us": (timings["hooked"].median - timings["plain"].median) * 1e6,
    }


def read_cost(modules: int = 50, batches: int = 20_000) -> dict:
    """Microseconds to read act.stats and act.extra after `batches` batches of `modules` modules."""
    model = nn.Sequential(*(nn.Identity() for _ in range(modules)))
    act = ActivationStats(model, modules=list(model), extra=EXTRAS, expected_batches=batches + 1)
    act.on_train_begin()
    for _ in range(batches):
        act.on_batch_end(train=True)
    timings = interleaved(
        {"stats": lambda: act.stats, "extra": lambda: act.extra}, rounds=5, calls=100
    )
    act.on_train_end()
    return {
        "modules": modules,
        "batches": batches,
        "stats_us": timings["stats"].min * 1e6,
        "extra_us": timings["extra"].min * 1e6,
    }


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [r["size_mb"] for r in rows]
    ax.plot(sizes, [r["sum_gbps"] for r in rows], "o-", label="torch.sum (one read pass)")
    for mode, marker in zip(MODES, "s^D", strict=True):
        ax.plot(sizes, [r[f"{mode}_gbps"] for r in rows], f"{marker}-", label=f"fused {mode}")
    ax.set_xscale("log")
    ax.set_xlabel("tensor size (MB)")
    ax.set_ylabel("throughput (GB/s)")
    ax.set_title(title, fontsize="small")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(results: dict) -> str:
    sums = results["sum_vs_fused"]
    geo = results["geomean_over_sum"]
    parts = [
        f"Machine: {results['machine']}",
        "",
        f"Time of each fused variant over the time of `torch.sum` on the same tensor "
        f"({results['dtype']} on {results['device']}; 1.00 is the one-read-pass bound, lower "
        f"is faster). Geometric means: mean+std {geo['mean+std']:.2f}, every extra "
        f"{geo['every extra']:.2f}, every extra + 40-bin hist {geo['every extra + hist']:.2f}.",
        "",
        markdown_table(
            ["size (MB)", "torch.sum GB/s", *(f"{mode} / sum" for mode in MODES)],
            [
                [str(r["size_mb"]), f"{r['sum_gbps']:.1f}"]
                + [f"{r[f'{mode}_over_sum']:.2f}" for mode in MODES]
                for r in sums
            ],
        ),
    ]
    if results.get("against_fastai"):
        names = [
            "fastai v1 hook",
            "fastai v2 hook + hist",
            "python mean+std",
            *(f"fused {mode}" for mode in MODES),
            "torch.sum",
        ]
        parts += [
            "",
            "Milliseconds per call on conv-sized activations. fastai's hooks reproduced: v1 "
            "`o.mean().item(), o.std().item()`; v2 with histogram `mean().item()`, "
            "`std().item()`, `(o<=0.05).sum().item()/o.numel()`, `o.float().histc(40, 0, 10)`. "
            "Fused every extra + hist computes all of those and more in one pass.",
            "",
            markdown_table(
                [
                    "activation",
                    *names,
                    "v1 / fused mean+std",
                    "v2+hist / fused+hist",
                    "fused+hist / sum",
                ],
                [
                    [r["shape"]]
                    + [f"{r[f'{name}_ms']:.2f}" for name in names]
                    + [
                        f"{r['v1_over_fused']:.1f}x",
                        f"{r['v2_hist_over_fused_hist']:.1f}x",
                        f"{r['fused_hist_over_sum']:.1f}",
                    ]
                    for r in results["against_fastai"]
                ],
            ),
        ]
    if results.get("read"):
        r = results["read"]
        parts += [
            "",
            f"Reading after {r['batches']:,} batches of {r['modules']} modules: `act.stats` "
            f"{r['stats_us']:.1f} us, `act.extra` (every extra) {r['extra_us']:.1f} us, best of "
            "the rounds (views of the buffers; the non-finite counts are converted to int64 "
            "once per new column).",
        ]
    if results.get("hooked_call"):
        h = results["hooked_call"]
        parts += [
            "",
            f"One hooked call on a 64x512 float32 output: {h['hook_cost_us']:.1f} us over an "
            f"unhooked call, best of the rounds (median {h['hook_cost_median_us']:.1f} us); "
            f"hook dispatch + op, the op alone {h['op_alone_us']:.1f} us. In a batch left out "
            f"by `every=N`: {h['left_out_cost_us']:.1f} us over an unhooked call.",
        ]
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/op_throughput"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=SIZES_MB)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    # First, while the machine is fresh: after minutes of streaming 200 MB tensors on both cores
    # this microsecond figure reads about 50% higher (the heavy sweeps lower the clock).
    hooked_call = hooked_call_cost(args.device, args.rounds) if dtype == torch.float32 else None
    rows = sum_vs_fused(args.device, dtype, args.sizes_mb, args.rounds)
    results = {
        "machine": machine_line() if args.device == "cpu" else torch.cuda.get_device_name(),
        "device": args.device,
        "dtype": args.dtype,
        "sum_vs_fused": rows,
        "geomean_over_sum": {
            mode: geometric_mean(r[f"{mode}_over_sum"] for r in rows) for mode in MODES
        },
    }
    if dtype == torch.float32:
        results["against_fastai"] = against_fastai(args.device, args.rounds)
        results["hooked_call"] = hooked_call
        results["read"] = read_cost()

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    text = report(results)
    (args.out / "results.md").write_text(text)
    plot(rows, args.out / "throughput.png", f"{results['machine']}, {args.dtype}")
    print("\n" + text)
    print(f"written to {args.out}/results.md, results.json and throughput.png")


if __name__ == "__main__":
    main()
