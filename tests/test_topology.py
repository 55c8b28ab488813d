"""The planner's choice of a way across nodes (``dcir.topology``), on a captured
``transformers`` Llama priced on the H100 description, and the Engine settings that ask
for it (``"auto"`` with a ``machine``). tests/test_mesh.py trains the Engine's choice
across two "nodes" equal to one device."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

import dcir
from dcir import topology
from dcir.diagnostics import DcirError
from dcir.machine import load
from dcir.memory import step_peak
from dcir.passes.recompute import Recompute
from dcir.sim import held_bytes
from dcir_lowering.frontend import capture
from dcir_runtime import Config
from dcir_runtime.capture import choose_layout
from models import mlp, squared, tiny_llama

WORLD, PER_NODE = 32, 8


@pytest.fixture(scope="module")
def step() -> dcir.Module:
    """A Llama's training step as captured, not yet sharded, the loss outside."""
    torch.manual_seed(0)
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    module, _ = capture(model, (), kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda out: out.loss,
                        training=True)
    return module


@pytest.fixture(scope="module")
def machine():
    return replace(load("h100-ib400"), ranks_per_node=PER_NODE)


def _choose(step, machine, **options) -> topology.Choice:
    return topology.choose(lambda layout: topology.sharded(step, layout, WORLD, PER_NODE, 4), machine, 4, **options)


def test_each_way_is_the_program_its_passes_make(step):
    for layout in topology.LAYOUTS:
        m = topology.sharded(step, layout, WORLD, PER_NODE, 4)
        dcir.verify(m)
        text = dcir.print(m)
        assert ("mesh.nodes = 4, mesh.local = 8" in text) == (layout.hsdp or layout.hpz), layout
        # HSDP: the parameters' shards split over the node
        assert bool(re.search(r"param @\S+ : shard<[^>]*local=8>", text)) == layout.hsdp, layout
        assert ("mem.shard(" in text) == layout.hpz, layout      # hpZ: the node-local partitions
        assert ("mem.quantize(" in text) == layout.weights, layout
        assert ("mem.dequantize_reduce(" in text) == layout.gradients, layout
    assert topology.sharded(step, topology.LAYOUTS[0], WORLD, PER_NODE).attrs == {"world_size": WORLD}


def test_the_fastest_way_that_fits_is_chosen_and_why(step, machine):
    exact = _choose(step, machine)
    assert [p.layout.name for p in exact.priced] == ["ZeRO-3", "HSDP", "hpZ"]  # quantizing needs lossy
    seconds = {p.layout.name: p.seconds for p in exact.priced}
    # a tiny model on 4 nodes: latency-bound; HSDP crosses nodes once a step, hpZ gathers in the node in the backward
    assert seconds["HSDP"] < seconds["hpZ"] < seconds["ZeRO-3"]
    assert exact.chosen.layout.name == "HSDP"
    why = exact.why().splitlines()
    assert why[0].startswith("HSDP: ") and why[0].endswith(": chosen, the fastest that fits"), why
    assert why[1].startswith("ZeRO-3: ") and why[1].endswith(": slower") and "x ZeRO-3" not in why[1], why
    assert f"{seconds['ZeRO-3'] / seconds['hpZ']:.2f}x ZeRO-3" in why[2], why

    lossy = _choose(step, machine, lossy=True)
    assert [p.layout.name for p in lossy.priced] == [layout.name for layout in topology.LAYOUTS]

    # HSDP holds whole-node shards: a budget below its peak leaves the fastest of the others
    peaks = {p.layout.name: p.peak for p in exact.priced}
    assert peaks["HSDP"] > max(peaks["ZeRO-3"], peaks["hpZ"])
    tight = _choose(step, machine, budget=max(peaks["ZeRO-3"], peaks["hpZ"]))
    assert tight.chosen.layout.name == "hpZ"
    assert any(line.startswith("HSDP: ") and line.endswith(f": does not fit the budget of "
                                                         f"{dcir.memory.format_bytes(tight.budget)}")
               for line in tight.why().splitlines())
    none = _choose(step, machine, budget=min(peaks.values()) - 1)
    assert none.chosen is None and none.why().splitlines()[0] == "no layout fits the budget"


def test_auto_settings_leave_the_planner_the_ways_they_allow():
    names = lambda config, world=WORLD: [layout.name for layout in Config.load(config).layouts(world)]  # noqa: E731
    h100 = {"machine": "h100-ib400"}
    assert names({}) == ["ZeRO-3"]
    assert names({"zero_hpz_partition_size": 8}) == ["hpZ"]
    assert names({"zero_hpz_partition_size": 8}, world=8) == ["ZeRO-3"]  # one node: nothing to keep
    assert names({"zero_hpz_partition_size": "auto", **h100}) == ["ZeRO-3", "hpZ"]
    assert names({"zero_hpz_partition_size": "auto", "zero_quantized_weights": "auto", **h100}) == [
        "ZeRO-3", "qwZ", "hpZ", "hpZ+qwZ"]
    assert names({"zero_hpz_partition_size": 8, "zero_quantized_weights": True,
                  "zero_quantized_gradients": "auto", **h100}) == ["hpZ+qwZ", "ZeRO++"]
    # combinations LAYOUTS does not name are named by their parts; HSDP quantizes too
    assert names({"zero_quantized_gradients": True}) == ["qgZ"]
    assert names({"mesh": {"replicate": 4, "shard": 8}, "zero_quantized_weights": "auto", **h100}) == [
        "HSDP", "HSDP+qwZ"]
    hsdp_q = Config.load({"mesh": {"replicate": 4, "shard": 8}, "zero_quantized_weights": True}).layouts(WORLD)[0]
    assert (hsdp_q.hsdp, hsdp_q.hpz, hsdp_q.weights, hsdp_q.gradients) == (True, False, True, False)
    assert Config.load({"zero_hpz_partition_size": "auto", **h100}).topology(8) == {
        "replicate": None, "shard": 8, "hsdp": False}


