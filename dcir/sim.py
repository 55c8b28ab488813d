"""The event simulator: how one schedule runs on a machine, op by op, lane by lane.

It is the one timing model of DCIR. The passes price candidate schedules with it
(``estimate``, and ``schedule.Sweep`` for the moves), ``dcir-opt --simulate``
and ``--emit-trace`` print and draw it, and the Engine's profile report compares it
with what ran. What each op costs is ``dcir.cost``'s (the profile, else the analytic
model of a ``Machine``); how the costs combine is this module's:

* the **compute** lane runs the ops in program order, one after the other (a device
  stream, or the host thread on a CPU);
* an async op (trait ``async``) costs its launch on the compute lane and queues its
  transfer on its own lane: the **collective** lane (the process group runs its
  collectives one at a time, in issue order) or the **copy** lane for host copies
  (``mem.offload``, ``mem.reload``: a copy stream on a GPU, the store's copy thread on
  a CPU). A transfer starts once it is launched and its lane is free;
* an op that waits (trait ``waits``) blocks the compute lane until every transfer it
  joins is done: the time it stalls is *exposed* communication.

For example, ``all_gather`` (100 us) issued before a 60 us ``relu`` and joined by the
``comm.wait`` after it exposes 40 us of the transfer::

    compute     | launch | relu 60 us   | wait (40 us stalled) | mm |
    collective           | all_gather 100 us              |

``simulate`` returns a ``Run``: the slices of every lane, when every op starts on the
compute lane and when every transfer ends; ``Run.summary`` sums it up.
``simulate_module`` runs one optimizer step of a module (every function as often as
the step calls it) and adds the memory model's peak.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from dcir import ops as registry, roles
from dcir.buffers import GRAD_ACC_OF, OPTIM_STATE_OF, UNSHARD_OF
from dcir.cost import (LAUNCH, Estimate, Machine, calibrate, fused_seconds, is_host_copy, is_transfer, late_s,
                       op_seconds, outside_s, pack_s, unpack_s)
from dcir.fusion import FusionMode
from dcir.ir import Function, HostType, Module, Op
from dcir.memory import timelines

COMPUTE, COLLECTIVE, COPY = "compute", "collective", "copy"
LANES = (COMPUTE, COLLECTIVE, COPY)


def lane_of(op: Op) -> str:
    """The lane an op's work runs on (an async op's launch runs on the compute lane)."""
    if not is_transfer(op):
        return COMPUTE
    return COPY if is_host_copy(op) else COLLECTIVE


def launch_s(op: Op, machine: Machine) -> float:
    """Compute-lane seconds of starting an async op: the profile's, else one dispatch (and
    a coalesced collective's packing, ``cost.pack_s``)."""
    t = op.attrs.get(LAUNCH) if machine.use_profile else None
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return t * 1e-6
    return machine.dispatch_s + pack_s(op, machine)


def epilogue_s(op: Op, machine: Machine, from_profile: bool) -> float:
    """Compute-lane seconds the first wait on a transfer of ``op`` adds (a coalesced
    gather's copy-out, ``cost.unpack_s``); none when the profile timed the transfer, as
    the profiler waits right after the start: its time holds the epilogue."""
    return 0.0 if from_profile else unpack_s(op, machine)


@dataclass(frozen=True)
class Slice:
    """One op's work on one lane, from ``start`` to ``end`` seconds. A wait's slice
    on the compute lane includes its stall (``stalled`` seconds of it)."""

    index: int
    op: Op
    lane: str
    start: float
    end: float
    stalled: float = 0.0


@dataclass
class Run:
    """A simulated run of one function."""

    func: Function
    slices: list[Slice] = field(default_factory=list)
    start: list[float] = field(default_factory=list)   # compute-lane start of op i; [n]: the end
    done: dict[int, float] = field(default_factory=dict)  # async op position -> when its transfer ends
    seconds: list[float] = field(default_factory=list)  # cost of op i (an async op: its transfer)
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_s: float = 0.0
    profiled: int = 0

    @property
    def end(self) -> float:
        return self.start[-1] if self.start else 0.0

    def summary(self) -> Estimate:
        n = len(self.func.ops)
        source = "profile" if self.profiled == n else "analytic" if self.profiled == 0 else "profile+analytic"
        return Estimate(self.end, self.compute_s, self.comm_s, self.exposed_s, source)


