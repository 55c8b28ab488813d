"""Activations the user checkpoints: captured, marked, replayed, trained as eager trains them.

``model.gradient_checkpointing_enable()`` (reentrant and not), ``torch.utils.checkpoint``
in the model's own forward and torch's selective checkpointing each train through
``torch.compile(backend="dcir")`` (one process) and through the Engine (world 2, ZeRO-3),
the loss computed outside, and land where eager training with the same checkpointing
lands after 3 AdamW steps. Every case has dropout inside its checkpointed region: the
backward's replay must draw the forward's masks (``rng.get`` / ``rng.set``,
``dcir.activations``), or the gradients differ.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

import dcir
from activations_worker import CASES
from dcir.activations import OFFLOAD, RECOMPUTE, recomputed
from dcir.fusion import FUSE
from dcir.memory import saved_storage
from dcir.passes.recompute import Recompute, footprint
from dcir_runtime import native
from dcir_runtime.launch import launch
from dcir_lowering.program import state_of
from dcir_runtime.plan import over_budget_advice
from models import Checkpointed, checkpointed_llama, tiny_llama
from test_fusion import assert_step_matches_eager
from zoo import LR, criterion, micro_batches, worst_relative

WORKER = str(__import__("pathlib").Path(__file__).resolve().parent / "activations_worker.py")
TOLERANCE = 1e-6
#: one of each kind in the default run; the rest under ``-m slow``
DEFAULT = ("llama_checkpointing", "selective_checkpointing")


def _cases():
    for name in CASES:
        yield pytest.param(name, marks=[] if name in DEFAULT else [pytest.mark.slow], id=name)


def _train(model, step, batches) -> list[float]:
    """3 AdamW steps of ``step`` (the model, or it compiled), the loss outside; each step
    starts from the generator state the caller set before the first."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for inputs, y in batches:
        loss = criterion(step(**inputs), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(_cases()))
def test_checkpointed_model_trains_as_eager_through_the_backend(name):
    z = CASES[name]
    batches = list(micro_batches(z, 1, 1))
    ref, mine = z.model(), z.model()  # each seeded: the same weights, the same generator state after
    start = torch.get_rng_state()
    expected = _train(ref, ref, batches)
    torch.set_rng_state(start)
    torch._dynamo.reset()
    try:
        got = _train(mine, torch.compile(mine, backend="dcir"), batches)
    finally:
        torch._dynamo.reset()
    worst, where = worst_relative(dict(ref.named_parameters()), dict(mine.named_parameters()))
    assert worst <= TOLERANCE, (name, where, worst, expected, got)
    assert got == expected, (expected, got)


@pytest.mark.parametrize("names", [pytest.param(DEFAULT, id="default"),
                                   pytest.param(tuple(n for n in CASES if n not in DEFAULT), id="rest",
                                                marks=pytest.mark.slow)])
def test_checkpointed_models_train_sharded_as_eager(names, tmp_path):
    native.load()  # built once here, before the ranks start and load it
    out = tmp_path / "results.json"
    assert launch([WORKER, str(out), *names], 2, timeout_s=500, grace_s=5) == 0
    results = json.loads(out.read_text())
    for name in names:
        r = results[name]
        assert r["worst"] is not None and r["worst"] <= TOLERANCE, (name, r)
        assert r["losses"][-1] < r["losses"][0], (name, r["losses"])  # it trains


def _ir(model, **kwargs) -> dcir.Module:
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    module = dcir.compile_to_ir(model, (), kwargs={"input_ids": ids, **kwargs})
    dcir.verify(module)
    assert dcir.print(dcir.parse(dcir.print(module))) == dcir.print(module)  # the marks round-trip
    return module


def test_recompute_is_marked_in_the_backward_and_saves_less():
    """The partitioner's recomputed ops are ordinary ops of ``@backward`` marked
    ``act.recompute``; the forward hands over less."""
    torch.manual_seed(0)
    plain = _ir(tiny_llama())
    torch.manual_seed(0)
    model = checkpointed_llama(reentrant=False)
    model.config.attention_dropout = 0.0
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0
    checkpointed = _ir(model)
    assert not any(recomputed(f) for f in plain.functions.values())
    assert not recomputed(checkpointed.functions["forward"])
    again = recomputed(checkpointed.functions["backward"])
    assert {op.name for op in again} >= {"aten.mm.default", "aten.mul.Tensor", "aten._softmax.default"}
    assert not any(op.name.startswith("rng.") for _, op in checkpointed.ops())  # no dropout: nothing to replay
    saved = lambda m: sum(b for _, b in {k: v for k, v in saved_storage(m).values()}.items())  # noqa: E731
    assert saved(checkpointed) < saved(plain) / 3, (saved(checkpointed), saved(plain))



