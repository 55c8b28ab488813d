"""The memory and cost models, and the schedule passes under arbitrary profiles."""

from __future__ import annotations

import dataclasses
import random
import re
from collections import Counter

import pytest
import torch

import dcir
from dcir import fusion
from dcir.context import PlanContext
from dcir.cost import Machine, source
from dcir.sim import estimate, estimate_module, kept_gradients
from dcir.diagnostics import DcirError
from dcir.hardware import load
from dcir.memory import parse_bytes, peaks, resident, timeline, timeline_of, timelines
from dcir.passes import PassManager, parse_pipeline
from dcir.passes.prefetch import Prefetch
from models import tiny_llama

TWO_GATHERS = """
module @m attributes {world_size = 2} {
  param @w : shard<f32[64, 64], 2> {trainable}
  func @forward(%x: f32[64, 64] {input}) -> (f32[] {output}) role forward {
    %w_shard = param.get @w : shard<f32[64, 64], 2>
    %p = comm.all_gather(%w_shard) {prof.time_us = 100.0} : pending<f32[64, 64]>
    %a = aten.relu.default(%x) {prof.time_us = 60.0} : f32[64, 64]
    %w = comm.wait(%p) {prof.time_us = 1.0} : f32[64, 64]
    %wt = aten.t.default(%w) {prof.time_us = 1.0} : f32[64, 64]
    %y = aten.mm.default(%a, %wt) {prof.time_us = 50.0} : f32[64, 64]
    mem.free(%w) {prof.time_us = 1.0}
    %loss = aten.sum.default(%y) {prof.time_us = 5.0} : f32[]
    return %loss
  }
}
"""


def test_memory_model_follows_storage_through_views_and_waits():
    m = dcir.parse(TWO_GATHERS)
    t = timeline(m.functions["forward"])
    kib16 = 64 * 64 * 4
    assert t.entry == kib16                                   # the argument
    assert t.during[1] == 2 * kib16                           # the gathered buffer, from its start
    assert t.during[4] == 3 * kib16                           # t() is a view: no new storage
    assert t.during[5] == 4 * kib16                           # the matmul's result
    assert t.after[6] == 2 * kib16                            # %a went after its last use, %w (and its view) at the free
    assert t.peak == 4 * kib16 and t.peak_op == 5


COMPILED_STRETCH = """
module @m attributes {world_size = 2} {
  func @forward(%x: f32[64, 64] {input}) -> (f32[] {output}) role forward {
    %a = aten.relu.default(%x) : f32[64, 64]
    %p = comm.all_reduce(%x) {op = "sum"} : pending<f32[64, 64]>
    %b = aten.neg.default(%a) {lower.fused} : f32[64, 64]
    %c = aten.exp.default(%b) : f32[64, 64]
    mem.free(%b)
    %d = aten.tanh.default(%c) : f32[64, 64]
    %loss = aten.sum.default(%d) : f32[]
    %s = comm.wait(%p) : f32[64, 64]
    mem.free(%s)
    return %loss
  }
}
"""


def test_a_compiled_stretch_holds_its_inputs_and_its_freed_values_until_it_returns():
    kib16 = 64 * 64 * 4
    marked = dcir.parse(COMPILED_STRETCH)
    eager = dcir.parse(COMPILED_STRETCH.replace(" {lower.fused}", ""))
    by_op = timeline(eager.functions["forward"])
    assert by_op.peak == 4 * kib16                    # %a goes after neg, %b at its free, %c after tanh
    # neg..sum are one call: %a (made before it) and %b (freed within it) go when it returns;
    # %c, made and last read inside, goes after tanh as before
    t = timeline(marked.functions["forward"])
    func = marked.functions["forward"]
    a, b, c = (func.ops[i].results[0] for i in (0, 2, 3))
    assert t.storage[a][2] == t.storage[b][2] == 6 and t.storage[c][2] == 5
    assert t.peak == 6 * kib16 and t.peak_op == 5
    assert timelines(marked)["forward"].peak == t.peak


