"""The fused CPU operator under each kernel build the CPU runs: AVX-512 (+GFNI), AVX2, portable.

The kernels are chosen once per process (FASTHOOKS_CPU_CAPABILITY caps the choice), so each build
runs in a worker process of its own (`workers.py`), asked for one timing round at a time; each
worker times `torch.sum` on the same tensors too. The builds must agree: counts, extremes and
histograms exactly, moments within 1e-6. Writes results.md and results.json to --out.
    python benchmarks/cpu_kernels.py --out results/cpu_kernels
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import workers
from timing import machine_line, markdown_table, time_call

CAPABILITIES = ("avx512_gfni", "avx512", "avx2", "default")
SUM = "torch.sum"
# (name, shape, after a ReLU, histogram range): fastai's range and one that holds N(0,1) whole.
ACTIVATIONS = [
    ("64x64x28x28", (64, 64, 28, 28), False, (0.0, 10.0)),
    ("64x64x28x28 ReLU", (64, 64, 28, 28), True, (0.0, 10.0)),
    ("64x64x28x28 over (-5, 5)", (64, 64, 28, 28), False, (-5.0, 5.0)),
    ("64x64x56x56", (64, 64, 56, 56), False, (0.0, 10.0)),
]
# (name, every extra, histogram bins)
MODES = [("mean+std", False, 0), ("every extra", True, 0), ("every extra + hist", True, 40)]


def _calls(shape: tuple[int, ...]) -> int:
    return max(3, int(2e7 // math.prod(shape)))


def worker() -> None:
    """Answers "capability", "round" and "values" requests (see workers.serve)."""
    import torch

    import fasthooks.ops as ops
    from fasthooks.buffers import StatBuffers

    generator = torch.Generator().manual_seed(0)
    calls, buffers = {}, {}
    for name, shape, relu, (lo, hi) in ACTIVATIONS:
        x = torch.randn(shape, generator=generator)
        if relu:
            x.relu_()
        calls[f"{name}, {SUM}"] = (lambda x=x: x.sum(), shape)
        for mode, full, bins in MODES:
            b = StatBuffers(1, 1, "cpu", full=full, hist_bins=bins)
            args = (*b.op_args(), 0, 0.05, lo, hi)
            record = lambda x=x, args=args: ops.accumulate_stats(x, *args)  # noqa: E731
            calls[f"{name}, {mode}"] = (record, shape)
            buffers[f"{name}, {mode}"] = b
    for call, _ in calls.values():
        call()  # warm-up, and the values compared afterwards

    def values() -> dict:
        return {
            case: [t.flatten().tolist() for t in buf.op_args()[:4]] for case, buf in buffers.items()
        }

    workers.serve(
        {
            "capability": lambda: {"capability": ops.cpu_capability()},
            "round": lambda: {case: time_call(c, _calls(s)) for case, (c, s) in calls.items()},
            "values": values,
        }
    )


def _agree(a: list[list[float]], b: list[list[float]]) -> bool:
    """Buffers of one case from two builds: state planes 0-4 (moments) and the float32 stats and
    extras within 1e-6, the sum of cubed deviations on its own scale, n * std^3 (symmetric data
    cancels it to near zero, where a relative error means nothing); everything else (extremes,
    counts, histogram) exactly."""
    state_a, state_b = a[0], b[0]
    moments = len(state_a) if len(state_a) == 3 else 5
    floor = [1e-9] * moments
    if moments == 5:
        count, squares = state_a[0], state_a[2]
        floor[3] = 1e-6 * squares**1.5 / count**0.5
    close = [
        math.isclose(u, v, rel_tol=1e-6, abs_tol=t)
        for u, v, t in zip(state_a[:moments], state_b[:moments], floor, strict=True)
    ]
    close += [
        math.isclose(u, v, rel_tol=1e-6, abs_tol=1e-9)
        for u, v in zip(a[1] + a[2], b[1] + b[2], strict=True)
    ]
    return all(close) and state_a[moments:] == state_b[moments:] and a[3] == b[3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/cpu_kernels"))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    builds = {}
    for capability in CAPABILITIES:
        process = workers.start(__file__, ["--worker"], {"FASTHOOKS_CPU_CAPABILITY": capability})
        if workers.ask(process, "capability")["capability"] == capability:
            builds[capability] = process
        else:  # the CPU lacks these instructions: the worker runs a lesser build
            workers.stop({capability: process})
    samples = workers.timing_rounds(builds, args.rounds)
    values = {build: workers.ask(process, "values") for build, process in builds.items()}
    workers.stop(builds)
    names = list(builds)
    agree = all(
        _agree(values[names[0]][case], values[other][case])
        for other in names[1:]
        for case in values[names[0]]
    )
    best = {build: {case: min(s) for case, s in cases.items()} for build, cases in samples.items()}
    rows = []
    for name, *_ in ACTIVATIONS:
        for mode, *_ in MODES:
            case = f"{name}, {mode}"
            times = [best[build][case] for build in names]
            sums = [best[build][f"{name}, {SUM}"] for build in names]
            rows.append(
                [
                    name,
                    mode,
                    *(f"{t * 1e3:.2f}" for t in times),
                    *(f"{t / s:.2f}" for t, s in zip(times, sums, strict=True)),
                    *(f"{slower / t:.2f}x" for t, slower in itertools.pairwise(times)),
                ]
            )
    header = ["activation", "statistics", *(f"{b} ms" for b in names)]
    header += [f"{b} / torch.sum" for b in names]
    header += [f"{b} speed-up over {lesser}" for b, lesser in itertools.pairwise(names)]
    report = (
        f"Machine: {machine_line()}. {args.rounds} interleaved rounds per build, one worker "
        "process each; best of the rounds (on a shared machine, noise only adds time). Every "
        "build also times `torch.sum` on the same tensors: time over it, lower is faster, 1.00 "
        "the one-read-pass bound.\n\n"
        f"{markdown_table(header, rows)}\n\n"
        "The builds agree (counts, extremes, histograms exactly; moments within 1e-6, the third "
        f"on the scale n * std^3): "
        f"{'yes' if agree else 'NO'}.\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(report)
    (args.out / "results.json").write_text(
        json.dumps({"machine": machine_line(), "agree": agree, "samples_s": samples}, indent=2)
    )
    print(report)


if __name__ == "__main__":
    main()
