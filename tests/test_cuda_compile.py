"""The CUDA kernels compiled where they run, with no GPU: every kernel the operator can launch,
compiled by the NVRTC found beside torch (or FASTHOOKS_NVRTC) for each architecture; the disk
cache across processes and under processes compiling at once; and what happens without a driver.

Runs where an NVRTC is found (a CUDA build of torch); FASTHOOKS_REQUIRE_NVRTC=1 makes a missing
one a failure.
"""

import fcntl
import itertools
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import subprocess_env

from fasthooks import cuda_setup, ops

ROOT = Path(__file__).resolve().parents[1]
ARCHS = (80, 90, 100, 120)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# (full, bins, diff, binades, top, channels) as the operator asks for them: a difference kernel
# computes every statistic; up to 40 bins are counted per thread, more per block; binades, top_k
# and channel statistics only of values: channel statistics without bins, with bins per thread and
# per block; top_k with bins per block, alone and beside binades and channel statistics.
FLAGS = (
    *(
        (full, bins, diff, binades, False, False)
        for full, diff in ((False, False), (True, False), (True, True))
        for bins in (0, 16, 256)
        for binades in ((False,) if diff else (False, True))
    ),
    (False, 0, False, False, False, True),
    (True, 16, False, False, False, True),
    (True, 256, False, False, True, False),
    (True, 256, False, True, True, True),
)


def _nvrtc_found() -> bool:
    return ops.extension_available() and ops.cuda_status().nvrtc is not None


