"""One rank of a multi-process test (started by ``dcir_runtime.launch``).

``python dist_worker.py equivalence OUT.json CASE...``: trains each case through the
Engine for 5 AdamW steps on this rank's part of every global batch, while training the
same model eagerly on one device over the same micro-batches (``_eager_micro_step``):
the global batch's mean loss, summed in the order the runtime's average sums it (it
reduces in rank order, see docs/runtime.md). Against one pass over the
whole batch, float reassociation alone moves a 2-layer Llama 2e-4 (relative) in 5
AdamW steps (lr 1e-2), as AdamW turns rounding noise in small gradients into full
steps, which would hide any real difference. Rank 0 writes, per case, the largest
relative parameter difference and the runtime's memory accounting.

``python dist_worker.py faulty-rank exit|hang TIMEOUT TRANSPORT``: rank 1 dies or stalls in the
middle of the second step; the others must fail with RankFailure (exit code 17). Each rank
prints the shared-memory segments it maps (``SEGMENTS:``), for the test to check that
their names are gone from ``/dev/shm``.

``python dist_worker.py errors``: a user's mistakes, each a located message on every rank.

``python dist_worker.py initialize-fails``: the job's first initialize fails; the engine
leaves the process group it created.

``python dist_worker.py ops TRANSPORT``: each collective of the C++ runtime against its
definition, over ``shared_memory`` or the ``process_group``.

With ``DCIR_TEST_DEVICE=cuda`` in the environment, ``equivalence`` and ``ops`` run on
the GPU of the rank's ``LOCAL_RANK`` over NCCL (``tests/test_gpu.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dcir
from dcir import ops as registry
from dcir.layout import ShardLayout
from dcir_runtime import RankFailure, transport
from dcir_runtime.accounting import fixed_bytes, scheduled_bytes
from dcir_lowering.calls import flat_shard
from dcir_runtime.native import runtime_stats
from models import BreakingNet, EagerLayerNet, InPlaceNet, Tied  # graph breaks; tied, a frozen layer
from models import mlp, tiny_llama  # mlp: 16*8+16 and 4*16+4 split unevenly over 3
from models import squared as _squared


class TinyTransformer(torch.nn.Module):
    """A two-block pre-norm causal transformer (the GPT shape) with its own attention.
    No bias on q/k/v: the gradient of a key bias is zero in exact arithmetic, so its
    float value is rounding noise, which AdamW scales up to full-size steps."""

    def __init__(self, vocab=64, dim=32, heads=4, blocks=2, seq=16):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({
            "norm1": torch.nn.LayerNorm(dim), "qkv": torch.nn.Linear(dim, 3 * dim, bias=False), "proj": torch.nn.Linear(dim, dim),
            "norm2": torch.nn.LayerNorm(dim), "up": torch.nn.Linear(dim, 4 * dim), "down": torch.nn.Linear(4 * dim, dim),
        }) for _ in range(blocks))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids, targets):
        b, t = ids.shape
        x = self.embed(ids) + self.pos[:t]
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + blk["proj"](a)
            x = x + blk["down"](F.gelu(blk["up"](blk["norm2"](x))))
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def _mlp_batch(g, n):
    return (torch.randn(n, 8, generator=g),), {}


def _transformer_batch(g, n):
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return (ids, torch.roll(ids, -1, 1)), {}


def _tied_batch(g, n):
    return (torch.randint(0, 10, (n, 3), generator=g),), {}


def _llama_batch(g, n):
    ids = torch.randint(0, 128, (n, 16), generator=g)
    return (), {"input_ids": ids, "labels": ids.clone()}


# name -> (model, batch(generator, rows) -> (args, kwargs), loss_fn, Engine config)
# two cycles within STEPS steps, the second profiling the plan: so the plan is taken on the
# cost model's word (a trial takes 1 + trial_steps steps a side: tests/test_trial.py runs them)
_TWICE = {"profile_at": [1, 3], "trial_steps": 0}
CASES = {
    "mlp": (mlp, _mlp_batch, _squared, {}),
    "mlp_accumulate2": (mlp, _mlp_batch, _squared, {"gradient_accumulation_steps": 2}),
    "transformer": (TinyTransformer, _transformer_batch, None, {}),
    "transformer_inductor": (TinyTransformer, _transformer_batch, None, {"inductor": True}),
    # Inductor on a planned schedule (coalesced transfers: waits that return at once)
    "transformer_inductor_schedule": (TinyTransformer, _transformer_batch, None,
                                      {"inductor": True, "passes": ["prefetch", "unshard", "bucket"]}),
    # ... planned by the optimization cycle, priced from the compiled stretches' times
    "transformer_inductor_optimize": (TinyTransformer, _transformer_batch, None,
                                      {"inductor": True, "optimize": {"passes": ["prefetch", "unshard", "bucket"],
                                                                      **_TWICE}}),
    # which stretches run compiled, planned with the schedule (fuse): first by the machine's
    # model, then, profiled again after the plan ran, from the compiled stretches' times
    "transformer_fuse_optimize": (TinyTransformer, _transformer_batch, None,
                                  {"optimize": {"passes": ["prefetch", "unshard", "bucket", "fuse"], **_TWICE}}),
    "tied_frozen": (Tied, _tied_batch, None, {}),
    "hf_llama": (tiny_llama, _llama_batch, lambda out: out.loss, {}),
    "hf_llama_accumulate2": (tiny_llama, _llama_batch, lambda out: out.loss, {"gradient_accumulation_steps": 2}),
    # activations rebuilt in the backward: the cheap ones; every one it can (matmuls too,
    # gathers again under ZeRO-3) under the schedule passes and accumulation (two backwards)
    "hf_llama_recompute": (tiny_llama, _llama_batch, lambda out: out.loss, {"passes": ["recompute"]}),
    "hf_llama_recompute_all_schedule_accumulate2": (
        tiny_llama, _llama_batch, lambda out: out.loss,
        {"gradient_accumulation_steps": 2, "passes": ["recompute{budget=1}", "prefetch", "unshard", "bucket"]}),
    # activations handed to the backward through host memory: every one the pass can, under
    # the schedule passes and accumulation (two backwards), with optimizer state offloaded
    # beside them on the same copy lanes, after the cheap ones are recomputed
    "hf_llama_offload_activations_schedule_accumulate2": (
        tiny_llama, _llama_batch, lambda out: out.loss,
        {"gradient_accumulation_steps": 2, "offload": {"budget": "200KiB"},
         "passes": ["recompute", "offload_activations{budget=1}", "prefetch", "unshard", "bucket"]}),
    # the schedule passes, then every other buffer's free placed by liveness (the runtime drops each there)
    "hf_llama_schedule_free": (tiny_llama, _llama_batch, lambda out: out.loss,
                               {"passes": ["prefetch", "unshard", "bucket", "free"]}),
}
# the schedule passes, alone and together, as static passes after zero3
_SCHEDULE = ["prefetch", "unshard", "bucket"]
for _k in range(1, 1 << len(_SCHEDULE)):
    _chosen = [p for i, p in enumerate(_SCHEDULE) if _k >> i & 1]
    CASES["transformer_" + "_".join(_chosen)] = (TinyTransformer, _transformer_batch, None, {"passes": _chosen})
CASES.update({
    "mlp_prefetch_unshard_bucket": (mlp, _mlp_batch, _squared, {"passes": _SCHEDULE}),
    "tied_frozen_prefetch_unshard_bucket": (Tied, _tied_batch, None, {"passes": _SCHEDULE}),
    # unshard across the micro-steps of an optimizer step (micro_steps comes from the config)
    "mlp_accumulate2_unshard": (mlp, _mlp_batch, _squared, {"gradient_accumulation_steps": 2, "passes": ["unshard"]}),
    # the optimization cycle: profiled after steps 1 and 3, planned from the profile
    "hf_llama_optimize": (tiny_llama, _llama_batch, lambda out: out.loss,
                          {"optimize": {"passes": _SCHEDULE, **_TWICE}}),
    "hf_llama_accumulate2_optimize": (tiny_llama, _llama_batch, lambda out: out.loss,
                                      {"gradient_accumulation_steps": 2,
                                       "optimize": {"passes": _SCHEDULE, "profile_at": [1]}}),
    # activations handed over through host memory, and the schedule planned around their
    # copies by the optimization cycle from profiles of the program that makes them
    "hf_llama_offload_activations_optimize": (
        tiny_llama, _llama_batch, lambda out: out.loss,
        {"passes": ["offload_activations{budget=1}"], "optimize": {"passes": _SCHEDULE, "profile_at": [1, 2]}}),
    # ... within a memory budget that leaves the schedule little room
    "transformer_optimize_budget": (TinyTransformer, _transformer_batch, None,
                                    {"memory_budget": 640_000, "optimize": {"passes": _SCHEDULE, "profile_at": [1]}}),
    # ... shrunk under the planned schedule to 1 byte less than it holds: the schedule
    # passes alone may already be at their floor (the activations), recompute is not
    "transformer_optimize_shrink": (TinyTransformer, _transformer_batch, None,
                                    {"memory_budget": 640_000,
                                     "optimize": {"passes": [*_SCHEDULE, "recompute"], "profile_at": [1]}}),
    # ZeRO-1 and ZeRO-2: replicated parameters, sharded optimizer state (and gradients)
    "mlp_zero1": (mlp, _mlp_batch, _squared, {"zero_stage": 1}),
    "mlp_zero2": (mlp, _mlp_batch, _squared, {"zero_stage": 2}),
    "transformer_zero1_accumulate4": (TinyTransformer, _transformer_batch, None,
                                      {"zero_stage": 1, "gradient_accumulation_steps": 4}),
    "transformer_zero2_accumulate4": (TinyTransformer, _transformer_batch, None,
                                      {"zero_stage": 2, "gradient_accumulation_steps": 4}),
    "hf_llama_zero1_optimize": (tiny_llama, _llama_batch, lambda out: out.loss,
                                {"zero_stage": 1, "optimize": {"passes": _SCHEDULE, "profile_at": [1]}}),
    "hf_llama_zero2_accumulate4_optimize": (tiny_llama, _llama_batch, lambda out: out.loss,
                                            {"zero_stage": 2, "gradient_accumulation_steps": 4,
                                             "optimize": {"passes": _SCHEDULE, "profile_at": [1]}}),
    # ZeRO-3 with gradients summed in full across micro-steps and reduced once per optimizer
    # step (FSDP2's set_requires_gradient_sync(False)); plain, and under the cycle
    "transformer_full_accumulate4": (TinyTransformer, _transformer_batch, None,
                                     {"gradient_accumulation_steps": 4, "accumulate_gradients": "full"}),
    "hf_llama_full_accumulate2_optimize": (tiny_llama, _llama_batch, lambda out: out.loss,
                                           {"gradient_accumulation_steps": 2, "accumulate_gradients": "full",
                                            "optimize": {"passes": _SCHEDULE, "profile_at": [1]}}),
    # optimizer state over the budget: the rest lives in host memory between steps
    "mlp_offload": (mlp, _mlp_batch, _squared, {"offload": {"budget": 520}}),
    "transformer_offload_accumulate4": (TinyTransformer, _transformer_batch, None,
                                        {"gradient_accumulation_steps": 4, "offload": {"budget": "64KiB"}}),
    "hf_llama_offload_optimize": (tiny_llama, _llama_batch, lambda out: out.loss,
                                  {"offload": {"budget": "200KiB"},
                                   "optimize": {"passes": _SCHEDULE, "profile_at": [1]}}),
    "transformer_zero2_offload": (TinyTransformer, _transformer_batch, None,
                                  {"zero_stage": 2, "offload": {"budget": "64KiB"}}),
})
# the rest of a training recipe: gradient clipping by the global norm (through the config,
# DeepSpeed's way, at every ZeRO stage and with offload, or by calling
# engine.clip_grad_norm_, FSDP's) and a learning-rate schedule; max norms below the
# models' gradient norms, so every step clips
CASES.update({
    "mlp_clip": (mlp, _mlp_batch, _squared, {"gradient_clipping": 0.05}),
    "transformer_zero1_accumulate4_clip": (TinyTransformer, _transformer_batch, None,
                                           {"zero_stage": 1, "gradient_accumulation_steps": 4,
                                            "gradient_clipping": 0.1}),
    "transformer_zero2_clip": (TinyTransformer, _transformer_batch, None, {"zero_stage": 2, "gradient_clipping": 0.1}),
    "mlp_offload_clip": (mlp, _mlp_batch, _squared, {"offload": {"budget": 520}, "gradient_clipping": 0.05}),
    "transformer_clip_call": (TinyTransformer, _transformer_batch, None, {"gradient_accumulation_steps": 2}),
    "transformer_schedule": (TinyTransformer, _transformer_batch, None, {"gradient_clipping": 0.1}),
})
# over the process group (the others run over shared memory, the default on one CPU
# host): the same training, every pass's kind of collective
CASES.update({
    "hf_llama_optimize_process_group": (tiny_llama, _llama_batch, lambda out: out.loss,
                                        {"transport": "process_group",
                                         "optimize": {"passes": _SCHEDULE, **_TWICE}}),
    "transformer_prefetch_unshard_bucket_process_group": (TinyTransformer, _transformer_batch, None,
                                                          {"transport": "process_group", "passes": _SCHEDULE}),
})
# graph breaks: each region its own sharded program, the Python between them eager
for _how in ("item", "call", "print"):
    for _stage in (1, 2, 3):
        CASES[f"breaks_{_how}_zero{_stage}"] = (functools.partial(BreakingNet, _how), _mlp_batch, _squared,
                                                {"zero_stage": _stage})
CASES["breaks_item_zero1_accumulate2"] = (BreakingNet, _mlp_batch, _squared,
                                          {"zero_stage": 1, "gradient_accumulation_steps": 2})
CASES["breaks_item_full_accumulate2"] = (BreakingNet, _mlp_batch, _squared,
                                         {"gradient_accumulation_steps": 2, "accumulate_gradients": "full"})
# a layer Dynamo does not trace, run eagerly with its parameters gathered for it
for _stage in (1, 3):
    CASES[f"eager_layer_zero{_stage}"] = (EagerLayerNet, _mlp_batch, _squared, {"zero_stage": _stage})
# a graph DCIR cannot capture (it writes into its input) run eagerly, its parameters gathered
for _stage in (2, 3):
    CASES[f"inplace_eager_zero{_stage}"] = (InPlaceNet, _mlp_batch, _squared, {"zero_stage": _stage})
# ... each region planned by the optimization cycle, profiled after steps 1 and 3
for _how, _stage in (("item", 3), ("call", 2), ("call", 1)):
    CASES[f"breaks_{_how}_zero{_stage}_optimize"] = (
        functools.partial(BreakingNet, _how), _mlp_batch, _squared,
        {"zero_stage": _stage, "optimize": {"passes": ["prefetch", "unshard", "bucket"], "profile_at": [1, 3]}})
# hybrid sharding (HSDP) over 2 "nodes" × 2 (tests/test_mesh.py launches them as two torchrun
# nodes): sharded in the node, averaged across nodes once per optimizer step
_HSDP = {"mesh": {"replicate": 2, "shard": 2}}
CASES.update({
    "transformer_hsdp": (TinyTransformer, _transformer_batch, None, _HSDP),
    "transformer_hsdp_accumulate4": (TinyTransformer, _transformer_batch, None,
                                     {**_HSDP, "gradient_accumulation_steps": 4}),
    "hf_llama_hsdp_accumulate4_schedule_clip": (tiny_llama, _llama_batch, lambda out: out.loss,
                                                {**_HSDP, "gradient_accumulation_steps": 4, "passes": _SCHEDULE,
                                                 "gradient_clipping": 0.1}),
    "hf_llama_hsdp_optimize": (tiny_llama, _llama_batch, lambda out: out.loss,
                               {**_HSDP, "gradient_accumulation_steps": 2,
                                "optimize": {"passes": _SCHEDULE, "profile_at": [1]}}),
    "breaks_item_hsdp": (BreakingNet, _mlp_batch, _squared, _HSDP),
    # ZeRO++'s hierarchical partitions (hpZ): sharded over all 4, gathered within the node in the backward
    "transformer_hpz_accumulate4": (TinyTransformer, _transformer_batch, None,
                                    {"zero_hpz_partition_size": 2, "gradient_accumulation_steps": 4}),
    "hf_llama_hpz_schedule": (tiny_llama, _llama_batch, lambda out: out.loss,
                              {"zero_hpz_partition_size": 2, "passes": _SCHEDULE}),
    # the planner's choice on the H100 description (dcir.topology): hpZ, 1.12x ZeRO-3's predicted step
    "transformer_hpz_auto_accumulate4": (TinyTransformer, _transformer_batch, None,
                                         {"zero_hpz_partition_size": "auto", "machine": "h100-ib400",
                                          "gradient_accumulation_steps": 4}),
    # FSDP2's way to ask for it: initialize(mesh=init_device_mesh(..., (2, 2))), no mesh in the config
    "transformer_hsdp_device_mesh": (TinyTransformer, _transformer_batch, None,
                                     {**_HSDP, "gradient_accumulation_steps": 2}),
})
#: cases given their mesh as a DeviceMesh (replicate, shard) instead of in the config
DEVICE_MESH = {"transformer_hsdp_device_mesh"}
CASES.update({
    "transformer_groups_schedule": (TinyTransformer, _transformer_batch, None, {}),
    "transformer_zero1_groups_schedule": (TinyTransformer, _transformer_batch, None, {"zero_stage": 1}),
    "tied_frozen_optimizer_instance": (Tied, _tied_batch, None, {}),
})


def _decay_groups(named) -> torch.optim.Optimizer:
    """Parameter groups chosen by name: no weight decay (and half the lr) on biases and norms."""
    named = list(named)
    plain = [(n, p) for n, p in named if n.endswith("bias") or "norm" in n]
    return torch.optim.AdamW([{"params": [(n, p) for n, p in named if (n, p) not in plain], "weight_decay": 0.1},
                              {"params": plain, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2)


#: cases whose optimizer is not the plain AdamW: a factory of named parameters, used for
#: the engine (on its shards) and for the reference (on its parameters) alike
OPTIMIZERS = {"transformer_groups_schedule": _decay_groups, "transformer_zero1_groups_schedule": _decay_groups}
#: cases given an optimizer built on the model's own parameters (DeepSpeed's way)
INSTANCES = {"tied_frozen_optimizer_instance": lambda m: torch.optim.AdamW(
    [{"params": [p for n, p in m.named_parameters() if "bias" not in n], "weight_decay": 0.1},
     {"params": [p for n, p in m.named_parameters() if "bias" in n], "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)}
#: cases whose loop calls engine.clip_grad_norm_(max_norm) before the last micro-step's engine.step()
CALL_CLIP = {"transformer_clip_call": 0.1}
#: cases trained with a learning-rate schedule: initialize(..., lr_scheduler=) and the reference's own
def _warmup_decay(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3) * 0.5 ** max(0, step - 2))


SCHEDULERS = {"transformer_schedule": _warmup_decay, "transformer_groups_schedule": _warmup_decay,
              "transformer_zero1_groups_schedule": _warmup_decay}
# after this many optimizer steps the case's memory budget shrinks to one byte under what
# the rank holds (memory changes under a planned schedule: the engine must profile again
# and plan within less)
SHRINK = {"transformer_optimize_shrink": 3}

ROWS = 2  # per rank and micro-step
STEPS = 5


def device() -> torch.device:
    """This rank's device: ``$DCIR_TEST_DEVICE`` (cpu, or cuda: the GPU of LOCAL_RANK)."""
    if os.environ.get("DCIR_TEST_DEVICE", "cpu") != "cuda":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _on(batch, where: torch.device):
    args, kwargs = batch
    return tuple(a.to(where) for a in args), {k: v.to(where) for k, v in kwargs.items()}


