"""One rank of the shape tests (started by ``dcir_runtime.launch``).

``python shapes_worker.py CASE OUT.json``: trains ``tiny_llama`` through the Engine
(ZeRO-3, world 2) for 4 AdamW steps with the loss computed outside, on batches whose
shapes change (``CASE``), then evaluates under ``engine.eval()`` and ``torch.no_grad()``.
Rank 0 trains the same model eagerly on one device, each rank's rows in rank order with
the gradients averaged in that order (as the runtime reduces), and writes the worst
relative parameter difference, the worst logits difference of the evaluation, and the
programs the engine kept.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import dcir
from models import tiny_llama

WORLD = 2
#: case -> per step, each rank's (rows, sequence length)
CASES = {
    "last_batch": [[(2, 8), (2, 8)], [(2, 8), (2, 8)], [(2, 8), (2, 8)], [(1, 8), (1, 8)]],
    "uneven_ranks": [[(3, 8), (1, 8)], [(3, 8), (1, 8)], [(2, 8), (2, 8)], [(3, 8), (1, 8)]],
    "sequence_lengths": [[(2, 8), (2, 8)], [(2, 6), (2, 6)], [(2, 8), (2, 8)], [(2, 5), (2, 7)]],
}


def criterion(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def batches(case: str):
    g = torch.Generator().manual_seed(7)
    for step in CASES[case]:
        yield [torch.randint(0, 128, shape, generator=g) for shape in step]


def reference(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_llama().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    for per_rank in batches(case):
        total = None
        for ids in per_rank:
            grads = torch.autograd.grad(criterion(model(input_ids=ids).logits, ids), params, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(params, total):
            p.grad = g / WORLD
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def main() -> int:
    case, out_path = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    engine = dcir.initialize(tiny_llama().train(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                             config={"timeout_s": 60})
    for per_rank in batches(case):
        ids = per_rank[rank]
        out = engine(input_ids=ids)
        engine.backward(criterion(out.logits, ids))
        engine.step()
    full = engine.full_parameters()
    probe = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=probe).logits
    roles = sorted(sorted(f.role for f in m.functions.values()) for m in engine.programs.modules())
    if rank == 0:
        ref = reference(case)
        worst = max(((full[n] - p).abs().max() / p.abs().max().clamp_min(1e-12)).item()
                    for n, p in ref.named_parameters())
        ref.eval()
        with torch.no_grad():
            expected = ref(input_ids=probe).logits
        Path(out_path).write_text(json.dumps({
            "worst": worst, "eval": ((logits - expected).abs().max() / expected.abs().max()).item(),
            "programs": len(engine.programs), "roles": roles}))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
