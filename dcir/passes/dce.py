"""Dead code elimination: remove ops whose results nothing observable needs.

An op is live when it has a side effect (``grad.set``, ``param.set``, a mutating aten
op), when the function returns one of its results, or when a live op reads its
results. Everything else goes, collectives included (the pass sees the same IR on
every rank, so every rank drops the same ones). A ``mem.free`` loses the operands
that are gone and disappears when none is left.

Before -> after::

    %a = aten.relu.default(%x) : f32[4]        // unused
    %p = comm.all_gather(%w) : pending<f32[8]>
    %w_full = comm.wait(%p) : f32[8]            // only freed
    mem.free(%w_full)
    return %x
  ->
    return %x
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import ops as registry
from dcir.analysis import live_ops
from dcir.context import PlanContext
from dcir.ir import Function, Module
from dcir.passes import Pass
from dcir.rewrite import Rewriter


def eliminate_dead_code(func: Function, stats: Counter) -> None:
    """Erase the ops of ``func`` that nothing observable needs; frees keep what is left."""
    rewriter = Rewriter(func)
    live = live_ops(func)
    dead = [op for i, op in enumerate(func.ops) if i not in live]
    kept = {v for i, op in enumerate(func.ops) if i in live for v in op.results}
    kept.update(func.args)
    for op in dead:
        if not registry.has_trait(op, registry.FREES):
            continue
        alive = [v for v in op.operands if v in kept]
        if alive:
            rewriter.set_operands(op, alive)
        else:
            rewriter.erase(op)
            stats["ops removed"] += 1
    for op in reversed(dead):  # readers before what they read, so each is unused when erased
        if not registry.has_trait(op, registry.FREES):
            rewriter.erase(op)
            stats["ops removed"] += 1


@dataclass(frozen=True)
class DeadCodeElimination(Pass):
    name = "dce"

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        for func in module.functions.values():
            eliminate_dead_code(func, stats)