pytestmark = pytest.mark.skipif(
    os.environ.get("FASTHOOKS_REQUIRE_NVRTC") != "1" and not _nvrtc_found(),
    reason="no NVRTC beside this torch (FASTHOOKS_REQUIRE_NVRTC=1 to require one)",
)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache for this test, handed to the extension."""
    monkeypatch.setenv("FASTHOOKS_CACHE_DIR", str(tmp_path / "kernels"))
    cuda_setup.configure()
    yield tmp_path / "kernels"
    monkeypatch.delenv("FASTHOOKS_CACHE_DIR")
    cuda_setup.configure()


def _image(path: str) -> tuple[bytes, bytes]:
    """(lowered name, image) of a cache file."""
    name, image = cuda_setup.read_kernel(path)
    return name.encode(), image


def test_nvrtc_is_found():
    setup = ops.cuda_status()
    assert setup.nvrtc and Path(setup.nvrtc).exists()
    assert setup.nvrtc_version and setup.nvrtc_version[0].isdigit()


# Every kernel is compiled for EVERY_KERNEL_ARCH; for the other architectures, each way of
# counting once per dtype (what differs by architecture is the code generated, not the paths):
# mean and std; bins per thread; bins per block with binades; bins per thread with every extra of
# values; the list kernel with bins per block; the list kernel of differences.
# FASTHOOKS_COMPILE_EACH_PATH=1 (the second NVRTC's run) compiles only those, for every one.
EVERY_KERNEL_ARCH = None if os.environ.get("FASTHOOKS_COMPILE_EACH_PATH") == "1" else 90
EACH_PATH = (  # (list kernel, (full, bins, diff, binades, top, channels))
    (False, (False, 0, False, False, False, False)),
    (False, (True, 16, False, False, False, False)),
    (False, (True, 256, False, True, False, False)),
    (False, (True, 16, False, True, True, True)),
    (True, (True, 256, False, False, False, False)),
    (True, (True, 0, True, False, False, False)),
)


def _kernels(arch: int) -> list[tuple[torch.dtype, bool, tuple[bool, int, bool, bool, bool, bool]]]:
    """(dtype, list kernel, flags) of every kernel compiled for `arch`."""
    if arch == EVERY_KERNEL_ARCH:
        return [
            (dtype, list_, flags)
            for dtype, list_, flags in itertools.product(DTYPES, (False, True), FLAGS)
            if not (list_ and any(flags[3:]))
        ]
    return [(dtype, list_, flags) for dtype in DTYPES for list_, flags in EACH_PATH]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_for_each_architecture(arch):
    # Into the run's own cache (FASTHOOKS_CACHE_DIR), which the register and roofline tables then
    # read rather than compile again; the cache tests below start from empty ones.
    kernels = _kernels(arch)
    paths = set()
    for dtype, list_, (full, bins, diff, binades, top, channels) in kernels:
        _, path = cuda_setup.compile_kernel(
            dtype,
            arch,
            full=full,
            bins=bins,
            diff=diff,
            list_=list_,
            binades=binades,
            top=top,
            channels=channels,
        )
        name, image = _image(path)
        assert name.startswith(b"_Z") and (b"list" in name) == list_
        assert ("-binades-" in path) == binades
        assert ("-top-" in path) == top
        assert ("-channels-" in path) == channels
        assert image[:4] == b"\x7fELF", f"{path} holds no cubin"
        assert f"-sm_{arch}-nvrtc" in path
        assert Path(path).parent == Path(cuda_setup.cache_dir())
        paths.add(path)
    assert len(paths) == len(kernels)


def test_a_gpu_newer_than_nvrtc_gets_ptx_and_an_older_one_a_clear_error(fresh_cache):
    target = cuda_setup.target(990)
    assert target.startswith("compute_")
    _, path = cuda_setup.compile_kernel(torch.bfloat16, 990, full=True, bins=40)
    _, image = _image(path)
    assert b".version" in image and b".target sm_" in image
    with pytest.raises(RuntimeError, match="need sm_70 or later, not this GPU's sm_60"):
        cuda_setup.target(60)


COMPILE_ONCE = """
import sys, torch
from fasthooks import cuda_setup, ops
ops.cuda_status()
compiled, path = cuda_setup.compile_kernel(torch.float16, 90, full=True)
print(int(compiled), path)
"""


def _compile_in_a_process(cache: Path) -> tuple[bool, str]:
    env = subprocess_env(FASTHOOKS_CACHE_DIR=str(cache))
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_ONCE], env=env, capture_output=True, text=True, check=True
    )
    compiled, path = done.stdout.split()
    return compiled == "1", path


def test_the_cache_serves_later_processes(tmp_path):
    first = _compile_in_a_process(tmp_path)
    second = _compile_in_a_process(tmp_path)
    assert first[0] and not second[0]
    assert first[1] == second[1]


def test_four_processes_compiling_at_once_compile_once(tmp_path):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(_compile_in_a_process, [tmp_path] * 4))
    assert sum(compiled for compiled, _ in results) == 1
    assert len({path for _, path in results}) == 1
    name, image = _image(results[0][1])
    assert name.startswith(b"_Z") and image[:4] == b"\x7fELF"
    assert [p.name for p in tmp_path.iterdir() if ".tmp." in p.name] == []


def test_a_process_that_holds_the_lock_too_long_is_not_waited_for(tmp_path):
    # A rank stopped or hung in its compile must not hang the others: past
    # FASTHOOKS_CACHE_LOCK_WAIT they compile the kernel themselves, into the same file.
    _, path = _compile_in_a_process(tmp_path)
    os.remove(path)
    with open(path.removesuffix(".bin") + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = subprocess_env(FASTHOOKS_CACHE_DIR=str(tmp_path), FASTHOOKS_CACHE_LOCK_WAIT="0.5")
        done = subprocess.run(
            [sys.executable, "-c", COMPILE_ONCE],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
    compiled, again = done.stdout.split()
    assert compiled == "1" and again == path
    assert "for over 0.5 s" in done.stderr and "compiling it here too" in done.stderr
    assert _image(path)[1][:4] == b"\x7fELF"


@pytest.mark.parametrize("given", ["soon", "-1", "inf", "nan"])
def test_a_lock_wait_that_is_not_seconds_warns_and_waits_the_default(given, monkeypatch):
    monkeypatch.setenv("FASTHOOKS_CACHE_LOCK_WAIT", given)
    with pytest.warns(RuntimeWarning, match=f"FASTHOOKS_CACHE_LOCK_WAIT .* not '{given}'"):
        assert cuda_setup.lock_wait() == cuda_setup.LOCK_WAIT_SECONDS
    monkeypatch.setenv("FASTHOOKS_CACHE_LOCK_WAIT", "2.5")
    assert cuda_setup.lock_wait() == 2.5


def test_an_unwritable_cache_still_compiles(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("FASTHOOKS_CACHE_DIR", str(blocked / "kernels"))
    cuda_setup.configure()
    try:
        compiled, path = cuda_setup.compile_kernel(torch.float32, 80, full=False)
    finally:
        monkeypatch.delenv("FASTHOOKS_CACHE_DIR")
        cuda_setup.configure()
    assert compiled and path == ""


@pytest.mark.skipif(
    ops.extension_available() and ops.cuda_status().unavailable is None,
    reason="the CUDA kernels can run here",
)
def test_without_a_driver_auto_runs_python_and_fused_is_refused(monkeypatch):
    monkeypatch.setattr(ops, "_warned_no_device_kernel", set())
    cuda = torch.device("cuda")
    why = ops.cuda_status().unavailable
    with pytest.warns(RuntimeWarning, match="cannot run here") as warned:
        assert ops.backend_for_device("fused", "auto", cuda) == "python"
    assert why in str(warned[0].message)
    with pytest.raises(RuntimeError, match="backend='fused' on cuda") as refused:
        ops.backend_for_device("fused", "fused", cuda)
    assert why in str(refused.value)
    assert why in cuda_setup.prepare(0)


def test_without_nvrtc_auto_runs_python_and_fused_is_refused_saying_so(monkeypatch):
    monkeypatch.delenv("FASTHOOKS_NVRTC", raising=False)
    monkeypatch.setattr(cuda_setup, "nvrtc_candidates", lambda: [])
    monkeypatch.setattr(ops, "_warned_no_device_kernel", set())
    monkeypatch.setattr(ops, "_cuda_setup", cuda_setup.configure())
    try:
        why = ops.cuda_status().unavailable
        assert ops.cuda_status().nvrtc is None and "no NVRTC library could be loaded" in why
        cuda = torch.device("cuda")
        with pytest.warns(RuntimeWarning, match="no NVRTC library could be loaded"):
            assert ops.backend_for_device("fused", "auto", cuda) == "python"
        with pytest.raises(RuntimeError, match="no NVRTC library could be loaded"):
            ops.backend_for_device("fused", "fused", cuda)
        with pytest.raises(RuntimeError, match="no NVRTC"):
            cuda_setup.compile_kernel(torch.float32, 90, full=False)
    finally:
        monkeypatch.undo()
        cuda_setup.configure()


def test_python_m_fasthooks_says_what_it_found():
    done = subprocess.run(
        [sys.executable, "-m", "fasthooks"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    setup = ops.cuda_status()
    assert f"nvrtc: {setup.nvrtc}" in done.stdout
    assert f"nvrtc_version: {setup.nvrtc_version}" in done.stdout
    assert f"kernel_cache: {setup.cache_dir}" in done.stdout
