"""Free placement by liveness: every storage the schedule owns is released by an explicit
``mem.free`` right after the op at which its last read ends.

The memory model already releases a storage with no ``mem.free`` after its last read
(``dcir.memory``); this pass writes those releases into the program, so that the text
says when each buffer goes and the lowering drops it there. A storage is the schedule's
to free when an op of the function allocates it (a compute result, a collective's or a
copy's buffer: a wait's result shares it) and nothing holds it past the function: not
returned, not handed to ``grad.set``, not module state (``param.get``), not already
freed. Its last read is the last op that reads it or any view of it; an async op (a
collective, a copy) reads its operands until the wait that joins it, so a storage last
read by one goes after that wait. The free names the value that holds the storage when
it goes: the base of its views, or the wait's result for a collective's buffer.

The sharding passes place the frees of what they create by the same rule: ``zero3``
frees each gathered parameter and each reduced full gradient and ``mixed_precision``
each cast copy it gathers or reduces from, through a ``FreePlacer``; ``unshard`` builds
``@unshard`` without frees and has ``place_frees`` release each gathered replica.

Before -> after::

    %h = aten.mm.default(%x, %w) : f32[4, 4]
    %p = comm.all_reduce(%h) {op = "sum"} : pending<f32[4, 4]>
    %s = comm.wait(%p) : f32[4, 4]
    %y = aten.relu.default(%s) : f32[4, 4]
    return %y
  ->
    %h = aten.mm.default(%x, %w) : f32[4, 4]
    %p = comm.all_reduce(%h) {op = "sum"} : pending<f32[4, 4]>
    %s = comm.wait(%p) : f32[4, 4]
    mem.free(%h)
    %y = aten.relu.default(%s) : f32[4, 4]
    mem.free(%s)
    return %y
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import ops as registry
from dcir.analysis import last_uses, read_end, view_bases
from dcir.context import PlanContext
from dcir.ir import Function, Module, Op, PendingType, Value
from dcir.memory import storage_bases
from dcir.passes import Pass
from dcir.rewrite import Rewriter


class FreePlacer:
    """The frees of one function, placed by liveness as they are asked for. Liveness is
    read when the placer is made, from the function as the asking pass found it: a free
    goes after the op at which the last read of the value's storage (the value or a
    view of it) ends. Frees after one op keep the order they were asked in."""

    def __init__(self, func: Function):
        self.func = func
        self.bases = view_bases(func)
        last, self.returned = last_uses(func)
        self.last = {v: func.ops[i] for v, i in last.items()}
        self._placed: dict[Op, Op] = {}  # op -> the last free placed after it
        self._freed: set[Value] = set()

    def release(self, rewriter: Rewriter, value: Value, holder: Value | None = None,
                after: Op | None = None) -> Op | None:
        """Free the storage of ``value`` (naming ``holder``, the value that holds it by
        then, or its base) once its last read ends, or once ``after``'s read ends for a
        value made since the placer was. Nothing is placed for storage the function
        returns or received (an argument is its caller's), storage nothing reads, or
        storage freed already. Returns the free placed, if one was."""
        base = self.bases.get(value, value)
        if base in self._freed or base in self.returned or base.owner is self.func:
            return None
        if any(not isinstance(user, Op) for user, _ in value.uses):
            return None  # returned by an op added since: the caller holds it
        anchor = after if after is not None else self.last.get(base)
        if anchor is None:
            return None
        anchor = read_end(anchor)
        free = Op("mem.free", [holder or base], parens=True)
        rewriter.insert_after(self._placed.get(anchor, anchor), [free])
        self._placed[anchor] = free
        self._freed.add(base)
        return free


def _holder(base: Value) -> Value:
    """The value that names ``base``'s storage in a free: a collective's or a copy's
    buffer by the result of the wait that joins it, any other storage by itself."""
    if isinstance(base.type, PendingType):
        wait = next((u for u in base.users() if registry.has_trait(u, registry.WAITS)), None)
        if wait is not None:
            return wait.results[wait.operands.index(base)]
    return base


def owned_unfreed(func: Function) -> dict[Value, Op]:
    """The storages of ``func`` that it allocates and leaves to their last read (no
    ``mem.free``, not returned, not handed to ``grad.set``), in the order they are made,
    each with the last op that reads it or a value sharing it (a storage nothing reads:
    the op that makes it)."""
    bases = storage_bases(func)
    own = lambda v: bases.get(bases.get(v, v), bases.get(v, v))  # noqa: E731  (a view of a wait's result too)
    held = {own(v) for v in func.returns}
    last: dict[Value, Op] = {}
    made: list[Value] = []
    for op in func.ops:
        for v in op.operands:
            last[own(v)] = op
        d = registry.lookup(op.name)
        if d is None:
            continue
        if d.has(registry.FREES) or d.has(registry.GRADIENT):
            held.update(own(v) for v in op.operands)
        if d.has(registry.ALLOCATES) and not d.has(registry.LOADS_STATE):
            made.extend(r for r in op.results if own(r) is r)
    return {v: last.get(v, v.owner) for v in made if v not in held}


def place_frees(func: Function, stats: Counter) -> None:
    """A ``mem.free`` of the storages ``owned_unfreed`` finds, after the op at which each
    one's last read ends (and after any frees already there): one free per such op."""
    ops = func.ops
    pos = {op: i for i, op in enumerate(ops)}
    going: dict[Op, list[Value]] = {}
    for storage, last in owned_unfreed(func).items():
        at = pos[read_end(last)]
        while at + 1 < len(ops) and registry.has_trait(ops[at + 1], registry.FREES):
            at += 1
        going.setdefault(ops[at], []).append(_holder(storage))
    Rewriter(func).insert_after_each({op: [Op("mem.free", values, parens=True)] for op, values in going.items()})
    stats["frees placed"] += sum(map(len, going.values()))


@dataclass(frozen=True)
class PlaceFrees(Pass):
    name = "free"

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        for func in module.functions.values():
            place_frees(func, stats)
