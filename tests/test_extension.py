"""Loading the extension: soft when missing, and the kernels each build promises."""

import importlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FUSED, subprocess_env

import fasthooks

WITHOUT_EXTENSION = """
import sys
sys.modules["fasthooks._C"] = None  # makes `import fasthooks._C` raise ImportError
import torch, fasthooks
from fasthooks import ActivationStats
assert not fasthooks.extension_available()
print(fasthooks.extension_error())
lin = torch.nn.Linear(3, 3)
act = ActivationStats(lin)
with act:
    lin(torch.randn(4, 3)); act.on_batch_end()
print(act.backend, tuple(act.stats.shape))
try:
    ActivationStats(lin, backend="fused")
except RuntimeError as error:
    print(error)
"""


def _python(script: str) -> subprocess.CompletedProcess:
    """Runs `script` in a child Python that imports this same fasthooks build."""
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env=subprocess_env(),
    )


def test_import_without_extension_falls_back_to_python():
    out = _python(WITHOUT_EXTENSION)
    error, backend, refusal = out.stdout.splitlines()
    assert error.startswith("ModuleNotFoundError:") and "fasthooks._C" in error
    assert backend == "python (2, 1, 1)"
    assert "the fused backend needs the compiled extension fasthooks._C" in refusal
    assert "pip install --no-build-isolation" in refusal and "backend='python'" in refusal


def _registered_kernels() -> str:
    return torch._C._dispatch_dump("fasthooks::accumulate_stats")


@FUSED
def test_cpu_kernel_and_fake_kernel_are_registered():
    table = _registered_kernels()
    assert "CPU:" in table
    assert (
        torch._library.simple_registry.singleton.find(
            "fasthooks::accumulate_stats"
        ).fake_impl.kernel
        is not None
    )
    assert fasthooks.ops.cpu_capability() in ("avx512_gfni", "avx512", "avx2", "default")


@FUSED
def test_cuda_kernels_are_registered_in_every_build():
    # The CUDA host code needs no CUDA to build or load: the kernels are compiled where they run.
    for op in ("accumulate_stats", "accumulate_stats_list"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fasthooks::{op}", "CUDA"), op


BROKEN_EXTENSION = """
import sys, warnings
class Broken:
    def find_spec(self, name, path=None, target=None):
        if name == "fasthooks._C":
            raise ImportError("_C.so: undefined symbol: _ZN3c104impl3fooEv")
sys.meta_path.insert(0, Broken())
import torch, fasthooks
from fasthooks import ActivationStats
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backends = [ActivationStats(torch.nn.Linear(2, 2)).backend for _ in range(2)]
print(backends, len(caught))
print(caught[0].message)
try:
    ActivationStats(torch.nn.Linear(2, 2), backend="fused")
except RuntimeError as error:
    print("refused:", error)
"""


def test_an_extension_that_fails_to_load_warns_once_and_falls_back():
    out = _python(BROKEN_EXTENSION)
    counts, warning, refusal = out.stdout.splitlines()
    assert counts == "['python', 'python'] 1"
    assert "fasthooks._C is installed but did not load (ImportError: _C.so: undefined" in warning
    assert "pip install --no-build-isolation" in warning
    assert refusal.startswith("refused: the fused backend needs the compiled extension")


OLD_TORCH = """
import warnings
import torch
torch.__version__ = "2.9.1"  # before fasthooks looks at it
import fasthooks
from fasthooks import ActivationStats
print(fasthooks.extension_error())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backends = [ActivationStats(torch.nn.Linear(2, 2)).backend for _ in range(2)]
print(backends, len(caught))
try:
    ActivationStats(torch.nn.Linear(2, 2), backend="fused")
except RuntimeError as error:
    print("refused:", error)
"""


@FUSED
def test_under_torch_older_than_its_abi_the_extension_is_left_alone():
    out = _python(OLD_TORCH)
    error, counts, refusal = out.stdout.splitlines()
    assert error == (
        "fasthooks._C is built on torch's stable ABI, which needs torch >= 2.10; "
        "this is torch 2.9.1"
    )
    assert counts == "['python', 'python'] 1"
    assert refusal.startswith("refused: the fused backend needs the compiled extension")
    assert refusal.endswith("upgrade torch to 2.10 or later, or use backend='python'")


@FUSED
def test_the_extension_links_torch_through_its_stable_c_abi_only():
    nm = shutil.which("nm")
    assert nm is not None, "nm (binutils) is needed to list the extension's symbols"
    origin = importlib.util.find_spec("fasthooks._C").origin
    assert origin.endswith(".abi3.so"), origin
    listing = subprocess.run(
        [nm, "-D", "--undefined-only", "--demangle", origin],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    symbols = [line.strip()[2:] for line in listing.splitlines() if line.strip().startswith("U ")]
    cpp_of_torch = [s for s in symbols if re.search(r"\b(c10|at|torch|caffe2)::", s)]
    assert cpp_of_torch == []
    # What it does use: the stable C shim, for registration and tensors.
    assert {"aoti_torch_library_init_def", "torch_library_impl"} <= set(symbols)


# What manylinux_2_28 allows (glibc 2.28, GCC 8's libstdc++).
NEWEST_ALLOWED = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11)}


