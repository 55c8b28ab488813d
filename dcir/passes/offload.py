"""Offload: keep on the device only the optimizer state that fits the budget.

The optimizer's per-element state (Adam's ``exp_avg`` and ``exp_avg_sq``: twice the
trainable parameters' bytes, more than the parameters themselves) is needed only by
the optimizer step. The pass makes that step part of the program and gives the
state a home:

* every trainable parameter's state tensors become buffers (``buffer @w.exp_avg :
  shard<f32[4, 8], 2> {optim.state_of = @w, optim.key = "exp_avg"}``), so the memory
  model and the text show them; which tensors the optimizer keeps is the ``state``
  option (the Engine fills it in by asking the optimizer);
* a new function ``@step``, which the Engine runs at the accumulation boundary in
  place of ``optimizer.step()``, updates the parameters one by one: ``optim.step @w(%m,
  %v)`` runs the optimizer on ``@w`` alone, with its state, in place, on the device;
* when all state exceeds ``budget``, the smallest parameters' state moves to host
  memory (its buffer is declared ``host<...>``) until what stays on the device, plus
  room to update the largest offloaded parameter, fits. Only that much state ever
  crosses to the host and back, and the bytes on the device never exceed ``budget``.

In ``@step`` an offloaded parameter's state is reloaded (``mem.reload``, async), used
by its ``optim.step``, copied back home (``mem.offload``, async, then ``param.set``)
and its device copy freed. Reloads start as early as the budget allows, so a
reload overlaps the updates before it, and the copies home are waited on only when
their room is needed for the next reload, so they overlap the updates after them.
Around the step, the copies also overlap forward and backward compute, as far as
memory allows (each without raising that function's peak, by the memory model):

* the reloads ``@step`` would start before its first update start in the last
  backward instead, once its activations are freed; the backward returns the state
  and ``@step`` takes it as arguments;
* the copies home still in flight when ``@step`` ends finish in the next forward:
  ``@step`` returns that updated state, ``@forward`` takes it as its last arguments,
  starts the copies first thing and waits for them before its peak.

With gradient accumulation (``micro_steps``) nothing moves on the other micro-steps:
``@step`` runs once per optimizer step, its reloads go to ``@backward_last`` (made as
a copy of ``@backward`` when needed), and the copies home stay in ``@step``, since
``@forward`` runs on every micro-step.

Before -> after (golden ``offload.dcir``, ``budget=1100``: both parameters' state, 1.12
KiB, goes to host memory; @a's 1 KiB is all the room holds at once)::

    param @a : shard<f32[16, 16], 2> {trainable}
    param @b : shard<f32[32], 2> {trainable}
  ->
    buffer @a.exp_avg : host<shard<f32[16, 16], 2>> {optim.state_of = @a, optim.key = "exp_avg"}
    ...
    func @forward(%x: f32[64, 64], %b_exp_avg_1: shard<f32[32], 2>, ...) -> (...) {
      %b_exp_avg_off = mem.offload(%b_exp_avg_1) : pending<host<shard<f32[32], 2>>>
      ...                                       // gathers and compute
      %b_exp_avg_home, ... = mem.wait(%b_exp_avg_off, ...)
      param.set @b.exp_avg(%b_exp_avg_home)
      mem.free(%b_exp_avg_1, ...)
      %h = aten.mul.Tensor(%x, %x) : f32[64, 64]  // the forward's peak
      ...
    func @backward(...) -> (shard<f32[16, 16], 2>, shard<f32[16, 16], 2>) {
      ...
      mem.free(%big)
      %a_exp_avg_host = param.get @a.exp_avg : host<shard<f32[16, 16], 2>>
      %a_exp_avg_pending = mem.reload(%a_exp_avg_host) : pending<shard<f32[16, 16], 2>>
      ...                                       // the rest of the backward
      %a_exp_avg = mem.wait(%a_exp_avg_pending) : shard<f32[16, 16], 2>
      return %a_exp_avg, %a_exp_avg_sq
    func @step(%a_exp_avg: shard<f32[16, 16], 2>, ...) -> (shard<f32[32], 2>, ...) {
      %a_exp_avg_1, %a_exp_avg_sq_1 = optim.step @a(%a_exp_avg, %a_exp_avg_sq) : ...
      %a_exp_avg_off = mem.offload(%a_exp_avg_1) : pending<host<shard<f32[16, 16], 2>>>
      ...
      %a_exp_avg_home, ... = mem.wait(%a_exp_avg_off, ...)
      param.set @a.exp_avg(%a_exp_avg_home)
      mem.free(%a_exp_avg_1, %a_exp_avg_sq_1)
      %b_exp_avg_host = param.get @b.exp_avg : host<shard<f32[32], 2>>
      %b_exp_avg_pending = mem.reload(%b_exp_avg_host) : pending<shard<f32[32], 2>>
      ...
      %b_exp_avg_1, %b_exp_avg_sq_1 = optim.step @b(%b_exp_avg, %b_exp_avg_sq) : ...
      return %b_exp_avg_1, %b_exp_avg_sq_1
"""