def _slice(batch, lo, hi):
    args, kwargs = batch
    return tuple(a[lo:hi] for a in args), {k: v[lo:hi] for k, v in kwargs.items()}


def _loss(model, loss_fn, batch):
    args, kwargs = batch
    out = model(*args, **kwargs)
    return loss_fn(out) if loss_fn else out


def _rank_grads(model, loss_fn, whole, world: int, accumulate: int) -> list[list[torch.Tensor]]:
    """One device, the ranks' micro-batches one after another: each rank's gradients,
    the loss seeded with 1/accumulate."""
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for r in range(world):
        loss = _loss(model, loss_fn, _slice(whole, r * ROWS, (r + 1) * ROWS))
        grads = torch.autograd.grad(loss, params, torch.full_like(loss, 1 / accumulate), allow_unused=True)
        out.append([torch.zeros_like(p) if gr is None else gr for p, gr in zip(params, grads)])
    return out


def _average(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The ranks' gradients summed in rank order, divided by the ranks (as the runtime's
    average rounds)."""
    out = []
    for k in range(len(per_rank[0])):
        t = per_rank[0][k]
        for r in range(1, len(per_rank)):
            t = t + per_rank[r][k]
        out.append(t / len(per_rank))
    return out


def _add_average(model, per_rank: list[list[torch.Tensor]]) -> None:
    """The ranks' (or nodes') gradients averaged (``_average``), added to ``.grad``."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p, t in zip(params, _average(per_rank)):
        p.grad = t if p.grad is None else p.grad + t


