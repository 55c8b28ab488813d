"""One rank of ``tests/test_custom_ops.py``'s world-2 run (started by ``dcir_runtime.launch``).

``python custom_op_worker.py OUT.json``: trains ``custom_op_lib.GatedMLP`` (a custom op
with a parameter, its backward a second custom op) through the Engine (ZeRO-3) for 3
AdamW steps on this rank's half of every batch. Rank 0 also trains it eagerly on one
device (each rank's half in rank order, the gradients summed in that order and halved,
as the runtime's reduction rounds) and writes the worst relative parameter difference
and the losses.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import dcir
from custom_op_lib import GatedMLP, batches

STEPS, ROWS, WORLD, LR = 3, 2, 2, 1e-2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GatedMLP()


def eager() -> torch.nn.Module:
    ref = model()
    params = list(ref.parameters())
    opt = torch.optim.AdamW(params, lr=LR)
    for x, y in batches(STEPS, ROWS * WORLD):
        total = None
        for r in range(WORLD):
            rows = slice(r * ROWS, (r + 1) * ROWS)
            grads = torch.autograd.grad(ref(x[rows], y[rows]), params)
            total = list(grads) if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(params, total):
            p.grad = g / WORLD
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref


def main() -> int:
    out_path, rank = sys.argv[1], int(os.environ["RANK"])
    engine = dcir.initialize(model(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), config={"timeout_s": 60})
    losses = []
    for x, y in batches(STEPS, ROWS * WORLD):
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        loss = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    full = engine.full_parameters()
    if rank == 0:
        worst, where = 0.0, ""
        for name, a in eager().named_parameters():
            err = (a - full[name].reshape(a.shape)).abs().max().item() / max(a.abs().max().item(), 1e-12)
            if not err <= worst:
                worst, where = err, name
        ops = sorted({op.name for f in engine.module.functions.values() for op in f.ops if op.family == "dcirtest"})
        Path(out_path).write_text(json.dumps({"worst": worst, "where": where, "losses": losses, "ops": ops}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
