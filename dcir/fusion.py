"""Op fusion: which stretches of compute between the runtime's ops run compiled.

The lowering runs a function's ops one by one, or hands each *stretch* of compute
between the runtime's ops to Inductor (``dcir_lowering.stretches.compile_compute``),
which fuses its pointwise ops into fewer kernels and so reads and writes memory less,
at a fixed cost per call into compiled code. Which stretches pay is a choice like
bucketing, and it interacts with it: merging collectives removes the cuts between
stretches (a collective's start cuts one), so fewer, longer stretches are compiled
(DisCo plans op fusion and tensor fusion together for this reason).

This module is that choice's model, at the IR's level:

* ``stretches`` cuts a function as the lowering cuts its graph: compute runs on
  across the reads of state (``param.get``), across a wait on a collective that an
  earlier wait finished, and across ``grad.set`` and ``mem.free`` (the lowering moves
  those to a stretch's edges); it is cut by every other op of the runtime
  (collective starts, ``param.set``, the optimizer-state store's calls, and a random
  op, which runs eagerly so that a recompute replays its draws: ``dcir.activations``)
  and before the first compute that reads a wait's result. The rules and the walk are
  ``crossing`` and ``arrange``, written once: the lowering cuts its graph with them,
  naming each node's kind as ``_kind`` names each op's. Only stretches with ``MIN_OPS``
  ops Inductor could fuse (``fusible``, as the lowering counts them) are compiled at all;
* an op marked ``lower.fused`` runs in a compiled stretch (the ``fuse`` pass marks them; a
  stretch is compiled when its ops are marked);
* ``compiled`` names the stretches the lowering compiles: those with a marked op.

What a compiled stretch costs is the cost model's (``dcir.cost.fused_seconds``); what
it holds, the memory model's (``dcir.memory``: a stretch keeps its inputs until it
returns, and a release the lowering moves to its end comes that late).
"""

from __future__ import annotations

from enum import Enum
from typing import Callable, Iterable

from dcir import ops as registry
from dcir.activations import draws_random
from dcir.analysis import view_bases
from dcir.buffers import OPTIM_STATE_OF
from dcir.ir import UNIT, Function, Module, Op
from dcir.roles import BACKWARD, BACKWARD_LAST, EVAL, FORWARD

#: the op attribute (a flag) that marks an op of a compiled stretch
FUSE = "lower.fused"
#: the fewest ops Inductor could fuse (``fusible``) a stretch needs to be compiled
MIN_OPS = 2
#: the roles whose functions the lowering may compile (the step's optimizer runs eagerly)
ROLES = (FORWARD, BACKWARD, BACKWARD_LAST, EVAL)
#: ops Inductor hands to the same library kernels eager calls: nothing to fuse
LIBRARY_KERNELS = ("aten.mm.", "aten.bmm.", "aten.addmm.", "aten.baddbmm.", "aten.convolution.")

#: What an op is to a stretch, as either representation (the IR's ops here, the lowered
#: graph's nodes in ``dcir_lowering.stretches``) says of its own: compute, or a runtime op
#: that reads state, picks a result already made, waits on a collective, hands a
#: gradient over, frees a buffer, or does anything else
COMPUTE, READ, PICK, WAIT, HAND_OVER, FREE, OTHER = "compute", "read", "pick", "wait", "hand_over", "free", "other"
#: where a runtime op goes in its stretch: to its start, to its end (or to just before
#: the first compute that reads its result), or nowhere (it cuts the stretch)
HOIST, SINK, FIXED = "hoist", "sink", "fixed"
#: the kinds whose place does not depend on what came before (``crossing``)
CROSSING = {
    READ: HOIST,       # a reference to stored state: only the ops that cut change it
    HAND_OVER: SINK,   # a dict entry
    FREE: SINK,        # nothing reads a freed value after the free: only the release comes later
    OTHER: FIXED,      # collective starts, param.set, the optimizer-state store, rng, random ops
}


def is_compute(op: Op) -> bool:
    """Whether ``op`` is compute that a stretch holds (aten and custom ops, casts)."""
    return registry.has_trait(op, registry.COMPUTE) or registry.has_trait(op, registry.CASTS)


def fusible(op: Op) -> bool:
    """Whether Inductor could fuse ``op`` with others: compute that is neither a view
    (``aten.t``, ``view``, ``_unsafe_view``: no kernel; a program that compiles runs the
    last two as reshapes, ``dcir_lowering.stretches.reshaping``) nor a library kernel (a
    matmul). The lowering counts a node of its graph alike (``stretches._fusible``)."""
    return is_compute(op) and not op.name.startswith(LIBRARY_KERNELS) and not registry.views(op)


def _store_state(module: Module | None, op: Op) -> bool:
    decl = module.decls.get(op.symbol) if module is not None and op.symbol else None
    return decl is not None and OPTIM_STATE_OF in decl.attrs


def crossing(kind: str, sources_placed: bool, collectives_finished: bool) -> str:
    """Where a runtime op of ``kind`` goes in its stretch (``HOIST``, ``SINK`` or
    ``FIXED``): the picking of a result already placed, and a wait whose collectives an
    earlier stretch's waits finished (the wait of one result of a coalesced transfer
    finishes all of them: the others return at once), go to the stretch's start; any
    other wait to its end (waiting later blocks less); the rest as ``CROSSING`` says."""
    if kind == PICK:
        return HOIST if sources_placed else SINK
    if kind == WAIT:
        return HOIST if sources_placed and collectives_finished else SINK
    return CROSSING[kind]