def _eager_micro_step(model, loss_fn, whole, world: int, accumulate: int, local: list | None,
                      shard: int | None = None) -> None:
    """One micro-step on one device. Gradients are averaged across ranks on every
    micro-step, or, with ``local`` (ZeRO-1 under accumulation, and ZeRO-3 accumulating in
    full gradients, which reduce once per optimizer step), summed per rank into ``local`` and averaged at the boundary by the
    caller; under HSDP (``shard`` ranks a node) each node's ranks are averaged first (the
    reduce-scatter in the node) and ``local`` sums per node. All orders are the same sum;
    computing the reference in the order the program adds keeps the comparison bit for
    bit (AdamW turns a last-bit difference in a near-zero gradient into a visible one:
    5e-5 of a weight's scale at world 3)."""
    per_rank = _rank_grads(model, loss_fn, whole, world, accumulate)
    if shard:
        per_rank = [_average(per_rank[n:n + shard]) for n in range(0, world, shard)]
    if local is None:
        _add_average(model, per_rank)
    elif not local:
        local.extend(per_rank)
    else:
        local[:] = [[a + g for a, g in zip(acc, gs)] for acc, gs in zip(local, per_rank)]


ENGINES = []  # every case's engine stays alive: engines must not disturb each other


def run_case(name: str, rank: int, world: int) -> dict:
    make, batch_of, loss_fn, config = CASES[name]
    accumulate = config.get("gradient_accumulation_steps", 1)
    where = device()
    torch.manual_seed(0)
    ref = make().to(where)
    model = copy.deepcopy(ref)
    make_opt = OPTIMIZERS.get(name, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    optimizer = INSTANCES[name](model) if name in INSTANCES else make_opt
    mesh = None
    if name in DEVICE_MESH:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", tuple(config["mesh"].values()), mesh_dim_names=("replicate", "shard"))
    given = {k: v for k, v in config.items() if not (mesh is not None and k == "mesh")}
    engine = dcir.initialize(model, optimizer=optimizer, config={**given, "timeout_s": 60}, loss_fn=loss_fn,
                             lr_scheduler=SCHEDULERS.get(name), mesh=mesh)
    ENGINES.append(engine)
    fallbacks = runtime_stats().shm_fallbacks
    opt = INSTANCES[name](ref) if name in INSTANCES else make_opt(ref.named_parameters())
    schedule = SCHEDULERS[name](opt) if name in SCHEDULERS else None
    clip = config.get("gradient_clipping") or CALL_CLIP.get(name)
    norms, ref_norms, lrs = [], [], []
    g = torch.Generator().manual_seed(1)
    memory = None
    shard = config["mesh"]["shard"] if "mesh" in config else None
    reduce_once = ((config.get("zero_stage") == 1 or config.get("accumulate_gradients") == "full") and accumulate > 1
                   or shard)
    traffic = []  # under a mesh: each micro-step's collectives and bytes, by mesh dimension
    for _ in range(STEPS):
        opt.zero_grad()
        local = [] if reduce_once else None
        for micro in range(accumulate):
            whole = _on(batch_of(g, ROWS * world), where)
            _eager_micro_step(ref, loss_fn, whole, world, accumulate, local, shard)
            before = engine.process_group.traffic()
            args, kwargs = _slice(whole, rank * ROWS, (rank + 1) * ROWS)
            loss = engine(*args, **kwargs)
            engine.backward(loss, scale_wrt_gas=True)  # DeepSpeed: divided by the accumulation
            if name in CALL_CLIP and micro == accumulate - 1:
                norms.append(engine.clip_grad_norm_(CALL_CLIP[name]).item())
            engine.step()
            if shard or "zero_hpz_partition_size" in config:
                traffic.append({dim: {k: n - before[dim][k] for k, n in counts.items()}
                                for dim, counts in engine.process_group.traffic().items()})
        if "gradient_clipping" in config:
            norms.append(engine.last_grad_norm.item())
        if name in SHRINK and engine.steps == SHRINK[name]:
            m = engine.memory()
            held = fixed_bytes(m) + scheduled_bytes(m)
            engine.config = dataclasses.replace(engine.config, memory_budget=held - 1)
        memory = memory or engine.memory()
        if local:
            _add_average(ref, local)
        if clip:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        opt.step()
        if schedule is not None:
            schedule.step()
        lrs.append((engine.get_lr(), [group["lr"] for group in opt.param_groups]))
    full = engine.full_parameters()
    worst, where = 0.0, ""
    for n, p in ref.named_parameters(remove_duplicate=False):
        a, b = p.detach(), full[n]
        err = ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
        if err > worst:
            worst, where = err, n
    last = engine.memory()
    state = {k: last[k] for k in ("optimizer_state", "optimizer_state_peak", "optimizer_state_host")}
    ir_text = str(engine.ir())
    norm_err = max((abs(a - b) / b for a, b in zip(norms, ref_norms)), default=None)
    return {"max_rel_err": worst, "worst_param": where, "memory": {**memory, **state},
            "grad_norm_rel_err": norm_err, "clipped": bool(clip) and all(n > clip for n in ref_norms),
            "norms": [norms, ref_norms], "lrs": lrs,
            "groups": [[g.get("param_names"), g["weight_decay"]] for g in engine.optimizer.param_groups],
            "full_optimizer_state": 2 * sum(p.numel() * 4 for p in ref.parameters() if p.requires_grad),
            "ir": ir_text if rank == 0 else "", "optimize": engine.optimize_log, "config": config,
            "profiled": str(engine.profiled_ir()) if rank == 0 and engine.profiled_ir() is not None else "",
            "outbox": engine.transport_bytes, "shm_fallbacks": runtime_stats().shm_fallbacks - fallbacks,
            "traffic": traffic, "accumulate": accumulate}


def equivalence(out: str, cases: list[str]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {name: run_case(name, rank, world) for name in cases}
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))


