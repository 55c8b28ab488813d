"""The training benchmark runs end to end on a tiny workload (every system it can run
here, interleaved) and reports what it measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_train  # noqa: E402


def test_tiny_run_reports_every_system(tmp_path, capfd):
    out = tmp_path / "bench.json"
    code = bench_train.main(["--layers", "1", "--hidden", "64", "--seq", "16", "--batch", "2", "--vocab", "256",
                             "--steps", "2", "--warmup", "2", "--rounds", "1", "--systems",
                             "floor,dcir,dcir-optimized,dcir-zero1,dcir-offload,fsdp2",
                             "--json", str(out), "--chart", str(tmp_path / "bench.png"), "--timeout", "300"])
    assert code == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert set(rows) == {"floor", "dcir", "dcir-optimized", "dcir-zero1", "dcir-offload", "fsdp2"}, capfd.readouterr()
    assert rows["floor"]["x_floor"] == 1.0
    assert rows["dcir"]["exposed_comm_s"] is not None and rows["fsdp2"]["exposed_comm_s"] is None
    assert all(r["step_s"] > 0 and r["measured_steps"] == 2 for r in rows.values())
    # the second step was profiled, so the cost model predicts the planned schedule's step time
    assert rows["dcir"]["predicted_s"] > 0 and rows["dcir-optimized"]["predicted_s"] > 0
    assert "deepcompile" in report["unavailable"]
    text = capfd.readouterr().out
    assert "x floor" in text and "unavailable: DeepSpeed's compiler needs CUDA" in text
