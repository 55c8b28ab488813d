"""Async: a pending value (what an ``async`` op yields) is consumed only by a
``waits`` op, exactly once, and every pending value is waited before its function
returns. Other checkers ask ``waited`` whether an async op has been joined yet."""

from __future__ import annotations

from dcir import ops as registry
from dcir.ir import PendingType
from dcir.verifier.checker import Checker


class Pending(Checker):
    def function(self, f) -> None:
        self.waited = {}  # pending value -> the op that joined it
        self.pendings = []  # every pending value defined, in order

    def operand(self, op, d, k: int, v) -> bool:
        if not isinstance(v.type, PendingType):
            return True
        if d is None or registry.WAITS not in d.traits:
            self.report.operand_error(op, k, f"pending value %{v.name} is used by {op.name}; only comm.wait can "
                                             "consume a pending value", (self.report.def_note(v),))
            return False
        if v in self.waited:
            self.report.operand_error(op, k, f"pending value %{v.name} is waited twice",
                                      (self.report.op_note(self.waited[v], "first waited here"),))
            return False
        return True

    def effects(self, op, d, ok: bool) -> None:
        if d is not None and registry.WAITS in d.traits:  # even a malformed wait shows what it meant to join
            for v in op.operands:
                if isinstance(v.type, PendingType):
                    self.waited.setdefault(v, op)
        if not ok:
            return
        for r in op.results:  # any op's, not only an async one's: comm.wait of pending<pending<T>>
            if isinstance(r.type, PendingType):
                self.pendings.append(r)

    def returned(self, f, k: int, v) -> bool:
        if isinstance(v.type, PendingType):
            self.report.return_error(f, f"return of pending value %{v.name}; comm.wait it first",
                                     (self.report.def_note(v),))
            return False
        return True

    def end_function(self, f) -> None:
        for p in self.pendings:
            if p not in self.waited:
                self.report.result_error(p, f"pending value %{p.name} is never waited; add comm.wait before the "
                                            "function returns")
