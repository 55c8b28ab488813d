"""Shape inference for schema ops (aten and custom) by running torch's meta kernels.

The verifier's structural checks trust the result types recorded at capture. With
``verify(module, shapes=True)`` (``dcir-opt --verify-shapes``) each aten op is also run
on meta tensors (no data, no compute) and its declared result types are compared with
what torch says. Results are cached per (op, operand types, attributes), so a model's
repeated layers cost one call per distinct op shape. Importing torch costs seconds,
which is why this is a choice and not the default.
"""

from __future__ import annotations

from functools import lru_cache

from dcir import aten
from dcir.custom_ops import lazy_torch, resolve
from dcir.ir import NONE, DType, TensorType, Type, attr_key

_DTYPES = {
    "bool": "bool", "u8": "uint8", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64", "c64": "complex64",
    "c128": "complex128",
}


def torch_dtype(name: str):
    return getattr(lazy_torch(), _DTYPES[name])


def dcir_dtype(dtype) -> str:
    text = str(dtype).removeprefix("torch.")
    for short, long in _DTYPES.items():
        if long == text:
            return short
    raise ValueError(f"DCIR has no element type for {dtype}")


#: schema types whose attribute may be a complex number (a Scalar, a complex, a tensor torch wraps from one)
_NUMBER_TYPES = ("number", "Optional[number]", "complex", "Optional[complex]", "List[number]", "Tensor",
                 "Optional[Tensor]")


def _attr_to_torch(arg: aten.Arg, value, device=None):
    """An attribute value as the torch object schema argument ``arg`` wants."""
    if isinstance(value, DType):
        return torch_dtype(value.name)
    if isinstance(value, tuple):
        return [_attr_to_torch(arg, v, device) for v in value]
    if aten.is_complex_text(value) and arg.type in _NUMBER_TYPES:
        return complex(value)  # "(1+2j)": a complex number, as the language writes it
    if isinstance(value, str) and arg.type in ("Device", "Optional[Device]"):
        return lazy_torch().device(device or value)
    if isinstance(value, str) and arg.type in ("int", "Optional[int]"):
        return getattr(lazy_torch(), value)  # memory_format = "contiguous_format", layout = "strided"
    return value


def call_arguments(op_name: str, operands: list, attrs: dict, *, device=None) -> tuple[list, dict]:
    """Positional and keyword arguments for ``torch.ops.<op_name>`` from an op's operand
    values (any objects, e.g. tensors or FX nodes) and attributes, by the mapping in
    ``dcir.aten``. ``device`` replaces every device argument (``"meta"`` for inference)."""
    sch = aten.schema(op_name)
    plain = {k: v for k, v in attrs.items() if "." not in k and k != "ranks"}
    args, kwargs = [], {}
    bound = aten.bind(sch, len(operands), plain)
    given = {arg.name for arg, _ in bound}
    # an argument left at its default shifts every later one: those go by keyword
    # (binary_cross_entropy(self, target, weight=None, reduction=1) without weight)
    skipped = next((k for k, a in enumerate(sch.args) if a.name not in given), len(sch.args))
    by_keyword = {a.name for a in sch.args[skipped:]}
    for arg, src in bound:
        if src[0] == "operand":
            value = operands[src[1]]
        elif src[0] == "operands":
            value = list(operands[src[1]:src[2]])
            for k in attrs.get(f"{arg.name}.absent", ()):  # a list of optional tensors: None where absent
                value.insert(k, None)
        else:
            value = _attr_to_torch(arg, plain[src[1]], device)
        if arg.kwarg_only or arg.name in by_keyword:
            kwargs[arg.name] = value
        else:
            args.append(value)
    return args, kwargs


@lru_cache(maxsize=None)
def _infer_cached(op_name: str, operand_types: tuple, attrs_key: tuple, attrs_items: tuple) -> tuple[Type, ...]:
    torch = lazy_torch()
    operands = []
    for t in operand_types:
        if t == NONE:
            operands.append(None)
        else:
            operands.append(torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta"))
    args, kwargs = call_arguments(op_name, operands, dict(attrs_items), device="meta")
    out = resolve(op_name)(*args, **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(NONE if o is None else TensorType(dcir_dtype(o.dtype), tuple(int(d) for d in o.shape)) for o in outs)


class ShapeError(ValueError):
    """torch's meta kernel rejected the op; the message is torch's, shortened."""


def infer(op_name: str, operand_types: list[Type], attrs: dict) -> list[Type]:
    """The result types torch computes for this aten op. Raises ShapeError."""
    if any(not isinstance(t, TensorType) and t != NONE for t in operand_types):
        raise ShapeError("shape inference needs full tensor operands")
    items = tuple(attrs.items())
    try:
        return list(_infer_cached(op_name, tuple(operand_types), tuple((k, attr_key(v)) for k, v in items), items))
    except aten.MappingError:
        raise
    except Exception as e:  # torch raises many kinds; the user needs its words, not its type
        first = str(e).strip().split("\n", 1)[0]
        raise ShapeError(first[:300]) from None
