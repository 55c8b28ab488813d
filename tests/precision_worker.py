"""One rank of a mixed-precision test (started by ``dcir_runtime.launch``, world 2).

``python precision_worker.py CASE OUT.json [DIR]``; rank 0 writes what it measured:

* ``reference``: ``param_dtype=bf16, reduce_dtype=fp32`` (also through DeepSpeed's
  ``bf16`` section, at ZeRO-2, with offload, with the optimization cycle; the MLP and
  a transformer) for 5 AdamW steps against a single-device reference that does what
  the policy says, written out here: per rank's micro-batch, the fp32 master parameters
  cast to bf16, the input cast to bf16, the bf16 gradients cast to fp32 and averaged in
  rank order, the optimizer on the fp32 masters. The largest relative difference of the
  master parameters.
* ``fsdp2``: DCIR and FSDP2 (``fully_shard`` with ``MixedPrecisionPolicy(bf16, fp32)``,
  CPU, gloo) train the same model on the same micro-batches for 20 steps, and DCIR in
  fp32 beside them (how far the policy's rounding moves things); the three loss
  trajectories, and the largest relative difference of each DCIR run's full parameters
  from FSDP2's after the 20 steps.
* ``overflow``: fp16 with dynamic loss scaling; the second step's input overflows fp16
  on one rank. That step must be skipped on every rank, the scale halved, the weights
  unchanged, the learning-rate schedule where it was; the next step trains; a
  checkpoint (to DIR) keeps the scaler's state.
* ``bytes``: the runtime's count of bytes sent by a forward (its all_gathers only) in
  fp32 and in bf16.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import dcir
from dist_worker import TinyTransformer
from models import mlp, squared

ROWS = 4  # rows of each rank's micro-batch
BF16 = {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}


def _batches(world: int, steps: int):
    """The global batch of every step, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS * world, 8, generator=g) for _ in range(steps)]


def _mine(whole, rank: int):
    """This rank's rows of a tensor, or of each tensor of a tuple."""
    if isinstance(whole, tuple):
        return tuple(t[rank * ROWS:(rank + 1) * ROWS] for t in whole)
    return whole[rank * ROWS:(rank + 1) * ROWS]


def _floats_to(args: tuple, dtype) -> tuple:
    return tuple(a.to(dtype) if a.is_floating_point() else a for a in args)


def _reference_step(ref: torch.nn.Module, opt, loss_fn, micro: list, world: int, dtype=torch.bfloat16) -> None:
    """What ``dtype`` compute with fp32 masters and fp32 reduction means, on one device,
    for one optimizer step over the global batches ``micro`` (several: accumulation, with
    each rank's fp32 gradients summed over its micro-steps before the ranks are, as
    ``zero1`` does)."""
    names = [n for n, _ in ref.named_parameters()]
    per_rank = [None] * world
    for whole in micro:
        for r in range(world):
            low = {n: p.detach().to(dtype).requires_grad_() for n, p in ref.named_parameters()}
            out = torch.func.functional_call(ref, low, _floats_to(_mine(whole, r), dtype))
            loss = loss_fn(out) if loss_fn else out
            grads = torch.autograd.grad(loss, [low[n] for n in names], torch.full_like(loss, 1 / len(micro)))
            mine = [g.float() for g in grads]
            per_rank[r] = mine if per_rank[r] is None else [a + g for a, g in zip(per_rank[r], mine)]
    for k, p in enumerate(ref.parameters()):
        total = per_rank[0][k]
        for r in range(1, world):
            total = total + per_rank[r][k]  # the runtime's reduce-scatter sums in rank order
        p.grad = total / world
    opt.step()
    opt.zero_grad()


