"""One rank of the memory-cap test (started by ``dcir_runtime.launch``).

``python memory_worker.py OUT.json``: a transformers Llama whose fp32 parameters,
gradients and Adam state (16 bytes a parameter) are 600 MiB, built under
``torch.device("meta")``, initialized by the engine and trained 2 steps. Each rank
resets its peak resident memory once torch, transformers and the runtime are loaded
and the process group joined, then measures its peak after ``initialize``, after the
first forward (the capture) and at the end; rank 0 writes every rank's growth at each
point, and the model's parameter and training-state bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import dcir
from dcir_runtime import native
from dcir_runtime.group import ProcessGroup


def rss_mib() -> float:
    """This process's peak resident memory since ``reset_peak`` (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def reset_peak() -> None:
    """The peak resident memory starts again from what the process holds now (Linux's
    clear_refs 5): what happened before (the runtime's build, imports) is not counted."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> int:
    torch.set_num_threads(1)
    group = ProcessGroup.join(120, torch.device("cpu"))
    native.load()
    config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, attn_implementation="eager")
    dist.barrier()
    reset_peak()
    base = rss_mib()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    params = 4 * sum(p.numel() for p in model.parameters()) / 2**20
    engine = dcir.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), config={"timeout_s": 120})
    grown = [rss_mib() - base]
    ids = torch.randint(0, 1024, (1, 32), generator=torch.Generator().manual_seed(group.rank))
    for step in range(2):
        out = engine(input_ids=ids)
        if step == 0:
            grown.append(rss_mib() - base)
        engine.backward(torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:]))
        engine.step()
    grown.append(rss_mib() - base)
    everyone = [torch.zeros(3) for _ in range(group.world)]
    dist.all_gather(everyone, torch.tensor(grown))
    if group.rank == 0:
        Path(sys.argv[1]).write_text(json.dumps({
            "init_mib": [t[0].item() for t in everyone], "capture_mib": [t[1].item() for t in everyone],
            "grown_mib": [t[2].item() for t in everyone], "params_mib": params, "state_mib": 4 * params,
            "outbox_mib": engine.memory().transport / 2**20}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
