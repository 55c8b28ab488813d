"""Reducing gradients once per optimizer step under gradient accumulation.

With ``micro_steps`` N > 1 a reduction that needs to run only once per optimizer step
(``zero1``'s reduce-scatter of full gradients; HSDP's all-reduce across nodes of the
node-local shards, ``zero3{shard=local}``) moves to the last micro-step. Each such
gradient gets an accumulator buffer (``{grad_acc.of = @w}``) of the reduced value's
type; every micro-step adds the gradient into it in place (``param.add``: no sum is
allocated, nothing copied back). ``@backward`` (micro-steps 1 to N-1) communicates
nothing more; ``@backward_last`` (micro-step N, which the Engine runs at the
accumulation boundary) reduces the accumulator itself where the reduction was, hands
the result over, and ends by zeroing every accumulator in place (``param.zero``) for
the next optimizer step.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from dcir import analysis, roles
from dcir import ops as registry
from dcir.buffers import GRAD_ACC_OF
from dcir.ir import Decl, Function, Module, Op, SymbolRef, Type, Value
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
    """Each gradient is added to its accumulator in place (``param.add``). The early
    micro-steps communicate nothing more; in the last the reduction reads the accumulator
    itself, and the function ends by zeroing every accumulator once its reduction is done
    reading it (``param.zero``, which the dependency analysis keeps after the wait)."""
    rewriter = Rewriter(func)
    fresh = func.name_maker()
    zeroes = []
    for start, wait, hand in reductions(func, trait):
        grad, acc_name = start.operands[0], accumulators[hand.symbol]
        rewriter.insert_before(start, [Op("param.add", [grad], symbol=acc_name)])
        if not last:
            for op in (hand, wait, start):  # readers first
                rewriter.erase(op)
            continue
        for free in [u for u, _ in grad.uses if u.name == "mem.free" and u.operands == (grad,)]:
            rewriter.move_before(free, start)  # added: the gradient's memory goes at once
        acc = Value(fresh(grad.name + "_acc"), grad.type)
        rewriter.insert_before(start, [Op("param.get", [], [acc], symbol=acc_name)])
        rewriter.set_operands(start, [acc])
        zeroes.append(Op("param.zero", [], symbol=acc_name))
    rewriter.append(zeroes)
