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
their room is needed for the next reload (or at the end), so they overlap the
updates after them. With gradient accumulation nothing moves on the micro-steps:
``@step`` runs once per optimizer step.

Before -> after (``budget=1KiB``; @b's 2 x 64 B fit, @w's 2 x 512 B do not)::

    param @w : shard<f32[16, 16], 2> {trainable}
    param @b : shard<f32[32], 2> {trainable}
  ->
    buffer @w.exp_avg : host<shard<f32[16, 16], 2>> {optim.state_of = @w, optim.key = "exp_avg"}
    buffer @w.exp_avg_sq : host<shard<f32[16, 16], 2>> {optim.state_of = @w, optim.key = "exp_avg_sq"}
    buffer @b.exp_avg : shard<f32[32], 2> {optim.state_of = @b, optim.key = "exp_avg"}
    buffer @b.exp_avg_sq : shard<f32[32], 2> {optim.state_of = @b, optim.key = "exp_avg_sq"}
    func @step() {
      %w_exp_avg_host = param.get @w.exp_avg : host<shard<f32[16, 16], 2>>
      %w_exp_avg_pending = mem.reload(%w_exp_avg_host) : pending<shard<f32[16, 16], 2>>
      ...
      %b_exp_avg = param.get @b.exp_avg : shard<f32[32], 2>
      %b_exp_avg_sq = param.get @b.exp_avg_sq : shard<f32[32], 2>
      %b_exp_avg_1, %b_exp_avg_sq_1 = optim.step @b(%b_exp_avg, %b_exp_avg_sq) : ...
      %w_exp_avg, %w_exp_avg_sq = comm.wait(%w_exp_avg_pending, %w_exp_avg_sq_pending) : ...
      %w_exp_avg_1, %w_exp_avg_sq_1 = optim.step @w(%w_exp_avg, %w_exp_avg_sq) : ...
      %w_exp_avg_off = mem.offload(%w_exp_avg_1) : pending<host<shard<f32[16, 16], 2>>>
      ...
      %w_exp_avg_home, %w_exp_avg_sq_home = comm.wait(%w_exp_avg_off, %w_exp_avg_sq_off) : ...
      param.set @w.exp_avg(%w_exp_avg_home)
      param.set @w.exp_avg_sq(%w_exp_avg_sq_home)
      mem.free(%w_exp_avg_1, %w_exp_avg_sq_1)
    }
