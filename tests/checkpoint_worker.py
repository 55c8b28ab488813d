"""One rank of a checkpoint test (started by ``dcir_runtime.launch``).

``python checkpoint_worker.py train SPEC.json``: trains a small model through the Engine
for ``micro`` micro-steps on a fixed global batch per micro-step (``GLOBAL`` rows, each
rank its slice, so any world of 1 to 4 sees the same data), optionally loading a
checkpoint first (``load``: a fresh engine, before its first call) and saving after
each micro-step in ``save_at`` (into ``save``), then, after the last save, dying by
SIGKILL (``die``: no clean shutdown) or, with ``kill_in_save``, in the middle of that
save. ``save_tag``: the tag of every save (default ``step<N>``). ``evaluate_first``:
a forward without backward before the load, so the load meets a captured program.
``train_first``: that many micro-steps on other data before the load, so the load
overwrites an engine that has trained (its parameters, optimizer state, counters and
schedule). Each rank seeds torch's generator with its rank after building the engine,
so ``mlp_dropout``'s masks differ by rank and continue only if the load restores it. With
``lr_scheduler`` the engine steps a StepLR (``initialize(..., lr_scheduler=)``). The data
generator's state travels in the checkpoint's ``client_state``. At the end each rank destroys the
process group and writes ``out`` ``.rank<r>.pt``: the full parameters, this rank's optimizer
state, the counters, the loss of every micro-step after the load (every micro-step's when
nothing is loaded), where it resumed from, and its native threads (not Python's) before the
engine and after the destroy: gloo's, if anything still held the group; also the engine's
``optimize_log`` and how many times this rank captured a step (``compiles``: none when the
program cache had it).

``python checkpoint_worker.py errors SPEC.json``: each bad load is a DcirError on every
rank, and the engine's state is unchanged afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

import dcir
from dcir_runtime import capture, checkpoint
from models import mlp, squared, tiny_llama

GLOBAL = 12  # rows per micro-step, split evenly over 1, 2, 3 or 4 ranks


def tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager", tie_word_embeddings=True))


def _mlp_batch(g):
    return (torch.randn(GLOBAL, 8, generator=g),), {}


def _llama_batch(g):
    ids = torch.randint(0, 128, (GLOBAL, 16), generator=g)
    return (), {"input_ids": ids, "labels": ids.clone()}


def mlp_dropout():
    """``mlp`` with dropout: every training step draws masks from torch's generator."""
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))


MODELS = {  # name -> (model, batch(generator), loss_fn)
    "mlp": (mlp, _mlp_batch, squared),
    "mlp_dropout": (mlp_dropout, _mlp_batch, squared),
    "llama": (tiny_llama, _llama_batch, lambda out: out.loss),
    "llama_tied": (tied_llama, _llama_batch, lambda out: out.loss),
}


def _engine(spec: dict):
    make, _, loss_fn = MODELS[spec["model"]]
    torch.manual_seed(0)
    model = make()
    schedule = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)) \
        if spec.get("lr_scheduler") else None
    return dcir.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=spec.get("lr", 1e-2)),
                           config={**spec.get("config", {}), "timeout_s": 60}, loss_fn=loss_fn,
                           lr_scheduler=schedule)


