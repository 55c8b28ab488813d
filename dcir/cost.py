"""The cost model: how long a schedule takes, with async collectives overlapping compute.

Costs per op come from the profile when the op carries one (``prof.time_us``, see
``docs/passes.md``), else from an analytic model:

* compute: the larger of its arithmetic (matmuls and convolutions: 2 flops per
  multiply-add) over ``Machine.flops`` and the bytes it reads and writes over
  ``Machine.mem_bw``, plus a per-op dispatch cost. A custom op (``dcir.custom_ops``) is
  opaque: its arithmetic is unknown, so it is priced by its bytes and dispatch only, a
  lower bound; profile the module (``prof.time_us``) to price it as measured;
* a collective: the ring model NCCL's tuner uses (``docs/simulator.md``). Over ``n``
  ranks, an all-gather or a reduce-scatter takes ``n - 1`` steps and moves
  ``(n - 1) / n`` of the full tensor over each rank's link, an all-reduce twice both;
  each step pays the link's latency and the bytes its bandwidth (``Machine.collective_s``).
  Steps that cross nodes pay the inter-node latency, and a ring that spans nodes runs at
  the slower of the two bandwidths. When the module has profiled collectives, latency
  and bandwidth are fitted to them (least squares, ``calibrate``), so a collective the
  profile never saw (a coalesced one that ``bucket`` creates) is priced from the same
  measurements.

* a host copy (``mem.offload``, ``mem.reload``): its bytes over ``Machine.copy_bw``.

* compute in a compiled stretch (``dcir.fusion``: where the lowering cuts stretches, and
  which it compiles): its share of the stretch's measured time (``prof.compiled_us``)
  where the profile has it (``stretch_seconds``). A stretch not yet measured: the matmuls
  and convolutions take their eager time (Inductor calls the same library kernels), the
  ops it fuses take ``Machine.fused_share`` of theirs, and the stretch pays
  ``Machine.compiled_call_s`` once (a call into compiled code, its guards and its result
  handling). Both figures are a machine's (``dcir/machines/*.toml``, ``[compiler]``;
  ``docs/simulator.md``). ``fused_seconds`` prices one function's compute ops, each
  stretch compiled or not.

The simulation of a schedule is ``dcir.sim``'s: a compute lane (the ops in order), a
collective lane and a copy lane; ``sim.estimate`` is its summary. The estimate says where
its numbers came from: ``profile``, ``analytic`` or ``profile+analytic``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dcir import fusion
from dcir import mesh as meshes
from dcir import ops as registry
from dcir.fusion import FusionMode
from dcir.ir import Function, Module, Op, PendingType, ShardType, TensorType
from dcir.machine import Machine, load
from dcir.memory import device_bytes

#: The profile's attributes: host time of an op (for an async op, its transfer time)
#: and the host time spent starting an async op.
TIME, LAUNCH = "prof.time_us", "prof.launch_us"
#: An op's host time in the program as it ran lowered with Inductor: its share of its
#: compiled stretch's time (the stretch's time split over its ops as ``prof.time_us``,
#: measured op by op, splits their sum). What the simulator takes, where present.
COMPILED = "prof.compiled_us"
#: The module's: the share of their profiled eager time the fusible ops of the profile's
#: compiled stretches took, fitted (``fitted_fused_share``): what the model of a stretch not
#: yet measured compiled takes in place of the machine's ``fused_share``.
FUSED = "prof.fused_share"
#: A collective's wait for the last rank: per profiled run, each rank's time of it less the
#: fastest rank's (the fastest arrived last, and waited for the bytes alone), the ranks' mean;
#: the median over runs. What the mean rank also waits at it, beside the transfer.
LATE = "prof.late_us"
#: The profile's module attributes: the device kind the step ran on ("cpu", "cuda"), the
#: host time of the optimizer step the runtime runs outside the program (torch.optim on the
#: shards, when the module has no ``@step``) and of the rest of its step there (the checks
#: of its numbers, clipping, clearing the gradients: ``outside_s``), once per optimizer step.
DEVICE, OPTIMIZER, CHECKS = "prof.device", "prof.optimizer_us", "prof.checks_us"
#: how the profiled run moved its collectives' bytes (``dcir_runtime.transport``)
TRANSPORT, SHARED_MEMORY = "prof.transport", "shared_memory"


def ring_kind(op: Op) -> str:
    """Which collective ``op`` runs: "all_gather", "reduce_scatter", "all_reduce" or
    "all_to_all"."""
    if registry.has_trait(op, registry.EXCHANGES):
        return "all_to_all"
    if not registry.has_trait(op, registry.REDUCES):
        return "all_gather"
    return "reduce_scatter" if registry.has_trait(op, registry.SCATTERS) else "all_reduce"


def ranks(op: Op, machine: Machine) -> int:
    """Ranks a collective spans: its mesh dimension's size, else its shards' parts, else
    the machine's world size (else 2)."""
    group = op.attrs.get("group")
    if group is not None and group in dict(machine.mesh):
        return dict(machine.mesh)[group]
    if registry.has_trait(op, registry.EXCHANGES):  # one row per rank
        return op.operands[0].type.shape[0]
    for v in (*op.operands, *op.results):
        t = v.type.inner if isinstance(v.type, PendingType) else v.type
        if isinstance(t, ShardType):
            return t.parts
    return machine.world_size or 2


