"""Compiled stretches: the compute of a lowered graph between the runtime's ops, each
stretch compiled by Inductor (``compile_compute``, ``_Compiled``) and timed, its times read
by the profiler (``stretch_times``). ``dcir.fusion`` cuts and arranges the IR the same way.
"""

from __future__ import annotations

import operator
import statistics
import time
from collections import deque

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from dcir import fusion
from dcir_lowering.calls import OP_INDEX, RUNTIME_CALLS, _grad_set, _item, _state_get


def _runs_in_runtime(node: fx.Node, runtime: set) -> bool:
    """State access and the runtime's ops (and the picking of their results)."""
    if node.op != "call_function":
        return False
    t = node.target
    if t in RUNTIME_CALLS or getattr(t, "_qualified_op_name", "").startswith("dcir::"):
        return True
    if torch.Tag.nondeterministic_seeded in getattr(t, "tags", ()):  # eager's generator (dcir.activations)
        return True
    return t is _item and node.args[0] in runtime


def compile_compute(gm: fx.GraphModule, only: set[int] | None = None) -> fx.GraphModule:
    """Inductor for the compute between collectives, the runtime's ops as they are.

    Inductor sees a collective as a synchronous kernel: it would reuse the storage of
    an input the transfer is still reading, or of a result that ``comm.wait`` returns,
    for its own buffers. So the graph is cut at runtime ops; each stretch of compute
    between them is compiled on its own, and the runtime's ops run between the compiled
    pieces. A copy of the graph is cut (``gm`` stays as it is: the profiler runs it).

    Fewer cuts mean fewer calls into compiled code (each costs some microseconds) and
    more to fuse, so runtime ops that need not split a stretch are moved to its edge
    (``_arrange``), keeping the order of every runtime op that has an effect:

    * to its start: reads of state (``param.get``: a reference to a stored tensor, which
      only ``param.set`` and the optimizer change, and those cut), the picking of a
      result already made, and a ``comm.wait`` on a collective that an earlier wait has
      finished (the wait of one result of a coalesced transfer finishes all of them:
      the others return at once);
    * to its end, or to just before the first compute that reads its result: any other
      ``comm.wait`` (waiting later blocks less; its buffer is allocated already),
      ``mem.free`` (nothing reads a freed value after the free, the verifier proves it,
      so only the release comes later: the stretch's compute keeps its memory that long)
      and ``grad.set`` (a dict entry);
    * never: collective starts (moving one earlier allocates its buffer earlier, later
      starts the transfer later), ``param.set`` (compute after it reads the new value),
      the optimizer-state store's calls (reloads, copies home, the step), ``rng.get``,
      ``rng.set`` and random ops (eager's generator: ``dcir.activations``).

    A stretch with fewer than ``MIN_COMPILED_OPS`` ops Inductor could fuse (views and
    matmuls aside: Inductor calls the same library kernels for those) runs as it is:
    there is nothing to fuse, and the call would cost more than it saves. With ``only``
    (positions of IR ops: those the ``fuse`` pass marked), only a stretch that runs one
    of them is compiled (``dcir.fusion`` cuts the IR so). The rest runs in place
    (``_inlined``, ``_frees_in_place``), each node marked with its part (``STRETCH``)."""
    arranged = fx.GraphModule(gm, _reshaped(_arrange(gm.graph)))
    runtime: set = set()
    part: dict = {}
    compute_parts: dict[int, int] = {}  # stretch -> its ops Inductor could fuse
    chosen: set[int] = set()  # stretches that run an op of ``only``
    current, last = 0, None
    for n in arranged.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        in_runtime = _runs_in_runtime(n, runtime)
        if in_runtime:
            runtime.add(n)
        if in_runtime != last:
            current, last = current + 1, in_runtime
        part[n] = current
        if not in_runtime:
            compute_parts[current] = compute_parts.get(current, 0) + _fusible(n)
            if only is None or n.meta.get(OP_INDEX) in only:
                chosen.add(current)
        n.meta[STRETCH] = current
    split = split_module(arranged, torch.nn.Module(), lambda n: part[n], keep_original_order=True)
    for name, sub in list(split.named_children()):
        k = int(name.rsplit("_", 1)[1])
        if compute_parts.get(k, 0) >= MIN_COMPILED_OPS and k in chosen:
            setattr(split, name, _Compiled(sub))
    return fx.GraphModule(split, _frees_in_place(split, _inlined(split)))


#: the node meta naming the part of the cut a node ran in (``compile_compute``): a stretch of compute, or
#: the runtime's ops between two
STRETCH = "dcir_stretch"