class _Lanes:
    """The transfer lanes of one run, on the clock they share with the compute lane.
    Each lane runs its transfers one at a time, in issue order, each from when it is
    ready (its launch, or later: the last rank's launch, ``cost.late_s``). While the
    compute lane works beside a running transfer, both run at ``1 - share`` of their speed
    (``share``: ``Machine.overlap_share``; on a CPU, gloo's threads copy on the cores the
    compute runs on); while the compute lane stalls, or after it ends, a transfer runs at
    full speed. With ``share`` 0 every transfer takes its own time, overlapped or not."""

    def __init__(self, run: Run, share: float):
        self.run, self.share = run, share
        self.queue: dict[str, deque] = {COLLECTIVE: deque(), COPY: deque()}  # [op position, seconds, lost, ready]
        self.began = {COLLECTIVE: 0.0, COPY: 0.0}  # when each lane's first queued transfer begins

    def _running(self, lane: str, now: float) -> bool:
        return bool(self.queue[lane]) and self.began[lane] <= now

    def busy(self, now: float) -> bool:
        return self.share > 0 and any(self._running(lane, now) for lane in self.queue)

    def push(self, i: int, lane: str, seconds: float, now: float, ready: float) -> None:
        if not self.queue[lane]:
            self.began[lane] = max(now, ready)
        self.queue[lane].append([i, seconds, 0.0, ready])

    def _end(self, lane: str, now: float, rate: float) -> float:
        """When the lane's first transfer ends, if ``rate`` holds from ``now``; when it
        begins, if it has not yet (the next event on the lane either way)."""
        if not self._running(lane, now):
            return self.began[lane]
        _, seconds, lost, _ = self.queue[lane][0]
        return _ends(self.began[lane], seconds, lost, now, rate)

    def next_end(self, now: float, computing: bool) -> float:
        rate = 1.0 - self.share if computing else 1.0
        return min((self._end(lane, now, rate) for lane, q in self.queue.items() if q), default=math.inf)

    def advance(self, now: float, until: float, computing: bool) -> None:
        """Run the lanes from ``now`` to ``until`` (no transfer begins or ends before ``until``)."""
        rate = 1.0 - self.share if computing else 1.0
        for lane, q in self.queue.items():
            if not self._running(lane, now):
                continue
            if self._end(lane, now, rate) <= until:
                i, seconds, lost, _ = q.popleft()
                end = self.began[lane] + seconds + lost if rate == 1.0 else until
                self.run.done[i] = end
                self.run.slices.append(Slice(i, self.run.func.ops[i], lane, self.began[lane], end))
                self.began[lane] = max(end, q[0][3]) if q else end
            else:
                q[0][2] += (1.0 - rate) * (until - now)

    def compute(self, now: float, seconds: float) -> float:
        """Run ``seconds`` of compute from ``now`` on the compute lane; returns when it ends."""
        start, lost = now, 0.0
        while True:
            rate = 1.0 - self.share if self.busy(now) else 1.0
            end, lane_end = _ends(start, seconds, lost, now, rate), self.next_end(now, True)
            if end <= lane_end:
                self.advance(now, end, True)
                return end
            lost += (1.0 - rate) * (lane_end - now)
            self.advance(now, lane_end, True)
            now = lane_end

    def wait(self, now: float, joined: set[int]) -> float:
        """Stall the compute lane from ``now`` until the transfers ``joined`` are done."""
        while joined - self.run.done.keys():
            end = self.next_end(now, False)
            self.advance(now, end, False)
            now = end
        return max((self.run.done[i] for i in joined), default=now)


def _ends(start: float, seconds: float, lost: float, now: float, rate: float) -> float:
    """When work of ``seconds`` begun at ``start`` ends, having lost ``lost`` seconds to
    sharing until ``now``, at ``rate`` from ``now`` (at full rate: exactly its start,
    seconds and losses)."""
    end = start + seconds + lost
    return end if rate == 1.0 else now + (end - now) / rate


