"""The op registry: every op family declared as data.

An ``OpDef`` says how many operands and results an op takes, which attributes it
accepts, its traits, and a type rule (operand types -> result types). The verifier and
the passes read these declarations; nothing else in DCIR lists op names. ``aten.*`` is
one open family whose members come from torch's own schemas (``dcir.aten``).

Traits:

=============  =====================================================================
``pure``        no side effect: removable when its results are unused
``compute``     computes on full tensors (never shards, pending or host values)
``async``       starts work and yields pending values, joined by a ``waits`` op
``waits``       joins pending values (its results share their storage); ``comm.wait``
                joins collectives, ``mem.wait`` host copies (``OpDef.joins``)
``collective``  every rank must issue it, in the same order
``gathers``     a collective that yields full tensors from every rank's shard
``scatters``    a collective that leaves each rank its shard of the result
``reduces``     combines its operands across ranks (sum, avg, ...)
``exchanges``   a collective that sends row ``p`` of its operand to rank ``p`` and yields,
                in row ``r``, what rank ``r`` sent this one (all-to-all)
``host_copy``   copies between device and host memory, on the copy channel
``gradient``    hands a parameter's gradient to the optimizer
``frees``       releases the storage of its operands
``allocates``   its results occupy new memory
``side_effect`` must run even when nothing reads its results
``reads_state`` reads a module-level symbol's storage
``loads_state`` its result *is* the named symbol's storage as this rank holds it
``writes_state`` writes a module-level symbol's storage
``schema``      operands, attributes and results follow a torch overload's schema
``casts``       copies its operand converted to the element type its ``dtype`` attribute names
``optimizes``   runs the optimizer's update of the named parameter
=============  =====================================================================

Passes and models ask ``has_trait(op, T)``, never an op's name, so a new op declared
with the traits of an existing one is rewritten, scheduled and costed like it.
A collective that works on one tensor names its form for several (``coalesced``),
which ``bucket`` creates when it merges them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable

from dcir import aten, shapes
from dcir.buffers import GRAD_ACC_OF
from dcir.ir import DTYPE_BYTES, NONE, DType, HostType, Op, PendingType, ShardType, TensorType, Type, retyped

PURE, COMPUTE, ASYNC, WAITS, COLLECTIVE, REDUCES = "pure", "compute", "async", "waits", "collective", "reduces"
FREES, ALLOCATES, SIDE_EFFECT, READS_STATE, WRITES_STATE = "frees", "allocates", "side_effect", "reads_state", "writes_state"
GRADIENT, GATHERS, SCATTERS, HOST_COPY = "gradient", "gathers", "scatters", "host_copy"
EXCHANGES = "exchanges"
SCHEMA, CASTS = "schema", "casts"
LOADS_STATE, OPTIMIZES = "loads_state", "optimizes"

REDUCE_OPS = ("sum", "avg", "max", "min")


class TypeRuleError(ValueError):
    """An operand or declared type that an op's type rule rejects; the message says why."""

    def __init__(self, message: str, operand: int | None = None):
        super().__init__(message)
        self.operand = operand  # index of the offending operand, for the caret


@dataclass(frozen=True)
class AttrSpec:
    kind: str  # "int", "str", "unit", "enum", "int_list", "dtype"
    required: bool = False
    choices: tuple[str, ...] = ()

    def check(self, value: object) -> str | None:
        """None when ``value`` fits, else what was expected."""
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "str": isinstance(value, str),
            "enum": isinstance(value, str) and value in self.choices,
            "int_list": isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
            "dtype": isinstance(value, DType) and value.name in DTYPE_BYTES,
        }.get(self.kind, True)
        if ok:
            return None
        if self.kind == "enum":
            return "one of " + ", ".join(f'"{c}"' for c in self.choices)
        return {"int": "an integer", "str": "a string", "int_list": "a list of integers",
                "dtype": "a dtype: " + ", ".join(DTYPE_BYTES)}.get(self.kind, self.kind)


# A type rule gets the op, its operand types and the module; it returns the result
# types the op must declare, or raises TypeRuleError.
TypeRule = Callable[[Op, list[Type], object], list[Type]]


