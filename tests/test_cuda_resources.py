"""The CUDA kernels' registers and occupancy, from ptxas, as docs/cuda.md states them."""

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    torch.version.cuda is None, reason="needs a CUDA build of torch and nvcc"
)


def _module():
    spec = importlib.util.spec_from_file_location(
        "cuda_resources", ROOT / "benchmarks" / "cuda_resources.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(
    os.environ.get("FASTHOOKS_REQUIRE_CUDA_KERNEL") != "1",
    reason="compiles every kernel twice (about a minute): the CUDA build's run only",
)
def test_every_kernel_holds_three_blocks_per_sm_as_the_docs_say():
    resources = _module()
    archs = ["80", "90"]
    table = resources.resources(resources.ptxas_report(archs))
    # 4 dtypes x (mean and std, every statistic, every statistic of a difference) x histogram or
    # not x (one tensor, a list)
    assert len(table) == 48
    for kernel, per_arch in table.items():
        for arch in archs:
            registers, _ = per_arch[arch]
            assert resources.blocks_by_registers(registers) >= 3, (kernel, arch, registers)
    page = (ROOT / "docs" / "cuda.md").read_text()
    stated = re.search(r"<!-- cuda-resources -->\n(.*?)<!-- /cuda-resources -->", page, re.S)
    assert stated is not None and stated.group(1) == resources.markdown(table, archs)


def test_blocks_by_registers():
    resources = _module()
    assert [resources.blocks_by_registers(r) for r in (64, 72, 80, 88, 96, 128)] == [
        4,
        3,
        3,
        2,
        2,
        2,
    ]