from __future__ import annotations

import re
from collections import Counter, deque
from dataclasses import dataclass

from dcir import analysis, roles, signature
from dcir import ops as registry
from dcir.buffers import OPTIM_KEY, OPTIM_STATE_OF
from dcir.context import PlanContext
from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Decl, Function, HostType, Module, Op, PendingType, SymbolRef, Value
from dcir.memory import Bytes, device_bytes, format_bytes, kept_by_caller, saved_storage, timeline
from dcir.passes import Pass
from dcir.rewrite import Rewriter


def _choose(sizes: dict[str, int], budget: int | None) -> set[str]:
    """The parameters whose state goes to host: the smallest first, until what stays
    plus room for the largest one offloaded fits the budget (the fewest bytes moved)."""
    total = sum(sizes.values())
    if budget is None or total <= budget:
        return set()
    out: set[str] = set()
    moved = 0
    for name in sorted(sizes, key=lambda n: (sizes[n], n)):
        out.add(name)
        moved += sizes[name]
        if total - moved + sizes[name] <= budget:  # ascending: this one is the largest offloaded
            return out
    return out  # everything offloaded and still too large: the caller reports it


class _StepBuilder:
    """Writes ``@step``: state reloaded ahead within the room, copies home retired late."""

    def __init__(self, module: Module, func: Function, state: dict[str, list[str]], room: float):
        self.module, self.func, self.state, self.room = module, func, state, room
        self.rewriter = Rewriter(func)
        self.live = 0
        # copies home in flight: (their mem.offload starts, the state symbols they go to, bytes)
        self.inflight: deque[tuple[list[Op], list[str], int]] = deque()
        self.reloaded: dict[str, tuple[Op, list[Value]]] = {}
        self.fresh = func.name_maker()

    def value(self, base: str, type_) -> Value:
        return Value(self.fresh(base), type_)

    def emit(self, op: Op) -> None:
        self.rewriter.append([op])

    def nbytes(self, param: str) -> int:
        return sum(self.module.decls[s].type.inner.nbytes for s in self.state[param])

    def retire(self) -> None:
        starts, symbols, nbytes = self.inflight.popleft()
        for op in _finish_copies(symbols, starts, self.fresh):
            self.emit(op)
        self.live -= nbytes

    def reload(self, param: str, force: bool) -> bool:
        need = self.nbytes(param)
        while self.live + need > self.room:
            if not force or not self.inflight:
                return False
            self.retire()
        pendings, devices = [], []
        for sym in self.state[param]:
            host_type = self.module.decls[sym].type
            base = sym.replace(".", "_")
            host = self.value(base + "_host", host_type)
            self.emit(Op("param.get", [], [host], symbol=sym))
            pending = self.value(base + "_pending", PendingType(host_type.inner))
            self.emit(Op("mem.reload", [host], [pending]))
            pendings.append(pending)
            devices.append(self.value(base, host_type.inner))
        self.reloaded[param] = (Op("mem.wait", pendings, devices), devices)
        self.live += need
        return True

    def offload(self, param: str, updated: list[Value]) -> None:
        starts = _copies_home(self.state[param], updated, self.fresh)
        for op in starts:
            self.emit(op)
        self.inflight.append((starts, self.state[param], self.nbytes(param)))

    def finish_all(self, skip: set[int]) -> None:
        """Finish the copies home still in flight, but those at the positions ``skip``."""
        for k, (starts, symbols, _) in enumerate(self.inflight):
            if k not in skip:
                self.rewriter.append(_finish_copies(symbols, starts, self.fresh))


def _copies_home(symbols: list[str], updated: list[Value], fresh) -> list[Op]:
    """The async starts that copy a parameter's updated state (``updated``, on the
    device) home to its host buffers ``symbols``."""
    return [Op("mem.offload", [v], [Value(fresh(sym.replace(".", "_") + "_off"), PendingType(HostType(v.type)))])
            for sym, v in zip(symbols, updated)]


