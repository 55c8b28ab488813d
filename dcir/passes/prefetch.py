"""Prefetch: start each all_gather early enough to hide its transfer behind compute,
and finish each reduce_scatter late enough to hide its own, within a memory budget.

``zero3`` starts every gather just before its first use and waits for it at once, and
waits for every gradient's reduce_scatter as soon as it starts: every transfer is on
the critical path. This pass moves, in schedule order:

* **all_gather starts earlier** (with the ``param.get`` of the shard they read, and the
  op that makes what it sends from that shard: ``mixed_precision``'s ``mem.cast`` to
  the compute dtype, ``quantize``'s ``mem.quantize``). A
  start moves up until the compute before its ``comm.wait`` covers the transfer, by the
  cost model (limit ``transfer hidden``: the transfer starts when the channel is free,
  after the transfers issued before it), and never past
  ``dependencies`` (the DAG of ``dcir.analysis``), ``gathers keep their order`` (the
  previous all_gather's new place: gathers are needed in the order they are issued)
  or the ``memory budget``: the gathered buffer is live from its new start, and the
  memory model must keep every op the move spans within ``budget``.
* **reduce_scatter waits later** (with the ``grad.set`` of the result and the
  ``mem.free`` of the full gradient): down until the transfer is done by the cost
  model (``transfer hidden``), and never past ``dependencies`` or the ``memory
  budget`` (the full gradient stays live until the wait).

Then, with ``fuse`` (the default), gathers (or reductions) that now start together
(only shard reads between them) are fused into one coalesced collective where the
cost model predicts a faster function: each collective pays a fixed latency, and
gathers stacked at one point by ``gathers keep their order`` would pay it one after
the other. Nothing moves for that; ``bucket`` also merges collectives further apart.

A transfer counts as hidden (``transfer hidden``, ``transfer done``) once the compute
beside it lasts ``slack`` times the transfer by the model (default 8): the model sees
neither jitter nor a rank that reaches the collective late, and a wait placed exactly
where the transfer should end stalls on both (``docs/passes.md`` has the measurements).

Costs are the profile's (``prof.time_us``) when the module has one, else the analytic
model's (``dcir.cost``); ``--pass-statistics`` counts, per move, which limit
stopped it. ``budget`` is per rank, for the bytes the memory model counts (see
``docs/passes.md``); without one, only the other limits apply.

Before -> after (the gather of %w2 overlaps the first matmul)::

    %w1_pending = comm.all_gather(%w1_shard)
    %w1 = comm.wait(%w1_pending)
    %h = aten.mm.default(%x, %w1)
    %w2_shard = param.get @w2
    %w2_pending = comm.all_gather(%w2_shard)
    %w2 = comm.wait(%w2_pending)
    %y = aten.mm.default(%h, %w2)
  ->
    %w1_pending = comm.all_gather(%w1_shard)
    %w2_shard = param.get @w2
    %w2_pending = comm.all_gather(%w2_shard)
    %w1 = comm.wait(%w1_pending)
    %h = aten.mm.default(%x, %w1)
    %w2 = comm.wait(%w2_pending)
    %y = aten.mm.default(%h, %w2)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import analysis, ops as registry
from dcir.context import PlanContext
from dcir.cost import note_source
from dcir.ir import Module, Op
from dcir.memory import Bytes, device_bytes
from dcir.passes import Pass
from dcir.passes.bucket import Bucket
from dcir.schedule import AFTER_DEPENDENCIES, BEFORE_DEPENDENTS, Limit, Move, Sweep, run_moves


def _is_gather(op: Op) -> bool:
    return registry.has_trait(op, registry.GATHERS)


def _gather_group(sweep: Sweep, i: int) -> list[int]:
    """The start; right above it, the op that makes everything it sends from what it
    reads, when it only converts (pure, not compute: ``mixed_precision``'s ``mem.cast`` of
    the shard to bf16, ``quantize``'s ``mem.quantize`` making its int8 copy and scales);
    and the param.get of each shard read, when the
    start (or that op) is its only reader and only shard reads run between them. A read
    further up stays where it is (a capture may read every shard at the top of the
    function; taking such a read along would move the group down, not up)."""
    ops = sweep.func.ops
    group = [i]
    makers = {v.owner for v in ops[i].operands}
    if len(makers) == 1 and i > 0 and ops[i - 1] in makers and analysis.converts(ops[i - 1]):
        group.insert(0, i - 1)
    top = group[0]
    for v in ops[top].operands:
        src = v.owner
        j = sweep.position.get(src)
        if isinstance(src, Op) and registry.has_trait(src, registry.LOADS_STATE) and j is not None and j < top \
                and sweep.graph.out_degree(j) == 1 \
                and all(registry.has_trait(op, registry.LOADS_STATE) for op in ops[j + 1:top]):
            group.insert(0, j)
    return sorted(group)


def _wait_of(sweep: Sweep, i: int) -> int:
    """Position of the first wait that joins a result of op ``i``."""
    waits = [sweep.waits[r] for r in sweep.func.ops[i].results if r in sweep.waits]
    return min((sweep.position[w] for w in waits), default=len(sweep.func.ops))


def _after_previous_gather(sweep: Sweep, i: int, group: list[int]) -> int:
    prev = max((j for j in sweep.placed if j < i and _is_gather(sweep.func.ops[j])), default=None)
    return 0 if prev is None else sweep.placed[prev]


def _gather_hidden(sweep: Sweep, i: int, group: list[int]) -> int:
    """The latest start from which the transfer ends before the compute reaches its wait."""
    need = sweep.time_at(_wait_of(sweep, i))
    for p in range(group[0], -1, -1):
        if max(sweep.time_at(p), sweep.channel) + sweep.slack * sweep.seconds[i] <= need:
            return p
    return 0


def _gather_cost(sweep: Sweep, i: int, group: list[int], pos: int) -> tuple[int, int, int]:
    nbytes = sum(device_bytes(r) for r in sweep.func.ops[i].results)
    return nbytes, pos, group[0]


HOIST_GATHERS = Move(
    "all_gather", anchor=_is_gather, group=_gather_group, direction="earlier",
    limits=(AFTER_DEPENDENCIES, Limit("gathers keep their order", _after_previous_gather),
            Limit("transfer hidden", _gather_hidden)),
    cost=_gather_cost)


def _reduces(op: Op) -> bool:
    """A collective that reduces, or the exchange of a quantized reduction's rows (qgZ:
    ``comm.all_to_all``, summed after its wait by ``mem.dequantize_reduce``)."""
    return registry.has_trait(op, registry.ASYNC) and (
        registry.has_trait(op, registry.REDUCES) or registry.has_trait(op, registry.EXCHANGES))


def _is_reduction_wait(op: Op) -> bool:
    return registry.has_trait(op, registry.WAITS) and all(
        isinstance(v.owner, Op) and _reduces(v.owner) for v in op.operands)


def _reduction_start(sweep: Sweep, i: int) -> int:
    return max(sweep.position[v.owner] for v in sweep.func.ops[i].operands)


def _wait_group(sweep: Sweep, i: int) -> list[int] | None:
    """The wait, then the ops right after it that only finish the reduction: the sum of
    a quantized reduction's rows (``mem.dequantize_reduce``), the cast of its results
    to fp32 (``mixed_precision`` reducing in bf16), the grad.set of its results, and the
    frees of what the reduction read and of the rows once summed."""
    ops = sweep.func.ops
    wait = ops[i]
    own = sweep.storage
    inputs = {own.get(v, v) for w in wait.operands for v in w.owner.operands}
    results = set(wait.results)
    group = [i]
    j = i + 1
    while j < len(ops):
        op = ops[j]
        reads = set(op.operands)
        if registry.has_trait(op, registry.GRADIENT) and reads <= results:
            group.append(j)
        elif (registry.has_trait(op, registry.CASTS) or registry.has_trait(op, registry.REDUCES)
              and not registry.has_trait(op, registry.ASYNC)) and reads <= results:
            group.append(j)
            results |= set(op.results)
        elif registry.has_trait(op, registry.FREES) and {own.get(v, v) for v in reads} <= inputs | results:
            group.append(j)
        else:
            break
        j += 1
    return group


def _reduction_end(sweep: Sweep, i: int) -> float:
    """When the transfer of wait ``i``'s reduction ends, with the sweep's slack: its
    launch plus slack times the time from launch to its end by the model."""
    start = _reduction_start(sweep, i)
    done = sweep.done.get(start, 0.0)
    launched = sweep.time_at(start)
    return launched + sweep.slack * max(done - launched, 0.0)


def _reduction_hidden(sweep: Sweep, i: int, group: list[int]) -> int:
    """The first position the compute reaches after the transfer has ended."""
    done = _reduction_end(sweep, i)
    n = len(sweep.func.ops)
    for q in range(group[-1] + 1, n + 1):
        if sweep.time_at(q) >= done:
            return q
    return n


def _wait_cost(sweep: Sweep, i: int, group: list[int], pos: int) -> tuple[int, int, int]:
    ops, own = sweep.func.ops, sweep.storage
    freed = {own.get(v, v) for j in group if registry.has_trait(ops[j], registry.FREES) for v in ops[j].operands}
    return sum(device_bytes(v) for v in freed), group[-1] + 1, pos


def _reduction_done(sweep: Sweep, i: int, group: list[int]) -> int:
    """For a wait that comes later than it must: the first position after its start
    at which the compute has reached the end of the transfer."""
    start = _reduction_start(sweep, i)
    done = _reduction_end(sweep, i)
    for q in range(start + 1, group[0] + 1):
        if sweep.time_at(q) >= done:
            return q
    return group[0]


def _start_group(sweep: Sweep, i: int) -> list[int]:
    """A reduction's start, with the run that begins at the op making what it sends from
    the gradient, when one does: ``mixed_precision``'s ``mem.cast`` to ``reduce_dtype``
    (the start reads only the cast), or a quantized reduction's ``mem.quantize`` (the
    ``comm.all_to_all`` of the rows and of their scales). The frees of the gradient that
    follow the run move with it."""
    ops, own = sweep.func.ops, sweep.storage
    made_by = ops[i].operands[0].owner
    j = sweep.position.get(made_by)
    quantized = registry.has_trait(ops[i], registry.EXCHANGES)
    cast = len(ops[i].operands) == 1 and j is not None and registry.has_trait(made_by, registry.CASTS)
    if j is None or not (quantized or cast):
        return [i]
    source = {own.get(v, v) for v in made_by.operands}
    group = [j]
    for k in range(j + 1, len(ops)):
        op = ops[k]
        sends = k == i or (registry.has_trait(op, registry.EXCHANGES) and op.operands[0].owner is made_by)
        if not (sends or (registry.has_trait(op, registry.FREES) and {own.get(v, v) for v in op.operands} <= source)):
            break
        group.append(k)
    return group if i in group else [i]


def _reduction_cost(sweep: Sweep, i: int, group: list[int], pos: int) -> tuple[int, int, int]:
    """What a start moved earlier makes live from there: its results, and what the ops
    moving with it make (a cast's copy, a quantized gradient's rows and scales)."""
    return sum(device_bytes(r) for j in group for r in sweep.func.ops[j].results), pos, group[0]


# A reduction starts as soon as its gradient is computed (captured backward graphs
# compute every gradient before handing any over), with the cast or quantization
# making what it sends ...
HOIST_REDUCTIONS = Move(
    "reduce_scatter", anchor=_reduces, group=_start_group, direction="earlier",
    limits=(AFTER_DEPENDENCIES,), cost=_reduction_cost)
# ... its wait comes once the transfer is done, which frees the full gradient early ...
RAISE_REDUCTION_WAITS = Move(
    "reduce_scatter wait (earlier)", anchor=_is_reduction_wait, group=_wait_group, direction="earlier",
    limits=(AFTER_DEPENDENCIES, Limit("transfer done", _reduction_done)))
# ... and not before: a wait right after its start stalls the compute for the transfer.
SINK_REDUCTION_WAITS = Move(
    "reduce_scatter wait (later)", anchor=_is_reduction_wait, group=_wait_group, direction="later",
    limits=(BEFORE_DEPENDENTS, Limit("transfer hidden", _reduction_hidden)),
    cost=_wait_cost)

MOVES = [HOIST_GATHERS, HOIST_REDUCTIONS, RAISE_REDUCTION_WAITS, SINK_REDUCTION_WAITS]


@dataclass(frozen=True)
class Prefetch(Pass):
    name = "prefetch"
    #: the most bytes the memory model may count at any op (per rank); none: no limit
    budget: Bytes | None = None
    #: fuse collectives that end up starting together into one, where the cost model says it pays
    fuse: bool = True
    #: a transfer counts as hidden once the compute beside it lasts slack times the transfer
    #: by the model: room for what the model does not see (jitter, a rank arriving late);
    #: 8 measured best of 1, 2, 4, 8, 32 and 1000 on the CPU benchmark (docs/passes.md)
    slack: float = 8.0

    def __post_init__(self):
        if not self.slack >= 1:
            raise ValueError(f"slack is at least 1 (a transfer hidden behind its own time), not {self.slack}")

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        machine = ctx.machine_for(module)
        note_source(module, stats, "prefetch")
        for func in module.functions.values():
            run_moves(module, func, MOVES, machine, self.budget, stats, "prefetch", self.slack, ctx.fusion)
        if self.fuse:
            Bucket(budget=self.budget).merge(module, machine, ctx.fusion, stats, "prefetch", adjacent=True)
