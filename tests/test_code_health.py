"""Units small enough to hold in one's head: no function over 60 lines and no class
over 250 lines in dcir/, dcir_lowering/ and runtime/, with no exceptions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dcir", "dcir_lowering", "runtime")
MAX_FUNCTION, MAX_CLASS = 60, 250


def _units(source: str):
    """(qualified name, kind, lines) of every function and class in ``source``."""
    def walk(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                yield name, kind, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")
            else:
                yield from walk(child, prefix)
    yield from walk(ast.parse(source), "")


def _oversized() -> dict[str, str]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name, kind, lines in _units(path.read_text()):
                limit = MAX_CLASS if kind == "class" else MAX_FUNCTION
                if lines > limit:
                    out[f"{path.relative_to(ROOT)}::{name}"] = f"{kind} of {lines} lines (limit {limit})"
    return out


def test_no_function_or_class_is_too_long():
    over = _oversized()
    assert not over, "split these:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(over.items()))


def test_the_scan_sees_nested_units():
    source = "class A:\n    def f(self):\n" + "        x = 1\n" * 70
    units = {name: lines for name, _, lines in _units(source)}
    assert units == {"A": 72, "A.f": 71}
