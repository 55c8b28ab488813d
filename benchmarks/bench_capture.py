#!/usr/bin/env python
"""Capture -> IR -> executable: how long DCIR takes to turn an HF Llama's training step
into a running program.

Phases, per model size: ``compile_to_ir`` (Dynamo + AOTAutograd + lowering to DCIR),
``verify`` (structure and schedule rules), ``lower`` (DCIR -> FX graphs), and the first
``train_step`` (running them once). The models are built from a config (no
downloads): hidden 256, 8 heads (4 key/value), intermediate 688, vocabulary 1024,
sequence 128, batch 1, fp32. Target (issue 3): 32 layers end to end <= 60 s.

    python benchmarks/bench_capture.py                  # 8 and 32 layers
    python benchmarks/bench_capture.py --layers 2       # quick
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import dcir  # noqa: E402
from dcir_lowering.backend import state_of  # noqa: E402


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    a = ap.parse_args(argv)
    print(f"{'layers':>6} {'ops':>7} {'compile_to_ir':>14} {'verify':>8} {'lower':>8} {'first step':>11} {'total':>8}")
    for n in a.layers:
        r = measure(n)
        print(f"{r['layers']:>6} {r['ops']:>7,} {r['compile_to_ir']:>13.2f}s {r['verify']:>7.2f}s {r['lower']:>7.2f}s "
              f"{r['first train_step']:>10.2f}s {r['total']:>7.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
