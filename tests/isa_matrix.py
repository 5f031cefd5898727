"""The CPU kernel tests (marker `isa`) on every kernel build this host can exercise: natively for
the builds its CPU has, under qemu-user as x86-64 CPUs that lack the next build's instructions
(Haswell: AVX2 without AVX-512; Nehalem: no AVX), and on aarch64. Each run checks that the CPU
picks the build it must. Prints which builds ran where and which this host could not exercise.

    python tests/isa_matrix.py [--aarch64 DIR] [pytest arguments]

With --aarch64, also the aarch64 wheel that tests/aarch64_venv.sh installed into DIR/venv, under
qemu-aarch64, with the checks of an installed wheel (its symbols and tags) beside the kernel tests.
With --require-emulation (make test under CI), an emulated CPU or aarch64 that could not run is a
failure, not a note.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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
TEST_FILES = (
    "test_operator.py",
    "test_extras.py",
    "test_isa.py",
    "test_binades.py",
    "test_top_k.py",
    "test_channel_sums.py",
)
# On aarch64 the wheel is the installed one: its checks run there too.
AARCH64_TEST_FILES = (*TEST_FILES, "test_extension.py")


def qemu_major(qemu: str) -> int:
    out = subprocess.run([qemu, "--version"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"version (\d+)\.", out).group(1))


def native_capability(env: dict[str, str]) -> str:
    script = "import fasthooks.ops as ops; print(ops.cpu_capability())"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def x86_qemu() -> str | None:
    """qemu-x86_64 where it is recent enough to trust, else None (saying why)."""
    qemu = shutil.which("qemu-x86_64")
    if os.uname().machine != "x86_64":
        print(f"isa matrix: {os.uname().machine} host: no x86-64 emulation")
        return None
    if qemu is None:
        print("isa matrix: qemu-x86_64 not found (qemu-user): emulated CPUs skipped")
        return None
    if qemu_major(qemu) < MIN_QEMU:
        print(
            f"isa matrix: qemu-user {qemu_major(qemu)} is older than {MIN_QEMU}, whose AVX2 "
            "emulation miscomputes some kernels: emulated CPUs skipped"
        )
        return None
    return qemu


def aarch64_interpreter(build: Path | None) -> list[str] | None:
    """The venv's aarch64 Python that tests/aarch64_venv.sh made in `build`, under qemu-aarch64."""
    qemu = shutil.which("qemu-aarch64")
    venv = build / "venv" if build else None
    if venv is None or qemu is None or not any(venv.glob("lib/python3*/site-packages/fasthooks")):
        why = "qemu-aarch64 not found" if build and qemu is None else "no aarch64 wheel installed"
        print(f"isa matrix: aarch64: not exercised ({why}; tests/aarch64_venv.sh installs one)")
        return None
    return [qemu, "-L", str(build / "root"), str(venv / "bin" / "python")]


def torch_version() -> str:
    """The host torch's release, which the wheels are built against."""
    return importlib.metadata.version("torch").split("+")[0]


def test_paths(run: str) -> list[str]:
    files = AARCH64_TEST_FILES if run.startswith("qemu-aarch64") else TEST_FILES
    return [str(ROOT / "tests" / name) for name in files]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aarch64", type=Path, help="the folder tests/aarch64.sh built into")
    parser.add_argument(
        "--require-emulation",
        action="store_true",
        help="fail unless the emulated x86-64 CPUs and aarch64 all ran",
    )
    options, pytest_arguments = parser.parse_known_args()
    aarch64 = options.aarch64.resolve() if options.aarch64 else None
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("FASTHOOKS_CPU_CAPABILITY", None)
    best = native_capability(env)
    here = [sys.executable]
    # name: (interpreter, build it must pick, environment, working folder). Emulated CPUs for
    # the builds below the host's; natively the host's own, and (capped) those it has that no
    # emulated run covers; aarch64 with the portable kernels, from its own folder so that the
    # work tree's x86-64 package stays off its path.
    runs = {}
    qemu = x86_qemu()
    if qemu:
        for cpu, build in EMULATED.items():
            runs[f"qemu -cpu {cpu} ({build})"] = ([qemu, "-cpu", cpu, *here], build, {}, ROOT)
    for build in BUILDS[: BUILDS.index(best) + 1]:
        if build == best or all(build != run[1] for run in runs.values()):
            runs[f"native ({build})"] = (here, build, {"FASTHOOKS_CPU_CAPABILITY": build}, ROOT)
    arm = aarch64_interpreter(aarch64)
    if arm is not None:
        (site,) = (aarch64 / "venv").glob("lib/python3*/site-packages")
        arm_env = {
            "PYTHONPATH": "",
            "FASTHOOKS_REQUIRE_EXT": "1",
            "FASTHOOKS_WHEEL_DIR": str(site),
            "FASTHOOKS_WHEEL_BUILT_WITH": torch_version(),
        }
        runs["qemu-aarch64 (default)"] = (arm, "default", arm_env, aarch64)
    # Each run on one thread, all at once: emulation is single-threaded anyway.
    started = {}
    for name, (interpreter, build, extra_env, folder) in runs.items():
        command = [*interpreter, "-m", "pytest", "-q", "-m", "isa", "-p", "no:cacheprovider"]
        run_env = {
            **env,
            "FASTHOOKS_EXPECT_CPU_CAPABILITY": build,
            "OMP_NUM_THREADS": "1",
            **extra_env,
        }
        process = subprocess.Popen(
            [*command, *test_paths(name), *pytest_arguments],
            cwd=folder,
            env=run_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started[name] = (process, time.monotonic())
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
        elif not name.startswith("qemu-aarch64"):
            exercised.add(runs[name][1])
    for build in BUILDS:
        if build not in exercised:
            why = " (its CPU lacks it and qemu-user emulates no AVX-512)" if "512" in build else ""
            print(f"isa matrix: x86-64 {build}: not exercised on this host{why}")
    emulations = [("qemu-aarch64", arm)]
    if os.uname().machine == "x86_64":
        emulations.append(("qemu-x86_64", qemu))
    missing = [name for name, ran in emulations if not ran]
    if options.require_emulation and missing:
        print(f"isa matrix: --require-emulation, but {' and '.join(missing)} did not run")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
