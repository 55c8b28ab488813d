"""The cost model: how long a schedule takes, with async collectives overlapping compute.

Costs per op come from the profile when the op carries one (``prof.time_us``, see
``docs/passes.md``), else from an analytic model:

* compute: the larger of its arithmetic (matmuls and convolutions: 2 flops per
  multiply-add) over ``Machine.flops`` and the bytes it reads and writes over
  ``Machine.mem_bw``, plus a per-op dispatch cost;
* a collective: the alpha-beta model, ``alpha + payload_bytes * beta``, where the
  payload is the full tensor (gathered or reduced). When the module has profiled
  collectives, alpha and beta are fitted to them (least squares), so a collective
  the profile never saw (a coalesced one that ``bucket`` creates) is priced from the
  same measurements.

* a host copy (``mem.offload``, ``mem.reload``): its bytes over ``Machine.copy_bw``.

The simulation has one compute stream (the ops in order), one communication
channel (collectives in issue order, one at a time, as a process group runs them)
and one copy channel (host copies in issue order: a copy stream on a GPU, the
store's copy thread on a CPU). An async start costs its launch on the compute stream
and queues its transfer on its channel; a wait (``comm.wait``, ``mem.wait``) stalls the compute stream until
the transfers it joins are done. The estimate says where its numbers came from:
``profile``, ``analytic`` or ``profile+analytic``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dcir import ops as registry
from dcir import roles
from dcir.ir import Function, Module, Op, ShardType, TensorType
from dcir.memory import device_bytes

#: The profile's attributes: host time of an op (for an async op, its transfer time)
#: and the host time spent starting an async op.
TIME, LAUNCH = "prof.time_us", "prof.launch_us"


@dataclass(frozen=True)
class Machine:
    """The analytic model's parameters (defaults: one CPU core, gloo over loopback)."""

    flops: float = 2.0e10          # multiply-adds count 2
    mem_bw: float = 5.0e9          # bytes/s a compute op streams
    dispatch_s: float = 8e-6       # host cost of one op
    alpha_s: float = 1.5e-4        # latency of one collective
    beta_s: float = 1.0 / 1.0e9    # seconds per payload byte
    copy_bw: float = 5.0e9         # bytes/s a host copy moves (one core's memcpy; PCIe on a GPU)

    def collective_s(self, payload: int) -> float:
        return self.alpha_s + payload * self.beta_s


def payload(op: Op) -> int:
    """Bytes a collective moves, counted as the full tensors gathered or reduced."""
    if registry.has_trait(op, registry.GATHERS):
        return sum(r.type.inner.nbytes for r in op.results)
    total = 0
    for v in op.operands:
        t = v.type
        total += t.full.nbytes if isinstance(t, ShardType) else t.nbytes
    return total


def is_transfer(op: Op) -> bool:
    """Async ops whose work runs on the communication channel."""
    return registry.has_trait(op, registry.ASYNC)


_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear"}


def _flops(op: Op) -> float:
    base = op.name.split(".")[1] if op.name.count(".") >= 1 else op.name
    if base in _MATMULS and op.results and isinstance(op.results[0].type, TensorType):
        # result elements times the contracted length (the last dim of the first matrix operand)
        mats = [v.type for v in op.operands if isinstance(v.type, TensorType) and len(v.type.shape) >= 2]
        if mats:
            k = mats[0].shape[-1]
            return 2.0 * op.results[0].type.numel * k
    if base == "convolution" and len(op.operands) >= 2:
        w = op.operands[1].type
        if isinstance(w, TensorType) and op.results and isinstance(op.results[0].type, TensorType):
            per_out = math.prod(w.shape[1:])
            return 2.0 * op.results[0].type.numel * per_out
    return 0.0


def _touched_bytes(op: Op) -> int:
    total = 0
    for v in (*op.operands, *op.results):
        t = v.type
        if isinstance(t, (TensorType, ShardType)):
            total += t.nbytes
    return total


def is_host_copy(op: Op) -> bool:
    """Async ops whose work runs on the copy channel (device <-> host)."""
    return registry.has_trait(op, registry.HOST_COPY)


def analytic_s(op: Op, machine: Machine) -> float:
    """Host seconds of ``op`` by the analytic model (an async op: its transfer)."""
    if is_host_copy(op):
        return machine.dispatch_s + sum(device_bytes(r) or device_bytes(v)
                                        for v, r in zip(op.operands, op.results)) / machine.copy_bw
    if is_transfer(op):
        return machine.collective_s(payload(op))
    if not registry.has_trait(op, registry.COMPUTE):
        return machine.dispatch_s
    return machine.dispatch_s + max(_flops(op) / machine.flops, _touched_bytes(op) / machine.mem_bw)


