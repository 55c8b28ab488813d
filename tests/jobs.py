"""Running a whole job (a launcher and its workers) from a test, with a hard timeout."""

from __future__ import annotations

import os
import signal
import subprocess

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
