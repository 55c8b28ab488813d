"""The one-process benchmark (``benchmarks/bench_one_process.py``) runs every system in
its own process, interleaved, and each trains as eager does (the same losses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_one_process.py"


@pytest.mark.slow
def test_a_quick_run_reports_every_system_against_eager(tmp_path):
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--layers", "1", "--seq", "32", "--vocab", "128",
                           "--rounds", "1", "--steps", "2", "--warmup", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["systems"]
    assert set(rows) == {"eager", "aot_eager", "dcir"}
    assert rows["eager"]["x_eager_speed"] == 1.0
    for name, row in rows.items():
        assert row["loss_vs_eager"] <= 1e-6 and row["step_s"] > 0 and row["peak_rss_mib"] > 0, (name, row)
    assert "x eager" in done.stdout and "loss vs eager" in done.stdout