def faulty_rank(how: str, timeout_s: float, transport: str) -> None:
    """Rank 1 dies (``exit``) or stalls (``hang``) between forward and backward of the
    second step; the others must raise RankFailure, which exits 17 here."""
    rank = int(os.environ["RANK"])
    if how == "hang":  # the user's own group, with a long timeout: the runtime bounds the wait itself
        torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    engine = dcir.initialize(mlp(), config={"timeout_s": timeout_s, "transport": transport}, loss_fn=_squared)
    x = torch.randn(2, 8)
    try:
        for step in range(3):
            loss = engine(x)
            if step == 1 and rank == 1:
                print_segments()
                if how == "exit":
                    print(f"rank 1 exits at {time.time():.6f}", flush=True)
                    os._exit(3)  # without a word to the others
                time.sleep(600)
            engine.backward(loss)
            engine.step()
    except RankFailure as e:
        print(f"RankFailure: {e}", file=sys.stderr, flush=True)
        print(f"rank {rank} failed at {time.time():.6f}", flush=True)
        print_segments()
        os._exit(17)  # the process group is broken: skip its teardown


def diverging_branch() -> None:
    """Rank 0's activations take the ``.item()`` branch that runs a layer of its own, the
    others' do not: their collectives differ. Every rank must say so (printed as 'ERROR: ...')
    within the timeout, and the elapsed seconds."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    engine = dcir.initialize(BreakingNet("item", extra=True), config={"timeout_s": 20}, loss_fn=_squared)
    x = torch.randn(2, 8) * (10.0 if rank == 0 else 0.0)  # rank 0: large activations; the others: the biases'
    begin = time.perf_counter()
    attempt(lambda: engine.backward(engine(x)))
    print(f"rank {rank} answered in {time.perf_counter() - begin:.1f} s", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def print_segments() -> None:
    """``SEGMENTS:`` and the runtime's shared-memory outboxes this process maps, by the
    names they were created with (``/proc/self/maps``)."""
    names = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[5:]
        if path and path[0].startswith("/dev/shm/dcir-"):
            names.add(path[0].removesuffix(" (deleted)"))
    # one write, so that the ranks' lines on their shared stdout cannot interleave mid-line
    sys.stdout.write(" ".join(["SEGMENTS:", *sorted(names)]) + "\n")
    sys.stdout.flush()


def attempt(fn) -> None:
    """Run ``fn``; print its DcirError as 'ERROR: ...' (one line), or 'NO ERROR'."""
    try:
        fn()
    except dcir.DcirError as e:
        print("ERROR:", e.render().replace("\n", " "), flush=True)
    else:
        print("NO ERROR", flush=True)


class _Detached(torch.nn.Module):
    """A model whose output needs no gradient: rank 0 cannot capture a training step."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).detach().mean()


