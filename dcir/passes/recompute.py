"""Recompute: rebuild saved activations in the backward instead of holding them.

``@forward`` hands ``@backward`` the activations its gradients need (``{saved}``
results). Each is held from the op that made it until the backward reads it, so at
the start of the backward every one is live at once: with long sequences they are
most of a step's memory. This pass drops chosen activations from the hand-off and
runs the op that made each again in every function that takes the saved values,
just before its first use there, marked ``act.recompute`` (``dcir.activations``).

An activation can be rebuilt when the ops that make it (its *cone*: at most 16 ops,
64 under a budget, what checkpointing a decoder layer's attention runs again) are
compute that draws no random numbers and start from values at hand in the backward:
activations that stay saved, parameters and buffers it reads again, and sharded
parameters it gathers again (``param.get``, ``comm.all_gather``, ``comm.wait`` before
the rebuilt ops, which ``prefetch`` may then move). A tensor handed over with views of
it (attention's softmax, detached for its own gradient and viewed for the product with
the values) is one candidate: dropping one of them would free nothing, so all go, and
their united cone runs once. Those are the candidates.

Which ones: without a budget, every cheap cone (elementwise ops, norms, views: no
library kernel, no matmul or convolution, whose recompute costs a kernel of its own),
the largest activation first, each taken when the memory model's peak of the step
(``dcir.memory``) goes down with it, or stays while the hand-off shrinks. With
``budget``, the most bytes per second of compute run again first (the profile's op
times where the module carries one), each taken only when the peak goes down, until
the peak fits; where that order does not reach the budget, the pass starts again in
the cheap-cones-first order with matmuls after them, which reaches the lowest floor.
Two cones often share ops (a layer's norm feeds its query, key and
value projections): a rebuild reads what an earlier one made before its own first use
instead of running those ops again, when the step's peak is no higher for holding
them that long; else it runs its whole cone. Statistics say what was rebuilt, how many
ops run again, and what could not be and why.

Before -> after::

    func @forward(%x: f32[64, 16] {input = "args[0]"}) -> (f32[] {output}, f32[64, 16] {saved}, f32[64, 16] {saved}) {
      %h = aten.relu.default(%x) : f32[64, 16]
      %loss = aten.sum.default(%h) : f32[]
      return %loss, %x, %h
    }
    func @backward(%x: f32[64, 16] {saved}, %h: f32[64, 16] {saved}, %g: f32[] {grad = 0}) {
      %gh = aten.threshold_backward.default(%e, %h) {threshold = 0}
  ->
    func @forward(...) -> (f32[] {output}, f32[64, 16] {saved}) {
      ...
      return %loss, %x
    }
    func @backward(%x: f32[64, 16] {saved}, %g: f32[] {grad = 0}) {
      %h = aten.relu.default(%x) {act.recompute} : f32[64, 16]
      %gh = aten.threshold_backward.default(%e, %h) {threshold = 0}
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import analysis, fusion, roles, signature
from dcir import ops as registry
from dcir.activations import RECOMPUTE, draws_random
from dcir.context import PlanContext
from dcir.cost import eager_s
from dcir.ir import UNIT, Function, Module, Op, PendingType, ShardType, Value
from dcir.machine import Machine
from dcir.memory import Bytes, device_bytes, saved_storage, step_peak, storage_bases
from dcir.passes import Pass
from dcir.rewrite import Rewriter


def footprint(module: Module) -> tuple[int, int]:
    """What the pass lowers: the memory model's peak over the module's functions, then
    the bytes the forward hands to the backward (lower later peaks need)."""
    handed = sum(dict(saved_storage(module).values()).values())  # one entry per storage
    return step_peak(module), handed


def gathered_from(value: Value) -> Op | None:
    """The ``param.get`` of the shard ``value`` is the gathered parameter of (the wait of
    an all_gather, coalesced or not, of a read shard), else None."""
    started = analysis.started_by(value)
    if started is None or not registry.has_trait(started[0], registry.GATHERS):
        return None
    gather, index = started
    read = gather.operands[index].owner
    return read if isinstance(read, Op) and registry.has_trait(read, registry.LOADS_STATE) else None


#: ops whose result is their operand under another name: a saved ``detach(x)`` gives the
#: backward ``x`` too (the forward saves a softmax's result detached, and its dropout's
#: input as it is)
ALIASES = ("aten.detach.default", "aten.alias.default")


def _alias_in(value: Value, saved: set[Value]) -> Value | None:
    """A saved value that is ``value`` under another name (``ALIASES``), if any."""
    return next((r for u, _ in value.uses if isinstance(u, Op) and u.name in ALIASES
                 for r in u.results if r in saved), None)


def _at_hand(module: Module, value: Value, saved: set[Value]) -> bool:
    """Whether the backward has ``value`` without holding it for the forward: another
    saved activation (or one that is it under another name), a parameter or buffer it
    reads again, or a sharded parameter it gathers again."""
    if value in saved or gathered_from(value) is not None or _alias_in(value, saved) is not None:
        return True
    owner = value.owner
    return isinstance(owner, Op) and registry.has_trait(owner, registry.LOADS_STATE) and \
        not isinstance(module.decls[owner.symbol].type, ShardType)


def _read_again(value: Value, fresh) -> list[Op]:
    """The ops that give the backward the state ``value`` is: a ``param.get``, and for a
    gathered parameter its all_gather and wait (the gathered copy is released after
    its last use, as any value without a ``mem.free``)."""
    read = gathered_from(value)
    if read is None:
        return [Op("param.get", [], [Value(fresh(value.name), value.type)], symbol=value.owner.symbol)]
    shard = Op("param.get", [], [Value(fresh(read.results[0].name), read.results[0].type)], symbol=read.symbol)
    before = analysis.started_by(value)[0]  # the forward's gather
    pending = Value(fresh(f"{value.name}_pending"), PendingType(value.type))
    gather = Op(registry.single_form(before) or before.name, [shard.results[0]], [pending], parens=True)
    wait = Op(registry.wait_for(gather), [gather.results[0]], [Value(fresh(value.name), value.type)], parens=True)
    return [shard, gather, wait]


#: the most ops rebuilt for one activation without a budget (a longer chain is the
#: forward run twice), and with one: a budget may need an attention's scores rebuilt
#: from its input projection and the causal mask, what checkpointing its layer would run
MAX_CONE, MAX_CONE_BUDGETED = 16, 64


def _why_not_op(op) -> str | None:
    """Why ``op`` cannot run again in the backward (None: it can)."""
    if not isinstance(op, Op) or not fusion.is_compute(op):
        return "not made by compute"
    if draws_random(op):
        return "draws random numbers"
    if registry.has_trait(op, registry.SIDE_EFFECT):
        return "has a side effect"
    return None


def cone(module: Module, fw: Function, rets: list[Value], saved: set[Value], limit: int = MAX_CONE) -> list[Op] | str:
    """The forward's ops that rebuild the saved activations ``rets`` (one storage: a
    tensor and the views of it the forward saves) from what the backward has at hand
    (the other ``saved`` values, state it reads again), each op once, in forward order;
    or why they cannot be rebuilt."""
    ops: list[Op] = []
    seen: set[Op] = set()
    todo = [ret.owner for ret in rets]
    owners = set(todo)
    others = saved - set(rets)
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        why = _why_not_op(op)
        if why is not None:
            return why if op in owners else "needs a value the backward does not have"
        seen.add(op)
        ops.append(op)
        if len(ops) > limit:
            return f"needs more than {limit} ops again"
        todo.extend(v.owner for v in op.operands if not _at_hand(module, v, others))
    order = {op: k for k, op in enumerate(fw.ops)}
    return sorted(ops, key=order.__getitem__)


def _rebuild(fw: Function, bws: list[Function], rets: list[Value], ops: list[Op],
             rewriters: dict[str, Rewriter], shared: dict[str, dict[Value, Value]] | None = None,
             reuse: bool = True) -> int:
    """Drop ``rets`` from the hand-off and run ``ops`` (their ``cone``) again in each of
    ``bws``, once, before the first use of what any of them was handed as; every change
    goes through ``rewriters`` (one per function, by name). With ``shared`` (per
    backward, forward value -> the value an earlier rebuild made for it there), what this
    one makes is added, and with ``reuse`` what an earlier rebuild made before that point
    is read, not run again. Returns the most ops one backward runs again."""
    most = 0
    for bw in bws:
        env = dict(signature.saved_pairs(fw, bw))  # forward value -> the backward's
        handed = {ret: env.pop(ret) for ret in rets}
        rewriter = rewriters[bw.name]
        users = [u for arg in handed.values() for u, _ in arg.uses if isinstance(u, Op)]
        anchor = min(users, key=bw.ops.index) if users else None
        if anchor is not None and shared is not None and reuse:
            before = set(bw.ops[:bw.ops.index(anchor)])
            env.update({v: w for v, w in shared[bw.name].items() if w.owner in before and v not in env})
        for v in {v for op in ops for v in op.operands if v not in env}:
            alias = _alias_in(v, set(env))
            if alias is not None:
                env[v] = env[alias]
        if anchor is not None:  # a backward that reads none of them just stops taking them
            known = set(env)
            most = max(most, _run_again(bw, ops, handed, env, rewriter, anchor))
            if shared is not None:
                shared[bw.name].update({v: w for v, w in env.items() if v not in known})
        for ret, arg in handed.items():
            if users:
                rewriter.replace_all_uses(arg, env[ret])
            rewriter.remove_arg(arg)
    dropped = {k for k in signature.result_indices(fw, signature.SAVED) if fw.returns[k] in set(rets)}
    keep = [k for k in range(len(fw.returns)) if k not in dropped]
    rewriters[fw.name].set_returns([fw.returns[k] for k in keep], [fw.result_types[k] for k in keep],
                                   [fw.result_attrs[k] for k in keep])
    return most


def _run_again(bw: Function, ops: list[Op], handed: dict[Value, Value], env: dict[Value, Value],
               rewriter: Rewriter, anchor: Op) -> int:
    """Insert ``ops`` again before ``anchor`` in ``bw``, marked recomputed, reading state
    again where ``env`` (forward value -> the backward's) has no value; a rebuilt value
    that was handed over takes the name of the argument it replaces. An op whose results
    ``env`` has already (an earlier rebuild's) is not run again. Returns how many ran."""
    fresh = bw.name_maker()
    ran = 0
    for op in ops:
        if op.results and all(r in env and r not in handed for r in op.results):
            continue
        ran += 1
        for v in op.operands:
            if v not in env:  # state the backward reads (and gathers) again
                again = _read_again(v, fresh)
                rewriter.insert_before(anchor, again)
                env[v] = again[-1].results[0]
        results = [Value(handed[r].name if r in handed else fresh(r.name), r.type) for r in op.results]
        again = Op(op.name, [env[v] for v in op.operands], results, {**op.attrs, RECOMPUTE: UNIT},
                   parens=op.parens, loc=op.loc)
        rewriter.insert_before(anchor, [again])
        env.update(zip(op.results, results))
    return ran


def _library(ops: list[Op]) -> bool:
    """Whether ``ops`` run a library kernel (a matmul, a convolution)."""
    return any(op.name.startswith(fusion.LIBRARY_KERNELS) for op in ops)


def storages(fw: Function) -> list[list[Value]]:
    """``fw``'s saved activations by storage: a tensor saved with views of it is one
    entry (dropping one of them frees nothing while another is handed over)."""
    bases = storage_bases(fw)
    out: dict[Value, list[Value]] = {}
    for ret in dict.fromkeys(signature.results(fw, signature.SAVED)):
        out.setdefault(bases.get(ret, ret), []).append(ret)
    return list(out.values())


#: the orders ``_candidates`` offers: the fewest seconds run again per byte freed first,
#: or the cheap cones (no library kernel) first, the largest first
BY_COST, BY_SIZE = "cost", "size"


def _candidates(module: Module, fw: Function, stats: Counter, limit: int, machine: Machine,
                order: str = BY_SIZE) -> list[list[Value]]:
    """The saved storages that can be rebuilt, in ``order``: ``BY_COST`` the most bytes per
    second of their cone's compute on ``machine`` first (the profile's op times where the
    module carries one); ``BY_SIZE`` those without a library kernel in their cone first,
    then by bytes, the largest first. Ties: the fewest ops again."""
    saved = set(signature.results(fw, signature.SAVED))
    out = []
    for rets in storages(fw):
        ops = cone(module, fw, rets, saved, limit)
        if isinstance(ops, str):
            stats[f"kept: {ops}"] += 1
            continue
        size = max(map(device_bytes, rets))
        if order == BY_COST:
            out.append((False, -size / max(sum(eager_s(op, machine) for op in ops), 1e-12), len(ops), rets))
        else:
            out.append((_library(ops), -size, len(ops), rets))
    return [rets for *_, rets in sorted(out, key=lambda c: c[:3])]


def _try_rebuild(module: Module, fw: Function, bws: list[Function], rets: list[Value], ops: list[Op],
                 rewriters: dict[str, Rewriter], shared: dict[str, dict[Value, Value]], now: tuple,
                 peak_only: bool = False) -> int | None:
    """Rebuild ``rets`` (``_rebuild``) if that lowers the ``footprint`` from ``now`` (with
    ``peak_only``, its peak: a rebuild that only shrinks the hand-off costs time for nothing):
    reading what earlier rebuilds made where they made it (fewer ops run again, each
    such value held longer) when the step's peak is no higher so, else running the
    whole cone again. Returns the most ops one backward runs again (None: the module is
    as it was)."""
    marks = {name: r.checkpoint() for name, r in rewriters.items()}
    before = {name: dict(made) for name, made in shared.items()}

    def attempt(reuse: bool) -> tuple[tuple, int]:
        ran = _rebuild(fw, bws, rets, ops, rewriters, shared, reuse)
        return footprint(module), ran

    def undo() -> None:
        for name, r in rewriters.items():
            r.rollback(marks[name])
        shared.update({name: dict(made) for name, made in before.items()})

    lower = (lambda f: f[0] < now[0]) if peak_only else (lambda f: f < now)
    whole, ran = attempt(reuse=False)
    undo()
    reused, ran_reusing = attempt(reuse=True)
    if lower(reused) and reused[0] <= whole[0]:
        return ran_reusing
    undo()
    if lower(whole):
        return attempt(reuse=False)[1]
    return None


@dataclass(frozen=True)
class Recompute(Pass):
    name = "recompute"
    budget: Bytes | None = None  # the step's peak to fit, per rank, as the memory model counts it

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        pair = roles.hand_off(module.functions.values())
        if pair is None:
            return
        fw, bws = pair
        rewriters = {f.name: Rewriter(f) for f in (fw, *bws)}
        machine = ctx.machine_for(module)
        if self.budget is not None:
            # under a budget, the cheapest bytes first, each taken only where it lowers the
            # peak; where that does not reach the budget (a rebuild took a value another
            # cone needed, or two rebuilds lower the peak only together), the order that
            # reaches the floor: cheap cones, largest first
            marks = {name: r.checkpoint() for name, r in rewriters.items()}
            by_cost = Counter()
            if self._take(module, fw, bws, rewriters, machine, by_cost, BY_COST)[0] <= self.budget:
                stats.update(by_cost)
                return
            for name, r in rewriters.items():
                r.rollback(marks[name])
        now = self._take(module, fw, bws, rewriters, machine, stats, BY_SIZE)
        if self.budget is not None and now[0] > self.budget:
            stats["over budget after every candidate"] += 1

    def _take(self, module: Module, fw: Function, bws: list[Function], rewriters: dict[str, Rewriter],
              machine: Machine, stats: Counter, order: str) -> tuple:
        """Rebuild the candidates in ``order`` in turn, each that lowers the footprint (``BY_COST``:
        the peak), until the budget fits; returns the footprint."""
        shared: dict[str, dict[Value, Value]] = {bw.name: {} for bw in bws}  # what rebuilds made, to reuse
        now = footprint(module)
        limit = MAX_CONE if self.budget is None else MAX_CONE_BUDGETED
        for rets in _candidates(module, fw, stats, limit, machine, order):
            if self.budget is not None and now[0] <= self.budget:
                break
            saved = set(signature.results(fw, signature.SAVED))
            ops = cone(module, fw, rets, saved, limit) if saved.issuperset(rets) else "a value it needs was rebuilt"
            if isinstance(ops, str):
                stats[f"kept: {ops}"] += 1
                continue
            if self.budget is None and _library(ops):
                stats["kept: needs a matmul again, and no budget asks for it"] += 1
                continue
            ran = _try_rebuild(module, fw, bws, rets, ops, rewriters, shared, now, peak_only=order == BY_COST)
            if ran is None:
                stats["kept: rebuilding it does not lower the peak"] += 1
                continue
            now = footprint(module)
            stats["activations rebuilt"] += 1
            stats["ops run again"] += ran
        return now
