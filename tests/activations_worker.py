"""One rank of the activation-checkpointing runs at world 2 (started by ``dcir_runtime.launch``).

``python activations_worker.py OUT.json CASE...``: each case of ``CASES`` (a model that
checkpoints its activations itself) trains through the Engine (ZeRO-3) for 3 AdamW
steps with the loss computed outside, exactly as ``zoo_worker.train`` trains a zoo
model; rank 0 trains it eagerly on one device with the same checkpointing
(``zoo.eager_reference``: each rank's part from that rank's generator, so dropout draws
the same masks) and writes, per case, the worst relative parameter difference and how
many ops of the program are marked recompute. The case ``budget`` (``budgeted``) trains
under a memory budget instead.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import dcir
from dcir.activations import RECOMPUTE
from dcir_runtime.accounting import fixed_bytes, scheduled_bytes
from models import Checkpointed, checkpointed_llama, tiny_llama
from zoo import ZOO, ZooModel
from zoo_worker import finish, train

_tokens = ZOO["llama"].batch

#: name -> a model that checkpoints its own activations, each with dropout inside the
#: checkpointed region (``random``: compared under the same generator states)
CASES = {z.name: z for z in [
    ZooModel("llama_checkpointing", "gradient_checkpointing_enable(), non-reentrant",
             lambda: checkpointed_llama(reentrant=False), _tokens, random=True),
    ZooModel("llama_checkpointing_reentrant", "gradient_checkpointing_enable(use_reentrant=True)",
             lambda: checkpointed_llama(reentrant=True), _tokens, random=True),
    ZooModel("checkpoint_in_model", "torch.utils.checkpoint.checkpoint in the model's forward",
             Checkpointed, _tokens, random=True),
    ZooModel("selective_checkpointing", "create_selective_checkpoint_contexts: matmuls saved",
             lambda: Checkpointed(selective=True), _tokens, random=True),
]}


def _held(config: dict, rank: int, steps: int = 4):
    """A tiny Llama (sequence 64) trained ``steps`` AdamW steps through the Engine, the loss
    outside; the engine, and after each step the most any rank held (fixed and scheduled)."""
    torch.manual_seed(0)
    engine = dcir.initialize(tiny_llama(), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), config=config)
    g = torch.Generator().manual_seed(rank)
    held = []
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 64), generator=g)
        out = engine(input_ids=ids)
        engine.backward(torch.nn.functional.cross_entropy(out.logits.reshape(-1, 128), ids.reshape(-1)))
        engine.step()
        m = engine.memory()
        most = torch.tensor([fixed_bytes(m), scheduled_bytes(m), fixed_bytes(m) + scheduled_bytes(m)])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        held.append(most.tolist())
    return engine, held


def budgeted(rank: int) -> dict:
    """Without a budget, then with ``memory_budget`` at what the ranks hold whatever the
    schedule plus 60% of the step's own memory, ``recompute`` in the cycle: what each
    step held, whether the parameters came out equal, how many ops run again."""
    free, held = _held({}, rank)
    fixed, own, _ = held[-1]
    budget = int(fixed + 0.6 * own)
    engine, planned = _held({"memory_budget": budget,
                             "optimize": {"passes": ["recompute", "prefetch"], "profile_at": [1]}}, rank)
    a, b = free.full_parameters(), engine.full_parameters()
    return {"budget": budget, "free": [h[2] for h in held], "held": [h[2] for h in planned],
            "equal": all(torch.equal(a[k], b[k]) for k in a), "log": [c["reason"] for c in engine.optimize_log],
            "recomputed": sum(RECOMPUTE in op.attrs for _, op in engine.ir().ops())}


def main() -> int:
    out_path, names = sys.argv[1], sys.argv[2:]
    rank = int(os.environ["RANK"])
    return finish({name: budgeted(rank) if name == "budget" else train(CASES[name], "criterion", rank)
                   for name in names}, out_path, rank)


if __name__ == "__main__":
    sys.exit(main())
