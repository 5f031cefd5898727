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


def test_import_without_extension_falls_back_to_python():
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTENSION],
        capture_output=True,
        text=True,
        check=True,
        env=subprocess_env(),
    )
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
