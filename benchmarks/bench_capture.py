#!/usr/bin/env python
"""Capture -> IR -> executable: how long DCIR takes to turn an HF Llama's training step
into a running program.

Phases, per model size: ``compile_to_ir`` (Dynamo + AOTAutograd + lowering to DCIR),
``verify`` (structure and schedule rules), ``lower`` (DCIR -> FX graphs), and the first
``train_step`` (running them once). The models are built from a config (no
downloads): hidden 256, 8 heads (4 key/value), intermediate 688, vocabulary 1024,
sequence 128, batch 1, fp32. Target (issue 3): 32 layers end to end <= 60 s.

``--world N`` measures the Engine's start instead, on N local ranks (gloo, one thread
each): the model built under ``torch.device("meta")``, ``dcir.initialize`` (its shards
initialized module by module), then the first training step, which captures on fake
tensors, runs ``zero3``, lowers and runs; no rank ever holds the full model. It reports
the seconds of ``initialize`` and of the first step (capture included; the slowest
rank), and each rank's peak resident memory next to the model's parameter bytes.

    python benchmarks/bench_capture.py                  # 8 and 32 layers
    python benchmarks/bench_capture.py --layers 2       # quick
    python benchmarks/bench_capture.py --layers 32 --world 2
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import dcir
from dcir_lowering.program import state_of


def llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def measure(layers: int) -> dict:
    torch.manual_seed(0)
    model = llama(layers)
    ids = torch.randint(0, 1024, (1, 128))
    batch = {"input_ids": ids, "labels": ids.clone()}
    times = {}
    t = time.perf_counter()
    module = dcir.compile_to_ir(model, (), kwargs=batch, loss_fn=lambda out: out.loss)
    times["compile_to_ir"] = time.perf_counter() - t
    t = time.perf_counter()
    dcir.verify(module)
    times["verify"] = time.perf_counter() - t
    t = time.perf_counter()
    program = dcir.lower(module, state_of(model))
    times["lower"] = time.perf_counter() - t
    t = time.perf_counter()
    program.train_step(**batch)
    times["first train_step"] = time.perf_counter() - t
    times["total"] = sum(times.values())
    return {"layers": layers, "ops": sum(1 for _ in module.ops()), **times}


def start(layers: int, out: str) -> None:
    """One rank of ``--world``: meta model, ``initialize``, first step; rank 0 writes every rank's figures."""
    import json
    import resource

    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = llama(layers)
    params_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    t = time.perf_counter()
    engine = dcir.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), config={"timeout_s": 900})
    init_s = time.perf_counter() - t
    ids = torch.randint(0, 1024, (1, 128))
    t = time.perf_counter()
    out_ = engine(input_ids=ids, labels=ids)
    engine.backward(out_.loss)
    engine.step()
    step_s = time.perf_counter() - t
    mine = torch.tensor([init_s, step_s, engine.capture_s, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])
    everyone = [torch.zeros(4) for _ in range(engine.world)]
    dist.all_gather(everyone, mine)
    if engine.rank == 0:
        with open(out, "w") as f:
            json.dump({"layers": layers, "params_mib": params_mib, "ranks": [t.tolist() for t in everyone]}, f)
    dist.destroy_process_group()


def sharded(layers: int, world: int) -> dict:
    import json
    import tempfile

    from dcir_runtime.launch import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/start.json"
        code = launch([__file__, "--layers", str(layers), "--rank-of", out], world, timeout_s=900,
                      env={"OMP_NUM_THREADS": "1"})
        if code != 0:
            raise SystemExit(f"the ranks failed (exit {code})")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--world", type=int, help="measure the Engine's start on this many local ranks instead")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)  # a rank of --world, writing its figures here
    a = ap.parse_args(argv)
    if a.rank_of:
        start(a.layers[0], a.rank_of)
        return 0
    if a.world:
        print(f"{'layers':>6} {'params':>10} {'initialize':>11} {'first step':>11} {'(capture)':>10} "
              f"{'total':>8} {'peak RSS per rank':>20}")
        for n in a.layers:
            r = sharded(n, a.world)
            init, step, cap = (max(rank[k] for rank in r["ranks"]) for k in range(3))
            rss = ", ".join(f"{rank[3]:,.0f}" for rank in r["ranks"])
            print(f"{n:>6} {r['params_mib']:>6.0f} MiB {init:>10.2f}s {step:>10.2f}s {cap:>9.2f}s "
                  f"{init + step:>7.2f}s {rss:>16} MiB")
        return 0
    print(f"{'layers':>6} {'ops':>7} {'compile_to_ir':>14} {'verify':>8} {'lower':>8} {'first step':>11} {'total':>8}")
    for n in a.layers:
        r = measure(n)
        print(f"{r['layers']:>6} {r['ops']:>7,} {r['compile_to_ir']:>13.2f}s {r['verify']:>7.2f}s {r['lower']:>7.2f}s "
              f"{r['first train_step']:>10.2f}s {r['total']:>7.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