@dataclass(frozen=True)
class OpDef:
    name: str
    summary: str
    operands: tuple[int, int | None]  # (min, max); max None = variadic
    results: tuple[int, int | None] | str  # or "per_operand": one result per operand
    traits: frozenset[str]
    type_rule: TypeRule
    attrs: dict[str, AttrSpec] = field(default_factory=dict)
    symbol: bool = False  # takes a module-level symbol: ``param.get @w``
    example: str = ""
    #: a collective on one tensor: the op that does the same for several at once
    coalesced: str | None = None
    #: a wait: the trait of the async ops whose pending values it joins
    joins: str | None = None

    def has(self, trait: str) -> bool:
        return trait in self.traits


# ---- type rules ----------------------------------------------------------------------

def _full_or_shard(t: Type, what: str, i: int = 0) -> Type:
    if not isinstance(t, (TensorType, ShardType)):
        raise TypeRuleError(f"{what} must be a device tensor or shard, got {t}", i)
    return t


def _group(module, op: Op) -> str | None:
    """The mesh dimension a collective runs over (its ``group``; None: every rank)."""
    group = op.attrs.get("group")
    if group is not None and group not in module.mesh:
        dims = ", ".join(f'"{d}"' for d in module.mesh)
        raise TypeRuleError(f"{op.name} runs over group \"{group}\", which is not a dimension of the module's mesh"
                            + (f" ({dims})" if dims else " (it declares none: mesh.<dim> = <size> attributes)"))
    return group


def _world(module, op: Op) -> int:
    group = _group(module, op)
    parts = op.attrs.get("parts", module.group_size(group))
    if not isinstance(parts, int) or parts < 1:
        raise TypeRuleError(f"{op.name} needs the number of shards: give the module a world_size "
                            "attribute or the op a 'parts' attribute")
    return parts


def _rule_param_get(op, types, module):
    return [module.decls[op.symbol].type]


def _rule_param_set(op, types, module):
    decl = module.decls[op.symbol]
    if types[0] != decl.type:
        raise TypeRuleError(f"@{op.symbol} holds {decl.type}, but the value written is {types[0]}", 0)
    return []


def _accumulator(op, module):
    """The declaration of the gradient accumulator ``op`` updates in place; anything else
    (a parameter, BatchNorm's running statistics) is written with ``param.set``."""
    decl = module.decls[op.symbol]
    if decl.kind != "buffer" or GRAD_ACC_OF not in decl.attrs:
        raise TypeRuleError(f"{op.name} updates a gradient accumulator (a buffer with {GRAD_ACC_OF}) in place; "
                            f"@{op.symbol} is not one: write it with param.set", 0)
    return decl


def _rule_param_add(op, types, module):
    decl = _accumulator(op, module)
    t = _full_or_shard(types[0], f"the operand of {op.name}")
    if retyped(t, decl.type.dtype) != decl.type:  # the element type may differ (bf16 into f32)
        raise TypeRuleError(f"@{op.symbol} holds {decl.type}, but the value added is {t}", 0)
    return []


def _rule_param_zero(op, types, module):
    _accumulator(op, module)
    return []


def _rule_grad_set(op, types, module):
    decl = module.decls[op.symbol]
    over = decl.type.over if isinstance(decl.type, ShardType) else None
    allowed = {decl.type, decl.full_type, ShardType(decl.full_type, module.group_size(over) or 1, over)}
    if types[0] not in allowed:
        raise TypeRuleError(f"gradient of @{op.symbol} must be {decl.type}"
                            + (" or its shard" if decl.type == decl.full_type else "") + f", got {types[0]}", 0)
    return []


def _over(over: str | None) -> str:
    return f'the mesh dimension "{over}"' if over else "every rank"


def _rule_take_shard(op, types, module):
    if not isinstance(types[0], TensorType):
        raise TypeRuleError(f"{op.name} splits a full tensor; its operand is {types[0]}", 0)
    group = _group(module, op)
    parts = module.group_size(group)
    if parts is None:
        raise TypeRuleError(f"{op.name} needs the number of shards: give the module a world_size attribute")
    return [ShardType(types[0], parts, group)]


