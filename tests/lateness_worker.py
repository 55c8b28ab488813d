"""One rank of the lateness test (started by ``dcir_runtime.launch``, world 2, gloo).

``python lateness_worker.py OUT.dcir``: both ranks annotate the same one-gather program
from three made-up runs, in which the ranks take turns arriving late at the gather
(rank 0's time of it 300, 100, 100 us; rank 1's 100, 300, 100), and rank 0 writes the
annotated module. Each rank's median alone (100 us on both) shows no lateness; per run it
is 100, 100 and 0 us on the ranks' mean.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

import dcir
from dcir_runtime.profiler import Profile
from test_sim import WAITED_AT_ONCE

GATHER_US = ([300, 100, 100], [100, 300, 100])  # per rank, per run: the gather's start and wait


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    m = dcir.parse(WAITED_AT_ONCE)
    profile = Profile(m)
    n = len(m.functions["forward"].ops)  # param.get, all_gather, comm.wait, mm, sum
    profile.runs["forward"] = [
        SimpleNamespace(time=[1e-6, us * 1e-6, 1e-6, 50e-6, 5e-6], launch=[0.0, 2e-6, 0.0, 0.0, 0.0], mem=[0] * n,
                        cuda_mem=[0] * n) for us in GATHER_US[rank]]
    profile.annotate(group=dist.group.WORLD)
    if rank == 0:
        Path(out).write_text(dcir.print(m))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