def _finish_copies(symbols: list[str], starts: list[Op], fresh) -> list[Op]:
    """The ops that finish the copies ``starts``: their wait, ``param.set`` of the host
    copies, free of the device copies."""
    pendings = [op.results[0] for op in starts]
    homes = [Value(fresh(sym.replace(".", "_") + "_home"), p.type.inner) for sym, p in zip(symbols, pendings)]
    sets = [Op("param.set", [home], symbol=sym) for sym, home in zip(symbols, homes)]
    return [Op("mem.wait", pendings, homes), *sets, Op("mem.free", [op.operands[0] for op in starts])]


def _earliest_to_end(during: list[int], limit: int) -> int | None:
    """The first position from which every entry of ``during`` to the end is within ``limit``."""
    at = None
    for i in reversed(range(len(during))):
        if during[i] > limit:
            break
        at = i
    return at


def _latest_from_entry(during: list[int], limit: int) -> int:
    """How many entries of ``during``, from the first, are all within ``limit``."""
    n = 0
    while n < len(during) and during[n] <= limit:
        n += 1
    return n


def _hand_over(module: Module, step: Function, micro_steps: int, stats: Counter) -> None:
    """Start the reloads ``@step`` issues before its first update in the last backward
    instead, where they overlap compute; the backward returns the reloaded state and
    ``@step`` takes it as arguments. The last backward is ``@backward_last`` (made here,
    as a copy of ``@backward``, when there are several micro-steps and a reload moves).

    A reload starts at the earliest op after which its bytes, held to the end of the
    backward, do not raise the backward's peak (the memory model's), so the state
    arrives as early as memory allows at no cost in peak memory."""
    first = next((i for i, op in enumerate(step.ops) if registry.has_trait(op, registry.OPTIMIZES)), 0)
    reloads = [op for op in step.ops[:first] if _is_reload(op)]
    bw = roles.last_micro_step(module.functions.values(), roles.BACKWARD)
    if not reloads or bw is None or bw.returns:
        return
    line = timeline(bw, saved_storage(module), kept_by_caller(module))
    peak, during = line.peak, list(line.during)
    placed: list[tuple[Op, int]] = []
    for reload in reloads:
        nbytes = device_bytes(reload.results[0])
        at = _earliest_to_end(during, peak - nbytes)
        if at is None:
            continue  # it would raise the backward's peak anywhere: it stays in @step
        for j in range(at, len(during)):
            during[j] += nbytes
        placed.append((reload, at))
    if not placed:
        return
    if micro_steps > 1 and bw.role == roles.BACKWARD:  # the other micro-steps move nothing
        bw = module.functions[roles.BACKWARD_LAST] = bw.clone(roles.BACKWARD_LAST, roles.BACKWARD_LAST)
    anchors, fresh = list(bw.ops), bw.name_maker()
    backward, arrived = Rewriter(bw), []
    for reload, at in placed:
        get = reload.operands[0].owner
        host = Value(fresh(get.results[0].name), get.results[0].type)
        pending = Value(fresh(reload.results[0].name), reload.results[0].type)
        backward.insert_before(anchors[at], [Op(get.name, [], [host], symbol=get.symbol),
                                             Op(reload.name, [host], [pending])])
        arrived.append(Op(registry.wait_for(reload), [pending], [Value(fresh(_waited(step, reload).name),
                                                                         pending.type.inner)]))
        stats["offload: reloads started in the last backward"] += 1
    backward.append(arrived)
    backward.set_returns([op.results[0] for op in arrived], attrs=[signature.mark(signature.STATE)] * len(arrived))
    _take_as_arguments(step, [reload for reload, _ in placed])


def _is_reload(op: Op) -> bool:
    return registry.has_trait(op, registry.HOST_COPY) and isinstance(op.operands[0].type, HostType)


def _waited(func: Function, start: Op) -> Value:
    """The value the wait of the async ``start`` yields."""
    wait = analysis.waits(func)[start.results[0]]
    return wait.results[wait.operands.index(start.results[0])]


