"""Running a whole job (a launcher and its workers) from a test, with a hard timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest


def run_job(argv: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``argv`` in its own process group; past ``timeout_s`` the whole group
    (torchrun's workers included) is killed and the test fails. Returns the finished
    process, stdout and stderr as text (``kwargs`` go to ``Popen``: ``cwd``, ``env``)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(argv[:6])} ... took over {timeout_s} s:\n{out[-4000:]}\n{err[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_nodes(argv: list[str], nodes: int, per_node: int, timeout_s: float) -> list[subprocess.CompletedProcess]:
    """Runs ``python argv...`` as a job of ``nodes`` × ``per_node`` ranks the way a cluster
    does: one ``torchrun --nnodes N --node-rank K`` per "node", all on this host (static
    rendezvous on loopback). Past ``timeout_s`` every launch (workers included) is killed
    and the test fails. Returns each node's finished launcher, stdout and stderr as text."""
    from dcir_runtime.launch import free_port
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                               "--node-rank", str(k), "--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1",
                               "--master-port", port, *argv],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for k in range(nodes)]
    deadline = time.monotonic() + timeout_s
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"{nodes} torchrun nodes of {' '.join(argv[:4])} ... took over {timeout_s} s:\n{err[-4000:]}")
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs
