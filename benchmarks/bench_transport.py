"""What moving a step's bytes costs each rank, over each transport, on this machine.

    python benchmarks/bench_transport.py [--world 2] [--mib 128] [--part-mib 4] [--repeats 5]

On a CPU host the transfers run on the cores the ranks compute on, so what a transport
costs a step is the CPU it takes, not only how long it takes. Each of ``--world`` ranks
(one compute thread each, as the Engine runs them) moves ``--mib`` MiB a step through
the runtime's own collectives (``torch.ops.dcir``), as a ZeRO-3 plan that gathers each
weight once a step moves them: gathers of ``--part-mib`` MiB tensors (``all_gather``)
and as many reduce-scatters of the same size (``reduce_scatter``), each started, then
waited, with nothing else running. ``--mib`` counts as ``bench_train.py``'s "sent
MiB/step" does: what a rank hands to the collectives (a gather's shard, a
reduce-scatter's whole tensor). Per transport (``process_group``: gloo over the
kernel's loopback; ``shared_memory``: the runtime's outboxes; interleaved, ``--repeats``
times each) it prints the wall time of a step's transfers and the CPU the rank's
process spent on them, every thread counted (gloo's workers and the kernel's socket
copies included): the medians, the slowest rank's.

The CPU is what a transport takes from compute when every core computes, as on the
2-core development machine: the process-group rows of ``bench_train.py`` pay it on top
of the shared-memory ones (docs/benchmarks.md). On GPUs NCCL moves the bytes on the
device and takes no host core.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

TRANSPORTS = ("process_group", "shared_memory")
MIB = 1 << 20


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    return use.ru_utime + use.ru_stime


def _step(ops, group: str, shard, full, parts: int) -> None:
    """One step's transfers: ``parts`` gathers and as many reduce-scatters, each waited at once."""
    for _ in range(parts):
        ops.wait(ops.all_gather(shard, list(full.shape), group, "bench gather"))
        ops.wait(ops.reduce_scatter(full, "sum", group, "bench reduce-scatter"))


def rank_main(ns) -> None:
    import torch
    import torch.distributed as dist

    from dcir_runtime import native, transport
    from dcir_runtime.group import ProcessGroup

    torch.set_num_threads(1)
    native.load()
    ops = torch.ops.dcir
    ops.set_timeout(120_000)
    group = ProcessGroup.join(120.0, torch.device("cpu"))
    n = ns.part_mib * MIB // 4 // group.world  # fp32 elements of one rank's shard
    shard, full = torch.randn(n), torch.randn(n * group.world)
    parts = max(1, round(ns.mib / (ns.part_mib * (1 + 1 / group.world))))  # a gather hands its shard
    # the job's group moves through the outboxes; a second group over the same ranks has none
    capacity = transport.set_up(group, "shared_memory", torch.device("cpu"))
    transport.resize(group, "shared_memory", capacity, 4 * ns.part_mib * MIB)
    names = {"process_group": dist.new_group(backend="gloo").group_name, "shared_memory": group.name}
    figures = {mode: [] for mode in TRANSPORTS}
    for repeat in range(ns.repeats + 1):  # the first, a warm-up, is not counted
        for mode in TRANSPORTS:
            dist.barrier()
            sent, wall, cpu = ops.group_stats(names[mode])[1], time.perf_counter(), _cpu_s()
            _step(ops, names[mode], shard, full, parts)
            if repeat:
                figures[mode].append((time.perf_counter() - wall, _cpu_s() - cpu,
                                      (ops.group_stats(names[mode])[1] - sent) / MIB))
    medians = torch.tensor([[statistics.median(f[k] for f in figures[mode]) for k in (0, 1, 2)] for mode in TRANSPORTS],
                           dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    if group.rank == 0:
        _report(ns, parts, dict(zip(TRANSPORTS, medians.tolist())))
    dist.destroy_process_group()


def _report(ns, parts: int, rows: dict) -> None:
    print(f"world {ns.world}, one thread per rank; a step: {parts} gathers and {parts} reduce-scatters of "
          f"{ns.part_mib} MiB tensors, each waited at once; medians of {ns.repeats}, the slowest rank's")
    print(f"{'transport':15s} {'sent MiB':>9s} {'wall s':>8s} {'CPU s':>8s} {'CPU ms/MiB':>11s} "
          f"{'x shared_memory CPU':>20s}")
    base = rows["shared_memory"][1]
    for mode, (wall, cpu, sent) in rows.items():
        print(f"{mode:15s} {sent:9.1f} {wall:8.3f} {cpu:8.3f} {cpu / sent * 1e3:11.2f} {cpu / base:20.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=float, default=128.0, help="MiB a rank hands to the collectives a step (bench_train's default shape: 130)")
    ap.add_argument("--part-mib", type=int, default=4, help="MiB of each gather and reduce-scatter (the whole tensor)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.world < 2:
        ap.error(f"--world {ns.world}: a transport moves bytes between ranks; give at least 2")
    if ns.mib <= 0 or ns.part_mib < 1 or ns.repeats < 1:
        ap.error("--mib, --part-mib and --repeats must be positive")
    if ns.rank:
        rank_main(ns)
        return 0
    from dcir_runtime.launch import launch

    args = [str(Path(__file__).resolve()), "--rank", "--world", str(ns.world), "--mib", str(ns.mib),
            "--part-mib", str(ns.part_mib), "--repeats", str(ns.repeats)]
    return launch(args, ns.world, env={"OMP_NUM_THREADS": "1"}, timeout_s=600)


if __name__ == "__main__":
    raise SystemExit(main())
