"""``dcir-train``: trains a small Hugging Face Llama, sharded through DCIR, on the text
of Python's own reference manual.

Run plainly, it starts ``--nproc`` local ranks (``dcir_runtime.launch``) and each of
them runs this script again as one rank; under ``torchrun`` (the environment has
``RANK``) it is one rank of a job that may span machines. The model is built from a
``LlamaConfig`` (no download) with a byte-level vocabulary; the corpus is
``pydoc_data.topics``, the reference manual's topics that ship with every Python
(about 465 kB of English), 95% for training and 5% held out. Rank 0 draws a progress
bar and ends with a summary: losses, tokens per second, the time capture took, and the
bytes each rank holds as the runtime accounts them. ``--save-every N`` checkpoints every
N optimizer steps and ``--resume DIR`` continues from the latest complete checkpoint,
data order included (docs/checkpoint.md).

The loop is the one a DeepSpeed user writes: ``out = engine(input_ids=ids)`` returns
the model's output, the next-byte loss is computed outside from ``out.logits``,
``engine.backward(loss / accumulation)`` and ``engine.step()``; the held-out loss is
taken under ``engine.eval()`` and ``torch.no_grad()`` (a forward-only program).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pydoc_data.topics import topics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dcir
from dcir.diagnostics import DcirError, Diagnostic
from dcir_runtime.checkpoint import latest
from dcir_runtime.config import Config
from dcir_runtime.engine import RankFailure
from dcir_runtime.launch import launch


def corpus() -> bytes:
    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def _args(argv):
    ap = argparse.ArgumentParser(prog="dcir-train", description=__doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--nproc", type=int, default=2, help="local ranks to start (default 2; ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    ap.add_argument("--seq", type=int, default=128, help="tokens (bytes) per sequence (default 128)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and micro-step (default 4)")
    ap.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    ap.add_argument("--config", default=None,
                    help='the Engine config: a JSON file or inline JSON, e.g. \'{"gradient_accumulation_steps": 2}\'')
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="bf16: bfloat16 compute and gathers, fp32 reduction and master weights (the config's bf16 "
                         "section); fp16: float16 with dynamic loss scaling (its fp16 section); default fp32")
    ap.add_argument("--ir", default=None, metavar="FILE", help="write the program the engine runs (DCIR text) here")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="write a Chrome trace (Perfetto) of the last step per rank here: DIR/rank<N>.json")
    ap.add_argument("--seed", type=int, default=0, help="seed of the model and the data order (default 0)")
    ap.add_argument("--save-every", type=int, default=0, metavar="N",
                    help="save a checkpoint every N optimizer steps into --checkpoint-dir (default 0: never)")
    ap.add_argument("--checkpoint-dir", default="checkpoints", metavar="DIR",
                    help="where --save-every saves (default checkpoints/)")
    ap.add_argument("--keep-last", type=int, default=None, metavar="K",
                    help="keep only the newest K complete checkpoints in --checkpoint-dir (default: every one)")
    ap.add_argument("--resume", default=None, metavar="DIR",
                    help="continue from the latest complete checkpoint in DIR, if there is one (else start fresh; "
                         "one whose files are damaged is skipped for the one before, with a warning); under torchrun "
                         "--max-restarts a restarted job finds its last save this way")
    ap.add_argument("--timeout", type=float, default=900, help="end the local run after this many seconds (900)")
    ap.add_argument("--list-breaks", action="store_true",
                    help="list where Dynamo splits the model's forward (graph breaks: file:line, reason, source) "
                         "on one batch, in this process, and exit; trains nothing")
    return ap.parse_args(argv)


def _config(text: str | None, precision: str = "fp32"):
    """``--config``: inline JSON or a file, checked (``Config.load``); ``--precision``
    adds its section (a config that has one already is an error naming both)."""

    config = Config()
    if text is not None and text.lstrip().startswith("{"):
        try:
            text = json.loads(text)
        except json.JSONDecodeError as e:
            raise DcirError(Diagnostic(f"--config:{e.lineno}:{e.colno}: not JSON: {e.msg}")) from None
    if text is not None:
        config = Config.load(text)
    if precision == "fp32":
        return config
    section = Config.load({precision: {"enabled": True}})
    return dataclasses.replace(config, **{precision: getattr(section, precision)})


def _model(ns):
    """A byte-level Llama from a ``LlamaConfig`` (no download)."""
    # the train extra's (~0.5 s to import): only the built-in model needs it, not --help or a checkpoint's check
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(ns.seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=ns.hidden, intermediate_size=ns.hidden * 3, num_hidden_layers=ns.layers,
        num_attention_heads=max(1, ns.hidden // 32), num_key_value_heads=max(1, ns.hidden // 64),
        max_position_embeddings=ns.seq, attn_implementation="eager"))


def _model_and_engine(ns):
    """The model (``_model``) in an Engine."""
    model = _model(ns)
    return dcir.initialize(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=ns.lr, weight_decay=0.01),
                           config=_config(ns.config, ns.precision))


class _Batches:
    """The corpus, 95% for training and 5% held out, cut into this rank's part of
    every global batch. One generator, the same on every rank, draws the global
    batch; a checkpoint saves its state, so a resumed run draws the same batches."""

    def __init__(self, ns, rank: int, world: int):
        self.ns, self.rank, self.world = ns, rank, world
        data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
        split = int(len(data) * 0.95)
        self.train, self.held_out = data[:split], data[split:]
        self.generator = torch.Generator().manual_seed(ns.seed)

    def __call__(self, source):
        ns = self.ns
        starts = torch.randint(0, len(source) - ns.seq, (ns.batch * self.world,), generator=self.generator)
        mine = starts[self.rank * ns.batch:(self.rank + 1) * ns.batch]
        return torch.stack([source[s:s + ns.seq] for s in mine])


def next_token_loss(logits, ids):
    """The language-modelling loss, computed outside the engine as a DeepSpeed or FSDP
    user writes it: cross-entropy of each position's logits against the next byte."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))