def user_errors() -> None:
    """Each mistake is a DcirError with its message on every rank; printed as 'ERROR: ...'."""
    engine = dcir.initialize(_Detached(), config={"timeout_s": 30})
    attempt(lambda: engine(torch.randn(2, 4)))  # rank 0 cannot capture; everyone hears of it
    engine = dcir.initialize(mlp(), config={"timeout_s": 30, "max_programs": 1}, loss_fn=_squared)
    engine.backward(engine(torch.randn(2, 8)))
    engine.step()
    attempt(lambda: engine(torch.randn(3, 8)))  # a second shape, beyond max_programs
    misuse()
    engine = dcir.initialize(mlp(), config={"timeout_s": 30, "memory_budget": "1KiB"}, loss_fn=_squared)

    def step():
        engine.backward(engine(torch.randn(2, 8)))
        engine.step()
    attempt(step)
    attempt(lambda: dcir.initialize(mlp(), config="/nonexistent/dcir.json"))
    engine = dcir.initialize(mlp(), config={"timeout_s": 30, "gradient_accumulation_steps": 2}, loss_fn=_squared)
    engine.backward(engine(torch.randn(2, 8)))
    attempt(lambda: engine.clip_grad_norm_(1.0))  # the first of two micro-steps: half a step's gradients
    engine.step()
    loss = engine(torch.randn(2, 8))
    attempt(lambda: engine.backward(torch.ones((), requires_grad=True)))  # not from the engine's output
    attempt(lambda: engine.backward(loss.expand(2)))  # not a scalar
    engine.backward(loss / 2)  # computed from the output: backpropagated as given
    engine.step()
    model = mlp()
    built = torch.optim.lr_scheduler.StepLR(torch.optim.AdamW(model.parameters()), 1)
    attempt(lambda: dcir.initialize(model, config={"timeout_s": 30}, lr_scheduler=built))
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    stepped.step()
    attempt(lambda: dcir.initialize(model, optimizer=stepped, config={"timeout_s": 30}))
    other = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    attempt(lambda: dcir.initialize(mlp(), config={"timeout_s": 30},
                                    lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(other, 1)))
    stranger = torch.optim.AdamW([*mlp().parameters()][:1])
    attempt(lambda: dcir.initialize(mlp(), optimizer=stranger, config={"timeout_s": 30}))
    # an initialize that failed after joining the group leaves the peers' last broadcast
    # in flight; leaving the group at interpreter exit then can abort gloo's threads
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def misuse() -> None:
    """Misusing the step protocol is an error that changes nothing: the engine trains on
    afterwards as if the mistake had not been made."""
    torch.manual_seed(0)
    engine = dcir.initialize(mlp(), config={"timeout_s": 30})
    attempt(engine.step)  # step without backward
    attempt(lambda: engine.backward(torch.ones((), requires_grad=True)))  # backward before any forward
    x = torch.randn(2, 8)
    out = engine(x)
    attempt(lambda: engine(x))  # a second forward before the first one's backward
    attempt(engine.step)  # step before backward
    loss = out.pow(2).mean()
    loss.backward(retain_graph=True)  # a plain backward runs the engine's too
    attempt(loss.backward)  # the same graph again
    attempt(lambda: engine.backward(out.pow(2).mean()))  # backward twice
    attempt(lambda: engine(x))  # a forward before the step
    engine.step()
    torch.manual_seed(0)
    clean = dcir.initialize(mlp(), config={"timeout_s": 30})  # the same step without the mistakes
    clean.backward(clean(x).pow(2).mean())
    clean.step()
    mine, theirs = engine.full_parameters(), clean.full_parameters()
    same = all(torch.equal(mine[n], theirs[n]) for n in theirs)
    for r in range(engine.world):  # one rank at a time: the ranks finish the collective together
        if r == engine.rank:
            print(f"MISUSE CHANGED NOTHING: {same}", flush=True)
        torch.distributed.barrier()


