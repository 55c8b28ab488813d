"""The DCIR data model: types, values, ops, functions and modules.

A module holds parameter/buffer declarations (module-level symbols such as
``@fc1.weight``) and functions. A function's ops are kept in execution order: the
printed order IS the schedule. Values are SSA: each is defined once, by a function
argument or by an op result, and named (names from FX survive: ``%linear_1``).

Everything here is plain data. What an op *means* (arity, attributes, traits, type
rule) lives in the op registry, ``dcir.ops``; checking lives in ``dcir.verifier``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, Union

# ---- types -------------------------------------------------------------------------

#: Element types and their size in bytes. The spelling is the one used in the text.
DTYPE_BYTES = {
    "bool": 1, "u8": 1, "i8": 1, "i16": 2, "i32": 4, "i64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
}


@dataclass(frozen=True, slots=True)
class TensorType:
    """A full tensor on the device: ``f32[8, 16]``; ``f32[]`` is a scalar tensor."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class ShardType:
    """One rank's flat shard of a tensor split across ``parts`` ranks: ``shard<f32[8, 16], 2>``.

    The full tensor is flattened and padded to a multiple of ``parts``; every rank
    holds ``ceil(numel / parts)`` elements, so collectives have the same size on
    every rank even when the split is uneven.
    """

    full: TensorType
    parts: int

    @property
    def dtype(self) -> str:
        return self.full.dtype

    @property
    def numel(self) -> int:
        return -(-self.full.numel // self.parts)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.full.dtype]

    def __str__(self) -> str:
        return f"shard<{self.full}, {self.parts}>"


@dataclass(frozen=True, slots=True)
class PendingType:
    """The result of an async op (a collective, an offload): usable only by ``comm.wait``."""

    inner: "Type"

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def __str__(self) -> str:
        return f"pending<{self.inner}>"


@dataclass(frozen=True, slots=True)
class HostType:
    """A tensor (or shard) placed in host memory: ``host<f32[8, 16]>``."""

    inner: Union[TensorType, ShardType]

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def __str__(self) -> str:
        return f"host<{self.inner}>"


@dataclass(frozen=True, slots=True)
class NoneType:
    """An absent optional tensor (e.g. an unused output of ``convolution_backward``)."""

    nbytes = 0

    def __str__(self) -> str:
        return "none"


NONE = NoneType()
Type = Union[TensorType, ShardType, PendingType, HostType, NoneType]

# ---- attribute values --------------------------------------------------------------


class Unit:
    """The value of a present-but-valueless attribute: ``{trainable}``."""

    _instance: "Unit | None" = None

    def __new__(cls) -> "Unit":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNIT"


UNIT = Unit()


@dataclass(frozen=True, slots=True)
class SymbolRef:
    """A reference to a module-level symbol used as an attribute value: ``@fc1.weight``."""

    name: str


@dataclass(frozen=True, slots=True)
class DType:
    """An element type used as an attribute value: ``{dtype = bf16}``."""

    name: str


#: An attribute value: int, float, str, bool, None, UNIT, SymbolRef, DType or a tuple of them.
Attr = object


def attr_key(value: Attr) -> object:
    """A comparison key that tells ``1``, ``1.0`` and ``true`` apart (Python does not)."""
    if isinstance(value, tuple):
        return ("list", tuple(attr_key(v) for v in value))
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, value)


# ---- values, ops, functions, modules -----------------------------------------------

Loc = tuple  # (line, column), both 1-based, in the file the module was parsed from


class Value:
    """An SSA value: a function argument or an op result."""

    __slots__ = ("name", "type", "owner", "index")

    def __init__(self, name: str, type: Type, owner: "Op | Function | None" = None, index: int = 0):
        self.name = name
        self.type = type
        self.owner = owner  # the defining Op, or the Function for an argument
        self.index = index  # result index in the op, or argument index in the function

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Op:
    """One operation: ``%r = family.op @sym(%a, %b) {k = v} : T``.

    ``operands`` is ``None`` when the op was written without parentheses, which is
    different from ``()``; the printer keeps the distinction so text round-trips.
    """

    __slots__ = ("name", "operands", "results", "attrs", "symbol", "loc", "parens")

    def __init__(self, name: str, operands: list[Value] | None = None, results: list[Value] | None = None,
                 attrs: dict[str, Attr] | None = None, symbol: str | None = None, loc: Loc | None = None,
                 parens: bool | None = None):
        self.name = name
        self.operands = list(operands or ())
        self.results = list(results or ())
        self.attrs = dict(attrs or {})
        self.symbol = symbol
        self.loc = loc
        self.parens = bool(self.operands) if parens is None else parens
        for i, r in enumerate(self.results):
            r.owner, r.index = self, i

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    def __repr__(self) -> str:
        from dcir.printer import print_op
        return f"<Op {print_op(self)}>"


