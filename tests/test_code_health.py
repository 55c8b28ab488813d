"""Units small enough to hold in one's head: no function over 60 lines and no class
over 250 lines in dcir/, dcir_lowering/ and runtime/, with no exceptions. And seams that
hold: no module edits ``sys.path`` to find another (the packages are installed, the tests'
helpers are on pytest's ``pythonpath``, a script's own folder is its ``sys.path[0]``), and
the Engine's parts that take it as an argument reach it through its public names only. And
layers the imports keep: ``dcir`` <- ``dcir_lowering`` <- ``dcir_runtime`` (runtime/), with no
import of the project's own modules inside a function, the kind that exists only to dodge a cycle
(the facade ``dcir/__init__.py``, which reaches up lazily so ``dcir-opt`` never imports torch, is the
one exception)."""

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
#: the project's packages, lowest layer first: each may import only those before it (runtime/ is ``dcir_runtime``)
LAYERS = ("dcir", "dcir_lowering", "dcir_runtime")
LAYER_OF_FOLDER = dict(zip(PACKAGES, LAYERS))
#: the facade: ``dcir.compile_to_ir`` and friends reach up the layers lazily, the one documented exception
FACADE = "dcir/__init__.py"
#: ``path::function`` whose project imports still sit inside the function; shrink it, never grow it
IN_FUNCTION_ALLOWED: set[str] = set()


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


def _imported_packages(node) -> list[str]:
    """The top-level packages an ``import``/``from ... import`` names (a relative import: ``"."``)."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    return ["."] if node.level else [node.module.split(".")[0]]


def _project_imports(source: str):
    """(line, enclosing function's qualified name or "" outside functions, package) of every import of the
    project's packages in ``source``."""
    def walk(node, qualname: str, function: str):
        for child in ast.iter_child_nodes(node):
            inner, inner_function = qualname, function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{qualname}.{child.name}" if qualname else child.name
                inner_function = inner if not isinstance(child, ast.ClassDef) else function
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for package in _imported_packages(child):
                    if package in LAYERS or package == ".":
                        yield child.lineno, function, package
            yield from walk(child, inner, inner_function)
    yield from walk(ast.parse(source), "", "")


def _import_problems(rel: str, source: str) -> list[str]:
    """``path:line: why`` for each import in ``source`` (at ``rel``) inside a function, or against the layers."""
    if rel == FACADE:
        return []
    layer = LAYERS.index(LAYER_OF_FOLDER[rel.split("/")[0]])
    problems = []
    for line, function, package in _project_imports(source):
        if function and f"{rel}::{function}" not in IN_FUNCTION_ALLOWED:
            problems.append(f"{rel}:{line}: {package} imported inside {function}() (import at the top; "
                            "if that makes a cycle, move the shared piece down a layer)")
        if package in LAYERS and LAYERS.index(package) > layer:
            problems.append(f"{rel}:{line}: {LAYERS[layer]} imports {package}, a layer above it")
    return problems


def _tree_import_problems() -> list[str]:
    problems = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            problems += _import_problems(rel, path.read_text())
    return problems


def test_imports_keep_the_layers_and_stay_at_the_top():
    problems = _tree_import_problems()
    assert not problems, "imports that dodge a cycle or run against the layers:\n" + "\n".join(problems)


def test_the_allowed_in_function_imports_still_exist():
    found = {f"{path.relative_to(ROOT)}::{function}" for package in PACKAGES for path in (ROOT / package).rglob("*.py")
             for _, function, _ in _project_imports(path.read_text()) if function}
    assert not IN_FUNCTION_ALLOWED - found, f"gone, drop from IN_FUNCTION_ALLOWED: {IN_FUNCTION_ALLOWED - found}"


def _uncommented_lazy_imports(source: str) -> list[int]:
    """Lines of imports inside functions in ``source`` with no comment saying why they are
    lazy: on the import's own lines, on another line of its run of imports, or on the line
    just above the run."""
    lines = source.splitlines()
    imports = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            imports |= {(n.lineno, n.end_lineno) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    starts = {start: end for start, end in imports}
    ends = {end: start for start, end in imports}
    bad = []
    for start, end in sorted(imports):
        first, last = start, end
        while first - 1 in ends:
            first = ends[first - 1]
        while last + 1 in starts:
            last = starts[last + 1]
        if not any("#" in line for line in lines[first - 2:last]):
            bad.append(start)
    return bad


def test_every_lazy_import_says_why():
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            # the facade's __getattr__ says why once, above its four imports
            if str(path.relative_to(ROOT)) != FACADE and (lines := _uncommented_lazy_imports(path.read_text())):
                found[str(path.relative_to(ROOT))] = lines
    assert not found, ("imports inside functions with no comment saying why they are not at the top "
                       "(what importing costs, or the optional dependency):\n"
                       + "\n".join(f"{path}: lines {lines}" for path, lines in found.items()))


def test_the_lazy_import_scan_sees_a_missing_reason():
    source = ("import json\ndef f():\n    import torch\n    x = 1\n    # torch is slow to import\n"
              "    import torch\n    from torch import fx\n    import yaml  # optional\n")
    assert _uncommented_lazy_imports(source) == [3]


def test_the_import_scan_sees_each_form():
    source = ("import torch\nfrom dcir import ir\nclass A:\n    from dcir.ops import OPS\n"
              "    def f(self):\n        import dcir_runtime\n        from .x import y\n"
              "def g():\n    def h():\n        from dcir_lowering.backend import lower\n    import json\n")
    assert list(_project_imports(source)) == [(2, "", "dcir"), (4, "", "dcir"), (6, "A.f", "dcir_runtime"),
                                              (7, "A.f", "."), (10, "g.h", "dcir_lowering")]
    assert _import_problems("dcir/x.py", "from dcir_lowering import frontend\n") == [
        "dcir/x.py:1: dcir imports dcir_lowering, a layer above it"]
    assert _import_problems("runtime/x.py", "import dcir_lowering, dcir\n") == []
    assert _import_problems(FACADE, "def f():\n    from dcir_runtime import initialize\n") == []