def _take_as_arguments(step: Function, reloads: list[Op]) -> None:
    """``@step`` takes the state ``reloads`` brought as arguments, in place of its own
    reloads (their reads of the host copy, and their part of the wait)."""
    rewriter, waits = Rewriter(step), analysis.waits(step)
    for reload in reloads:
        device = _waited(step, reload)
        arg = Value(device.name, device.type)
        rewriter.insert_arg(arg, attrs=signature.mark(signature.STATE))
        rewriter.replace_all_uses(device, arg)
    moved = {reload.results[0] for reload in reloads}
    for wait in {waits[pending]: None for pending in moved}:
        kept = [(v, r) for v, r in zip(wait.operands, wait.results) if v not in moved]
        if kept:
            rest = Op(wait.name, [v for v, _ in kept], [Value(r.name, r.type) for _, r in kept])
            rewriter.insert_before(wait, [rest])
            for (_, r), new in zip(kept, rest.results):
                rewriter.replace_all_uses(r, new)
        rewriter.erase(wait)
    for reload in reloads:
        get = reload.operands[0].owner
        rewriter.erase(reload)
        rewriter.erase(get)


def _hand_to_forward(module: Module, step: Function, tail: list[tuple[list[Op], list[str], int]],
                     stats: Counter) -> set[int]:
    """Finish the copies home still in flight at the end of ``@step`` (``tail``) in the
    next ``@forward`` instead, where they overlap its compute: ``@step`` returns those
    parameters' updated state, still on the device, and ``@forward`` takes it as its
    last arguments, starts the copies first thing and finishes them as late as memory
    allows. Returns the positions in ``tail`` of the copies it moved.

    The copies of one parameter are finished before the latest op up to which holding
    its bytes from the forward's entry does not raise the forward's peak (the memory
    model's), so the peak stays what it was; a copy that would have to finish at the
    entry gains nothing there and stays in ``@step``."""
    fw = module.role(roles.FORWARD)
    if fw is None or not tail:
        return set()
    line = timeline(fw)
    peak, during = line.peak, list(line.during)
    finish_at: dict[int, int] = {}
    for k in reversed(range(len(tail))):  # the newest copies have the most left to do
        before = _latest_from_entry(during, peak - tail[k][2])
        if before == 0:
            continue  # it would finish at the entry, behind no compute
        for j in range(before):
            during[j] += tail[k][2]
        finish_at[k] = before
        stats["offload: copies home finished in the next forward"] += 1
    if finish_at:
        _move_copies(step, fw, [(tail[k][0], tail[k][1], finish_at[k]) for k in sorted(finish_at)])
    return set(finish_at)


def _move_copies(step: Function, fw: Function, copies: list[tuple[list[Op], list[str], int]]) -> None:
    """``@step`` returns the state its copies home ``(starts, symbols, finish)`` would
    copy; ``@forward`` takes it as arguments, starts the copies at its entry and
    finishes each before its op ``finish`` (a position before any of this)."""
    forward, anchors, fresh = Rewriter(fw), list(fw.ops), fw.name_maker()
    built = {}
    for k in reversed(range(len(copies))):  # named newest first, as they were decided
        starts, symbols, _ = copies[k]
        args = [Value(fresh(op.operands[0].name), op.operands[0].type) for op in starts]
        new_starts = _copies_home(symbols, args, fresh)
        built[k] = (args, new_starts, _finish_copies(symbols, new_starts, fresh))
    stepping, starts_all = Rewriter(step), []
    for k, (starts, _, finish) in enumerate(copies):
        args, new_starts, finishing = built[k]
        stepping.set_returns([*step.returns, *(op.operands[0] for op in starts)],
                             attrs=[*step.result_attrs, *[signature.mark(signature.STATE)] * len(starts)])
        for op in starts:
            stepping.erase(op)
        for a in args:
            forward.insert_arg(a, attrs=signature.mark(signature.STATE))
        starts_all.extend(new_starts)
        forward.insert_before(anchors[finish] if finish < len(anchors) else None, finishing)
    forward.insert_at(0, starts_all)


def _declare_state(module: Module, params: list[Decl], keys: list[str], offloaded: set[str]) -> dict[str, list[str]]:
    """Declare a buffer for each optimizer state tensor of each parameter (in host memory
    for the ``offloaded`` ones); returns each parameter's state symbols, in ``keys`` order."""
    state: dict[str, list[str]] = {}
    for d in params:
        syms = []
        for key in keys:
            sym = f"{d.name}.{key}"
            while sym in module.decls:
                sym += "_"
            home = HostType(d.type) if d.name in offloaded else d.type
            module.decls[sym] = Decl("buffer", sym, home, {OPTIM_STATE_OF: SymbolRef(d.name), OPTIM_KEY: key})
            syms.append(sym)
        state[d.name] = syms
    return state


