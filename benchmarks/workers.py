"""Worker processes that time the same calls, each under an environment of its own.

What cannot share a process (two builds of one operator, two CPU kernel choices read once at
start) runs in workers; the parent asks them for one timing round at a time, rotating which goes
first, so that machine drift hits them alike. A worker answers each request line on stdin with one
JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable


def start(script: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`python script *args` with `env` added to this process's environment."""
    return subprocess.Popen(
        [sys.executable, script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def ask(process: subprocess.Popen, request: str) -> dict:
    process.stdin.write(request + "\n")
    process.stdin.flush()
    return json.loads(process.stdout.readline())


def serve(answers: dict[str, Callable[[], dict]]) -> None:
    """The worker's side: answers each request line with answers[request]()."""
    for line in sys.stdin:
        print(json.dumps(answers[line.strip()]()), flush=True)


def timing_rounds(
    workers: dict[str, subprocess.Popen], rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Seconds per call of every case in every worker, one "round" request per worker and round."""
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in workers}
    names = list(workers)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            # The previous worker's threads spin a while after its round: let them sleep.
            time.sleep(0.2)
            for case, seconds in ask(workers[name], "round").items():
                samples[name].setdefault(case, []).append(seconds)
    return samples


def stop(workers: dict[str, subprocess.Popen]) -> None:
    for process in workers.values():
        process.stdin.close()
        process.wait()
