"""The verifier's shape: one checker per invariant, each with its golden file; checkers
ask traits, not op names; and verifying never changes the module verified."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import dcir
from dcir import ops as registry
from dcir.ir import structure

ROOT = Path(__file__).resolve().parent.parent
CHECKERS = sorted(p.stem for p in (ROOT / "dcir" / "verifier").glob("*.py")
                  if "class " in p.read_text() and "(Checker)" in p.read_text())
GOLDENS = ROOT / "tests" / "golden" / "verifier"

_BAD = """module @m attributes {world_size = 2} {
  param @w : shard<f32[8], 2> {trainable}
  func @backward(%x: f32[8] {grad = 0}) -> (f32[8] {state}) role backward {
    %w = param.get @w : shard<f32[8], 2>
    %p = comm.all_gather(%w) : pending<f32[8]>
    %y = aten.relu.default(%p) : f32[8]
    mem.free(%x)
    grad.set @w(%x)
    return %x
  }
}
"""


def _locations(m) -> list:
    return ([m.loc] + [d.loc for d in m.decls.values()]
            + [(f.loc, f.return_loc, [op.loc for op in f.ops]) for f in m.functions.values()])


@pytest.mark.parametrize("in_memory", [False, True], ids=["parsed", "in_memory"])
def test_verify_leaves_the_module_as_it_was(in_memory: bool):
    module = dcir.parse(_BAD, "bad.dcir")
    if in_memory:  # as a pass or capture builds it: no source, no locations
        module.source = None
        for f in module.functions.values():
            f.loc = f.return_loc = None
            for op in f.ops:
                op.loc = None
    before, where, source = structure(module), _locations(module), module.source
    with pytest.raises(dcir.DcirError) as e:
        dcir.verify(module, shapes=True)
    assert "only comm.wait can consume a pending value" in str(e.value)
    assert "<generated>" in str(e.value) if in_memory else "bad.dcir:6:" in str(e.value)
    assert structure(module) == before
    assert _locations(module) == where
    assert module.source is source


def test_every_checker_has_its_golden_file():
    goldens = sorted(p.stem for p in GOLDENS.glob("*.dcir"))
    assert CHECKERS == goldens, "one golden file per checker, named alike: dcir/verifier/X.py and golden/verifier/X.dcir"


def _messages(path: Path) -> list[str]:
    """The longest literal piece of each diagnostic a checker module reports."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if not node.func.attr.endswith("error") or not node.args:
            continue
        arg = next((a for a in node.args if isinstance(a, (ast.Constant, ast.JoinedStr, ast.BinOp))), None)
        pieces = [v.value for v in ast.walk(arg) if isinstance(v, ast.Constant) and isinstance(v.value, str)] if arg else []
        if pieces:
            out.append(max(pieces, key=len).strip(" ;:,.'\"").split("{")[0].strip())
    return [m for m in out if len(m) >= 6]


@pytest.mark.parametrize("checker", CHECKERS)
def test_each_checker_is_tested_by_its_own_golden_file(checker: str):
    golden = (GOLDENS / f"{checker}.dcir").read_text()
    messages = _messages(ROOT / "dcir" / "verifier" / f"{checker}.py")
    assert messages, f"{checker} reports nothing?"
    missing = [m for m in messages if m not in golden]
    assert not missing, f"tests/golden/verifier/{checker}.dcir has no case for: {missing}"


def _op_names() -> set[str]:
    return set(registry.OPS) | {n.rsplit(".", 1)[0] + "." for n in registry.OPS}


def test_checkers_ask_traits_not_op_names():
    """No comparison of an op's name with a literal op name: a new op with the right
    traits must be checked like the ones it resembles."""
    names = _op_names()
    offenders = []
    for path in sorted((ROOT / "dcir" / "verifier").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            literals = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
            literals += [e.value for c in node.comparators if isinstance(c, (ast.Tuple, ast.Set, ast.List))
                         for e in c.elts if isinstance(e, ast.Constant)]
            hits = [x for x in literals if isinstance(x, str) and (x in names or re.match(r"\w+\.\w+", x))]
            if hits:
                offenders.append(f"{path.name}:{node.lineno}: {hits}")
    assert not offenders, "compare traits, not op names:\n" + "\n".join(offenders)


def test_a_new_op_with_existing_traits_is_checked_like_its_kin(monkeypatch):
    """An op the verifier has never heard of by name, declared with all_gather's traits:
    its pending result must be waited, and its operand may not be freed while it runs."""
    from dataclasses import replace
    gather = replace(registry.OPS["comm.all_gather"], name="comm.gather_v2")
    monkeypatch.setitem(registry.OPS, gather.name, gather)
    text = _BAD.replace("comm.all_gather", "comm.gather_v2")
    with pytest.raises(dcir.DcirError, match="only comm.wait can consume a pending value"):
        dcir.verify(dcir.parse(text))
    good = """module @m attributes {world_size = 2} {
  param @w : shard<f32[8], 2>
  func @f() -> (f32[8]) {
    %w = param.get @w : shard<f32[8], 2>
    %p = comm.gather_v2(%w) : pending<f32[8]>
    mem.free(%w)
    %y = comm.wait(%p) : f32[8]
    return %y
  }
}
"""
    with pytest.raises(dcir.DcirError, match="is freed while comm.gather_v2 still reads it"):
        dcir.verify(dcir.parse(good))
    dcir.verify(dcir.parse(good.replace("    mem.free(%w)\n", "").replace("return %y", "mem.free(%w)\n    return %y")))
