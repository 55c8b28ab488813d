"""ZeRO-1: optimizer state sharded; parameters replicated; gradients reduced once per
optimizer step.

With one micro-step per optimizer step this is ``zero2``: every gradient is
reduce-scattered in ``@backward`` and the shard goes to the optimizer. With
gradient accumulation (``micro_steps`` N > 1, which the Engine sets from
``gradient_accumulation_steps``) ZeRO-1 does not communicate on every micro-step.
Each rank sums its own full gradients across micro-steps and the sum is
reduce-scattered once, in the last micro-step:

* each trainable parameter gets an accumulator of its full size (``buffer
  @w.grad_acc : f32[4, 8] {grad_acc.of = @w}``): ZeRO-1 holds full gradients;
* ``@backward`` (micro-steps 1 to N-1) adds each gradient into its accumulator and
  communicates nothing;
* ``@backward_last`` (micro-step N, which the Engine runs at the accumulation
  boundary) adds the last gradient to the accumulator, reduce-scatters the sum
  (average across ranks) where ``zero3`` reduced the gradient, so the reduction
  still overlaps the rest of the backward, hands the shard to the optimizer and
  zeroes the accumulator for the next optimizer step.

Before -> after (``micro_steps=4``; the ``zero2`` part is as in ``zero2``)::

    grad.set @fc.weight(%g)
  ->
    buffer @fc.weight.grad_acc : f32[4, 8] {grad_acc.of = @fc.weight}
    func @backward(...) {
      ...
      %g_acc = param.get @fc.weight.grad_acc : f32[4, 8]
      %g_sum = aten.add.Tensor(%g_acc, %g) : f32[4, 8]
      param.set @fc.weight.grad_acc(%g_sum)
      mem.free(%g_sum)
      mem.free(%g)
    }
    func @backward_last(...) {
      ...
      %g_acc = param.get @fc.weight.grad_acc : f32[4, 8]
      %g_sum = aten.add.Tensor(%g_acc, %g) : f32[4, 8]
      %g_pending = comm.reduce_scatter(%g_sum) {op = "avg"} : pending<shard<f32[4, 8], 2>>
      %g_shard = comm.wait(%g_pending) : shard<f32[4, 8], 2>
      mem.free(%g_sum)
      %g_zero = aten.zero.default(%g_acc) : f32[4, 8]
      param.set @fc.weight.grad_acc(%g_zero)
      mem.free(%g_zero)
      grad.set @fc.weight(%g_shard)
      mem.free(%g)
    }
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import analysis, roles
from dcir import ops as registry
from dcir.context import PlanContext
from dcir.ir import Decl, Function, Module, Op, SymbolRef, Value
from dcir.memory import GRAD_ACC_OF
from dcir.passes import Pass
from dcir.passes.zero2 import replicate_parameters
from dcir.passes.zero3 import Zero3
from dcir.rewrite import Rewriter

def _reductions(func: Function) -> list[tuple[Op, Op, Op]]:
    """(reduce_scatter, wait, grad.set) of every gradient, as ``zero3`` wrote them."""
    waits = analysis.waits(func)
    hands = {op.operands[0]: op for op in func.ops if registry.has_trait(op, registry.GRADIENT)}
    out = []
    for op in func.ops:
        if registry.has_trait(op, registry.SCATTERS) and not registry.is_coalesced(op):
            wait = waits[op.results[0]]
            out.append((op, wait, hands[wait.results[0]]))
    return out


def _accumulate(func: Function, accumulators: dict[str, str], last: bool) -> None:
    """Each gradient is added to its accumulator; in the last micro-step the sum is
    reduced (and the accumulator zeroed), in the others nothing is communicated."""
    rewriter = Rewriter(func)
    fresh = func.name_maker()
    for start, wait, hand in _reductions(func):
        grad, acc_name = start.operands[0], accumulators[hand.symbol]
        acc = Value(fresh(grad.name + "_acc"), grad.type)
        total = Value(fresh(grad.name + "_sum"), grad.type)
        add = [Op("param.get", [], [acc], symbol=acc_name), Op("aten.add.Tensor", [acc, grad], [total])]
        if last:
            rewriter.insert_before(start, add)
            rewriter.set_operands(start, [total])
            zero = Value(fresh(grad.name + "_zero"), grad.type)
            rewriter.insert_after(wait, [Op("mem.free", [total]), Op("aten.zero.default", [acc], [zero]),
                                         Op("param.set", [zero], symbol=acc_name), Op("mem.free", [zero])])
        else:
            rewriter.insert_before(start, [*add, Op("param.set", [total], symbol=acc_name), Op("mem.free", [total])])
            for op in (hand, wait, start):  # readers first
                rewriter.erase(op)


@dataclass(frozen=True)
class Zero1(Pass):
    name = "zero1"
    world_size: int = 2
    #: micro-steps per optimizer step; above 1, gradients are summed locally and reduced once
    micro_steps: int = 1

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError("world_size must be at least 1")
        if self.micro_steps < 1:
            raise ValueError("micro_steps must be at least 1")

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        Zero3(world_size=self.world_size).run(module, stats, ctx)
        replicate_parameters(module, stats, self.name)
        bw = module.role(roles.BACKWARD)
        if self.micro_steps == 1 or bw is None:
            return
        accumulators = {}
        for start, wait, hand in _reductions(bw):
            decl = module.decls[hand.symbol]
            acc = hand.symbol + ".grad_acc"
            while acc in module.decls:
                acc += "_"
            module.decls[acc] = Decl("buffer", acc, decl.full_type, {GRAD_ACC_OF: SymbolRef(hand.symbol)})
            accumulators[hand.symbol] = acc
            stats["zero1: gradients reduced once per optimizer step"] += 1
        last = bw.clone(roles.BACKWARD_LAST, roles.BACKWARD_LAST)
        _accumulate(bw, accumulators, last=False)
        _accumulate(last, accumulators, last=True)
        module.functions[roles.BACKWARD_LAST] = last