def test_auto_settings_need_a_machine_and_a_machine_needs_them():
    with pytest.raises(DcirError) as e:
        Config.load({"zero_hpz_partition_size": "auto", "zero_quantized_weights": "auto"})
    assert "zero_hpz_partition_size and zero_quantized_weights" + ' given as "auto": the planner chooses by pricing each way to lay the step across nodes on a machine description: give machine (a dcir/machines name or a .toml)' in str(e.value)  # noqa: E501
    with pytest.raises(DcirError) as e:
        Config.load({"machine": "h100-ib400"})
    assert 'machine is the description the ZeRO++ settings given as "auto" are chosen on, and none is: give zero_hpz_partition_size, zero_quantized_weights or zero_quantized_gradients "auto", or leave machine out' in str(e.value)  # noqa: E501
    with pytest.raises(DcirError, match=r"bad value for 'machine': cannot read hardware description .*nope\.toml"):
        Config.load({"zero_hpz_partition_size": "auto", "machine": "nope"})
    with pytest.raises(DcirError, match=r"bad value for 'machine': 3; a dcir/machines name or a \.toml path"):
        Config.load({"zero_hpz_partition_size": "auto", "machine": 3})
    with pytest.raises(DcirError) as e:
        Config.load({"zero_hpz_partition_size": "sometimes"})
    assert "bad value for 'zero_hpz_partition_size': 'sometimes'; a positive integer, or null, or \"auto\"" in str(e.value)
    with pytest.raises(DcirError) as e:
        Config.load({"zero_quantized_gradients": "maybe"})
    assert "bad value for 'zero_quantized_gradients': 'maybe'; true or false, or \"auto\"" in str(e.value)


def test_an_engine_given_auto_runs_the_way_it_chose(capfd):
    """One process: quantizing is a candidate (its setting is "auto"), priced on the H100
    description; at one rank there is nothing to gather, so int8 only adds work."""
    torch.manual_seed(0)
    engine = dcir.initialize(mlp(), torch.optim.AdamW, {"zero_quantized_weights": "auto",
                                                        "machine": "h100-ib400"}, loss_fn=squared)
    x = torch.randn(4, 8)
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    said = capfd.readouterr().err
    assert "laid across 1 node of 1 rank, as priced on h100-ib400:\n  ZeRO-3: " in said, said
    assert re.search(r"\n  qwZ: \S+ s a step, 0\.\d+x ZeRO-3, peak .*: slower", said), said
    assert said.count("as priced on") == 1  # chosen once, when the step is compiled
    assert 'plan.layout = "ZeRO-3"' in dcir.print(engine.ir()) and "mem.quantize" not in dcir.print(engine.ir())


def test_when_no_way_fits_the_engine_runs_the_smallest_and_says_so(capfd):
    module, _ = capture(mlp(), (torch.randn(4, 8),), kwargs={}, loss_fn=squared, training=True)
    config = Config.load({"zero_hpz_partition_size": "auto", "machine": "h100-ib400", "memory_budget": 1})
    layout = choose_layout(module, config, 4, 2, config.layouts(4))
    lines = capfd.readouterr().err.splitlines()
    assert lines[1] == "  no layout fits the budget" and lines[-1] == f"  running {layout.name}, the smallest peak", lines
    assert len(lines) == 5 and all(line.endswith(": does not fit the budget of 1 B") for line in lines[2:4]), lines
    assert layout.name == "ZeRO-3" and module.attrs["plan.layout"] == "ZeRO-3"  # hpZ keeps the node's partitions too


def test_with_recompute_in_the_cycle_each_way_is_priced_as_it_would_run(capfd):
    """Under a budget below every way's peak but above what recomputing leaves them,
    with ``recompute`` in the cycle (which then runs the first step fitted within the
    budget, ``plan.fit_first_step``), each way is priced rebuilding what it must, and
    the fastest is chosen; without it, none fits and the smallest peak runs."""
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    module, _ = capture(tiny_llama(), (), kwargs={"input_ids": ids, "labels": ids}, loss_fn=lambda out: out.loss,
                        training=True)
    config = Config.load({"zero_hpz_partition_size": "auto", "machine": "h100-ib400"})
    peaks, floors = [], []
    for layout in config.layouts(4):
        m = topology.sharded(module, layout, 4, 2)
        peaks.append(held_bytes(m) + step_peak(m))
        dcir.run_passes(m, [Recompute(budget=1)])
        floors.append(held_bytes(m) + step_peak(m))
    budget = (max(floors) + min(peaks)) // 2
    assert max(floors) < budget < min(peaks)
    for cycle, chosen in (({"passes": ["recompute", "prefetch"]}, True), ({"passes": ["prefetch"]}, False)):
        tight = Config.load({"zero_hpz_partition_size": "auto", "machine": "h100-ib400", "memory_budget": budget,
                             "optimize": cycle})
        choose_layout(module.clone(), tight, 4, 2, tight.layouts(4))
        said = capfd.readouterr().err
        assert ("chosen, the fastest that fits" in said) == chosen and ("no layout fits" in said) != chosen, said
