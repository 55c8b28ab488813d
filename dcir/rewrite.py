"""The one way to change the IR: the ``Rewriter``, and declarative rules on top of it.

**The rewriter.** Every change to a function goes through a ``Rewriter``: insert ops
before or after another (or at a position), erase an op, move one, replace all uses
of a value, set an op's operands or the function's returns, add or remove an
argument. Values keep their use-lists (``Value.uses``) and their owner and index,
and the op list keeps its order, by construction. Every change is logged with its
inverse, so ``rollback(checkpoint())`` undoes a rejected candidate through the same
API (``bucket`` tries merges that way).

**Rules.** A rule is data: a pattern over ops, named constraints, and a rewrite.
Patterns are written like the IR they match::

    Rule(P("aten.t.default", P("aten.t.default", X("x"))),   # t(t(x)) -> x
         rewrite=lambda m: m["x"])

``P(name, *operands, bind=...)`` matches an op by name (or by trait with
``trait=``) whose operands match the sub-patterns; ``X(name)`` matches any value and
binds it. Constraints are named predicates over a ``Match``: the bindings by name
(``m["x"]``), and what every match has as attributes (the root op ``m.root``, its
function ``m.func``, the module ``m.module``, the rewriter ``m.rewriter``), plus what
``apply_rules``'s ``context`` computes per function, by name. A rewrite
returns the value that replaces the root's single result, a new ``Op`` to insert in the
root's place, ``EDITED`` when it changed the IR itself through ``m.rewriter`` (a
bigger rewrite, as a named function), or None to leave it. A rule records the file
and line that defined it, so ``--pass-statistics`` can say which rule fired.

Reordering for overlap is the other formalism: ``dcir.schedule``'s ``Move``/``Limit``,
which moves groups of ops through this rewriter too.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

from dcir import ops as registry
from dcir.ir import Function, Module, Op, Value

#: What a rule's rewrite returns when it made its change through ``m.rewriter``.
EDITED = object()


class Rewriter:
    """Changes one function's ops, keeping uses, owners, indices and order consistent.

    Positions are found by identity in ``func.ops`` (linear, like MLIR's op lists
    without ordering caches); a pass that needs many positions reads them once."""

    def __init__(self, func: Function):
        self.func = func
        self._undo: list[Callable[[], None]] = []

    # ---- transactions ----

    def checkpoint(self) -> int:
        """A mark to roll back to."""
        return len(self._undo)

    def rollback(self, mark: int) -> None:
        """Undo every change made since ``mark``, newest first."""
        while len(self._undo) > mark:
            self._undo.pop()()

    # ---- placing ops ----

    def position(self, op: Op) -> int:
        return self.func.ops.index(op)

    def insert_at(self, pos: int, ops: Iterable[Op]) -> None:
        """Insert ``ops`` (built with ``Op()``, which records their operand uses) to run
        before the op now at ``pos`` (``len(func.ops)``: at the end)."""
        ops = list(ops)
        self.func.ops[pos:pos] = ops
        self._undo.append(lambda: [self._detach(op) for op in reversed(ops)])

    def insert_before(self, anchor: Op | None, ops: Iterable[Op]) -> None:
        """Insert ``ops`` just before ``anchor`` (None: at the end)."""
        self.insert_at(len(self.func.ops) if anchor is None else self.position(anchor), ops)

    def insert_after(self, anchor: Op, ops: Iterable[Op]) -> None:
        self.insert_at(self.position(anchor) + 1, ops)

    def append(self, ops: Iterable[Op]) -> None:
        self.insert_at(len(self.func.ops), ops)

    def insert_after_each(self, placements: dict[Op, list[Op]]) -> None:
        """Insert each ``placements[anchor]`` just after its anchor, in one sweep over the
        ops (placing them one by one would search the list for each anchor)."""
        placed = [op for ops in placements.values() for op in ops]
        self.func.ops[:] = [op for anchor in self.func.ops for op in (anchor, *placements.get(anchor, ()))]

        def undo():
            gone = {id(op) for op in placed}
            self.func.ops[:] = [op for op in self.func.ops if id(op) not in gone]
            for op in placed:
                op.operands = ()
        self._undo.append(undo)

    def erase(self, op: Op) -> None:
        """Remove ``op``; its results must be unused (replace their uses first)."""
        used = [r for r in op.results if r.uses]
        if used:
            raise ValueError(f"cannot erase {op.name}: %{used[0].name} is still used")
        pos = self.position(op)
        operands = op.operands
        self._detach(op)

        def undo():
            self.func.ops.insert(pos, op)
            op.operands = operands
        self._undo.append(undo)

    def _detach(self, op: Op) -> None:
        self.func.ops.pop(self.position(op))
        op.operands = ()

    def move(self, op: Op, pos: int) -> None:
        """Move ``op`` to run before the op now at ``pos`` (``len(func.ops)``: the end)."""
        old = self.position(op)
        self.func.ops.pop(old)
        pos = pos - 1 if pos > old else pos
        self.func.ops.insert(pos, op)

        def undo():
            self.func.ops.pop(self.func.ops.index(op))
            self.func.ops.insert(old, op)
        self._undo.append(undo)

    def move_before(self, op: Op, anchor: Op | None) -> None:
        """Move ``op`` just before ``anchor`` (None: to the end)."""
        self.move(op, len(self.func.ops) if anchor is None else self.position(anchor))

    def set_attr(self, op: Op, key: str, value=None) -> None:
        """Set attribute ``key`` of ``op`` to ``value`` (None: remove it)."""
        had, old = key in op.attrs, op.attrs.get(key)
        if value is None:
            op.attrs.pop(key, None)
        else:
            op.attrs[key] = value

        def undo():
            if had:
                op.attrs[key] = old
            else:
                op.attrs.pop(key, None)
        self._undo.append(undo)

    # ---- values ----

    def set_operands(self, op: Op, values: Iterable[Value]) -> None:
        old, op.operands = op.operands, list(values)
        self._undo.append(lambda: setattr(op, "operands", old))

    def set_returns(self, values: Iterable[Value], types: list | None = None, attrs: list[dict] | None = None) -> None:
        """Set what the function returns; its result types follow the values' unless given,
        and its result attributes (``{saved}``...) stay unless given (they must be when the
        number of results changes)."""
        func = self.func
        old, old_types, old_attrs = func.returns, list(func.result_types), list(func.result_attrs)
        values = list(values)
        if attrs is None and len(values) != len(old_attrs):
            raise ValueError(f"@{func.name} returns {len(values)} values instead of {len(old_attrs)}: "
                             "give their attributes")
        func.returns = values
        func.result_types = list(types) if types is not None else [v.type for v in func.returns]
        func.result_attrs = [dict(d) for d in attrs] if attrs is not None else old_attrs

        def undo():
            func.returns, func.result_types, func.result_attrs = old, old_types, old_attrs
        self._undo.append(undo)

    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Every reader of ``old`` (ops and the return) reads ``new`` instead."""
        for user, i in list(old.uses):
            if isinstance(user, Op):
                self.set_operands(user, [new if k == i else v for k, v in enumerate(user.operands)])
            else:
                self.set_returns([new if k == i else v for k, v in enumerate(user.returns)], user.result_types)

    def replace_op(self, op: Op, values: list[Value]) -> None:
        """Replace every use of ``op``'s results by ``values``, then erase it."""
        for r, v in zip(op.results, values):
            self.replace_all_uses(r, v)
        self.erase(op)

    # ---- arguments ----

    def insert_arg(self, value: Value, at: int | None = None, attrs: dict | None = None) -> None:
        """Make the fresh ``value`` an argument (at ``at``; default: the last), with the
        signature attributes ``attrs`` (``{saved}``...)."""
        if value.owner is not None:
            raise ValueError(f"%{value.name} is defined already; an argument must be a fresh value")
        args, arg_attrs = self.func.args, self.func.arg_attrs
        at = len(args) if at is None else at
        args.insert(at, value)
        arg_attrs.insert(at, dict(attrs or {}))
        self._renumber()
        self._undo.append(lambda: (args.remove(value), arg_attrs.pop(at), setattr(value, "owner", None),
                                   self._renumber()))

    def remove_arg(self, value: Value) -> None:
        """Drop the unused argument ``value``."""
        if value.uses:
            raise ValueError(f"cannot remove argument %{value.name}: it is still used")
        args, arg_attrs = self.func.args, self.func.arg_attrs
        at = args.index(value)
        args.pop(at)
        attrs = arg_attrs.pop(at)
        value.owner = None
        self._renumber()
        self._undo.append(lambda: (args.insert(at, value), arg_attrs.insert(at, attrs), self._renumber()))

    def _renumber(self) -> None:
        for i, a in enumerate(self.func.args):
            a.owner, a.index = self.func, i


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


