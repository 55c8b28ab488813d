"""SSA and dominance: every use is defined, and defined before it is used; every name
is defined once per function."""

from __future__ import annotations

from dcir.verifier.checker import Checker


class Ssa(Checker):
    def function(self, f) -> None:
        self.position = {a: -1 for a in f.args}  # value -> index of the op defining it
        self.names = {}
        for a in f.args:
            if a.name in self.names:
                self.report.error(f"redefinition of %{a.name}", self.report.loc(f), 4,
                                  (self.report.def_note(self.names[a.name], "previous definition here"),))
            self.names[a.name] = a
        for i, op in enumerate(f.ops):
            for r in op.results:
                self.position.setdefault(r, i)

    def defined(self, i: int, op, k: int, v) -> bool:
        """Whether operand ``k`` of ``op`` (the function's op #``i``) is defined before
        it; reports it if not. The walk asks this first, and the other checkers see
        only defined operands."""
        if v.owner is None:
            self.report.operand_error(op, k, f"use of undefined value %{v.name}")
            return False
        if self.position.get(v, -1) >= i:
            self.report.operand_error(op, k, f"use of %{v.name} before its definition", (self.report.def_note(v),))
            return False
        return True

    def effects(self, op, d, ok: bool) -> None:
        for r in op.results:
            first = self.names.get(r.name)
            if first is not None and first is not r:
                self.report.error(f"redefinition of %{r.name}", *self.report.result_span(r),
                                  (self.report.def_note(first, "previous definition here"),))
            else:
                self.names[r.name] = r

    def returned(self, f, k: int, v) -> bool:
        if v.owner is None:
            self.report.return_error(f, f"return of undefined value %{v.name}")
            return False
        return True
