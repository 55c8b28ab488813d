"""Offload activations: hand saved activations to the backward through host memory.

``@forward`` hands ``@backward`` the activations its gradients need (``{saved}``
results), each held on the device from the op that made it until the backward reads
it. This pass copies chosen ones to host memory once the forward is done with them and
back before the backward needs them, through the copy lanes the optimizer-state
``offload`` uses (``dcir_lowering.copies``): the forward starts ``mem.offload`` after
the activation's last use there, finishes it (``mem.wait``) and frees the device copy
once the compute after it covers the copy, and hands over the ``host<...>`` value;
every function that takes the saved values starts ``mem.reload`` early enough for the
compute before the first use to cover the copy back, and waits for it just before that
use. The copies are marked ``act.offload`` (``dcir.activations``); the memory model
counts a host value as no device memory, and the simulator runs the copies on its copy
lane, beside compute.

A candidate is an activation the forward made (compute, not an input, a parameter or a
gathered parameter), handed over alone (a tensor saved with views of it is one storage:
recompute those) and not also an output. The largest go first; each is taken when the
memory model's peak of the step goes down with it, or stays while the hand-off shrinks,
and, without a ``budget``, only when its copies hide: the simulated step grows by no more
than the dispatch of the ops the offload adds. With ``budget`` the pass stops as soon
as the peak fits it, hidden or not. On a CPU device and host memory are the same RAM:
the copies are real, but they save nothing there, so the planner never picks this pass
on a CPU (``dcir.search.pipelines``); run it by hand to see and test the program.

Before -> after::

    func @forward(%x: f32[64, 16] {input = "args[0]"}) -> (f32[] {output}, f32[64, 16] {saved}) {
      %h = aten.relu.default(%x) : f32[64, 16]
      %loss = aten.sum.default(%h) : f32[]
      return %loss, %h
    }
    func @backward(%h: f32[64, 16] {saved}, %g: f32[] {grad = 0}) {
      %gh = aten.threshold_backward.default(%e, %h) {threshold = 0}
  ->
    func @forward(...) -> (f32[] {output}, host<f32[64, 16]> {saved}) {
      %h = aten.relu.default(%x) : f32[64, 16]
      %loss = aten.sum.default(%h) : f32[]
      %h_off = mem.offload(%h) {act.offload} : pending<host<f32[64, 16]>>
      %h_host = mem.wait(%h_off) : host<f32[64, 16]>
      mem.free(%h)
      return %loss, %h_host
    }
    func @backward(%h_host: host<f32[64, 16]> {saved}, %g: f32[] {grad = 0}) {
      %h_pending = mem.reload(%h_host) {act.offload} : pending<f32[64, 16]>
      %h = mem.wait(%h_pending) : f32[64, 16]
      %gh = aten.threshold_backward.default(%e, %h) {threshold = 0}
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dcir import fusion, roles, signature
from dcir.activations import OFFLOAD
from dcir.context import PlanContext
from dcir.cost import analytic_s, is_host_copy, is_transfer, op_seconds
from dcir.ir import UNIT, Function, HostType, Module, Op, PendingType, Value
from dcir.machine import Machine
from dcir.memory import Bytes, device_bytes, storage_bases
from dcir.passes import Pass
from dcir.passes.recompute import footprint, storages
from dcir.rewrite import Rewriter
from dcir.sim import estimate_module


def _why_not(fw: Function, rets: list[Value], bases: dict[Value, Value], outputs: set[Value]) -> str | None:
    """Why the saved storage ``rets`` stays on the device (None: it can go to host memory)."""
    if len(rets) > 1:
        return "handed over with views of it"
    base = bases.get(rets[0], rets[0])
    if isinstance(rets[0].type, HostType):
        return "in host memory already"
    if not isinstance(base.owner, Op) or not fusion.is_compute(base.owner):
        return "not made by compute"
    group = [v for v in fw.values() if bases.get(v, v) is base]
    if outputs.intersection(group):
        return "the forward returns it"
    if any(u.name == "mem.free" for v in group for u, _ in v.uses if isinstance(u, Op)):
        return "freed in the forward"
    return None


def _candidates(fw: Function, stats: Counter) -> list[Value]:
    """The saved activations that can go to host memory, the largest first."""
    bases = storage_bases(fw)
    saved = set(signature.result_indices(fw, signature.SAVED))
    outputs = {v for k, v in enumerate(fw.returns) if k not in saved}
    out = []
    for rets in storages(fw):
        why = _why_not(fw, rets, bases, outputs)
        if why is not None:
            stats[f"kept: {why}"] += 1
        else:
            out.append(rets[0])
    return sorted(out, key=lambda v: -device_bytes(v))


def _covered(ops: list[Op], seconds: float, machine: Machine) -> int:
    """How many of ``ops``, from the first, run for ``seconds`` of compute (all of them
    when they run for less): what a copy of that length hides under."""
    spent = 0.0
    for k, op in enumerate(ops):
        if spent >= seconds:
            return k
        if not (is_host_copy(op) or is_transfer(op)):
            spent += op_seconds(op, machine)[0]
    return len(ops)


def _out(fw: Function, ret: Value, machine: Machine, rewriter: Rewriter) -> Value:
    """In ``fw``: copy ``ret`` to host memory after its storage's last use, finish the
    copy and free the device copy once compute has covered it; returns the host value."""
    bases = storage_bases(fw)
    base = bases.get(ret, ret)
    uses = [u for v in fw.values() if bases.get(v, v) is base for u, _ in v.uses if isinstance(u, Op)]
    last = max(uses, key=fw.ops.index, default=base.owner)
    fresh = fw.name_maker()
    host_type = HostType(ret.type)
    off = Op("mem.offload", [ret], [Value(fresh(f"{ret.name}_off"), PendingType(host_type))], {OFFLOAD: UNIT},
             parens=True)
    rewriter.insert_after(last, [off])
    after = fw.ops[fw.ops.index(off) + 1:]
    k = _covered(after, analytic_s(off, machine), machine)
    host = Value(fresh(f"{ret.name}_host"), host_type)
    rewriter.insert_before(after[k] if k < len(after) else None,
                           [Op("mem.wait", [off.results[0]], [host], parens=True), Op("mem.free", [ret], [], parens=True)])
    return host


def _back(bw: Function, arg: Value, machine: Machine, rewriter: Rewriter) -> None:
    """In ``bw``: take ``arg`` from host memory, reloaded early enough for the compute
    before its first use to cover the copy, and waited for just before that use."""
    host_type = HostType(arg.type)
    fresh = bw.name_maker()
    host = Value(fresh(f"{arg.name}_host"), host_type)
    at = bw.args.index(arg)
    rewriter.insert_arg(host, at, bw.arg_attrs[at])
    users = [u for u, _ in arg.uses if isinstance(u, Op)]
    if users:
        first = min(users, key=bw.ops.index)
        reload = Op("mem.reload", [host], [Value(fresh(f"{arg.name}_pending"), PendingType(arg.type))],
                    {OFFLOAD: UNIT}, parens=True)
        before = bw.ops[:bw.ops.index(first)]
        k = _covered(before[::-1], analytic_s(reload, machine), machine)
        rewriter.insert_before(before[len(before) - k] if k < len(before) else bw.ops[0], [reload])
        value = Value(arg.name, arg.type)  # the argument's name: it goes below
        rewriter.insert_before(first, [Op("mem.wait", [reload.results[0]], [value], parens=True)])
        rewriter.replace_all_uses(arg, value)
    rewriter.remove_arg(arg)


def _offload(fw: Function, bws: list[Function], ret: Value, machine: Machine, rewriters: dict[str, Rewriter]) -> None:
    """Hand ``ret`` from ``fw`` to each of ``bws`` through host memory."""
    args = [(bw, dict(signature.saved_pairs(fw, bw))[ret]) for bw in bws]
    host = _out(fw, ret, machine, rewriters[fw.name])
    rewriters[fw.name].set_returns([host if v is ret else v for v in fw.returns],
                                   [HostType(t) if v is ret else t for v, t in zip(fw.returns, fw.result_types)],
                                   fw.result_attrs)
    for bw, arg in args:
        _back(bw, arg, machine, rewriters[bw.name])


@dataclass(frozen=True)
class OffloadActivations(Pass):
    name = "offload_activations"
    budget: Bytes | None = None  # the step's peak to fit, per rank, as the memory model counts it

    def run(self, module: Module, stats: Counter, ctx: PlanContext) -> None:
        pair = roles.hand_off(module.functions.values())
        if pair is None:
            return
        fw, bws = pair
        machine = ctx.machine_for(module)
        rewriters = {f.name: Rewriter(f) for f in (fw, *bws)}
        now = footprint(module)
        seconds = estimate_module(module, machine).seconds if self.budget is None else 0.0
        for ret in _candidates(fw, stats):
            if self.budget is not None and now[0] <= self.budget:
                break
            marks = {name: r.checkpoint() for name, r in rewriters.items()}
            ops = sum(len(f.ops) for f in (fw, *bws))
            _offload(fw, bws, ret, machine, rewriters)
            after = footprint(module)
            took = estimate_module(module, machine).seconds if self.budget is None and after < now else seconds
            added = sum(len(f.ops) for f in (fw, *bws)) - ops  # each costs its dispatch, hidden or not
            why = ("offloading it does not lower the peak" if after >= now else
                   "its copies would not hide under compute" if took > seconds + added * machine.dispatch_s * (1 + 1e-9)
                   else None)
            if why is not None:
                for name, r in rewriters.items():
                    r.rollback(marks[name])
                stats[f"kept: {why}"] += 1
                continue
            now, seconds = after, took
            stats["activations offloaded"] += 1
            stats["bytes copied each way"] += device_bytes(ret)
        if self.budget is not None and now[0] > self.budget:
            stats["over budget after every candidate"] += 1