@pytest.mark.slow  # 34 s (Inductor); the default tier fuses a Llama in tests/test_fusion.py
def test_recomputed_ops_run_in_the_stretches_fuse_compiles():
    """``recompute`` and ``fuse`` compose: with every activation the pass can rebuild
    rebuilt, ``fuse`` compiles stretches of the backward that hold rebuilt ops, and a
    step matches eager (float sums reassociated by Inductor: its bound). The budgeted
    benchmark plans take both (docs/benchmarks.md)."""
    torch.manual_seed(0)
    ref = tiny_llama()
    mine = copy.deepcopy(ref)
    ids = torch.randint(0, 128, (2, 16))
    module = dcir.compile_to_ir(copy.deepcopy(ref), (), kwargs={"input_ids": ids, "labels": ids.clone()},
                                loss_fn=lambda o: o.loss)
    dcir.run_passes(module, [Recompute(budget=1)])
    dcir.run_passes(module, "fuse")
    backward = module.functions["backward"].ops
    assert any(RECOMPUTE in op.attrs and FUSE in op.attrs for op in backward)
    assert_step_matches_eager(ref, mine, dcir.lower(module, state_of(mine)), ids)

def test_a_budget_buys_the_cheapest_bytes_first():
    """Under a budget, ``recompute`` takes the most bytes freed per second of compute
    run again first, and only what lowers the step's peak: on a 2-layer Llama after
    ``zero3`` (sequence 64, batch 4), within 60% of its peak it fits running fewer ops
    again, and a faster simulated step, than the cheap-cones-by-size order it falls back
    to reaches the same budget with (docs/passes.md)."""
    from collections import Counter

    from dcir import roles
    from dcir.passes.recompute import BY_SIZE
    from dcir.rewrite import Rewriter
    from dcir.sim import estimate_module

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    captured = dcir.compile_to_ir(tiny_llama(), (), kwargs={"input_ids": ids, "labels": ids.clone()},
                                  loss_fn=lambda out: out.loss)
    dcir.run_passes(captured, "zero3{world_size=2}")
    budget = int(0.6 * footprint(captured)[0])
    by_cost, by_size = captured.clone(), captured.clone()
    dcir.run_passes(by_cost, [Recompute(budget=budget)])
    fw, bws = roles.hand_off(by_size.functions.values())
    rewriters = {f.name: Rewriter(f) for f in (fw, *bws)}
    Recompute(budget=budget)._take(by_size, fw, bws, rewriters, dcir.machine.Machine(world_size=2), Counter(),
                                   BY_SIZE)
    again = [len([op for _, op in m.ops() if RECOMPUTE in op.attrs]) for m in (by_cost, by_size)]
    assert footprint(by_cost)[0] <= budget and footprint(by_size)[0] <= budget
    assert again[0] < again[1] / 2, again  # measured: 48 against 109
    assert estimate_module(by_cost).seconds < estimate_module(by_size).seconds


def test_dropout_in_a_checkpointed_region_replays_the_forward_state():
    """The forward saves the generator's state before each random op of a checkpointed
    region; the backward sets it around the replay and puts the generator back after."""
    module = _ir(checkpointed_llama(reentrant=False))
    fw, bw = module.functions["forward"], module.functions["backward"]
    saves = [op for op in fw.ops if op.name == "rng.get"]
    assert len(saves) == 2  # one per layer's attention dropout
    for save in saves:
        after = fw.ops[fw.ops.index(save) + 1]
        assert after.name == "aten.native_dropout.default" and after.operands[0] is save.operands[0]
    sets = [op for op in bw.ops if op.name == "rng.set"]
    assert len(sets) == 4 and all(RECOMPUTE in op.attrs for op in sets)
    for first, last in zip(sets[::2], sets[1::2]):
        between = bw.ops[bw.ops.index(first) + 1:bw.ops.index(last)]
        assert [op.name for op in between] == ["aten.native_dropout.default"]
        assert first.operands[0].type.dtype == "u8" and last.operands[0].owner.name == "rng.get"