EAGER_STRETCH_BESIDE_A_COMPILED_ONE = """
module @m attributes {world_size = 2} {
  func @forward(%x: f32[64, 64] {input}) -> (f32[] {output}) role forward {
    %a = aten.relu.default(%x) : f32[64, 64]
    %p = comm.all_reduce(%x) {op = "sum"} : pending<f32[64, 64]>
    %b = aten.neg.default(%a) : f32[64, 64]
    %c = aten.exp.default(%b) : f32[64, 64]
    %s = comm.wait(%p) : f32[64, 64]
    %d = aten.add.Tensor(%c, %s) {lower.fused} : f32[64, 64]
    %e = aten.tanh.default(%d) : f32[64, 64]
    %loss = aten.sum.default(%e) : f32[]
    mem.free(%s)
    return %loss
  }
}
"""


def test_beside_a_compiled_stretch_an_eager_one_runs_op_by_op():
    """A function that compiles one stretch runs the others as they are, in place
    (``dcir_lowering.stretches``): neg..exp is no call, so %a goes after neg, its last
    use, as it would with nothing compiled; add..sum is one call."""
    kib16 = 64 * 64 * 4
    marked = dcir.parse(EAGER_STRETCH_BESIDE_A_COMPILED_ONE)
    func = marked.functions["forward"]
    assert fusion.stretches(func) == [[0], [2, 3], [5, 6, 7]] and fusion.compiled(func) == [[5, 6, 7]]
    a = func.ops[0].results[0]
    t = timeline(func)
    assert t.storage[a][2] == 2 and t.during[3] == 4 * kib16  # at exp: %x, %p's buffer, %b, %c
    eager = dcir.parse(EAGER_STRETCH_BESIDE_A_COMPILED_ONE.replace(" {lower.fused}", ""))
    assert timeline(eager.functions["forward"]).during[:4] == t.during[:4]


def test_cost_model_overlaps_the_transfer_with_compute():
    m = dcir.parse(TWO_GATHERS)
    e = estimate(m.functions["forward"], Machine())
    # the 100 us transfer runs behind relu's 60 us: 40 us of it is exposed
    assert e.exposed_s == pytest.approx(40e-6)
    assert e.source == "profile+analytic"
    bare = dcir.parse(TWO_GATHERS.replace("{prof.time_us = 100.0}", "").replace("prof.time_us", "other.time_us"))
    assert source(bare) == "analytic" and estimate_module(bare).source == "analytic"


GATHER_AND_COPY = """
module @m attributes {world_size = 2} {
  param @w : shard<f32[64, 64], 2> {trainable}
  func @forward(%x: f32[64, 64] {input}, %m: shard<f32[64, 64], 2> {state}) -> (f32[] {output}) role forward {
    %off = mem.offload(%m) {prof.time_us = 80.0} : pending<host<shard<f32[64, 64], 2>>>
    %w_shard = param.get @w : shard<f32[64, 64], 2>
    %p = comm.all_gather(%w_shard) {prof.time_us = 100.0} : pending<f32[64, 64]>
    %a = aten.relu.default(%x) {prof.time_us = 60.0} : f32[64, 64]
    %home = mem.wait(%off) {prof.time_us = 1.0} : host<shard<f32[64, 64], 2>>
    %w = comm.wait(%p) {prof.time_us = 1.0} : f32[64, 64]
    %y = aten.mm.default(%a, %w) {prof.time_us = 50.0} : f32[64, 64]
    mem.free(%w, %m) {prof.time_us = 1.0}
    %loss = aten.sum.default(%y) {prof.time_us = 5.0} : f32[]
    return %loss
  }
}
"""