def simulate(func: Function, machine: Machine, stalls: bool = True, module: Module | None = None,
             fusion: FusionMode = FusionMode.AS_LOWERED) -> Run:
    """Run ``func``'s schedule on ``machine``'s lanes. ``stalls=False``: waits never
    block (the compute lane as it would run were every transfer hidden, the target the
    scheduling moves aim for). A transfer that overlaps compute slows it, and is slowed,
    by ``machine.overlap_share`` (``_Lanes``); with ``machine.transfers_on_host`` a
    collective's transfer runs on the compute lane at its first wait instead, exposed
    wherever it is started. Compute in a compiled stretch costs what
    ``dcir.cost.fused_seconds`` says under ``fusion`` (``module``, when given, tells its cuts
    exactly)."""
    run = Run(func)
    fused = fused_seconds(func, machine, module, fusion)
    lanes = _Lanes(run, machine.overlap_share)
    pending: dict = {}  # a transfer's result -> its op's position
    epilogue: dict[int, float] = {}  # a transfer's position -> what its first wait adds
    on_host: dict[int, float] = {}  # a transfer's position -> its seconds, moved at its first wait
    now = 0.0
    for i, op in enumerate(func.ops):
        seconds, from_profile = op_seconds(op, machine)
        seconds = fused.get(i, seconds)
        run.seconds.append(seconds)
        run.profiled += from_profile
        run.start.append(now)
        lane = lane_of(op)
        if lane != COMPUTE:
            launch = launch_s(op, machine)
            end = lanes.compute(now, launch)
            run.slices.append(Slice(i, op, COMPUTE, now, end))
            run.compute_s += launch if end == now + launch else end - now  # its own time, slowed by sharing
            now = end
            ready = now + late_s(op, machine)  # the last rank's launch
            if machine.transfers_on_host and lane == COLLECTIVE:  # its first wait moves the bytes
                run.done[i], on_host[i] = ready, seconds
            else:
                lanes.push(i, lane, seconds, now, ready)
            run.comm_s += seconds
            pending.update((r, i) for r in op.results)
            epilogue[i] = epilogue_s(op, machine, from_profile)
            continue
        arrived, stalled = now, 0.0
        joins = {pending[v] for v in op.operands if v in pending} if registry.has_trait(op, registry.WAITS) else set()
        if stalls and joins:
            stalled = max(lanes.wait(now, joins) - now, 0.0)
            now += stalled
            run.exposed_s += stalled
        for k in sorted(joins & on_host.keys()):  # the copy-out, on the rank's own thread
            end = lanes.compute(now, on_host.pop(k))
            run.slices.append(Slice(k, func.ops[k], COLLECTIVE, now, end))
            stalled, run.exposed_s, now = stalled + end - now, run.exposed_s + end - now, end
        seconds += sum(epilogue.pop(k, 0.0) for k in sorted(joins))  # run once, by the first wait
        end = lanes.compute(now, seconds)
        run.compute_s += seconds if end == now + seconds else end - now
        now = end
        run.slices.append(Slice(i, op, COMPUTE, arrived, now, stalled))
    run.start.append(now)
    lanes.wait(now, set(pending.values()))  # when the transfers no wait joined end
    run.slices.sort(key=lambda s: (s.index, s.lane != COMPUTE))
    return run


def runs_per_step(module: Module, micro_steps: int) -> dict[str, int]:
    """How often one optimizer step calls each function, as its role declares
    (``dcir.roles``)."""
    funcs = list(module.functions.values())
    return {f.name: roles.runs_per_step(f, funcs, micro_steps) for f in funcs}


def estimate(func: Function, machine: Machine, module: Module | None = None,
             fusion: FusionMode = FusionMode.AS_LOWERED) -> Estimate:
    """Simulate ``func`` (of ``module``, when given) (``simulate``: a compute lane, a
    collective lane and a copy lane), its stretches of compute priced as ``fusion``
    says, and sum it up."""
    return simulate(func, machine, module=module, fusion=fusion).summary()


def estimate_module(module: Module, machine: Machine | None = None, micro_steps: int = 1) -> Estimate:
    """One optimizer step (``runs_per_step``, and the optimizer the runtime runs
    outside the program: ``outside_s``); links calibrated to the module's profile when it
    has one."""
    machine = calibrate(module, machine)
    total = None
    for name, calls in runs_per_step(module, micro_steps).items():
        e = simulate(module.functions[name], machine, module=module).summary()
        for _ in range(calls):
            total = e if total is None else total + e
    total = total or Estimate(0.0, 0.0, 0.0, 0.0, "analytic")
    outside = outside_s(module, machine)
    return total + Estimate(outside, outside, 0.0, 0.0, total.source) if outside else total


