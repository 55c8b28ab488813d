"""The rewriter keeps the IR consistent, and it is the only way passes change the IR.

* ``Rewriter`` operations keep use-lists, owners and indices consistent, and
  ``rollback`` restores a function exactly;
* a scan of the passes' and models' source fails if any of them writes ``func.ops``,
  ``op.operands``, owner or index fields, or mutates an IR list directly;
* ``Module.clone`` is a deep copy equal to the original.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dcir
from dcir.ir import Op, Value
from dcir.rewrite import Rewriter

ROOT = Path(__file__).resolve().parent.parent
SCANNED = sorted([*ROOT.glob("dcir/passes/*.py"), *(ROOT / "dcir" / n for n in
                                                      ("schedule.py", "memory.py", "cost.py", "analysis.py"))])

#: IR fields that only dcir.ir and dcir.rewrite may write
IR_FIELDS = {"ops", "operands", "_operands", "results", "returns", "_returns", "result_types", "args", "owner",
             "index", "uses"}
LIST_MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse", "__setitem__",
                 "__delitem__"}


def ir_writes(source: str) -> list[tuple[int, str]]:
    """(line, what) for every direct write to an IR field in ``source``."""
    found = []

    def field_of(node) -> str | None:
        if isinstance(node, ast.Subscript):
            node = node.value
        return node.attr if isinstance(node, ast.Attribute) and node.attr in IR_FIELDS else None

    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for leaf in ast.walk(t):
                name = field_of(leaf) if isinstance(leaf, (ast.Attribute, ast.Subscript)) else None
                if name is not None and (leaf is t or isinstance(t, (ast.Tuple, ast.List))):
                    found.append((node.lineno, f"writes .{name}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = field_of(node.func.value)
            if name is not None and node.func.attr in LIST_MUTATORS:
                found.append((node.lineno, f"calls .{name}.{node.func.attr}()"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in IR_FIELDS:
            found.append((node.lineno, f"setattr(..., {node.args[1].value!r})"))
    return sorted(found)


@pytest.mark.parametrize("path", SCANNED, ids=[str(p.relative_to(ROOT)) for p in SCANNED])
def test_passes_and_models_change_the_ir_only_through_the_rewriter(path):
    writes = ir_writes(path.read_text())
    assert not writes, f"{path.relative_to(ROOT)} changes the IR by hand (use dcir.rewrite.Rewriter): {writes}"


@pytest.mark.parametrize("snippet", [
    "func.ops = [op for op in func.ops if keep(op)]",
    "op.operands = [new]",
    "op.operands[0] = new",
    "func.ops[i:i] = ops",
    "del func.ops[3]",
    "func.ops.insert(0, op)",
    "bw.args.append(v)",
    "wait.results.pop(k)",
    "v.owner, v.index = f, 0",
    "step.returns.extend(values)",
    "fw.result_types += [t]",
    "setattr(op, 'operands', ())",
])
def test_the_scan_catches_each_kind_of_hand_edit(snippet):
    assert ir_writes(snippet), snippet


def test_the_scan_leaves_reads_and_other_fields_alone():
    assert not ir_writes("ops = list(func.ops)\nx = op.operands[0]\nself.during[j] += 1\nd.attrs['k'] = 1\n"
                         "module.functions['step'] = f\nstats[key] += 1\n")


TEXT = """module @m {
  func @f(%x: f32[4]) -> (f32[4]) {
    %a = aten.relu.default(%x) : f32[4]
    %b = aten.neg.default(%a) : f32[4]
    %c = aten.add.Tensor(%a, %b) : f32[4]
    return %c
  }
}
"""


def _consistent(func) -> None:
    """Every use-list, owner and index agrees with the ops, the returns and the arguments."""
    expected = {}
    for op in func.ops:
        for i, r in enumerate(op.results):
            assert r.owner is op and r.index == i
        for i, v in enumerate(op.operands):
            expected.setdefault(v, []).append((op, i))
    for i, v in enumerate(func.returns):
        expected.setdefault(v, []).append((func, i))
    for i, a in enumerate(func.args):
        assert a.owner is func and a.index == i
    for v in func.values():
        assert sorted((id(u), i) for u, i in v.uses) == sorted((id(u), i) for u, i in expected.get(v, []))


def test_uses_are_kept_by_construction_and_rollback_restores_the_function():
    module = dcir.parse(TEXT)
    func = module.functions["f"]
    before = str(module)
    x, (relu, neg, add) = func.args[0], func.ops
    assert [(u.name, i) for u, i in relu.results[0].uses] == [("aten.neg.default", 0), ("aten.add.Tensor", 0)]
    rw = Rewriter(func)
    mark = rw.checkpoint()
    sig = Op("aten.sigmoid.default", [x], [Value("s", x.type)])
    rw.insert_before(neg, [sig])
    rw.replace_all_uses(relu.results[0], sig.results[0])
    rw.erase(relu)
    rw.move_before(add, neg)  # invalid order, but moving is allowed: the verifier judges it
    arg = Value("y", x.type)
    rw.insert_arg(arg)
    rw.set_returns([arg])
    _consistent(func)
    assert relu.results[0].uses == [] and not any(u is relu for u, _ in x.uses)
    rw.rollback(mark)
    _consistent(func)
    assert str(module) == before


def test_insert_after_each_places_in_one_sweep_and_rolls_back():
    module = dcir.parse(TEXT)
    func = module.functions["f"]
    before = str(module)
    x, (relu, neg, add) = func.args[0], func.ops
    rw = Rewriter(func)
    mark = rw.checkpoint()
    free = Op("mem.free", [relu.results[0]], parens=True)
    sig = Op("aten.sigmoid.default", [x], [Value("s", x.type)])
    rw.insert_after_each({add: [free], relu: [sig]})
    assert func.ops == [relu, sig, neg, add, free]
    _consistent(func)
    rw.rollback(mark)
    _consistent(func)
    assert str(module) == before


def test_erase_refuses_an_op_whose_results_are_used():
    func = dcir.parse(TEXT).functions["f"]
    with pytest.raises(ValueError, match="still used"):
        Rewriter(func).erase(func.ops[0])


def test_an_op_takes_only_fresh_results():
    func = dcir.parse(TEXT).functions["f"]
    with pytest.raises(ValueError, match="a value has one definition"):
        Op("aten.neg.default", [func.args[0]], [func.ops[0].results[0]])


def test_module_clone_is_a_deep_copy():
    module = dcir.parse((ROOT / "tests/golden/passes/zero3.dcir").read_text().split("// -----")[0])
    copy = module.clone()
    assert copy == module and str(copy) == str(module)
    assert not {id(op) for _, op in copy.ops()} & {id(op) for _, op in module.ops()}
    dcir.run_passes(copy, "zero3")
    assert copy != module and str(module) == str(module.clone())


#: Units the rewriter work keeps small (issue 18): functions at most 60 lines, classes at most 250
SIZED = sorted([*ROOT.glob("dcir/passes/*.py"), *(ROOT / "dcir" / n for n in
                                                    ("ir.py", "rewrite.py", "ops.py", "analysis.py", "schedule.py",
                                                     "memory.py", "cost.py", "roles.py"))])


@pytest.mark.parametrize("path", SIZED, ids=[str(p.relative_to(ROOT)) for p in SIZED])
def test_functions_and_classes_stay_small(path):
    big = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(path.read_text()))
           if (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60)
           or (isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > 250)]
    assert not big, f"{path.relative_to(ROOT)}: over 60 lines (function) or 250 (class): {big}"


def test_the_writing_a_pass_guide_shows_the_code_in_the_tree():
    """Each Python block of docs/writing-a-pass.md is verbatim in dce.py, zero3.py or
    free.py, but the worked example, which runs and prints what the guide says it prints."""
    import contextlib
    import io
    import re
    guide = (ROOT / "docs" / "writing-a-pass.md").read_text()
    sources = [(ROOT / "dcir" / "passes" / n).read_text() for n in ("dce.py", "zero3.py", "free.py")]
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) >= 6
    for block in blocks:
        if not block.startswith("import "):
            assert any(block in src for src in sources), block[:200]
    example, printed = re.search(r"```python\n(import .*?)```\n\nprints\n\n```\n(.*?)```", guide, re.S).groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(example, {})
    assert out.getvalue() == printed