def initialize_fails() -> None:
    """The job's first initialize fails after joining the group (the optimizer has
    stepped): the engine leaves the group it created, so the error ends the process
    cleanly rather than gloo's teardown at exit."""
    model = mlp()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    stepped.step()
    try:
        dcir.initialize(model, optimizer=stepped, config={"timeout_s": 30})
    except dcir.DcirError as e:
        print("ERROR:", e.render().replace("\n", " "), flush=True)
    assert not torch.distributed.is_initialized(), "the failed initialize left its process group behind"
    print("left the group", flush=True)


def native_ops(transport: str) -> None:
    """The collectives against their definition, on a tensor that splits unevenly, over
    ``transport`` (the Engine's config key)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = device()
    engine = dcir.initialize(mlp().to(where), config={"transport": transport})  # joins the group, loads the runtime
    d, g = torch.ops.dcir, engine.group
    assert d.shm_active(g) == (transport != "process_group"), (transport, engine.transport_bytes)
    full = torch.arange(10.0, device=where).reshape(2, 5)
    shard = flat_shard(full, rank, world)
    assert torch.equal(d.wait(d.all_gather(shard, [2, 5], g, "t")), full)
    a, b = d.all_gather_coalesced([shard, shard * 2], [2, 5, 10], [2, 1], g, "t")
    d.wait(b)
    d.wait(a)
    assert torch.equal(a, full) and torch.equal(b, full.reshape(-1) * 2)
    # shards of different dtypes (int8 weights and f32 scales) travel as their own bytes
    sent = torch.ops.dcir.group_stats(g)[1]
    a, b = d.all_gather_coalesced([shard.to(torch.int8), shard * 0.5], [2, 5, 10], [2, 1], g, "t")
    d.wait(b)
    d.wait(a)
    assert a.dtype == torch.int8 and torch.equal(a, full.to(torch.int8)) and torch.equal(b, full.reshape(-1) * 0.5)
    assert torch.ops.dcir.group_stats(g)[1] - sent == shard.numel() * 5, "a mixed-dtype gather was promoted"
    ranks_sum = sum(range(1, world + 1))
    grad = full * (rank + 1)
    assert torch.equal(d.wait(d.reduce_scatter(grad, "avg", g, "t")), flat_shard(full * ranks_sum / world, rank, world))
    assert torch.equal(d.wait(d.reduce_scatter(grad, "max", g, "t")), flat_shard(full * world, rank, world))
    s1, s2 = d.reduce_scatter_coalesced([grad, grad[0]], "sum", g, "t")
    d.wait(s2)
    d.wait(s1)
    assert torch.equal(s1, flat_shard(full * ranks_sum, rank, world))
    assert torch.equal(s2, flat_shard(full[0] * ranks_sum, rank, world))
    assert torch.equal(d.wait(d.all_reduce(grad, "avg", g, "t")), full * ranks_sum / world)
    # all_to_all: row p goes to rank p; row r of the result is what rank r sent (int8 rows, as qgZ sends)
    rows = (torch.arange(world * 3, device=where).reshape(world, 3) + 10 * rank).to(torch.int8)
    got = d.wait(d.all_to_all(rows, g, "t"))
    sent = [(torch.arange(world * 3, device=where).reshape(world, 3) + 10 * r).to(torch.int8)[rank] for r in range(world)]
    assert got.dtype == torch.int8 and torch.equal(got, torch.stack(sent)), (got, sent)
    assert torch.equal(d.wait(d.all_to_all(rows.float()[:, :1], g, "t")), torch.stack(sent).float()[:, :1])
    before = runtime_stats()
    x = d.wait(d.all_gather(shard, [2, 5], g, "t"))
    # the gathered buffer, accounted
    assert runtime_stats().gathered_now - before.gathered_now == ShardLayout(10, world).padded * 4
    d.free(x)
    assert x.untyped_storage().nbytes() == 0 and runtime_stats().gathered_now == before.gathered_now
    # one dropped without a free (released at its last use) is not counted once it is gone
    d.reset_peak()
    blockers = []  # each takes the address the dropped buffer had, so the next gather's is new
    for _ in range(3):
        y = d.wait(d.all_gather(shard, [2, 5], g, "t"))
        del y
        _until_released(before.gathered_now)
        blockers.append(torch.empty(ShardLayout(10, world).padded, device=where))
    assert runtime_stats().gathered_peak - before.gathered_now == ShardLayout(10, world).padded * 4
    _layouts_agree(d, g, rank, world, where)
    _many_in_flight(d, g, rank, world, engine.transport_bytes, where)
    _streamed(engine, d, g, rank, world, where)
    try:
        d.reduce_scatter(grad, "mean", g, "t")
    except RuntimeError as e:
        assert "unknown reduction 'mean'" in str(e)
    else:
        raise AssertionError("an unknown reduction started")
    print_segments()
    print(f"rank {rank}: ops ok", flush=True)


def _until_released(gathered: int, limit_s: float = 10.0) -> None:
    """Waits until the runtime counts ``gathered`` bytes of gathered buffers again: a
    transport may hold a finished transfer's output a moment after ``wait`` returns
    (gloo's worker thread drops its work after marking it done), and the buffer is gone
    only then."""
    deadline = time.monotonic() + limit_s
    while runtime_stats().gathered_now != gathered:
        assert time.monotonic() < deadline, f"a dropped gathered buffer still counted after {limit_s} s"
        time.sleep(0.001)


def _layouts_agree(d, g, rank: int, world: int, where: torch.device) -> None:
    """The runtime's collectives put each rank's elements where ``ShardLayout`` says (the
    rule the C++ ``chunk_of`` follows): fewer elements than ranks, multiples of the
    world, uneven sizes."""
    ranks_sum = sum(range(1, world + 1))
    for numel in sorted({n for n in (1, world - 1, world, world + 1, 2 * world, 7, 10, 11) if n > 0}):
        full = torch.arange(1.0, numel + 1, device=where)
        layout = ShardLayout(numel, world)
        start, stop = layout.range_of(rank)
        mine = torch.zeros(layout.chunk, device=where)  # this rank's elements, then padding
        mine[:stop - start] = full[start:stop]
        assert torch.equal(d.wait(d.reduce_scatter(full * (rank + 1), "sum", g, "t")), mine * ranks_sum), numel
        gathered = d.wait(d.all_gather(mine, [numel], g, "t"))
        assert torch.equal(gathered, full), numel
        d.free(gathered)


def _many_in_flight(d, g, rank: int, world: int, outbox: int, where: torch.device) -> None:
    """More transfers in flight than the shared-memory outbox holds, and one larger than
    all of it, waited out of order: the ones that do not fit go over the process group
    (every rank decides alike), and every value is right."""
    fallbacks = runtime_stats().shm_fallbacks
    n = max(outbox // 4 // 6, 1024)  # elements per shard: 6 of them fill the outbox
    shards = [torch.full((n,), float(rank * 100 + i), device=where) for i in range(8)]
    shards.append(torch.full((outbox // 4 + 1,), -1.0 - rank, device=where))
    gathers = [d.all_gather(s, [s.numel() * world], g, "t") for s in shards]
    grads = [torch.arange(world * 1000.0, device=where) * (rank + 1) + i for i in range(6)]
    reduced = [d.reduce_scatter(x, "sum", g, "t") for x in grads]
    for i, t in reversed(list(enumerate(gathers))):
        d.wait(t)
        rows = t.view(world, -1)
        want = [-1.0 - r if i == 8 else float(r * 100 + i) for r in range(world)]
        assert all(bool((rows[r] == want[r]).all()) for r in range(world)), (i, rows[:, 0])
    ranks_sum = sum(range(1, world + 1))
    for i, t in enumerate(reduced):
        whole = torch.arange(world * 1000.0, device=where) * ranks_sum + i * world
        assert torch.equal(d.wait(t), whole[rank * 1000:(rank + 1) * 1000]), i
    for t in gathers:
        d.free(t)
    assert (runtime_stats().shm_fallbacks > fallbacks) == (outbox > 0), "the outbox's overflow was not counted"


def _streamed(engine, d, g, rank: int, world: int, where: torch.device) -> None:
    """Transfers larger than ``STREAM_ABOVE`` stream through an outbox of one part and a
    small transfer: every kind, with parts that split a coalesced gather's shards and a
    last part shorter than the rest, while a small gather is in flight and waited after.
    Every value is right, and none went over the process group when the outbox has room."""
    if engine.transport_bytes:
        engine.transport_bytes = transport.resize(engine.process_group, "auto", engine.transport_bytes,
                                                  transport.STREAM_PART + (64 << 10))
    fallbacks = runtime_stats().shm_fallbacks
    n = transport.STREAM_ABOVE // 4 + 12345  # f32 elements per shard: 3 parts, the last short
    small = d.all_gather(torch.full((1000,), float(rank), device=where), [1000 * world], g, "t")
    shard = torch.arange(n, dtype=torch.float32, device=where) + rank * n
    everything = torch.arange(n * world, dtype=torch.float32, device=where)
    assert torch.equal(d.wait(d.all_gather(shard, [n * world], g, "t")), everything)
    codes = (torch.arange(n + 7, device=where) % 100 + rank).to(torch.int8)
    a, b = d.all_gather_coalesced([codes, shard], [(n + 7) * world, n * world], [1, 1], g, "t")
    d.wait(b)
    want = torch.cat([(torch.arange(n + 7, device=where) % 100 + r).to(torch.int8) for r in range(world)])
    assert torch.equal(a, want) and torch.equal(b, everything)
    grad = everything % 1000 * (rank + 1)
    ranks_sum = sum(range(1, world + 1))
    whole = everything % 1000 * ranks_sum
    assert torch.equal(d.wait(d.reduce_scatter(grad, "sum", g, "t")), whole[rank * n:(rank + 1) * n])
    s1, s2 = d.reduce_scatter_coalesced([grad, grad[:3]], "avg", g, "t")
    d.wait(s1)
    assert torch.equal(s1, whole[rank * n:(rank + 1) * n] / world), "a streamed coalesced reduce-scatter"
    rows = (torch.arange(world * n, device=where).reshape(world, n) + rank).to(torch.int32)
    sent = [(torch.arange(world * n, device=where).reshape(world, n) + r).to(torch.int32)[rank] for r in range(world)]
    assert torch.equal(d.wait(d.all_to_all(rows, g, "t")), torch.stack(sent))
    assert torch.equal(d.wait(small).view(world, -1)[:, 0], torch.arange(world, dtype=torch.float32, device=where))
    assert runtime_stats().shm_fallbacks == fallbacks, "a stream went over the process group with room for a part"


def _gather_bytes(module) -> int:
    """Bytes this rank hands to the gathers of one micro-step's forward and backward."""
    return sum(v.type.nbytes for name in ("forward", "backward") for op in module.functions[name].ops
               if registry.has_trait(op, registry.GATHERS) for v in op.operands)


def _train_quantized(config: dict, steps: int, rank: int, world: int) -> dict:
    """A Llama trained ``steps`` AdamW steps under ``config`` (over the process group
    unless it says otherwise), from the seed every run starts from, on the same batches:
    the ranks' mean loss of each micro-step, the bytes this rank sent per step (either
    transport counts them), the bytes its gathers moved per micro-step (from the
    program), and the final parameters' checksum."""
    torch.manual_seed(0)
    engine = dcir.initialize(tiny_llama(), lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                             config={"timeout_s": 60, "transport": "process_group", **config},
                             loss_fn=lambda o: o.loss)
    ENGINES.append(engine)
    micro = config.get("gradient_accumulation_steps", 1)
    g, losses = torch.Generator().manual_seed(1), []
    before = engine.process_group.traffic()["world"]["bytes"]
    for _ in range(steps * micro):
        args, kwargs = _slice(_llama_batch(g, ROWS * world), rank * ROWS, (rank + 1) * ROWS)
        loss = engine(*args, **kwargs)
        engine.backward(loss)
        engine.step()
        losses.append(torch.tensor(loss.item()).reshape(1).clone())
    sent = (engine.process_group.traffic()["world"]["bytes"] - before) / steps
    mean = [torch.distributed.all_reduce(x) or x.item() / world for x in losses]
    module = engine.ir()
    backward_gathers = sum(1 for op in module.role("backward").ops if registry.has_trait(op, registry.GATHERS))
    return {"losses": mean, "bytes_per_step": sent, "gather_bytes": _gather_bytes(module),
            "shm": engine.transport_bytes > 0, "backward_gathers": backward_gathers,
            "unshard": module.role("unshard") is not None,
            "checksum": sum(float(t.double().sum()) for t in engine.full_parameters().values())}


def quantized(out: str, steps: int) -> None:
    """The Llama of ``_train_quantized`` trained in ZeRO-3 fp32, with int8 parameter
    gathers (``zero_quantized_weights``), and with int8 gathers and gradient reductions
    (also ``zero_quantized_gradients``, over shared memory, with the schedule passes);
    then int8 gathers with the schedule passes over the process group, and under 2
    micro-steps without and with ``unshard`` (copies gathered once a step). Rank 0 writes
    each run's figures."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    int8, scheduled = {"zero_quantized_weights": True}, {"passes": ["prefetch", "unshard", "bucket"]}
    both = {**int8, **scheduled, "zero_quantized_gradients": True, "transport": "auto"}
    accumulate = {**int8, "gradient_accumulation_steps": 2}
    runs = {name: _train_quantized(config, steps, rank, world) for name, config in (
        ("fp32", {}), ("int8", int8), ("int8_grads", both), ("int8_scheduled", {**int8, **scheduled}),
        ("int8_accumulate2", accumulate), ("int8_accumulate2_unshard", {**accumulate, "passes": ["unshard"]}))}
    if rank == 0:
        Path(out).write_text(json.dumps(runs, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # gloo's threads must not outlive the interpreter

if __name__ == "__main__":
    if sys.argv[1] == "equivalence":
        equivalence(sys.argv[2], sys.argv[3:])
    elif sys.argv[1] == "quantized":
        quantized(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "faulty-rank":
        faulty_rank(sys.argv[2], float(sys.argv[3]), sys.argv[4])
    elif sys.argv[1] == "errors":
        user_errors()
    elif sys.argv[1] == "diverging-branch":
        diverging_branch()
    elif sys.argv[1] == "initialize-fails":
        initialize_fails()
    elif sys.argv[1] == "ops":
        native_ops(sys.argv[2])