def _snapshot(engine) -> dict:
    """This rank's state: full parameters, optimizer state of its shards, counters."""
    full = {k: v.clone() for k, v in engine.full_parameters().items()}
    state = {}
    for name, shard in engine.shards.items():
        for key, v in engine.optimizer.state.get(shard, {}).items():
            state[f"{name}.{key}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    grads = {n: s.grad.clone() for n, s in engine.shards.items() if s.grad is not None}
    return {"full": full, "state": state, "shards": {n: s.detach().clone() for n, s in engine.shards.items()},
            "grads": grads, "steps": engine.steps, "micro_steps": engine.micro_steps,
            "lr": engine.optimizer.param_groups[0]["lr"], "memory": engine.memory()}


def _native_threads(at_most: int | None = None) -> int:
    """This process's threads that Python did not start (gloo's workers and its loop).
    With ``at_most``, polled for up to 5 s until there are no more than that: a thread
    that just ended can linger in /proc for a moment, a kept group's threads stay."""
    deadline = time.monotonic() + 5
    while True:
        python = {t.native_id for t in threading.enumerate()}
        n = len({int(t) for t in os.listdir("/proc/self/task")} - python)
        if at_most is None or n <= at_most or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def train(spec: dict) -> None:
    rank = int(os.environ["RANK"])
    threads_before = _native_threads()
    compiles, compile_step = [], capture.compile_step
    capture.compile_step = lambda *args, **kwargs: compiles.append(1) or compile_step(*args, **kwargs)
    engine = _engine(spec)
    torch.manual_seed(rank)  # each rank its own dropout masks
    world = engine.world
    _, batch_of, _ = MODELS[spec["model"]]
    g = torch.Generator().manual_seed(1)
    resumed = None
    if spec.get("load") and spec.get("evaluate_first"):  # as dcir-train does: the first call captures
        args, kwargs = batch_of(torch.Generator().manual_seed(7))
        rows = GLOBAL // world
        engine(*(a[:rows] for a in args), **{k: v[:rows] for k, v in kwargs.items()})
    if spec.get("load") and spec.get("train_first"):  # other data: the load must overwrite what this did
        other = torch.Generator().manual_seed(99)
        for _ in range(spec["train_first"]):
            _micro_step(engine, batch_of(other), rank)
    if spec.get("load"):
        path, client = engine.load_checkpoint(spec["load"], spec.get("tag"))
        g.set_state(client["data"])
        resumed = (path.name, engine.micro_steps)
    losses = []
    while engine.micro_steps < spec["micro"]:
        losses.append(_micro_step(engine, batch_of(g), rank))
        if spec.get("save") and engine.micro_steps in spec.get("save_at", []):
            if spec.get("kill_in_save") and engine.micro_steps == spec["save_at"][-1]:
                os.environ[checkpoint.KILL_IN_SAVE] = "1"
            engine.save_checkpoint(spec["save"], spec.get("save_tag"), client_state={"data": g.get_state()})
            if spec.get("die") and engine.micro_steps == spec["save_at"][-1]:
                os.kill(os.getpid(), signal.SIGKILL)  # every process dies hard right after the save
    snapshot = _snapshot(engine)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    threads = (threads_before, _native_threads(at_most=threads_before))
    torch.save({**snapshot, "losses": losses, "resumed": resumed, "native_threads": threads,
                "optimize_log": engine.optimize_log, "compiles": len(compiles)},
               f"{spec['out']}.rank{rank}.pt")


def _micro_step(engine, batch, rank: int) -> float:
    """One micro-step on this rank's rows of the global ``batch``; its loss."""
    args, kwargs = batch
    rows = GLOBAL // engine.world
    args = tuple(a[rank * rows:(rank + 1) * rows] for a in args)
    kwargs = {k: v[rank * rows:(rank + 1) * rows] for k, v in kwargs.items()}
    loss = engine(*args, **kwargs)
    engine.backward(loss, scale_wrt_gas=True)
    engine.step()  # and the schedule, at each optimizer step
    return loss.item()


def errors(spec: dict) -> None:
    """Each bad load: a DcirError on every rank, and the engine unchanged. Each rank
    writes ``out.rank<r>.json``: per attempt, the error (None: it loaded) and whether
    the engine is unchanged."""
    engine = _engine(spec)
    before = _snapshot(engine)
    results = []
    for attempt in spec["attempts"]:
        try:
            engine.load_checkpoint(attempt["dir"], attempt.get("tag"))
            error = None
        except dcir.DcirError as e:
            error = e.render()
        after = _snapshot(engine)
        same = all(torch.equal(before["shards"][n], after["shards"][n]) for n in before["shards"])
        same = same and before["state"].keys() == after["state"].keys() and before["steps"] == after["steps"]
        results.append({"error": error, "unchanged": same})
    Path(f"{spec['out']}.rank{engine.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[2]).read_text())
    {"train": train, "errors": errors}[sys.argv[1]](spec)
    if torch.distributed.is_initialized():  # leave the group now, not in gloo's teardown at interpreter exit
        torch.distributed.destroy_process_group()