def _rule_all_gather(op, types, module):
    group = _group(module, op)
    out = []
    for i, t in enumerate(types):
        if not isinstance(t, ShardType):
            raise TypeRuleError(f"{op.name} gathers shards; operand #{i} is {t}", i)
        if t.over != group:
            raise TypeRuleError(f"{op.name} runs over {_over(group)}, but operand #{i} ({t}) is split over "
                                f"{_over(t.over)}: gather it with group = \"{t.over}\"" if t.over else
                                f"{op.name} runs over {_over(group)}, but operand #{i} ({t}) is split over every "
                                "rank: gather it without a group", i)
        out.append(PendingType(t.full))
    return out


def _rule_reduce_scatter(op, types, module):
    parts, group = _world(module, op), op.attrs.get("group")
    out = []
    for i, t in enumerate(types):
        if not isinstance(t, TensorType):
            raise TypeRuleError(f"{op.name} reduces full tensors; operand #{i} is {t}", i)
        out.append(PendingType(ShardType(t, parts, group)))
    return out


def _rule_all_to_all(op, types, module):
    t, parts = types[0], _world(module, op)
    if not (isinstance(t, TensorType) and t.shape and t.shape[0] == parts):
        raise TypeRuleError(f"{op.name} sends row p of a tensor to rank p: its operand needs one row per rank "
                            f"({parts}), got {t}", 0)
    return [PendingType(t)]


def _rule_all_reduce(op, types, module):
    _group(module, op)
    for i, t in enumerate(types):
        _full_or_shard(t, f"operand #{i} of {op.name}", i)
    return [PendingType(t) for t in types]


def _rule_wait(op, types, module):
    joins = OPS[op.name].joins
    out = []
    for i, t in enumerate(types):
        if not isinstance(t, PendingType):
            raise TypeRuleError(f"{op.name} joins pending values; operand #{i} is {t}", i)
        src = op.operands[i].owner
        d = lookup(src.name) if isinstance(src, Op) else None
        if d is not None and joins not in d.traits:
            other = next((d.name for d in OPS.values() if d.joins is not None and has_trait(src, d.joins)), None)
            raise TypeRuleError(f"{op.name} joins {joins.replace('_', ' ')} ops; %{op.operands[i].name} "
                                f"comes from {src.name}" + (f", which {other} joins" if other else ""), i)
        out.append(t.inner)
    return out


def _rule_free(op, types, module):
    return []  # any storage can be freed; pending operands are the verifier's async rule


def _rule_offload(op, types, module):
    t = _full_or_shard(types[0], "the offloaded value")
    return [PendingType(HostType(t))]


def _rule_reload(op, types, module):
    if not isinstance(types[0], HostType):
        raise TypeRuleError(f"mem.reload brings a host value back; the operand is {types[0]}", 0)
    return [PendingType(types[0].inner)]


def _rule_cast(op, types, module):
    t = _full_or_shard(types[0], "the cast value")
    to = op.attrs.get("dtype")
    full = TensorType(to.name, t.full.shape if isinstance(t, ShardType) else t.shape)
    return [replace(t, full=full) if isinstance(t, ShardType) else full]


