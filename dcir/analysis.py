"""Analyses: functions of a function or module that return plain data.

Passes read these and do not re-derive them.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx

from dcir import ops as registry
from dcir.ir import Function, Module, Op, Value


def collectives(module: Module) -> dict[str, int]:
    """How many collectives of each kind ``module``'s functions hold (``all_gather``,
    ``reduce_scatter_coalesced``...), one count per op, however often a step runs it."""
    counts = Counter(op.name.removeprefix("comm.") for _, op in module.ops()
                     if registry.has_trait(op, registry.COLLECTIVE))
    return dict(sorted(counts.items()))


def unprofiled(attrs: dict) -> dict:
    """An op's attributes without what a profile wrote into them (``prof.*``): what a
    copy of the op, or a merge of several, carries."""
    return {k: v for k, v in attrs.items() if not k.startswith("prof.")}


def waits(func: Function) -> dict[Value, Op]:
    """For every pending value of ``func``, the wait (``comm.wait``, ``mem.wait``) that joins it."""
    return {v: op for op in func.ops if registry.has_trait(op, registry.WAITS) for v in op.operands}


def started_by(value: Value) -> tuple[Op, int] | None:
    """For the result of a wait, the async op whose pending value it joined and that
    value's index among the op's results (a coalesced collective has several); for any
    other value, None."""
    wait = value.owner
    if not isinstance(wait, Op) or not registry.has_trait(wait, registry.WAITS):
        return None
    pending = wait.operands[value.index]
    return (pending.owner, pending.index) if isinstance(pending.owner, Op) else None


def converts(op: Op) -> bool:
    """Whether ``op`` only converts what it reads: pure, not compute (``mixed_precision``'s
    ``mem.cast`` of a shard to bf16, ``quantize``'s ``mem.quantize``)."""
    return registry.has_trait(op, registry.PURE) and not registry.has_trait(op, registry.COMPUTE)


def shard_read(value: Value) -> tuple[Op, Op | None] | None:
    """The state read behind ``value``: (the read, None) when ``value`` is what a
    ``param.get`` read; (the read, the op) when one op converting its one operand made it
    from such a read (a shard cast to bf16 before its gather, or its int8 copy or scales,
    ``quantize``'s ``mem.quantize``); else None."""
    owner = value.owner
    if not isinstance(owner, Op):
        return None
    if registry.has_trait(owner, registry.LOADS_STATE):
        return owner, None
    if converts(owner) and len(owner.operands) == 1:
        read = owner.operands[0].owner
        if isinstance(read, Op) and registry.has_trait(read, registry.LOADS_STATE):
            return read, owner
    return None


def read_end(op: Op) -> Op:
    """The op at which ``op`` is done reading its operands: for an async op (a collective,
    a copy) the wait that joins it, since the transfer reads them until then; for any
    other op, itself."""
    if not registry.has_trait(op, registry.ASYNC):
        return op
    waits = (u for r in op.results for u in r.users() if registry.has_trait(u, registry.WAITS))
    return next(waits, op)


def dependency_graph(func: Function) -> nx.DiGraph:
    """The ops of ``func`` as a DAG, nodes numbered by schedule position.

    Edges carry ``kind``: ``"data"`` (a result feeds an operand), ``"state"`` (reads and
    writes of the same symbol keep their order; a write follows every reader of what a
    ``param.get`` loaded from the symbol before it, and the wait of every async op reading
    that: the loaded value is the state's storage, which an in-place write changes),
    ``"collective"`` (collectives keep their order on every rank) and ``"free"`` (a
    ``mem.free`` follows every reader of what it frees or of a view of it, and the wait
    of every async op that reads it).
    Any topological order of this graph is a valid schedule.
    """
    g = nx.DiGraph()
    g.add_nodes_from(range(len(func.ops)))
    base = view_bases(func)
    where: dict[Value, int] = {}
    readers: dict[Value, list[int]] = {}  # storage base -> ops that read it (an async read ends at its wait)
    started: dict[Value, Op] = {}         # pending value -> the async op that yields it
    last_write: dict[str, int] = {}
    reads_since_write: dict[str, list[int]] = {}
    last_collective = None
    for i, op in enumerate(func.ops):
        d = registry.lookup(op.name)
        for v in op.operands:
            if v in where:
                g.add_edge(where[v], i, kind="data")
            readers.setdefault(base.get(v, v), []).append(i)
            if v in started and d is not None and d.has(registry.WAITS):
                for src in started.pop(v).operands:
                    readers.setdefault(base.get(src, src), []).append(i)
        if d is not None and d.has(registry.ASYNC):
            started.update(dict.fromkeys(op.results, op))
        if d is not None and d.has(registry.FREES):
            for v in op.operands:
                for r in readers.get(base.get(v, v), ()):
                    if r != i:
                        g.add_edge(r, i, kind="free")
        if op.symbol is not None and d is not None:
            if d.has(registry.WRITES_STATE):
                for r in reads_since_write.pop(op.symbol, ()):
                    loaded = (u for v in func.ops[r].results for u in readers.get(v, ()) if u != i)
                    g.add_edges_from((a, i, {"kind": "state"}) for a in (r, *loaded) if not g.has_edge(a, i))
                if op.symbol in last_write:
                    g.add_edge(last_write[op.symbol], i, kind="state")
                last_write[op.symbol] = i
            elif d.has(registry.READS_STATE):
                if op.symbol in last_write:
                    g.add_edge(last_write[op.symbol], i, kind="state")
                reads_since_write.setdefault(op.symbol, []).append(i)
        if d is not None and d.has(registry.COLLECTIVE):
            if last_collective is not None:
                g.add_edge(last_collective, i, kind="collective")
            last_collective = i
        for r in op.results:
            where[r] = i
    return g


def live_ops(func: Function) -> set[int]:
    """Positions of the ops whose effect is observable: side effects, what the function
    returns, and everything they depend on through data. A ``mem.free`` is live only
    while something it frees is."""
    g = dependency_graph(func)
    data = nx.DiGraph((a, b) for a, b, kind in g.edges(data="kind") if kind == "data")
    data.add_nodes_from(g)
    roots = set()
    for i, op in enumerate(func.ops):
        d = registry.lookup(op.name)
        if d is None or (d.has(registry.SIDE_EFFECT) and not d.has(registry.FREES)):
            roots.add(i)
    where = {r: i for i, op in enumerate(func.ops) for r in op.results}
    roots.update(where[v] for v in func.returns if v in where)
    sink = len(func.ops)  # one node below every root, so one search finds all that they need
    data.add_node(sink)
    data.add_edges_from((r, sink) for r in roots)
    return nx.ancestors(data, sink)


def view_bases(func: Function) -> dict[Value, Value]:
    """For every value that is a view (``aten.t``, ``view``, ``split``...), its base: the
    value whose storage it shares (a view of a view maps to the original)."""
    bases: dict[Value, Value] = {}
    for op in func.ops:
        for res, src in registry.views(op).items():
            base = op.operands[src]
            bases[op.results[res]] = bases.get(base, base)
    return bases


def last_uses(func: Function) -> tuple[dict[Value, int], set[Value]]:
    """For every storage base, the position of the last op that reads it or any view of
    it; and the bases whose storage the function returns (never to be freed)."""
    bases = view_bases(func)
    last: dict[Value, int] = {}
    for i, op in enumerate(func.ops):
        for v in op.operands:
            last[bases.get(v, v)] = i
    returned = {bases.get(v, v) for v in func.returns}
    return last, returned