def _write_step(module: Module, params: list[Decl], state: dict[str, list[str]], offloaded: set[str],
                room: float, stats: Counter) -> _StepBuilder:
    """Write ``@step``'s updates, reloading offloaded state ahead as far as ``room``
    allows; the copies home still in flight are left in the builder for the caller."""
    build = _StepBuilder(module, Function(roles.STEP, role=roles.STEP), state, room)
    order = [d.name for d in params if d.name in offloaded]
    ahead = 0  # next reload to issue

    def prefetch() -> None:
        nonlocal ahead
        while ahead < len(order) and build.reload(order[ahead], force=False):
            ahead += 1

    prefetch()
    for d in params:
        if d.name in offloaded:
            while ahead <= order.index(d.name):
                build.reload(order[ahead], force=True)
                ahead += 1
            wait, values = build.reloaded.pop(d.name)
            build.emit(wait)
        else:
            values = []
            for sym in state[d.name]:
                v = build.value(sym.replace(".", "_"), module.decls[sym].type)
                build.emit(Op("param.get", [], [v], symbol=sym))
                values.append(v)
        updated = [build.value(v.name + "_1", v.type) for v in values]
        build.emit(Op("optim.step", values, updated, symbol=d.name))
        if d.name in offloaded:
            build.offload(d.name, updated)
            stats["offload: parameters whose optimizer state lives in host memory"] += 1
        else:
            stats["offload: parameters whose optimizer state stays on the device"] += 1
        prefetch()
    return build


@dataclass(frozen=True)
class Offload(Pass):
    name = "offload"
    #: the most optimizer-state bytes on the device at any time (per rank); none: all of it
    budget: Bytes | None = None
    #: the optimizer's per-element state tensors, ``+``-separated (the Engine asks its optimizer)
    state: str = "exp_avg+exp_avg_sq"
    #: micro-steps per optimizer step; above 1, reloads start in ``@backward_last`` only
    #: and the copies home finish in ``@step``
    micro_steps: int = 1

    def __post_init__(self):
        if self.micro_steps < 1:
            raise ValueError("micro_steps must be at least 1")
        keys = self.state.split("+")
        bad = [k for k in keys if not re.fullmatch(r"[A-Za-z_]\w*", k)]
        if bad:
            raise ValueError(f"state names the optimizer's state tensors, like exp_avg+exp_avg_sq; "
                             f"{bad[0]!r} is not a name")

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        if module.role(roles.STEP) is not None:
            stats["offload: @step exists already"] += 1
            return
        keys = self.state.split("+")
        params = [d for d in module.decls.values() if d.trainable]
        sizes = {d.name: len(keys) * d.type.nbytes for d in params}
        offloaded = _choose(sizes, self.budget)
        kept = sum(n for p, n in sizes.items() if p not in offloaded)
        room = float("inf") if self.budget is None else self.budget - kept
        if offloaded and max(sizes[p] for p in offloaded) > room:
            largest = module.decls[max(offloaded, key=lambda p: sizes[p])]
            raise DcirError(Diagnostic(
                f"offload: the optimizer state of @{largest.name} ({format_bytes(sizes[largest.name])}) does not "
                f"fit the budget of {format_bytes(self.budget)}; the step updates it on the device, so the budget "
                f"must hold at least the largest parameter's state", module.source, largest.loc, len(largest.kind)))
        state = _declare_state(module, params, keys, offloaded)
        build = _write_step(module, params, state, offloaded, room, stats)
        func = build.func
        # the copies home still in flight finish in the next forward where that hides them
        # (under accumulation @forward runs on every micro-step: they stay in @step)
        handed = _hand_to_forward(module, func, list(build.inflight) if self.micro_steps == 1 else [], stats)
        build.finish_all(skip=handed)
        module.functions[roles.STEP] = func
        _hand_over(module, func, self.micro_steps, stats)
        moved = sum(sizes[p] for p in offloaded)
        arrived = sum(a.type.nbytes for a in func.args)  # reloaded in the backward: held into @step
        peak = kept + max(timeline(func).peak, arrived)
        stats[f"offload: optimizer state {format_bytes(sum(sizes.values()))}, on the device at most "
              f"{format_bytes(peak)}, moved each step {format_bytes(moved)}"] += 1
