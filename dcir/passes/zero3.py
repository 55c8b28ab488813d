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
from dcir import roles, signature
from dcir.accumulate import once_per_step
from dcir.context import PlanContext
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Function, Module, Op, PendingType, ShardType, TensorType, Value
from dcir.passes import Pass
from dcir.passes.free import FreePlacer
from dcir.rewrite import EDITED, Constraint, Match, P, Rewriter, Rule, apply_rules

# ---- rematerializing saved views of parameters ----------------------------------------


def _param_view_chain(v: Value, module: Module) -> list[Op] | None:
    """The ops from a ``param.get`` of a parameter to ``v`` when each is a view of the
    one before (``t``, ``view``, ``detach``...), else None."""
    chain = []
    while isinstance(v.owner, Op):
        op = v.owner
        if registry.has_trait(op, registry.LOADS_STATE):
            decl = module.decls.get(op.symbol)
            return list(reversed(chain)) if decl is not None and decl.kind == "param" else None
        if len(op.operands) != 1 or len(op.results) != 1 or registry.views(op) != {0: 0}:
            return None
        chain.append(op)
        v = op.operands[0]
    return None


def rematerialize_param_views(module: Module, stats: Counter) -> None:
    """Saved views of parameters are recomputed in each backward instead of passed to it
    (the saved values are the ones the signatures declare ``{saved}``)."""
    fw = roles.saver(module.functions.values())
    backs = [f for f in module.functions.values() if roles.takes_saved(f)]
    if fw is None or not backs:
        return
    saved = signature.result_indices(fw, signature.SAVED)
    chains = {i: _param_view_chain(fw.returns[i], module) for i in saved}
    dropped = {i for i, chain in chains.items() if chain is not None}
    if not dropped or any(len(signature.args(bw, signature.SAVED)) != len(saved) for bw in backs):
        return
    for bw in backs:
        args = signature.args(bw, signature.SAVED)
        _recompute(bw, [(args[k], fw.returns[i], chains[i]) for k, i in enumerate(saved) if i in dropped])
    stats["saved parameter views recomputed in backward"] += len(dropped)
    keep = [i for i in range(len(fw.returns)) if i not in dropped]
    Rewriter(fw).set_returns([fw.returns[i] for i in keep], attrs=[fw.result_attrs[i] for i in keep])


def _recompute(bw: Function, recompute: list) -> None:
    """Each (argument, saved value, view chain): the chain replayed from the parameter
    in ``bw`` just before the argument's first use, and the argument dropped."""
    fresh, rewriter = bw.name_maker(), Rewriter(bw)
    pos = {op: i for i, op in enumerate(bw.ops)}
    for arg, value, chain in recompute:
        # recomputed just before the first use, not all up front: the gathered parameter
        # then lives only as long as it must; the recomputed value takes the argument's name
        source = chain[0].operands[0] if chain else value  # the param.get's result
        cur = Value(arg.name if not chain else fresh(source.name), source.type)
        ops = [Op(source.owner.name, [], [cur], symbol=source.owner.symbol)]
        for k, op in enumerate(chain):
            cur = Value(arg.name if k == len(chain) - 1 else fresh(op.results[0].name), op.results[0].type)
            ops.append(Op(op.name, [ops[-1].results[0]], [cur], dict(op.attrs), parens=op.parens))
        first = min(arg.users(), key=pos.__getitem__, default=None)
        if first is None:
            rewriter.append(ops)
        else:
            rewriter.insert_before(first, ops)
        rewriter.replace_all_uses(arg, cur)
        rewriter.remove_arg(arg)


# ---- the rewrites ----------------------------------------------------------------------


def _facts(func: Function, over: str | None) -> dict:
    """What the rewrites read, computed once per function before any of them runs: the
    first reader of every value, the placer of the frees (liveness as the function
    came), a name maker, and the mesh dimension parameters are sharded over (None: all)."""
    first: dict[Value, Op] = {}
    for op in func.ops:
        for v in op.operands:
            first.setdefault(v, op)
    return {"first": first, "frees": FreePlacer(func), "fresh": func.name_maker(), "over": over}


