"""Hierarchical partitions (ZeRO++'s hpZ): the backward gathers parameters within the node.

Under ``zero3{nodes=N}`` every parameter is sharded over all ranks, so each of its
gathers crosses nodes: once in ``@forward`` and again in every backward. This pass keeps
a secondary, node-local partition of each parameter the forward gathers: right after the
forward's gather, each rank takes its shard of the full tensor split over its node's
ranks (``mem.shard {group = "local"}``: a copy, no communication) and hands it to the
backward with the saved values; the backward gathers it over the node (``{group =
"local"}``) instead of over every rank. The forward's gathers and every gradient's
reduce-scatter still span all ranks (ZeRO-3's memory for parameters and optimizer
state); the secondary partitions cost each rank ``1 / local`` of the parameters from
the forward to the backward. Parameters sharded over the node already (HSDP,
``zero3{shard=local}``) have nothing to gain and are left as they are.

Before -> after (``zero3{world_size=4, nodes=2}``)::

    func @forward(%x) -> (f32[], f32[2, 8] {saved}) {
      %w_shard = param.get @w : shard<f32[4, 8], 4>
      %w_pending = comm.all_gather(%w_shard) : pending<f32[4, 8]>
      %w = comm.wait(%w_pending) : f32[4, 8]
      ...
    func @backward(%x: f32[2, 8] {saved}, %tangent: f32[] {grad = 0}) {
      %w_shard = param.get @w : shard<f32[4, 8], 4>
      %w_pending = comm.all_gather(%w_shard) : pending<f32[4, 8]>
  ->
    func @forward(%x) -> (f32[], f32[2, 8] {saved}, shard<f32[4, 8], local=2> {saved}) {
      %w_shard = param.get @w : shard<f32[4, 8], 4>
      %w_pending = comm.all_gather(%w_shard) : pending<f32[4, 8]>
      %w = comm.wait(%w_pending) : f32[4, 8]
      %w_local = mem.shard(%w) {group = "local"} : shard<f32[4, 8], local=2>
      ...
    func @backward(%x: f32[2, 8] {saved}, %w_local: shard<f32[4, 8], local=2> {saved}, %tangent: f32[] {grad = 0}) {
      %w_pending = comm.all_gather(%w_local) {group = "local"} : pending<f32[4, 8]>
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import roles, signature
from dcir.context import PlanContext
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Module, Op, ShardType, Value
from dcir.passes import Pass
from dcir.passes.unshard import Gather, param_gathers
from dcir.passes.zero3 import LOCAL
from dcir.rewrite import Rewriter


def _secondary(module: Module, name: str, fw: Gather, backs: list) -> None:
    """``@p``'s node-local partition, taken in ``@forward`` after ``fw`` and handed to each
    backward, whose gather of ``@p`` (in ``backs``: (function, its gathers of ``@p``))
    gathers it over the node instead."""
    forward = module.role(roles.FORWARD)
    full = fw.full
    part = ShardType(full.type, module.mesh[LOCAL], LOCAL)
    local = Value(forward.fresh_name(full.name + "_local"), part)
    Rewriter(forward).insert_after(fw.wait, [Op("mem.shard", [full], [local], {"group": LOCAL})])
    Rewriter(forward).set_returns([*forward.returns, local],
                                  attrs=[*forward.result_attrs, signature.mark(signature.SAVED)])
    for func, gathers in backs:
        rewriter = Rewriter(func)
        arg = Value(func.fresh_name(local.name), part)
        rewriter.insert_arg(arg, signature.first_grad(func), signature.mark(signature.SAVED))
        for g in gathers:
            rewriter.set_operands(g.start, [arg])
            rewriter.set_attr(g.start, "group", LOCAL)
            if not g.get.results[0].uses:
                rewriter.erase(g.get)


@dataclass(frozen=True)
class Hierarchical(Pass):
    name = "hierarchical"

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        if LOCAL not in module.mesh:
            raise DcirError(Diagnostic(f"hierarchical: @{module.name} declares no node-local mesh dimension "
                                       f"\"{LOCAL}\": shard it with zero3{{nodes=N}} first", module.source,
                                       module.loc, 6))
        forward = module.role(roles.FORWARD)
        backs = [f for f in module.functions.values() if roles.takes_saved(f)]
        if forward is None or not backs:
            return
        gathered = param_gathers(forward)
        in_backs = [param_gathers(f) for f in backs]
        for name, fws in gathered.items():
            decl = module.decls[name]
            if not isinstance(decl.type, ShardType) or decl.type.over is not None or len(fws) != 1:
                stats["hierarchical: left as they are (sharded over the node, or gathered twice)"] += 1
                continue
            mine = [(f, g[name]) for f, g in zip(backs, in_backs) if g.get(name)]
            if not mine:
                continue
            _secondary(module, name, fws[0], mine)
            stats["hierarchical: parameters gathered within the node in the backward"] += 1
