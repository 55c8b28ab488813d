"""Declarative rewrite rules and the driver that applies them.

A rule is data: a pattern over ops, named constraints, and a rewrite. Patterns are
written like the IR they match::

    Rule(P("aten.t.default", P("aten.t.default", X("x"))),   # t(t(x)) -> x
         rewrite=lambda m: m["x"])

``P(name, *operands, bind=...)`` matches an op by name (or by trait with
``trait=``) whose operands match the sub-patterns; ``X(name)`` matches any value and
binds it. Constraints are named predicates over the bindings (the root op is bound as
``"root"``, its function as ``"func"``); a rewrite returns the value that replaces the root's single result, a
new ``Op`` to insert in the root's place, or None to leave it. A rule records the
file and line that defined it, so ``--pass-statistics`` can say which rule fired.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from dcir import ops as registry
from dcir.analysis import RETURN, uses
from dcir.ir import Function, Module, Op, Value


@dataclass(frozen=True)
class X:
    """Any value, bound under ``name``."""

    name: str


@dataclass(frozen=True)
class P:
    """An op named ``name`` (or having ``trait``) whose operands match ``operands``."""

    name: str | None
    operands: tuple = ()
    bind: str | None = None
    trait: str | None = None

    def __init__(self, name=None, *operands, bind=None, trait=None):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "operands", operands)
        object.__setattr__(self, "bind", bind)
        object.__setattr__(self, "trait", trait)


@dataclass(frozen=True)
class Constraint:
    """A named predicate over a match's bindings."""

    name: str
    test: Callable[[dict], bool]


@dataclass(frozen=True)
class Rule:
    pattern: P
    rewrite: Callable[[dict], Value | Op | None]
    constraints: tuple[Constraint, ...] = ()
    name: str = ""
    where: str = field(default="", compare=False)

    def __post_init__(self):
        caller = sys._getframe(1)
        while caller.f_code.co_filename == __file__ or caller.f_code.co_name == "__init__":
            caller = caller.f_back
        object.__setattr__(self, "where", f"{caller.f_code.co_filename}:{caller.f_lineno}")
        if not self.name:
            object.__setattr__(self, "name", self.where.rsplit("/", 1)[-1])


def _match(pat, value: Value, m: dict) -> bool:
    if isinstance(pat, X):
        bound = m.get(pat.name)
        if bound is not None and bound is not value:
            return False
        m[pat.name] = value
        return True
    op = value.owner
    if not isinstance(op, Op) or not _match_op(pat, op, m):
        return False
    return True


def _match_op(pat: P, op: Op, m: dict) -> bool:
    if pat.name is not None and op.name != pat.name:
        return False
    if pat.trait is not None and not registry.has_trait(op, pat.trait):
        return False
    if pat.operands and len(pat.operands) != len(op.operands):
        return False
    if pat.bind:
        m[pat.bind] = op
    return all(_match(p, v, m) for p, v in zip(pat.operands, op.operands))


class _Replacer:
    """Keeps use lists current while values are replaced."""

    def __init__(self, func: Function):
        self.func = func
        self.uses = uses(func)

    def replace(self, old: Value, new: Value) -> None:
        for user, i in self.uses.pop(old, ()):
            if user is RETURN:
                self.func.returns[i] = new
            else:
                user.operands[i] = new
            self.uses.setdefault(new, []).append((user, i))


def apply_rules(module: Module, rules: list[Rule], stats: Counter | None = None, max_iterations: int = 10) -> bool:
    """Apply ``rules`` until nothing matches (or ``max_iterations`` sweeps). True if anything changed."""
    by_root: dict[str | None, list[Rule]] = {}
    for r in rules:
        by_root.setdefault(r.pattern.name, []).append(r)
    changed = False
    for func in module.functions.values():
        for _ in range(max_iterations):
            if not _sweep(func, by_root, stats):
                break
            changed = True
    return changed


def _sweep(func: Function, by_root: dict, stats: Counter | None) -> bool:
    rep = _Replacer(func)
    new_ops: list[Op] = []
    changed = False
    for op in func.ops:
        candidates = by_root.get(op.name, []) + by_root.get(None, [])
        if op.results and not any(rep.uses.get(r) for r in op.results):
            candidates = []  # dead already: rewriting it would change nothing
        for rule in candidates:
            m: dict = {"root": op, "func": func}
            if not _match_op(rule.pattern, op, m) or not all(c.test(m) for c in rule.constraints):
                continue
            out = rule.rewrite(m)
            if out is None:
                continue
            if isinstance(out, Op):
                new_ops.append(out)
                for a, b in zip(op.results, out.results):
                    rep.replace(a, b)
                for i, v in enumerate(out.operands):
                    rep.uses.setdefault(v, []).append((out, i))
            else:
                rep.replace(op.results[0], out)
            if stats is not None:
                stats[rule.name] += 1
            changed = True
            break
        new_ops.append(op)
    func.ops = new_ops
    return changed
