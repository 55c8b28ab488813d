"""ZeRO-2: gradients and optimizer state sharded, parameters replicated.

Every rank holds every parameter whole, so forward and backward gather nothing. Each
rank also keeps its flat shard of every parameter (``shard<T, N>``): that shard is
what the optimizer updates, with sharded optimizer state. After each optimizer step
the updated shards are gathered back into the replicas.

The pass is ``zero3`` followed by one rewrite. ``zero3`` shards the parameters and
reduce-scatters every gradient in ``@backward``; the full gradient is freed once its
reduction is done, so a rank holds gradients only as shards. Then every parameter
gets a buffer for its replica (``buffer @w.unsharded : f32[4, 8] {unshard.of =
@w}``), every gather of it becomes a read of the replica, and a function
``@unshard`` gathers all replicas from the shards. The Engine runs ``@unshard``
before the first micro-step of every optimizer step, which is after the previous
step's update (the same mechanism as ``unshard{micro_steps=N}``).

The gradient reductions stay where ``zero3`` put them, one per gradient;
``prefetch`` starts each one as soon as its gradient exists, so it overlaps the rest
of the backward, and ``bucket`` merges them (and ``@unshard``'s gathers) into
coalesced collectives where the cost model says it pays.

Before -> after (world_size 2)::

    param @fc.weight : f32[4, 8] {trainable}
    func @forward(%x: f32[2, 8]) -> (f32[2, 4]) {
      %w = param.get @fc.weight : f32[4, 8]
      ...
    grad.set @fc.weight(%g)
  ->
    param @fc.weight : shard<f32[4, 8], 2> {trainable}
    buffer @fc.weight.unsharded : f32[4, 8] {unshard.of = @fc.weight}
    func @forward(%x: f32[2, 8]) -> (f32[2, 4]) {
      %w = param.get @fc.weight.unsharded : f32[4, 8]
      ...
    %g_pending = comm.reduce_scatter(%g) {op = "avg"} : pending<shard<f32[4, 8], 2>>
    %g_shard = comm.wait(%g_pending) : shard<f32[4, 8], 2>
    grad.set @fc.weight(%g_shard)
    mem.free(%g)
    ...
    func @unshard() {
      %fc_weight_shard = param.get @fc.weight : shard<f32[4, 8], 2>
      %fc_weight_pending = comm.all_gather(%fc_weight_shard) : pending<f32[4, 8]>
      %fc_weight = comm.wait(%fc_weight_pending) : f32[4, 8]
      param.set @fc.weight.unsharded(%fc_weight)
      mem.free(%fc_weight)
    }
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir.context import PlanContext
from dcir.ir import Module, ShardType
from dcir.passes import Pass
from dcir.passes.unshard import gather_once_a_step, param_gathers
from dcir.passes.zero3 import Zero3


def replicate_parameters(module: Module, stats: Counter, pass_name: str) -> None:
    """After ``zero3``: every sharded parameter is read from a replica that ``@unshard``
    gathers once per optimizer step."""
    gathers: dict[str, list] = {}
    for func in module.functions.values():
        for name, gs in param_gathers(func).items():
            gathers.setdefault(name, []).extend(gs)
    replicated = [(name, gathers.get(name, [])) for name, decl in module.decls.items()
                  if decl.kind == "param" and isinstance(decl.type, ShardType)]
    if replicated:
        stats[f"{pass_name}: parameters replicated"] += len(replicated)
    gather_once_a_step(module, replicated)


@dataclass(frozen=True)
class Zero2(Pass):
    name = "zero2"
    world_size: int = 2

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError("world_size must be at least 1")

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        Zero3(world_size=self.world_size).run(module, stats, ctx)
        replicate_parameters(module, stats, self.name)
