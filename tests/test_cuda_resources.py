"""The CUDA kernels' registers and occupancy, from the cubins NVRTC makes, as docs/cuda.md states
them."""

import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = os.environ.get("FASTHOOKS_REQUIRE_CUDA_KERNEL") == "1"


def _module():
    spec = importlib.util.spec_from_file_location(
        "cuda_resources", ROOT / "benchmarks" / "cuda_resources.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_kernel_holds_three_blocks_per_sm_as_the_docs_say():
    resources = _module()
    why = resources.missing()
    if why is not None and not REQUIRED:
        pytest.skip(f"needs NVRTC and nvdisasm (make test-wheel): {why}")
    assert why is None
    archs = ["80", "90"]
    table = resources.resources(resources.disassemble(archs))
    # 4 dtypes x (mean and std, every statistic, every statistic of a difference) x (no histogram,
    # its bins counted per thread, per block) x (one tensor, a list), and binades beside the
    # first two of one tensor
    assert len(table) == 4 * 3 * 3 * 2 + 4 * 2 * 3
    for kernel, per_arch in table.items():
        for arch in archs:
            registers, _ = per_arch[arch]
            assert resources.blocks_by_registers(registers) >= 3, (kernel, arch, registers)
    page = (ROOT / "docs" / "cuda.md").read_text()
    stated = re.search(r"<!-- cuda-resources -->\n(.*?)<!-- /cuda-resources -->", page, re.S)
    assert stated is not None and stated.group(1) == resources.markdown(table, archs)


def test_spills_and_registers_from_a_listing():
    resources = _module()
    listing = """
	//----- nvinfo : EIATTR_REGCOUNT
	.align		4
        /*0000*/ 	.byte	0x04, 0x2f
        /*0002*/ 	.short	(.L_33 - .L_32)
	.align		4
.L_32:
        /*0004*/ 	.word	index@(kernel)
        /*0008*/ 	.word	0x00000050
.text.kernel:
        /*0010*/                   STL.64 [R1+0x8], R4 ;
        /*0020*/              @!P0 LDL.LU R4, [R1+0x8] ;
        /*0030*/                   LDL.128 R4, [R1] ;
        /*0040*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
$__internal_0_$__cuda_sm20_div_rn_f64_full:
        /*0050*/                   STL.64 [R1+0x10], R6 ;
"""
    assert resources.registers("kernel", listing) == 80
    # The kernel's own local stores and loads, not its subroutine's.
    assert resources.spilled_bytes("kernel", listing) == 8 + 4 + 16


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
