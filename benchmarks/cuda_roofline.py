"""Instructions per element of each CUDA kernel, from its SASS, against the memory bandwidth.

Compiles every kernel instantiation with NVRTC for sm_80, sm_90 and sm_100, as the extension
does at first use (no GPU needed; what cuda_resources.py needs), disassembles each cubin with
nvdisasm and counts the instructions a thread issues per input element in the steady state:

- the steady loop: the innermost loop that holds the most kVecBytes (16-byte) global loads,
  the vector loads of the input: its body's instructions over the elements its loads bring;
- the per-segment path: the rest of the loop around it (a segment of kSegmentLoads loads per
  thread: the shift, the merge of the segment's sums into the thread's moments), over the
  elements of a segment. Left out as not taken: other loops in it and the code that leads only
  to them (the segment recomputed in double when its float sums are unsafe), and blocks that
  call a subroutine (the compiler's slow paths of division). Both sides of any other branch are
  counted.

Every instruction of the steady loop's body is counted once: in the steady state every load of
an iteration is in range, and a warp issues a branch's body when any of its lanes takes it (a
histogram's shared-memory atomic, where a block shares one table, is issued by one lane of each
group of lanes sharing a bin, so by some lane of every warp). Every bin count up to
kThreadBins runs the code of a histogram counted per thread, every count above it the code of
one counted per block: 16 and 256 bins stand for each. The scalar head and tail of an
input, and the per-block and per-tensor merges, are left out (a bounded cost, not per element).
Loops are found from backward branches of code laid out as ptxas lays it out (a loop's body is
the address range from its head to its backward branch): a heuristic, checked only in that it
must find a steady loop with vector loads in every kernel. Code that runs only when a warp has
diverged (what ptxas places behind BRA.DIV) is taken as not run.

For each GPU: the issue bound, 4 warp instructions per cycle per SM x 32 threads x SMs x clock
over instructions per element, in elements per second, against the memory bandwidth over the
bytes an element reads (both inputs' for a difference): above 1 the memory is the limit. It
treats every instruction alike, though FP64 and conversion instructions run on narrower pipes.
And the bytes each SM keeps in flight (the loads a thread issues before it uses the first of
them x threads per block x resident blocks by registers, as cuda_resources.py computes them)
against the latency-bandwidth product per SM (bandwidth / SMs x LATENCY_NS).

    python benchmarks/cuda_roofline.py [--archs 80 90 100] [--out DIR] [--check docs/cuda.md]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# python -P (the installed fasthooks, not the checkout's) leaves this folder off sys.path.
sys.path.append(str(Path(__file__).resolve().parent))
from cuda_resources import (
    ROOT,
    Kernel,
    access_bytes,
    blocks_by_registers,
    disassemble,
    registers,
)

KERNEL_LAYOUT = ROOT / "csrc" / "cuda" / "kernel_layout.h"
ELEMENT_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}


class Gpu(NamedTuple):
    name: str
    arch: str
    sms: int
    clock_ghz: float  # boost clock
    tb_s: float  # memory bandwidth


# As their makers state them.
GPUS = [
    Gpu("A100 80GB", "80", 108, 1.41, 2.04),
    Gpu("H100 SXM", "90", 132, 1.98, 3.35),
    Gpu("H200", "90", 132, 1.98, 4.8),
    Gpu("B200", "100", 148, 1.965, 8.0),
]
WARP_ISSUE_PER_CYCLE = 4
LATENCY_NS = 700
# Goals: the issue bound at least 1.5x the bandwidth on an H200, and at least twice the
# latency-bandwidth product in flight per SM.
GOAL_GPU, GOAL_ISSUE, GOAL_IN_FLIGHT = "H200", 1.5, 2.0
# The variants the table shows (results.json holds every kernel), each for every dtype.
SHOWN = [
    (False, 0, False, False, False),  # (full, bins, diff, list, binades): mean and std
    (True, 0, False, False, False),
    (True, 0, False, False, True),
    (True, 16, False, False, False),
    (True, 256, False, False, False),
    (True, 0, False, True, False),
    (True, 0, True, True, False),
]
DTYPE_ORDER = ["float32", "bfloat16", "float16", "float64"]
BEGIN, END = "<!-- cuda_roofline:begin -->", "<!-- cuda_roofline:end -->"

CLASSES = {
    "loads": ("LDG", "LD"),
    "FP32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FSWZADD", "MUFU"),
    "FP16": ("HADD2", "HMUL2", "HFMA2", "HSETP2", "HSET2", "HMNMX2"),
    "FP64": ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DSET"),
    "conversion": ("F2F", "F2I", "I2F", "I2I", "F2FP", "I2FP", "F2IP", "FRND"),
    "shared/atomic": ("LDS", "STS", "LDSM", "ATOMS", "ATOMG", "ATOM", "RED", "REDG"),
    "local (spills)": ("LDL", "STL"),
    "branch": ("BRA", "BRX", "JMP", "JMX", "BSSY", "BSYNC", "BREAK", "CALL", "RET", "EXIT"),
    "warp": ("SHFL", "VOTE", "VOTEU", "MATCH", "REDUX", "WARPSYNC", "ENDCOLLECTIVE"),
}
INTEGER = re.compile(
    r"(U?(IADD3|IMAD|IMUL|LOP3|ISETP|SHF|LEA|IABS|IMNMX|POPC|FLO|BREV|PRMT|SEL|MOV|PLOP3|SGXT|"
    r"BMSK|IDP|SHL|SHR)|VIADD|VIMNMX|VIADDMNMX|CS2R|P2R|R2P)$"
)
CLASSES_ORDER = [*CLASSES, "integer", "other"]
CLASS_OF = {op: name for name, ops in CLASSES.items() for op in ops}
# A SASS line: /*0a30*/ [@!P0] OPCODE operands ;
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
LABEL = re.compile(r"^(\.L_x_\d+|\$[\w$]+):")
TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def kernel_constant(name: str) -> int:
    """A `constexpr int` of the kernels' layout (csrc/cuda/kernel_layout.h)."""
    match = re.search(rf"constexpr int {name} = (\d+);", KERNEL_LAYOUT.read_text())
    if match is None:
        raise SystemExit(f"no constexpr int {name} in {KERNEL_LAYOUT}")
    return int(match.group(1))


