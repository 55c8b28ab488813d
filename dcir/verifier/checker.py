"""The shape every checker has: hooks the walk calls, in execution order.

A checker owns one invariant and the state it needs to check it. The walk
(``dcir.verifier.walk``) visits each function once, op by op, and calls, for every
checker in turn:

* ``module()`` once, before any function; ``end_module()`` once, after all;
* ``function(f)`` when a function starts; ``end_function(f)`` after its return;
* ``operand(op, d, k, v)`` for each operand the SSA checker found defined before ``op``;
* ``op(op, d, ok)``: checks of the op itself; ``ok`` says whether every check before
  this one passed, so a check that needs a well-formed op (a type rule) can skip;
  returns whether the op is still well formed;
* ``effects(op, d, ok)``: what the op does to the state the checker tracks (a free,
  a wait); most skip when ``ok`` is False, as a malformed op's effects are unknown and
  tracking them would only add follow-on errors;
* ``returned(f, k, v)`` for each value the function returns.

``d`` is the op's ``OpDef`` (None for an unknown op). Hooks that check return False
after reporting a violation. A checker asks an op's traits, never its name.
"""

from __future__ import annotations

from dcir.ir import Function, Module, Op, Value
from dcir.ops import OpDef
from dcir.verifier.report import Reporter


class Checker:
    def __init__(self, report: Reporter, module: Module):
        self.report = report
        self.m = module

    def module(self) -> None:
        pass

    def function(self, f: Function) -> None:
        pass

    def operand(self, op: Op, d: OpDef | None, k: int, v: Value) -> bool:
        return True

    def op(self, op: Op, d: OpDef | None, ok: bool) -> bool:
        return ok

    def effects(self, op: Op, d: OpDef | None, ok: bool) -> None:
        pass

    def returned(self, f: Function, k: int, v: Value) -> bool:
        return True

    def end_function(self, f: Function) -> None:
        pass

    def end_module(self) -> None:
        pass
