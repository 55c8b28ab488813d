"""Bucket: coalesce collectives into one larger transfer where the cost model says it pays.

Every collective pays a fixed latency (alpha) besides its bytes; many small ones
(a layer's norms, biases) pay it many times. This pass walks the all_gathers, then
the reduce_scatters, in issue order, and tries to merge each into the bucket before
it:

* all_gathers: the later start moves up to the bucket's start (with the
  ``param.get`` of its shard), as one ``comm.all_gather_coalesced``; its buffer is
  then live from there (``memory budget``);
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

from dcir.cost import Machine, calibrate, estimate, note_source, payload
from dcir.ir import Function, Module, Op
from dcir.memory import Bytes, timelines
from dcir.passes import Pass

_GATHERS = ("comm.all_gather", "comm.all_gather_coalesced")
_REDUCTIONS = ("comm.reduce_scatter", "comm.reduce_scatter_coalesced")


def _merge(func: Function, a: Op, b: Op, gather: bool) -> list[Op] | None:
    """The op list with ``b`` merged into ``a`` (gathers: at ``a``'s place; reductions:
    at ``b``'s), or None when the merge would break an order it must keep."""
    ops = func.ops
    ia, ib = ops.index(a), ops.index(b)
    between = ops[ia + 1:ib]
    if gather:
        # b's shard reads move along; anything else b reads must exist before a
        gets = [v.owner for v in b.operands if isinstance(v.owner, Op) and v.owner in between
                and v.owner.name == "param.get"]
        if any(v.owner in between and v.owner not in gets for v in b.operands):
            return None
        merged = Op("comm.all_gather_coalesced", [*a.operands, *b.operands], [*a.results, *b.results],
                    {k: v for k, v in a.attrs.items() if not k.startswith("prof.")})
        return [*ops[:ia], *gets, merged, *[op for op in between if op not in gets], *ops[ib + 1:]]
    keep = {k: v for k, v in a.attrs.items() if not k.startswith("prof.")}
    if keep != {k: v for k, v in b.attrs.items() if not k.startswith("prof.")}:
        return None  # a different reduction or group
    pending = set(a.results)
    freed = {v for v in a.operands}
    for op in between:  # a's results must not be waited, nor its inputs freed, before the merged start
        if pending & set(op.operands) or (op.name == "mem.free" and freed & set(op.operands)):
            return None
    merged = Op("comm.reduce_scatter_coalesced", [*a.operands, *b.operands], [*a.results, *b.results], keep)
    return [*ops[:ia], *between, merged, *ops[ib + 1:]]


def _together(func: Function, a: Op, b: Op) -> bool:
    """Whether only shard reads run between the starts ``a`` and ``b``."""
    ops = func.ops
    return all(op.name == "param.get" for op in ops[ops.index(a) + 1:ops.index(b)])


def _owners_of(ops: list[Op]) -> None:
    for op in ops:
        for i, r in enumerate(op.results):
            r.owner, r.index = op, i


@dataclass(frozen=True)
class Bucket(Pass):
    name = "bucket"
    #: the most bytes the memory model may count at any op (per rank); none: no limit
    budget: Bytes | None = None
    #: the largest payload of one coalesced collective; none: no limit
    max_bytes: Bytes | None = None

    def run(self, module: Module, stats: Counter) -> None:
        machine = calibrate(module)
        note_source(module, stats, "bucket")
        self.merge(module, machine, stats, "bucket")

    def merge(self, module: Module, machine: Machine, stats: Counter, prefix: str, adjacent: bool = False) -> None:
        """Merge where it pays; ``adjacent``: only collectives that already start together
        (nothing but shard reads between them), which moves nothing (``prefetch`` fuses so)."""
        for func in module.functions.values():
            for kinds, gather in ((_GATHERS, True), (_REDUCTIONS, False)):
                self._bucket(module, func, kinds, gather, machine, stats, prefix, adjacent)

    def _bucket(self, module, func, kinds, gather, machine, stats, prefix, adjacent) -> None:
        best = estimate(func, machine).seconds
        current = None
        for op in [op for op in func.ops if op.name in kinds]:
            if current is None:
                current = op
                continue
            what = "all_gather" if gather else "reduce_scatter"
            if adjacent and not _together(func, current, op):
                current = op
                continue
            merged_ops = _merge(func, current, op, gather)
            if merged_ops is None:
                stats[f"{prefix}: {what} not merged (order)"] += 1
                current = op
                continue
            merged = next(o for o in merged_ops if o.name.endswith("_coalesced") and set(o.results) >= set(op.results))
            if self.max_bytes is not None and payload(merged) > self.max_bytes:
                _owners_of([current, op])
                stats[f"{prefix}: {what} not merged (max_bytes)"] += 1
                current = op
                continue
            old = func.ops
            func.ops = merged_ops
            seconds = estimate(func, machine).seconds
            fits = self.budget is None or timelines(module)[func.name].peak <= self.budget
            if seconds < best and fits:
                best = seconds
                current = merged
                stats[f"{prefix}: {what} merged"] += 1
            else:
                func.ops = old
                _owners_of(old)
                stats[f"{prefix}: {what} not merged ({'memory budget' if not fits else 'not faster'})"] += 1
                current = op
