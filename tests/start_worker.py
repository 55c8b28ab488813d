"""One rank of the start-without-the-full-model tests (started by ``dcir_runtime.launch``).

``python start_worker.py CASE OUT.json [CHECKPOINT]``:

* ``transformer_init_fn``, ``llama``, ``llama_stream``: the model is built under
  ``torch.device("meta")`` and ``dcir.initialize`` initializes it (a ``param_init_fn``;
  transformers' own init on every rank; the same streamed from rank 0), then 5 AdamW
  steps. Rank 0 writes the worst relative difference from the same model initialized on
  one device (``to_empty``, then ``model.apply(param_init_fn)`` or
  ``initialize_weights()`` from the same seed) and trained eagerly on the ranks' batches.
* ``pretrained``: a meta-device Llama with ``pretrained=CHECKPOINT``; the first training
  forward's loss and logits against ``from_pretrained(CHECKPOINT)``'s on the same rows,
  then the parameters after 2 steps against that model trained eagerly.
* ``errors``: what cannot start is an error on every rank, printed one rank at a time.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import dcir
from dist_worker import ROWS, TinyTransformer, _add_average, _llama_batch, _rank_grads, _slice
from dist_worker import _transformer_batch
from models import tiny_llama


def init_fn(module: torch.nn.Module) -> None:
    """A user's param_init_fn: the positional table the model makes itself, then torch's defaults."""
    if isinstance(module, TinyTransformer):
        torch.nn.init.normal_(module.pos, std=0.02)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def out_loss(out):
    return out.loss


# name -> (model, batch, loss of the model's output (None: it is the loss), initialize keywords)
CASES = {
    "transformer_init_fn": (TinyTransformer, _transformer_batch, None, {"param_init_fn": init_fn}),
    "llama": (tiny_llama, _llama_batch, out_loss, {}),
    "llama_stream": (tiny_llama, _llama_batch, out_loss, {"stream_init": True}),
}


def on_one_device(make, keywords: dict) -> torch.nn.Module:
    """The reference: the same meta model, materialized on one device and initialized
    there by the model's usual means, from the same seed."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = make()
    model.to_empty(device="cpu")
    with torch.no_grad():
        if "param_init_fn" in keywords:
            model.apply(keywords["param_init_fn"])
        else:
            model.initialize_weights()
    return model


def train(engine, ref, batch_of, loss_fn, rank: int, world: int, steps: int) -> float:
    """``steps`` AdamW steps of the engine and of ``ref`` on one device; the worst relative difference."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        whole = batch_of(g, ROWS * world)
        opt.zero_grad()
        _add_average(ref, _rank_grads(ref, loss_fn, whole, world, 1))
        opt.step()
        args, kwargs = _slice(whole, rank * ROWS, (rank + 1) * ROWS)
        out = engine(*args, **kwargs)
        engine.backward(loss_fn(out) if loss_fn else out)
        engine.step()
    full = engine.full_parameters()
    return max(((p.detach() - full[n]).abs().max() / p.detach().abs().max().clamp_min(1e-12)).item()
               for n, p in ref.named_parameters(remove_duplicate=False))


def initialized(case: str, rank: int, world: int) -> dict:
    make, batch_of, loss_fn, keywords = CASES[case]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = make()
    engine = dcir.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                             config={"timeout_s": 60}, **keywords)
    on_meta = all(p.is_meta for p in model.parameters())
    ref = on_one_device(make, keywords)
    return {"worst": train(engine, ref, batch_of, loss_fn, rank, world, 5), "on_meta": on_meta}


def pretrained(path: str, rank: int, world: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    engine = dcir.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                             config={"timeout_s": 60}, pretrained=path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    whole = _llama_batch(torch.Generator().manual_seed(1), ROWS * world)
    args, kwargs = _slice(whole, rank * ROWS, (rank + 1) * ROWS)
    out, expected = engine(*args, **kwargs), ref(*args, **kwargs)
    logits = ((out.logits - expected.logits).abs().max() / expected.logits.abs().max()).item()
    loss = abs(out.loss.item() - expected.loss.item()) / expected.loss.item()
    engine.backward(out.loss)
    engine.step()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _add_average(ref, _rank_grads(ref, out_loss, whole, world, 1))
    opt.step()
    full = engine.full_parameters()
    worst = max(((p.detach() - full[n]).abs().max() / p.detach().abs().max().clamp_min(1e-12)).item()
                for n, p in ref.named_parameters(remove_duplicate=False))
    return {"logits": logits, "loss": loss, "worst": worst}


def errors(path: str) -> None:
    """The group is the worker's, so a failed ``initialize`` leaves it for the next, and
    the ranks print their errors one at a time (concurrent prints can share a line)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def in_turn(fn):
        try:
            fn()
            line = "NO ERROR"
        except dcir.DcirError as e:
            line = "ERROR: " + e.render().replace("\n", " ")
        for r in range(world):
            torch.distributed.barrier()
            if r == rank:
                print(line, flush=True)
        torch.distributed.barrier()

    adam = lambda ps: torch.optim.AdamW(ps)  # noqa: E731
    with torch.device("meta"):
        no_init = TinyTransformer()
    in_turn(lambda: dcir.initialize(no_init, adam))
    in_turn(lambda: dcir.initialize(TinyTransformer(), adam, stream_init=True))
    with torch.device("meta"):
        other = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2))
    in_turn(lambda: dcir.initialize(other, adam, pretrained=path))

    def per_rank(m):  # seeded by the rank: the ranks' values differ
        init_fn(m)
        for p in m.parameters(recurse=False):
            p.add_(rank)
    with torch.device("meta"):
        diverging = TinyTransformer()
    in_turn(lambda: dcir.initialize(diverging, adam, param_init_fn=per_rank))
    torch.distributed.destroy_process_group()


def main() -> int:
    case, out_path = sys.argv[1], sys.argv[2]
    path = sys.argv[3] if len(sys.argv) > 3 else None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if case == "errors":
        errors(path)
        return 0
    result = pretrained(path, rank, world) if case == "pretrained" else initialized(case, rank, world)
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
