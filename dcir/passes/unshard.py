"""Unshard: keep chosen parameters gathered from ``@forward`` to ``@backward``.

Under ``zero3`` every parameter is gathered twice a step: for the forward and again
for the backward. For a parameter kept gathered, ``@forward`` does not free the
gathered tensor but hands it to ``@backward`` with the saved values, and ``@backward``
uses it in place of its own gather (and frees it after its last use there). That
saves one all_gather per parameter and step, and costs the parameter's full size,
live from its last use in the forward to its last use in the backward.

Which parameters: every candidate (gathered alone in both functions) is ranked by
communication saved per byte held, the backward gather's transfer time (profiled
``prof.time_us``, else the analytic alpha-beta model) over the parameter's bytes,
and taken in that order while the memory model keeps both functions within
``budget``. Without a budget every candidate is kept gathered.

Before -> after::

    func @forward(%x) -> (f32[], f32[2, 8]) {
      ...
      %w = comm.wait(%w_pending) : f32[4, 8]
      %y = aten.mm.default(%x, %w)
      mem.free(%w)
      return %loss, %x
    }
    func @backward(%x: f32[2, 8], %tangent: f32[]) {
      %w_shard = param.get @w : shard<f32[4, 8], 2>
      %w_pending = comm.all_gather(%w_shard) : pending<f32[4, 8]>
      %w_1 = comm.wait(%w_pending) : f32[4, 8]
      %gx = aten.mm.default(%g, %w_1)
      mem.free(%w_1)
  ->
    func @forward(%x) -> (f32[], f32[2, 8], f32[4, 8]) {
      ...
      %w = comm.wait(%w_pending) : f32[4, 8]
      %y = aten.mm.default(%x, %w)
      return %loss, %x, %w
    }
    func @backward(%x: f32[2, 8], %w_1: f32[4, 8], %tangent: f32[]) {
      %gx = aten.mm.default(%g, %w_1)
      mem.free(%w_1)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir.cost import Machine, calibrate, note_source, op_seconds
from dcir.ir import Function, Module, Op, Value
from dcir.memory import Bytes, owners, timelines
from dcir.passes import Pass


@dataclass
class _Gather:
    get: Op          # param.get of the shard
    start: Op        # comm.all_gather
    wait: Op         # comm.wait
    full: Value      # the gathered tensor
    free: Op | None  # the mem.free that releases it


def _gathers(func: Function) -> dict[str, list[_Gather]]:
    """Single-tensor gathers of a parameter, by parameter."""
    waits = {v: op for op in func.ops if op.name == "comm.wait" for v in op.operands}
    own = owners(func)
    frees = {}
    for op in func.ops:
        if op.name == "mem.free":
            for v in op.operands:
                frees.setdefault(own.get(v, v), op)
    out: dict[str, list[_Gather]] = {}
    for op in func.ops:
        if op.name != "comm.all_gather":
            continue
        src = op.operands[0].owner
        wait = waits.get(op.results[0])
        if not isinstance(src, Op) or src.name != "param.get" or wait is None or len(wait.operands) != 1:
            continue
        full = wait.results[0]
        out.setdefault(src.symbol, []).append(_Gather(src, op, wait, full, frees.get(own.get(full, full))))
    return out


def _keep(module: Module, name: str, fw: _Gather, bw: _Gather) -> None:
    """Hand ``fw.full`` from @forward to @backward in place of @backward's gather."""
    f, b = module.functions["forward"], module.functions["backward"]
    if len(fw.free.operands) == 1:
        f.ops.remove(fw.free)
    else:
        fw.free.operands = [v for v in fw.free.operands if v is not fw.full]
    f.returns.append(fw.full)
    f.result_types.append(fw.full.type)
    arg = bw.full  # the gathered value becomes an argument, under its own name
    b.ops = [op for op in b.ops if op is not bw.start and op is not bw.wait
             and not (op is bw.get and all(u is bw.start for u in _users(b, op.results[0])))]
    b.args.insert(len(b.args) - 1, arg)
    for i, a in enumerate(b.args):
        a.owner, a.index = b, i


def _users(func: Function, v: Value) -> list[Op]:
    return [op for op in func.ops if v in op.operands]


@dataclass(frozen=True)
class Unshard(Pass):
    name = "unshard"
    #: the most bytes the memory model may count at any op of either function (per rank); none: no limit
    budget: Bytes | None = None

    def run(self, module: Module, stats: Counter) -> None:
        f, b = module.functions.get("forward"), module.functions.get("backward")
        if f is None or b is None or len(b.args) != len(f.returns):
            return
        machine = calibrate(module, Machine())
        note_source(module, stats, "unshard")
        fws, bws = _gathers(f), _gathers(b)
        ranked = []
        for name, fw in fws.items():
            bw = bws.get(name)
            if len(fw) != 1 or not bw or len(bw) != 1 or fw[0].free is None:
                continue
            nbytes = fw[0].full.type.nbytes
            saved = op_seconds(bw[0].start, machine)[0]
            ranked.append((saved / max(nbytes, 1), name, fw[0], bw[0]))
        ranked.sort(key=lambda c: (-c[0], c[1]))
        lines = timelines(module)
        fwd, bwd = list(lines["forward"].during), list(lines["backward"].during)
        fpos = {op: i for i, op in enumerate(f.ops)}
        bpos = {op: i for i, op in enumerate(b.ops)}
        entry = lines["backward"].entry
        kept = []
        for _, name, fw, bw in ranked:
            # forward: held from its free to the end; backward: from entry to where it was gathered
            nbytes, k, g = fw.full.type.nbytes, fpos[fw.free], bpos[bw.start]
            if self.budget is not None and max([*fwd[k + 1:], *bwd[:g], entry], default=0) + nbytes > self.budget:
                stats["unshard: parameters left sharded (memory budget)"] += 1
                continue
            for j in range(k + 1, len(fwd)):
                fwd[j] += nbytes
            for j in range(g):
                bwd[j] += nbytes
            entry += nbytes
            kept.append((name, fw, bw))
            stats["unshard: parameters kept gathered from forward to backward"] += 1
        for name, fw, bw in sorted(kept, key=lambda c: fpos[c[1].start]):
            _keep(module, name, fw, bw)
