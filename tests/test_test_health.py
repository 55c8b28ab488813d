"""Every test can fail: a scan of every ``test_*`` function in ``tests/*.py`` (with
``ast``) that fails on a test that checks nothing, so the kind does not come back.

A test checks something when its body (nested functions included) asserts, raises,
calls ``pytest.raises``/``pytest.warns``/``pytest.fail``, calls a function named
``assert*`` (``torch.testing.assert_close``), or calls a helper of ``tests/`` that
does (found through every module of ``tests/``, helpers calling helpers included:
a helper of the same file, one imported from a module of ``tests/``, or one reached
as ``module.helper``). An ``assert`` whose condition is a literal that is always true
(``assert True``, ``assert 1``, ``assert (x == y, "message")``: a non-empty tuple)
checks nothing either. What the scan cannot see (an ``assert n >= 0`` on a count, a
test that recomputes what it checks) is left to review.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

#: calls that check on their own (``pytest.X``)
_PYTEST_CHECKS = {"raises", "warns", "fail", "deprecated_call"}


def _call_target(call: ast.Call) -> tuple[str | None, str]:
    """(the name it is reached through, the attribute called) of ``call``: ``f()`` is
    (None, "f"), ``m.f()`` is ("m", "f"), anything else (None, "")."""
    f = call.func
    if isinstance(f, ast.Name):
        return None, f.id
    if isinstance(f, ast.Attribute):
        return (f.value.id if isinstance(f.value, ast.Name) else None), f.attr
    return None, ""


def _checks_directly(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, (ast.Assert, ast.Raise)):
            return True
        if not isinstance(n, ast.Call):
            continue
        owner, name = _call_target(n)
        if name.startswith("assert") or (owner == "pytest" and name in _PYTEST_CHECKS):
            return True
    return False


class _Module:
    """What the scan needs of one source file: its functions (top level and nested, by
    name) and where the names it imports come from."""

    def __init__(self, name: str, source: str):
        self.name = name
        self.tree = ast.parse(source)
        self.functions: dict[str, ast.FunctionDef] = {}
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (module, its name there)
        self.modules: dict[str, str] = {}                # local name -> module imported whole
        for n in ast.walk(self.tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(n.name, n)
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                for a in n.names:
                    self.imported[a.asname or a.name] = (n.module, a.name)
            elif isinstance(n, ast.Import):
                for a in n.names:
                    self.modules[a.asname or a.name] = a.name

    def callees(self, fn: ast.AST) -> set[tuple[str, str]]:
        """(module, function) of every call in ``fn`` that may reach a helper of ``tests/``."""
        out = set()
        for n in ast.walk(fn):
            if not isinstance(n, ast.Call):
                continue
            owner, name = _call_target(n)
            if owner is None and name in self.imported:
                out.add(self.imported[name])
            elif owner is None:
                out.add((self.name, name))
            elif owner in self.modules:
                out.add((self.modules[owner], name))
        return out


def checking_helpers(modules: dict[str, _Module]) -> set[tuple[str, str]]:
    """(module, function) of every function of ``modules`` that checks, directly or
    through helpers of ``modules`` it calls (a fixed point over the call graph)."""
    found = {(m.name, f) for m in modules.values() for f, fn in m.functions.items() if _checks_directly(fn)}
    grew = True
    while grew:
        grew = False
        for m in modules.values():
            for f, fn in m.functions.items():
                if (m.name, f) not in found and m.callees(fn) & found:
                    found.add((m.name, f))
                    grew = True
    return found


def _always_true(test: ast.expr) -> bool:
    """Whether ``test`` is a literal that is true whatever runs: a true constant, or a
    display with an element that is there whatever (``(x, "message")``, ``f"x={x}"``)."""
    if isinstance(test, ast.Constant):
        return bool(test.value)
    if isinstance(test, (ast.Tuple, ast.List, ast.Set)):
        return any(not isinstance(e, ast.Starred) for e in test.elts)
    if isinstance(test, ast.Dict):
        return any(k is not None for k in test.keys)
    if isinstance(test, ast.JoinedStr):
        return any(isinstance(v, ast.Constant) and v.value for v in test.values)
    return False


def problems(sources: dict[str, str]) -> list[str]:
    """``file:line: why`` for every ``test_*`` function of ``sources`` (module name ->
    source; helpers are looked for in all of them) that cannot fail."""
    modules = {name: _Module(name, src) for name, src in sources.items()}
    checking = checking_helpers(modules)
    out = []
    for m in modules.values():
        for n in ast.walk(m.tree):
            if isinstance(n, ast.Assert) and _always_true(n.test):
                out.append(f"{m.name}.py:{n.lineno}: an assert that is always true: {ast.unparse(n.test)[:60]}")
        if not m.name.startswith("test_"):
            continue
        for node in m.tree.body:
            tests = node.body if isinstance(node, ast.ClassDef) else [node]
            for fn in tests:
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.name.startswith("test"):
                    continue
                if not _checks_directly(fn) and not m.callees(fn) & checking:
                    out.append(f"{m.name}.py:{fn.lineno}: {fn.name} asserts nothing and calls no helper that does")
    return sorted(out)


def test_every_test_can_fail():
    sources = {p.stem: p.read_text() for p in sorted(TESTS.glob("*.py"))}
    found = problems(sources)
    assert not found, "tests that cannot fail (give each a check that can):\n" + "\n".join(found)


_HELPERS = '''
def expect_ok(x):
    assert x.ok, x

def expect_through(x):
    expect_ok(x)

def just_print(x):
    print(x)
'''


def test_the_scan_flags_what_checks_nothing():
    test_source = '''
import pytest
import helpers
from helpers import expect_through, just_print

def test_nothing():
    run()

def test_prints():
    just_print(run())

def test_always_true():
    assert True

def test_a_tuple():
    assert (run() == 1, "the tuple is never empty")

def test_a_message_only():
    assert "x is 1"

def test_an_f_string():
    assert f"x is {run()}"

def test_what_may_be_empty():
    assert [*run()]
    assert {**run()}
    assert f"{run()}"

class TestGrouped:
    def test_inside_a_class(self):
        run()

def test_asserts():
    assert run() == 1

def test_raises():
    with pytest.raises(ValueError):
        run()

def test_a_helper_two_calls_away():
    expect_through(run())

def test_a_helper_by_its_module():
    helpers.expect_ok(run())

def test_a_local_helper():
    _local(run())

def _local(x):
    if not x:
        raise AssertionError(x)

def test_assert_close():
    torch.testing.assert_close(run(), 1)

def test_a_nested_check():
    def check(x):
        assert x
    check(run())
'''
    found = problems({"helpers": _HELPERS, "test_synthetic": test_source})
    lines = test_source.split("\n")
    flagged = {(lines[int(f.split(":")[1]) - 1].strip(), "always true" in f) for f in found}
    assert flagged == {("def test_nothing():", False), ("def test_prints():", False),
                       ("def test_inside_a_class(self):", False), ("assert True", True), ('assert f"x is {run()}"', True),
                       ('assert (run() == 1, "the tuple is never empty")', True), ('assert "x is 1"', True)}, found