@dataclass
class Instruction:
    address: int
    predicated: bool
    opcode: str
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def klass(self) -> str:
        if self.base in CLASS_OF:
            return CLASS_OF[self.base]
        return "integer" if INTEGER.match(self.base) else "other"

    @property
    def load_bytes(self) -> int:
        """Bytes of a global load, 0 for any other instruction."""
        if self.base not in ("LDG", "LD"):
            return 0
        return access_bytes(self.opcode)

    @property
    def target(self) -> str | None:
        match = TARGET.search(self.operands)
        return match.group(1) if match and self.base in ("BRA", "BRX", "JMP") else None


def functions(sass: str) -> dict[str, tuple[list[Instruction], dict[str, int]]]:
    """{function: (instructions, {label: index})} of nvdisasm's output, each kernel up to its
    first subroutine ($__internal_...)."""
    found: dict[str, tuple[list[Instruction], dict[str, int]]] = {}
    current = None
    for line in sass.splitlines():
        if line.startswith(".text."):
            current = found.setdefault(line[len(".text.") :].rstrip(":"), ([], {}))
        elif current is None:
            continue
        elif label := LABEL.match(line):
            if label.group(1).startswith("$"):
                current = None
            else:
                current[1][label.group(1)] = len(current[0])
        elif (match := INSTRUCTION.match(line)) and current is not None:
            address, predicate, opcode, operands = match.groups()
            current[0].append(
                Instruction(int(address, 16), predicate is not None, opcode, operands)
            )
    return found


