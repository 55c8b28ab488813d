"""bf16 against FSDP2's and DDP's: the yardstick for DcirTrainer's bf16 (docs/integrations.md).

    python benchmarks/bf16_parity.py          # world 2, about a minute on 2 cores

The stock Trainer cannot run FSDP on a machine without a GPU (accelerate trains DDP
instead, silently), so this measures the same thing in a plain loop: the Llama, data,
optimizer groups, schedule, accumulation and clipping of ``docs/examples/trainer_dcir.py``,
30 optimizer steps at world 2, trained four ways: DDP in fp32, DDP under
``torch.autocast(bfloat16)``, FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`` on every decoder layer and the root, and DCIR's Engine with
``{"bf16": {"enabled": True}}``. It prints each one's largest per-step difference of
the mean loss, relative, from the others.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SYSTEMS = ("ddp-fp32", "ddp-bf16", "fsdp2-bf16", "dcir-bf16")
STEPS, ACCUMULATE, PER_RANK = 30, 2, 2


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _sequence(i: int) -> torch.Tensor:
    """The example's corpus: an arithmetic progression modulo 512 per seed."""
    start, stride = torch.randint(0, 512, (2,), generator=torch.Generator().manual_seed(i))
    return (start + stride * torch.arange(32)) % 512


def _groups(model) -> list[dict]:
    """The Trainer's weight-decay groups: none on norms and biases."""
    plain = lambda n: "norm" in n or "bias" in n  # noqa: E731
    return [{"params": [p for n, p in model.named_parameters() if not plain(n)], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if plain(n)], "weight_decay": 0.0}]


def _wrapped(system: str, model):
    """The model as ``system`` trains it, and the optimizer it steps."""
    import torch.distributed as dist

    if system == "dcir-bf16":
        import dcir

        engine = dcir.initialize(model, optimizer=torch.optim.AdamW(_groups(model), lr=3e-3),
                                 config={"gradient_accumulation_steps": ACCUMULATE, "bf16": {"enabled": True}})
        return engine, engine.optimizer
    if system == "fsdp2-bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.AdamW(_groups(model), lr=3e-3)
    assert dist.is_initialized()
    return torch.nn.parallel.DistributedDataParallel(model), torch.optim.AdamW(_groups(model), lr=3e-3)


def rank_main(system: str, out: str) -> None:
    """One rank of ``system``: 30 optimizer steps; rank 0 writes the mean losses."""
    import torch.distributed as dist
    from transformers import get_scheduler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    net, optimizer = _wrapped(system, model)
    schedule = get_scheduler("cosine", optimizer, num_warmup_steps=5, num_training_steps=STEPS)
    order = torch.randperm(240, generator=torch.Generator().manual_seed(0)).tolist()
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for micro in range(ACCUMULATE):
            first = (step * ACCUMULATE + micro) * PER_RANK * world + rank * PER_RANK
            ids = torch.stack([_sequence(i) for i in order[first:first + PER_RANK]])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=system == "ddp-bf16"):
                loss = net(input_ids=ids, labels=ids).loss
            total += loss.detach() / ACCUMULATE
            if system == "dcir-bf16":
                net.backward(loss / ACCUMULATE)
                if micro == ACCUMULATE - 1:
                    net.clip_grad_norm_(1.0)
                net.step()
            else:
                (loss / ACCUMULATE).backward()
        if system != "dcir-bf16":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        schedule.step()
        dist.all_reduce(total)
        losses.append((total / world).item())
    if rank == 0:
        Path(out).write_text(json.dumps(losses))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bf16_parity.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", nargs=2, metavar=("SYSTEM", "OUT"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.rank:
        rank_main(*ns.rank)
        return 0
    work = Path(tempfile.mkdtemp(prefix="dcir-bf16-"))
    losses = {}
    for system in SYSTEMS:
        out = work / f"{system}.json"
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              __file__, "--rank", system, str(out)], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        if run.returncode != 0:
            print(f"{system} failed:\n{run.stderr[-3000:]}", file=sys.stderr)
            return 1
        losses[system] = json.loads(out.read_text())
    worst = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(losses[a], losses[b]))  # noqa: E731
    print(f"{'largest relative difference of a step loss':<44}" + "".join(f"{s:>13}" for s in SYSTEMS))
    for a in SYSTEMS:
        print(f"{a:<44}" + "".join(f"{worst(a, b):>13.2e}" for b in SYSTEMS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