def calibrate(module: Module, machine: Machine | None = None) -> Machine:
    """``machine`` with alpha and beta fitted to the module's profiled collectives
    (unchanged when fewer than two sizes were profiled)."""
    machine = machine or Machine()
    pts = [(payload(op), op.attrs[TIME] * 1e-6) for _, op in module.ops()
           if is_transfer(op) and not is_host_copy(op) and isinstance(op.attrs.get(TIME), (int, float))]
    if len({b for b, _ in pts}) < 2:
        return machine
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    var = sum((b - mb) ** 2 for b, _ in pts)
    beta = sum((b - mb) * (t - mt) for b, t in pts) / var
    beta = max(beta, 1e-13)
    alpha = max(mt - beta * mb, 0.0)
    return replace(machine, alpha_s=alpha, beta_s=beta)


def op_seconds(op: Op, machine: Machine) -> tuple[float, bool]:
    """(seconds, from the profile?) for one op: host time, or an async op's transfer."""
    t = op.attrs.get(TIME)
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return t * 1e-6, True
    return analytic_s(op, machine), False


@dataclass
class Estimate:
    """A predicted run of one schedule."""

    seconds: float      # until the last op finishes on the compute stream
    compute_s: float    # host time of the ops themselves
    comm_s: float       # transfer time on the channels (collectives and host copies)
    exposed_s: float    # compute stream stalled in comm.wait
    source: str         # "profile", "analytic" or "profile+analytic"

    def __add__(self, other: "Estimate") -> "Estimate":
        sources = {self.source, other.source}
        source = sources.pop() if len(sources) == 1 else "profile+analytic"
        return Estimate(self.seconds + other.seconds, self.compute_s + other.compute_s,
                        self.comm_s + other.comm_s, self.exposed_s + other.exposed_s, source)


def _source(profiled: int, total: int) -> str:
    if profiled == total:
        return "profile"
    return "analytic" if profiled == 0 else "profile+analytic"


def estimate(func: Function, machine: Machine) -> Estimate:
    """Simulate ``func``'s schedule: one compute stream, an in-order channel for
    collectives and another for host copies."""
    now = 0.0
    channels = {False: 0.0, True: 0.0}  # is a host copy -> when its channel is free
    compute = comm = exposed = 0.0
    ready: dict = {}
    profiled = counted = 0
    for op in func.ops:
        seconds, from_profile = op_seconds(op, machine)
        counted += 1
        profiled += from_profile
        if is_transfer(op):
            launch = op.attrs.get(LAUNCH)
            launch = launch * 1e-6 if isinstance(launch, (int, float)) else machine.dispatch_s
            now += launch
            compute += launch
            lane = is_host_copy(op)
            channels[lane] = max(channels[lane], now) + seconds
            comm += seconds
            for r in op.results:
                ready[r] = channels[lane]
        elif registry.has_trait(op, registry.WAITS):
            done = max((ready.get(v, 0.0) for v in op.operands), default=0.0)
            if done > now:
                exposed += done - now
                now = done
            now += seconds
            compute += seconds
        else:
            now += seconds
            compute += seconds
    return Estimate(now, compute, comm, exposed, _source(profiled, counted))


def estimate_module(module: Module, machine: Machine | None = None, micro_steps: int = 1) -> Estimate:
    """One optimizer step: every function as many times as its role runs per optimizer
    step (``dcir.roles``: ``@forward`` and ``@backward`` once per micro-step, ``@backward``
    once less when ``@backward_last`` stands in for it on the last; ``@unshard``, ``@step``
    once); alpha-beta calibrated to the module's profile when it has one."""
    machine = calibrate(module, machine)
    total = None
    for name, f in module.functions.items():
        e = estimate(f, machine)
        for _ in range(roles.runs_per_step(name, module.functions, micro_steps)):
            total = e if total is None else total + e
    return total or Estimate(0.0, 0.0, 0.0, 0.0, "analytic")


def source(module: Module) -> str:
    """Where the cost model's numbers for ``module`` come from: "profile", "analytic"
    or "profile+analytic" (some ops profiled)."""
    ops = [op for _, op in module.ops()]
    return _source(sum(isinstance(op.attrs.get(TIME), (int, float)) for op in ops), len(ops))


def note_source(module: Module, stats, name: str) -> None:
    """Count, in a pass's statistics, which cost model it decided with."""
    stats[f"{name}: costs from {source(module).replace('+', ' and ')}"] += 1