class Graph:
    """The basic blocks of a kernel reachable from its entry, a warp taken as converged."""

    def __init__(self, code: list[Instruction], labels: dict[str, int]):
        self.code = code
        starts = {0} | set(labels.values())
        for i, ins in enumerate(code):
            if ins.base in ("BRA", "BRX", "JMP", "EXIT", "RET") and i + 1 < len(code):
                starts.add(i + 1)
        self.starts = sorted(starts)
        ends = [*self.starts[1:], len(code)]
        self.blocks = dict(zip(self.starts, ends, strict=True))
        self.successors: dict[int, list[int]] = {}
        for start, end in self.blocks.items():
            last = code[end - 1]
            conditional = last.predicated or re.match(r"!?U?P\d", last.operands) is not None
            nexts = []
            if last.base == "BRA" and ".DIV" not in last.opcode and last.target:
                nexts.append(labels[last.target])
            falls = last.base not in ("BRA", "BRX", "JMP", "EXIT", "RET") or ".DIV" in last.opcode
            if (falls or conditional) and end < len(code):
                nexts.append(end)
            self.successors[start] = nexts
        self.reachable = self._reach(0)
        # Loops: (head, last instruction) of each backward branch, as address-ordered ranges.
        self.loops = sorted(
            {
                (head, end - 1)
                for start, end in self.blocks.items()
                if start in self.reachable
                for head in self.successors[start]
                if head <= start
            }
        )

    def _reach(self, start: int) -> set[int]:
        seen, todo = {start}, [start]
        while todo:
            for n in self.successors[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    def body(self, loop: tuple[int, int]) -> list[int]:
        """Reachable blocks of a loop."""
        return [s for s in self.starts if loop[0] <= s <= loop[1] and s in self.reachable]

    def count(self, blocks: list[int]) -> list[Instruction]:
        return [ins for s in blocks for ins in self.code[s : self.blocks[s]]]


def dominators(nodes: list[int], successors: dict[int, list[int]]) -> dict[int, set[int]]:
    """Dominator sets over `nodes` (the first is the entry), edges outside them ignored."""
    inside = set(nodes)
    preds: dict[int, list[int]] = {n: [] for n in nodes}
    for n in nodes:
        for m in successors[n]:
            if m in inside and m != nodes[0]:
                preds[m].append(n)
    dom = {n: set(inside) for n in nodes}
    dom[nodes[0]] = {nodes[0]}
    changed = True
    while changed:
        changed = False
        for n in nodes[1:]:
            new = set.intersection(*(dom[p] for p in preds[n])) if preds[n] else set()
            new = new | {n}
            if new != dom[n]:
                dom[n], changed = new, True
    return dom


@dataclass
class Analysis:
    loop: list[Instruction]
    elements_per_iteration: float
    in_flight_bytes: int  # per thread: the loop's load bytes issued before the first is used
    segment: list[Instruction]
    elements_per_segment: float


def analyse(code: list[Instruction], labels: dict[str, int], kernel: Kernel) -> Analysis:
    graph = Graph(code, labels)
    innermost = [
        loop
        for loop in graph.loops
        if not any(o != loop and loop[0] <= o[0] and o[1] <= loop[1] for o in graph.loops)
    ]

    def load_bytes(loop: tuple[int, int], size: int = 0) -> int:
        loads = [ins.load_bytes for ins in graph.count(graph.body(loop))]
        return sum(b for b in loads if b == size or not size)

    vector = kernel_constant("kVecBytes")
    steady = max(innermost, key=lambda loop: (load_bytes(loop, vector), -loop[0]), default=None)
    if steady is None or load_bytes(steady, vector) == 0:
        raise SystemExit(f"no loop of {vector}-byte loads found in {kernel}")
    loop = graph.count(graph.body(steady))
    bytes_per_element = ELEMENT_BYTES[kernel.dtype] * (2 if kernel.diff else 1)

    # Loads in flight: those issued before any instruction names a register one of them wrote.
    written: set[str] = set()
    in_flight = 0
    for ins in loop:
        named = set(re.findall(r"\bR(\d+)\b", ins.operands))
        if named & written:
            break
        if ins.load_bytes:
            first = int(re.match(r"R(\d+)", ins.operands).group(1))
            written |= {str(first + k) for k in range(max(1, ins.load_bytes // 4))}
            in_flight += ins.load_bytes

    around = [o for o in graph.loops if o[0] <= steady[0] and steady[1] <= o[1] and o != steady]
    segment: list[Instruction] = []
    if around:
        outer = min(around, key=lambda o: o[1] - o[0])
        nodes = graph.body(outer)
        inner = [o for o in graph.loops if outer[0] <= o[0] and o[1] <= outer[1] and o != outer]
        in_loops = {s for o in inner for s in graph.body(o)}
        dom = dominators(nodes, graph.successors)
        latch = max(s for s in nodes if s <= outer[1])
        # The code that leads only to another loop: what the first of that loop's dominators
        # that do not dominate the latch dominates.
        fallback: set[int] = set()
        for other in inner:
            leading = [d for d in dom.get(other[0], ()) if d not in dom[latch]]
            if other != steady and leading:
                entry = min(leading, key=lambda d: len(dom[d]))
                fallback |= {n for n in nodes if entry in dom[n]}
        calls = {s for s in nodes if any(i.base == "CALL" for i in graph.count([s]))}
        kept = [s for s in nodes if s not in in_loops | fallback | calls]
        segment = graph.count(kept)
    return Analysis(
        loop=loop,
        elements_per_iteration=load_bytes(steady) / bytes_per_element,
        in_flight_bytes=in_flight,
        segment=segment,
        elements_per_segment=kernel_constant("kSegmentLoads")
        * vector
        / ELEMENT_BYTES[kernel.dtype],
    )


def per_element(instructions: list[Instruction], elements: float) -> dict[str, float]:
    """{class: instructions per element}."""
    return {k: n / elements for k, n in Counter(ins.klass for ins in instructions).items()}


def measure(archs: list[str]) -> dict[str, dict[str, dict]]:
    """{kernel variant: {arch: figures}} of every kernel."""
    threads = kernel_constant("kThreads")
    results: dict[str, dict[str, dict]] = {}
    for (kernel, arch), (name, listing) in disassemble(archs).items():
        code, labels = functions(listing)[name]
        a = analyse(code, labels, kernel)
        loop = per_element(a.loop, a.elements_per_iteration)
        segment = per_element(a.segment, a.elements_per_segment)
        classes = {k: loop.get(k, 0.0) + segment.get(k, 0.0) for k in CLASSES_ORDER}
        used = registers(name, listing)
        blocks = blocks_by_registers(used)
        results.setdefault(f"{kernel.dtype}, {kernel.what}", {})[arch] = {
            "kernel": kernel._asdict(),
            "loop_instructions": len(a.loop),
            "elements_per_iteration": a.elements_per_iteration,
            "segment_instructions": len(a.segment),
            "elements_per_segment": a.elements_per_segment,
            "per_element": sum(classes.values()),
            "loop_per_element": sum(loop.values()),
            "segment_per_element": sum(segment.values()),
            "by_class": {
                k: v for k, v in sorted(classes.items(), key=lambda kv: (-kv[1], kv[0])) if v
            },
            "registers": used,
            "blocks_per_sm": blocks,
            "in_flight_bytes_per_thread": a.in_flight_bytes,
            "in_flight_bytes_per_sm": a.in_flight_bytes * threads * blocks,
        }
    return results


def bounds(figures: dict, gpu: Gpu) -> tuple[float, float]:
    """(issue bound / bandwidth, bytes in flight / the latency-bandwidth product), per SM."""
    kernel = Kernel(**figures["kernel"])
    element_bytes = ELEMENT_BYTES[kernel.dtype] * (2 if kernel.diff else 1)
    issue = WARP_ISSUE_PER_CYCLE * 32 * gpu.sms * gpu.clock_ghz * 1e9 / figures["per_element"]
    memory = gpu.tb_s * 1e12 / element_bytes
    return issue / memory, figures["in_flight_bytes_per_sm"] / needed_in_flight(gpu)


def needed_in_flight(gpu: Gpu) -> float:
    """The latency-bandwidth product of one SM, in bytes."""
    return gpu.tb_s * 1e12 / gpu.sms * LATENCY_NS * 1e-9


def shown(results: dict[str, dict[str, dict]]) -> list[str]:
    """The variants of the table, in its order."""
    picked = []
    for variant, per_arch in results.items():
        k = Kernel(**next(iter(per_arch.values()))["kernel"])
        flags = (k.full, k.bins, k.diff, k.is_list, k.binades)
        if flags in SHOWN:
            picked.append(((DTYPE_ORDER.index(k.dtype), SHOWN.index(flags)), variant))
    return [variant for _, variant in sorted(picked)]


def markdown(results: dict[str, dict[str, dict]], archs: list[str]) -> str:
    lines = [
        "| kernel | GPU | instructions / element (loop + segment) | main classes "
        "| issue bound / bandwidth | KB in flight / needed per SM |",
        "|---|---|---|---|---|---|",
    ]
    variants, met_issue, met_flight = shown(results), [], []
    for variant in variants:
        for gpu in (g for g in GPUS if g.arch in archs):
            f = results[variant][gpu.arch]
            issue, flight = bounds(f, gpu)
            main = ", ".join(f"{k} {v:.2f}" for k, v in list(f["by_class"].items())[:3])
            kb, needed_kb = f["in_flight_bytes_per_sm"] / 1024, needed_in_flight(gpu) / 1024
            lines.append(
                f"| {variant} | {gpu.name} (sm_{gpu.arch}) | {f['per_element']:.2f} "
                f"({f['loop_per_element']:.2f} + {f['segment_per_element']:.2f}) | {main} "
                f"| {issue:.2f} | {kb:.0f} / {needed_kb:.1f} ({flight:.2f}) |"
            )
            if gpu.name == GOAL_GPU and issue >= GOAL_ISSUE:
                met_issue.append(variant)
            if gpu.name == GOAL_GPU and flight >= GOAL_IN_FLIGHT:
                met_flight.append(variant)
    if any(g.name == GOAL_GPU and g.arch in archs for g in GPUS):
        lines += [
            "",
            f"On the {GOAL_GPU}: an issue bound at least {GOAL_ISSUE}x the bandwidth in "
            f"{len(met_issue)} of {len(variants)} kernels ({'; '.join(met_issue) or 'none'}); at "
            f"least {GOAL_IN_FLIGHT:g}x the latency-bandwidth product in flight per SM in "
            f"{len(met_flight)} of {len(variants)} ({'; '.join(met_flight) or 'none'}).",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["80", "90", "100"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--check", type=Path, help="exit 1 unless FILE holds this table")
    args = parser.parse_args()
    results = measure(args.archs)
    text = markdown(results, args.archs)
    print(text, end="")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text(text)
        payload = {
            "gpus": [g._asdict() for g in GPUS],
            "latency_ns": LATENCY_NS,
            "kernels": results,
        }
        (args.out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    if args.check:
        page = args.check.read_text()
        stated = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), page, re.S)
        if stated is None or stated.group(1) != text:
            print(
                f"{args.check} does not hold this table between {BEGIN} and {END}: "
                "regenerate it with python benchmarks/cuda_roofline.py",
                file=sys.stderr,
            )
            raise SystemExit(1)


if __name__ == "__main__":
    main()