def _inlined(split: fx.GraphModule) -> fx.Graph:
    """``split``'s graph with every part it does not compile run in place, op by op: what
    such a stretch reads goes after its last use, as op by op, not when a call returns
    (the memory model holds only a compiled stretch's inputs to its end, ``dcir.memory``)."""
    out, env = fx.Graph(), {}
    compiled = {name for name, sub in split.named_children() if isinstance(sub, _Compiled)}
    for n in split.graph.nodes:
        if n.op == "call_module" and n.target not in compiled:
            sub = getattr(split, n.target)
            inner = dict(zip([m for m in sub.graph.nodes if m.op == "placeholder"], [env[a] for a in n.args]))
            for m in sub.graph.nodes:
                if m.op == "output":
                    env[n] = fx.node.map_arg(m.args[0], lambda a: inner[a])
                elif m.op != "placeholder":
                    inner[m] = out.node_copy(m, lambda a: inner[a])
        elif n.op == "call_function" and n.target is operator.getitem and isinstance(env.get(n.args[0]), tuple):
            env[n] = env[n.args[0]][n.args[1]]  # a result of a part run in place
        else:
            env[n] = out.node_copy(n, lambda a: env[a])
    return out


def _frees_in_place(split: fx.GraphModule, graph: fx.Graph) -> fx.Graph:
    """``graph`` with each ``mem.free`` moved back to just after the last op the IR runs
    before it: ``_arrange`` moved it to its stretch's end, which only a compiled stretch
    needs (the call holds its memory until it returns anyway); in a part run in place it
    would hold the memory longer than the IR says. Nothing reads a freed value after the
    free (the verifier proves it), so only the ops before it in the IR must run first,
    and the nodes that make what it frees (the picking of a compiled stretch's result
    comes after the call, and may carry no IR op of its own)."""
    for free in reversed([n for n in graph.nodes if _runtime_op(n) == "free"]):  # one op's frees keep their order
        k, n, inputs = free.meta[OP_INDEX], free.prev, set(free.all_input_nodes)
        while n.op != "root" and n not in inputs and not any(i < k for i in _ir_ops(split, n)):
            n = n.prev
        if n.op != "root" and n.next is not free:
            n.append(free)
    return graph


def _ir_ops(split: fx.GraphModule, node: fx.Node) -> list[int]:
    """The positions of the IR ops ``node`` runs: a compiled stretch's, or its own."""
    if node.op == "call_module":
        return getattr(split, node.target).ops
    return [node.meta[OP_INDEX]] if OP_INDEX in node.meta else []


#: the fewest ops Inductor could fuse (``_fusible``) a stretch needs to be compiled
MIN_COMPILED_OPS = fusion.MIN_OPS


def _fusible(node: fx.Node) -> int:
    """1 for an op Inductor could fuse with others, 0 for a view, the picking of a
    result, or a library kernel (a matmul: ``dcir.fusion.LIBRARY_KERNELS``)."""
    t = node.target
    return int(t is not _item and not str(t).startswith(fusion.LIBRARY_KERNELS) and not getattr(t, "is_view", False))


def _kind(node: fx.Node, runtime: set) -> str:
    """What ``node`` is to a stretch, in ``dcir.fusion``'s terms (``fusion.arrange`` places
    it); ``runtime``: the runtime's nodes so far."""
    if not _runs_in_runtime(node, runtime):
        return fusion.COMPUTE
    runtime.add(node)
    t, runtime_op = node.target, _runtime_op(node)
    if t is _state_get or runtime_op == "get_shard":
        return fusion.READ
    if t is _item:
        return fusion.PICK
    if t is _grad_set:
        return fusion.HAND_OVER
    return {"free": fusion.FREE, "wait": fusion.WAIT}.get(runtime_op, fusion.OTHER)


def _runtime_op(node: fx.Node) -> str:
    """The name of the runtime's op (``torch.ops.dcir.*``) a node calls, or ``""``."""
    name = getattr(node.target, "_qualified_op_name", "")
    return name[len("dcir::"):] if name.startswith("dcir::") else ""


def _collective(wait: fx.Node) -> fx.Node:
    """The collective a ``comm.wait`` node finishes (a coalesced one's results are picked)."""
    pending = wait.args[0]
    return pending.args[0] if pending.target is _item else pending


