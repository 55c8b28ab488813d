"""The parser's fast path (op lines parsed once per shape) must never change what a
text means; these are the cases where it has to step aside."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import dcir
from dcir.cli import SPLIT_MARKER
from dcir.ir import UNIT, SymbolRef, structure

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.dcir"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_canonical(path: Path):
    text = path.read_text()
    module = dcir.parse(text, str(path))
    dcir.verify(module)
    assert dcir.print(module) == text
    assert dcir.parse(text, fast=False) == module


def _one_op(body: str, **kw):
    m = dcir.parse("module @m {\n  func @f(%x: f32[4]) {\n" + body + "\n    return\n  }\n}\n", **kw)
    return m.functions["f"].ops


def test_comment_with_value_names_is_ignored():
    ops = _one_op("    %y = aten.relu.default(%x) : f32[4]  // not %z or %w")
    assert [v.name for v in ops[0].operands] == ["x"]


def test_string_attribute_with_value_like_text():
    ops = _one_op('    %y = aten.relu.default(%x) {prof.note = "%x // {"} : f32[4]')
    assert ops[0].attrs["prof.note"] == "%x // {"
    assert [v.name for v in ops[0].operands] == ["x"]


def test_op_over_several_lines():
    ops = _one_op("    %y = aten.sum.dim_IntList(%x) {\n      dim = [0],\n      prof.flag\n    } : f32[]")
    assert ops[0].attrs == {"dim": (0,), "prof.flag": UNIT}


def test_two_ops_on_one_line():
    ops = _one_op("    %a = aten.relu.default(%x) : f32[4] %b = aten.neg.default(%a) : f32[4]")
    assert [o.name for o in ops] == ["aten.relu.default", "aten.neg.default"]


def test_parens_are_kept_apart_from_no_operands():
    ops = _one_op("    comm.fence\n    comm.fence()")
    assert [o.parens for o in ops] == [False, True]
    text = dcir.print(dcir.parse("module @m {\n  func @f() {\n    a.b\n    a.b()\n    return\n  }\n}\n"))
    assert "    a.b\n    a.b()\n" in text


def test_op_after_return_is_an_error_on_both_paths():
    text = "module @m {\n  func @f(%x: f32[4]) {\n    return\n    %y = aten.relu.default(%x) : f32[4]\n  }\n}\n"
    for fast in (True, False):
        with pytest.raises(dcir.DcirError, match="'return' must be the last op of its function"):
            dcir.parse(text, fast=fast)


def test_quoted_symbols_and_keys():
    text = 'module @"my model" {\n  param @"layers.0 weight" : f32[2] {"odd key" = @"a b"}\n}\n'
    m = dcir.parse(text)
    assert m.name == "my model"
    assert m.decls["layers.0 weight"].attrs == {"odd key": SymbolRef("a b")}
    assert dcir.print(m) == text


def test_floats_round_trip_exactly():
    for v in ["1e-05", "0.1", "-inf", "inf", "nan", "1.0", "3.4028234663852886e+38", "5e-324"]:
        text = f"module @m attributes {{prof.v = {v}}} {{\n}}\n"
        assert dcir.print(dcir.parse(text)) == text


def test_int_float_bool_are_distinct():
    m = dcir.parse("module @m attributes {a = 1, b = 1.0, c = true} {\n}\n")
    assert [type(v) for v in m.attrs.values()] == [int, float, bool]
    other = dcir.parse("module @m attributes {a = 1.0, b = 1, c = 1} {\n}\n")
    assert m != other


def test_line_offset_shifts_locations():
    with pytest.raises(dcir.DcirError) as e:
        dcir.parse("module @m {\n  param @w f32[4]\n}\n", "f.dcir", line_offset=10)
    assert "f.dcir:12:" in str(e.value)


@pytest.mark.parametrize("body", [
    "    %a = aten.relu.default(%x)\n    // a comment inside the op\n        : f32[4]",
    "    mem.free(%x,\n      %y)\n    %a = aten.relu.default(%z)\n        : f32[4]",
    '    mem.free(%x,\n      %y)\n    mem.free(%z)\n      {note.which = "z"}',
    "    %a = aten.relu.default(%x) : f32[4]\n    %b,\n      %c = aten.split.Tensor(%a) {split_size = 2} : f32[2], f32[2]",
])
def test_fast_path_steps_aside_for_ops_over_several_lines(body):
    text = "module @m {\n  func @f(%x: f32[4], %y: f32[4], %z: f32[4]) {\n" + body + "\n    return\n  }\n}\n"
    assert dcir.parse(text) == dcir.parse(text, fast=False)


def test_end_of_file_inside_a_function_is_reported_at_the_end():
    text = "module @m {\n  func @f(%x: f32[4]) {\n    %a = aten.relu.default(%x) : f32[4]\n"
    with pytest.raises(dcir.DcirError, match=r"<string>:3:40: error: unexpected end of file"):
        dcir.parse(text)


# ---- the fast path against the full grammar, on every text we ship ------------------

GOLDENS = sorted((ROOT / "tests" / "golden").rglob("*.dcir"))
_MODULE = re.compile(r"^module .*?^}$", re.M | re.S)
# (a snapshot of rendered diagnostics holds no module: its input is a golden file)
SNAPSHOTS = sorted(p for p in (ROOT / "tests" / "snapshots").glob("*") if _MODULE.search(p.read_text()))


def _texts(path: Path) -> list[tuple[str, int]]:
    """The chunks of a golden file (with the line each starts after), or the modules
    a snapshot holds: what dcir-opt reads and what it prints."""
    text = path.read_text()
    if path.suffix == ".dcir":
        out, offset = [], 0
        for chunk in SPLIT_MARKER.split(text):
            out.append((chunk, offset))
            offset += chunk.count("\n")
        return out
    return [(m.group() + "\n", 0) for m in _MODULE.finditer(text)]


def _outcome(text: str, offset: int, fast: bool):
    try:
        return "module", structure(dcir.parse(text, "f.dcir", fast=fast, line_offset=offset))
    except dcir.DcirError as e:
        return "error", [(d.loc, d.length, d.message) for d in e.diagnostics]


@pytest.mark.parametrize("path", GOLDENS + SNAPSHOTS, ids=[str(p.relative_to(ROOT)) for p in GOLDENS + SNAPSHOTS])
def test_fast_path_and_full_grammar_agree(path: Path):
    """Same module (structurally), or the same errors at the same places."""
    texts = _texts(path)
    assert texts, f"{path} holds no module"
    for text, offset in texts:
        assert _outcome(text, offset, True) == _outcome(text, offset, False), f"chunk at line {offset + 1}"