class Function:
    """A function: arguments, ops in execution order, and the values it returns."""

    __slots__ = ("name", "args", "result_types", "ops", "returns", "attrs", "loc", "return_loc")

    def __init__(self, name: str, args: list[Value] | None = None, result_types: list[Type] | None = None,
                 ops: list[Op] | None = None, returns: list[Value] | None = None,
                 attrs: dict[str, Attr] | None = None, loc: Loc | None = None, return_loc: Loc | None = None):
        self.name = name
        self.args = list(args or ())
        self.result_types = list(result_types or ())
        self.ops = list(ops or ())
        self.returns = list(returns or ())
        self.attrs = dict(attrs or {})
        self.loc = loc
        self.return_loc = return_loc
        for i, a in enumerate(self.args):
            a.owner, a.index = self, i

    def values(self) -> Iterator[Value]:
        yield from self.args
        for op in self.ops:
            yield from op.results

    def name_maker(self):
        """A function that turns a base into a value name unused in this function and
        not handed out before (for a rewrite that creates several values at once)."""
        used = {v.name for v in self.values()}

        def fresh(base: str) -> str:
            name, k = base, 1
            while name in used:
                name, k = f"{base}_{k}", k + 1
            used.add(name)
            return name
        return fresh

    def fresh_name(self, base: str) -> str:
        """A value name not yet used in this function, derived from ``base``."""
        return self.name_maker()(base)


@dataclass(slots=True)
class Decl:
    """A module-level parameter or buffer: ``param @fc1.weight : f32[16, 8] {trainable}``.

    The declared type is the type of the storage this rank holds: a ``TensorType``
    when replicated, a ``ShardType`` (which names the full logical type) when sharded.
    """

    kind: str  # "param" or "buffer"
    name: str
    type: Type
    attrs: dict[str, Attr] = field(default_factory=dict)
    loc: Loc | None = None

    @property
    def trainable(self) -> bool:
        return self.kind == "param" and "trainable" in self.attrs

    @property
    def full_type(self) -> TensorType:
        return self.type.full if isinstance(self.type, ShardType) else self.type


@dataclass(slots=True)
class Module:
    """A DCIR module: declarations and functions, plus where it came from (for diagnostics)."""

    name: str
    decls: dict[str, Decl] = field(default_factory=dict)
    functions: dict[str, Function] = field(default_factory=dict)
    attrs: dict[str, Attr] = field(default_factory=dict)
    loc: Loc | None = None
    source: "Source | None" = None

    def ops(self) -> Iterator[tuple[Function, Op]]:
        for f in self.functions.values():
            for op in f.ops:
                yield f, op

    @property
    def world_size(self) -> int | None:
        ws = self.attrs.get("world_size")
        return ws if isinstance(ws, int) and not isinstance(ws, bool) and ws >= 1 else None

    def __str__(self) -> str:
        from dcir.printer import print_module
        return print_module(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Module):
            return NotImplemented
        return structure(self) == structure(other)

    __hash__ = None  # mutable


@dataclass(frozen=True)
class Source:
    """The text a module was parsed from, kept so diagnostics can quote it."""

    name: str
    text: str
    line_offset: int = 0  # lines before this text in its file (for --split-input-file)

    @cached_property
    def lines(self) -> list[str]:
        return self.text.split("\n")

    def line(self, lineno: int) -> str:
        idx = lineno - 1 - self.line_offset
        return self.lines[idx] if 0 <= idx < len(self.lines) else ""


def _attrs_key(attrs: dict[str, Attr]) -> tuple:
    return tuple((k, attr_key(v)) for k, v in attrs.items())


def structure(module: Module) -> tuple:
    """Everything that makes two modules equal, as nested tuples (locations excluded)."""
    decls = tuple((d.kind, d.name, d.type, _attrs_key(d.attrs)) for d in module.decls.values())
    funcs = []
    for f in module.functions.values():
        ops = tuple(
            (op.name, op.symbol, op.parens, tuple(v.name for v in op.operands),
             tuple((r.name, r.type) for r in op.results), _attrs_key(op.attrs))
            for op in f.ops)
        funcs.append((f.name, tuple((a.name, a.type) for a in f.args), tuple(f.result_types), ops,
                      tuple(v.name for v in f.returns), _attrs_key(f.attrs)))
    return (module.name, _attrs_key(module.attrs), decls, tuple(funcs))
