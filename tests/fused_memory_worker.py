"""One rank of the fused-memory test (started by ``dcir_runtime.launch``, world 2, gloo).

``python fused_memory_worker.py OUT.json PASS...``: the activation benchmark's tiny Llama
(``tests/test_bench_train.py``: one layer, hidden 64, sequence 256) trained by the Engine
with ``PASS...`` as its fixed pipeline, three steps; the third runs under torch's memory
profiler, and rank 0 writes every rank's allocator figures for it (``allocated``: the
bytes live when the step began and the most live within it) beside the memory model's
step peak of the program that ran and whether any of its functions compiles a stretch.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch._C._profiler import _ExtraFields_Allocation

import dcir
from dcir import fusion, memory
from transformers import LlamaConfig, LlamaForCausalLM

STEP = "fused_memory_worker: step"


def allocated(profiler) -> dict:
    """``{"start", "peak"}`` (bytes) of the ``STEP`` window, from the profiler's allocation
    events on this thread (every allocation and free of the step is made here)."""
    events, span, todo = [], None, list(profiler.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if isinstance(e.extra_fields, _ExtraFields_Allocation) and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.total_allocated))
        elif e.name == STEP:
            span = (e.start_time_ns, e.end_time_ns)
    events.sort()
    start = ([total for t, total in events if t < span[0]] or [0])[-1]
    return {"start": start, "peak": max([start, *(total for t, total in events if span[0] <= t <= span[1])])}


def main(out: str, passes: list[str]) -> None:
    torch.set_num_threads(1)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    profiler.__enter__()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=256,
                         attn_implementation="eager")
    engine = dcir.initialize(LlamaForCausalLM(config), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                             config={"passes": passes, "timeout_s": 120}, loss_fn=lambda o: o.loss)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(3):
        ids = torch.randint(0, 64, (1, 256), generator=g)
        with torch.profiler.record_function(STEP) if step == 2 else torch.profiler.record_function("warm-up"):
            engine.backward(engine(input_ids=ids, labels=ids))
            engine.step()
    profiler.__exit__(None, None, None)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, allocated(profiler))
    if dist.get_rank() == 0:
        module = engine.module
        with open(out, "w") as f:
            json.dump({"allocated": everyone, "step_peak": memory.step_peak(module),
                       "compiled": any(fusion.compiled(fn, module) for fn in module.functions.values())}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
