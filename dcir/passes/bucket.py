"""Bucket: coalesce collectives into one larger transfer where the cost model says it pays.

Every collective pays a fixed latency (alpha) besides its bytes; many small ones
(a layer's norms, biases) pay it many times. This pass walks the all_gathers, then
the reduce_scatters, in issue order, and tries to merge each into the bucket before
it:

* all_gathers: the later start moves up to the bucket's start (with the
  ``param.get`` of its shard, and the ``mem.cast`` of that shard under
  ``mixed_precision`` or its ``mem.quantize`` under ``quantize``), as one
  ``comm.all_gather_coalesced``; its buffer is then live from there (``memory budget``);
* reduce_scatters: the earlier starts move down to the last one's place, as one
  ``comm.reduce_scatter_coalesced`` (same reduction and group); each full gradient
  then lives until that start (``memory budget``), and no wait of a merged
  reduction may come before it (``waits follow the start``).

A merge is kept only when the cost model (``dcir.cost``: profiled times, and for the
new coalesced op the alpha-beta model fitted to the profiled collectives) predicts
a faster function, the memory model keeps every op within ``budget``, and the bucket
stays within ``max_bytes``. The waits stay where they were: each result is waited
where it is needed.

Before -> after::

    %a_pending = comm.all_gather(%a_shard) : pending<f32[64]>
    %b_shard = param.get @b : shard<f32[64], 2>
    %b_pending = comm.all_gather(%b_shard) : pending<f32[64]>
  ->
    %b_shard = param.get @b : shard<f32[64], 2>
    %a_pending, %b_pending = comm.all_gather_coalesced(%a_shard, %b_shard) : pending<f32[64]>, pending<f32[64]>
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import analysis, ops as registry, search
from dcir.context import PlanContext
from dcir.cost import Machine, note_source, payload
from dcir.fusion import FusionMode
from dcir.ir import Function, Module, Op, Value
from dcir.memory import Bytes, timeline_of
from dcir.passes import Pass
from dcir.rewrite import Rewriter
from dcir.sim import estimate

def _kind(trait: str):
    return lambda op: registry.has_trait(op, trait) and registry.coalesced_form(op) is not None


def _merge(rewriter: Rewriter, a: Op, b: Op, gather: bool) -> Op | None:
    """Merge ``b`` into ``a`` (gathers: at ``a``'s place; reductions: at ``b``'s) and return
    the coalesced op, or None (nothing changed) when the merge would break an order it must keep."""
    ops = rewriter.func.ops
    between = ops[ops.index(a) + 1:ops.index(b)]
    inside = set(between)
    name = registry.coalesced_form(a)
    if gather:
        moved = _gather_inputs(b, inside)
        if moved is None:
            return None
        for op in moved:
            rewriter.move_before(op, a)
        anchor, attrs = a, analysis.unprofiled(a.attrs)
    else:
        attrs = analysis.unprofiled(a.attrs)
        if name != registry.coalesced_form(b) or attrs != analysis.unprofiled(b.attrs):
            return None  # a different reduction or group
        if len({v.type.dtype for v in (*a.operands, *b.operands)}) > 1:
            return None  # one buffer is summed: another dtype would be converted (gathers move bytes)
        pending, inputs = set(a.results), set(a.operands)
        for op in between:  # a's results must not be waited, nor its inputs freed, before the merged start
            if pending & set(op.operands) or (registry.has_trait(op, registry.FREES) and inputs & set(op.operands)):
                return None
        anchor = b
    results = [Value(r.name, r.type) for r in (*a.results, *b.results)]
    merged = Op(name, [*a.operands, *b.operands], results, attrs)
    rewriter.insert_before(anchor, [merged])
    rewriter.replace_op(a, results[:len(a.results)])
    rewriter.replace_op(b, results[len(a.results):])
    return merged


def _gather_inputs(b: Op, inside: set[Op]) -> list[Op] | None:
    """The ops between two gathers that make what the later one, ``b``, sends, in their
    order, which move up with it: its shard reads, and what converts each shard to what
    is sent (``mixed_precision``'s cast, ``quantize``'s int8 copy and scales) with that
    shard's read; None when ``b`` reads anything else made between them."""
    moved = []
    for v in b.operands:
        if v.owner not in inside:
            continue
        source = analysis.shard_read(v)
        if source is None:
            return None
        moved += [op for op in source if op is not None and op in inside and op not in moved]
    return moved


def _together(func: Function, a: Op, b: Op) -> bool:
    """Whether only shard reads run between the starts ``a`` and ``b``."""
    ops = func.ops
    return all(registry.has_trait(op, registry.LOADS_STATE) for op in ops[ops.index(a) + 1:ops.index(b)])


