#!/usr/bin/env python
"""Predict Llama-3-70B on 32 H100s: ZeRO-3 against ZeRO-3 with DCIR's passes, beside DeepCompile's figures.

The DeepCompile blog (DeepSpeed, 2025) reports, for Llama-3-70B on 32 H100s
(micro-batch 1, sequence 1024, activation checkpointing), DeepCompile's proactive
prefetching and selective unsharding at 1.18x the speed of ZeRO-3 at gradient
accumulation 1 and 1.28x at 16. This script predicts the same comparison with DCIR's
simulator (``dcir.sim``) on the H100 description (``dcir/machines/h100-ib400.toml``):

* the program is the synthetic ZeRO-3 step of ``bench_compiler.py``, generated from
  the model's config (hidden 8192, 64 heads, 8 KV heads, FFN 28672, vocabulary 128256,
  80 layers, bf16 parameters and compute) without materializing a tensor: every
  decoder layer checkpointed (its input saved, the layer recomputed in the backward),
  each parameter gathered before its first use and freed after its last, gradients
  reduce-scattered one layer later;
* "ZeRO-3" is that program as generated; "DCIR" is it after ``prefetch``,
  ``unshard{micro_steps=N}`` and ``bucket``, planned on the H100 description with
  the device memory (less the state every rank holds) as the budget;
* a step is ``N`` micro-steps: ``@forward`` and ``@backward`` N times, ``@unshard``
  (the gathered copies ``unshard`` keeps across micro-steps) once.

ZeRO-3 is simulated on the full 80-layer program (47,511 ops a micro-step). The
passes are not run on it: ``bucket`` prices every candidate merge by simulating the
whole function, quadratic in its length (about 10 minutes here at 80 layers, against
the minute this script has). Decoder layers are identical, so the planned program's
step time is linear in the layer count past the first layers: the passes plan the
2-, 3- and 4-layer programs, a least-squares line through their step times gives the
time a layer adds, and the line is read at 80. The same fit of ZeRO-3's times is
checked against its direct 80-layer simulation (the "fit error" printed). The memory
budget scales with the layers: what the schedule may hold beyond ZeRO-3's own peak is
the 80-layer headroom (device memory less held state and that peak) times L/80, so
``unshard`` keeps the same share of the layers gathered as it would at 80.

``--mesh`` predicts instead where hybrid sharding (HSDP, ``zero3{nodes=N, shard=local}``:
parameters sharded over a node's 8 ranks, gradients reduce-scattered there and averaged
across nodes once per optimizer step) or hierarchical partitions (hpZ, ``zero3{nodes=N},
hierarchical``: sharded over every rank, the backward gathering node-local partitions
within the node) or int8 parameter gathers (qwZ, ``quantize``; alone and with hpZ) or all
of ZeRO++ (hpZ, qwZ and int8 gradient reductions, qgZ) win over flat ZeRO-3:
Llama-3-70B, Llama-3-8B and Mixtral-8x7B (``bench_compiler``'s mixture of experts: 8
experts a layer, 2 per token, routed evenly) on 32, 128 and 1,024 ranks (8 per node), each
program as the stage writes it (no scheduling passes), with its peak memory per rank
(whether it fits the device) and the bytes one rank sends per optimizer step within its
node and across nodes (a ring that spans nodes counts as crossing them: the NIC bounds
it). The choice is the planner's, ``dcir.topology.choose``: the fastest that fits, with
its reason printed under each group of rows. The simulator prices the quantize ops as one
pass over the bytes they read and write (``mem_bw``).

Usage::

    python benchmarks/predict_at_scale.py              # 80 layers, accumulation 1 and 16
    python benchmarks/predict_at_scale.py --layers 2   # quick (tests)
    python benchmarks/predict_at_scale.py --mesh       # flat ZeRO-3 against HSDP, by model and ranks
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import replace

import dcir
from dcir import ops as registry
from dcir.accumulate import once_per_step
from dcir.context import PlanContext
from dcir.cost import is_host_copy, is_transfer, nodes_spanned, payload, ranks, ring_kind
from dcir.hardware import load
from dcir.passes import PassManager, parse_pipeline
from dcir.passes.hierarchical import Hierarchical
from dcir.passes.quantize import Quantize
from dcir.sim import held_bytes, runs_per_step, simulate_module
from dcir.topology import Layout, choose

from bench_compiler import generate

#: Llama-3-70B (transformers' LlamaConfig of meta-llama/Meta-Llama-3-70B)
LLAMA3_70B = {"hidden": 8192, "heads": 64, "kv_heads": 8, "intermediate": 28672, "vocab": 128256, "layers": 80}
#: Llama-3-8B (meta-llama/Meta-Llama-3-8B)
LLAMA3_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 128256, "layers": 32}
#: Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1): 8 experts a layer, each token routed to 2
MIXTRAL_8X7B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 32000, "layers": 32,
                "experts": 8, "top_k": 2}
#: DeepCompile over ZeRO-3, Llama-3-70B on 32 H100s, by gradient accumulation steps (the blog's figure)
PUBLISHED = {1: 1.18, 16: 1.28}


#: the models ``--mesh`` predicts, by name
MODELS = {"Llama-3-70B": LLAMA3_70B, "Llama-3-8B": LLAMA3_8B, "Mixtral-8x7B": MIXTRAL_8X7B}


def program(layers: int, world: int, seq: int = 1024, model: dict = LLAMA3_70B, nodes: int = 1,
            accumulate: int = 1, hpz: int = 0, quantized: str = "") -> dcir.Module:
    """The model's ZeRO-3 step (``nodes`` > 1: HSDP over ``nodes`` × ``world / nodes``,
    averaging across nodes once per optimizer step of ``accumulate`` micro-steps; ``hpz``:
    ZeRO-3 with hierarchical partitions over nodes of ``hpz`` ranks; ``quantized`` "w":
    its parameter gathers in int8, "wg": its gradient reductions too, ``quantize``)."""
    cfg = {**model, "layers": layers}
    text = generate(layers=cfg["layers"], hidden=cfg["hidden"], heads=cfg["heads"], seq=seq, batch=1,
                    world_size=world, kv_heads=cfg["kv_heads"], intermediate=cfg["intermediate"], vocab=cfg["vocab"],
                    micro_batches=1, offload=False, param_dtype="bf16", compute_dtype="bf16", nodes=nodes,
                    experts=cfg.get("experts", 0), top_k=cfg.get("top_k", 2))
    module = dcir.parse(text, "llama.dcir")
    if hpz:
        module.attrs.update({"mesh.nodes": world // hpz, "mesh.local": hpz})
        PassManager([Hierarchical()], verify_each=False).run(module)
    if quantized:
        PassManager([Quantize(gradients="g" in quantized)], verify_each=False).run(module)
    if nodes > 1 and accumulate > 1:
        once_per_step(module, Counter(), registry.REDUCES, lambda decl, grad: grad.type, "averaged once")
    return module


def plan(module: dcir.Module, machine, accumulate: int, budget: int | None) -> dcir.Module:
    """``module`` after the full pass set, planned on ``machine`` within ``budget``."""
    out = module.clone()
    opt = f"budget={budget}, " if budget else ""
    pipeline = f"prefetch{{{opt[:-2]}}},unshard{{{opt}micro_steps={accumulate}}},bucket{{{opt[:-2]}}}"
    PassManager(parse_pipeline(pipeline.replace("{}", "")), verify_each=False, context=PlanContext(machine)).run(out)
    return out


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def predict(layers: int, machine, accumulate: int, fit_layers=(2, 3, 4)) -> dict:
    """ZeRO-3 simulated at ``layers``; DCIR planned at ``fit_layers`` and extrapolated."""
    world = machine.world_size
    full = program(layers, world)
    base = simulate_module(full, machine, accumulate)
    headroom = None
    if machine.memory:
        headroom = machine.memory - base.peak_bytes  # what the passes may add at full size
    zero3, planned, exposed = [], [], []
    for n in fit_layers:
        small = program(n, world)
        small_base = simulate_module(small, machine, accumulate)
        budget = None
        if headroom is not None:
            budget = small_base.peak_bytes - held_bytes(small, accumulate) + max(headroom, 0) * n // layers
        after = simulate_module(plan(small, machine, accumulate, budget), machine, accumulate)
        zero3.append(small_base.estimate.seconds)
        planned.append(after.estimate.seconds)
        exposed.append(after.estimate.exposed_s)
    a0, b0 = _line(list(fit_layers), zero3)
    a1, b1 = _line(list(fit_layers), planned)
    a2, b2 = _line(list(fit_layers), exposed)
    zero3_fit = a0 + b0 * layers
    return {"accumulate": accumulate, "zero3_s": base.estimate.seconds, "zero3_exposed_s": base.estimate.exposed_s,
            "zero3_peak": base.peak_bytes, "dcir_s": a1 + b1 * layers, "dcir_exposed_s": a2 + b2 * layers,
            "fit_error": zero3_fit / base.estimate.seconds - 1, "ops": sum(len(f.ops) for f in full.functions.values())}


def link_bytes(module: dcir.Module, machine, accumulate: int) -> dict[str, float]:
    """Bytes one rank sends per optimizer step over collectives within its node and across
    nodes (a ring whose ranks span nodes counts as crossing them)."""
    out = {"intra": 0.0, "cross": 0.0}
    calls = runs_per_step(module, accumulate)
    for name, func in module.functions.items():
        for op in func.ops:
            if not is_transfer(op) or is_host_copy(op):
                continue
            n = ranks(op, machine)
            nodes = nodes_spanned(op, machine) or -(-n // machine.ranks_per_node)
            passes = 2 if ring_kind(op) == "all_reduce" else 1
            out["cross" if nodes > 1 else "intra"] += payload(op) * passes * (n - 1) / n * calls[name]
    return out


def build(layers: int | None, model: dict, world: int, per_node: int, accumulate: int):
    """``topology.choose``'s ``build``: ``model``'s generated step laid out each way."""
    def make(layout: Layout) -> dcir.Module:
        quantized = "wg" if layout.gradients else "w" if layout.weights else ""
        return program(layers or model["layers"], world, model=model, nodes=world // per_node if layout.hsdp else 1,
                       accumulate=accumulate, hpz=per_node if layout.hpz else 0, quantized=quantized)
    return make


def mesh_rows(layers: int | None, machine, worlds=(32, 128, 1024), accumulate=(1, 16)) -> list[tuple]:
    """(model, world, accumulation, the planner's ``Choice`` over every layout, the bytes
    each layout's rank sends in and across nodes) for each model, world and accumulation."""
    rows = []
    for model_name, model in MODELS.items():
        for world in worlds:
            for n in accumulate:
                modules, make = {}, build(layers, model, world, machine.ranks_per_node, n)
                choice = choose(lambda layout: modules.setdefault(layout.name, make(layout)),
                                replace(machine, world_size=world), n, lossy=True)
                sent = {name: link_bytes(m, replace(machine, world_size=world, mesh=tuple(m.mesh.items())), n)
                        for name, m in modules.items()}
                rows.append((model_name, world, n, choice, sent))
    return rows


def print_mesh(rows: list[tuple]) -> None:
    print(f"{'model':>12} {'ranks':>6} {'accum':>6} {'scheme':>8} {'step s':>8} {'peak GiB':>9} {'fits':>5} "
          f"{'in node GB':>11} {'across GB':>10} {'choice':>7}")
    for model, world, n, choice, sent in rows:
        for p in choice.priced:
            s = sent[p.layout.name]
            print(f"{model:>12} {world:>6} {n:>6} {p.layout.name:>8} {p.seconds:>8.3f} {p.peak / 2**30:>9.1f} "
                  f"{'yes' if p.fits else 'no':>5} {s['intra'] / 1e9:>11.1f} {s['cross'] / 1e9:>10.1f} "
                  f"{'<-' if p is choice.chosen else '':>7}")
        if choice.chosen is not None:
            print("  why: " + choice.why().splitlines()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: the model's, 80 for Llama-3-70B and 32 for Llama-3-8B)")
    ap.add_argument("--hardware", default="h100-ib400", help="a dcir/machines name or a .toml (default h100-ib400)")
    ap.add_argument("--accumulate", default="1,16", help="gradient accumulation steps to predict (default 1,16)")
    ap.add_argument("--mesh", action="store_true",
                    help="flat ZeRO-3 against HSDP, hpZ, qwZ and ZeRO++ on 32, 128 and 1,024 ranks, for Llama-3-70B, "
                         "Llama-3-8B and Mixtral-8x7B (--layers then overrides every model's layer count)")
    ns = ap.parse_args(argv)
    begin = time.perf_counter()
    machine = load(ns.hardware)
    machine = replace(machine, world_size=machine.world_size or 32)
    if ns.mesh:
        print(f"micro-batch 1, seq 1024, activation checkpointing, {machine.ranks_per_node} ranks a node of "
              f"{machine.name}; per rank and optimizer step")
        print_mesh(mesh_rows(ns.layers, machine, accumulate=[int(x) for x in ns.accumulate.split(",")]))
        print(f"({time.perf_counter() - begin:.1f} s)")
        return 0
    ns.layers = ns.layers or LLAMA3_70B["layers"]
    print(f"Llama-3-70B shapes ({ns.layers} layers), micro-batch 1, seq 1024, activation checkpointing, "
          f"{machine.world_size} ranks of {machine.name}")
    print(f"{'accumulation':>12} {'ZeRO-3 s':>9} {'exposed':>8} {'DCIR s':>8} {'exposed':>8} "
          f"{'speedup':>8} {'published':>10} {'ZeRO-3 peak GiB':>16} {'fit error':>10}")
    for n in [int(x) for x in ns.accumulate.split(",")]:
        r = predict(ns.layers, machine, n)
        speedup = r["zero3_s"] / r["dcir_s"]
        published = PUBLISHED.get(n)
        print(f"{n:>12} {r['zero3_s']:>9.3f} {r['zero3_exposed_s']:>8.3f} {r['dcir_s']:>8.3f} "
              f"{r['dcir_exposed_s']:>8.3f} {speedup:>7.2f}x {(f'{published:.2f}x' if published else 'n/a'):>10} "
              f"{r['zero3_peak'] / 2**30:>16.1f} {100 * r['fit_error']:>9.1f}%")
    print(f"({r['ops']:,} ops a micro-step at {ns.layers} layers; {time.perf_counter() - begin:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
