"""Element types for mixed precision: names, and the verifier's dtype rules.

Users name dtypes the way FSDP2 and DeepSpeed do (``"bfloat16"``, ``"float32"``, the
names of ``torch.dtype``); the IR spells them short (``bf16``, ``f32``). Both spellings
are accepted everywhere a dtype is configured, and an unknown one is an error that lists
the valid ones.

The dtype rules (``check``) run inside the verifier. The type rules of the ops already
keep a dtype through collectives, waits and copies, and make a gradient handed to the
optimizer match its parameter's storage. What is left is what a misplaced cast breaks:

* a matrix product (``mm``, ``addmm``, ``bmm``, ``convolution`` ...) whose floating
  operands differ in dtype: torch refuses it at run time, so a cast placed on one side
  only (a parameter cast to bf16 meeting an f32 activation) is caught here, statically;
* a ``mem.cast`` to the dtype its operand already has: a copy that casts nothing is a
  sign the pass ran on a module it did not expect.
"""

from __future__ import annotations

from typing import Callable

from dcir.ir import DType, Module, Op, TensorType

#: The floating dtypes a precision policy may name: torch's name -> the IR's spelling.
FLOAT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
#: torch's other names of the same dtypes (``torch.half`` is ``torch.float16``)
_ALIASES = {"float": "f32", "half": "f16", "double": "f64"}


def parse_dtype(name: object) -> str:
    """A floating dtype in the IR's spelling, from either spelling (``"bfloat16"``,
    ``"bf16"``, ``torch.bfloat16``). Raises ``ValueError`` listing the valid names."""
    text = str(name).removeprefix("torch.")
    short = {**FLOAT_DTYPES, **_ALIASES}.get(text, text)
    if short in FLOAT_DTYPES.values():
        return short
    valid = ", ".join(f"{long} ({s})" for long, s in FLOAT_DTYPES.items())
    raise ValueError(f"unknown dtype {name!r}; valid dtypes: {valid}")


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES.values()


#: aten ops (by their base name) that torch runs only on operands of one dtype
_SAME_DTYPE = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot",
                         "convolution", "convolution_backward"})

OpError = Callable[[Op, str], None]


def check(module: Module, op_error: OpError) -> None:
    """Report each dtype rule broken in ``module`` through ``op_error(op, message)``."""
    for _, op in module.ops():
        if op.name == "mem.cast":
            _check_cast(op, op_error)
        elif op.name.startswith("aten.") and op.name.split(".")[1] in _SAME_DTYPE:
            _check_same_dtype(op, op_error)


def _check_cast(op: Op, op_error: OpError) -> None:
    to = op.attrs.get("dtype")
    if len(op.operands) == 1 and isinstance(to, DType) and getattr(op.operands[0].type, "dtype", None) == to.name:
        op_error(op, f"mem.cast of %{op.operands[0].name} to {to.name}, the dtype it has: remove the cast")


def _check_same_dtype(op: Op, op_error: OpError) -> None:
    floats = {}
    for v in op.operands:
        if isinstance(v.type, TensorType) and is_float(v.type.dtype):
            floats.setdefault(v.type.dtype, v)
    if len(floats) > 1:
        mixed = " and ".join(f"%{v.name} is {t}" for t, v in floats.items())
        op_error(op, f"{op.name} needs operands of one dtype, but {mixed}; cast one of them "
                     "(the mixed_precision pass casts parameters and the forward casts its inputs)")