"""

from __future__ import annotations

import re
from collections import Counter, deque
from dataclasses import dataclass

from dcir.diagnostics import DcirError, Diagnostic
from dcir.ir import Decl, Function, HostType, Module, Op, PendingType, SymbolRef, Value
from dcir.memory import OPTIM_KEY, OPTIM_STATE_OF, Bytes, format_bytes, saved_storage, timeline
from dcir.passes import Pass
from dcir.passes.zero1 import copy_function


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
        self.live = 0
        self.inflight: deque[tuple[list[Op], int]] = deque()
        self.reloaded: dict[str, tuple[Op, list[Value]]] = {}

    def value(self, base: str, type_) -> Value:
        return Value(self.func.fresh_name(base), type_)

    def emit(self, op: Op) -> None:
        self.func.ops.append(op)

    def nbytes(self, param: str) -> int:
        return sum(self.module.decls[s].type.inner.nbytes for s in self.state[param])

    def retire(self) -> None:
        ops, nbytes = self.inflight.popleft()
        for op in ops:
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
        self.reloaded[param] = (Op("comm.wait", pendings, devices), devices)
        self.live += need
        return True

    def offload(self, param: str, updated: list[Value]) -> None:
        pendings, homes, sets = [], [], []
        for sym, v in zip(self.state[param], updated):
            base = sym.replace(".", "_")
            pending = self.value(base + "_off", PendingType(HostType(v.type)))
            self.emit(Op("mem.offload", [v], [pending]))
            home = self.value(base + "_home", HostType(v.type))
            pendings.append(pending)
            homes.append(home)
            sets.append(Op("param.set", [home], symbol=sym))
        retire = [Op("comm.wait", pendings, homes), *sets, Op("mem.free", list(updated))]
        self.inflight.append((retire, self.nbytes(param)))


def _last_backward(module: Module, micro_steps: int) -> Function | None:
    """The backward of the last micro-step of an optimizer step: ``@backward_last``
    (made here, as a copy of ``@backward``, when there are several micro-steps)."""
    if "backward_last" in module.functions:
        return module.functions["backward_last"]
    bw = module.functions.get("backward")
    if bw is None or micro_steps == 1:
        return bw
    last = copy_function(bw, "backward_last")
    module.functions["backward_last"] = last
    return last


def _hand_over(module: Module, step: Function, micro_steps: int, stats: Counter) -> None:
    """Start the reloads ``@step`` issues before its first update in the last backward
    instead, where they overlap compute; the backward returns the reloaded state and
    ``@step`` takes it as arguments.

    A reload starts at the earliest op after which its bytes, held to the end of the
    backward, do not raise the backward's peak (the memory model's), so the state
    arrives as early as memory allows at no cost in peak memory."""
    first = next((i for i, op in enumerate(step.ops) if op.name == "optim.step"), 0)
    reloads = [op for op in step.ops[:first] if op.name == "mem.reload"]
    if not reloads:
        return
    bw = _last_backward(module, micro_steps)
    if bw is None or bw.returns:
        return
    waits = {v: op for op in step.ops if op.name == "comm.wait" for v in op.operands}
    line = timeline(bw, saved_storage(module) if bw.name in ("backward", "backward_last") else None)
    peak, during = line.peak, list(line.during)
    fresh = bw.name_maker()
    moved: dict[int, list[Op]] = {}
    tail: list[Op] = []
    gone: set[Op] = set()
    for reload in reloads:
        get = reload.operands[0].owner
        wait = waits[reload.results[0]]
        k = wait.operands.index(reload.results[0])
        device = wait.results[k]
        nbytes = device.type.nbytes
        at = next((i for i in range(len(during)) if max(during[i:]) + nbytes <= peak), None)
        if at is None:
            continue  # it would raise the backward's peak anywhere: it stays in @step
        for j in range(at, len(during)):
            during[j] += nbytes
        host = Value(fresh(get.results[0].name), get.results[0].type)
        pending = Value(fresh(reload.results[0].name), reload.results[0].type)
        arrived = Value(fresh(device.name), device.type)
        moved.setdefault(at, []).extend([Op("param.get", [], [host], symbol=get.symbol),
                                         Op("mem.reload", [host], [pending])])
        tail.append(Op("comm.wait", [pending], [arrived]))
        bw.returns.append(arrived)
        bw.result_types.append(arrived.type)
        # @step takes the reloaded state as an argument in place of its own reload
        gone.update((get, reload))
        wait.operands.pop(k)
        wait.results.pop(k)
        for i, r in enumerate(wait.results):
            r.index = i
        if not wait.operands:
            gone.add(wait)
        step.args.append(device)
        stats["offload: reloads started in the last backward"] += 1
    ops = []
    for i, op in enumerate(bw.ops):
        ops.extend(moved.get(i, ()))
        ops.append(op)
    bw.ops = ops + tail
    step.ops = [op for op in step.ops if op not in gone]
    for i, a in enumerate(step.args):
        a.owner, a.index = step, i


@dataclass(frozen=True)
class Offload(Pass):
    name = "offload"
    #: the most optimizer-state bytes on the device at any time (per rank); none: all of it
    budget: Bytes | None = None
    #: the optimizer's per-element state tensors, ``+``-separated (the Engine asks its optimizer)
    state: str = "exp_avg+exp_avg_sq"
    #: micro-steps per optimizer step; above 1, reloads start in ``@backward_last`` only
    micro_steps: int = 1

    def __post_init__(self):
        if self.micro_steps < 1:
            raise ValueError("micro_steps must be at least 1")
        keys = self.state.split("+")
        bad = [k for k in keys if not re.fullmatch(r"[A-Za-z_]\w*", k)]
        if bad:
            raise ValueError(f"state names the optimizer's state tensors, like exp_avg+exp_avg_sq; "
                             f"{bad[0]!r} is not a name")

    def run(self, module: Module, stats: Counter) -> None:
        if "step" in module.functions:
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
        func = Function("step")
        build = _StepBuilder(module, func, state, room)
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
        while build.inflight:
            build.retire()
        module.functions["step"] = func
        _hand_over(module, func, self.micro_steps, stats)
        moved = sum(sizes[p] for p in offloaded)
        arrived = sum(a.type.nbytes for a in func.args)  # reloaded in the backward: held into @step
        peak = kept + max(timeline(func).peak, arrived)
        stats[f"offload: optimizer state {format_bytes(sum(sizes.values()))}, on the device at most "
              f"{format_bytes(peak)}, moved each step {format_bytes(moved)}"] += 1