def quantized_scales(shard: ShardType, block: int) -> TensorType:
    """The full tensor of a quantized shard's scales: every rank's ``ceil(chunk / block)``
    blocks, side by side (``mem.quantize``)."""
    blocks = -(-shard.layout.chunk // block)
    return TensorType("f32", (shard.parts * blocks,))


def quantized_types(shard: ShardType, block: int) -> tuple[ShardType, ShardType]:
    """What ``mem.quantize`` makes of ``shard``: the same shard in i8, and its scales'
    shard, split over the same ranks."""
    return (replace(shard, full=TensorType("i8", shard.full.shape)),
            ShardType(quantized_scales(shard, block), shard.parts, shard.over))


def quantized_rows(full: TensorType, parts: int, block: int) -> tuple[TensorType, TensorType]:
    """What ``mem.quantize {parts}`` makes of a full tensor: one i8 row per rank's chunk of
    it (the ``ShardLayout``: flattened, zero-padded) and the rows' scales, a block of
    ``block`` elements each; the operand of a quantized reduction's ``comm.all_to_all``."""
    chunk = ShardType(full, parts).layout.chunk
    return TensorType("i8", (parts, chunk)), TensorType("f32", (parts, -(-chunk // block)))


def _block(op) -> int:
    block = op.attrs.get("block")
    if not isinstance(block, int) or block < 1:
        raise TypeRuleError(f"{op.name} needs a positive block size ('block', elements per scale)")
    return block


def _rule_quantize(op, types, module):
    t, parts = types[0], op.attrs.get("parts")
    if isinstance(t, TensorType) and t.dtype in ("f32", "bf16", "f16"):
        if not isinstance(parts, int) or parts < 1:
            raise TypeRuleError(f"{op.name} of a full tensor quantizes it in rows, one per rank's chunk: give "
                                "'parts', the ranks")
        return list(quantized_rows(t, parts, _block(op)))
    if not (isinstance(t, ShardType) and t.dtype in ("f32", "bf16", "f16")):
        raise TypeRuleError(f"{op.name} quantizes a floating-point shard or full tensor; its operand is {t}", 0)
    if parts is not None:
        raise TypeRuleError(f"{op.name} of a shard quantizes it whole: 'parts' is for a full tensor, and the shard "
                            f"already says its ranks ({t.parts})")
    return list(quantized_types(t, _block(op)))


def _rule_dequantize(op, types, module):
    q, scales = types
    to, parts = op.attrs.get("dtype"), op.attrs.get("parts")
    if not (isinstance(q, TensorType) and q.dtype == "i8"):
        raise TypeRuleError(f"{op.name} dequantizes a gathered i8 tensor; operand #0 is {q}", 0)
    if not isinstance(parts, int) or parts < 1:
        raise TypeRuleError(f"{op.name} needs 'parts', the ranks the quantized shards came from")
    expect = quantized_scales(ShardType(q, parts), _block(op))
    if scales != expect:
        raise TypeRuleError(f"{op.name} needs the gathered scales of {parts} shards in blocks of {op.attrs['block']}, "
                            f"{expect}; operand #1 is {scales}", 1)
    return [TensorType(to.name, q.shape)]


def _rule_dequantize_reduce(op, types, module):
    """The rows carry no full shape: the declared shard gives it, and must fit the rows."""
    q, scales = types
    declared, group = op.results[0].type, _group(module, op)
    if not (isinstance(q, TensorType) and q.dtype == "i8" and len(q.shape) == 2):
        raise TypeRuleError(f"{op.name} sums the i8 rows a comm.all_to_all received; operand #0 is {q}", 0)
    if not (isinstance(declared, ShardType) and declared.dtype == op.attrs["dtype"].name and declared.over == group):
        raise TypeRuleError(f"{op.name} gives this rank's shard of the sum in {op.attrs['dtype'].name}; "
                            f"%{op.results[0].name} is declared {declared}")
    rows = quantized_rows(declared.full, declared.parts, _block(op))
    for i, (t, want) in enumerate(zip(types, rows)):
        if t != want:
            raise TypeRuleError(f"{op.name} into {declared} needs operand #{i} to be {want}, got {t}", i)
    return [declared]


def _rule_optim_step(op, types, module):
    decl = module.decls[op.symbol]
    if not decl.trainable:
        raise TypeRuleError(f"optim.step updates a trainable parameter; @{decl.name} is not one")
    for i, t in enumerate(types):
        _full_or_shard(t, f"optimizer state operand #{i}", i)
    return list(types)


def _rule_rng_get(op, types, module):
    if not isinstance(types[0], TensorType):
        raise TypeRuleError(f"rng.get reads the generator of a device tensor's device; the operand is {types[0]}", 0)
    declared = op.results[0].type
    if not isinstance(declared, TensorType) or declared.dtype != "u8" or len(declared.shape) != 1:
        raise TypeRuleError(f"a generator's state is a u8[N] tensor; %{op.results[0].name} is declared {declared}")
    return [declared]


def _rule_rng_set(op, types, module):
    state, where = types
    if not isinstance(state, TensorType) or state.dtype != "u8" or len(state.shape) != 1:
        raise TypeRuleError(f"rng.set takes a generator's state (u8[N], from rng.get); the state is {state}", 0)
    if not isinstance(where, TensorType):
        raise TypeRuleError(f"rng.set sets the generator of a device tensor's device; the operand is {where}", 1)
    return []


def _rule_aten(op, types, module):
    """aten result types come from capture (FX metadata); arity and kind are checked here."""
    sch = aten.schema(op.name)
    n = len(op.results)
    if not sch.variadic_results and n != len(sch.returns):
        k = len(sch.returns)
        raise TypeRuleError(f"{op.name} returns {k} value{'' if k == 1 else 's'}, but {n} are defined")
    for r in op.results:
        if not isinstance(r.type, TensorType) and r.type != NONE:
            raise TypeRuleError(f"compute results are device tensors (or none); %{r.name} is declared {r.type}")
    return [r.type for r in op.results]


def _rule_custom(op, types, module):
    """A custom op's result types are what its fake kernel computes on meta tensors (cached
    per operand types and attributes); arity and kind are checked as for aten."""
    _rule_aten(op, types, module)
    try:
        return shapes.infer(op.name, types, op.attrs)
    except shapes.ShapeError as e:
        raise TypeRuleError(f"the fake kernel of {op.name} rejects these operands: {e}") from None


# ---- the registry --------------------------------------------------------------------

_GROUP = {"group": AttrSpec("str")}
_REDUCE = {"op": AttrSpec("enum", required=True, choices=REDUCE_OPS), "group": AttrSpec("str"), "parts": AttrSpec("int")}

OPS: dict[str, OpDef] = {d.name: d for d in [
    OpDef("param.get", "Read this rank's storage of a parameter or buffer (its declared type).",
          (0, 0), (1, 1), frozenset({READS_STATE, LOADS_STATE}), _rule_param_get, symbol=True,
          example="%w = param.get @fc1.weight : shard<f32[16, 8], 2>"),
    OpDef("param.set", "Overwrite a parameter's or buffer's storage (BatchNorm running stats, optimizer updates).",
          (1, 1), (0, 0), frozenset({WRITES_STATE, SIDE_EFFECT}), _rule_param_set, symbol=True,
          example="param.set @bn.running_mean(%new_mean)"),
    OpDef("param.add", "Add a gradient into its accumulator's storage, in place (a tensor, or this rank's shard).",
          (1, 1), (0, 0), frozenset({READS_STATE, WRITES_STATE, SIDE_EFFECT}), _rule_param_add, symbol=True,
          example="param.add @fc1.weight.grad_acc(%g)"),
    OpDef("param.zero", "Zero a gradient accumulator's storage, in place (after the last reduction reading it).",
          (0, 0), (0, 0), frozenset({WRITES_STATE, SIDE_EFFECT}), _rule_param_zero, symbol=True,
          example="param.zero @fc1.weight.grad_acc"),
    OpDef("grad.set", "Hand the (reduced) gradient of a trainable parameter to the optimizer.",
          (1, 1), (0, 0), frozenset({SIDE_EFFECT, GRADIENT}), _rule_grad_set, symbol=True,
          example="grad.set @fc1.weight(%grad_shard)"),
    OpDef("comm.all_gather", "Start gathering a shard from every rank into the full tensor.",
          (1, 1), (1, 1), frozenset({ASYNC, COLLECTIVE, GATHERS, ALLOCATES}), _rule_all_gather, _GROUP,
          example="%p = comm.all_gather(%w) : pending<f32[16, 8]>", coalesced="comm.all_gather_coalesced"),
    OpDef("comm.all_gather_coalesced", "Start one all_gather for several shards.",
          (1, None), "per_operand", frozenset({ASYNC, COLLECTIVE, GATHERS, ALLOCATES}), _rule_all_gather, _GROUP,
          example="%p, %q = comm.all_gather_coalesced(%w, %b) : pending<f32[16, 8]>, pending<f32[16]>"),
    OpDef("comm.reduce_scatter", "Start reducing a full tensor across ranks; each rank gets its shard.",
          (1, 1), (1, 1), frozenset({ASYNC, COLLECTIVE, REDUCES, SCATTERS, ALLOCATES}), _rule_reduce_scatter, _REDUCE,
          example='%p = comm.reduce_scatter(%g) {op = "avg"} : pending<shard<f32[16, 8], 2>>',
          coalesced="comm.reduce_scatter_coalesced"),
    OpDef("comm.reduce_scatter_coalesced", "Start one reduce_scatter for several tensors.",
          (1, None), "per_operand", frozenset({ASYNC, COLLECTIVE, REDUCES, SCATTERS, ALLOCATES}), _rule_reduce_scatter,
          _REDUCE,
          example='%p, %q = comm.reduce_scatter_coalesced(%g, %h) {op = "avg"} : pending<shard<f32[16, 8], 2>>, pending<shard<f32[16], 2>>'),
    OpDef("comm.all_to_all", "Start sending row p of a tensor to rank p; row r of the result is what rank r sent "
          "this one.",
          (1, 1), (1, 1), frozenset({ASYNC, COLLECTIVE, EXCHANGES, ALLOCATES}), _rule_all_to_all, _GROUP,
          example="%p = comm.all_to_all(%g_q) : pending<i8[2, 64]>"),
    OpDef("comm.all_reduce", "Start reducing a tensor across ranks; every rank gets the result.",
          (1, 1), (1, 1), frozenset({ASYNC, COLLECTIVE, REDUCES, ALLOCATES}), _rule_all_reduce,
          {k: v for k, v in _REDUCE.items() if k != "parts"},
          example='%p = comm.all_reduce(%g) {op = "sum"} : pending<f32[16]>', coalesced="comm.all_reduce_coalesced"),
    OpDef("comm.all_reduce_coalesced", "Start one all_reduce for several tensors.",
          (1, None), "per_operand", frozenset({ASYNC, COLLECTIVE, REDUCES, ALLOCATES}), _rule_all_reduce,
          {k: v for k, v in _REDUCE.items() if k != "parts"},
          example='%p, %q = comm.all_reduce_coalesced(%g, %h) {op = "sum"} : pending<f32[16]>, pending<f32[4]>'),
    OpDef("comm.wait", "Join the pending values of collectives; results are usable values.",
          (1, None), "per_operand", frozenset({WAITS}), _rule_wait,
          example="%w_full = comm.wait(%p) : f32[16, 8]", joins=COLLECTIVE),
    OpDef("mem.free", "Release the storage of values (and of every view of them) after their last use.",
          (1, None), (0, 0), frozenset({FREES, SIDE_EFFECT}), _rule_free,
          example="mem.free(%w_full, %b_full)"),
    OpDef("mem.offload", "Start copying a device value to host memory.",
          (1, 1), (1, 1), frozenset({ASYNC, HOST_COPY, ALLOCATES}), _rule_offload,
          example="%h = mem.offload(%exp_avg) : pending<host<shard<f32[16, 8], 2>>>"),
    OpDef("mem.shard", "Copy this rank's shard of a full tensor split over the ranks of a group (no communication).",
          (1, 1), (1, 1), frozenset({PURE, ALLOCATES}), _rule_take_shard, _GROUP,
          example='%w_local = mem.shard(%w) {group = "local"} : shard<f32[16, 8], local=2>'),
    OpDef("mem.reload", "Start copying a host value back to the device.",
          (1, 1), (1, 1), frozenset({ASYNC, HOST_COPY, ALLOCATES}), _rule_reload,
          example="%d = mem.reload(%h) : pending<shard<f32[16, 8], 2>>"),
    OpDef("mem.cast", "Copy a tensor or shard converted to another element type (mixed precision: a shard cast "
          "before its gather, a gradient before its reduction).",
          (1, 1), (1, 1), frozenset({PURE, ALLOCATES, CASTS}), _rule_cast, {"dtype": AttrSpec("dtype", required=True)},
          example="%w_bf16 = mem.cast(%w) {dtype = bf16} : shard<bf16[16, 8], 2>"),
    OpDef("mem.quantize", "Quantize a shard to int8 in blocks, each with its f32 scale (absmax / 127): the shard "
          "a quantized gather moves (ZeRO++'s qwZ); with 'parts', a full tensor in one row per rank's chunk, "
          "what a quantized reduction sends (qgZ). Each element is off by at most half its block's scale.",
          (1, 1), (2, 2), frozenset({PURE, ALLOCATES}), _rule_quantize,
          {"block": AttrSpec("int", required=True), "parts": AttrSpec("int")},
          example="%w_q, %w_scales = mem.quantize(%w_shard) {block = 256} : shard<i8[16, 8], 2>, "
                  "shard<f32[2], 2>"),
    OpDef("mem.dequantize", "The full tensor of gathered int8 shards and their gathered scales (mem.quantize's "
          "inverse, up to its rounding).",
          (2, 2), (1, 1), frozenset({PURE, ALLOCATES}), _rule_dequantize,
          {"block": AttrSpec("int", required=True), "parts": AttrSpec("int", required=True),
           "dtype": AttrSpec("dtype", required=True)},
          example="%w = mem.dequantize(%w_q_full, %w_scales_full) {block = 256, parts = 2, dtype = f32} : "
                  "f32[16, 8]"),
    OpDef("mem.dequantize_reduce", "This rank's shard of the sum (or average) of the i8 rows every rank sent it "
          "(comm.all_to_all of mem.quantize's rows), each row dequantized with its scales and added in f32 in rank "
          "order: the reduction of a quantized reduce-scatter, over the all_to_all's group.",
          (2, 2), (1, 1), frozenset({PURE, ALLOCATES, REDUCES}), _rule_dequantize_reduce,
          {"block": AttrSpec("int", required=True), "op": AttrSpec("enum", required=True, choices=("sum", "avg")),
           "dtype": AttrSpec("dtype", required=True), **_GROUP},
          example='%g_shard = mem.dequantize_reduce(%g_rows, %g_row_scales) {block = 256, op = "avg", dtype = f32} : '
                  "shard<f32[16, 8], 2>"),
    OpDef("mem.wait", "Join the pending values of host copies (offloads, reloads); results are usable values.",
          (1, None), "per_operand", frozenset({WAITS}), _rule_wait,
          example="%d_dev = mem.wait(%d) : shard<f32[16, 8], 2>", joins=HOST_COPY),
    OpDef("rng.get", "Read the state of the default random generator of the operand's device (what the next "
          "random op draws from): activation checkpointing saves it before a random op it will replay.",
          (1, 1), (1, 1), frozenset({ALLOCATES}), _rule_rng_get,
          example="%rng_state = rng.get(%relu) : u8[5056]"),
    OpDef("rng.set", "Set the state of the default random generator of the second operand's device to the "
          "first (from rng.get): a recomputed random op draws what the forward drew.",
          (2, 2), (0, 0), frozenset({SIDE_EFFECT}), _rule_rng_set,
          example="rng.set(%rng_state, %relu)"),
    OpDef("optim.step", "Run the optimizer's update of one parameter with its gradient and the given state, in "
          "place; the results are the updated state (the operands' storage).",
          (0, None), "per_operand", frozenset({SIDE_EFFECT, READS_STATE, WRITES_STATE, OPTIMIZES}), _rule_optim_step,
          symbol=True,
          example="%m_1, %v_1 = optim.step @fc1.weight(%m, %v) : shard<f32[16, 8], 2>, shard<f32[16, 8], 2>"),
]}

ATEN = OpDef("aten.*", "Compute: one-to-one with a torch.ops.aten overload (operands are its tensor arguments, "
             "attributes its other arguments).", (0, None), (0, None),
             frozenset({PURE, COMPUTE, ALLOCATES, SCHEMA}), _rule_aten,
             example="%addmm = aten.addmm.default(%b, %x, %t) : f32[4, 16]")

_MUTATING_ATEN = OpDef("aten.*", ATEN.summary, (0, None), (0, None),
                       frozenset({COMPUTE, SIDE_EFFECT, ALLOCATES, SCHEMA}), _rule_aten, example=ATEN.example)

CUSTOM = OpDef("<namespace>.*", "Compute: an operator registered with torch.library outside aten, with a fake "
               "kernel (opaque: DCIR knows its schema and result shapes, not what it computes).", (0, None), (0, None),
               frozenset({PURE, COMPUTE, ALLOCATES, SCHEMA}), _rule_custom,
               example="%y = transformers.grouped_mm_fallback.default(%x, %w, %offs) : f32[16, 64]")

FAMILIES = ("aten", "comm", "grad", "mem", "optim", "param", "rng")

#: Attributes every op may carry. Keys with a dot (``prof.time_us``) are free-form too.
COMMON_ATTRS = {"ranks": AttrSpec("int_list")}


def lookup(name: str) -> OpDef | None:
    """The definition of op ``name``, or None if DCIR does not know it. ``OPS`` is read
    afresh each time (an op added to it, or taken out, is known or unknown at once); what
    torch's schemas say of an aten op is cached (the cost model asks for every op of every
    candidate schedule a pass prices). A name outside DCIR's families is a custom op,
    known once torch holds a usable one (``dcir.custom_ops``)."""
    d = OPS.get(name)
    if d is not None:
        return d
    if name.startswith("aten."):
        return _lookup_aten(name)
    if name.split(".", 1)[0] in FAMILIES:
        return None
    return CUSTOM if aten.schema(name) is not None else None


@lru_cache(maxsize=None)
def _lookup_aten(name: str) -> OpDef | None:
    sch = aten.schema(name)
    if sch is None:
        return None
    return _MUTATING_ATEN if sch.mutates else ATEN


def has_trait(op: Op, trait: str) -> bool:
    """Whether ``op`` is declared with ``trait``; the one question passes and models ask."""
    d = lookup(op.name)
    return d is not None and trait in d.traits


def coalesced_form(op: Op) -> str | None:
    """The op that does ``op``'s collective for several tensors at once (itself if it does)."""
    d = lookup(op.name)
    if d is None or not d.has(COLLECTIVE):
        return None
    return op.name if d.results == "per_operand" else d.coalesced


def is_coalesced(op: Op) -> bool:
    """Whether ``op`` is a collective over several tensors at once."""
    return coalesced_form(op) == op.name


def single_form(op: Op) -> str | None:
    """For a coalesced collective, the op that does the same for one tensor."""
    return next((d.name for d in OPS.values() if d.coalesced == op.name), None)


def wait_for(op: Op) -> str:
    """The wait op that joins the pending values of the async ``op``."""
    return next(d.name for d in OPS.values() if d.joins is not None and has_trait(op, d.joins))


#: ops whose result shares its operand's storage though their schema does not say so
#: (``_unsafe_view`` is ``view`` without the alias annotation)
STORAGE_SHARING = ("aten._unsafe_view.",)


def views(op: Op) -> dict[int, int]:
    """For each result that is a view of an operand's storage, the operand's index.
    Which schema arguments an op gives decides it, never their values."""
    if op.name == "optim.step":  # updates its operands in place
        return {i: i for i in range(min(len(op.operands), len(op.results)))}
    if not has_trait(op, SCHEMA):
        return {}
    if op.name.startswith(STORAGE_SHARING):
        return {0: 0}
    keys = tuple(k for k in op.attrs if "." not in k and k not in COMMON_ATTRS)
    return dict(_view_pairs(op.name, len(op.operands), keys, len(op.results)))


@lru_cache(maxsize=65536)
def _view_pairs(name: str, n_operands: int, keys: tuple[str, ...], n_results: int) -> tuple[tuple[int, int], ...]:
    sch = aten.schema(name)
    if sch is None:
        return ()
    try:
        bound = aten.bind(sch, n_operands, dict.fromkeys(keys), check_values=False)
    except aten.MappingError:
        return ()
    where = {a.name: src[1] for a, src in bound if src[0] == "operand"}
    pairs = []
    for i in range(n_results):
        arg = sch.aliased_operand(i)
        if arg in where:
            pairs.append((i, where[arg]))
    return tuple(pairs)
