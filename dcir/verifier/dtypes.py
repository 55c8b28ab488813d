"""Dtypes: what a misplaced mixed-precision cast breaks. The ops' type rules already keep
a dtype through collectives, waits and copies, and make a gradient handed to the
optimizer match its parameter's storage. Left to check here:

* a matrix product (``mm``, ``addmm``, ``bmm``, ``convolution`` ...) whose floating
  operands differ in dtype: torch refuses it at run time, so a cast placed on one side
  only (a parameter cast to bf16 meeting an f32 activation) is caught statically;
* a cast (an op with the ``casts`` trait) to the dtype its operand already has: a copy
  that casts nothing is a sign the pass ran on a module it did not expect.
"""

from __future__ import annotations

from dcir.dtypes import is_float
from dcir.ir import DType, Op, TensorType
from dcir.ops import CASTS, SCHEMA, OpDef
from dcir.verifier.checker import Checker

#: aten ops (by their base name) that torch runs only on operands of one dtype
_SAME_DTYPE = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot",
                         "convolution", "convolution_backward"})


class Dtypes(Checker):
    def __init__(self, *args):
        super().__init__(*args)
        self._rule: dict[str, object] = {}  # op name -> the check it needs (None: none); once per name

    def op(self, op: Op, d: OpDef | None, ok: bool) -> bool:
        if not ok or d is None:
            return ok
        rule = self._rule.get(op.name, self)
        if rule is self:
            rule = self._rule[op.name] = self._rule_for(op.name, d)
        return True if rule is None else rule(op)

    def _rule_for(self, name: str, d: OpDef):
        if CASTS in d.traits:
            return self._cast
        if SCHEMA in d.traits and name.startswith("aten.") and name.split(".")[1] in _SAME_DTYPE:
            return self._same_dtype
        return None

    def _cast(self, op: Op) -> bool:
        to = op.attrs.get("dtype")
        if isinstance(to, DType) and getattr(op.operands[0].type, "dtype", None) == to.name:
            self.report.op_error(op, f"{op.name} of %{op.operands[0].name} to {to.name}, the dtype it has: "
                                     "remove the cast")
            return False
        return True

    def _same_dtype(self, op: Op) -> bool:
        floats: dict = {}
        for v in op.operands:
            if isinstance(v.type, TensorType) and is_float(v.type.dtype):
                floats.setdefault(v.type.dtype, v)
        if len(floats) > 1:
            mixed = " and ".join(f"%{v.name} is {t}" for t, v in floats.items())
            self.report.op_error(op, f"{op.name} needs operands of one dtype, but {mixed}; cast one of them "
                                     "(the mixed_precision pass casts parameters and the forward casts its inputs)")
            return False
        return True
