"""One rank of the zoo's world-2 runs (started by ``dcir_runtime.launch``).

``python zoo_worker.py MODEL OUT.json FORM...``: for each loss form of ``tests/zoo.py``
(``labels``, ``criterion``, ``aux``, ``accumulate``), trains a fresh copy of the zoo
model through the Engine (ZeRO-3) for 3 AdamW steps on this rank's part of every
global batch, with the loop a DeepSpeed user writes::

    out = engine(**inputs)            # ``labels``: engine(**inputs, labels=y), loss_fn=.loss
    loss = criterion(out.logits, y)   # the form's loss, computed outside the engine
    engine.backward(loss)
    engine.step()

Rank 0 trains the same model eagerly on one device (``zoo.eager_reference``) and writes,
per form, the worst relative difference over the parameters and every rank's buffers
(each rank updates its own BatchNorm statistics from its own part of the batch; eager
runs each part on that rank's copy), or the error that stopped the run (its type and
first line, the same on every rank: a capture error is rank 0's, sent to all). One form
failing does not stop the others.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import dcir
from zoo import FORMS, LR, ZOO, eager_reference, micro_batches, rank_slice, worst_relative


def train(z, form: str, rank: int) -> dict:
    loss_of, accumulate = FORMS[form]
    model = z.model()
    config = {"gradient_accumulation_steps": accumulate, "timeout_s": 60}
    # ``labels``: the model's own loss, picked by loss_fn (the engine then returns it);
    # the other forms compute the loss outside, from the outputs the engine returns
    engine = dcir.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), config=config,
                             loss_fn=(lambda out: out.loss) if form == "labels" else None)
    losses = []
    for batch in micro_batches(z, 2, accumulate):
        inputs, y = rank_slice(batch, rank)
        if form == "labels":
            loss = engine(**inputs, labels=y)
        else:
            loss = loss_of(engine, inputs, y)  # engine(...) returns the model's outputs
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    full = engine.full_parameters()
    buffers = [None] * engine.world  # every rank's, on rank 0
    torch.distributed.all_gather_object(buffers, {n: b.detach().clone() for n, b in engine.model.named_buffers()})
    result = {"graphs": 1, "capture_s": engine.capture_s, "losses": losses}
    if rank != 0:
        return result
    if not z.matches:
        result["worst"], result["where"] = None, ""
        result["trained"] = all(l == l for l in losses) and any(
            not torch.equal(p, full[n]) for n, p in z.model().named_parameters() if p.requires_grad)
        return result
    reference, reference_buffers = eager_reference(z, form, 2)
    result["worst"], result["where"] = worst_relative(dict(reference.named_parameters()), full)
    for r, (expected, got) in enumerate(zip(reference_buffers, buffers)):
        worst, where = worst_relative(expected, got)
        if not worst <= result["worst"]:  # NaN counts as the worst
            result["worst"], result["where"] = worst, f"rank {r}'s {where}"
    return result


def main() -> int:
    name, out_path, forms = sys.argv[1], sys.argv[2], sys.argv[3:]
    z, rank = ZOO[name], int(os.environ["RANK"])
    results = {}
    for form in forms:
        try:
            results[form] = train(z, form, rank)
        except Exception as e:  # the row records why; the next form still runs
            lines = [line.strip() for line in str(e).strip().split("\n") if line.strip()]
            results[form] = {"error": f"{type(e).__name__}: {' '.join(lines[:3])}"}
    return finish(results, out_path, rank)


def finish(results: dict, out_path: str, rank: int) -> int:
    """Rank 0 writes ``results`` to ``out_path``; every rank leaves its process group."""
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