def _evaluate(engine, batches: _Batches) -> float:
    """The mean loss over 4 held-out batches of every rank: ``engine.eval()`` under
    ``torch.no_grad()`` runs the forward-only program."""
    engine.eval()
    with torch.no_grad():
        losses = []
        for _ in range(4):
            ids = batches(batches.held_out)
            losses.append(next_token_loss(engine(input_ids=ids).logits, ids))
    engine.train()
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    return (losses / engine.world).mean().item()


def _resume(engine, directory: str, batches: _Batches) -> None:
    """``--resume``: continue from the latest complete checkpoint in ``directory``, if any."""
    if latest(directory) is None:
        if engine.rank == 0:
            print(f"dcir-train: no complete checkpoint in {directory}; starting fresh", flush=True)
        return
    path, client = engine.load_checkpoint(directory)
    batches.generator.set_state(client["data"])  # the data order continues where it stopped
    if engine.rank == 0:
        print(f"dcir-train: resumed from {path} at step {engine.steps}", flush=True)


def _progress_bar(engine, ns):
    if engine.rank != 0:
        return None
    from tqdm import tqdm  # the train extra's: rank 0 alone draws the bar
    return tqdm(total=ns.steps, initial=engine.steps, desc=f"dcir {engine.world} ranks", unit="step",
                file=sys.stdout, dynamic_ncols=True)


