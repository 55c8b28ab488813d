"""The profiler: run one lowered function op by op and measure each op.

For every op of a DCIR function it measures

* ``prof.time_us``: host wall time; for a collective or a host copy (``mem.reload``,
  ``mem.offload``), the real transfer: the start is followed at once by a wait for
  completion, so the time is the transfer's own, not hidden behind compute (the later
  wait (``comm.wait``, ``mem.wait``) of the program then finds the result ready);
* ``prof.launch_us``: for a collective or a host copy, the host time of starting it;
* ``prof.mem``: the bytes live while the op runs, by following the storage of every
  tensor the function receives or creates (a weak reference per storage: a storage
  counts until it dies or ``mem.free`` empties it). Module state (parameter shards,
  buffers, optimizer state) and copies in host memory are not counted, as in the
  memory model (``dcir.memory``). On a GPU the CUDA allocator's own figure is taken
  as well (``prof.cuda_mem``).

Ranks agree: per op, the ranks' mean compute time (the largest of each op would add
up to more than any rank's step), the fastest rank's transfer time (a rank that
reaches a collective late sees only the transfer; what the others waited for it, run
by run, is ``prof.late_us``), and the largest bytes. Several runs are reduced to their
median. So every rank writes the same numbers into its IR, and every rank's estimates
decide alike (the Engine passes its process group to ``annotate``).
"""

from __future__ import annotations

import resource
import statistics
import time
import weakref

import torch
import torch.distributed as dist
import torch.fx as fx

from dcir.cost import (CHECKS, COMPILED, DEVICE, FUSED, LATE, LAUNCH, OPTIMIZER, TIME, TRANSPORT, fitted_fused_share,
                       is_transfer)
from dcir.ir import Function, Module, Op
from dcir.memory import resident_buffers
from dcir.ops import COLLECTIVE, COMPUTE, HOST_COPY, WAITS, has_trait
from dcir_lowering import copies
from dcir_lowering.calls import OP_INDEX, reads_state
from dcir_lowering.stretches import stretch_times
from dcir_lowering.state_store import OPTIMIZER_STATE, OptimizerStateStore, store_call

MEM, PEAK, RUNS = "prof.mem", "prof.peak_bytes", "prof.runs"
#: the module's: how far apart the same compute measured (``Profile.annotate``), a share of the step
NOISE = "prof.noise"


def _runtime_call(node: fx.Node) -> bool:
    """Whether a node calls one of the C++ runtime's ops (``torch.ops.dcir.*``), not the
    picking of its results."""
    name = getattr(node.target, "_qualified_op_name", "") if node.op == "call_function" else ""
    return name.startswith("dcir::")


def _starts_collective(node: fx.Node, op: Op | None) -> bool:
    """The runtime's call that starts the collective of ``op`` (the IR op the node comes from)."""
    return op is not None and has_trait(op, COLLECTIVE) and _runtime_call(node)


def _starts_host_copy(node: fx.Node, op: Op | None) -> bool:
    """The call that starts the host copy of ``op``: on the optimizer-state store, or for
    an activation on the copy lanes (``dcir_lowering.copies``)."""
    return op is not None and has_trait(op, HOST_COPY) and (
        store_call(node) is not None or node.target in (copies.offload, copies.reload))


def _waits_in_runtime(node: fx.Node, op: Op | None) -> bool:
    """The runtime's call that waits for a collective (``comm.wait``)."""
    return op is not None and has_trait(op, WAITS) and _runtime_call(node)


