"""One name everywhere: a pass's CLI id, its class's ``name``, its file and its golden
test agree; every op the registry declares is documented and its example is valid."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from dcir import ops as registry
from dcir.passes import registry as passes

ROOT = Path(__file__).resolve().parent.parent


def test_pass_name_file_and_golden_agree():
    files = {p.stem for p in (ROOT / "dcir" / "passes").glob("*.py") if p.stem != "__init__"}
    goldens = {p.stem for p in (ROOT / "tests" / "golden" / "passes").glob("*.dcir")}
    names = set(passes())
    assert names == files == goldens
    for name, cls in passes().items():
        assert cls.__module__ == f"dcir.passes.{name}"


@pytest.mark.parametrize("name", sorted(passes()))
def test_pass_docstring_shows_before_and_after(name):
    doc = sys.modules[passes()[name].__module__].__doc__
    assert doc and "->" in doc, f"dcir/passes/{name}.py needs a docstring with a before -> after example"


@pytest.mark.parametrize("name", sorted(registry.OPS))
def test_op_example_parses(name):
    d = registry.OPS[name]
    assert d.summary and d.example, f"{name} needs a summary and an example"
    from dcir.parser import _lark
    _lark().parse(d.example, start="op")
    assert d.example.split("=")[-1].strip().startswith(name) or f" {name}" in d.example or d.example.startswith(name)


def test_language_reference_covers_every_op():
    doc = (ROOT / "docs" / "language.md").read_text()
    for name in registry.OPS:
        assert f"`{name}`" in doc or name in doc, f"docs/language.md does not describe {name}"
    for trait in ("pure", "compute", "async", "waits", "collective", "reduces", "gradient", "frees", "allocates",
                  "side_effect", "reads_state", "writes_state", "schema"):
        assert trait in doc, f"docs/language.md does not describe the trait {trait}"


# ---- every diagnostic has a golden test -------------------------------------------------

_REPORTERS = {"error", "op_error", "operand_error", "result_error", "return_error", "TypeRuleError", "MappingError",
              "_SemanticError", "Diagnostic", "_fail", "_error", "RankFailure"}
_SOURCES = [*(str(p.relative_to(ROOT)) for p in sorted((ROOT / "dcir" / "verifier").glob("*.py"))),
            "dcir/ops.py", "dcir/aten.py", "dcir/parser.py", "dcir/passes/__init__.py",
            "dcir_lowering/frontend.py", "dcir_lowering/backend.py", "dcir_lowering/dynamo.py", "runtime/config.py",
            "runtime/engine.py", "runtime/group.py", "runtime/shards.py", "runtime/plan.py", "runtime/execution.py",
            "runtime/precision.py", "runtime/pretrained.py", "runtime/materialize.py", "runtime/checkpoint.py",
            "runtime/programs.py", "runtime/lightning.py", "dcir_lowering/regions.py", "runtime/regions.py"]


def _message_fragments() -> list[tuple[str, int, str]]:
    """The longest literal piece of every diagnostic message written in the sources."""
    out = []
    for rel in _SOURCES:
        tree = ast.parse((ROOT / rel).read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if fn not in _REPORTERS:
                continue
            for arg in node.args:
                pieces = _literal_pieces(arg)
                if pieces:
                    out.append((rel, node.lineno, max(pieces, key=len)))
                    break
    for rel in ["dcir/parser.py"]:
        src = (ROOT / rel).read_text()
        for m in re.finditer(r'^\s+"([^"]{12,})"\),$', src, re.M):
            out.append((rel, src[:m.start()].count("\n") + 1, m.group(1)))
    return out


def _literal_pieces(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value for v in node.values if isinstance(v, ast.Constant)]
    if isinstance(node, ast.BinOp):
        return _literal_pieces(node.left) + _literal_pieces(node.right)
    return []


def test_every_diagnostic_has_a_golden_test():
    goldens = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.dcir"))
    goldens += "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    missing = []
    for rel, line, piece in _message_fragments():
        probe = piece.strip(" ;:,.'\"").split("{")[0].strip()
        if len(probe) >= 6 and probe not in goldens:
            missing.append(f"{rel}:{line}: {piece!r}")
    assert not missing, "diagnostics without a golden test:\n" + "\n".join(missing)
