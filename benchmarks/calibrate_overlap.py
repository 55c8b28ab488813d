"""How much an overlapped transfer slows the compute it overlaps, on this machine.

    python benchmarks/calibrate_overlap.py [--world 2] [--mib 64] [--repeats 7]

Each of ``--world`` ranks (gloo, one compute thread each, as the Engine runs them)
times, per repeat:

* a compute block alone (matmuls and elementwise ops, as a transformer's step mixes
  them, in small chunks);
* an ``all_gather`` of ``--mib`` MiB alone (started, then waited at once: how the
  profiler measures a transfer);
* the two together: the all_gather started, then the compute block, polling between
  chunks for when the transfer ends.

It prints ``overlap_share``: the compute time lost while the transfer was in flight,
over how long it was in flight (the median over repeats and the ranks' mean). That is
the share of a core the transfer takes from compute, the ``links.overlap_share`` of a
hardware description (docs/simulator.md). A transfer that needs no host core (NCCL on
a GPU) takes none: 0. It also prints how much longer the overlapped transfer took
than the transfer alone (``transfer_stretch``), which the simulator does not model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path


def _compute_chunk(a, b, x):
    import torch

    y = torch.mm(a, b)                 # 2 * 128 * 1024 * 256 FLOP
    z = torch.nn.functional.silu(x) * x + 1.0  # streams x a few times
    return y, z


def _block(a, b, x, chunks: int, work=None) -> tuple[float, float | None]:
    """Seconds of ``chunks`` compute chunks; with ``work``, when it completed (seconds
    from the start, polled between chunks; None if still running at the end)."""
    begin = time.perf_counter()
    done = None
    for _ in range(chunks):
        _compute_chunk(a, b, x)
        if work is not None and done is None and work.is_completed():
            done = time.perf_counter() - begin
    return time.perf_counter() - begin, done


def rank_main(ns) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b, x = torch.randn(128, 1024), torch.randn(1024, 256), torch.randn(128, 1024)
    n = ns.mib * 2**20 // 4 // world
    shard, full = torch.randn(n), torch.empty(n * world)
    chunks = ns.chunks
    _block(a, b, x, chunks)  # warm-up
    dist.all_gather_into_tensor(full, shard)
    rows = []
    for _ in range(ns.repeats):
        dist.barrier()
        alone, _ = _block(a, b, x, chunks)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather_into_tensor(full, shard, async_op=True).wait()
        transfer = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_gather_into_tensor(full, shard, async_op=True)
        launch = time.perf_counter() - t0
        both, done = _block(a, b, x, chunks, work)
        work.wait()
        if done is None:  # the transfer outlasted the block: the block was too short
            done = time.perf_counter() - t0 - launch
        inflight = launch + done
        lost = both - alone
        # the chunks that ran after the transfer ended ran at full speed: the loss is all in flight
        rows.append((lost / inflight, inflight / transfer, alone, transfer, inflight))
    shares = torch.tensor([statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows),
                           statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows),
                           statistics.median(r[4] for r in rows)], dtype=torch.float64)
    dist.all_reduce(shares)
    shares /= world
    if rank == 0:
        share, stretch, alone, transfer, inflight = shares.tolist()
        print(f"compute block alone {alone * 1e3:.1f} ms; all_gather of {ns.mib} MiB alone {transfer * 1e3:.1f} ms, "
              f"overlapped {inflight * 1e3:.1f} ms")
        print(f"overlap_share = {share:.3f}")
        print(f"transfer_stretch = {stretch:.3f}")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64, help="MiB of the gathered tensor")
    ap.add_argument("--chunks", type=int, default=100, help="compute chunks per block (make it outlast the transfer)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.rank:
        rank_main(ns)
        return 0
    from dcir_runtime.launch import launch

    args = [str(Path(__file__).resolve()), "--rank", "--mib", str(ns.mib), "--chunks", str(ns.chunks),
            "--repeats", str(ns.repeats)]
    return launch(args, ns.world, env={"OMP_NUM_THREADS": "1"}, timeout_s=600)


if __name__ == "__main__":
    raise SystemExit(main())
