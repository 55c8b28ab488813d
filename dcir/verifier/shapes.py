"""Types and shapes: each op's type rule accepts its operands, and every result is
declared with the type the rule computes. With ``shapes=True``, a ``schema`` op's
results are instead checked against torch's meta kernels (``dcir.shapes``), which
know the shape of every aten op, not only its kind."""

from __future__ import annotations

from dcir import ops as registry, shapes
from dcir.ops import TypeRuleError
from dcir.verifier.checker import Checker


class Shapes(Checker):
    def __init__(self, report, module, meta: bool = False):
        super().__init__(report, module)
        self.meta = meta

    def op(self, op, d, ok: bool) -> bool:
        if not ok:  # a type rule needs the arity, symbol and attributes it was written for
            return False
        types = [v.type for v in op.operands]
        try:
            expected = d.type_rule(op, types, self.m)
        except TypeRuleError as e:
            if e.operand is not None and e.operand < len(op.operands):
                self.report.operand_error(op, e.operand, str(e))
            else:
                self.report.op_error(op, str(e))
            return False
        if self.meta and registry.SCHEMA in d.traits:
            return self._meta(op, types)
        for want, r in zip(expected, op.results):
            if r.type != want:
                self.report.result_error(r, f"%{r.name} should have type {want}, but is declared {r.type}")
        return True

    def _meta(self, op, types) -> bool:
        try:
            inferred = shapes.infer(op.name, types, op.attrs)
        except shapes.ShapeError as e:
            self.report.op_error(op, f"torch rejects {op.name} on these operands: {e}")
            return False
        for want, r in zip(inferred, op.results):
            if r.type != want:
                self.report.result_error(r, f"%{r.name} should have type {want} (torch's meta kernel for {op.name} "
                                            f"says so), but is declared {r.type}")
        return True
