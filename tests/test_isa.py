"""Each CPU kernel build runs only where the CPU has its instructions: nothing compiled for an
instruction set executes at load, and no shared code is compiled for one."""

import importlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import FUSED

from fasthooks import ops
from fasthooks.layout import EXTRAS

pytestmark = FUSED

# Namespaces of the kernel units (csrc/cpu/kernels_<isa>.cpp) and what each may execute.
ISA_NAMESPACES = {"avx2": {"avx"}, "avx512": {"avx", "avx512"}, "avx512_gfni": {"avx", "avx512"}}


def _extension() -> Path:
    return Path(importlib.import_module("fasthooks._C").__file__)


@pytest.mark.isa
def test_the_expected_cpu_kernels_run():
    expected = os.environ.get("FASTHOOKS_EXPECT_CPU_CAPABILITY")
    if not expected:
        pytest.skip("the ISA matrix (make test-isa) says which kernels a CPU must pick")
    assert ops.cpu_capability() == expected


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} (binutils) is not installed")
    return path


def test_no_kernel_unit_runs_code_at_load():
    symbols = subprocess.run(
        [_tool("nm"), str(_extension())], capture_output=True, text=True, check=True
    ).stdout
    initialisers = re.findall(r"_GLOBAL__sub_I_(\w+)\.cpp", symbols)
    assert initialisers, "no initialiser found at all: the check would prove nothing"
    assert not [unit for unit in initialisers if unit.startswith("kernels")]


def _instruction_sets(instructions: list[str]) -> set[str]:
    found = set()
    for line in instructions:
        if "%zmm" in line or re.search(r"%k[0-7]\b", line):
            found.add("avx512")
        elif line.startswith("v") or "%ymm" in line:
            found.add("avx")
    return found


def _functions(library: Path) -> dict[str, list[str]]:
    listing = subprocess.run(
        [_tool("objdump"), "-d", "-C", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    functions: dict[str, list[str]] = {}
    current = None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if header:
            current = functions.setdefault(header.group(1), [])
        elif current is not None and "\t" in line:
            current.append(line.split("\t")[1].strip())
    return functions


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 kernel builds only")
def test_vector_instructions_only_in_their_kernel_units():
    functions = _functions(_extension())
    outside, seen = [], set()
    for name, instructions in functions.items():
        used = _instruction_sets(instructions)
        unit = re.search(r"fasthooks::(avx2|avx512|avx512_gfni)::", name)
        allowed = ISA_NAMESPACES[unit.group(1)] if unit else set()
        seen |= used
        if used - allowed:
            outside.append((name, sorted(used - allowed)))
    assert seen == {"avx", "avx512"}, "no AVX-512 code found: the check would prove nothing"
    assert not outside, outside


@pytest.mark.isa
def test_a_recording_run_matches_the_python_backend():
    # A few training steps of a small CNN with every statistic and a histogram, forward and
    # backward, recorded by this CPU's kernels and by the python backend.
    import torch
    from torch import nn

    from fasthooks import ActivationStats

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10)).to(
        memory_format=torch.channels_last
    )
    options = dict(extra=EXTRAS, hist_bins=16, hist_range=(-3, 3))
    runs = []
    for backend in ("fused", "python"):
        forward = ActivationStats(model, backend=backend, **options)
        backward = ActivationStats(model, backend=backend, is_forward=False, **options)
        with forward, backward:
            for step in range(3):
                x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))
                model(x).square().mean().backward()
                forward.on_batch_end()
                backward.on_batch_end()
        runs.append([forward.stats, *forward.extra.values(), forward.hist, backward.stats])
    assert runs[0][0].shape == (2, 2, 3)  # the conv and the linear layer, three batches
    for fused, python in zip(*runs, strict=True):
        torch.testing.assert_close(fused, python, rtol=1e-5, atol=1e-6, equal_nan=True)