def _counted(node: fx.Node) -> bool:
    """Module state (shards, buffers, optimizer state) is held whatever the schedule,
    so not counted. An update (``optim.step``) returns the state it was given, updated
    in place: a reloaded copy is counted from its reload, state on the device not at all."""
    return node.op == "call_function" and not reads_state(node)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _minor_faults() -> int:
    """This process's minor page faults so far: a fresh block of host memory is faulted
    in page by page when first written (on this machine 22 ms for 64 MiB against 2 ms
    when the allocator hands back memory it kept), which is part of an op's time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _Recorder(fx.Interpreter):
    """Runs a lowered function node by node, timing and sizing every op. ``sync``: wait
    for each transfer right after its start (the profile's transfer times); without it
    the program runs as scheduled and ``spans`` record when each op began and ended
    (``dcir_runtime.trace``)."""

    def __init__(self, gm: fx.GraphModule, ops: list[Op], store: OptimizerStateStore | None, sync: bool = True,
                 held: list = ()):
        super().__init__(gm, garbage_collect_values=True)
        for node in gm.graph.nodes:  # a value nothing reads goes at once, as in the compiled code (and the memory model)
            if not node.users and node.op != "output":
                self.user_to_last_uses.setdefault(node, []).append(node)
        self.ops = ops  # the function's IR ops, by position (``OP_INDEX``): their traits say what a node does
        n_ops = len(ops)
        self.store = store  # the optimizer-state store the function's host copies run on (offload), or None
        self.sync = sync
        self.spans: list[tuple[int, float, float]] = []  # (op, begin, end), perf_counter seconds
        self.time = [0.0] * n_ops
        self.launch = [0.0] * n_ops
        self.mem = [0] * n_ops
        self.cuda_mem = [0] * n_ops
        self.faults = [0] * n_ops  # minor page faults while the op ran (the trace's args)
        self.storages: dict[int, weakref.ref] = {}
        self.ready: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # collectives already waited
        self.wait = torch.ops.dcir.wait if hasattr(torch.ops, "dcir") else None
        self._track(held)  # live throughout: counted from the start

    def run(self, *args):
        try:
            return super().run(*args)
        finally:  # a kept recording must not hold the outputs (the forward's saved activations)
            self.env.clear()

    def _track(self, out) -> None:
        for t in _tensors(out):
            if copies.is_host(t):  # an activation's host copy (the backward's arguments hold them)
                continue
            s = t.untyped_storage()
            ref = self.storages.get(s._cdata)
            if ref is None or ref() is None:
                self.storages[s._cdata] = weakref.ref(s)

    def _host(self, n: fx.Node, out) -> bool:
        """A copy in host memory, which the store or the copy lanes made (on a CPU, RAM
        like the rest): not the device's, as in the memory model."""
        if not isinstance(out, torch.Tensor):
            return False
        return copies.is_host(out) or (store_call(n) is not None and self.store.is_host(out))

    def _live(self) -> int:
        total = 0
        for key, ref in list(self.storages.items()):
            s = ref()
            if s is None:
                del self.storages[key]
            else:
                total += s.nbytes()
        return total

    def run_node(self, n: fx.Node):
        k = n.meta.get(OP_INDEX)
        op = self.ops[k] if k is not None else None
        if k is not None:  # what the op's operands hold counts while it runs (a free's included)
            self.mem[k] = max(self.mem[k], self._live())
        faults = _minor_faults() if k is not None else 0  # a syscall: only for the IR's ops
        if _waits_in_runtime(n, op) and id(self.env[n.args[0]]) in self.ready:
            out = self.env[n.args[0]]  # finished when it started (profiling)
            begin = end = time.perf_counter()
        else:
            begin = time.perf_counter()
            out = super().run_node(n)
            end = time.perf_counter()
            if self.sync and _starts_collective(n, op):
                if k is not None:
                    self.launch[k] += end - begin
                for t in _tensors(out):
                    self.wait(t)
                    self.ready[id(t)] = t
                end = time.perf_counter()
            elif self.sync and _starts_host_copy(n, op):  # the program's own wait then finds it done
                if k is not None:
                    self.launch[k] += end - begin
                copies.finish(out)
                end = time.perf_counter()
        if n.op == "placeholder" or (_counted(n) and not self._host(n, out)):
            self._track(out)
        if k is not None:
            self.faults[k] += _minor_faults() - faults
            self.spans.append((k, begin, end))
            self.time[k] += end - begin
            self.mem[k] = max(self.mem[k], self._live())
            if torch.cuda.is_available() and any(t.is_cuda for t in _tensors(out)):
                self.cuda_mem[k] = max(self.cuda_mem[k], torch.cuda.memory_allocated())
        return out


class Profile:
    """Per-op measurements of the functions of one module, over one or more runs."""

    def __init__(self, module: Module):
        self.module = module
        self.runs: dict[str, list[_Recorder]] = {}
        self.optimizer_s: list[float] = []  # the optimizer steps run outside the program (torch.optim)
        self.checks_s: list[float] = []  # the step's checks, clipping and clearing of gradients (``Execution.step``)
        self.stretches: dict[str, list[tuple[list[int], float]]] = {}  # Inductor's, timed in earlier steps

    def run(self, name: str, gm: fx.GraphModule, *args, sync: bool = True, compiled=None):
        """Run function ``name`` (lowered as ``gm``) on ``args``, measuring; returns its result.
        ``compiled``: what runs the function outside the profile, when that is Inductor's
        compiled stretches (``dcir_lowering.stretches.stretch_times``): its stretches' times
        in the steps before price its ops (``prof.compiled_us``)."""
        if compiled is not None and stretch_times(compiled):
            self.stretches[name] = stretch_times(compiled)
        state = args[0]  # a lowered function takes (state, grads, *args)
        # the schedule's own buffers (gathered copies, gradient accumulators) are live
        # throughout, as the memory model has them
        held = [state[n] for n in resident_buffers(self.module) if n in state]
        rec = _Recorder(gm, self.module.functions[name].ops, state.get(OPTIMIZER_STATE), sync, held)
        out = rec.run(*args)
        self.runs.setdefault(name, []).append(rec)
        return out

    def annotate(self, group=None, device: torch.device | str = "cpu",
                 transport: str = "process_group") -> dict[str, int]:
        """Write the (rank-agreed, median) measurements into the module's ops as
        attributes; returns the measured peak bytes per function. ``device`` is where the
        agreement's tensors go for ``group``'s backend (NCCL reduces only GPU tensors);
        ``transport``, how the collectives moved their bytes (``dcir_runtime.transport``:
        ``"shared_memory"`` or ``"process_group"``: ``dcir.cost.Machine.transfers_on_host``).
        Where compiled stretches ran, the share of their eager time their fusible ops took
        (``prof.fused_share``, ``dcir.cost.fitted_fused_share``) goes to the module."""
        peaks, own, spread = {}, 0.0, 0.0  # own: this rank's compute time (the noise's, below)
        measured = []  # every compiled stretch: ([(compute op, eager seconds)], its seconds)
        for name, recs in self.runs.items():
            func = self.module.functions[name]
            time_s = [statistics.median(r.time[k] for r in recs) for k in range(len(func.ops))]
            launch = [statistics.median(r.launch[k] for r in recs) for k in range(len(func.ops))]
            mem = [max(r.mem[k] for r in recs) for k in range(len(func.ops))]
            cuda = [max(r.cuda_mem[k] for r in recs) for k in range(len(func.ops))]
            transfer = [k for k, op in enumerate(func.ops) if is_transfer(op)]
            computes = [has_trait(op, COMPUTE) for op in func.ops]
            runs = [sum(r.time[k] for k in range(len(func.ops)) if computes[k]) for r in recs]
            own += statistics.median(runs)
            spread = max(spread, runs_spread(runs))
            compiled = _compiled_shares(time_s, computes, self.stretches.get(name, ()))
            late = _lateness(func, recs, group, device)
            time_s, launch, mem, cuda, compiled = _agree(func, time_s, launch, mem, cuda, compiled, set(transfer),
                                                         group, device)
            measured += [([(func.ops[k], time_s[k]) for k in ops if compiled[k] >= 0],
                          sum(max(compiled[k], 0.0) for k in ops)) for ops, _ in self.stretches.get(name, ())]
            for k, op in enumerate(func.ops):
                for key in [key for key in op.attrs if key.startswith("prof.")]:
                    del op.attrs[key]
                op.attrs[TIME] = round(time_s[k] * 1e6, 2)
                if compiled[k] >= 0:
                    op.attrs[COMPILED] = round(compiled[k] * 1e6, 2)
                if k in transfer:
                    op.attrs[LAUNCH] = round(launch[k] * 1e6, 2)
                if k in late:
                    op.attrs[LATE] = round(late[k] * 1e6, 2)
                op.attrs[MEM] = int(mem[k])
                if cuda[k]:
                    op.attrs["prof.cuda_mem"] = int(cuda[k])
            peaks[name] = max(mem, default=0)
            func.attrs[PEAK] = peaks[name]
            func.attrs[RUNS] = len(recs)
        self._annotate_step(group, device, own, spread)
        self.module.attrs[TRANSPORT] = transport
        share = fitted_fused_share(measured)  # the same on every rank: from the agreed figures
        if share is not None:
            self.module.attrs[FUSED] = round(share, 3)
        return peaks

    def _annotate_step(self, group, device, own: float, spread: float) -> None:
        """What the module's attributes say of the profiled step beside its functions: the
        device kind it ran on (``prof.device``), the optimizer step the runtime ran outside
        the program (``prof.optimizer_us``: median over steps, the ranks' mean) and the rest
        of its step there (``prof.checks_us``: whether the numbers are finite, clipping, the
        clearing of gradients, alike), which ``dcir.sim`` adds to a step, and the profile's
        noise (``prof.noise``): the ranks ran the same compute, and so did a function's runs
        (micro-steps); how far apart they measured it, as a share (the ranks' sums of
        compute, the largest less the smallest over the largest; a function's runs,
        ``runs_spread``; the larger of the two). A plan
        predicted faster by less than that is predicted faster by the noise alone
        (``runtime.plan``)."""
        attrs = self.module.attrs
        for key in [key for key in attrs if key.startswith("prof.")]:
            del attrs[key]
        attrs[DEVICE] = torch.device(device).type
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            t = torch.tensor([own, -own, spread], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            most, least, spread = t[0].item(), -t[1].item(), t[2].item()
            spread = max(spread, (most - least) / max(most, 1e-9))
        attrs[NOISE] = round(spread, 4)
        for key, samples in ((OPTIMIZER, self.optimizer_s), (CHECKS, self.checks_s)):  # alike on every rank
            if samples:
                attrs[key] = round(_ranks_mean(statistics.median(samples), group, device) * 1e6, 2)


def runs_spread(runs: list[float]) -> float:
    """How far a function's runs in one profiled step (its micro-steps) measured the same
    compute apart, as a share: their median distance from their median, over the median.
    The ops are priced by the median of the runs, so one run off (the first micro-step
    after the optimizer, cold: 20-45% slower than the other three in the benchmark's bf16
    Llama under 4 micro-steps) does not move the price, and does not count as noise;
    the largest less the smallest run did, and kept every plan predicted 27-36% faster
    out there. Two runs: half their difference."""
    middle = statistics.median(runs)
    return statistics.median(abs(r - middle) for r in runs) / max(middle, 1e-9)


def _ranks_mean(x: float, group, device) -> float:
    """The mean over ``group``'s ranks of each one's ``x`` (collective: every rank calls it)."""
    t = torch.tensor([x], dtype=torch.float64, device=device)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t /= dist.get_world_size(group)
    return t.item()


def _lateness(func: Function, recs: list[_Recorder], group, device) -> dict[int, float]:
    """Per collective of ``func``, what the ranks waited at it, on their mean, for the last
    to arrive (``prof.late_us``): in each run, each rank's time of it (its start and the
    wait right after) less the fastest rank's, which arrived last and waited for the bytes
    alone; the median over runs. Empty on one rank. Collective: every rank calls it, with
    the same runs of the same function."""
    ks = [k for k, op in enumerate(func.ops) if has_trait(op, COLLECTIVE)]
    if not ks or group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {}
    own = torch.tensor([[r.time[k] for k in ks] for r in recs], dtype=torch.float64, device=device)
    fastest = own.clone()
    dist.all_reduce(fastest, op=dist.ReduceOp.MIN, group=group)
    late = own - fastest
    dist.all_reduce(late, op=dist.ReduceOp.SUM, group=group)
    late = (late / dist.get_world_size(group)).tolist()
    return {k: statistics.median(run[j] for run in late) for j, k in enumerate(ks)}


def _compiled_shares(time_s: list[float], computes: list[bool], stretches) -> list[float]:
    """Per compute op, its share of the compiled stretch it ran in (``prof.compiled_us``):
    the stretch's time split over its compute ops as their op-by-op times split their
    sum; -1 for any other op (its own time stands: a ``comm.wait`` whose result a stretch
    picks apart is the runtime's, not Inductor's)."""
    out = [-1.0] * len(time_s)
    for ops, seconds in stretches:
        ops = [k for k in ops if computes[k]]
        eager = sum(time_s[k] for k in ops)
        if eager > 0:
            for k in ops:
                out[k] = time_s[k] * seconds / eager
    return out


def _agree(func: Function, time_s, launch, mem, cuda, compiled, transfer: set[int], group, device):
    """Every rank takes the same numbers: compute, the ranks' mean (a compiled share, where
    every rank has one); transfers, the fastest's; bytes, the most."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return time_s, launch, mem, cuda, compiled
    n, world = len(func.ops), dist.get_world_size(group)
    mean = torch.tensor([*(0.0 if k in transfer else t for k, t in enumerate(time_s)), *launch,
                         *(max(c, 0.0) for c in compiled)], dtype=torch.float64, device=device)
    most = torch.tensor([*map(float, mem), *map(float, cuda), *(float(c < 0) for c in compiled)],
                        dtype=torch.float64, device=device)
    fast = torch.tensor([t if k in transfer else 0.0 for k, t in enumerate(time_s)], dtype=torch.float64,
                        device=device)
    dist.all_reduce(mean, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(fast, op=dist.ReduceOp.MIN, group=group)
    mean, most, fast = (mean / world).tolist(), most.tolist(), fast.tolist()
    times = [fast[k] if k in transfer else mean[k] for k in range(n)]
    compiled = [-1.0 if most[2 * n + k] else mean[2 * n + k] for k in range(n)]
    return times, mean[n:2 * n], most[:n], most[n:2 * n], compiled


def _op_key(op) -> tuple:
    if op.results:
        return tuple(r.name for r in op.results)
    return (op.name, op.symbol, tuple(v.name for v in op.operands))


class ProfileHistory:
    """Every profile of one program so far, combined: per op, the median of each
    profile's time (``prof.time_us``, ``prof.launch_us``) and the most bytes
    (``prof.mem``, ``prof.peak_bytes``), and of the step's own figures the median
    optimizer time and checks (``prof.optimizer_us``, ``prof.checks_us``), noise
    (``prof.noise``) and share of compiled stretches (``prof.fused_share``, over the
    profiles that ran compiled stretches).

    A profile taken on a shared machine can be off by tens of percent for some ops,
    and a plan decided from it alone can flip with that noise. With three or more
    profiles (``optimize.profile_at`` with several steps), one outlier no longer moves
    the median, so it no longer moves the plan. The median is taken over the profiles
    in which the op ran (a merged collective of one plan is absent from the next), and
    it does not depend on the order the profiles came in, so the same profiles give
    the same plan."""

    _MEDIAN = (TIME, LAUNCH, COMPILED, LATE)
    _MOST = (MEM, "prof.cuda_mem")

    def __init__(self):
        self.samples: dict[tuple[str, tuple], dict[str, list[float]]] = {}
        self.func_samples: dict[str, dict[str, list[float]]] = {}
        self.step_samples: dict[str, list] = {}  # the module's: the optimizer outside the program, the device
        self.profiles = 0

    def add(self, module: Module) -> None:
        """Record the ``prof.*`` figures of every op of ``module`` (one profile)."""
        self.profiles += 1
        for name, f in module.functions.items():
            for op in f.ops:
                rec = self.samples.setdefault((name, _op_key(op)), {})
                for key in (*self._MEDIAN, *self._MOST):
                    v = op.attrs.get(key)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        rec.setdefault(key, []).append(v)
            rec = self.func_samples.setdefault(name, {})
            for key in (PEAK, RUNS):
                if isinstance(f.attrs.get(key), (int, float)):
                    rec.setdefault(key, []).append(f.attrs[key])
        for key, v in module.attrs.items():
            if key.startswith("prof."):
                self.step_samples.setdefault(key, []).append(v)

    def note(self, key: str, value: float) -> None:
        """One more sample of a step's figure measured outside a profile (``prof.fused_share``:
        what a trial's compiled stretches took, ``runtime.plan``)."""
        self.step_samples.setdefault(key, []).append(value)

    def write(self, dst: Module) -> int:
        """Write the combined figures onto the same ops of ``dst`` (an op is the same
        when it defines the same values, or does the same to the same values: a profile
        of a rescheduled program annotates the schedule it came from); returns how many
        ops got a profile."""
        written = 0
        for name, f in dst.functions.items():
            for op in f.ops:
                rec = self.samples.get((name, _op_key(op)))
                if not rec:
                    continue
                for key, values in rec.items():
                    v = statistics.median(values) if key in self._MEDIAN else max(values)
                    op.attrs[key] = round(v, 2) if isinstance(v, float) else v
                written += 1
            rec = self.func_samples.get(name, {})
            if PEAK in rec:
                f.attrs[PEAK] = max(rec[PEAK])
            if RUNS in rec:
                f.attrs[RUNS] = sum(rec[RUNS])
        for key, values in self.step_samples.items():  # a time or the noise: the median; anything else: the latest
            if key in (OPTIMIZER, CHECKS, NOISE, FUSED):
                dst.attrs[key] = round(statistics.median(values), 2 if key in (OPTIMIZER, CHECKS) else 4)
            else:
                dst.attrs[key] = values[-1]
        return written