def payload(op: Op) -> int:
    """Bytes a collective moves, counted as the tensors gathered or reduced (an
    all-reduce of a shard: the shard's)."""
    if registry.has_trait(op, registry.GATHERS):
        return sum(r.type.inner.nbytes for r in op.results)
    return sum(v.type.nbytes for v in op.operands)


def nodes_spanned(op: Op, machine: Machine) -> int | None:
    """The nodes a collective over a mesh dimension runs across (its group's ranks,
    ``ranks_per_node`` consecutive ranks to a node); None without a group: the ranks are
    consecutive, and ``collective_s`` counts the nodes."""
    group, mesh = op.attrs.get("group"), dict(machine.mesh)
    if group is None or group not in mesh:
        return None
    return len({r // machine.ranks_per_node for r in meshes.group_of(mesh, group, 0)})


def is_transfer(op: Op) -> bool:
    """Async ops whose work runs on the communication channel."""
    return registry.has_trait(op, registry.ASYNC)


_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear"}


def op_flops(op: Op) -> float:
    if op.family != "aten":
        return 0.0  # a custom op's arithmetic is unknown: priced by the bytes it touches (module docstring)
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


def touched_bytes(op: Op) -> int:
    total = 0
    for v in (*op.operands, *op.results):
        t = v.type
        if isinstance(t, (TensorType, ShardType)):
            total += t.nbytes
    return total


def pack_s(op: Op, machine: Machine) -> float:
    """Compute-lane seconds the runtime spends copying a coalesced collective's operands
    into its one send buffer when it starts (``native/dcir_runtime.cpp``: ``at::cat`` into
    fresh memory): the bytes written over ``mem_bw``; 0 for a collective of one tensor."""
    if not registry.is_coalesced(op):
        return 0.0
    return sum(device_bytes(v) for v in op.operands) / machine.mem_bw


def unpack_s(op: Op, machine: Machine) -> float:
    """Compute-lane seconds of a coalesced gather's epilogue, which the first wait on one
    of its results runs: the gathered buffer copied out into every result (the bytes
    written over ``mem_bw``). Other collectives reduce in place or hand out views: 0."""
    if not registry.is_coalesced(op) or not registry.has_trait(op, registry.GATHERS):
        return 0.0
    return sum(r.type.inner.nbytes for r in op.results) / machine.mem_bw


def is_host_copy(op: Op) -> bool:
    """Async ops whose work runs on the copy channel (device <-> host)."""
    return registry.has_trait(op, registry.HOST_COPY)


def analytic_s(op: Op, machine: Machine) -> float:
    """Host seconds of ``op`` by the analytic model (an async op: its transfer)."""
    if is_host_copy(op):
        return machine.dispatch_s + sum(device_bytes(r) or device_bytes(v)
                                        for v, r in zip(op.operands, op.results)) / machine.copy_bw
    if is_transfer(op):
        return machine.collective_s(ring_kind(op), payload(op), ranks(op, machine), nodes_spanned(op, machine))
    if registry.has_trait(op, registry.COMPUTE):
        return machine.dispatch_s + max(op_flops(op) / machine.flops, touched_bytes(op) / machine.mem_bw)
    if registry.has_trait(op, registry.PURE) and registry.has_trait(op, registry.ALLOCATES):
        # a cast, a quantization, an accumulation: one pass over what it reads and writes
        return machine.dispatch_s + touched_bytes(op) / machine.mem_bw
    if registry.has_trait(op, registry.READS_STATE) and registry.has_trait(op, registry.WRITES_STATE) \
            and not registry.has_trait(op, registry.OPTIMIZES):
        # an update in place (param.add): the state and the operand read, the state written
        return machine.dispatch_s + 3 * touched_bytes(op) / machine.mem_bw
    return machine.dispatch_s


def calibrate(module: Module, machine: Machine | None = None) -> Machine:
    """``machine`` with its links fitted to the module's profiled collectives (unchanged
    when fewer than two sizes were profiled). Each collective's time is its ring steps'
    latency plus the bytes each rank sends over the link bandwidth; a least-squares line
    through (bytes sent, seconds) gives the bandwidth (its slope) and the latency (its
    intercept over the mean number of steps). Every link is taken as alike (one node).
    Without ``machine``, the module's default (``_profiled_on``)."""
    machine = machine or _profiled_on(module)
    if module.mesh:
        machine = replace(machine, mesh=tuple(module.mesh.items()))
    if not machine.use_profile:
        return machine
    pts, steps = [], []
    for _, op in module.ops():
        t = profiled_us(op)
        if not is_transfer(op) or is_host_copy(op) or t is None:
            continue
        n, passes = ranks(op, machine), 2 if ring_kind(op) == "all_reduce" else 1
        pts.append((payload(op) * passes * (n - 1) / n, t * 1e-6))
        steps.append(passes * (n - 1))
    if len({b for b, _ in pts}) < 2:
        return machine
    n = len(pts)
    mb = sum(b for b, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    var = sum((b - mb) ** 2 for b, _ in pts)
    beta = max(sum((b - mb) * (t - mt) for b, t in pts) / var, 1e-13)
    latency = max(mt - beta * mb, 0.0) / (sum(steps) / n)
    return replace(machine, link_latency_s=latency, link_bw=1 / beta, inter_latency_s=latency,
                   inter_bw=1 / beta, ranks_per_node=1 << 20)


def _profiled_on(module: Module) -> Machine:
    """The default machine for ``module``: on a profile taken on a CPU, one whose transfers
    share the cores with compute as this machine's do (``dcir/machines/cpu-2core.toml``'s
    ``links.overlap_share``, measured by ``benchmarks/calibrate_overlap.py``), and whose
    compiled stretches cost what its ``[compiler]`` table says, or, once the profile has
    measured compiled stretches, what they took (``prof.fused_share``); on a profile taken
    over the shared-memory transport (``prof.transport``), one whose ranks move the bytes
    themselves (``Machine.transfers_on_host``)."""
    machine = Machine(world_size=module.world_size, transfers_on_host=module.attrs.get(TRANSPORT) == SHARED_MEMORY)
    if module.attrs.get(DEVICE) == "cpu":
        cpu = load("cpu-2core")
        machine = replace(machine, overlap_share=cpu.overlap_share, compiled_call_s=cpu.compiled_call_s,
                          fused_share=cpu.fused_share)
    share = module.attrs.get(FUSED)
    return replace(machine, fused_share=share) if _number(share) else machine


def fitted_fused_share(stretches: list[tuple[list[tuple[Op, float]], float]]) -> float | None:
    """The share of their eager time the fusible ops of compiled stretches take, from
    stretches that ran compiled, each (its compute ops with their eager seconds, the
    seconds it took): what they took less their library kernels' eager time (a matmul runs
    the same kernel compiled, as the model has it), over their fusible ops' eager time;
    None without a fusible op. On the activation benchmark (docs/benchmarks.md), whose
    eager ops fault in fresh pages at every allocation (``--malloc release``) while a
    compiled stretch reuses its buffers, it came to 0.15-0.30, where
    ``calibrate_fusion.py``'s stretches, timed alone with memory kept for reuse, gave 0.61."""
    fusible = sum(e for ops, _ in stretches for op, e in ops if fusion.fusible(op))
    if fusible <= 0:
        return None
    library = sum(e for ops, _ in stretches for op, e in ops if not fusion.fusible(op))
    took = sum(seconds for _, seconds in stretches)
    return min(max((took - library) / fusible, 0.05), 2.0)


def outside_s(module: Module, machine: Machine) -> float:
    """Seconds of one optimizer step that no function of ``module`` runs, as the profile
    measured them: the optimizer the runtime runs on the shards (torch.optim) when the
    module has no ``@step``, and the runtime's checks of the step (finite numbers,
    clipping, clearing the gradients: ``prof.checks_us``); 0 on a machine that takes no
    profile."""
    if not machine.use_profile:
        return 0.0
    keys = (CHECKS,) if module.role("step") is not None else (OPTIMIZER, CHECKS)
    return sum(t * 1e-6 for t in map(module.attrs.get, keys) if _number(t))


def _number(t) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool)


def compiled_us(op: Op) -> float | None:
    """The profile's microseconds of ``op`` in a compiled stretch (``prof.compiled_us``), or None."""
    t = op.attrs.get(COMPILED)
    return t if _number(t) else None


def profiled_us(op: Op, compiled: bool = True) -> float | None:
    """The profile's microseconds of ``op`` (None: not profiled): in a program lowered
    with Inductor, its share of its compiled stretch (``prof.compiled_us``; not with
    ``compiled=False``); for an async op, its transfer alone: the profiler times a
    transfer from its start to the end of the wait right after it, so ``prof.time_us``
    holds the launch (``prof.launch_us``) as well."""
    t = op.attrs.get(COMPILED, op.attrs.get(TIME)) if compiled else op.attrs.get(TIME)
    if not _number(t):
        return None
    launch = op.attrs.get(LAUNCH) if is_transfer(op) else None
    return max(t - launch, 0.0) if isinstance(launch, (int, float)) and not isinstance(launch, bool) else t


def late_s(op: Op, machine: Machine) -> float:
    """Seconds after its own start that the last rank starts ``op`` (a collective), as the
    profile measured it (``prof.late_us``); 0 unprofiled."""
    t = op.attrs.get(LATE) if machine.use_profile else None
    return t * 1e-6 if _number(t) else 0.0


def eager_s(op: Op, machine: Machine) -> float:
    """Seconds of ``op`` run on its own, not in a compiled stretch: profiled, else modelled."""
    t = profiled_us(op, compiled=False) if machine.use_profile else None
    return t * 1e-6 if t is not None else analytic_s(op, machine)


def op_seconds(op: Op, machine: Machine) -> tuple[float, bool]:
    """(seconds, from the profile?) for one op: host time, or an async op's transfer."""
    t = profiled_us(op) if machine.use_profile else None
    if t is not None:
        return t * 1e-6, True
    return analytic_s(op, machine), False


def fused_seconds(func: Function, machine: Machine, module: Module | None = None,
                  mode: FusionMode = FusionMode.AS_LOWERED) -> dict[int, float]:
    """Per compute op of ``func``, its seconds as the function will run under ``mode``
    (``dcir.fusion.FusionMode``): a stretch runs compiled when an op of it is marked, or,
    ``CHOOSING``, when that is faster. Empty when nothing is marked or chosen
    (``AS_LOWERED``): the ops' own profiled times then hold."""
    choose = mode is FusionMode.CHOOSING
    if mode is FusionMode.AS_LOWERED and not fusion.marked(func):
        return {}
    out = {i: eager_s(op, machine) for i, op in enumerate(func.ops) if fusion.is_compute(op)}
    for stretch in fusion.candidates(func, module):
        if not choose and not any(fusion.FUSE in func.ops[i].attrs for i in stretch):
            continue
        compiled = stretch_seconds(func, stretch, machine)
        if choose and sum(compiled.values()) >= sum(out[i] for i in stretch):
            continue
        out.update(compiled)
    return out


def stretch_seconds(func: Function, stretch: list[int], machine: Machine) -> dict[int, float]:
    """Per op of ``stretch``, its seconds when the stretch runs compiled: its measured
    share of a compiled run (``prof.compiled_us``), else the model of a compiled stretch
    (module docstring); the call's fixed cost goes to the first op when no op of the
    stretch was measured (a measured share holds its part of it)."""
    out, any_measured = {}, False
    for i in stretch:
        op = func.ops[i]
        t = compiled_us(op) if machine.use_profile else None
        any_measured |= t is not None
        if t is not None:
            out[i] = t * 1e-6
        else:
            out[i] = eager_s(op, machine) * (machine.fused_share if fusion.fusible(op) else 1.0)
    if not any_measured and stretch:
        out[stretch[0]] += machine.compiled_call_s
    return out


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


def source(module: Module) -> str:
    """Where the cost model's numbers for ``module`` come from: "profile", "analytic"
    or "profile+analytic" (some ops profiled)."""
    ops = [op for _, op in module.ops()]
    return _source(sum(isinstance(op.attrs.get(TIME), (int, float)) for op in ops), len(ops))


def note_source(module: Module, stats, name: str) -> None:
    """Count, in a pass's statistics, which cost model it decided with."""
    stats[f"{name}: costs from {source(module).replace('+', ' and ')}"] += 1
