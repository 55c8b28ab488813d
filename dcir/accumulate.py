"""Reducing gradients once per optimizer step under gradient accumulation.

With ``micro_steps`` N > 1 a reduction that needs to run only once per optimizer step
(``zero1``'s reduce-scatter of full gradients; HSDP's all-reduce across nodes of the
node-local shards, ``zero3{shard=local}``) moves to the last micro-step. Each such
gradient gets an accumulator buffer (``{grad_acc.of = @w}``) of the reduced value's
type; ``@backward`` (micro-steps 1 to N-1) adds the gradient into it in place
(``param.add``: no sum is allocated, nothing copied back) and communicates nothing
more; ``@backward_last`` (micro-step N, which the Engine runs at the accumulation
boundary) adds the last gradient into a fresh sum, which the reduction reads while
it runs, reduces it where the reduction was, hands it over and zeroes the
accumulator for the next optimizer step.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from dcir import analysis, roles
from dcir import ops as registry
from dcir.buffers import GRAD_ACC_OF
from dcir.ir import Decl, Function, Module, Op, ShardType, SymbolRef, Type, Value
from dcir.rewrite import Rewriter


def once_per_step(module: Module, stats: Counter, trait: str, acc_type: Callable[[Decl, Value], Type],
                  label: str) -> None:
    """Moves every reduction with ``trait`` whose result is handed to the optimizer to
    the last micro-step (module docstring); ``acc_type(decl, gradient)`` gives each
    accumulator's type."""
    bw = module.role(roles.BACKWARD)
    if bw is None:
        return
    accumulators = {}
    for start, wait, hand in reductions(bw, trait):
        acc = hand.symbol + ".grad_acc"
        while acc in module.decls:
            acc += "_"
        module.decls[acc] = Decl("buffer", acc, acc_type(module.decls[hand.symbol], start.operands[0]),
                                 {GRAD_ACC_OF: SymbolRef(hand.symbol)})
        accumulators[hand.symbol] = acc
        stats[label] += 1
    last = bw.clone(roles.BACKWARD_LAST, roles.BACKWARD_LAST)
    _accumulate(bw, accumulators, trait, last=False)
    _accumulate(last, accumulators, trait, last=True)
    module.functions[roles.BACKWARD_LAST] = last


#: how a gradient is summed and an accumulator zeroed: a full tensor's by compute, a shard's
#: (which compute does not take) by the grad ops
_ADD = {False: "aten.add.Tensor", True: "grad.accumulate"}
_ZERO = {False: "aten.zero.default", True: "grad.zero"}


def reductions(func: Function, trait: str) -> list[tuple[Op, Op, Op]]:
    """(reduction, wait, grad.set) of every gradient whose last reduction has ``trait``
    and is waited straight into the hand-over (as ``zero3`` writes them)."""
    waits = analysis.waits(func)
    hands = {op.operands[0]: op for op in func.ops if registry.has_trait(op, registry.GRADIENT)}
    out = []
    for op in func.ops:
        if registry.has_trait(op, trait) and not registry.is_coalesced(op):
            wait = waits[op.results[0]]
            if wait.results[0] in hands:
                out.append((op, wait, hands[wait.results[0]]))
    return out


def _accumulate(func: Function, accumulators: dict[str, str], trait: str, last: bool) -> None:
    """Each gradient is added to its accumulator: in place in the early micro-steps, which
    communicate nothing; in the last into a fresh sum that is reduced (a state write would
    have to wait for the reduction to finish reading), and the accumulator is zeroed."""
    rewriter = Rewriter(func)
    fresh = func.name_maker()
    for start, wait, hand in reductions(func, trait):
        grad, acc_name = start.operands[0], accumulators[hand.symbol]
        if not last:  # summed in place: the accumulator's storage is the only memory it takes
            rewriter.insert_before(start, [Op("param.add", [grad], symbol=acc_name)])
            for op in (hand, wait, start):  # readers first
                rewriter.erase(op)
            continue
        acc = Value(fresh(grad.name + "_acc"), grad.type)
        total = Value(fresh(grad.name + "_sum"), grad.type)
        sharded = isinstance(grad.type, ShardType)
        read = Op("param.get", [], [acc], symbol=acc_name)
        rewriter.insert_before(start, [read, Op(_ADD[sharded], [acc, grad], [total])])
        rewriter.set_operands(start, [total])
        zero = Value(fresh(grad.name + "_zero"), grad.type)
        rewriter.insert_after(wait, [Op("mem.free", [total]), Op(_ZERO[sharded], [acc], [zero]),
                                     Op("param.set", [zero], symbol=acc_name), Op("mem.free", [zero])])
