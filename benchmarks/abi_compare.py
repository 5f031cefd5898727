"""The stable-ABI build of the operator against a build of the same kernels on torch's C++ API.

Two builds cannot register the same operator in one process, so each runs in a worker process
of its own (`workers.py`), asked for one timing round at a time. Each worker also times an
operator with the same schema that does nothing, built on its own API (`benchmarks/abi_floor/`):
the calling convention's share. Both builds compute the statistics of the same seeded tensors;
the report says whether they agree bit for bit (they did at the port; the kernels have changed
since). Writes results.md and results.json to --out.
    python benchmarks/abi_compare.py --baseline DIR --floor DIR --out results/abi_compare
where --baseline holds a fasthooks package built with the C++ API and --floor the two no-op
modules (`make bench-abi` prepares both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

import workers
from timing import machine_line, markdown_table, time_call

NOOP = "no-op, same schema"
# (name, shape, every extra, histogram bins): a hook's small call and conv-sized activations.
CASES = [
    ("64x512, mean+std", (64, 512), False, 0),
    ("64x512, every extra + hist", (64, 512), True, 40),
    ("64x64x28x28, mean+std", (64, 64, 28, 28), False, 0),
    ("64x64x28x28, every extra + hist", (64, 64, 28, 28), True, 40),
    ("64x64x56x56, mean+std", (64, 64, 56, 56), False, 0),
]


def _calls(shape: tuple[int, ...]) -> int:
    elements = 1
    for s in shape:
        elements *= s
    return max(5, int(2e7 // elements))


def worker(noop_module: str) -> None:
    """Answers each line on stdin ("round" or "values") with one JSON line on stdout."""
    import importlib

    import torch

    import fasthooks
    from fasthooks.buffers import StatBuffers

    assert fasthooks.extension_available(), fasthooks.extension_error()
    importlib.import_module(noop_module)
    # The operators themselves, as the hooks call them.
    operator = torch.ops.fasthooks.accumulate_stats.default
    noop = getattr(torch.ops, noop_module).noop.default
    generator = torch.Generator().manual_seed(0)
    calls = {}
    for name, shape, full, bins in CASES:
        x = torch.randn(shape, generator=generator).relu_()
        buffers = StatBuffers(1, 1, "cpu", full=full, hist_bins=bins)
        args = buffers.op_args()
        calls[name] = (lambda x=x, args=args: operator(x, *args, 0, 0.05, 0.0, 10.0), args)
        calls[name][0]()  # warm-up
    small, small_args = CASES[0][1], calls[CASES[0][0]][1]
    x = torch.randn(small)
    noop_call = lambda: noop(x, *small_args, 0, 0.05, 0.0, 10.0)  # noqa: E731

    def timing_round() -> dict:
        out = {NOOP: time_call(noop_call, _calls(small))}
        out.update({name: time_call(calls[name][0], _calls(shape)) for name, shape, _, _ in CASES})
        return out

    def values() -> dict:
        return {name: [t.flatten().tolist() for t in args[:4]] for name, (_, args) in calls.items()}

    workers.serve({"round": timing_round, "values": values})


def _start(package_root: str, floor: str, noop_module: str) -> subprocess.Popen:
    path = os.pathsep.join([package_root, floor, str(Path(__file__).parent)])
    return workers.start(__file__, ["--worker", noop_module], {"PYTHONPATH": path})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a fasthooks package root built on torch's C++ API")
    parser.add_argument("--out", type=Path, default=Path("results/abi_compare"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--floor", help="the folder holding noop_stable and noop_cpp_api")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    builds = {
        "stable ABI": _start(str(Path(__file__).resolve().parents[1]), args.floor, "noop_stable"),
        "C++ API": _start(args.baseline, args.floor, "noop_cpp_api"),
    }
    names = [NOOP] + [c[0] for c in CASES]
    samples = workers.timing_rounds(builds, args.rounds)
    values = {build: workers.ask(process, "values") for build, process in builds.items()}
    workers.stop(builds)
    same = values["stable ABI"] == values["C++ API"]
    rows, results = [], {"machine": machine_line(), "same_numbers": same, "cases": {}}
    for case in names:
        stable, classic = samples["stable ABI"][case], samples["C++ API"][case]
        results["cases"][case] = {
            "stable_best_s": min(stable),
            "cpp_api_best_s": min(classic),
            "stable_median_s": statistics.median(stable),
            "cpp_api_median_s": statistics.median(classic),
        }
        rows.append(
            [
                case,
                *(f"{min(t) * 1e6:.1f}" for t in (classic, stable)),
                f"{min(stable) / min(classic):.2f}",
                *(f"{statistics.median(t) * 1e6:.1f}" for t in (classic, stable)),
                f"{statistics.median(stable) / statistics.median(classic):.2f}",
            ]
        )
    header = ["call", "C++ API best us", "stable ABI best us", "best ratio"]
    header += ["C++ API median us", "stable ABI median us", "median ratio"]
    table = markdown_table(header, rows)
    report = (
        f"Machine: {machine_line()}. {args.rounds} interleaved rounds per build; best of them (on "
        "a shared machine, noise only adds time) and median. Ratio: stable ABI over C++ API.\n\n"
        f"{table}\n\nSame numbers in every buffer, bit for bit: {'yes' if same else 'NO'}.\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(report)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(report)


if __name__ == "__main__":
    main()