#: the policy through FSDP2's and DeepSpeed's names, at ZeRO-3, ZeRO-2, with optimizer-state offload, and
#: with the optimization cycle's schedule passes (planned after step 1's profile); the MLP, and a transformer
#: (embedding, LayerNorm, attention, cross-entropy in bf16) at ZeRO-3, also with the schedule passes from the
#: first step (the bf16 weights kept from forward to backward, gathers coalesced; under accumulation, gathered
#: once a step into bf16 copies); ZeRO-1 under accumulation, and ZeRO-3 summing full gradients across micro-steps
CONFIGS = {"mixed_precision": BF16, "bf16": {"bf16": {"enabled": True}}, "zero2": {**BF16, "zero_stage": 2},
           "offload": {**BF16, "offload": {"budget": 512}},
           "optimized": {**BF16, "optimize": {"passes": ["prefetch", "unshard", "bucket"], "profile_at": [1]}},
           "transformer": BF16, "zero1_accumulate2": {**BF16, "zero_stage": 1, "gradient_accumulation_steps": 2},
           "transformer_scheduled": {**BF16, "passes": ["prefetch", "unshard", "bucket"]},
           "transformer_accumulate2_scheduled": {**BF16, "passes": ["prefetch", "unshard", "bucket"],
                                                 "gradient_accumulation_steps": 2},
           "full_accumulate2": {**BF16, "gradient_accumulation_steps": 2, "accumulate_gradients": "full"}}