def _arrange(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with the runtime ops that may cross compute moved to the edges
    of their stretch (``compile_compute``), where ``dcir.fusion.arrange`` puts them."""
    args = [n for n in graph.nodes if n.op == "placeholder"]
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    runtime: set = set()
    kinds = [_kind(n, runtime) for n in nodes]
    order, _ = fusion.arrange(nodes, kinds, lambda n: n.all_input_nodes,
                              lambda n: [_collective(n)], placed=args)
    out = fx.Graph()
    env: dict = {}
    for n in [*args, *order, *[m for m in graph.nodes if m.op == "output"]]:
        env[n] = out.node_copy(n, lambda a: env[a])
    return out


#: the runs of a compiled stretch after compiling it that are not timed (``_Compiled``)
WARM_RUNS = 4

#: Inductor's compiled stretches, by their code and their inputs' layouts (``_Compiled``), the
#: most recent ``COMPILED_KEPT``: a plan lowered again in the same process (a trial's winner,
#: installed after the program it replaced ran its side) runs what it compiled then. Inductor's
#: own cache on disk still took 5 s for a tiny Llama, 17 s for a 4-layer Mixtral (a 0.5 s step).
_COMPILED: dict[tuple, object] = {}
COMPILED_KEPT = 4096

#: the views a program that compiles any stretch runs as reshapes (``reshaping``)
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def reshaping(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its views run as reshapes, on a copy of its graph (``gm`` stays as it
    is: the profiler runs it). A compiled stretch's results are laid out as Inductor lays
    them out (``_Compiled``), which can differ from eager's: Inductor traces with meta
    strides (a ``cat`` with an empty operand keeps the other's permuted strides on meta,
    a contiguous result in eager). An ``aten.view`` the IR has of such a value, or of a
    transpose of it, held for eager's layout and can fail for the other, inside a
    compiled stretch, in a stretch run as it is, or in another function (the backward
    reading a saved value a compiled forward made). A reshape is the view where the
    strides allow one and a copy where not; the captured graphs are functional, so a
    copy changes no value. ``lower`` runs every function of a program that compiles any
    stretch so (``compile_compute`` cuts a reshaped copy)."""
    return fx.GraphModule(gm, _reshaped(gm.graph))


def _reshaped(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose ``_VIEWS`` are reshapes (``reshaping``)."""
    out = fx.Graph()
    out.output(out.graph_copy(graph, {}))
    for n in out.nodes:
        if n.target in _VIEWS:
            n.target = torch.ops.aten.reshape.default
    return out


class _Compiled(torch.nn.Module):
    """A stretch compiled by Inductor at its first call (``compile_fx`` with the call's
    tensors as the example: a program's shapes are fixed, and Inductor's code checks
    each input's size and strides).

    Straight to Inductor, not ``torch.compile``: Dynamo would check its guards on every
    call (about 15 us on this CPU, hundreds of stretches a step) for a graph that has no
    Python to trace. Inductor may lay a result out differently from eager; the program's
    views are reshapes (``reshaping``), so that none depends on either layout, and the
    results are handed on as they are. (They were made contiguous once: on the
    activation benchmark's Llama those copies held 12 MiB beside their originals at the
    step's peak of 176, memory no model of the program saw.)

    Each call is timed (``times``: the profiler prices the stretch's ops from them). The
    first run of a compiled kernel loads it, which took up to 10 times its later runs
    here, and the next few are slow too (their buffers are fresh: a tiny Llama's
    stretches, run once a step, took 1.8, 1.55 and 1.28 times a later run in their 2nd,
    3rd and 4th runs, 1.05 in their 5th), so after compiling, the stretch runs
    ``WARM_RUNS`` times untimed; their results are dropped (the stretch has no effect
    but its results: state is written by ``param.set``, which cuts stretches; a stretch
    with random ops draws its seeds from torch's generator that many times more then).
    The optimization cycle profiles a compiled plan after one step, so the first timed
    run is what prices it."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.gm, self.compiled = gm, None
        # the IR ops it runs (its placeholders carry the meta of the ops that made its inputs)
        self.ops = sorted({n.meta[OP_INDEX] for n in gm.graph.nodes if n.op == "call_function" and OP_INDEX in n.meta})
        self.times: deque = deque(maxlen=5)  # seconds of its last calls, compiling aside (``stretch_times``)

    def forward(self, *args):
        if self.compiled is None:
            self.compiled = _compile(self.gm, args)
            for _ in range(WARM_RUNS):  # untimed: the first runs are slow (the class's docstring)
                self.compiled(*args)
        begin = time.perf_counter()
        out = self.compiled(*args)
        self.times.append(time.perf_counter() - begin)
        return out


def _compile(gm: fx.GraphModule, args: tuple):
    """``gm`` compiled by Inductor for ``args``, or what the same code compiled for inputs
    laid out alike (``_COMPILED``). A stretch reads only its inputs (no ``get_attr``: a
    constant's value is not in the code), so the same code and layouts compute the same."""
    key = None
    if not any(n.op == "get_attr" for n in gm.graph.nodes):
        key = (gm.code, tuple((a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else repr(a)
                              for a in args))
        if key in _COMPILED:
            return _COMPILED[key]
    from torch._inductor.compile_fx import compile_fx  # Inductor takes ~1.3 s to import: at first use
    with torch.no_grad():
        compiled = compile_fx(gm, list(args))
    if key is not None:
        while len(_COMPILED) >= COMPILED_KEPT:
            _COMPILED.pop(next(iter(_COMPILED)))
        _COMPILED[key] = compiled
    return compiled


def stretch_times(runner) -> list[tuple[list[int], float]]:
    """The compiled stretches of a function's runner (``Program.runs``) that have run:
    (the IR ops each runs, the median seconds of its last calls). The profiler prices
    the ops of a program lowered with ``inductor`` from them (``dcir_runtime.profiler``)."""
    children = runner.children() if isinstance(runner, torch.nn.Module) else ()
    return [(c.ops, statistics.median(c.times)) for c in children if isinstance(c, _Compiled) and c.times]

