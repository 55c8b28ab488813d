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

Usage::

    python benchmarks/predict_at_scale.py              # 80 layers, accumulation 1 and 16
    python benchmarks/predict_at_scale.py --layers 2   # quick (tests)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import dcir
from dcir.context import PlanContext
from dcir.hardware import load
from dcir.passes import PassManager, parse_pipeline
from dcir.sim import held_bytes, simulate_module

from bench_compiler import generate

#: Llama-3-70B (transformers' LlamaConfig of meta-llama/Meta-Llama-3-70B)
LLAMA3_70B = {"hidden": 8192, "heads": 64, "kv_heads": 8, "intermediate": 28672, "vocab": 128256, "layers": 80}
#: DeepCompile over ZeRO-3, Llama-3-70B on 32 H100s, by gradient accumulation steps (the blog's figure)
PUBLISHED = {1: 1.18, 16: 1.28}


def program(layers: int, world: int, seq: int = 1024) -> dcir.Module:
    cfg = {**LLAMA3_70B, "layers": layers}
    text = generate(layers=cfg["layers"], hidden=cfg["hidden"], heads=cfg["heads"], seq=seq, batch=1,
                    world_size=world, kv_heads=cfg["kv_heads"], intermediate=cfg["intermediate"], vocab=cfg["vocab"],
                    micro_batches=1, offload=False, param_dtype="bf16", compute_dtype="bf16")
    return dcir.parse(text, "llama3-70b.dcir")


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
            budget = small_base.peak_bytes - held_bytes(small) + max(headroom, 0) * n // layers
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=80, help="decoder layers (default 80, Llama-3-70B's)")
    ap.add_argument("--hardware", default="h100-ib400", help="a dcir/machines name or a .toml (default h100-ib400)")
    ap.add_argument("--accumulate", default="1,16", help="gradient accumulation steps to predict (default 1,16)")
    ns = ap.parse_args(argv)
    begin = time.perf_counter()
    machine = load(ns.hardware)
    machine = replace(machine, world_size=machine.world_size or 32)
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
