"""The event simulator, hardware descriptions, traces, the memory picture and the at-scale prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

import dcir
from dcir.cli import main as opt_main
from dcir.cost import (CHECKS, DEVICE, LATE, LAUNCH, OPTIMIZER, TIME, TRANSPORT, Machine, analytic_s, calibrate,
                       outside_s)
from dcir.hardware import HardwareError, dump, fit, load, shipped
from dcir.memory import timeline
from dcir.ops import WAITS, has_trait
from dcir.passes.zero3 import Zero3
from dcir.schedule import Sweep
from dcir.passes import parse_pipeline, run_passes
from dcir.sim import (COLLECTIVE, COMPUTE, COPY, estimate, estimate_module, held_bytes, kept_gradients, simulate,
                      simulate_module)
from dcir.trace import MEASURED_ROWS, PREDICTED_ROWS
from test_schedule import GATHER_AND_COPY  # the same program: a gather beside a host copy

ROOT = Path(__file__).resolve().parents[1]


def test_lanes_run_side_by_side_and_waits_block_compute():
    run = simulate(dcir.parse(GATHER_AND_COPY).functions["forward"], Machine())
    by_lane = Counter(s.lane for s in run.slices)
    assert by_lane == {COMPUTE: 9, COLLECTIVE: 1, COPY: 1}
    copy = next(s for s in run.slices if s.lane == COPY)
    gather = next(s for s in run.slices if s.lane == COLLECTIVE)
    # launches cost 8 us (and param.get 8): the copy runs 8-88 us, the gather 24-124 us
    assert (copy.start, copy.end) == pytest.approx((8e-6, 88e-6))
    assert (gather.start, gather.end) == pytest.approx((24e-6, 124e-6))
    waits = [s for s in run.slices if has_trait(s.op, WAITS)]  # the copy's mem.wait, the gather's comm.wait
    assert [w.stalled for w in waits] == pytest.approx([4e-6, 35e-6])  # the slice holds its stall
    assert run.exposed_s == pytest.approx(39e-6) and run.summary() == estimate(run.func, Machine())
    # without stalls the compute lane never waits: the schedule the scheduling moves aim for
    hidden = simulate(run.func, Machine(), stalls=False)
    assert hidden.exposed_s == 0 and hidden.end == pytest.approx(run.end - 39e-6)


def test_an_overlapped_transfer_shares_the_cores_with_compute():
    """On a machine whose transfers run on the compute cores (gloo on a CPU), compute
    and a transfer beside it each run at ``1 - overlap_share`` of their speed; a stall or
    the end of compute gives the transfer its full speed back. On one whose transfers
    take no core (NCCL on a GPU: 0) nothing changes."""
    func = dcir.parse(GATHER_AND_COPY).functions["forward"]
    run = simulate(func, Machine(overlap_share=0.5))
    lanes = {s.lane: s for s in run.slices if s.lane != COMPUTE}
    compute = {s.index: s for s in run.slices if s.lane == COMPUTE}
    # the offload's launch (0-8 us) runs alone; param.get (8 us) and the gather's launch
    # (8 us) beside the copy take 16 us each; relu (60 us) beside both transfers takes 120
    assert (compute[1].start, compute[2].start, compute[3].start, compute[3].end) == pytest.approx(
        (8e-6, 24e-6, 40e-6, 160e-6))
    # the copy made 8 + 8 + 60 of its 80 us at half speed; the mem.wait's stall runs the
    # last 4 at full speed; the gather (100 us) made 30 beside relu and mem.wait, 35 in its wait
    assert (lanes[COPY].start, lanes[COPY].end) == pytest.approx((8e-6, 164e-6))
    assert (lanes[COLLECTIVE].start, lanes[COLLECTIVE].end) == pytest.approx((40e-6, 201e-6))
    assert [compute[4].stalled, compute[5].stalled] == pytest.approx([4e-6, 35e-6])
    # the stalls are exposed; the compute lane's own time grew by what sharing took
    assert run.end == pytest.approx(258e-6) and run.exposed_s == pytest.approx(39e-6)
    assert run.compute_s == pytest.approx(run.end - run.exposed_s) and run.comm_s == pytest.approx(180e-6)
    # no sharing (the default, and a GPU's): the timeline of the test above
    assert simulate(func, Machine()).end == pytest.approx(181e-6) and load("h100-ib400").overlap_share == 0
    # a transfer waited for at once overlaps no compute: sharing changes nothing
    alone = dcir.parse(WAITED_AT_ONCE).functions["forward"]
    assert simulate(alone, Machine(overlap_share=0.5)).end == simulate(alone, Machine()).end == pytest.approx(172e-6)


def test_over_shared_memory_a_gather_moves_its_bytes_at_its_wait():
    """Over the shared-memory transport a rank's own thread moves the bytes: the gather's
    start copies in (its launch), its first wait copies out (the rest of its time), so
    the relu between them hides none of it. A host copy still runs on its own lane."""
    func = dcir.parse(GATHER_AND_COPY).functions["forward"]
    run = simulate(func, Machine(transfers_on_host=True))
    gather = next(s for s in run.slices if s.lane == COLLECTIVE)
    wait = next(s for s in run.slices if s.op.name == "comm.wait")
    # the relu ends at 84 us, the copy's wait at 89; the gather's 100 us run from there
    assert (gather.start, gather.end) == pytest.approx((89e-6, 189e-6))
    assert (wait.start, wait.end, wait.stalled) == pytest.approx((89e-6, 190e-6, 100e-6))
    assert next(s for s in run.slices if s.lane == COPY).end == pytest.approx(88e-6)
    # 65 us later than in the background (its 35 us stall was all that showed), all exposed
    assert run.end == pytest.approx(simulate(func, Machine()).end + 65e-6) == pytest.approx(246e-6)
    assert run.exposed_s == pytest.approx(104e-6) and run.comm_s == pytest.approx(180e-6)


def test_the_profile_says_which_transport_moved_the_bytes():
    """``prof.transport`` (the Engine's profile: shared memory when an outbox is sized)
    reaches the plans made from the profile and the machine they are priced on."""
    from dcir_runtime.profiler import Profile, ProfileHistory

    m = dcir.parse(WAITED_AT_ONCE)
    Profile(m).annotate(transport="shared_memory")
    plan = dcir.parse(WAITED_AT_ONCE)
    history = ProfileHistory()
    history.add(m)
    history.write(plan)
    assert calibrate(dcir.parse(dcir.print(plan))).transfers_on_host
    Profile(m).annotate()
    assert m.attrs[TRANSPORT] == "process_group" and not calibrate(m).transfers_on_host


def test_a_collective_waits_for_the_last_rank_to_start_it():
    """A collective's transfer begins when the last rank starts it, ``prof.late_us`` after
    the mean rank's start: on the collective lane it waits that long, and the compute
    beside it runs at full speed meanwhile; over shared memory a wait far enough behind the
    start finds the last rank's bytes already in (the gather's start at 24 us, the wait at
    89 us), and only a wait that comes sooner stalls for them."""
    late = dcir.parse(GATHER_AND_COPY.replace("{prof.time_us = 100.0}", "{prof.time_us = 100.0, prof.late_us = 50.0}"))
    func, on_time = late.functions["forward"], dcir.parse(GATHER_AND_COPY).functions["forward"]
    gather = next(s for s in simulate(func, Machine()).slices if s.lane == COLLECTIVE)
    assert (gather.start, gather.end) == pytest.approx((74e-6, 174e-6))  # launched at 24 us
    assert simulate(func, Machine()).end == pytest.approx(simulate(on_time, Machine()).end + 50e-6)
    shm = Machine(transfers_on_host=True)
    assert simulate(func, shm).end == pytest.approx(simulate(on_time, shm).end)  # in by 74 us, waited at 89
    func.ops[2].attrs[LATE] = 80.0  # in at 104 us: the wait stalls 15 us more
    assert simulate(func, shm).end == pytest.approx(simulate(on_time, shm).end + 15e-6)
    run = simulate(dcir.parse(GATHER_BESIDE_RELU).functions["forward"], Machine(overlap_share=0.5))
    relu = next(s for s in run.slices if s.op.name == "aten.relu.default")
    # launched at 16 us, ready at 46: the relu's first 30 us at full speed, its last 30 at half,
    # beside the transfer's first 30; the other 70 at full speed from 106 us while the wait stalls
    assert (relu.start, relu.end) == pytest.approx((16e-6, 106e-6))
    assert next(s for s in run.slices if s.lane == COLLECTIVE).end == pytest.approx(176e-6)


GATHER_BESIDE_RELU = """
module @m attributes {world_size = 2} {
  param @w : shard<f32[64, 64], 2> {trainable}
  func @forward(%x: f32[64, 64] {input}) -> (f32[] {output}) role forward {
    %w_shard = param.get @w : shard<f32[64, 64], 2>
    %p = comm.all_gather(%w_shard) {prof.time_us = 100.0, prof.late_us = 30.0} : pending<f32[64, 64]>
    %a = aten.relu.default(%x) {prof.time_us = 60.0} : f32[64, 64]
    %w = comm.wait(%p) {prof.time_us = 1.0} : f32[64, 64]
    %y = aten.mm.default(%a, %w) {prof.time_us = 50.0} : f32[64, 64]
    %loss = aten.sum.default(%y) {prof.time_us = 5.0} : f32[]
    return %loss
  }
}
"""


def test_the_profile_takes_the_ranks_lateness_run_by_run(tmp_path, capfd):
    """Two ranks take turns arriving late at a gather: each rank's median time of it is the
    same (100 us), so lateness is only seen run by run (100, 100, 0 us on the ranks' mean):
    ``prof.late_us`` is its median over the runs, 100 us, and ``prof.time_us`` the fastest
    rank's median. The simulator makes the mean rank wait that long at it; one rank has no
    lateness."""
    from dcir_runtime import native
    from dcir_runtime.launch import launch
    from dcir_runtime.profiler import Profile

    native.load()
    out = tmp_path / "profiled.dcir"
    code = launch([str(Path(__file__).parent / "lateness_worker.py"), str(out)], 2, timeout_s=120, grace_s=5)
    text = capfd.readouterr()
    assert code == 0, text.out + text.err
    m = dcir.parse(out.read_text())
    gather = m.functions["forward"].ops[1]
    assert (gather.attrs[LATE], gather.attrs[TIME]) == (100.0, 100.0)
    on_time = dcir.parse(out.read_text().replace("prof.late_us = 100.0", "prof.late_us = 0.0"))
    assert estimate_module(m).seconds == pytest.approx(estimate_module(on_time).seconds + 100e-6)
    alone = dcir.parse(WAITED_AT_ONCE)
    Profile(alone).annotate()
    assert not any(LATE in op.attrs for op in alone.functions["forward"].ops)


WAITED_AT_ONCE = """
module @m attributes {world_size = 2} {
  param @w : shard<f32[64, 64], 2> {trainable}
  func @forward(%x: f32[64, 64] {input}) -> (f32[] {output}) role forward {
    %w_shard = param.get @w : shard<f32[64, 64], 2>
    %p = comm.all_gather(%w_shard) {prof.time_us = 100.0} : pending<f32[64, 64]>
    %w = comm.wait(%p) {prof.time_us = 1.0} : f32[64, 64]
    %y = aten.mm.default(%x, %w) {prof.time_us = 50.0} : f32[64, 64]
    %loss = aten.sum.default(%y) {prof.time_us = 5.0} : f32[]
    return %loss
  }
}
"""


def test_a_step_adds_the_optimizer_the_runtime_runs_outside_the_program():
    """The profile's ``prof.optimizer_us`` (torch.optim on the shards, timed in the profiled
    step) is once per optimizer step; a module with its own ``@step`` runs it inside, and
    a described machine prices no profile."""
    m = dcir.parse(WAITED_AT_ONCE)
    base = estimate_module(m, Machine()).seconds
    m.attrs[OPTIMIZER] = 2500.0
    assert outside_s(m, Machine()) == pytest.approx(2.5e-3)
    assert estimate_module(m, Machine(), micro_steps=4).seconds == pytest.approx(4 * base + 2.5e-3)
    assert simulate_module(m, Machine(), 4).estimate.seconds == pytest.approx(4 * base + 2.5e-3)
    assert outside_s(m, load("cpu-2core")) == 0.0
    with_step = dcir.parse((ROOT / "examples" / "mlp_zero3.dcir").read_text())
    with_step.attrs[OPTIMIZER] = 2500.0
    assert (with_step.role("step") is None) == (outside_s(with_step, Machine()) > 0)
    # the runtime's checks of the step (finite numbers, clipping, clearing) run outside either way
    m.attrs[CHECKS] = 400.0
    assert outside_s(m, Machine()) == pytest.approx(2.9e-3)
    offloaded = dcir.parse((ROOT / "examples" / "mlp_zero3.dcir").read_text())
    run_passes(offloaded, "offload{budget=512B}")  # the optimizer runs in its @step
    offloaded.attrs.update({OPTIMIZER: 2500.0, CHECKS: 400.0})
    assert offloaded.role("step") is not None and outside_s(offloaded, Machine()) == pytest.approx(0.4e-3)


def test_the_profile_records_the_optimizer_step_and_the_device():
    from dcir_runtime.profiler import Profile, ProfileHistory

    m = dcir.parse(WAITED_AT_ONCE)
    profile = Profile(m)
    profile.optimizer_s += [0.01, 0.03, 0.02]  # what Execution.step times while profiling
    profile.checks_s += [0.002, 0.001, 0.004]
    profile.annotate()
    assert m.attrs[OPTIMIZER] == 20000.0 and m.attrs[CHECKS] == 2000.0 and m.attrs[DEVICE] == "cpu"
    plan = dcir.parse(WAITED_AT_ONCE)  # a plan made from the captured schedule gets them too
    history = ProfileHistory()
    history.add(m)
    history.write(plan)
    assert plan.attrs[OPTIMIZER] == 20000.0 and dcir.parse(dcir.print(plan)).attrs[DEVICE] == "cpu"
    assert plan.attrs[CHECKS] == 2000.0


COMPUTE_ONLY = """
module @m {
  func @forward(%x: f32[64, 64] {input}, %w: f32[64, 64] {input}) -> (f32[] {output}) role forward {
    %y = aten.mm.default(%x, %w) : f32[64, 64]
    %a = aten.relu.default(%y) : f32[64, 64]
    %b = aten.mul.Tensor(%a, %a) : f32[64, 64]
    %loss = aten.sum.default(%b) : f32[]
    return %loss
  }
}
"""


def test_a_compiled_stretch_prices_its_ops_by_their_share_of_it():
    """Lowered with Inductor, the ops of a compiled stretch are priced at their share of
    the stretch's time (``prof.compiled_us``), split as the op-by-op profile splits it;
    the simulator takes it over ``prof.time_us``, and later profiles keep it (the median)."""
    import torch

    from dcir.cost import COMPILED
    from dcir_runtime import native
    from dcir_runtime.profiler import Profile, ProfileHistory

    native.load()  # the profiler waits on transfers with the runtime's ops
    m = dcir.parse(COMPUTE_ONLY)
    program = dcir.lower(m, {})
    profile = Profile(m)
    x = torch.randn(64, 64)
    profile.run("forward", program.graphs["forward"], {}, {}, x, x)
    profile.stretches["forward"] = [([1, 2, 3], 30e-6)]  # relu, mul and sum compiled into one: 30 us
    profile.annotate()
    ops = m.functions["forward"].ops
    assert COMPILED not in ops[0].attrs  # the matmul ran as it is
    shares = [ops[k].attrs[COMPILED] for k in (1, 2, 3)]
    assert sum(shares) == pytest.approx(30.0, abs=0.02)
    eager = [ops[k].attrs[TIME] for k in (1, 2, 3)]
    assert shares[0] / shares[1] == pytest.approx(eager[0] / eager[1], rel=0.01)
    compiled_s = estimate(m.functions["forward"], Machine()).compute_s
    assert compiled_s == pytest.approx((ops[0].attrs[TIME] + 30.0) * 1e-6, rel=1e-3)
    plan = dcir.parse(COMPUTE_ONLY)
    history = ProfileHistory()
    history.add(dcir.parse(dcir.print(m)))
    history.write(plan)
    assert [op.attrs.get(COMPILED) for op in plan.functions["forward"].ops] == [None, *shares]


def test_stretches_not_yet_measured_compiled_cost_what_the_measured_ones_took():
    """Where a profile's program ran compiled stretches, the share of their eager time its
    fusible ops took (their stretches' time less the matmuls' eager time, over the fusible
    ops' eager time; ``prof.fused_share``) prices a stretch no profile has measured compiled,
    in place of the machine's ``fused_share``; a plan's trial adds its own stretches'
    (``runtime.plan._fused_share``), and the history keeps the median."""
    from types import SimpleNamespace

    from dcir.cost import COMPILED, FUSED, stretch_seconds
    from dcir_runtime.plan import _fused_share
    from dcir_runtime.profiler import Profile, ProfileHistory

    m = dcir.parse(COMPUTE_ONLY)  # mm, relu, mul, sum
    profile = Profile(m)
    eager = [50e-6, 20e-6, 20e-6, 10e-6]
    profile.runs["forward"] = [SimpleNamespace(time=eager, launch=[0.0] * 4, mem=[0] * 4, cuda_mem=[0] * 4)]
    profile.stretches["forward"] = [([0, 1, 2, 3], 65e-6)]  # the matmul's 50 us and 0.3 x the rest's 50
    profile.annotate()
    assert m.attrs[FUSED] == 0.3 and calibrate(m).fused_share == 0.3
    assert load("cpu-2core").fused_share == pytest.approx(0.61, abs=0.01)  # what it replaces
    func = m.functions["forward"]
    for op in func.ops:
        del op.attrs[COMPILED]
    machine = calibrate(m)
    assert sum(stretch_seconds(func, [1, 2, 3], machine).values()) == pytest.approx(
        0.3 * 50e-6 + machine.compiled_call_s)
    trial = {"forward": [([1, 2, 3], 40e-6)]}  # a plan's trial: 0.8 of the eager 50 us
    assert _fused_share(m, trial) == pytest.approx(0.8) and _fused_share(m, {}) == -1.0
    history = ProfileHistory()
    history.add(m)
    history.note(FUSED, 0.8)
    plan = dcir.parse(COMPUTE_ONLY)
    history.write(plan)
    assert plan.attrs[FUSED] == pytest.approx(0.55)
    unfused = dcir.parse(COMPUTE_ONLY)
    profile = Profile(unfused)
    profile.runs["forward"] = [SimpleNamespace(time=eager, launch=[0.0] * 4, mem=[0] * 4, cuda_mem=[0] * 4)]
    profile.annotate()
    assert FUSED not in unfused.attrs and calibrate(unfused).fused_share == load("cpu-2core").fused_share


BIG_OUTPUT = """
module @m {
  func @forward(%x: f32[4096, 4096] {input}) -> (f32[] {output}) role forward {
    %y = aten.mul.Tensor(%x, %x) : f32[4096, 4096]
    %loss = aten.sum.default(%y) : f32[]
    return %loss
  }
}
"""


def test_the_profile_counts_the_page_faults_of_each_op():
    """An op that writes a fresh 64 MiB tensor faults its pages in (16,384 of 4 KiB, or 32
    huge pages); the sum that only reads it, none to speak of (a trace shows the counts:
    ``test_dcir_train_writes_a_perfetto_trace_per_rank``)."""
    import torch

    from dcir_runtime import native
    from dcir_runtime.profiler import Profile

    native.load()
    m = dcir.parse(BIG_OUTPUT)
    profile = Profile(m)
    x = torch.ones(4096, 4096)
    (loss,) = profile.run("forward", dcir.lower(m, {}).graphs["forward"], {}, {}, x)
    assert loss.item() == 4096 * 4096
    faults = profile.runs["forward"][0].faults
    assert faults[0] >= 32 and faults[1] < faults[0]


UNREAD_VIEW = """
module @m {
  func @forward(%x: f32[1024, 1024] {input}) -> (f32[] {output}) role forward {
    %y = aten.mul.Tensor(%x, %x) : f32[1024, 1024]
    %unread = aten.detach.default(%y) : f32[1024, 1024]
    %loss = aten.sum.default(%y) : f32[]
    %z = aten.mul.Tensor(%x, %x) : f32[1024, 1024]
    %loss2 = aten.sum.default(%z) : f32[]
    %out = aten.add.Tensor(%loss, %loss2) : f32[]
    return %out
  }
}
"""


def test_the_profile_lets_a_value_nothing_reads_go_at_once():
    """A view nothing reads (the forward's ``detach`` of an activation the recompute pass
    stopped handing over) does not keep its tensor: the compiled code drops it at once,
    and so do the memory model and the profile (4 MiB at most, not 8)."""
    import torch

    from dcir_runtime import native
    from dcir_runtime.profiler import Profile

    native.load()
    m = dcir.parse(UNREAD_VIEW)
    profile = Profile(m)
    profile.run("forward", dcir.lower(m, {}).graphs["forward"], {}, {}, torch.ones(1024, 1024))
    measured = profile.annotate()["forward"] - 4 * 2**20  # less the input
    assert measured == timeline(m.functions["forward"]).peak - 4 * 2**20 < 5 * 2**20


def test_fit_describes_the_machine_a_profile_ran_on():
    fitted = fit(dcir.parse(GATHER_AND_COPY), "here")
    # the offload moves the 8 KiB shard in its 80 us less a dispatch
    assert fitted.name == "here" and fitted.copy_bw == pytest.approx(8192 / (80e-6 - fitted.dispatch_s))


def test_a_cpu_profile_is_priced_with_the_cpus_overlap_share():
    """The Engine's default machine follows where the profile ran: on a CPU, cpu-2core's
    measured ``overlap_share``; on a GPU (or without a device), none."""
    m = dcir.parse(WAITED_AT_ONCE)
    assert calibrate(m).overlap_share == 0.0
    m.attrs[DEVICE] = "cpu"
    assert calibrate(m).overlap_share == load("cpu-2core").overlap_share > 0
    m.attrs[DEVICE] = "cuda"
    assert calibrate(m).overlap_share == 0.0


def test_coalesced_collectives_pay_their_packing_when_unprofiled():
    """A coalesced collective the profile never timed (one ``bucket`` made) costs its
    packing at launch and, for a gather, the copy-out at its first wait: bytes written
    over ``mem_bw`` (``native/dcir_runtime.cpp`` copies both on the compute thread)."""
    m = dcir.parse(COALESCED)
    func, machine = m.functions["forward"], Machine(mem_bw=1e9)
    run = simulate(func, machine)
    launch = next(s for s in run.slices if s.op.name == "comm.all_gather_coalesced" and s.lane == COMPUTE)
    assert launch.end - launch.start == pytest.approx(machine.dispatch_s + 2 * 64 * 64 * 4 / 2 / 1e9)
    waits = [s for s in run.slices if s.op.name == "comm.wait"]
    unpack = 2 * 64 * 64 * 4 / 1e9  # both gathered tensors, by the first wait only
    assert waits[0].end - waits[0].start - waits[0].stalled == pytest.approx(machine.dispatch_s + unpack)
    assert waits[1].end - waits[1].start - waits[1].stalled == pytest.approx(machine.dispatch_s)
    for op in func.ops:  # profiled, the transfer's time holds the copy-out, the launch its packing
        if op.name == "comm.all_gather_coalesced":
            op.attrs.update({TIME: 500.0, LAUNCH: 3.0})
    timed = simulate(func, machine)
    launch = next(s for s in timed.slices if s.op.name == "comm.all_gather_coalesced" and s.lane == COMPUTE)
    assert launch.end - launch.start == pytest.approx(3e-6)
    assert [s.end - s.start - s.stalled for s in timed.slices if s.op.name == "comm.wait"] == pytest.approx(
        [machine.dispatch_s] * 2)


COALESCED = """
module @m attributes {world_size = 2} {
  param @a : shard<f32[64, 64], 2> {trainable}
  param @b : shard<f32[64, 64], 2> {trainable}
  func @forward(%x: f32[64, 64] {input}) -> (f32[] {output}) role forward {
    %a_shard = param.get @a : shard<f32[64, 64], 2>
    %b_shard = param.get @b : shard<f32[64, 64], 2>
    %pa, %pb = comm.all_gather_coalesced(%a_shard, %b_shard) : pending<f32[64, 64]>, pending<f32[64, 64]>
    %a = comm.wait(%pa) : f32[64, 64]
    %b = comm.wait(%pb) : f32[64, 64]
    %y = aten.mm.default(%a, %b) : f32[64, 64]
    %loss = aten.sum.default(%y) : f32[]
    return %loss
  }
}
"""


def test_the_sweep_reads_the_simulator_and_queues_copies_on_their_own_lane():
    func = dcir.parse(GATHER_AND_COPY).functions["forward"]
    sweep = Sweep(func, Machine(), None)
    assert sweep.start == simulate(func, Machine(), stalls=False).start
    sweep.issue(0, 0)  # the offload: the copy lane
    assert sweep.channel == 0.0 and sweep.done[0] == pytest.approx(80e-6)
    sweep.issue(2, 2)  # the gather does not queue behind the copy
    assert sweep.done[2] == pytest.approx(sweep.time_at(2) + 100e-6)


def test_ring_model_follows_nccl():
    m = Machine(link_latency_s=1e-6, link_bw=100e9, inter_latency_s=10e-6, inter_bw=10e9, ranks_per_node=8)
    gib = 2**30
    # one node of 8: 7 steps, 7/8 of the tensor over each link; all_reduce twice both
    assert m.collective_s("all_gather", gib, 8) == pytest.approx(7e-6 + gib * 7 / 8 / 100e9)
    assert m.collective_s("all_reduce", gib, 8) == pytest.approx(14e-6 + gib * 14 / 8 / 100e9)
    assert m.collective_s("reduce_scatter", gib, 8) == m.collective_s("all_gather", gib, 8)
    # 4 nodes: 3 of the 31 steps cross nodes, and the ring runs at the NIC's bandwidth
    assert m.collective_s("all_gather", gib, 32) == pytest.approx(28e-6 + 30e-6 + gib * 31 / 32 / 10e9)
    assert m.collective_s("all_gather", gib, 1) == 0.0


def test_shipped_descriptions_load_and_round_trip(tmp_path):
    assert {"cpu-2core", "h100-ib400"} <= set(shipped())
    h100 = load("h100-ib400")
    assert h100.world_size == 32 and h100.ranks_per_node == 8 and h100.memory == 80 * 2**30
    assert not h100.use_profile  # a described machine prices ops by its model
    (tmp_path / "again.toml").write_text(dump(h100))
    again = load(tmp_path / "again.toml")
    assert replace(again, name=h100.name) == replace(h100, flops=again.flops, mem_bw=again.mem_bw,
                                                     copy_bw=again.copy_bw)


def test_bad_descriptions_name_the_file_and_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[device]\nflopz = 1e12\n")
    with pytest.raises(HardwareError, match="bad.toml: unknown key 'device.flopz'; keys are: device.flops"):
        load(bad)
    bad.write_text("[links]\nintra_bw = -3\n")
    with pytest.raises(HardwareError, match="'link_bw' must be a positive number, got -3"):
        load(bad)
    bad.write_text("[links]\noverlap_share = 1.5\n")
    with pytest.raises(HardwareError, match="'overlap_share' must be at least 0 and below 1, got 1.5"):
        load(bad)
    bad.write_text("[compiler]\ncall_s = -1e-6\n")
    with pytest.raises(HardwareError, match="'compiler.call_s' must be at least 0 seconds, got -1e-06"):
        load(bad)
    bad.write_text("[compiler]\ncall_s = 0\n")
    assert load(bad).compiled_call_s == 0.0
    bad.write_text("[device\n")
    with pytest.raises(HardwareError, match="not valid TOML"):
        load(bad)


def test_dcir_opt_simulate_prints_the_prediction(capsys):
    path = str(ROOT / "examples" / "mlp_zero3.dcir")
    assert opt_main([path, "--simulate", "h100-ib400", "--micro-steps", "4"]) == 0
    out = capsys.readouterr().out
    for what in ("machine h100-ib400", "step time", "exposed comm", "peak memory", "device memory", "@forward"):
        assert what in out, out
    # the example is sharded over 2 ranks; the machine file describes 32
    assert out.startswith("note: the program is sharded over 2 ranks (its world_size), h100-ib400 describes 32: "
                          "predicted on 2 of them; compile the model for 32 ranks to predict them all"), out
    assert "machine h100-ib400: 2 ranks" in out, out
    assert opt_main([path, "--simulate", "no-such-machine"]) == 2
    assert "cannot read hardware description" in capsys.readouterr().err


def test_emit_trace_writes_the_predicted_lanes(tmp_path):
    out = tmp_path / "pred.json"
    assert opt_main([str(ROOT / "examples" / "mlp_zero3.dcir"), "--emit-trace", str(out), "-o", os.devnull]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows == {"predicted compute", "predicted communication", "predicted host copies"}
    slices = [e for e in events if e["ph"] == "X"]
    assert any(e["name"].startswith("comm.all_gather %") and e["cat"] == COLLECTIVE for e in slices)
    assert any(e["ph"] == "C" and e["name"] == "predicted live bytes" for e in events)


def test_the_trace_marks_recomputed_ops_and_draws_activations_and_the_budget(tmp_path):
    """Perfetto's view of a recomputing schedule: the rebuilt ops' slices are in category
    ``compute,recompute``, and counters beside the live bytes give the saved activations,
    the recomputed ones and the budget."""
    text = (ROOT / "tests" / "golden" / "passes" / "recompute.dcir").read_text().split("// -----")[0]
    module = dcir.parse(text)
    dcir.run_passes(module, "recompute")
    path, out = tmp_path / "m.dcir", tmp_path / "pred.json"
    path.write_text(dcir.print(module))
    assert opt_main([str(path), "--emit-trace", str(out),
                     "--budget", "8KiB", "-o", os.devnull]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    rebuilt = [e for e in events if e["ph"] == "X" and e["cat"] == f"{COMPUTE},recompute"]
    assert [e["name"] for e in rebuilt] == ["aten.relu.default %h"] and rebuilt[0]["args"]["recompute"] is True
    counters = {e["name"]: e["args"]["bytes"] for e in events if e["ph"] == "C"}  # each track's last value
    assert {"predicted live bytes: saved activations", "predicted live bytes: recomputed"} <= counters.keys()
    budget = [e["args"]["bytes"] for e in events if e["ph"] == "C" and e["name"] == "memory budget"]
    assert budget == [8192, 0]  # drawn across the step, back to 0 after it


def test_memory_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "mem.png"
    assert opt_main([str(ROOT / "examples" / "mlp_zero3.dcir"), "--memory-plot", str(out), "--budget", "2KiB",
                     "-o", os.devnull]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_split_adds_up_to_the_model():
    from dcir.memory import timelines
    from dcir.memplot import CATEGORIES, split

    m = dcir.parse((ROOT / "examples" / "mlp_zero3.dcir").read_text())
    parts, lines = split(m), timelines(m)
    for name, t in lines.items():
        assert [sum(parts[name][c][i] for c in CATEGORIES) for i in range(len(t.during))] == t.during
    assert max(parts["backward"]["gradients"]) > 0 and max(parts["forward"]["parameters"]) > 0


def test_memory_split_shows_saved_and_recomputed_activations():
    """The picture tells what the forward hands over from what the backward rebuilt."""
    from dcir.memplot import split

    text = (ROOT / "tests" / "golden" / "passes" / "recompute.dcir").read_text().split("// -----")[0]
    before = split(dcir.parse(text))
    after = split(dcir.run_passes(dcir.parse(text), "recompute"))
    assert max(before["backward"]["saved activations"]) == 2 * 64 * 16 * 4  # %x and %h
    assert max(before["backward"]["recomputed"]) == 0
    assert max(after["backward"]["saved activations"]) == 64 * 16 * 4  # %x alone
    assert max(after["backward"]["recomputed"]) == 64 * 16 * 4  # %h, rebuilt where it is used
    assert max(after["forward"]["saved activations"]) == 64 * 16 * 4


def test_memory_split_and_trace_show_offloaded_activations(tmp_path):
    """An activation handed over through host memory is drawn apart: its device copy in
    the forward until its copy out is done, and in the backward from its reload on; host
    memory is not the device's, so nothing else holds it. The trace puts its copies in
    category ``copy,offload``."""
    from dcir.memplot import split

    text = (ROOT / "tests" / "golden" / "passes" / "offload_activations.dcir").read_text().split("// -----")[0]
    module = dcir.run_passes(dcir.parse(text), "offload_activations")
    after = split(module)
    h = 64 * 16 * 4
    assert max(after["forward"]["saved activations"]) == h  # %x alone: %h leaves for host memory
    assert after["forward"]["offloaded activations"] == [h] * 6 + [0]  # made by op 0, freed by op 5
    assert max(after["backward"]["saved activations"]) == h
    assert after["backward"]["offloaded activations"] == [0, h, h, h, h]  # from its reload (op 1) on
    path, out = tmp_path / "m.dcir", tmp_path / "pred.json"
    path.write_text(dcir.print(module))
    assert opt_main([str(path), "--emit-trace", str(out), "-o", os.devnull]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    copies = [e["name"] for e in events if e["ph"] == "X" and e["cat"] == "copy,offload"]
    assert sorted(copies) == ["mem.offload %h_off", "mem.reload %h_pending"], copies
    assert "predicted live bytes: offloaded activations" in {e["name"] for e in events if e["ph"] == "C"}


def test_simulate_module_counts_micro_steps_and_held_state():
    m = dcir.parse((ROOT / "examples" / "mlp_zero3.dcir").read_text())
    one, four = simulate_module(m, Machine(), 1), simulate_module(m, Machine(), 4)
    assert four.estimate.seconds == pytest.approx(4 * one.estimate.seconds)
    assert one.peak_bytes > simulate_module(m, Machine(), 1, state_bytes=False).peak_bytes


def test_gradient_shards_are_held_state_only_where_micro_steps_accumulate_into_them():
    """One backward per optimizer step: its gradient shards are the memory model's (from
    their reduce-scatter), not held beside the step. Micro-steps accumulating into them
    (zero3) hold them all step; zero1's, summed in accumulators and reduced in the last
    micro-step alone, do not."""
    mlp = dcir.parse((ROOT / "examples" / "mlp.dcir").read_text())
    shards = {}
    for passes, micro in (("zero3{world_size=2}", 1), ("zero3{world_size=2, micro_steps=4}", 4),
                          ("zero1{world_size=2, micro_steps=4}", 4)):
        m = mlp.clone()
        dcir.run_passes(m, parse_pipeline(passes))
        shards[passes] = held_bytes(m, micro) - held_bytes(m, 1)
        assert kept_gradients(m, 1) == set()
    trainable = sum(d.type.nbytes for d in m.decls.values() if d.trainable)
    assert list(shards.values()) == [0, trainable, 0], shards
    assert trainable == 4 * (16 * 8 + 16 + 4 * 16 + 4) // 2


def test_dcir_train_writes_a_perfetto_trace_per_rank(tmp_path, capsys):
    """A real 2-rank run: one Chrome trace per rank, with measured and predicted rows
    for compute, communication and host copies, and memory counters."""
    argv = [sys.executable, "-m", "dcir_runtime.train", "--nproc", "2", "--steps", "2", "--layers", "1",
            "--hidden", "64", "--seq", "32", "--batch", "2", "--trace", str(tmp_path / "trace"), "--timeout", "150"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        events = json.loads((tmp_path / "trace" / f"rank{rank}.json").read_text())["traceEvents"]
        rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert set(rows.values()) >= {"compute", "communication", "host copies", "predicted compute",
                                      "predicted communication", "predicted host copies"}
        assert all(e["pid"] == rank for e in events)
        slices = [e for e in events if e["ph"] == "X"]
        used = {rows[e["tid"]] for e in slices}
        assert {"compute", "communication", "predicted compute", "predicted communication"} <= used
        assert any(e["name"].startswith("comm.all_gather %") for e in slices if rows[e["tid"]] == "communication")
        assert all(e["dur"] > 0 and e["ts"] >= 0 for e in slices)
        # every measured compute slice carries its op's minor page faults, a count (how many
        # a run has depends on the allocator's history; that an op writing a fresh block
        # counts its pages is test_the_profile_counts_the_page_faults_of_each_op)
        faults = [e["args"].get("page faults") for e in slices if rows[e["tid"]] == "compute"]
        assert faults and all(type(n) is int and n >= 0 for n in faults), faults
        counters = {e["name"] for e in events if e["ph"] == "C"}
        assert counters == {"live bytes", "predicted live bytes", "predicted live bytes: saved activations"}
    # the ranks' traces line up wait by wait: trace_lateness reads them
    from trace_lateness import main  # benchmarks/ (pytest's pythonpath)
    assert main([str(tmp_path / "trace")]) == 0
    out = capsys.readouterr().out
    assert "waits per rank" in out and "(predicted: n/a)" not in out and "lateness per rank: " in out, out


def test_predict_at_scale_runs_quickly(capsys):
    from predict_at_scale import main  # benchmarks/ (pytest's pythonpath)
    assert main(["--layers", "6", "--accumulate", "1,4"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["4"])}
    row = rows["1"]
    zero3, dcir_s, speedup, published = float(row[1]), float(row[3]), row[5], row[6]
    assert 0 < dcir_s <= zero3 and speedup.endswith("x") and published == "1.18x"
    assert abs(float(row[-1].rstrip("%"))) < 5  # the layer fit matches ZeRO-3's direct simulation
    # a step of 4 micro-steps runs forward and backward 4 times (the generated functions declare their roles)
    assert 3.5 * zero3 < float(rows["4"][1]) < 4.5 * zero3


def test_predict_at_scale_compares_the_ways_across_nodes(capsys):
    """Per model (Mixtral's mixture of experts too), ranks and accumulation: flat ZeRO-3, HSDP, hpZ, qwZ, hpZ+qwZ and ZeRO++
    (hpZ, qwZ and qgZ), each with its peak and the bytes a rank sends in and across nodes,
    and the fastest that fits marked. HSDP carries least across nodes, hpZ moves the
    backward's gathers into the node, qwZ halves the bf16 gathers, qgZ the reductions."""
    from predict_at_scale import main  # benchmarks/ (pytest's pythonpath)
    assert main(["--mesh", "--layers", "2", "--accumulate", "4"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in lines if r[:1] == ["Llama-3-8B"]]
    assert len(rows) == 3 * 6  # 32, 128 and 1,024 ranks, six ways each
    moe = [r for r in lines if r[:1] == ["Mixtral-8x7B"]]
    assert len(moe) == 3 * 6
    # eight experts a layer: at 2 layers, over twice the dense 8B's bytes across nodes, though
    # its embedding and head (a quarter of the 8B's vocabulary) are a quarter the size
    assert float(moe[0][8]) > 2 * float(rows[0][8])
    first = {r[3]: r for r in rows[:6]}  # 32 ranks
    across = {name: float(r[8]) for name, r in first.items()}
    assert across["HSDP"] < across["ZeRO++"] < across["hpZ+qwZ"] < across["hpZ"] < across["ZeRO-3"]
    assert across["qwZ"] < across["ZeRO-3"]
    assert float(first["ZeRO-3"][7]) == 0 and float(first["hpZ"][7]) > 0  # in the node: only hpZ's and HSDP's
    assert float(first["ZeRO++"][7]) == float(first["hpZ+qwZ"][7])  # qgZ's reductions span every rank
    assert sum(len(r) == 10 for r in rows[:6]) == 1  # one choice ("<-") among the six
    # the planner's reason under each group (dcir.topology): 3 models at 3 worlds
    why = [r for r in lines if r[:1] == ["why:"]]
    assert len(why) == 9 and all(w[-5:] == ["chosen,", "the", "fastest", "that", "fits"] for w in why), why
    chosen = [r[3] for r in rows[:6] if len(r) == 10][0]
    assert why[3][1] == f"{chosen}:", (why[3], chosen)  # Llama-3-8B at 32 ranks: the marked row's way


def _trace(waits_us: list[float], compute_us: list[float], predicted_us: list[float] = ()) -> list[dict]:
    """One rank's trace events: before each wait, one compute slice; the predicted row's waits."""
    events, t = [], 0.0
    for k, (w, c) in enumerate(zip(waits_us, compute_us)):
        events.append({"ph": "X", "tid": MEASURED_ROWS[COMPUTE], "name": "aten.mm.default %x", "ts": t, "dur": c})
        events.append({"ph": "X", "tid": MEASURED_ROWS[COMPUTE], "name": f"comm.wait %g{k}", "ts": t + c, "dur": w})
        t += c + w
    events += [{"ph": "X", "tid": PREDICTED_ROWS[COMPUTE], "name": f"comm.wait %g{k}", "ts": 1e6 + k, "dur": w}
               for k, w in enumerate(predicted_us)]
    return events


def test_trace_lateness_separates_the_transfer_from_the_late_peer(capsys):
    from trace_lateness import lateness, main  # benchmarks/ (pytest's pythonpath)
    compute = [100.0, 1000.0, 3000.0, 500.0]
    transfer = [50.0, 400.0, 200.0, 80.0]
    late = [200 + 0.1 * c for c in compute]  # rank 0 arrives first at every wait
    report = lateness({0: _trace([t + l for t, l in zip(transfer, late)], compute, [60.0, 390.0, 210.0, 70.0]),
                       1: _trace(transfer, compute)})
    assert report.count == 4
    assert report.fastest_s == pytest.approx(sum(transfer) * 1e-6)
    assert report.predicted_s == pytest.approx(730e-6)
    assert report.late_s == pytest.approx([sum(late) * 1e-6, 0.0])
    # the ranks' mean lateness is half of rank 0's: 100 us + 0.05 x the compute
    assert report.fixed_s == pytest.approx(100e-6) and report.per_compute == pytest.approx(0.05)
    with pytest.raises(ValueError, match="lateness needs the traces of at least 2 ranks, got 1"):
        lateness({0: _trace([1.0], [1.0])})
    with pytest.raises(ValueError, match="different numbers of waits"):
        lateness({0: _trace([1.0], [1.0]), 1: _trace([1.0, 2.0], [1.0, 1.0])})
    assert main([str(ROOT / "no-such-dir")]) == 2
    assert "no rank<N>.json traces" in capsys.readouterr().err


#: one linear layer's training step, as captured (unsharded)
LINEAR = """module @linear {
  param @fc.weight : f32[4, 8] {trainable}
  func @forward(%x: f32[2, 8] {input}) -> (f32[] {output}, f32[2, 8] {saved}) role forward {
    %w = param.get @fc.weight : f32[4, 8]
    %t = aten.t.default(%w) : f32[8, 4]
    %y = aten.mm.default(%x, %t) : f32[2, 4]
    %loss = aten.sum.default(%y) : f32[]
    return %loss, %x
  }
  func @backward(%x: f32[2, 8] {saved}, %tangent: f32[] {grad = 0}) role backward {
    %ones = aten.expand.default(%tangent) {size = [2, 4]} : f32[2, 4]
    %ot = aten.t.default(%ones) : f32[4, 2]
    %g = aten.mm.default(%ot, %x) : f32[4, 8]
    grad.set @fc.weight(%g)
    return
  }
}"""


def test_a_mesh_prices_each_collective_on_its_own_links():
    """Under HSDP (2 nodes × 2) a gather over the node runs on the node's links and the
    average across nodes on the NIC, at its shard's size; flat over 4 ranks, 2 to a node,
    the same gather would cross nodes."""
    hsdp, flat = dcir.parse(LINEAR), dcir.parse(LINEAR)
    dcir.run_passes(hsdp, [Zero3(world_size=4, nodes=2, shard="local")])
    dcir.run_passes(flat, [Zero3(world_size=4)])
    slow_nic = Machine(link_bw=1e11, inter_bw=1e9, link_latency_s=0.0, inter_latency_s=0.0, ranks_per_node=2,
                       use_profile=False)

    def collectives(module):
        machine = calibrate(module, slow_nic)
        return {op.name: analytic_s(op, machine) for _, op in module.ops()
                if op.family == "comm" and op.name != "comm.wait"}
    h, f = collectives(hsdp), collectives(flat)
    w = 4 * 8 * 4  # the weight's bytes: f32[4, 8]
    assert h["comm.all_gather"] == pytest.approx(w * 1 / 2 / 1e11)  # 1 ring step of 2 in the node
    assert h["comm.all_reduce"] == pytest.approx((w / 2) * 2 * 1 / 2 / 1e9)  # the shard, 2 passes, across
    assert f["comm.all_gather"] == pytest.approx(w * 3 / 4 / 1e9)  # 3 steps of 4, over the NIC


def test_a_quantized_reduction_is_priced_by_its_bytes():
    """qgZ's all-to-all sends a rank's (n - 1) / n of its int8 rows, as a reduce-scatter
    of the same bytes does; its quantize ops make one pass over what they read and write."""
    module = dcir.parse((Path(__file__).parent / "golden/passes/quantize.dcir").read_text(), "quantize.dcir")
    dcir.run_passes(module, "zero3{world_size=2},quantize{block=16,weights=false,gradients=true}")
    machine = Machine(world_size=2)
    ops = {op.name: op for op in module.functions["backward"].ops}
    exchange = [op for op in module.functions["backward"].ops if op.name == "comm.all_to_all"][0]
    assert analytic_s(exchange, machine) == machine.collective_s("reduce_scatter", 32, 2)
    for name in ("mem.quantize", "mem.dequantize_reduce"):
        touched = sum(v.type.nbytes for v in (*ops[name].operands, *ops[name].results))
        assert analytic_s(ops[name], machine) == pytest.approx(machine.dispatch_s + touched / machine.mem_bw)