def arrange(items: list, kinds: list[str], sources: Callable, collectives: Callable,
            placed: Iterable = ()) -> tuple[list, list[list]]:
    """Cut ``items`` (ops or nodes in program order, each of ``kinds``) into stretches of
    compute: (the items in the order they run, runtime ops moved to their stretch's edges
    as ``crossing`` says; the compute of each stretch, in order). ``sources(x)``: the items
    ``x`` reads; ``collectives(x)``: the collectives a wait finishes; ``placed``: what is
    there before the first item (arguments)."""
    order: list = []
    bodies: list[list] = []
    head: list = []
    body: list = []
    tail: list = []
    placed, finished, waiting = set(placed), set(), set()  # waiting: the tail's items
    kind_of = dict(zip(map(id, items), kinds))

    def flush():
        for x in (*head, *body, *tail):
            order.append(x)
            placed.add(x)
            if kind_of[id(x)] == WAIT:
                finished.update(collectives(x))
        if body:
            bodies.append(list(body))
        head.clear(), body.clear(), tail.clear(), waiting.clear()

    for x, kind in zip(items, kinds):
        if kind == COMPUTE:
            if waiting.intersection(sources(x)):
                flush()
            body.append(x)
            continue
        reads = list(sources(x))
        where = crossing(kind, all(s in placed for s in reads),
                         kind == WAIT and all(c in finished for c in collectives(x)))
        if where == HOIST:
            head.append(x)
            placed.add(x)
        elif where == SINK:
            tail.append(x)
            waiting.add(x)
        else:
            flush()
            order.append(x)
            placed.add(x)
    flush()
    return order, bodies


def _kind(module: Module | None, op: Op, copies: set) -> str:
    """What ``op`` is to a stretch (``arrange``); ``copies``: the values host copies made."""
    if is_compute(op) and not draws_random(op):
        return COMPUTE
    if op.name == "param.get":
        return OTHER if _store_state(module, op) else READ
    if op.name == "comm.wait":
        return WAIT
    if op.name == "grad.set":
        return HAND_OVER
    if op.name == "mem.free" and not copies & set(op.operands):
        return FREE
    return OTHER


def _owners(op: Op) -> list[Op]:
    return [v.owner for v in op.operands if isinstance(v.owner, Op)]


def stretches(func: Function, module: Module | None = None) -> list[list[int]]:
    """The stretches of compute the lowering cuts ``func`` into (``arrange``, as the
    lowering cuts its graph): each the positions of its compute ops, in order. ``module``
    tells the optimizer-state store's reads (offload) from the parameters'; without it
    every read is a parameter's."""
    bases = view_bases(func)
    copies = {bases.get(r, r) for op in func.ops if op.name == "mem.wait" for r in op.results}
    copies |= {v for v, b in bases.items() if b in copies}
    kinds = [_kind(module, op, copies) for op in func.ops]
    _, bodies = arrange(func.ops, kinds, _owners, _owners)
    position = {op: i for i, op in enumerate(func.ops)}
    return [[position[op] for op in body] for body in bodies]


def compilable(func: Function, stretch: list[int]) -> bool:
    """Whether the lowering would compile ``stretch`` if asked: enough to fuse."""
    return sum(fusible(func.ops[i]) for i in stretch) >= MIN_OPS


def candidates(func: Function, module: Module | None = None) -> list[list[int]]:
    """The stretches of ``func`` that may be compiled (none outside ``ROLES``)."""
    if func.role not in ROLES:
        return []
    return [s for s in stretches(func, module) if compilable(func, s)]


def compiled(func: Function, module: Module | None = None) -> list[list[int]]:
    """The stretches of ``func`` the lowering compiles: the candidates with a marked op."""
    if not marked(func):
        return []
    return [s for s in candidates(func, module) if any(FUSE in func.ops[i].attrs for i in s)]


def marked(func: Function) -> bool:
    """Whether any op of ``func`` is marked to run compiled."""
    return any(FUSE in op.attrs for op in func.ops)


class FusionMode(Enum):
    """How the simulator prices a function's stretches of compute (``dcir.cost.fused_seconds``); a
    planning context carries one (``dcir.context.PlanContext``)."""

    #: as the lowering will run it: compiled where marked; a function with no marks at
    #: its ops' own profiled times (a program lowered with every stretch compiled,
    #: ``inductor``, carries its compiled times as ``prof.compiled_us``)
    AS_LOWERED = "as lowered"
    #: compiled exactly where marked, also when nothing is: the ``fuse`` pass's walk
    #: starts from every stretch eager, and an op that carries a compiled figure from an
    #: earlier plan is priced eagerly until its stretch is marked
    AS_MARKED = "as marked"
    #: every compilable stretch at the faster of its eager and its compiled run, as the
    #: ``fuse`` pass will choose: the passes before it (bucket, prefetch, unshard) then
    #: plan for the compute that will run
    CHOOSING = "choosing"
