"""benchmarks/cuda_roofline.py's reading of SASS, on a hand-written listing (no NVRTC needed).

make test-cuda-kernels checks its table of the real kernels against docs/cuda.md."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# An outer loop (a segment) around a steady loop of two 16-byte loads; after it, a fallback loop
# reached only past a branch, and a division's slow path (a CALL) skipped by another.
SASS = """
.text._ZN9fasthooks4cuda23accumulate_stats_kernelIffLb0ELb0ELb0EEEvPKT_S4_llNS0_7BuffersE:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/                   BSSY B0, `(.L_x_3) ;
.L_x_2:
        /*0030*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0040*/                   LDG.E.128.CONSTANT R8, desc[UR4][R2.64+0x10] ;
        /*0050*/                   FADD R12, R4, R5 ;
        /*0060*/                   DADD R14, R14, 4 ;
        /*0070*/               @P0 BRA `(.L_x_2) ;
.L_x_3:
        /*0080*/                   BSYNC B0 ;
        /*0090*/                   DSETP.GT.AND P1, PT, R14, RZ, PT ;
        /*00a0*/               @P1 BRA `(.L_x_5) ;
        /*00b0*/                   MOV R20, RZ ;
.L_x_4:
        /*00c0*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*00d0*/                   DFMA R20, R4, R4, R20 ;
        /*00e0*/               @P2 BRA `(.L_x_4) ;
.L_x_5:
        /*00f0*/                   DSETP.NEU.AND P3, PT, R20, RZ, PT ;
        /*0100*/               @P3 BRA `(.L_x_6) ;
        /*0110*/                   MOV R40, 0x130 ;
        /*0120*/                   CALL.REL.NOINC `($__internal_0_$__cuda_sm20_div_rn_f64_full) ;
.L_x_6:
        /*0130*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*0140*/              @!P0 BRA `(.L_x_1) ;
        /*0150*/                   EXIT ;
$__internal_0_$__cuda_sm20_div_rn_f64_full:
        /*0160*/                   RET.REL.NODEC R40 `(kernel) ;
"""


@pytest.fixture
def roofline(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("cuda_roofline")


def test_the_steady_loop_and_the_segment_path_are_found(roofline):
    (name, (code, labels)), *others = roofline.functions(SASS).items()
    assert not others and len(code) == 22  # up to the subroutine
    assert name.startswith("_ZN9fasthooks4cuda23accumulate_stats_kernelIff")
    kernel = roofline.Kernel("float32", False, False, False, False)
    a = roofline.analyse(code, labels, kernel)
    assert [i.address for i in a.loop] == [0x30, 0x40, 0x50, 0x60, 0x70]
    assert a.elements_per_iteration == 8 and a.in_flight_bytes == 32
    assert roofline.per_element(a.loop, 8) == {
        "loads": 0.25,
        "FP32": 0.125,
        "FP64": 0.125,
        "branch": 0.125,
    }
    # Outside both loops, the fallback's entry and the block that calls the slow path.
    assert [i.address for i in a.segment] == [
        0x10,
        0x20,
        0x80,
        0x90,
        0xA0,
        0xF0,
        0x100,
        0x130,
        0x140,
    ]
    assert (
        a.elements_per_segment
        == roofline.kernel_constant("kSegmentLoads") * roofline.kernel_constant("kVecBytes") / 4
    )


def test_instruction_classes(roofline):
    def klass(opcode):
        return roofline.Instruction(0, False, opcode, "").klass

    assert [klass(op) for op in ("IMAD.WIDE.U32", "SEL", "VIADD", "ULEA")] == ["integer"] * 4
    assert [klass(op) for op in ("F2F.F64.F32", "F2I.S64.TRUNC")] == ["conversion"] * 2
    assert [klass(op) for op in ("ATOMS.ADD", "LDS.64", "MATCH.ANY", "STL.64")] == [
        "shared/atomic",
        "shared/atomic",
        "warp",
        "local (spills)",
    ]
    assert klass("LDC.64") == "other" and klass("DSETP.GT.AND") == "FP64"


def test_issue_bound_and_bytes_in_flight(roofline):
    h200 = next(g for g in roofline.GPUS if g.name == "H200")
    kernel = roofline.Kernel("bfloat16", True, False, True, True)._asdict()
    figures = {"kernel": kernel, "per_element": 20.0, "in_flight_bytes_per_sm": 49152}
    issue, flight = roofline.bounds(figures, h200)
    # 4 warp instructions a cycle x 32 lanes x 132 SMs x 1.98 GHz over 20 instructions, against
    # 4.8 TB/s over 4 bytes an element (a bfloat16 value and its base).
    assert issue == pytest.approx(4 * 32 * 132 * 1.98e9 / 20 / (4.8e12 / 4))
    assert flight == pytest.approx(49152 / (4.8e12 / 132 * 700e-9))


def test_the_docs_hold_a_table_between_the_markers(roofline):
    page = (ROOT / "docs" / "cuda.md").read_text()
    block = re.search(re.escape(roofline.BEGIN) + r"\n(.*?)" + re.escape(roofline.END), page, re.S)
    assert block is not None
    rows = [line for line in block.group(1).splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(roofline.SHOWN) * len(roofline.DTYPE_ORDER) * len(roofline.GPUS)