@dataclass(frozen=True)
class Bucket(Pass):
    name = "bucket"
    #: the most bytes the memory model may count at any op (per rank); none: no limit
    budget: Bytes | None = None
    #: the largest payload of one coalesced collective; none: no limit
    max_bytes: Bytes | None = None
    #: groupings kept per collective by the search (``dcir.search.beam``); 1: the greedy walk
    beam: int = 4

    def __post_init__(self):
        if self.beam < 1:
            raise ValueError(f"beam is {self.beam}; it keeps at least 1 grouping (1: the greedy walk)")

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        machine = ctx.machine_for(module)
        note_source(module, stats, "bucket")
        self.merge(module, machine, ctx.fusion, stats, "bucket")

    def merge(self, module: Module, machine: Machine, fusion: FusionMode, stats: Counter, prefix: str,
              adjacent: bool = False) -> None:
        """Merge where it pays, on ``machine`` with stretches priced as ``fusion`` says;
        ``adjacent``: only collectives that already start together (nothing but shard
        reads between them), which moves nothing (``prefetch`` fuses so)."""
        for func in module.functions.values():
            for kinds, gather in ((_kind(registry.GATHERS), True), (_kind(registry.SCATTERS), False)):
                _Buckets(self, module, func, machine, fusion, gather, kinds).plan(stats, prefix, adjacent)

    def rejected(self, module: Module, func: Function, merged: list[Op]) -> str | None:
        """Why a grouping that made the ops ``merged`` is not allowed, or None."""
        if self.max_bytes is not None and any(payload(op) > self.max_bytes for op in merged):
            return "max_bytes"
        if self.budget is not None and timeline_of(module, func.name).peak > self.budget:
            return "memory budget"
        return None


@dataclass
class _Buckets:
    """The search for one function's collectives of one kind: each candidate grouping
    is applied through the rewriter, priced by the simulator and rolled back."""

    spec: Bucket
    module: Module
    func: Function
    machine: Machine
    fusion: FusionMode
    gather: bool
    kinds: object

    def __post_init__(self):
        self.items = [op for op in self.func.ops if self.kinds(op)]
        self.rewriter = Rewriter(self.func)

    def apply(self, grouping: search.Grouping) -> tuple[list[Op] | None, str | None]:
        """Merge every group of ``grouping``; (the coalesced ops, None), or (None, why not)."""
        merged = []
        for group in grouping:
            current = self.items[group[0]]
            for j in group[1:]:
                current = _merge(self.rewriter, current, self.items[j], self.gather)
                if current is None:
                    return None, "order"
            if len(group) > 1:
                merged.append(current)
        why = self.spec.rejected(self.module, self.func, merged) if merged else None
        return (None, why) if why else (merged, None)

    def price(self, grouping: search.Grouping) -> tuple[float | None, str | None]:
        """The simulated function time with ``grouping`` applied (None, and why, when not allowed)."""
        mark = self.rewriter.checkpoint()
        try:
            merged, why = self.apply(grouping)
            if merged is None:
                return None, why
            return estimate(self.func, self.machine, self.module, self.fusion).seconds, None
        finally:
            self.rewriter.rollback(mark)

    def plan(self, stats: Counter, prefix: str, adjacent: bool) -> None:
        """Search the grouping (``dcir.search.beam``), apply the best, and count in
        ``stats`` the merges, and for every cut why the next collective did not join."""
        if len(self.items) < 2:
            return
        together = [adjacent and not _together(self.func, a, b) for a, b in zip(self.items, self.items[1:])]

        def can_join(group: tuple[int, ...], item: int) -> bool:
            return not together[item - 1] and (self.spec.max_bytes is None or sum(
                payload(self.items[j]) for j in (*group, item)) <= self.spec.max_bytes)

        found = search.beam(len(self.items), lambda g: self.price(g)[0], self.spec.beam, can_join)
        what = "all_gather" if self.gather else "reduce_scatter"
        for k, group in enumerate(found.grouping):
            stats[f"{prefix}: {what} merged"] += len(group) - 1
            if k == 0 or together[group[0] - 1]:
                continue
            previous = found.grouping[k - 1]
            if not can_join(previous, group[0]):
                stats[f"{prefix}: {what} not merged (max_bytes)"] += 1
                continue
            rest = (group[1:],) if len(group) > 1 else ()
            tried = found.grouping[:k - 1] + (previous + (group[0],),) + rest + found.grouping[k + 1:]
            stats[f"{prefix}: {what} not merged ({self.price(tried)[1] or 'not faster'})"] += 1
        stats[f"{prefix}: {what} groupings priced"] += found.priced
        self.apply(found.grouping)
