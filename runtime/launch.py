"""Runs a script as N local ranks (``python -m dcir_runtime.launch --nproc 2 train.py``).

The local counterpart of ``torchrun --standalone``: each process gets the rendezvous
environment torch.distributed reads (``MASTER_ADDR``/``MASTER_PORT``, ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``), and ``OMP_NUM_THREADS`` shares the cores out unless it
is set. Unlike torchrun it does not kill the other ranks the moment one fails: they get
``grace_s`` seconds to notice (their collectives fail within the Engine's
``timeout_s``) and say so themselves, which is what makes a dead rank's effect
readable. A whole run longer than ``timeout_s`` is ended, all ranks, exit code 124.
Only the processes it started are ever signalled. For several machines use
``torchrun`` (docs/runtime.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv: list[str], nproc: int, *, timeout_s: float | None = None, grace_s: float = 30.0,
           env: dict | None = None) -> int:
    """Runs ``python argv...`` as ``nproc`` ranks; returns the first failing rank's exit
    code (0 when all succeed, 124 on timeout)."""
    base = {**os.environ, **(env or {})}
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc))
    procs = [subprocess.Popen([sys.executable, *argv], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(nproc)]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at, code = None, 0
    try:
        while None in [p.poll() for p in procs]:  # every rank polled: one that ended is noticed
            now = time.monotonic()
            for p in procs:
                if p.returncode not in (None, 0) and failed_at is None:
                    failed_at, code = now, p.returncode
            if deadline is not None and now > deadline:
                print(f"dcir launch: the run took over {timeout_s:g} s; ending all ranks", file=sys.stderr)
                code = 124
                break
            if failed_at is not None and now - failed_at > grace_s:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if code == 0:
        code = next((p.returncode for p in procs if p.returncode != 0), 0)
    return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dcir_runtime.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    ap.add_argument("--timeout", type=float, default=None, help="end every rank after this many seconds")
    ap.add_argument("--grace", type=float, default=30.0,
                    help="seconds the other ranks get to report a failed rank's effect before they are ended (30)")
    ap.add_argument("script", help="the Python script each rank runs")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    ns = ap.parse_args(argv)
    return launch([ns.script, *ns.args], ns.nproc, timeout_s=ns.timeout, grace_s=ns.grace)


if __name__ == "__main__":
    sys.exit(main())