def _train(engine, ns, batches: _Batches):
    """Optimizer steps up to ``ns.steps``; returns (the losses of every micro-step, the
    seconds they took, the memory after the first backward, with its gradients)."""
    accumulate = engine.config.gradient_accumulation_steps
    bar = _progress_bar(engine, ns)
    losses, t0 = [], time.perf_counter()
    memory = None
    kill_at = int(os.environ.get("DCIR_TEST_KILL_AT_STEP", 0))  # test-only, see _test_kill
    while engine.steps < ns.steps:
        done = engine.steps
        if ns.trace and engine.steps == ns.steps - 1:
            engine.trace(os.path.join(ns.trace, f"rank{engine.rank}.json"))
        for _ in range(accumulate):
            ids = batches(batches.train)
            out = engine(input_ids=ids)  # the model's output: logits (and its KV cache)
            loss = next_token_loss(out.logits, ids)
            engine.backward(loss / accumulate)
            memory = memory or engine.memory()  # with gradients, before the optimizer frees them
            engine.step()
            losses.append(loss.item())
        if bar is not None:
            tokens = len(losses) * ns.batch * ns.seq * engine.world
            bar.set_postfix(loss=f"{sum(losses[-accumulate:]) / accumulate:.3f}",
                            tok_s=f"{tokens / (time.perf_counter() - t0):,.0f}")
            bar.update(engine.steps - done)
        if engine.steps == done:
            continue  # fp16: the step was skipped (inf/NaN gradients)
        if ns.save_every and engine.steps % ns.save_every == 0:
            engine.save_checkpoint(ns.checkpoint_dir, client_state={"data": batches.generator.get_state()},
                                   keep_last=ns.keep_last)
        if engine.steps == kill_at:
            _test_kill(engine.rank)
    train_s = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return losses, train_s, memory


def _memory_of_every_rank(engine, memory) -> list:
    """Every rank's accounting: from the first backward (gradients held), with the
    optimizer state as it is at the end (none before the last step: resumed at the end)."""
    last = engine.memory()
    memory = dataclasses.replace(memory or last, optimizer_state=last.optimizer_state,
                                 optimizer_state_peak=last.optimizer_state_peak,
                                 optimizer_state_host=last.optimizer_state_host)
    everyone = [None] * engine.world
    dist.all_gather_object(everyone, memory)
    return everyone


