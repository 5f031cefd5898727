"""No module of fasthooks reads another object's private attributes or imports another module's
private names: readers go through the public reading API, so a recorder's insides can change."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fasthooks"
# Names with an underscore that are public API: the module inside a `torch.compile` wrapper,
# and a named tuple's own methods and fields.
PUBLIC_UNDERSCORED = {"_orig_mod", "_fields", "_field_defaults", "_replace", "_asdict", "_make"}
# torch's own, with no public way: the whole DeviceMesh a sub-mesh was sliced from.
TORCH_PRIVATE = {"_get_root_mesh"}


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_super(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(source: str) -> list[str]:
    """Each private read or import in `source` that is not its own object's."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            own = (isinstance(base, ast.Name) and base.id in ("self", "cls")) or _is_super(base)
            allowed = PUBLIC_UNDERSCORED | TORCH_PRIVATE
            if not own and _root(base) != "torch" and node.attr not in allowed:
                found.append(f"line {node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"line {node.lineno}: imports {alias.name}")
    return found


def test_the_check_finds_what_it_looks_for():
    source = "from .stats import _check\nx = act._seen\ny = self._ok\nz = torch._C.f\n"
    assert violations(source) == ["line 1: imports _check", "line 2: reads ._seen"]


def test_no_module_reads_private_names_of_another():
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if (hits := violations(path.read_text()))
    }
    assert found == {}