class Match(dict):
    """A rule's match at an op: the pattern's bindings and the ``context``'s by name
    (``m["x"]``), and what every match has, as attributes."""

    @property
    def root(self) -> Op:
        """The op the rule's pattern matched at."""
        return self["root"]

    @property
    def func(self) -> Function:
        return self["func"]

    @property
    def module(self) -> Module:
        return self["module"]

    @property
    def rewriter(self) -> Rewriter:
        """The rewriter of ``func``, for a rewrite that edits the IR itself (``EDITED``)."""
        return self["rewriter"]


@dataclass(frozen=True)
class Constraint:
    """A named predicate over a match's bindings."""

    name: str
    test: Callable[[Match], bool]


@dataclass(frozen=True)
class Rule:
    pattern: P
    rewrite: Callable[[Match], Value | Op | None]
    constraints: tuple[Constraint, ...] = ()
    name: str = ""
    where: str = field(default="", compare=False)
    #: also try ops whose results are unused (a rewrite that does more than replace them)
    dead_too: bool = False

    def __post_init__(self):
        caller = sys._getframe(1)
        while caller.f_code.co_filename == __file__ or caller.f_code.co_name == "__init__":
            caller = caller.f_back
        object.__setattr__(self, "where", f"{caller.f_code.co_filename}:{caller.f_lineno}")
        if not self.name:
            object.__setattr__(self, "name", self.where.rsplit("/", 1)[-1])


