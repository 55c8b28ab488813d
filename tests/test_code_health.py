"""Units small enough to hold in one's head: no function over 60 lines and no class
over 250 lines in dcir/, dcir_lowering/ and runtime/, with no exceptions. And seams that
hold: no module edits ``sys.path`` to find another (the packages are installed, the tests'
helpers are on pytest's ``pythonpath``, a script's own folder is its ``sys.path[0]``), and
the Engine's parts that take it as an argument reach it through its public names only."""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dcir", "dcir_lowering", "runtime")
MAX_FUNCTION, MAX_CLASS = 60, 250
#: modules handed the Engine (``engine``) that must use its public interface, not its private attributes
ENGINE_CLIENTS = ("runtime/checkpoint.py", "runtime/programs.py")
#: what changes a list in place, ``sys.path`` included
LIST_EDITS = {"insert", "append", "extend", "remove", "pop", "clear"}
#: the one home of the flat shard layout's rule (``ShardLayout``), and the names a world size goes by
LAYOUT_HOME, WORLD_NAMES = "dcir/layout.py", {"world", "world_size", "parts"}


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


def _tree_sources():
    """(path relative to the root, source) of every .py file of the tree, outside .git and installed packages."""
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(d for d in subfolders if d not in (".git", "site-packages", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(folder) / name
            yield str(path.relative_to(ROOT)), path.read_text()


def _is_sys_path(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _sys_path_edits(source: str) -> list[int]:
    """Lines of ``source`` that change ``sys.path``: a list method on it (``insert``, ``append``...),
    or an assignment to it or to an item of it."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in LIST_EDITS and _is_sys_path(node.value):
            lines.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AugAssign):
            targets = [node.target]
        if any(_is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)) for t in targets):
            lines.append(node.lineno)
    return sorted(lines)


def _private_engine_reads(source: str) -> list[str]:
    """``line: engine._name`` for every private attribute of an ``engine`` (a name, or an
    attribute ``.engine``) that ``source`` reads or writes, directly or by ``getattr``/``setattr``."""
    def is_engine(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "engine") or (
            isinstance(node, ast.Attribute) and node.attr == "engine")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and is_engine(node.value):
            found.append((node.lineno, f"engine.{node.attr}"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
                and len(node.args) >= 2 and is_engine(node.args[0]) and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("_")):
            found.append((node.lineno, f"{node.func.id}(engine, {node.args[1].value!r})"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_no_module_edits_sys_path():
    edits = {path: lines for path, source in _tree_sources() if (lines := _sys_path_edits(source))}
    assert not edits, ("sys.path edited (import the installed packages; tests' helpers are on pytest's "
                       "pythonpath; a script's own folder is its sys.path[0]):\n"
                       + "\n".join(f"{path}: lines {lines}" for path, lines in edits.items()))


def test_the_engine_s_parts_use_its_public_interface():
    reads = {path: found for path in ENGINE_CLIENTS if (found := _private_engine_reads((ROOT / path).read_text()))}
    assert not reads, "give the Engine a public name for these:\n" + "\n".join(
        f"{p}:{r}" for p, found in reads.items() for r in found)


def test_the_seam_scans_see_each_form():
    edits = ("import sys\n" + "".join(f"sys.path.{method}(0, 'x')\n" for method in ("insert", "append"))
             + "sys.path += ['z']\nsys.path[0] = 'w'\nsys.path = []\nprint(sys.path[0], 'sys.path.append')\n")
    assert _sys_path_edits(edits) == [2, 3, 4, 5, 6]
    reads = ("engine._optim.state_keys(engine.device)\nengine._flag = True\nself.engine._lowered(m)\n"
             "getattr(engine, '_x')\nengine.lower(m)\ngetattr(engine, attr)\n")
    assert _private_engine_reads(reads) == ["1: engine._optim", "2: engine._flag", "3: engine._lowered",
                                            "4: getattr(engine, '_x')"]


def _is_world(node) -> bool:
    return ((isinstance(node, ast.Name) and node.id in WORLD_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in WORLD_NAMES))


def _world_ceil_divisions(source: str) -> list[int]:
    """Lines of ``source`` that divide by a world size rounding up, the shard layout's
    ``chunk``: ``-(-n // world)``, ``(n + world - 1) // world``, ``math.ceil(n / world)``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and _is_world(node.right) and (
                isinstance(node.left, ast.UnaryOp) or any(map(_is_world, ast.walk(node.left)))):
            lines.append(node.lineno)
        name = getattr(node.func, "attr", getattr(node.func, "id", "")) if isinstance(node, ast.Call) else ""
        if name == "ceil" and node.args and isinstance(node.args[0], ast.BinOp) and _is_world(node.args[0].right):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_shard_layout_is_computed_in_one_place():
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel != LAYOUT_HOME and (lines := _world_ceil_divisions(path.read_text())):
                found[rel] = lines
    assert not found, ("a shard's size computed again (use dcir.layout.ShardLayout):\n"
                       + "\n".join(f"{path}: lines {lines}" for path, lines in found.items()))
    assert _world_ceil_divisions((ROOT / LAYOUT_HOME).read_text()), "the scan no longer sees the rule's own home"


def test_the_layout_scan_sees_each_form():
    source = ("a = -(-n // world)\nb = (n + g.world - 1) // g.world\nc = math.ceil(n / self.parts)\n"
              "d = ceil(n / world_size)\ne = n // world\nf = total / world\ng = -(-n // 64)\n")
    assert _world_ceil_divisions(source) == [1, 2, 3, 4]
