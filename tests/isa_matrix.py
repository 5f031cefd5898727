"""The CPU kernel tests (marker `isa`) on every x86-64 kernel build this host can exercise:
natively for the builds its CPU has, and under qemu-user as CPUs that lack the next build's
instructions (Haswell: AVX2 without AVX-512; Nehalem: no AVX). Each run checks that the CPU
picks the build it must. Prints which builds ran where and which this host could not exercise.

    python tests/isa_matrix.py [pytest arguments]
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILDS = ("default", "avx2", "avx512", "avx512_gfni")
# Emulated CPUs, each the most capable one without the next build's instructions. qemu's TCG
# emulates no AVX-512, so those builds run only natively.
EMULATED = {"Haswell": "avx2", "Nehalem": "default"}
# qemu 7.2 miscomputes some AVX2 code (histogram bins of values on the edges); 10.0 does not.
MIN_QEMU = 8


def qemu_major(qemu: str) -> int:
    out = subprocess.run([qemu, "--version"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"version (\d+)\.", out).group(1))


def native_capability(env: dict[str, str]) -> str:
    script = "import fasthooks.ops as ops; print(ops.cpu_capability())"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def pytest_command(prefix: list[str], extra: list[str]) -> list[str]:
    return [
        *prefix,
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "isa",
        "-p",
        "no:cacheprovider",
        "tests/test_operator.py",
        "tests/test_extras.py",
        "tests/test_isa.py",
        *extra,
    ]


def main() -> int:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("FASTHOOKS_CPU_CAPABILITY", None)
    best = native_capability(env)
    qemu = shutil.which("qemu-x86_64")
    if os.uname().machine != "x86_64":
        print(f"isa matrix: {os.uname().machine} host, portable kernels only ({best})")
        qemu = None
    elif qemu is None:
        print("isa matrix: qemu-x86_64 not found (qemu-user): emulated CPUs skipped")
    elif qemu_major(qemu) < MIN_QEMU:
        print(
            f"isa matrix: qemu-user {qemu_major(qemu)} is older than {MIN_QEMU}, whose AVX2 "
            "emulation miscomputes some kernels: emulated CPUs skipped"
        )
        qemu = None
    # (command prefix, build it must pick, ceiling): emulated CPUs for the builds below the
    # host's; natively the host's own, and (capped) those it has that no emulated run covers.
    runs = {}
    if qemu:
        for cpu, build in EMULATED.items():
            runs[f"qemu -cpu {cpu} ({build})"] = ([qemu, "-cpu", cpu], build, "")
    for build in BUILDS[: BUILDS.index(best) + 1]:
        if build == best or all(build != picked for _, picked, _ in runs.values()):
            runs[f"native ({build})"] = ([], build, build)
    # Each run on one thread, all at once: emulation is single-threaded anyway.
    started = {}
    for name, (prefix, build, ceiling) in runs.items():
        run_env = {**env, "FASTHOOKS_EXPECT_CPU_CAPABILITY": build, "OMP_NUM_THREADS": "1"}
        if ceiling:
            run_env["FASTHOOKS_CPU_CAPABILITY"] = ceiling
        started[name] = (
            subprocess.Popen(
                pytest_command(prefix, sys.argv[1:]),
                cwd=ROOT,
                env=run_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            ),
            time.monotonic(),
        )
    failed = []
    exercised = set()
    for name, (process, start) in started.items():
        output, _ = process.communicate()
        seconds = time.monotonic() - start
        summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
        print(f"isa matrix: {name}: {summary} [{seconds:.0f} s]")
        if process.returncode != 0:
            failed.append(name)
            print(output)
        else:
            exercised.add(runs[name][1])
    for build in BUILDS:
        if build not in exercised:
            print(
                f"isa matrix: {build}: not exercised on this host (its CPU lacks it and "
                "qemu-user emulates no AVX-512)"
                if build.startswith("avx512")
                else f"isa matrix: {build}: not exercised on this host"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