def _match(pat, value: Value, m: Match) -> bool:
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


def _match_op(pat: P, op: Op, m: Match) -> bool:
    if pat.name is not None and op.name != pat.name:
        return False
    if pat.trait is not None and not registry.has_trait(op, pat.trait):
        return False
    if pat.operands and len(pat.operands) != len(op.operands):
        return False
    if pat.bind:
        m[pat.bind] = op
    return all(_match(p, v, m) for p, v in zip(pat.operands, op.operands))


def apply_rules(module: Module, rules: list[Rule], stats: Counter | None = None, max_iterations: int = 10,
                context: Callable[[Function], dict] | None = None) -> bool:
    """Apply ``rules`` until nothing matches (or ``max_iterations`` sweeps). True if anything changed.
    ``context(func)``: more bindings for the matches in ``func`` (analyses its rewrites
    read), computed once per function before its first sweep."""
    by_root: dict[str | None, list[Rule]] = {}
    for r in rules:
        by_root.setdefault(r.pattern.name, []).append(r)
    changed = False
    for func in module.functions.values():
        base = {"module": module, "func": func, "rewriter": Rewriter(func)}
        base.update(context(func) if context is not None else {})
        for _ in range(max_iterations):
            if not _sweep(base, by_root, stats):
                break
            changed = True
    return changed


def _sweep(base: dict, by_root: dict, stats: Counter | None) -> bool:
    """One pass over the ops as they were at its start; the first rule that rewrites an op wins."""
    changed = False
    for op in list(base["func"].ops):
        dead = bool(op.results) and not any(r.uses for r in op.results)
        for rule in by_root.get(op.name, []) + by_root.get(None, []):
            if dead and not rule.dead_too:
                continue  # rewriting it would change nothing
            if _fire(rule, op, base):
                if stats is not None:
                    stats[rule.name] += 1
                changed = True
                break
    return changed


def _fire(rule: Rule, op: Op, base: dict) -> bool:
    """Match ``rule`` at ``op`` and apply its rewrite; True if the IR changed."""
    rewriter = base["rewriter"]
    m = Match(base, root=op)
    if not _match_op(rule.pattern, op, m) or not all(c.test(m) for c in rule.constraints):
        return False
    out = rule.rewrite(m)
    if out is None:
        return False
    if isinstance(out, Op):
        rewriter.insert_before(op, [out])
        for a, b in zip(op.results, out.results):
            rewriter.replace_all_uses(a, b)
    elif out is not EDITED:
        rewriter.replace_all_uses(op.results[0], out)
    return True