@FUSED
@pytest.mark.isa
def test_the_extension_needs_nothing_newer_than_manylinux_2_28_and_links_no_cuda():
    origin = importlib.util.find_spec("fasthooks._C").origin
    listing = subprocess.run(
        [shutil.which("objdump") or "objdump", "-T", "-p", origin],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    versions = set(re.findall(r"\b(GLIBC|GLIBCXX|CXXABI)_([0-9.]+)\b", listing))
    assert ("GLIBC", "2.2.5") in versions or any(lib == "GLIBC" for lib, _ in versions)
    too_new = [
        f"{lib}_{v}"
        for lib, v in versions
        if tuple(int(part) for part in v.split(".")) > NEWEST_ALLOWED[lib]
    ]
    assert too_new == [], too_new
    needed = re.findall(r"NEEDED\s+(\S+)", listing)
    assert needed and not [lib for lib in needed if re.search(r"cuda|nvrtc|cublas", lib)], needed


@pytest.mark.isa
@pytest.mark.skipif(
    not os.environ.get("FASTHOOKS_WHEEL_DIR"),
    reason="only for the wheel installed beside another torch (FASTHOOKS_WHEEL_DIR, make test)",
)
def test_the_wheel_built_against_another_torch_loads_here():
    built_with = os.environ["FASTHOOKS_WHEEL_BUILT_WITH"]
    assert fasthooks.extension_available(), fasthooks.extension_error()
    assert torch.__version__.split("+")[0] != built_with
    origin = importlib.util.find_spec("fasthooks._C").origin
    assert origin.startswith(os.path.abspath(os.environ["FASTHOOKS_WHEEL_DIR"])), origin
    assert origin.endswith(".abi3.so")


def _setup_py(tmp_path, torch_init="raise ImportError('No module named torch')\n", **env):
    """Runs `setup.py --name` with a stand-in torch (by default one that fails to import, as in
    an isolated pip build)."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(torch_init)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path), **env},
        timeout=60,
    )


def test_a_build_without_torch_stops_with_the_command_to_use(tmp_path):
    run = _setup_py(tmp_path)
    assert run.returncode != 0
    assert "run `pip install --no-build-isolation .`" in run.stderr
    assert "`FASTHOOKS_NO_EXT=1 pip install .`" in run.stderr


def test_the_pure_python_build_needs_no_torch(tmp_path):
    run = _setup_py(tmp_path, FASTHOOKS_NO_EXT="1")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "fasthooks"


def test_torch_older_than_its_abi_installs_the_pure_python_package(tmp_path):
    run = _setup_py(tmp_path, torch_init="__version__ = '2.9.1'\n")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "fasthooks"
    assert "torch 2.9.1 predates the stable ABI (torch >= 2.10)" in run.stderr


@pytest.mark.skipif(
    not os.environ.get("FASTHOOKS_INSTALLED_AT"),
    reason="only for a package installed into a folder of its own (FASTHOOKS_INSTALLED_AT)",
)
def test_the_package_under_test_is_the_installed_one():
    folder = os.path.abspath(os.environ["FASTHOOKS_INSTALLED_AT"])
    assert fasthooks.extension_available(), fasthooks.extension_error()
    assert fasthooks.__file__.startswith(folder), fasthooks.__file__
    assert importlib.util.find_spec("fasthooks._C").origin.startswith(folder)


@pytest.mark.isa
@pytest.mark.skipif(
    not os.environ.get("FASTHOOKS_WHEEL_DIR"),
    reason="only for the wheel installed beside another torch (FASTHOOKS_WHEEL_DIR, make test)",
)
def test_the_wheel_is_tagged_manylinux_2_28_as_torch_is():
    (wheel_file,) = Path(os.environ["FASTHOOKS_WHEEL_DIR"]).glob("fasthooks-*.dist-info/WHEEL")
    tags = [
        line.split(": ", 1)[1]
        for line in wheel_file.read_text().splitlines()
        if line.startswith("Tag: ")
    ]
    machine = platform.machine()
    assert f"cp310-abi3-manylinux_2_28_{machine}" in tags, tags
    policies = [re.fullmatch(rf"cp310-abi3-manylinux_2_(\d+)_{machine}", tag) for tag in tags]
    assert all(p is not None and int(p[1]) <= 28 for p in policies), tags


@FUSED
def test_a_device_the_build_has_no_kernel_for_falls_back_or_is_refused(monkeypatch):
    monkeypatch.setattr(fasthooks.ops, "_warned_no_device_kernel", set())
    xpu = torch.device("xpu")  # no build of fasthooks._C registers kernels for it
    assert not fasthooks.ops.has_kernel_for("xpu") and fasthooks.ops.has_kernel_for("cpu")
    with pytest.warns(RuntimeWarning, match="has no xpu kernel.* python backend runs instead"):
        assert fasthooks.ops.backend_for_device("fused", "auto", xpu) == "python"
    with pytest.raises(RuntimeError, match="backend='fused' on xpu: this build .* no xpu kernel"):
        fasthooks.ops.backend_for_device("fused", "fused", xpu)
    assert fasthooks.ops.backend_for_device("python", "python", xpu) == "python"
    assert fasthooks.ops.backend_for_device("fused", "fused", torch.device("cpu")) == "fused"


def test_python_m_fasthooks_says_what_it_holds_and_checks_its_kernels():
    run = subprocess.run(
        [sys.executable, "-m", "fasthooks"],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert "fasthooks: " in run.stdout and "torch: " in run.stdout, run.stdout
    if fasthooks.extension_available():
        assert run.returncode == 0, run.stdout + run.stderr
        for dtype in ("float32", "float16", "bfloat16"):
            assert f"self-check cpu torch.{dtype}: ok" in run.stdout
        for key in ("cpu_kernels", "fused_kernels", "nvrtc", "kernel_cache", "cuda_unavailable"):
            assert re.search(rf"^ *{key}: ", run.stdout, re.M), run.stdout
    else:
        assert run.returncode == 1 and "did not load" in run.stdout


@FUSED
def test_python_m_fasthooks_exits_1_on_a_mismatch(monkeypatch, capsys):
    module = importlib.import_module("fasthooks.build_info")  # the package exports its function
    monkeypatch.setattr(module, "self_check", lambda device, dtype: 1e-2)
    assert module.main() == 1
    assert "self-check cpu torch.float32: MISMATCH (largest difference 1.00e-02)" in (
        capsys.readouterr().out
    )