def test_host_copies_have_a_channel_of_their_own():
    """A copy to host memory does not queue behind the collectives (nor they behind it):
    a copy stream on a GPU, the store's thread on a CPU."""
    e = estimate(dcir.parse(GATHER_AND_COPY).functions["forward"], Machine())
    # launches cost 8 us each (and param.get 8): the copy runs from 8 to 88 us and
    # the gather from 24 to 124 us, side by side; relu ends at 84 us, so 4 us of the
    # copy and then 35 us of the gather are exposed (on one channel the gather would
    # have started at 88 us and 64 us more of it would show)
    assert e.exposed_s == pytest.approx(39e-6)
    assert e.comm_s == pytest.approx(180e-6)
    # unprofiled, a copy costs its bytes over copy_bw: 8 KiB (the shard) at 8.192 GB/s, 1 us
    bare = dcir.parse(GATHER_AND_COPY.replace("{prof.time_us = 80.0} ", ""))
    e = estimate(bare.functions["forward"], Machine(copy_bw=8.192e9))
    assert e.comm_s == pytest.approx(100e-6 + Machine().dispatch_s + 1e-6)


def test_sizes_parse():
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="is not a size"):
        parse_bytes("lots")
    for nothing in ("0", "0B", "0.1B", 0, -4):  # "0" read as "not a size" once; "0B" passed as 0 bytes
        with pytest.raises(ValueError, match=r"is no memory at all: a size is at least 1 byte"):
            parse_bytes(nothing)


@pytest.fixture(scope="module")
def llama_zero3() -> str:
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    m = dcir.compile_to_ir(tiny_llama(), (), kwargs={"input_ids": ids, "labels": ids.clone()},
                           loss_fn=lambda out: out.loss)
    dcir.run_passes(m, "zero3{world_size=2}")
    return dcir.print(m)


@pytest.mark.parametrize("seed", range(12))
def test_passes_are_valid_and_within_budget_under_any_profile(llama_zero3, seed):
    """Random op costs (from 1 us to ms), random pipelines and budgets: every output
    verifies (the pass manager checks), and never goes over a budget the input was within."""
    rng = random.Random(seed)
    m = dcir.parse(llama_zero3)
    for _, op in m.ops():
        op.attrs["prof.time_us"] = round(rng.expovariate(1 / rng.choice([1, 10, 100, 1000])), 2)
    before = max(peaks(m).values())
    budget = rng.choice([None, before, int(before * 1.1), int(before * 1.5)])
    chosen = rng.sample(["prefetch", "unshard", "bucket"], rng.randint(1, 3))
    spec = ",".join(p + (f"{{budget={budget}}}" if budget else "") for p in chosen)
    PassManager(parse_pipeline(spec)).run(m)
    if budget is not None:
        assert max(peaks(m).values()) <= budget, spec


def test_one_functions_timeline_is_the_modules_entry_for_it(llama_zero3):
    """``timeline_of`` (what bucket and the sweeps ask for each candidate) models one
    function exactly as ``timelines`` does: the backward's saved values shared as the
    forward made them, the gathered copies ``unshard`` keeps counted throughout."""
    m = dcir.parse(llama_zero3)
    dcir.run_passes(m, "unshard{micro_steps=2}")
    assert resident(m) > 0
    every = timelines(m)
    for name in m.functions:
        one = timeline_of(m, name)
        assert (one.entry, one.during, one.after, one.storage) == (every[name].entry, every[name].during,
                                                                     every[name].after, every[name].storage), name


def test_the_schedule_budget_leaves_room_for_the_step(tmp_path):
    from dcir_runtime import initialize

    engine = initialize(torch.nn.Linear(8, 8), config={"memory_budget": "1GiB"})
    assert engine._pass_budget() > 0
    engine.config = dataclasses.replace(engine.config, memory_budget=100)
    with pytest.raises(DcirError, match=re.escape(
            ": parameter shards, optimizer state and buffers (with gradient shards where they outlive a backward, and the outputs the caller keeps) take ")):  # noqa: E501
        engine._pass_budget()


