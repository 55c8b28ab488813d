#!/usr/bin/env python
"""One process, no communication: is a captured training step as fast as eager autograd?

The same HF Llama (from a config, fp32; default 4 layers, hidden 256, 4 heads, MLP 1024,
vocabulary 4096, sequence 1024, batch 4: compute-bound), the same batch, the loss
computed outside the model (``cross_entropy`` of the next token), AdamW, trained by:

* ``eager``: the model as it is (autograd);
* ``aot_eager``: ``torch.compile(backend="aot_eager")``: Dynamo and AOTAutograd's graphs,
  run as they are (the capture DCIR starts from, without DCIR);
* ``dcir``: ``torch.compile(backend="dcir")``: the same graphs through DCIR and back;
* ``inductor`` (``--with-inductor``): ``torch.compile()``, the compiled floor.

Each system runs in its own process (so each peak RSS is its own), ``--rounds`` times,
interleaved (eager, aot_eager, dcir, eager, ...): drift of the machine hits all alike.
A run times ``--steps`` steps after ``--warmup`` (the first compiles); a system's figure is
the median over all its measured steps, and "x eager" is eager's median over its, from
the same invocation (above 1: faster than eager). Peak RSS is the process's high-water
mark (``ru_maxrss``), its largest over the rounds. "loss vs eager" is the largest relative
difference of a system's losses from eager's, step by step (the same training, so ~1e-7).

    python benchmarks/bench_one_process.py                    # the default shape
    python benchmarks/bench_one_process.py --seq 128 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SYSTEMS = ("eager", "aot_eager", "dcir")


def _model(ns):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # the bench extra's
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=ns.vocab, hidden_size=ns.hidden, intermediate_size=ns.hidden * 4, num_hidden_layers=ns.layers,
        num_attention_heads=max(1, ns.hidden // 64), num_key_value_heads=max(1, ns.hidden // 64),
        max_position_embeddings=ns.seq, attn_implementation="eager"))


def run_one(ns) -> dict:
    """One system's run in this process: the step times and the peak RSS."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(ns.threads)
    model = _model(ns)
    ids = torch.randint(0, ns.vocab, (ns.batch, ns.seq), generator=torch.Generator().manual_seed(1))
    step = model if ns.run == "eager" else torch.compile(model) if ns.run == "inductor" else \
        torch.compile(model, backend=ns.run)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, losses = [], []
    for _ in range(ns.warmup + ns.steps):
        start = time.perf_counter()
        logits = step(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return {"times": times[ns.warmup:], "losses": losses,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _argv(ns, system: str) -> list[str]:
    flags = [f"--{k}={getattr(ns, k)}" for k in ("layers", "hidden", "seq", "batch", "vocab", "threads", "steps",
                                                  "warmup")]
    return [sys.executable, os.path.abspath(__file__), f"--run={system}", *flags]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per run (default 8)")
    p.add_argument("--warmup", type=int, default=4, help="steps before measuring (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--with-inductor", action="store_true", help="also torch.compile() with Inductor")
    p.add_argument("--json", default="bench_one_process.json", help="where to write the figures")
    p.add_argument("--run", choices=[*SYSTEMS, "inductor"], help=argparse.SUPPRESS)  # one run, in a child
    ns = p.parse_args()
    if ns.run:
        print(json.dumps(run_one(ns)))
        return
    systems = [*SYSTEMS, *(["inductor"] if ns.with_inductor else [])]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(ns.rounds):
        for s in systems:
            done = subprocess.run(_argv(ns, s), capture_output=True, text=True, timeout=1800)
            if done.returncode:
                sys.exit(f"{s} failed in round {r + 1}:\n{done.stderr[-3000:]}")
            runs[s].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"  round {r + 1}: {s:10s} median step {statistics.median(runs[s][-1]['times']):.3f} s", flush=True)
    _report(ns, runs)


def _report(ns, runs: dict) -> None:
    median = {s: statistics.median(t for run in rs for t in run["times"]) for s, rs in runs.items()}
    print(f"\nLlama {ns.layers} layers, hidden {ns.hidden}, sequence {ns.seq}, batch {ns.batch}, vocabulary "
          f"{ns.vocab}; {ns.threads} threads; {ns.rounds} rounds x {ns.steps} steps (+{ns.warmup} warm-up), "
          "interleaved\n")
    print(f"{'system':10s} {'step s':>8s} {'min-max s':>12s} {'x eager':>8s} {'peak RSS MiB':>13s} "
          f"{'loss vs eager':>14s}")
    reference = runs["eager"][0]["losses"]
    rows = {}
    for s, rs in runs.items():
        times = [t for run in rs for t in run["times"]]
        drift = max(abs(a - b) / abs(b) for run in rs for a, b in zip(run["losses"], reference))
        rows[s] = {"step_s": median[s], "x_eager_speed": median["eager"] / median[s], "loss_vs_eager": drift,
                   "peak_rss_mib": max(run["peak_rss_mib"] for run in rs), "min_s": min(times), "max_s": max(times)}
        print(f"{s:10s} {median[s]:8.3f} {min(times):5.2f}-{max(times):<6.2f} {rows[s]['x_eager_speed']:8.3f} "
              f"{rows[s]['peak_rss_mib']:13.0f} {drift:14.1e}")
    with open(ns.json, "w") as f:
        json.dump({"config": {k: v for k, v in vars(ns).items() if k != "run"}, "systems": rows}, f, indent=1)


if __name__ == "__main__":
    main()
