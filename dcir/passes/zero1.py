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
* every micro-step adds each gradient into its accumulator, in place
  (``param.add``); ``@backward`` (micro-steps 1 to N-1) communicates nothing more;
* ``@backward_last`` (micro-step N, which the Engine runs at the accumulation
  boundary) reduce-scatters the accumulator itself (average across ranks) where
  ``zero3`` reduced the gradient, so the reduction still overlaps the rest of the
  backward, hands the shard to the optimizer and ends by zeroing every accumulator
  in place (``param.zero``) for the next optimizer step.

Before -> after (``micro_steps=4``; the ``zero2`` part is as in ``zero2``)::

    grad.set @fc.weight(%g)
  ->
    buffer @fc.weight.grad_acc : f32[4, 8] {grad_acc.of = @fc.weight}
    func @backward(...) {
      ...
      param.add @fc.weight.grad_acc(%g)
      mem.free(%g)
    }
    func @backward_last(...) {
      ...
      param.add @fc.weight.grad_acc(%g)
      mem.free(%g)
      %g_acc = param.get @fc.weight.grad_acc : f32[4, 8]
      %g_pending = comm.reduce_scatter(%g_acc) {op = "avg"} : pending<shard<f32[4, 8], 2>>
      %g_shard = comm.wait(%g_pending) : shard<f32[4, 8], 2>
      grad.set @fc.weight(%g_shard)
      ...
      param.zero @fc.weight.grad_acc
    }
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import ops as registry
from dcir.context import PlanContext
from dcir.ir import Module
from dcir.passes import Pass
from dcir.accumulate import once_per_step
from dcir.passes.zero2 import replicate_parameters
from dcir.passes.zero3 import Zero3


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
        if self.micro_steps > 1:
            once_per_step(module, stats, registry.SCATTERS, lambda decl, grad: decl.full_type,
                          "zero1: gradients reduced once per optimizer step")
