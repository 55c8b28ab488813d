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
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import zip_longest
from typing import Iterator, Literal, Union

from dcir.attrs import UNIT, Attr, DType, SymbolRef, Unit, attr_key  # noqa: F401  (the IR's attribute values)
from dcir.layout import ShardLayout
from dcir.printer import print_module, print_op

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
    """One rank's flat shard of a tensor split across ``parts`` ranks: ``shard<f32[8, 16], 2>``,
    or, in a module with a mesh, across the ranks of one of its dimensions, ``over``
    (replicated over the others): ``shard<f32[8, 16], local=2>``.

    The full tensor is flattened and padded to a multiple of ``parts``; every rank
    holds ``ceil(numel / parts)`` elements, so collectives have the same size on
    every rank even when the split is uneven (``dcir.layout.ShardLayout``).
    """

    full: TensorType
    parts: int
    #: the mesh dimension the shards are split over (None: every rank of the world)
    over: str | None = None

    @property
    def dtype(self) -> str:
        return self.full.dtype

    @property
    def numel(self) -> int:
        return self.layout.chunk

    @property
    def layout(self) -> ShardLayout:
        """Which of the full tensor's flattened elements each rank holds."""
        return ShardLayout(self.full.numel, self.parts)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.full.dtype]

    def __str__(self) -> str:
        return f"shard<{self.full}, {self.over}={self.parts}>" if self.over else f"shard<{self.full}, {self.parts}>"


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


def retyped(t: Type, dtype: str) -> Type:
    """``t`` with its element type replaced (through shard and pending wrappers)."""
    if isinstance(t, TensorType):
        return TensorType(dtype, t.shape)
    if isinstance(t, ShardType):
        return replace(t, full=TensorType(dtype, t.full.shape))
    if isinstance(t, PendingType):
        return PendingType(retyped(t.inner, dtype))
    return t


# ---- values, ops, functions, modules -----------------------------------------------

Loc = tuple  # (line, column), both 1-based, in the file the module was parsed from


class Value:
    """An SSA value: a function argument or an op result.

    ``owner`` is the defining ``Op`` (or the ``Function`` for an argument) and ``index``
    the result (or argument) position there; ``Op()`` and ``Function()`` set both when
    they take the value. ``uses`` lists every reader as ``(op, operand index)``, or
    ``(function, return index)`` for a return; ``Op.operands`` and
    ``Function.returns`` keep it current, so a pass asks a value who reads it instead
    of scanning the function. Change the IR through ``dcir.rewrite.Rewriter``, which
    keeps owners, indices, uses and order consistent.
    """

    __slots__ = ("name", "type", "owner", "index", "uses")

    def __init__(self, name: str, type: Type):
        self.name = name
        self.type = type
        self.owner: "Op | Function | None" = None
        self.index = 0
        self.uses: list[tuple["Op | Function", int]] = []

    def users(self) -> list["Op"]:
        """The ops that read this value, in no particular order, each once."""
        return list({id(u): u for u, _ in self.uses if isinstance(u, Op)}.values())

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


def _unuse(values, user, start: int = 0) -> None:
    for i, v in enumerate(values, start):
        v.uses.remove((user, i))


def _reuse(old: tuple, values, user) -> tuple:
    """``values`` as ``user``'s new operands (or returns): the old uses dropped, the new recorded."""
    if old:
        _unuse(old, user)
    new = tuple(values)
    for i, v in enumerate(new):
        v.uses.append((user, i))
    return new


class Op:
    """One operation: ``%r = family.op @sym(%a, %b) {k = v} : T``.

    ``operands`` is a tuple; assigning it records the new uses and drops the old ones.
    It is ``None`` in the text when the op was written without parentheses, which is
    different from ``()``; ``parens`` keeps the distinction so text round-trips.

    ``Op()`` takes its results: each must be a fresh value (no owner yet), and
    becomes this op's result ``i`` (``owner`` and ``index`` set). To give an existing
    value's name to a new op, make a new ``Value`` and replace the old one's uses.
    """

    __slots__ = ("name", "_operands", "results", "attrs", "symbol", "loc", "parens")

    def __init__(self, name: str, operands: list[Value] | None = None, results: list[Value] | None = None,
                 attrs: dict[str, Attr] | None = None, symbol: str | None = None, loc: Loc | None = None,
                 parens: bool | None = None):
        self.name = name
        self._operands = tuple(operands) if operands else ()
        for i, v in enumerate(self._operands):
            v.uses.append((self, i))
        self.results = list(results or ())
        self.attrs = dict(attrs or {})
        self.symbol = symbol
        self.loc = loc
        self.parens = bool(self._operands) if parens is None else parens
        for i, r in enumerate(self.results):
            if r.owner is not None:
                raise ValueError(f"%{r.name} is defined already (by {r.owner.name}); a value has one definition")
            r.owner, r.index = self, i

    @property
    def operands(self) -> tuple[Value, ...]:
        return self._operands

    @operands.setter
    def operands(self, values) -> None:
        self._operands = _reuse(self._operands, values, self)

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    def __repr__(self) -> str:
        return f"<Op {print_op(self)}>"