@dataclass
class Prediction:
    """One optimizer step of a module on a machine, per rank (every rank runs the same
    program, so one rank's prediction is every rank's)."""

    machine: Machine
    runs: dict[str, Run]
    calls: dict[str, int]
    estimate: Estimate
    peak_bytes: int
    peak_function: str

    def report(self) -> str:
        e, m = self.estimate, self.machine
        lines = [f"machine {m.name}: {m.world_size or '?'} ranks, costs from {e.source}",
                 f"  step time          {e.seconds * 1e3:12.3f} ms",
                 f"  compute            {e.compute_s * 1e3:12.3f} ms",
                 f"  communication      {e.comm_s * 1e3:12.3f} ms (on the collective and copy lanes)",
                 f"  exposed comm       {e.exposed_s * 1e3:12.3f} ms "
                 f"({100 * e.exposed_s / e.seconds if e.seconds else 0:.1f}% of the step)",
                 f"  peak memory        {_gib(self.peak_bytes)} in @{self.peak_function}"]
        if m.memory:
            verdict = "fits" if self.peak_bytes <= m.memory else "DOES NOT FIT"
            lines.append(f"  device memory      {_gib(m.memory)}: {verdict}")
        for name, run in self.runs.items():
            s = run.summary()
            lines.append(f"  @{name:<14} x{self.calls[name]:<3} {s.seconds * 1e3:10.3f} ms, "
                         f"exposed {s.exposed_s * 1e3:.3f} ms")
        return "\n".join(lines) + "\n"


def _gib(n: int) -> str:
    return f"{n / 2**30:10.3f} GiB"


def simulate_module(module: Module, machine: Machine, micro_steps: int = 1,
                    state_bytes: bool = True) -> Prediction:
    """Predict one optimizer step of ``module`` per rank (its functions as often as the step
    runs them, and the optimizer the runtime runs outside them, ``cost.outside_s``). The peak is the memory model's
    (``dcir.memory``), plus, with ``state_bytes``, the module state every rank holds
    (parameter shards, buffers, optimizer state: ``held_bytes``)."""
    calls = runs_per_step(module, micro_steps)
    runs = {name: simulate(f, machine, module=module) for name, f in module.functions.items()}
    total = None
    for name, run in runs.items():
        for _ in range(calls[name]):
            total = run.summary() if total is None else total + run.summary()
    total = total or Estimate(0.0, 0.0, 0.0, 0.0, "analytic")
    outside = outside_s(module, machine)  # the optimizer the runtime runs beside the functions
    total = total + Estimate(outside, outside, 0.0, 0.0, total.source) if outside else total
    lines = timelines(module)
    peak_fn = max(lines, key=lambda n: lines[n].peak, default="")
    peak = lines[peak_fn].peak if peak_fn else 0
    return Prediction(machine, runs, calls, total, peak + (held_bytes(module, micro_steps) if state_bytes else 0),
                      peak_fn)


#: AdamW's fp32 tensors per parameter element (exp_avg, exp_avg_sq), when the module does not declare
#: its optimizer state; parameters held in a narrower type get an fp32 master copy as well (mixed precision)
ADAM_STATES = 2


def held_bytes(module: Module, micro_steps: int = 1) -> int:
    """Device bytes of module state, held whatever the schedule: parameter shards and
    buffers, optimizer state (declared on the device, ``optim.state_of``, else AdamW's:
    ``ADAM_STATES`` fp32 tensors per element, plus an fp32 master copy of parameters
    that are not fp32), and the gradient shards that outlive a backward
    (``kept_gradients``). A gradient shard made in the step's only backward is the
    memory model's, from the reduction that makes it to the backward's end."""

    total, declared = 0, False
    for d in module.decls.values():
        if UNSHARD_OF in d.attrs or GRAD_ACC_OF in d.attrs:  # the schedule's: in the memory model
            continue
        declared |= OPTIM_STATE_OF in d.attrs
        if not isinstance(d.type, HostType):
            total += d.type.nbytes
    kept = kept_gradients(module, micro_steps)
    for d in module.decls.values():
        if not d.trainable:
            continue
        total += d.type.nbytes if d.name in kept else 0
        if not declared:
            total += 4 * d.type.numel * (ADAM_STATES + (d.type.dtype != "f32"))
    return total


def kept_gradients(module: Module, micro_steps: int) -> set[str]:
    """The trainable parameters whose gradient shard outlives a backward: with more than
    one micro-step, each one that micro-steps accumulate into, which is every one but
    those summed in an accumulator and reduced in the last micro-step alone
    (``dcir.accumulate``: ``zero1``'s, HSDP's)."""
    if micro_steps <= 1:
        return set()
    summed = {d.attrs[GRAD_ACC_OF].name for d in module.decls.values() if GRAD_ACC_OF in d.attrs}
    return {d.name for d in module.decls.values() if d.trainable and d.name not in summed}