def _model(name: str, n: int):
    """(model, ``n`` global batches, loss_fn) of a case."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if name.startswith("transformer"):
        ids = [torch.randint(0, 64, (ROWS * 2, 16), generator=g) for _ in range(n)]
        return TinyTransformer(), [(i, torch.roll(i, -1, 1)) for i in ids], None
    return mlp(), [(x,) for x in _batches(2, n)], squared


def _collectives(module: dcir.Module) -> dict:
    """How many of each collective the program runs, per function."""
    counts: dict = {}
    for name, func in module.functions.items():
        for op in func.ops:
            if op.name.startswith("comm.") and op.name != "comm.wait":
                counts.setdefault(name, {}).setdefault(op.name, 0)
                counts[name][op.name] += 1
    return counts


def reference(rank: int, world: int) -> dict:
    out = {}
    for name, config in CONFIGS.items():
        accumulate = config.get("gradient_accumulation_steps", 1)
        ref, batches, loss_fn = _model(name, 5 * accumulate)
        engine = dcir.initialize(copy.deepcopy(ref), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                 {**config, "timeout_s": 60}, loss_fn=loss_fn)
        ref32 = copy.deepcopy(ref)  # no casts: how far the policy's rounding moves the weights
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt32 = torch.optim.AdamW(ref32.parameters(), lr=1e-2)
        for step in range(5):
            micro = batches[step * accumulate:(step + 1) * accumulate]
            for whole in micro:
                loss = engine(*_mine(whole, rank))
                engine.backward(loss, scale_wrt_gas=True)
                engine.step()
            _reference_step(ref, opt, loss_fn, micro, world)
            _reference_step(ref32, opt32, loss_fn, micro, world, torch.float32)
        full = engine.full_parameters()

        def rel(model):
            return max(((p.detach() - full[n]).abs().max() / p.detach().abs().max()).item()
                       for n, p in model.named_parameters())
        drift = max(((p.detach() - p.detach().to(torch.bfloat16).float()).abs().max()).item()
                    for p in ref.parameters())
        out[name] = {"max_rel_err": rel(ref), "fp32_rel_err": rel(ref32), "loss_dtype": str(loss.dtype),
                     "host_state": engine.memory()["optimizer_state_host"], "replans": len(engine.optimize_log),
                     "master_not_bf16": drift > 0, "collectives": _collectives(engine.module),
                     "shard_dtypes": sorted({str(s.dtype) for s in engine.shards.values()}),
                     "state_dtypes": sorted({str(t.dtype) for st in engine.optimizer.state.values()
                                             for t in st.values() if t.dim() > 0})}
    return out


def _fsdp2_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 4))


def fsdp2(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    theirs = _fsdp2_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in theirs:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(theirs, mp_policy=policy)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    engines = {"bf16": dcir.initialize(_fsdp2_model(), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                       {**BF16, "timeout_s": 60}, loss_fn=squared),
               "fp32": dcir.initialize(_fsdp2_model(), lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                       {"timeout_s": 60}, loss_fn=squared)}
    losses = {"bf16": [], "fp32": [], "fsdp2": []}
    for whole in _batches(world, 20):
        x = _mine(whole, rank)
        mine = []
        for engine in engines.values():
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            mine.append(loss.float().item())
        their_loss = squared(theirs(x))
        their_loss.backward()
        their_opt.step()
        their_opt.zero_grad()
        both = torch.tensor([*mine, their_loss.float().item()], dtype=torch.float64)
        dist.all_reduce(both)  # the global batch's mean loss
        for name, value in zip(losses, both.tolist()):
            losses[name].append(value / world)
    reference = {n: p.full_tensor().detach() for n, p in theirs.named_parameters()}

    def rel(full):
        return max(((full[n] - p).abs().max() / p.abs().max()).item() for n, p in reference.items())
    return {"loss": losses, "param_rel_err": {name: rel(e.full_parameters()) for name, e in engines.items()}}


def _fp16_run(rank: int, world: int, extra: dict):
    """An fp16 engine (initial scale 256, hysteresis 1, a schedule that halves the
    learning rate at every step) over 3 steps whose second overflows on rank 1; what
    each step did, and the engine."""
    torch.manual_seed(0)
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, "timeout_s": 60, **extra}
    engine = dcir.initialize(mlp(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), fp16, loss_fn=squared,
                             lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    record = {"scales": [engine.loss_scale], "took": [], "changed": [], "finite": [],
              "lrs": [engine.optimizer.param_groups[0]["lr"]]}
    for step, whole in enumerate(_batches(world, 3)):
        x = _mine(whole, rank)
        if step == 1 and rank == 1:
            x = x * 1e6  # beyond fp16's range (65504): inf on this rank only
        before = engine.full_parameters()
        loss = engine(x)
        engine.backward(loss)
        record["took"].append(engine.step())
        after = engine.full_parameters()
        record["scales"].append(engine.loss_scale)
        record["lrs"].append(engine.optimizer.param_groups[0]["lr"])
        record["changed"].append(any(not torch.equal(before[n], after[n]) for n in before))
        record["finite"].append(all(torch.isfinite(t).all().item() for t in after.values()))
    record["skipped_steps"], record["steps"] = engine.skipped_steps, engine.steps
    record["schedule_steps"] = engine.lr_scheduler.last_epoch
    return record, engine


def overflow(rank: int, world: int, ckpt_dir: str) -> dict:
    record, engine = _fp16_run(rank, world, {})
    engine.save_checkpoint(ckpt_dir, tag="t")
    fresh = dcir.initialize(mlp(), lambda ps: torch.optim.AdamW(ps, lr=1e-2), engine.config, loss_fn=squared)
    fresh.load_checkpoint(ckpt_dir, tag="t")
    record["scaler_saved"] = engine.loss_scaler.state_dict()
    record["scaler_loaded"] = fresh.loss_scaler.state_dict()
    # with optimizer state offloaded, the skipped step leaves the state where it was too
    offloaded, other = _fp16_run(rank, world, {"offload": {"budget": 512}})
    ours, theirs = engine.full_parameters(), other.full_parameters()
    record["offload"] = {**offloaded, "host_state": other.memory()["optimizer_state_host"],
                         "max_diff": max((ours[n] - theirs[n]).abs().max().item() for n in ours)}
    return record


def sent_bytes(rank: int, world: int) -> dict:
    out = {}
    for name, config in (("f32", {}), ("bf16", BF16)):
        torch.manual_seed(0)
        engine = dcir.initialize(mlp(), lambda ps: torch.optim.SGD(ps, lr=0.1), {**config, "timeout_s": 60},
                                 loss_fn=squared)
        whole = _batches(world, 1)[0]
        for _ in range(2):  # the first call captures
            before = engine.memory()["sent"]
            loss = engine(_mine(whole, rank))
            forward = engine.memory()["sent"] - before
            engine.backward(loss)
            engine.step()
        out[name] = {"forward_sent": forward, "ir": str(engine.ir()) if rank == 0 else ""}
    return out


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    case, out_file = sys.argv[1], sys.argv[2]
    if case == "reference":
        result = reference(rank, world)
    elif case == "fsdp2":
        result = fsdp2(rank, world)
    elif case == "overflow":
        result = overflow(rank, world, sys.argv[3])
    elif case == "bytes":
        result = sent_bytes(rank, world)
    else:
        raise SystemExit(f"unknown case {case!r}")
    if rank == 0:
        Path(out_file).write_text(json.dumps(result))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip the teardown of the process group and of the runtime's threads: not under test
