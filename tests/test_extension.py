"""Loading the extension: soft when missing, and the kernels each build promises."""

import os
import subprocess
import sys

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
    assert fasthooks.ops.cpu_capability() in ("avx2", "default")


@pytest.mark.skipif(
    os.environ.get("FASTHOOKS_REQUIRE_CUDA_KERNEL") != "1",
    reason="only for a CUDA build (FASTHOOKS_REQUIRE_CUDA_KERNEL=1)",
)
def test_cuda_kernel_is_registered():
    assert torch.version.cuda is not None
    assert "CUDA:" in _registered_kernels(), _registered_kernels()


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


def _setup_py(tmp_path, **env):
    """Runs `setup.py --name` where importing torch fails, as in an isolated pip build."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named torch')\n")
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