def _wide_mlp() -> torch.nn.Module:
    """An MLP whose activations on a long batch outweigh its parameters 20 times over."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))


def _steps(engine, n: int) -> None:
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(0))
    for _ in range(n):
        engine.backward(engine(x).square().mean())  # the loss outside the engine
        engine.step()


def test_gradient_shards_are_fixed_only_where_they_outlive_a_backward():
    """With one backward per optimizer step the gradient shards exist from the reduction
    that makes each to the optimizer step: the memory model counts them (the backward
    ends holding every one), so what the rank holds whatever the schedule leaves them
    out. With accumulation they sit beside the next micro-step's forward: fixed; except
    under ZeRO-1, which sums full gradients in its accumulators (counted as those) and
    reduces them to shards in the last micro-step's backward alone."""
    from dcir_runtime import initialize
    from dcir_runtime.accounting import fixed_bytes

    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    one = initialize(_wide_mlp(), optimizer=adamw)
    _steps(one, 1)
    m = one.memory()
    trainable = sum(p.numel() * p.element_size() for p in one.shards.values() if p.requires_grad)
    assert m.gradients_kept == 0 and fixed_bytes(m) == m.parameters + m.optimizer_state_peak + m.buffers
    assert timeline(one.ir().functions["backward"]).after[-1] >= trainable
    accumulating = initialize(_wide_mlp(), optimizer=adamw, config={"gradient_accumulation_steps": 2})
    _steps(accumulating, 2)
    m = accumulating.memory()
    assert m.gradients_kept == trainable
    assert fixed_bytes(m) == m.parameters + trainable + m.optimizer_state_peak + m.buffers
    zero1 = initialize(_wide_mlp(), optimizer=adamw, config={"gradient_accumulation_steps": 2, "zero_stage": 1})
    _steps(zero1, 2)
    m = zero1.memory()
    assert m.gradients_kept == 0 and m.gradient_accumulators > 0
    assert timeline(zero1.ir().functions["backward_last"]).after[-1] >= trainable
    for engine in (one, accumulating, zero1):  # as the simulator prices the held state (HSDP's accumulators too)
        kept = kept_gradients(engine.ir(), engine.config.gradient_accumulation_steps)
        assert engine.memory().gradients_kept == sum(engine.shards[n].numel() * 4 for n in kept)


def test_the_memory_budget_counts_the_activations_a_step_holds():
    """A 640 MB budget once let a step peak at 1,081 MB: only the runtime's own buffers
    were counted. Now the step's saved activations and temporaries count too (the memory
    model's peak, which the profiler measures as it runs)."""
    from dcir_runtime import initialize
    from dcir_runtime.accounting import fixed_bytes

    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    free = initialize(_wide_mlp(), optimizer=adamw)
    _steps(free, 1)
    m = free.memory()
    fixed, own = fixed_bytes(m), m.replicas + m.gradient_accumulators + m.gathered_peak
    assert m.step_peak > 10 * own  # the activations: what the old count left out
    over = initialize(_wide_mlp(), optimizer=adamw, config={"memory_budget": fixed + own + 2**16})
    with pytest.raises(DcirError, match=r"in the step \(saved activations, temporaries, gathered parameters"):
        _steps(over, 1)
    budget = fixed + int(m.step_peak * 1.25)
    within = initialize(_wide_mlp(), optimizer=adamw,
                        config={"memory_budget": budget, "optimize": {"passes": ["prefetch"], "profile_at": [1]}})
    _steps(within, 3)
    measured = within.optimize_log[0]["measured_peak"]  # the profiler follows the step's real storages
    assert fixed + max(measured.values()) <= budget, (measured, budget - fixed)


