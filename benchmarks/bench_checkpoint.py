"""Checkpoint save and load throughput: DCIR against FSDP2 + torch.distributed.checkpoint.

    python benchmarks/bench_checkpoint.py                 # the bench model (bench_train.py's)
    python benchmarks/bench_checkpoint.py --layers 2      # smaller

Both systems train the benchmark Llama of ``bench_train.py`` (6 layers, hidden 256,
vocab 32000, fp32) for one AdamW step at ``--world`` ranks, so the optimizer state
exists, then save a checkpoint and load it back, timed between barriers (the slowest
rank's time):

* ``dcir``: ``engine.save_checkpoint`` / ``engine.load_checkpoint`` (plain ``zero3``):
  DCP with every parameter a DTensor over its flat elements, plus the commit (CRC-32C of
  every file, the ``COMPLETE`` marker, the rename) and, on load, the checks against the
  manifest before DCP reads;
* ``fsdp2``: ``fully_shard`` per decoder layer and on the root (``train_worker.Fsdp2``),
  ``get_state_dict`` + ``dcp.save``, and ``dcp.load`` + ``set_state_dict``.

Runs are interleaved round by round (dcir fsdp2 dcir fsdp2 ...), ``--rounds`` of them,
and the figures are medians. Each timed phase starts after ``gc.collect()`` on every
rank: a full collection falls where the process's history puts it (over a process
holding a captured program, 0.4 s), and without it one landed inside DCIR's load in
some rounds and not others. Throughput is MB (10^6 bytes) per second per rank: the
checkpoint's bytes on disk divided by the world, over the time. Loads read files just
written, so mostly from the page cache, for both systems alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = ("dcir", "fsdp2")
MODEL = [("layers", 6), ("hidden", 256), ("seq", 128), ("batch", 4), ("vocab", 32000), ("intermediate", 0)]


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def rank_main(system: str, out: str, ckpt: str, ns) -> None:
    """One rank: one training step, then a timed save and a timed load."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from train_worker import Fsdp2, batches, llama, parser

    torch.set_num_threads(1)
    # train_worker's defaults for every option this benchmark does not set (accumulation 1, CPU, real init)
    ns = parser().parse_args([system, out, *(f"--{n}={getattr(ns, n)}" for n, _ in MODEL)])
    if system == "dcir":
        import dcir

        engine = dcir.initialize(llama(ns), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
                                 config={"timeout_s": 600}, loss_fn=lambda o: o.loss)
        rank, world = engine.rank, engine.world
        engine.backward(engine(**next(batches(ns, rank, world))))
        engine.step()

        def save():
            engine.save_checkpoint(ckpt, tag="bench")

        def load():
            engine.load_checkpoint(ckpt, tag="bench")
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        runner = Fsdp2(ns)
        rank, world = dist.get_rank(), dist.get_world_size()
        runner.micro_step(next(batches(ns, rank, world)))
        path = os.path.join(ckpt, "bench")

        def save():
            msd, osd = get_state_dict(runner.model, runner.opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        def load():
            msd, osd = get_state_dict(runner.model, runner.opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(runner.model, runner.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    times = {}
    for name, fn in (("save_s", save), ("load_s", load)):
        gc.collect()  # a full collection the history of the process set off is not the save's or load's
        dist.barrier()
        begin = time.perf_counter()
        fn()
        dist.barrier()
        times[name] = time.perf_counter() - begin
    everyone = [None] * world
    dist.all_gather_object(everyone, times)
    if rank == 0:
        result = {k: max(t[k] for t in everyone) for k in times}
        Path(out).write_text(json.dumps({**result, "world": world, "bytes": _dir_bytes(Path(ckpt) / "bench")}))
    dist.barrier()
    os._exit(0)  # skip process-group teardown: it is not what is measured


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_checkpoint.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    for name, default in MODEL:
        ap.add_argument(f"--{name}", type=int, default=default, help=f"(default {default})")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default 600)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--rank", nargs=3, metavar=("SYSTEM", "OUT", "CKPT"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.rank:
        rank_main(*ns.rank, ns)
        return 0
    from dcir_runtime import native
    from dcir_runtime.launch import launch

    native.load()  # built once, before the ranks start
    root = Path(ns.dir or tempfile.mkdtemp(prefix="dcir-bench-ckpt-"))
    model = [a for name, _ in MODEL for a in (f"--{name}", str(getattr(ns, name)))]
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for r in range(ns.rounds):
        for system in SYSTEMS:
            ckpt, out = root / f"{system}{r}", root / f"{system}{r}.json"
            code = launch([__file__, *model, "--rank", system, str(out), str(ckpt)], ns.world, timeout_s=ns.timeout)
            if code != 0:
                print(f"{system} round {r + 1} failed (exit {code})", file=sys.stderr)
                return 1
            runs[system].append(json.loads(out.read_text()))
            shutil.rmtree(ckpt)
    rows = {}
    for system, results in runs.items():
        mb = statistics.median(x["bytes"] for x in results) / 1e6
        save_s = statistics.median(x["save_s"] for x in results)
        load_s = statistics.median(x["load_s"] for x in results)
        rows[system] = {"checkpoint_mb": mb, "save_s": save_s, "load_s": load_s,
                        "save_mb_s_per_rank": mb / ns.world / save_s, "load_mb_s_per_rank": mb / ns.world / load_s}
    print(f"\nLlama {ns.layers} layers, hidden {ns.hidden}, vocab {ns.vocab}, fp32, AdamW; {ns.world} ranks; "
          f"medians of {ns.rounds} interleaved rounds")
    print(f"{'system':<8} {'checkpoint MB':>14} {'save s':>8} {'save MB/s/rank':>15} {'load s':>8} "
          f"{'load MB/s/rank':>15} {'save vs fsdp2':>14} {'load vs fsdp2':>14}")
    ref = rows["fsdp2"]
    for system, x in rows.items():
        print(f"{system:<8} {x['checkpoint_mb']:14.1f} {x['save_s']:8.3f} {x['save_mb_s_per_rank']:15.1f} "
              f"{x['load_s']:8.3f} {x['load_mb_s_per_rank']:15.1f} "
              f"{x['save_mb_s_per_rank'] / ref['save_mb_s_per_rank']:13.2f}x "
              f"{x['load_mb_s_per_rank'] / ref['load_mb_s_per_rank']:13.2f}x")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"rows": rows, "runs": runs, "world": ns.world}, indent=1))
    if ns.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
