"""Unshard: keep chosen parameters gathered from ``@forward`` to ``@backward``.

Under ``zero3`` every parameter is gathered twice a step: for the forward and again
for the backward. For a parameter kept gathered, ``@forward`` does not free the
gathered tensor but hands it to ``@backward`` with the saved values, and ``@backward``
uses it in place of its own gather (and frees it after its last use there). That
saves one all_gather per parameter and step, and costs the parameter's full size,
live from its last use in the forward to its last use in the backward.

Which parameters: every candidate (gathered once in each function; a coalesced
gather counts as one gather per tensor, and what is left of it is coalesced again)
is ranked by communication saved per byte held, the backward gather's transfer time
(profiled ``prof.time_us``, else the analytic alpha-beta model) over the parameter's
bytes, and taken in that order while the memory model keeps both functions within
``budget``. Without a budget every candidate is kept gathered. A gather that sends
its shard cast first (``mixed_precision``), or quantized to int8 and rebuilt after its
wait (``quantize``), is a candidate too: the backward's cast, or quantize and rebuild,
go with its gather; the forward hands over what its own gather made, so a parameter is
kept only where both send it the same way.

With ``micro_steps`` > 1 (gradient accumulation; the Engine passes its own), kept
parameters stay gathered across the micro-steps of an optimizer step: each gets a
buffer for its gathered copy (``buffer @w.unsharded : f32[4, 8] {unshard.of = @w}``),
a new function ``@unshard`` gathers them all (the Engine runs it before the first
micro-step of every optimizer step), and every gather of them in ``@forward`` and
``@backward`` becomes a read of the copy. Ranked by the transfer time saved per step
per byte; a copy is held at every op, so it is taken while the larger function peak
plus the copies stays within ``budget``. A copy holds what the gathers made: bf16 where
they sent the shard cast (``mixed_precision``), the weight rebuilt from int8 where they
quantized it (``quantize``), and ``@unshard`` sends the shard the same way.

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

from dcir import analysis, roles, signature
from dcir import ops as registry
from dcir.buffers import UNSHARD_OF
from dcir.context import PlanContext
from dcir.cost import Machine, note_source, op_seconds
from dcir.ir import Decl, Function, Module, Op, PendingType, SymbolRef, Value
from dcir.memory import Bytes, storage_bases, timelines
from dcir.passes import Pass
from dcir.passes.free import place_frees
from dcir.rewrite import Rewriter


@dataclass
class Gather:
    get: Op          # param.get of the shard
    start: Op        # comm.all_gather
    wait: Op         # comm.wait
    full: Value      # the gathered tensor
    free: Op | None  # the mem.free that releases it
    #: what converts the shard before it is sent: ``mixed_precision``'s mem.cast, or ``quantize``'s
    #: mem.quantize (its int8 copy and scales, both sent)
    cast: Op | None = None
    #: what makes the gathered tensor of what the wait gave (``quantize``'s mem.dequantize)
    rebuild: Op | None = None


def _same(values: list[Value], others: list[Value]) -> bool:
    return len(values) == len(others) and all(a is b for a, b in zip(values, others))


def _sent_from(start: Op) -> tuple[Op, Op | None] | None:
    """The shard read behind all that ``start`` sends and the op that converts it (None:
    the shard is sent as read): one tensor, or every result of one converting op (the
    int8 copy and scales of ``mem.quantize``); None when it sends anything else."""
    sources = [analysis.shard_read(v) for v in start.operands]
    if any(s is None for s in sources) or len({(id(r), id(c)) for r, c in sources}) != 1:
        return None
    read, convert = sources[0]
    return (read, convert) if _same(start.operands, convert.results if convert else read.results) else None


def _rebuilt(wait: Op) -> tuple[Value, Op | None] | None:
    """The gathered tensor ``wait`` makes: its one result, or the one result of the
    converting op that alone reads all of them (``mem.dequantize``); else None."""
    if len(wait.results) == 1:
        return wait.results[0], None
    readers = {u for r in wait.results for u in r.users() if not registry.has_trait(u, registry.FREES)}
    rebuild = readers.pop() if len(readers) == 1 else None
    if rebuild is None or not analysis.converts(rebuild) or len(rebuild.results) != 1 \
            or not _same(rebuild.operands, wait.results):
        return None
    return rebuild.results[0], rebuild


def param_gathers(func: Function, through_casts: bool = False) -> dict[str, list[Gather]]:
    """Gathers of one parameter each, waited alone, by parameter; ``through_casts``: also
    those that send the shard converted (``analysis.shard_read``): cast to bf16, or
    quantized to int8 and rebuilt after the wait."""
    waits = analysis.waits(func)
    storage = storage_bases(func)
    frees = {}
    for op in func.ops:
        if registry.has_trait(op, registry.FREES):
            for v in op.operands:
                frees.setdefault(storage.get(v, v), op)
    out: dict[str, list[Gather]] = {}
    for op in func.ops:
        if not registry.has_trait(op, registry.GATHERS):
            continue
        source, wait = _sent_from(op), waits.get(op.results[0])
        if source is None or (source[1] is not None and not through_casts) or wait is None \
                or not _same(wait.operands, op.results):
            continue
        made = _rebuilt(wait)
        if made is None:
            continue
        (src, cast), (full, rebuild) = source, made
        free = frees.get(storage.get(full, full))
        out.setdefault(src.symbol, []).append(Gather(src, op, wait, full, free, cast, rebuild))
    return out


def _split_coalesced(func: Function) -> list[tuple[Op, list[Op]]]:
    """Each coalesced gather becomes one gather per wait that joins it (one tensor, or
    the int8 copy and scales of a quantized one) at its place, yielding the same values,
    so that every gather of a parameter is seen (a kept parameter gathered again in a
    coalesced gather would be gathered twice). Returns (coalesced op, its parts) for
    ``_merge_back``."""
    rewriter, groups, waits = Rewriter(func), [], analysis.waits(func)
    for op in list(func.ops):
        if not registry.has_trait(op, registry.GATHERS) or not registry.is_coalesced(op):
            continue
        joined: dict[int, list[int]] = {}
        for k, r in enumerate(op.results):
            joined.setdefault(id(waits.get(r, r)), []).append(k)
        attrs = analysis.unprofiled(op.attrs)  # the group stays
        parts = [Op(op.name if len(ks) > 1 else registry.single_form(op), [op.operands[k] for k in ks],
                    [Value(op.results[k].name, op.results[k].type) for k in ks], dict(attrs), loc=op.loc)
                 for ks in joined.values()]
        rewriter.insert_before(op, parts)
        by_name = {r.name: r for p in parts for r in p.results}
        rewriter.replace_op(op, [by_name[r.name] for r in op.results])
        groups.append((op, parts))
    return groups


def _merge_back(func: Function, groups: list[tuple[Op, list[Op]]]) -> None:
    """The parts of each split gather that are left become one coalesced gather again,
    at the place of the first (its profile holds only if no part went)."""
    rewriter, where = Rewriter(func), set(func.ops)
    for coalesced, parts in groups:
        left = [p for p in parts if p in where]
        if len(left) < 2 and len(left) != len(parts):
            continue
        attrs = coalesced.attrs if len(left) == len(parts) else analysis.unprofiled(coalesced.attrs)
        merged = Op(coalesced.name, [v for p in left for v in p.operands],
                    [Value(r.name, r.type) for p in left for r in p.results], dict(attrs), loc=coalesced.loc)
        rewriter.insert_before(left[0], [merged])
        made = iter(merged.results)
        for p in left:
            rewriter.replace_op(p, [next(made) for _ in p.results])


def _drop_from_free(rewriter: Rewriter, free: Op, value: Value) -> None:
    """``free`` no longer releases ``value`` (and goes when it releases nothing)."""
    rest = [v for v in free.operands if v is not value]
    if rest:
        rewriter.set_operands(free, rest)
    else:
        rewriter.erase(free)


def _drop_frees(rewriter: Rewriter, values: list[Value]) -> None:
    """No free releases ``values`` any more."""
    for v in values:
        for free in [u for u in v.users() if registry.has_trait(u, registry.FREES)]:
            _drop_from_free(rewriter, free, v)


def _drop_gather(rewriter: Rewriter, g: Gather) -> None:
    """Erase a gather whose result is no longer read, with what converted the shard for
    it and rebuilt its result, and its shard read if only it read it."""
    if g.rebuild is not None:
        rewriter.erase(g.rebuild)
        _drop_frees(rewriter, g.wait.results)
    rewriter.erase(g.wait)
    rewriter.erase(g.start)
    if g.cast is not None:
        _drop_frees(rewriter, g.cast.results)
        if not any(r.uses for r in g.cast.results):
            rewriter.erase(g.cast)
    if not g.get.results[0].uses:
        rewriter.erase(g.get)


def _sends(g: Gather) -> tuple:
    """What ``g`` sends and makes of it: the shard as stored, or converted and rebuilt
    (those ops' names and attributes)."""
    return tuple((op.name, *sorted((k, str(v)) for k, v in analysis.unprofiled(op.attrs).items()))
                 for op in (g.cast, g.rebuild) if op is not None)


def _keep(module: Module, name: str, fw: Gather, bw: Gather) -> None:
    """Hand ``fw.full`` from @forward to @backward in place of @backward's gather."""
    f, b = module.role(roles.FORWARD), module.role(roles.BACKWARD)
    forward = Rewriter(f)
    _drop_from_free(forward, fw.free, fw.full)
    forward.set_returns([*f.returns, fw.full], attrs=[*f.result_attrs, signature.mark(signature.SAVED)])
    backward = Rewriter(b)
    arg = Value(bw.full.name, bw.full.type)  # the gathered value becomes an argument, under its own name
    backward.insert_arg(arg, signature.first_grad(b), signature.mark(signature.SAVED))
    backward.replace_all_uses(bw.full, arg)
    _drop_gather(backward, bw)


def _resident(module: Module, name: str, gathers: list[Gather]) -> str:
    """Read the parameter from its gathered copy: declare ``buffer @<p>.unsharded``,
    filled by ``@unshard``, in the type the gathers make (bf16 where they send the
    shard cast); every gather of it becomes a read of the copy."""
    decl = module.decls[name]
    copy = name + ".unsharded"
    while copy in module.decls:
        copy += "_"
    full_type = gathers[0].full.type if gathers else decl.full_type
    module.decls[copy] = Decl("buffer", copy, full_type, {UNSHARD_OF: SymbolRef(name)})
    for func in module.functions.values():
        rewriter = Rewriter(func)
        for g in (x for x in gathers if x.start in func.ops):
            read = Op(g.get.name, [], [Value(g.full.name, g.full.type)], symbol=copy)
            rewriter.insert_before(g.start, [read])
            if g.free is not None:  # state is not the schedule's to release
                _drop_from_free(rewriter, g.free, g.full)
            rewriter.replace_all_uses(g.full, read.results[0])
            _drop_gather(rewriter, g)
    return copy


def _like(op: Op, operands: list[Value], results: list[Value]) -> Op:
    """An op doing what ``op`` does, on ``operands`` (its profile left behind)."""
    return Op(op.name, operands, results, analysis.unprofiled(op.attrs))


def _unshard_function(module: Module, copies: list[tuple[str, str, Gather | None]]) -> None:
    """``@unshard``: gathers each kept parameter into its copy (name, copy, and one of
    the gathers it replaces: what that one sent the shard through, cast or quantized,
    and rebuilt the tensor with, this one does too); the Engine runs it before the first
    micro-step of every optimizer step. Each gathered buffer is freed once stored, by the
    free placement (``dcir.passes.free``)."""
    func = Function(roles.UNSHARD, role=roles.UNSHARD)
    rewriter, fresh = Rewriter(func), func.name_maker()
    for name, copy, like in copies:
        decl = module.decls[name]
        base = name.replace(".", "_")
        sent = [Value(fresh(base + "_shard"), decl.type)]
        rewriter.append([Op("param.get", [], sent, symbol=name)])
        if like is not None and like.cast is not None:
            converted = [Value(fresh(base + "_sent"), r.type) for r in like.cast.results]
            rewriter.append([_like(like.cast, sent, converted)])
            sent = converted
        pending = [Value(fresh(base + "_pending"), PendingType(v.type.full)) for v in sent]
        over = decl.type.over  # gathered over the ranks the shards are split over (HSDP: the node's)
        start = Op("comm.all_gather" if len(sent) == 1 else "comm.all_gather_coalesced", sent, pending,
                   {"group": over} if over else {})
        rebuild = like.rebuild if like is not None else None
        got = [Value(fresh(base + ("_got" if rebuild else "")), p.type.inner) for p in pending]
        rewriter.append([start, Op(registry.wait_for(start), pending, got)])
        full = got[0]
        if rebuild is not None:
            full = Value(fresh(base), module.decls[copy].type)
            rewriter.append([_like(rebuild, got, [full])])
        rewriter.append([Op("param.set", [full], [], symbol=copy)])
    place_frees(func, Counter())
    module.functions[roles.UNSHARD] = func


def gather_once_a_step(module: Module, params: list[tuple[str, list[Gather]]]) -> None:
    """Every parameter of ``params`` (its name, and its gathers in every function) read
    from a copy that ``@unshard`` gathers once per optimizer step, the way its gathers
    did: what ``zero2`` does to every parameter, and ``unshard`` under accumulation to
    those it keeps."""
    copies = [(name, _resident(module, name, gathers), gathers[0] if gathers else None) for name, gathers in params]
    if copies:
        _unshard_function(module, copies)


@dataclass(frozen=True)
class Unshard(Pass):
    name = "unshard"
    #: the most bytes the memory model may count at any op of either function (per rank); none: no limit
    budget: Bytes | None = None
    #: micro-steps per optimizer step; above 1, kept parameters stay gathered across them
    micro_steps: int = 1

    def __post_init__(self):
        if self.micro_steps < 1:
            raise ValueError("micro_steps must be at least 1")

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        f, b = module.role(roles.FORWARD), module.role(roles.BACKWARD)
        if f is None or b is None or module.role(roles.UNSHARD) is not None:
            return
        funcs = [func for func in roles.in_order(module.functions.values()) if roles.runs_per_micro_step(func)]
        split = [(func, _split_coalesced(func)) for func in funcs]
        self._choose(module, f, b, stats, ctx.machine_for(module))
        for func, groups in split:
            _merge_back(func, groups)

    def _choose(self, module: Module, f: Function, b: Function, stats: Counter, machine: Machine) -> None:
        note_source(module, stats, "unshard")
        fws, bws = param_gathers(f, True), param_gathers(b, True)
        last = module.role(roles.BACKWARD_LAST)
        if last is not None:  # the last micro-step's backward gathers the same parameters
            for name, gs in param_gathers(last, True).items():
                bws.setdefault(name, []).extend(gs)
            if self.micro_steps == 1:  # its saved values are @backward's: no hand-over to two
                stats["unshard: left as it is (@backward_last: give micro_steps)"] += 1
                return
        if self.micro_steps > 1:
            self._across_micro_steps(module, fws, bws, machine, stats)
            return
        ranked = []
        for name, fw in fws.items():
            bw = bws.get(name)
            if len(fw) != 1 or not bw or len(bw) != 1 or fw[0].free is None or fw[0].full.type != bw[0].full.type \
                    or _sends(fw[0]) != _sends(bw[0]):
                continue  # the backward would read another tensor than its gather made
            nbytes = fw[0].full.type.nbytes
            saved = op_seconds(bw[0].start, machine)[0]
            ranked.append((saved / max(nbytes, 1), name, fw[0], bw[0]))
        ranked.sort(key=lambda c: (-c[0], c[1]))
        lines = timelines(module)
        fwd, bwd = list(lines[f.name].during), list(lines[b.name].during)
        fpos = {op: i for i, op in enumerate(f.ops)}
        bpos = {op: i for i, op in enumerate(b.ops)}
        entry = lines[b.name].entry
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

    def _across_micro_steps(self, module: Module, fws, bws, machine: Machine, stats: Counter) -> None:
        """Every micro-step's gathers of a kept parameter become reads of a copy
        gathered once per optimizer step; the copy is held all the time."""
        ranked = []
        for name in sorted(set(fws) | set(bws)):
            gathers = fws.get(name, []) + bws.get(name, [])
            if any(g.free is None for g in gathers) or len({(g.full.type, _sends(g)) for g in gathers}) > 1:
                continue  # one copy serves every gather: they must make the same tensor
            once = sum(op_seconds(g.start, machine)[0] for g in gathers)
            saved = once * self.micro_steps - op_seconds(gathers[0].start, machine)[0]
            nbytes = gathers[0].full.type.nbytes
            ranked.append((saved / max(nbytes, 1), name, gathers))
        ranked.sort(key=lambda c: (-c[0], c[1]))
        worst = max(t.peak for t in timelines(module).values())
        kept = []
        for _, name, gathers in ranked:
            nbytes = gathers[0].full.type.nbytes
            if self.budget is not None and worst + nbytes > self.budget:
                stats["unshard: parameters left sharded (memory budget)"] += 1
                continue
            worst += nbytes  # held at every op, over the peak of either function at worst
            kept.append((name, gathers))
            stats["unshard: parameters kept gathered across micro-steps"] += 1
        gather_once_a_step(module, kept)