def test_selective_checkpointing_saves_what_its_policy_names():
    """A policy that saves matmuls: no matmul is recomputed, the rest of the region is."""
    module = _ir(Checkpointed(selective=True))
    again = {op.name for op in recomputed(module.functions["backward"])}
    assert "aten.gelu.default" in again and "aten.native_layer_norm.default" in again
    assert not again & {"aten.addmm.default", "aten.mm.default"}
    everything = {op.name for op in recomputed(_ir(Checkpointed()).functions["backward"])}
    assert "aten.addmm.default" in everything


def _train_engine(config: dict, steps: int = 4):
    """A tiny Llama at sequence 64 through the Engine (one process), the loss outside;
    after each step what the rank holds whatever the schedule, and the step's peak."""
    from dcir_runtime.accounting import fixed_bytes

    torch.manual_seed(0)
    engine = dcir.initialize(tiny_llama(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), config=config)
    g = torch.Generator().manual_seed(0)
    held = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (4, 64), generator=g)
        out = engine(input_ids=ids)
        engine.backward(torch.nn.functional.cross_entropy(out.logits.reshape(-1, 128), ids.reshape(-1)))
        engine.step()
        m = engine.memory()
        held.append((fixed_bytes(m), m.step_peak))
    return engine, held


def test_the_outputs_a_loss_outside_keeps_are_held_beside_the_backward():
    """A loss computed outside keeps the logits through the engine's backward: the rank
    holds them whatever the schedule (``outputs_held`` in ``fixed_bytes``), as rank 0's
    first-step fit assumed; a caller that keeps only the loss holds its 4 bytes, and an
    output that is a saved activation is the program's already."""
    from dcir.memory import handed_bytes
    from dcir_runtime.accounting import HandedOut, fixed_bytes

    engine, _ = _train_engine({}, steps=1)
    m = engine.memory()
    logits, cache = 4 * 64 * 128 * 4, 2 * 2 * 4 * 2 * 64 * 16 * 4  # the outputs: logits, and keys and values
    assert m.outputs_held == logits + cache == handed_bytes(engine.ir())  # ``out`` keeps its DynamicCache
    assert fixed_bytes(m) == m.parameters + m.optimizer_state_peak + m.buffers + logits + cache
    ids = torch.randint(0, 128, (4, 64))
    engine(input_ids=ids, labels=ids).loss.backward()  # the outputs go at once, but for the loss
    engine.step()
    assert engine.memory().outputs_held == logits + cache  # the most any backward saw
    fresh = dcir.initialize(tiny_llama(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    loss = fresh(input_ids=ids, labels=ids).loss
    loss.backward()
    assert fresh.memory().outputs_held == loss.element_size() == 4
    handed, saved, kept = HandedOut(), torch.ones(8), torch.ones(4)
    handed.hand((saved, kept, torch.ones(2)))  # the last one the caller let go
    handed.backward_starts((saved[2:],))  # a view of the saved activation shares its storage
    assert handed.peak == kept.nbytes == 16


def test_a_loss_outside_is_counted_beside_the_backwards_entry():
    """A loss computed outside holds, when the logits' gradient reaches the backward, its
    log-softmax and that one's gradient: from the first backward on the running program
    says so (``caller.loss_bytes``: twice the gradients handed over), and the memory
    model counts it at the entry of the backward alone, in the step's peak too. A loss
    inside the model hands over the loss's gradient alone."""
    from dcir.memory import CALLER_LOSS, step_peak, timelines
    from dcir_runtime.accounting import LOSS_COPIES

    engine, _ = _train_engine({}, steps=1)
    module, logits = engine.ir(), 4 * 64 * 128 * 4
    assert module.attrs[CALLER_LOSS] == LOSS_COPIES * logits
    lines = timelines(module)
    assert lines["backward"].caller == LOSS_COPIES * logits and lines["forward"].caller == 0
    assert lines["backward"].peak >= lines["backward"].entry + LOSS_COPIES * logits
    assert engine.memory().step_peak == step_peak(module)
    del module.attrs[CALLER_LOSS]
    assert engine.memory().step_peak == step_peak(module)  # the accounting follows the program's word
    inside = dcir.initialize(tiny_llama(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR))
    ids = torch.randint(0, 128, (4, 64))
    inside(input_ids=ids, labels=ids).loss.backward()
    inside.step()
    assert inside.ir().attrs[CALLER_LOSS] == LOSS_COPIES * 4


def test_a_budget_only_recompute_meets_says_so():
    """Without the cycle, a step over the budget is an error that says what recomputing
    would fit, and how to ask for it."""
    _, held = _train_engine({}, steps=1)
    fixed, peak = held[-1]
    with pytest.raises(dcir.DcirError, match=r"recomputing every activation that can be rebuilt, the step fits "
                                             r"[0-9.]+ [KM]iB: add 'recompute' to optimize.passes"):
        _train_engine({"memory_budget": fixed + int(0.8 * peak)}, steps=1)


def test_over_a_budget_on_a_gpu_the_advice_counts_offload_too():
    """Where host memory is apart from the device's, the floor the error gives includes
    offloading what recompute cannot rebuild, and the advice names both passes."""
    both = "recomputing every activation that can be rebuilt and offloading the others to host memory"
    assert over_budget_advice(5 << 20, 6 << 20, host_apart=True) == (
        f"{both}, the step fits 5.00 MiB: add 'recompute' and 'offload_activations' to optimize.passes")
    assert over_budget_advice(7 << 20, 6 << 20, host_apart=True) == (
        f"even {both}, the step needs 7.00 MiB: raise memory_budget or lower the micro-batch")


@pytest.mark.parametrize("share", [0.6, "floor"])
def test_a_memory_budget_the_activations_exceed_is_met_by_recomputing(share, capfd):
    """With ``memory_budget`` at 60% of the step's own memory, or at the floor (every
    activation ``recompute`` can rebuild rebuilt), and the optimization cycle allowed to
    recompute, every step is within the budget, the first one too: the captured program
    is fitted before it runs, by the memory model, and the cycle plans again from a
    profile within the same budget. Training is bit for bit the run without a budget."""
    free, held = _train_engine({})
    fixed, peak = held[-1]
    if share == "floor":
        least = free.ir().clone()
        dcir.run_passes(least, [Recompute(budget=1)])
        budget = fixed + footprint(least)[0]
    else:
        budget = fixed + int(share * peak)
    assert fixed + peak > budget
    engine, planned = _train_engine({"memory_budget": budget,
                                     "optimize": {"passes": ["recompute", "prefetch"], "profile_at": [1]}})
    assert re.search(r"dcir: the captured step holds [0-9.]+ [KM]iB of its own at its peak, over the [0-9.]+ [KM]iB "
                     r"the memory budget leaves it; from the first step, [0-9]+ more ops run in the backward",
                     capfd.readouterr().err)
    assert all(f + p <= budget for f, p in planned), (planned, budget)  # the first step included
    (cycle,) = engine.optimize_log
    assert cycle["budget"] == budget - fixed and cycle["reason"] != "memory", cycle  # no step went over
    assert any(RECOMPUTE in op.attrs for _, op in engine.ir().ops())
    a, b = free.full_parameters(), engine.full_parameters()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_budget_holds_on_every_rank_from_the_first_step(tmp_path):
    """World 2: under a budget of 60% of the step's own memory (plus what the ranks hold
    whatever the schedule) every rank's every step, the first included, is within it,
    rank 0's fitted program runs on both, and the parameters are bit for bit those of
    the run without a budget."""
    native.load()
    out = tmp_path / "results.json"
    assert launch([WORKER, str(out), "budget"], 2, timeout_s=300, grace_s=5) == 0
    r = json.loads(out.read_text())["budget"]
    assert all(h > r["budget"] for h in r["free"]), r  # without a budget: over it
    assert all(h <= r["budget"] for h in r["held"]), r
    assert r["equal"] and r["recomputed"] > 0 and "memory" not in r["log"], r


def test_a_budget_the_first_step_cannot_meet_fails_before_it():
    """Where even every activation rebuilt leaves the step over the budget, the error
    comes before the first step runs (on a GPU it would run out of memory first), with
    the smallest budget that would do, as the check after a step gives it."""
    _, held = _train_engine({}, steps=1)
    fixed, _ = held[-1]
    with pytest.raises(dcir.DcirError) as e:
        _train_engine({"memory_budget": fixed + 1024, "optimize": {"passes": ["recompute"], "profile_at": [1]}},
                      steps=1)
    assert " whatever the schedule (parameter shards, the optimizer state the step makes, buffers, the outputs the caller keeps) and " in str(e.value)  # noqa: E501
    assert re.search(r"the first step would hold ([0-9.]+ [KM]iB) at its peak, over the memory budget of [0-9.]+ "
                     r"[KM]iB: .* in the step; even recomputing every activation that can be rebuilt, the step needs "
                     r"\1: raise memory_budget", str(e.value)), str(e.value)
    assert "rank 0 could not fit the first step within the memory budget" in str(e.value)


def test_random_ops_run_eagerly_so_compiled_stretches_replay_them():
    """Under Inductor a random op runs eagerly, between compiled stretches, from the
    generator ``rng.get``/``rng.set`` save and set: the forward draws eager's masks and
    the backward's replay draws them again (Inductor's own kernels would draw others)."""
    z = CASES["checkpoint_in_model"]
    batches = list(micro_batches(z, 1, 1))
    ref, mine = z.model(), z.model()
    start = torch.get_rng_state()
    _train(ref, ref, batches)
    torch.set_rng_state(start)
    engine = dcir.initialize(mine, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), config={"inductor": True})
    for inputs, y in batches:
        engine.backward(criterion(engine(**inputs), y))
        engine.step()
    worst, where = worst_relative(dict(ref.named_parameters()), engine.full_parameters())
    assert worst <= 1e-4, (where, worst)  # Inductor's bound (test_runtime.INDUCTOR_CASES)


def _zoo_cases():
    from zoo import ZOO

    for name, z in ZOO.items():
        if z.matches:
            yield pytest.param(name, marks=() if name in ("llama", "t5", "resnet") else pytest.mark.slow)


@pytest.mark.parametrize("name", list(_zoo_cases()))
def test_zoo_models_step_with_everything_recomputed(name):
    """A zoo model (tests/zoo.py) through ``recompute{budget=1}`` (every activation the
    pass can rebuild, matmuls included): the hand-off shrinks, and the lowered step's
    loss and gradients are eager's, bit for bit (the same ops, run again)."""
    from dcir.passes import PassManager, parse_pipeline
    from dcir.passes.recompute import footprint
    from dcir_lowering.program import state_of
    from zoo import ZOO, captured_step, eager_and_lowered

    ref, mine, kwargs, module = captured_step(ZOO[name])
    handed = footprint(module)[1]
    manager = PassManager(parse_pipeline("recompute{budget=1}"))
    manager.run(module)
    assert footprint(module)[1] < 0.6 * handed, (footprint(module), handed)  # 12-51% of it is left
    assert manager.stats["recompute{budget=1}"]["activations rebuilt"] > 0
    program = dcir.lower(module, state_of(mine))
    loss_ref, loss_mine = eager_and_lowered(ref, program, kwargs)
    assert loss_mine.item() == loss_ref.item()
    for (n, p), q in zip(ref.named_parameters(), mine.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n


@pytest.mark.parametrize("name", list(_zoo_cases()))
def test_zoo_models_step_with_activations_in_host_memory(name):
    """A zoo model through ``offload_activations{budget=1}`` (every activation the pass
    can hand over through host memory): the device's hand-off shrinks, each copy runs on
    the copy lanes and its host copy is gone after the backward, and the lowered step's
    loss and gradients are eager's, bit for bit (the same ops on copied values)."""
    from dcir.passes import PassManager, parse_pipeline
    from dcir_lowering import copies
    from dcir_lowering.program import state_of
    from zoo import ZOO, captured_step, eager_and_lowered

    ref, mine, kwargs, module = captured_step(ZOO[name])
    handed = footprint(module)[1]
    manager = PassManager(parse_pipeline("offload_activations{budget=1}"))
    manager.run(module)
    stats = manager.stats["offload_activations{budget=1}"]
    assert footprint(module)[1] < 0.6 * handed, (footprint(module), handed, stats)  # resnet keeps the most, 51% (storages saved with views)
    marked = [op for f in module.functions.values() for op in f.ops if OFFLOAD in op.attrs]
    assert {op.name for op in marked} == {"mem.offload", "mem.reload"} and stats["activations offloaded"] > 0
    program = dcir.lower(module, state_of(mine))
    before = copies.activation_stats()
    loss_ref, loss_mine = eager_and_lowered(ref, program, kwargs)
    after = copies.activation_stats()
    assert after.moved - before.moved == 2 * stats["bytes copied each way"]
    assert after.host_now == before.host_now and after.host_peak >= stats["bytes copied each way"] // 2
    assert loss_mine.item() == loss_ref.item()
    for (n, p), q in zip(ref.named_parameters(), mine.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n
