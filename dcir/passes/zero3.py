"""ZeRO-3: shard every parameter across the ranks; gather it where it is used.

Each parameter is flattened, padded and split into ``world_size`` shards; a rank keeps
one (``shard<T, N>``). Then, in every function:

* a parameter is gathered just before its first use (``comm.all_gather`` ->
  ``comm.wait``) and freed after its last use, views included (so the full tensor
  lives only while compute needs it, in forward and again in backward);
* each gradient is averaged across the ranks with ``comm.reduce_scatter`` and each
  rank hands its own shard to the optimizer; the full gradient is freed once the
  reduction is done.

A view of a parameter that ``@forward`` saves for ``@backward`` (``aten.t`` of a
weight, as AOTAutograd saves it) would keep the gathered parameter alive between the
two; the pass recomputes such views in ``@backward`` from a fresh gather instead.
The pass does not reorder anything for overlap: that is ``prefetch``'s job.

Before -> after (world_size 2)::

    param @fc.weight : f32[4, 8] {trainable}
    %w = param.get @fc.weight : f32[4, 8]
    %t = aten.t.default(%w) : f32[8, 4]
    %y = aten.mm.default(%x, %t) : f32[2, 4]
    ...
    grad.set @fc.weight(%g)
  ->
    param @fc.weight : shard<f32[4, 8], 2> {trainable}
    %w_shard = param.get @fc.weight : shard<f32[4, 8], 2>
    %w_pending = comm.all_gather(%w_shard) : pending<f32[4, 8]>
    %w = comm.wait(%w_pending) : f32[4, 8]
    %t = aten.t.default(%w) : f32[8, 4]
    %y = aten.mm.default(%x, %t) : f32[2, 4]
    mem.free(%w)
    ...
    %g_pending = comm.reduce_scatter(%g) {op = "avg"} : pending<shard<f32[4, 8], 2>>
    %g_shard = comm.wait(%g_pending) : shard<f32[4, 8], 2>
    grad.set @fc.weight(%g_shard)
    mem.free(%g)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import ops as registry
from dcir.analysis import last_uses, storage_owners
from dcir import roles
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Function, Module, Op, PendingType, ShardType, TensorType, Value
from dcir.passes import Pass

# ---- rematerializing saved views of parameters ----------------------------------------


def _param_view_chain(v: Value, module: Module) -> list[Op] | None:
    """The ops from a ``param.get`` of a parameter to ``v`` when each is a view of the
    one before (``t``, ``view``, ``detach``...), else None."""
    chain = []
    while isinstance(v.owner, Op):
        op = v.owner
        if op.name == "param.get":
            decl = module.decls.get(op.symbol)
            return list(reversed(chain)) if decl is not None and decl.kind == "param" else None
        if len(op.operands) != 1 or len(op.results) != 1 or registry.views(op) != {0: 0}:
            return None
        chain.append(op)
        v = op.operands[0]
    return None


def rematerialize_param_views(module: Module, stats: Counter) -> None:
    """Saved views of parameters are recomputed in @backward instead of passed to it.

    Relies on the capture convention: @forward returns (loss, *saved) and @backward
    takes (*saved, tangent)."""
    fw, bw = module.functions.get(roles.FORWARD), module.functions.get(roles.BACKWARD)
    if fw is None or bw is None or len(bw.args) != len(fw.returns):
        return
    keep_returns, keep_args, recompute = [fw.returns[0]], [], []
    for value, arg in zip(fw.returns[1:], bw.args[:-1]):
        chain = _param_view_chain(value, module)
        if chain is None:
            keep_returns.append(value)
            keep_args.append(arg)
        else:
            recompute.append((arg, value, chain))
    if not recompute:
        return
    fresh = bw.name_maker()
    first_use: dict[Value, int] = {}
    for i, op in enumerate(bw.ops):
        for v in op.operands:
            first_use.setdefault(v, i)
    before: dict[int, list[Op]] = {}  # recomputed just before the first use, not all up front:
    replacement = {}                   # the gathered parameter then lives only as long as it must
    for arg, value, chain in recompute:
        # the argument goes away, so the recomputed value (the chain's last) takes its name
        source = chain[0].operands[0] if chain else value  # the param.get's result
        cur = Value(arg.name if not chain else fresh(source.name), source.type)
        ops = [Op("param.get", [], [cur], symbol=source.owner.symbol)]
        for k, op in enumerate(chain):
            name = arg.name if k == len(chain) - 1 else fresh(op.results[0].name)
            cur = Value(name, op.results[0].type)
            ops.append(Op(op.name, [ops[-1].results[0]], [cur], dict(op.attrs), parens=op.parens))
        replacement[arg] = cur
        before.setdefault(first_use.get(arg, len(bw.ops)), []).extend(ops)
        stats["saved parameter views recomputed in backward"] += 1
    for op in bw.ops:
        op.operands = [replacement.get(v, v) for v in op.operands]
    bw.returns = [replacement.get(v, v) for v in bw.returns]
    bw.ops = [new for i, op in enumerate(bw.ops) for new in (*before.get(i, ()), op)] + before.get(len(bw.ops), [])
    fw.returns = keep_returns
    fw.result_types = [v.type for v in keep_returns]
    tangent = bw.args[-1]
    bw.args = keep_args + [tangent]
    for i, a in enumerate(bw.args):
        a.owner, a.index = bw, i


# ---- the rewrites ----------------------------------------------------------------------


class _Edit:
    """What a rewrite may do to a function: new names, ops before a value's first use,
    an op replaced by several, a free after a storage's last use. Applied at the end,
    in one pass, from facts computed once (``dcir.analysis``)."""

    def __init__(self, func: Function, world: int):
        self.func, self.world = func, world
        self.fresh = func.name_maker()
        self.first: dict[Value, int] = {}
        for i, op in enumerate(func.ops):
            for v in op.operands:
                self.first.setdefault(v, i)
        self.last, self.returned = last_uses(func)
        self.owners = storage_owners(func)
        self.before: dict[int, list[Op]] = {}
        self.after: dict[int, list[Op]] = {}
        self.replaced: dict[Op, list[Op]] = {}

    def used(self, v: Value) -> bool:
        return v in self.first

    def insert_before_first_use(self, v: Value, ops: list[Op]) -> None:
        self.before.setdefault(self.first[v], []).extend(ops)

    def replace(self, op: Op, ops: list[Op]) -> None:
        self.replaced[op] = ops

    def free_after_last_use(self, v: Value) -> None:
        """Free the storage of ``v`` after its last reader, unless the function returns
        it or received it (an argument is its caller's to free)."""
        owner = self.owners.get(v, v)
        if owner in self.returned or owner in self.func.args or owner not in self.last:
            return
        frees = self.after.setdefault(self.last[owner], [])
        if not any(owner in f.operands for f in frees):
            frees.append(Op("mem.free", [owner], parens=True))

    def apply(self) -> None:
        ops: list[Op] = []
        for i, op in enumerate(self.func.ops):
            ops.extend(self.before.get(i, ()))
            ops.extend(self.replaced.get(op, [op]))
            ops.extend(self.after.get(i, ()))
        self.func.ops = ops


def gather_before_first_use(edit: _Edit, op: Op, stats: Counter) -> None:
    """%w = param.get @p : T  ->  %w_shard = param.get @p : shard<T, N>;
    before the first use of %w: %w_pending = comm.all_gather(%w_shard), %w = comm.wait;
    after the last use of %w or of a view of it: mem.free(%w)."""
    full = op.results[0]
    shard = Value(edit.fresh(f"{full.name}_shard"), ShardType(full.type, edit.world), op, 0)
    op.results = [shard]
    if not edit.used(full):
        return  # read but never used: nothing to gather
    pending = Value(edit.fresh(f"{full.name}_pending"), PendingType(full.type))
    edit.insert_before_first_use(full, [Op("comm.all_gather", [shard], [pending]), Op("comm.wait", [pending], [full])])
    edit.free_after_last_use(full)
    stats["parameters gathered"] += 1


def reduce_then_hand_over(edit: _Edit, op: Op, stats: Counter) -> None:
    """grad.set @p(%g)  ->  %g_pending = comm.reduce_scatter(%g) {op = "avg"};
    %g_shard = comm.wait(%g_pending); grad.set @p(%g_shard); mem.free(%g) when the
    full gradient has no other use."""
    grad = op.operands[0]
    shard_type = ShardType(grad.type, edit.world)
    pending = Value(edit.fresh(f"{grad.name}_pending"), PendingType(shard_type))
    shard = Value(edit.fresh(f"{grad.name}_shard"), shard_type)
    op.operands = [shard]
    edit.replace(op, [Op("comm.reduce_scatter", [grad], [pending], {"op": "avg"}),
                      Op("comm.wait", [pending], [shard]), op])
    edit.free_after_last_use(grad)
    stats["gradients reduce-scattered"] += 1


def _is_param(module: Module, op: Op) -> bool:
    decl = module.decls.get(op.symbol)
    return decl is not None and decl.kind == "param" and isinstance(decl.type, TensorType)


# op name -> (named constraint, rewrite); the constraint reads the module and the op
RULES = {
    # param.get of a parameter -> shard read, gather before first use, free after last
    "param.get": (_is_param, gather_before_first_use),
    # grad.set of a full gradient -> reduce-scatter (average), wait, hand over the shard
    "grad.set": (_is_param, reduce_then_hand_over),
}


def _shard_function(module: Module, func: Function, world: int, stats: Counter) -> None:
    edit = _Edit(func, world)
    for op in list(func.ops):
        rule = RULES.get(op.name)
        if rule is not None and rule[0](module, op):
            rule[1](edit, op, stats)
    edit.apply()


@dataclass(frozen=True)
class Zero3(Pass):
    name = "zero3"
    world_size: int = 2

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError("world_size must be at least 1")

    def run(self, module: Module, stats: Counter) -> None:
        if any(isinstance(d.type, ShardType) for d in module.decls.values()):
            raise DcirError(Diagnostic(f"zero3: @{module.name} is sharded already", module.source, module.loc, 6))
        rematerialize_param_views(module, stats)
        module.attrs["world_size"] = self.world_size
        for func in module.functions.values():
            _shard_function(module, func, self.world_size, stats)
        for decl in module.decls.values():
            if decl.kind == "param" and isinstance(decl.type, TensorType):
                decl.type = ShardType(decl.type, self.world_size)
