"""Fuse: compile the stretches of compute where the simulator says it pays.

The lowering can hand each stretch of compute between the runtime's ops to Inductor
(``dcir.fusion``: where the stretches are cut, and what a compiled one costs). This
pass chooses which: it walks each function's stretches in order and marks a stretch's
ops ``lower.fused`` when the simulated function (``dcir.sim``) runs faster with it
compiled (or as fast, with less compute), and the lowering compiles exactly the marked
stretches. The walk starts from every stretch eager. A stretch that
ran compiled before is priced from its measured share (``prof.compiled_us``), any
other by the machine's compiler model (``Machine.compiled_call_s``, ``fused_share``).
Ops it leaves eager lose their compiled figures, so nothing prices them as compiled.

Op fusion and tensor fusion are planned together: the passes before ``fuse`` in a
pipeline (``bucket``, ``prefetch``, ``unshard``) price every schedule with each of its
stretches as fast as this pass will make it (the pass manager gives them
``FusionMode.CHOOSING``: this pass declares ``chooses_fusion``), so a merge
that joins two stretches into one compiled call is seen as paying for that too.

Only the forward, backward and evaluation functions are compiled (the step's
optimizer runs eagerly); a stretch needs at least two ops Inductor could fuse.

A compiled stretch is one call: it holds what it reads until it returns, and a release
inside it comes at its end (``dcir.memory``). With ``budget`` (the planner gives it the
memory budget, as it gives ``recompute``), a stretch is compiled only where its
function's peak stays within the budget, or within the peak the walk started from when
that is higher: a plan fitted to a budget op by op stays within it compiled.

Before -> after (golden ``fuse.dcir``): relu and neg ran compiled in 8 + 2 us against
40 + 10 op by op, so they stay compiled; add and mul (after a matmul) ran compiled in
88 us against 84, so they run eagerly and lose their compiled figures::

    %a = aten.relu.default(%x) {prof.compiled_us = 8.0, prof.time_us = 40.0} : f32[16, 64]
    %b = aten.neg.default(%a) {prof.compiled_us = 2.0, prof.time_us = 10.0} : f32[16, 64]
    %c = aten.add.Tensor(%h, %x) {prof.compiled_us = 3.0, prof.time_us = 2.0} : f32[16, 64]
  ->
    %a = aten.relu.default(%x) {prof.compiled_us = 8.0, prof.time_us = 40.0, lower.fused} : f32[16, 64]
    %b = aten.neg.default(%a) {prof.compiled_us = 2.0, prof.time_us = 10.0, lower.fused} : f32[16, 64]
    %c = aten.add.Tensor(%h, %x) {prof.time_us = 2.0} : f32[16, 64]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import fusion
from dcir.context import PlanContext
from dcir.cost import COMPILED, note_source
from dcir.fusion import FusionMode
from dcir.ir import Module
from dcir.memory import Bytes, timeline_of
from dcir.passes import Pass
from dcir.rewrite import Rewriter
from dcir.sim import estimate


@dataclass(frozen=True)
class Fuse(Pass):
    name = "fuse"
    chooses_fusion = True
    budget: Bytes | None = None  # the step's peak to stay within, per rank, as the memory model counts it

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        machine = ctx.machine_for(module)
        # compiled exactly where marked; under a later fuse's joint planning, as it will choose
        mode = FusionMode.CHOOSING if ctx.fusion is FusionMode.CHOOSING else FusionMode.AS_MARKED
        note_source(module, stats, "fuse")
        for func in module.functions.values():
            rewriter = Rewriter(func)
            for op in func.ops:  # decided afresh
                if fusion.FUSE in op.attrs:
                    rewriter.set_attr(op, fusion.FUSE)
            best = _score(func, machine, module, mode)
            limit = None if self.budget is None else max(self.budget, timeline_of(module, func.name).peak)
            for stretch in fusion.candidates(func, module):
                mark = rewriter.checkpoint()
                for i in stretch:
                    rewriter.set_attr(func.ops[i], fusion.FUSE, fusion.UNIT)
                if limit is not None and timeline_of(module, func.name).peak > limit:
                    rewriter.rollback(mark)
                    stats["fuse: stretches kept eager (over the memory budget)"] += 1
                    continue
                score = _score(func, machine, module, mode)
                if score < best:
                    best = score
                    stats["fuse: stretches compiled"] += 1
                    stats["fuse: ops compiled"] += len(stretch)
                else:
                    rewriter.rollback(mark)
                    stats["fuse: stretches kept eager (not faster)"] += 1
            for op in func.ops:
                if fusion.FUSE not in op.attrs and COMPILED in op.attrs:
                    rewriter.set_attr(op, COMPILED)


def _score(func, machine, module, mode: FusionMode) -> tuple[float, float]:
    """What the walk minimizes: the function's time, then its compute (a stretch hidden
    under a transfer is compiled too when that takes less compute: the host has the
    time for other work, and the stretch still gains when the transfer gets faster),
    with the stretches compiled exactly where marked (``FusionMode.AS_MARKED``: an
    unmarked op's compiled figure, from a plan that compiled it, does not price it).
    Times are compared to the nanosecond, so float noise decides nothing."""
    e = estimate(func, machine, module, mode)
    return round(e.seconds, 9), round(e.compute_s, 9)