def gather_before_first_use(m: Match):
    """%w = param.get @p : T  ->  %w_shard = param.get @p : shard<T, N>;
    before the first use of %w: %w_pending = comm.all_gather(%w_shard), %w = comm.wait;
    after the last use of %w or of a view of it: mem.free(%w)."""
    root, rewriter, fresh = m.root, m.rewriter, m["fresh"]
    full, over = root.results[0], m["over"]
    shard = Value(fresh(f"{full.name}_shard"), ShardType(full.type, m.module.group_size(over), over))
    rewriter.insert_before(root, [Op(root.name, [], [shard], dict(root.attrs), root.symbol, root.loc, root.parens)])
    if full.uses:
        pending = Value(fresh(f"{full.name}_pending"), PendingType(full.type))
        gathered = Value(full.name, full.type)
        start = Op("comm.all_gather", [shard], [pending], _group(over))
        rewriter.insert_before(m["first"][full], [start, Op(registry.wait_for(start), [pending], [gathered])])
        rewriter.replace_all_uses(full, gathered)
        m["frees"].release(rewriter, full, gathered)
    rewriter.erase(root)
    return EDITED


def reduce_then_hand_over(m: Match):
    """grad.set @p(%g)  ->  %g_pending = comm.reduce_scatter(%g) {op = "avg"};
    %g_shard = comm.wait(%g_pending); grad.set @p(%g_shard); mem.free(%g) when the
    full gradient has no other use (under HSDP, over the node: ``{group = "local"}``)."""
    root, rewriter, fresh, over = m.root, m.rewriter, m["fresh"], m["over"]
    grad = root.operands[0]
    shard_type = ShardType(grad.type, m.module.group_size(over), over)
    pending = Value(fresh(f"{grad.name}_pending"), PendingType(shard_type))
    shard = Value(fresh(f"{grad.name}_shard"), shard_type)
    start = Op("comm.reduce_scatter", [grad], [pending], {"op": "avg", **_group(over)})
    rewriter.insert_before(root, [start, Op(registry.wait_for(start), [pending], [shard])])
    rewriter.set_operands(root, [shard])
    m["frees"].release(rewriter, grad)
    return EDITED


def average_across_nodes(func: Function) -> None:
    """HSDP: each node-local gradient shard handed over is first averaged across the nodes
    (``%g_avg = comm.wait(comm.all_reduce(%g_shard) {group = "nodes"})``, the node-local
    shard freed once it is)."""
    rewriter, fresh = Rewriter(func), func.name_maker()
    for hand in [op for op in func.ops if registry.has_trait(op, registry.GRADIENT)]:
        shard = hand.operands[0]
        if not (isinstance(shard.type, ShardType) and shard.type.over == LOCAL):
            continue
        pending = Value(fresh(f"{shard.name}_across"), PendingType(shard.type))
        avg = Value(fresh(f"{shard.name}_avg"), shard.type)
        across = Op("comm.all_reduce", [shard], [pending], {"op": "avg", "group": NODES})
        rewriter.insert_before(hand, [across, Op(registry.wait_for(across), [pending], [avg]), Op("mem.free", [shard])])
        rewriter.set_operands(hand, [avg])


def _group(over: str | None) -> dict:
    return {"group": over} if over is not None else {}


def _full_param(m: Match) -> bool:
    decl = m.module.decls.get(m.root.symbol)
    return decl is not None and decl.kind == "param" and isinstance(decl.type, TensorType)


full_param = Constraint("names an unsharded parameter", _full_param)
used = Constraint("its result is used", lambda m: bool(m.root.results[0].uses))
unused = Constraint("its result is unused", lambda m: not m.root.results[0].uses)

