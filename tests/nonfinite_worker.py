"""One rank of the inf/NaN test (started by ``dcir_runtime.launch``, world 2, gloo).

``python nonfinite_worker.py OUT.json``; rank 0 writes every rank's record of three runs
of the 2-layer MLP (AdamW, a schedule that halves the learning rate at every step):

* ``error``: the config's default, ``nonfinite`` ``"error"``, with 2 micro-steps per
  optimizer step; rank 1's loss of the second micro-step of the second step is
  multiplied by NaN. ``engine.step()`` must raise the same message on every rank and
  leave the parameters, the optimizer state, the step count and the schedule as they
  were; the third step trains.
* ``skip``: ``nonfinite`` ``"skip"``, one micro-step per step, rank 1's second loss
  NaN: that step is skipped on every rank, and the parameters end equal, bit for bit,
  to those of a run that never saw the second batch.
* ``poisoned``: rank 1's shard of ``2.weight`` holds a NaN before the first step: the
  error names the parameter, and both ranks' NaN losses.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import dcir
from models import mlp, squared

ROWS = 4  # rows of each rank's micro-batch


def _batches(world: int, n: int) -> list[torch.Tensor]:
    """Every micro-step's global batch, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS * world, 8, generator=g) for _ in range(n)]


def _engine(config: dict):
    torch.manual_seed(0)
    return dcir.initialize(mlp(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), {"timeout_s": 30, **config},
                           loss_fn=squared,
                           lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))


def _micro_step(engine, x, poison: bool) -> bool:
    loss = engine(x)
    engine.backward(loss * float("nan") if poison else loss)
    return engine.step()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _state(engine) -> dict:
    """The optimizer state, flat: "parameter index.key" -> a copy of the tensor."""
    state = engine.optimizer.state.values()
    return {f"{i}.{k}": torch.as_tensor(v).clone() for i, s in enumerate(state) for k, v in s.items()}


def error_run(rank: int, world: int) -> dict:
    engine = _engine({"gradient_accumulation_steps": 2})
    batches = _batches(world, 6)
    record = {"took": [], "message": None}
    for step in range(3):
        before, state, lr = engine.full_parameters(), _state(engine), engine.get_lr()
        for micro in range(2):
            x = batches[2 * step + micro][rank * ROWS:(rank + 1) * ROWS]
            try:
                record["took"].append(_micro_step(engine, x, step == 1 and micro == 1 and rank == 1))
            except dcir.DcirError as e:
                record["message"] = e.render()
                record["took"].append("raised")
        if step == 1:
            record["unchanged"] = {"parameters": _same(before, engine.full_parameters()),
                                   "optimizer_state": _same(state, _state(engine)), "lr": engine.get_lr() == lr,
                                   "steps": engine.steps,
                                   "grads": all(s.grad is None for s in engine.shards.values())}
    record["steps"], record["schedule_steps"] = engine.steps, engine.lr_scheduler.last_epoch
    return record


def skip_run(rank: int, world: int) -> dict:
    engine = _engine({"nonfinite": "skip"})
    record = {"took": [], "changed": []}
    for step, whole in enumerate(_batches(world, 3)):
        before = engine.full_parameters()
        record["took"].append(_micro_step(engine, whole[rank * ROWS:(rank + 1) * ROWS], step == 1 and rank == 1))
        record["changed"].append(not _same(before, engine.full_parameters()))
    record["skipped_steps"], record["steps"] = engine.skipped_steps, engine.steps
    record["schedule_steps"], record["lr"] = engine.lr_scheduler.last_epoch, engine.get_lr()
    never = _engine({})  # the same run without the second batch
    for step, whole in enumerate(_batches(world, 3)):
        if step != 1:
            _micro_step(never, whole[rank * ROWS:(rank + 1) * ROWS], False)
    record["equals_a_run_without_that_batch"] = _same(engine.full_parameters(), never.full_parameters())
    return record


def poisoned_run(rank: int, world: int) -> dict:
    engine = _engine({"nonfinite": "error"})
    if rank == 1:
        with torch.no_grad():
            engine.shards["2.weight"][0] = float("nan")
    begin = time.perf_counter()
    try:
        _micro_step(engine, _batches(world, 1)[0][rank * ROWS:(rank + 1) * ROWS], False)
    except dcir.DcirError as e:
        return {"message": e.render(), "seconds": time.perf_counter() - begin}
    return {"message": None}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {"error": error_run(rank, world), "skip": skip_run(rank, world), "poisoned": poisoned_run(rank, world)}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps(every))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the teardown of the process group and of the runtime's threads: not under test
