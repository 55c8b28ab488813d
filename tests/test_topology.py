"""The planner's choice of a way across nodes (``dcir.topology``), on a captured
``transformers`` Llama priced on the H100 description."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

import dcir
from dcir import topology
from dcir.machine import load
from dcir_lowering.frontend import capture
from models import tiny_llama

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