RULES = [
    # param.get @p (unsharded) -> shard read, gather before first use, free after last
    Rule(P(trait=registry.LOADS_STATE), gather_before_first_use, (full_param, used), "parameters gathered"),
    # param.get @p whose result nothing reads -> shard read only
    Rule(P(trait=registry.LOADS_STATE), gather_before_first_use, (full_param, unused),
         "parameters read but unused", dead_too=True),
    # grad.set @p(%g) -> reduce-scatter (average), wait, hand over the shard, free %g
    Rule(P(trait=registry.GRADIENT), reduce_then_hand_over, (full_param,), "gradients reduce-scattered"),
]


#: the mesh ``zero3{nodes=N}`` declares: ``nodes`` × ``local`` ranks (row-major: a node's ranks are consecutive)
NODES, LOCAL = "nodes", "local"
#: where ``zero3{accumulate=...}`` keeps gradients across micro-steps
SHARD, FULL = "shard", "full"


@dataclass(frozen=True)
class Zero3(Pass):
    name = "zero3"
    world_size: int = 2
    #: nodes the ranks are on (above 1, the module declares the mesh nodes × local)
    nodes: int = 1
    #: what parameters are sharded over: "world" (every rank) or "local" (the ranks of a
    #: node, replicated across nodes: HSDP)
    shard: str = "world"
    #: micro-steps per optimizer step; above 1, HSDP averages across nodes once per optimizer step
    micro_steps: int = 1
    #: where gradients accumulate across micro-steps: "shard" (each micro-step's gradient
    #: reduce-scattered into the shard, FSDP2's default) or "full" (summed in full
    #: gradients and reduce-scattered once per optimizer step, FSDP2's
    #: ``set_requires_gradient_sync(False)``: fewer bytes for a full gradient held)
    accumulate: str = "shard"

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError("world_size must be at least 1")
        if self.nodes < 1 or self.world_size % self.nodes:
            raise ValueError(f"nodes must divide world_size ({self.world_size}); got {self.nodes}")
        if self.shard not in ("world", LOCAL):
            raise ValueError(f'shard must be "world" or "local"; got "{self.shard}"')
        if self.micro_steps < 1:
            raise ValueError("micro_steps must be at least 1")
        if self.accumulate not in (SHARD, FULL):
            raise ValueError(f'accumulate must be "{SHARD}" or "{FULL}"; got "{self.accumulate}"')
        if self.accumulate == FULL and self.shard == LOCAL:
            raise ValueError(f'accumulate="{FULL}" sums over one flat group; shard=local already averages across '
                             f'nodes once per optimizer step')

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        if any(isinstance(d.type, ShardType) for d in module.decls.values()):
            raise DcirError(Diagnostic(f"zero3: @{module.name} is sharded already", module.source, module.loc, 6))
        rematerialize_param_views(module, stats)
        module.attrs["world_size"] = self.world_size
        if self.nodes > 1 or self.shard == LOCAL:
            module.attrs[f"mesh.{NODES}"], module.attrs[f"mesh.{LOCAL}"] = self.nodes, self.world_size // self.nodes
        over = LOCAL if self.shard == LOCAL else None
        apply_rules(module, RULES, stats, max_iterations=1, context=lambda f: _facts(f, over))
        for decl in module.decls.values():
            if decl.kind == "param" and isinstance(decl.type, TensorType):
                decl.type = ShardType(decl.type, module.group_size(over), over)
        if over is not None and self.nodes > 1:
            for func in module.functions.values():
                average_across_nodes(func)
        if over is not None and self.nodes > 1 and self.micro_steps > 1:
            once_per_step(module, stats, registry.REDUCES, lambda decl, grad: grad.type,
                          "zero3: gradients averaged across nodes once per optimizer step")
        if self.accumulate == FULL and self.micro_steps > 1:
            once_per_step(module, stats, registry.SCATTERS, lambda decl, grad: grad.type,
                          "zero3: gradients summed in full and reduce-scattered once per optimizer step")