def _report(engine, ns, losses: list[float], train_s: float, evals: tuple[float, float], everyone: list,
            total_s: float) -> None:
    """Rank 0's summary: losses, throughput, capture time and every rank's memory."""
    if not losses:
        print(f"\nnothing to train: step {engine.steps} of {ns.steps} is done")
        return
    world, accumulate = engine.world, engine.config.gradient_accumulation_steps
    ran = max(1, len(losses) // accumulate)  # optimizer steps this run (fewer after a resume)
    tokens = ran * accumulate * ns.batch * ns.seq * world
    n_params = everyone[0].full_parameters // 4  # fp32
    print(f"\nLlama {ns.layers} layers, hidden {ns.hidden}, {n_params / 1e6:.2f} M parameters; {world} ranks; "
          f"{ran} steps of {ns.batch * world * accumulate} x {ns.seq} tokens")
    print(f"loss            train {sum(losses[:accumulate]) / accumulate:.3f} -> "
          f"{sum(losses[-10:]) / len(losses[-10:]):.3f} (last 10); held out {evals[0]:.3f} -> {evals[1]:.3f}")
    print(f"final loss      {losses[-1]!r} (step {engine.steps})")
    _precision_line(engine)
    print(f"throughput      {tokens / train_s:,.0f} tokens/s ({tokens / train_s / world:,.0f} per rank), "
          f"{train_s / ran:.3f} s/step; capture + passes {engine.capture_s:.1f} s, total {total_s:.1f} s")
    _memory_table(everyone)
    if ns.ir:
        print(f"the program: {ns.ir} (dcir-opt {ns.ir} reads it)")


def _precision_line(engine) -> None:
    if not engine.precision.active:
        return
    scaled = f"; loss scale {engine.loss_scale:g}, {engine.skipped_steps} steps skipped (inf/NaN)" \
        if engine.loss_scaler is not None else ""
    print(f"precision       compute and gathers in {engine.precision.param_dtype}, gradients reduced in "
          f"{engine.precision.reduce_dtype}, master weights f32{scaled}")


def _memory_table(everyone: list) -> None:
    mib = 2**20
    print("memory per rank (the runtime's accounting, MiB; optimizer state on the device at its peak, "
          "and in host memory):")
    print(f"  {'rank':>4} {'params':>8} {'replicas':>9} {'grads':>8} {'optim':>8} {'optim host':>11} "
          f"{'gathered peak':>14} {'of full params':>15}")
    for r, m in enumerate(everyone):
        print(f"  {r:>4} {m.parameters / mib:8.2f} {m.replicas / mib:9.2f} {m.gradients / mib:8.2f} "
              f"{m.optimizer_state_peak / mib:8.2f} {m.optimizer_state_host / mib:11.2f} "
              f"{m.gathered_peak / mib:14.2f} {m.parameters / m.full_parameters:14.1%}")


def rank_main(ns) -> None:
    """One rank: capture (by a first evaluation), resume if asked, train, evaluate,
    and on rank 0 the summary."""
    engine = _model_and_engine(ns)
    batches = _Batches(ns, engine.rank, engine.world)
    begin = time.perf_counter()
    first_eval = _evaluate(engine, batches)  # the first call captures the step
    if ns.resume:
        _resume(engine, ns.resume, batches)
    losses, train_s, memory = _train(engine, ns, batches)
    last_eval = _evaluate(engine, batches)
    everyone = _memory_of_every_rank(engine, memory)
    if ns.ir and engine.rank == 0:
        with open(ns.ir, "w") as f:
            f.write(str(engine.ir()))
    if engine.rank == 0:
        _report(engine, ns, losses, train_s, (first_eval, last_eval), everyone, time.perf_counter() - begin)
    dist.destroy_process_group()


def list_breaks(ns) -> int:
    """``--list-breaks``: the graph breaks of the model's forward on one training batch
    (``dcir.graph_breaks``), as a table; exit code 0 with breaks or without."""
    batches = _Batches(ns, 0, 1)
    batch = batches(batches.train)
    found = dcir.graph_breaks(_model(ns), input_ids=batch)
    print(breaks_table(found))
    return 0


def breaks_table(found) -> str:
    """``dcir.graph_breaks``'s list as a table: location, reason, source line."""
    if not found:
        return "no graph breaks: the step is one graph"
    rows = [(b.where, b.reason, b.source) for b in found]
    width = [max(len(r[k]) for r in rows + [("file:line", "reason", "source")]) for k in range(2)]
    lines = [f"{'file:line':<{width[0]}}  {'reason':<{width[1]}}  source"]
    lines += [f"{w:<{width[0]}}  {r:<{width[1]}}  {src}" for w, r, src in rows]
    plural = "" if len(found) == 1 else "s"
    lines.append(f"{len(found)} graph break{plural}: the forward runs as {found.graphs} graph(s) "
                 "and Python between them")
    lines.append("the Engine trains each graph as a sharded region of its own and runs the Python between them "
                 "eagerly, a module Dynamo does not trace with its parameters gathered (docs/runtime.md, "
                 "\"Graph breaks: regions\")")
    return "\n".join(lines)


def _test_kill(rank: int) -> None:
    """Test-only (tests/test_checkpoint.py, the elastic test): with
    ``DCIR_TEST_KILL_AT_STEP=K`` and ``DCIR_TEST_KILL_MARKER=FILE``, rank 1 SIGKILLs itself
    after step K, once: the marker file keeps the restarted job from dying again."""
    marker = os.environ.get("DCIR_TEST_KILL_MARKER")
    if rank != 1 or not marker or os.path.exists(marker):
        return
    open(marker, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ns = _args(argv if argv is not None else sys.argv[1:])
    try:
        _config(ns.config, ns.precision)  # a bad config is reported once, before any rank starts
    except DcirError as e:
        print(e.render(), file=sys.stderr)
        return 1
    if ns.list_breaks:  # one process, no ranks
        return list_breaks(ns)
    if "RANK" not in os.environ:  # the launcher: start the ranks, each runs this again
        return launch(["-m", "dcir_runtime.train", *(argv if argv is not None else sys.argv[1:])], ns.nproc,
                      timeout_s=ns.timeout)
    try:
        rank_main(ns)
    except DcirError as e:
        print(e.render(), file=sys.stderr)
        return 1
    except RankFailure as e:
        print(f"dcir-train: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # the process group is broken: its teardown could block or abort
    return 0


if __name__ == "__main__":
    sys.exit(main())
