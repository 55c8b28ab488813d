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
    fw, bw = module.functions.get("forward"), module.functions.get("backward")
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
    ops = []
    for arg, value, chain in recompute:
        source = value
        while isinstance(source.owner, Op) and source.owner.name != "param.get":
            source = source.owner.operands[0]
        cur = Value(bw.fresh_name(source.name), source.type)
        ops.append(Op("param.get", [], [cur], symbol=source.owner.symbol))
        bw.ops.insert(0, ops[-1])  # so fresh_name sees the names taken so far
        for k, op in enumerate(chain):
            last = k == len(chain) - 1
            res = Value(arg.name if last else bw.fresh_name(op.results[0].name), op.results[0].type)
            if last:
                arg.name = f"{arg.name}__saved"  # the argument goes away; its name passes to the recomputed value
            ops.append(Op(op.name, [cur], [res], dict(op.attrs), parens=op.parens))
            bw.ops.insert(0, ops[-1])
            cur = res
        _replace_uses(bw, arg, cur)
        stats["saved parameter views recomputed in backward"] += 1
    del bw.ops[:len(ops)]
    bw.ops[:0] = ops
    fw.returns = keep_returns
    fw.result_types = [v.type for v in keep_returns]
    tangent = bw.args[-1]
    bw.args = keep_args + [tangent]
    for i, a in enumerate(bw.args):
        a.owner, a.index = bw, i


def _replace_uses(func: Function, old: Value, new: Value) -> None:
    for op in func.ops:
        op.operands = [new if v is old else v for v in op.operands]
    func.returns = [new if v is old else v for v in func.returns]


# ---- the rewrites ---------------------------------------------------------------------


def gather_before_first_use(func: Function, op: Op, world: int, insert_at, free_after) -> None:
    """%w = param.get @p : T  ->  %w_shard = param.get @p : shard<T, N>;
    before the first use of %w: %w_pending = comm.all_gather(%w_shard), %w = comm.wait;
    after the last use of %w or of a view of it: mem.free(%w)."""
    full = op.results[0]
    shard = Value(func.fresh_name(f"{full.name}_shard"), ShardType(full.type, world))
    op.results = [shard]
    shard.owner, shard.index = op, 0
    pending = Value(func.fresh_name(f"{full.name}_pending"), PendingType(full.type))
    insert_at(full, [Op("comm.all_gather", [shard], [pending]), Op("comm.wait", [pending], [full])])
    free_after(full)


def reduce_then_hand_over(func: Function, op: Op, world: int, replace, free_after) -> None:
    """grad.set @p(%g)  ->  %g_pending = comm.reduce_scatter(%g) {op = "avg"};
    %g_shard = comm.wait(%g_pending); grad.set @p(%g_shard); mem.free(%g) when the
    full gradient has no other use."""
    grad = op.operands[0]
    shard_type = ShardType(grad.type, world)
    pending = Value(func.fresh_name(f"{grad.name}_pending"), PendingType(shard_type))
    shard = Value(func.fresh_name(f"{grad.name}_shard"), shard_type)
    op.operands = [shard]
    replace(op, [Op("comm.reduce_scatter", [grad], [pending], {"op": "avg"}),
                 Op("comm.wait", [pending], [shard]), op])
    free_after(grad)


def _is_param(module: Module, op: Op) -> bool:
    decl = module.decls.get(op.symbol)
    return decl is not None and decl.kind == "param" and isinstance(decl.type, TensorType)


# op name -> (named constraint, rewrite); the constraint reads the op and the module
RULES = {
    # param.get of a parameter -> shard read, gather before first use, free after last
    "param.get": (_is_param, gather_before_first_use),
    # grad.set of a full gradient -> reduce-scatter (average), wait, hand over the shard
    "grad.set": (_is_param, reduce_then_hand_over),
}


def _shard_function(module: Module, func: Function, world: int, stats: Counter) -> None:
    last, returned = last_uses(func)
    owners = storage_owners(func)
    before: dict[int, list[Op]] = {}
    after: dict[int, list[Op]] = {}
    replaced: dict[Op, list[Op]] = {}

    def first_use(v: Value) -> int:
        return next((i for i, op in enumerate(func.ops) if v in op.operands), len(func.ops))

    def insert_at(v: Value, new_ops: list[Op]) -> None:
        before.setdefault(first_use(v), []).extend(new_ops)

    def free_after(v: Value) -> None:
        owner = owners.get(v, v)
        if owner in returned or owner in func.args or owner not in last:
            return
        end = last[owner]
        freeing = after.setdefault(end, [])
        if not any(owner in f.operands for f in freeing):
            freeing.append(Op("mem.free", [owner], parens=True))

    for op in list(func.ops):
        rule = RULES.get(op.name)
        if rule is None or not rule[0](module, op):
            continue
        constraint, rewrite = rule
        if rewrite is gather_before_first_use and first_use(op.results[0]) == len(func.ops):
            op.results[0].type = ShardType(op.results[0].type, world)  # never used: nothing to gather
            continue
        if rewrite is gather_before_first_use:
            rewrite(func, op, world, insert_at, free_after)
            stats["parameters gathered"] += 1
        else:
            rewrite(func, op, world, lambda o, new: replaced.__setitem__(o, new), free_after)
            stats["gradients reduce-scattered"] += 1
    new_ops: list[Op] = []
    for i, op in enumerate(func.ops):
        new_ops.extend(before.get(i, ()))
        new_ops.extend(replaced.get(op, [op]))
        new_ops.extend(after.get(i, ()))
    func.ops = new_ops


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