class Function:
    """A function: arguments, ops in execution order, and the values it returns.

    ``returns`` records its uses like ``Op.operands`` (``(function, index)``).

    The signature is declared: ``role`` says what the function is for (``forward``,
    ``backward``..., ``dcir/roles.py``; None for a plain function), and each argument
    and result carries an attribute dict (``arg_attrs``, ``result_attrs``, parallel to
    ``args`` and ``result_types``) saying what passes through it (``{input =
    "labels"}``, ``{saved}``, ``{grad = 0}``: ``dcir/signature.py``)."""

    __slots__ = ("name", "args", "result_types", "ops", "_returns", "attrs", "loc", "return_loc", "role",
                 "arg_attrs", "result_attrs")

    def __init__(self, name: str, args: list[Value] | None = None, result_types: list[Type] | None = None,
                 ops: list[Op] | None = None, returns: list[Value] | None = None,
                 attrs: dict[str, Attr] | None = None, loc: Loc | None = None, return_loc: Loc | None = None,
                 role: str | None = None, arg_attrs: list[dict] | None = None,
                 result_attrs: list[dict] | None = None):
        self.name = name
        self.role = role
        self.args = list(args or ())
        self.result_types = list(result_types or ())
        self.arg_attrs = [dict(a) for a in arg_attrs] if arg_attrs is not None else [{} for _ in self.args]
        self.result_attrs = ([dict(a) for a in result_attrs] if result_attrs is not None
                             else [{} for _ in self.result_types])
        self.ops = list(ops or ())
        self._returns = tuple(returns) if returns else ()
        for i, v in enumerate(self._returns):
            v.uses.append((self, i))
        self.attrs = dict(attrs or {})
        self.loc = loc
        self.return_loc = return_loc
        for i, a in enumerate(self.args):
            a.owner, a.index = self, i

    @property
    def returns(self) -> tuple[Value, ...]:
        return self._returns

    @returns.setter
    def returns(self, values) -> None:
        self._returns = _reuse(self._returns, values, self)

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

    def clone(self, name: str | None = None, role: str | None = None) -> "Function":
        """A deep copy (new values and ops, same names, types, attributes and locations),
        optionally under another name and role."""
        env: dict[Value, Value] = {}

        def copy(v: Value) -> Value:
            if v not in env:
                env[v] = Value(v.name, v.type)
            return env[v]
        args = [copy(a) for a in self.args]
        ops = [Op(op.name, [copy(v) for v in op.operands], [copy(r) for r in op.results], dict(op.attrs),
                  op.symbol, op.loc, op.parens) for op in self.ops]
        return Function(name or self.name, args, list(self.result_types), ops, [copy(v) for v in self.returns],
                        dict(self.attrs), self.loc, self.return_loc, role or self.role, self.arg_attrs, self.result_attrs)


#: What a module-level declaration is: a parameter (``param``) or a buffer (``buffer``).
DeclKind = Literal["param", "buffer"]


@dataclass(slots=True)
class Decl:
    """A module-level parameter or buffer: ``param @fc1.weight : f32[16, 8] {trainable}``.

    The declared type is the type of the storage this rank holds: a ``TensorType``
    when replicated, a ``ShardType`` (which names the full logical type) when sharded.
    """

    kind: DeclKind
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

    def clone(self) -> "Module":
        """A deep copy: declarations, functions (new values and ops) and attributes; the
        source text is shared (it is immutable). Replanning copies a module this way
        rather than printing and parsing it."""
        decls = {k: replace(d, attrs=dict(d.attrs)) for k, d in self.decls.items()}
        funcs = {k: f.clone() for k, f in self.functions.items()}
        return Module(self.name, decls, funcs, dict(self.attrs), self.loc, self.source)

    def role(self, role: str) -> Function | None:
        """The function that declares ``role`` (``dcir/roles.py``), if the module has one."""
        return next((f for f in self.functions.values() if f.role == role), None)

    def ops(self) -> Iterator[tuple[Function, Op]]:
        for f in self.functions.values():
            for op in f.ops:
                yield f, op

    @property
    def world_size(self) -> int | None:
        ws = self.attrs.get("world_size")
        return ws if isinstance(ws, int) and not isinstance(ws, bool) and ws >= 1 else None

    @property
    def mesh(self) -> dict[str, int]:
        """The mesh the ranks form, its dimensions in order (row-major: the last varies
        fastest across ranks), from ``mesh.<dim> = <size>`` attributes; {} without one."""
        return {k[5:]: v for k, v in self.attrs.items() if k.startswith("mesh.") and isinstance(v, int)}

    def group_size(self, over: str | None) -> int | None:
        """How many ranks a collective over mesh dimension ``over`` (None: the world) spans."""
        return self.world_size if over is None else self.mesh.get(over)

    def __str__(self) -> str:
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
        funcs.append((f.name, f.role, tuple((a.name, a.type, _attrs_key(d or {}))
                                            for a, d in zip_longest(f.args, f.arg_attrs[:len(f.args)])),
                      tuple((t, _attrs_key(d or {})) for t, d in zip_longest(f.result_types,
                                                                             f.result_attrs[:len(f.result_types)])), ops,
                      tuple(v.name for v in f.returns), _attrs_key(f.attrs)))
    return (module.name, _attrs_key(module.attrs), decls, tuple(funcs))