def test_the_backward_lets_each_saved_activation_go_after_its_last_use():
    """The backward is handed ``@forward``'s saved activations in a box it empties (a
    boxed call, as AOTAutograd's), so each goes after its last use: the profiled
    backward peaks where the memory model says, well below holding every saved
    activation to the end (the batch stays: the caller holds it)."""
    from dcir.memory import saved_storage, timeline, timelines
    from dcir_runtime import initialize

    engine = initialize(_wide_mlp(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                        config={"optimize": {"passes": ["prefetch"], "profile_at": [1]}})
    _steps(engine, 2)
    measured = engine.optimize_log[0]["measured_peak"]["backward"]
    module = engine.ir()
    modelled = timelines(module)["backward"].peak
    bw = module.role("backward")
    held_to_the_end = timeline(bw, saved_storage(module), kept=set(bw.args)).peak
    assert abs(measured - modelled) <= 0.1 * modelled, (measured, modelled)
    assert measured < held_to_the_end - 2**20, (measured, held_to_the_end)  # the 2 MiB GELU output went early


SHARED_SAVED = """
module @shared {
  func @forward(%x: f32[64, 64] {input = "args[0]"}) -> (f32[] {output}, f32[64, 64] {saved}, f32[64, 64] {saved}) role forward {
    %p = aten._log_softmax.default(%x) {dim = 1, half_to_float = false} : f32[64, 64]
    %d = aten.detach.default(%p) : f32[64, 64]
    %loss = aten.sum.default(%p) : f32[]
    return %loss, %p, %d
  }
  func @backward(%p: f32[64, 64] {saved}, %d: f32[64, 64] {saved}, %g: f32[] {grad = 0}) role backward {
    %e = aten.expand.default(%g) {size = [64, 64]} : f32[64, 64]
    %a = aten.mul.Tensor(%e, %p) : f32[64, 64]
    %dd = aten.detach.default(%d) : f32[64, 64]
    %b = aten.mul.Tensor(%a, %dd) : f32[64, 64]
    return
  }
}
"""


def test_two_saved_values_of_one_tensor_live_until_the_last_use_of_either():
    """``%p`` and ``%d`` are one forward tensor (a log_softmax and its detach): one
    storage in the backward, live until the last op that reads it through either, here
    a view of ``%d`` (it once ended at ``%p``'s last use, 16 MiB under the profiler on
    the activations benchmark)."""
    from dcir.memory import timelines

    module = dcir.parse(SHARED_SAVED)
    storage = timelines(module)["backward"].storage
    (size, _, end), = [s for v, s in storage.items() if v.name in ("p", "d")]
    assert (size, end) == (64 * 64 * 4, 3)


def _profile(text: str, seed: int | None) -> dcir.Module:
    """``text`` with a profile: each op's analytic time, or with ``seed`` that time
    scaled by a random factor between 1/3 and 3 (a profile taken on a busy machine)."""
    from dcir.cost import TIME, Machine, analytic_s

    rng = random.Random(seed)
    m = dcir.parse(text)
    machine = Machine(world_size=2)
    for _, op in m.ops():
        noise = 1.0 if seed is None else 3 ** rng.uniform(-1, 1)
        op.attrs[TIME] = round(analytic_s(op, machine) * 1e6 * noise, 2)
    return m


def _plan(text: str, profiles: list[dcir.Module]) -> str:
    """What the Engine's optimization cycle plans from ``profiles`` (runtime/plan.py)."""
    from dcir_runtime.profiler import ProfileHistory

    history = ProfileHistory()
    for p in profiles:
        history.add(p)
    base = dcir.parse(text)
    history.write(base)
    PassManager(parse_pipeline("prefetch,unshard,bucket")).run(base)
    for _, op in base.ops():  # the schedule, not the figures it was planned from
        for key in [k for k in op.attrs if k.startswith("prof.")]:
            del op.attrs[key]
    return dcir.print(base)


def test_the_plan_is_the_same_for_the_same_profiles_in_any_order(llama_zero3):
    profiles = [_profile(llama_zero3, s) for s in (1, 2, 3)]
    first = _plan(llama_zero3, profiles)
    assert _plan(llama_zero3, profiles) == first
    assert _plan(llama_zero3, profiles[::-1]) == first
    assert first != _plan(llama_zero3, [])  # the profiles decided something


def test_one_noisy_profile_does_not_flip_the_plan(llama_zero3):
    """Three profiles, one of them noisy: the plan is the clean profiles' plan. The
    noisy profile alone plans differently, so the median is what keeps the plan."""
    clean = _plan(llama_zero3, [_profile(llama_zero3, None)])
    noisy = _profile(llama_zero3, 7)
    assert _plan(llama_zero3, [noisy]) != clean
    assert _plan(llama_zero3, [_profile(llama_zero3, None), noisy, _profile(llama_zero3, None)]) == clean


def test_a_wider_beam_finds_the_grouping_the_greedy_walk_misses():
    """Joining items 0 and 1 costs more than leaving them alone, but once item 2 joins
    too the step is cheapest: the greedy walk (width 1) cuts after item 0 and never
    sees it; a beam of 2 keeps the dearer grouping and does."""
    from dcir.search import beam

    prices = {(): 10.0, ((0, 1),): 12.0, ((1, 2),): 11.0, ((0, 1, 2),): 5.0}

    def score(grouping):
        return prices.get(tuple(g for g in grouping if len(g) > 1), 20.0)

    assert beam(3, score, width=1).grouping == ((0,), (1,), (2,))
    found = beam(3, score, width=2)
    assert found.grouping == ((0, 1, 2),) and found.score == 5.0
    with pytest.raises(ValueError, match="beam width must be at least 1"):
        beam(3, score, width=0)


def test_the_planner_tries_the_joint_alternatives_and_keeps_the_fastest(llama_zero3):
    from dcir.search import best_pipeline, pipelines

    m = _profile(llama_zero3, 7)
    candidates = pipelines(parse_pipeline("prefetch,unshard,bucket"))
    planned, chosen, tried = best_pipeline(m, candidates)
    assert [c.spec for c in tried] == ["prefetch,unshard,bucket", "unshard,prefetch,bucket",
                                       "prefetch{fuse=false},unshard,bucket", "unshard,prefetch{fuse=false},bucket"]
    assert chosen.seconds == min(c.seconds for c in tried)
    assert estimate_module(planned).seconds == chosen.seconds
    # within a budget below every candidate's peak, the smallest peak wins
    _, tight, _ = best_pipeline(m, candidates, budget=1)
    assert tight.peak == min(c.peak for c in tried)


@pytest.mark.slow  # 19 s; the default tier plans within budgets in tests/test_runtime.py
def test_under_a_budget_the_planner_also_tries_the_step_without_passes_that_spend_memory(llama_zero3):
    """A budget at the floor of what ``recompute`` can reach leaves no room for earlier
    gathers, replicas or larger collectives (``bucket`` grows the outbox): the pipeline
    without them is tried too, and fits where the others do not."""
    from dcir.passes.recompute import Recompute
    from dcir.memory import step_peak
    from dcir.search import best_pipeline, pipelines
    from dcir_runtime.transport import outbox_bytes

    m = _profile(llama_zero3, 7)
    floor = m.clone()
    dcir.run_passes(floor, [Recompute(budget=1)])
    budget = step_peak(floor)
    candidates = pipelines(parse_pipeline(f"recompute{{budget={budget}}},prefetch{{budget={budget}}},unshard,bucket"))
    assert [p.name for p in candidates[-1]] == ["recompute"]
    assert all(len(c) == 4 for c in candidates[:-1])
    assert [p.name for p in pipelines(parse_pipeline("recompute,prefetch"))[-1]] == ["recompute", "prefetch"]
    _, chosen, tried = best_pipeline(m, candidates, budget=budget + outbox_bytes(m), extra=outbox_bytes)
    assert chosen.spec.startswith("recompute{") and "," not in chosen.spec, tried
    assert chosen.peak <= budget + outbox_bytes(m) < min(c.peak for c in tried[:-1]), tried


def test_consecutive_profile_steps_each_profile_the_next_step():
    """``profile_at: [1, 2, 3]`` profiles three steps in a row and plans after each,
    every plan named by the pipeline the search chose."""
    from dcir_runtime import initialize
    from models import mlp, squared

    torch.manual_seed(0)
    engine = initialize(mlp(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), loss_fn=squared,
                        config={"optimize": {"passes": ["prefetch", "unshard", "bucket"], "profile_at": [1, 2, 3],
                                              "trial_steps": 0}})  # plans on the model's word: no trial
    for _ in range(6):
        engine.backward(engine(torch.randn(4, 8)))
        engine.step()
    assert [r["step"] for r in engine.optimize_log] == [2, 3, 4]
    assert all(r["pipeline"].startswith(("prefetch", "unshard")) for r in engine.optimize_log)


def _three_layers() -> str:
    """Three layers, each a gather of its weight and a stretch of compute that reads it."""
    layers = "".join(f"""
    %w{k}_shard = param.get @w{k} : shard<f32[64, 64], 2>
    %w{k}_pending = comm.all_gather(%w{k}_shard) : pending<f32[64, 64]>
    %w{k} = comm.wait(%w{k}_pending) : f32[64, 64]
    %h{k} = aten.mm.default(%x{k}, %w{k}) : f32[256, 64]
    %r{k} = aten.relu.default(%h{k}) : f32[256, 64]
    %x{k + 1} = aten.neg.default(%r{k}) : f32[256, 64]""" for k in range(3))
    return ("module @m attributes {world_size = 2} {\n"
            + "".join(f"  param @w{k} : shard<f32[64, 64], 2> {{trainable}}\n" for k in range(3))
            + "  func @forward(%x0: f32[256, 64] {input}) -> (f32[256, 64] {output}) role forward {"
            + layers + "\n    return %x3\n  }\n}\n")


def test_prefetch_plans_for_the_machine_its_context_names():
    """The machine a pass plans for is its context (``dcir.context.PlanContext``), handed
    to it, not a global. On the 2-core CPU's gloo (150 us a ring step) one coalesced
    gather of all three weights pays; on an H100's NVLink (a few us) the first weight
    is gathered alone, so the first layer need not wait for the other two. Each plan is
    what the pass makes when it is given that machine directly."""
    plans, direct = {}, {}
    for name in ("cpu-2core", "h100-ib400"):
        context = PlanContext(load(name))
        plans[name] = dcir.print(dcir.run_passes(dcir.parse(_three_layers()), "prefetch", context=context))
        module = dcir.parse(_three_layers())
        Prefetch().run(module, Counter(), context)
        direct[name] = dcir.print(module)
    assert plans == direct
    assert plans["cpu-2core"] != plans["h100-ib400"]
    assert "comm.all_gather_coalesced(%w0_shard, %w1_shard, %w2_shard)" in plans["cpu-2core"]
    assert "comm.all_gather(%w0_shard)" in plans["h100-ib400"]
    assert "comm.all_gather_coalesced(%w1_shard, %w2_shard)" in plans["h100-ib400"]


def test_where_host_memory_is_apart_the_planner_may_offload_activations_instead(llama_zero3):
    """On a GPU (a described H100 here) the planner also tries handing activations to the
    backward through host memory within the budget, in place of ``recompute`` and after
    its cheap cones; on a CPU, where host memory is the device's, it never does. On the
    H100's model a copy at 55 GB/s beside compute beats rebuilding the activations where
    the budget needs more than recompute's cheapest rebuilds: within 85% of the step's
    peak it offloads, and fits."""
    from dcir import hardware
    from dcir.context import PlanContext
    from dcir.memory import step_peak
    from dcir.search import best_pipeline, pipelines

    m = dcir.parse(llama_zero3)
    budget = int(step_peak(m) * 0.85)
    spec = f"recompute{{budget={budget}}},prefetch{{budget={budget}}}"
    on_cpu = pipelines(parse_pipeline(spec))
    assert not any(p.name == "offload_activations" for pipe in on_cpu for p in pipe)
    on_gpu = pipelines(parse_pipeline(spec), host_apart=True)
    names = [[p.name for p in pipe] for pipe in on_gpu]
    assert names[:len(on_cpu)] == [[p.name for p in pipe] for pipe in on_cpu]
    assert ["recompute", "offload_activations", "prefetch"] in names and ["offload_activations", "prefetch"] in names
    assert all(p.budget == budget for pipe in on_gpu for p in pipe if p.name == "offload_activations")
    context = PlanContext(machine=hardware.load("h100-ib400"))
    planned, chosen, tried = best_pipeline(m, on_gpu, budget=budget, context=context)
    assert "offload_activations" in chosen.spec and chosen.peak <= budget, tried
    assert chosen.seconds < min(c.seconds for c in tried if "offload" not in c.spec), tried
    assert any("{act.offload}" in line for line in dcir.print(planned).splitlines())
