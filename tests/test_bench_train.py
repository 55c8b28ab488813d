"""The training benchmark runs end to end on a tiny workload (every system it can run
here, interleaved) and reports what it measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_train  # noqa: E402
import trace_lateness  # noqa: E402


def test_tiny_run_reports_every_system(tmp_path, capfd):
    out = tmp_path / "bench.json"
    code = bench_train.main(["--layers", "1", "--hidden", "64", "--seq", "16", "--batch", "2", "--vocab", "256",
                             "--steps", "2", "--warmup", "2", "--rounds", "1", "--systems",
                             "floor,dcir,dcir-optimized,dcir-zero1,dcir-offload,fsdp2",
                             "--json", str(out), "--chart", str(tmp_path / "bench.png"), "--timeout", "300",
                             "--trace"])
    assert code == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    # --trace: every DCIR run traced one more step, each rank a Chrome trace the lateness tool reads
    logs = tmp_path / "bench_train_logs"
    assert sorted(p.name for p in logs.glob("*-trace")) == [
        "dcir-0-trace", "dcir-offload-0-trace", "dcir-optimized-0-trace", "dcir-zero1-0-trace"]
    late = trace_lateness.lateness(trace_lateness.load(logs / "dcir-optimized-0-trace"))
    assert late.count > 0 and len(late.waits_s) == 2 and late.predicted_s is not None
    assert set(rows) == {"floor", "dcir", "dcir-optimized", "dcir-zero1", "dcir-offload", "fsdp2"}, capfd.readouterr()
    assert rows["floor"]["x_floor"] == 1.0
    assert rows["dcir"]["exposed_comm_s"] is not None and rows["fsdp2"]["exposed_comm_s"] is None
    assert all(r["step_s"] > 0 and r["measured_steps"] == 2 for r in rows.values())
    # the second step was profiled, so the cost model predicts the planned schedule's step time
    assert rows["dcir"]["predicted_s"] > 0 and rows["dcir-optimized"]["predicted_s"] > 0
    assert "deepcompile" in report["unavailable"]
    text = capfd.readouterr().out
    assert "x floor" in text and "unavailable: DeepSpeed's compiler needs CUDA" in text


def test_meta_init_reports_rss_against_fsdp2_and_first_step(tmp_path, capfd):
    out = tmp_path / "bench.json"
    code = bench_train.main(["--layers", "1", "--hidden", "64", "--seq", "16", "--batch", "2", "--vocab", "256",
                             "--steps", "1", "--warmup", "1", "--rounds", "1", "--systems", "eager,dcir,fsdp2",
                             "--init", "meta", "--json", str(out), "--chart", str(tmp_path / "bench.png"),
                             "--timeout", "300"])
    assert code == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert set(rows) == {"eager", "dcir", "fsdp2"}, capfd.readouterr()
    # the sharded systems built the model on the meta device; eager (one process) with its values
    assert rows["dcir"]["init"] == rows["fsdp2"]["init"] == "meta" and rows["eager"]["init"] == "real"
    assert rows["fsdp2"]["x_fsdp2_rss"] == 1.0
    assert rows["fsdp2"]["x_fsdp2_speed"] == 1.0
    assert rows["dcir"]["x_fsdp2_speed"] == rows["fsdp2"]["step_s"] / rows["dcir"]["step_s"]
    assert rows["dcir"]["x_fsdp2_rss"] == rows["dcir"]["peak_rss_mib"] / rows["fsdp2"]["peak_rss_mib"]
    # process start to the end of the first step: more than a step, less than the run
    assert all(r["step_s"] < r["first_step_s"] < 300 for r in rows.values())
    assert all(0 < r["start_rss_mib"] <= r["peak_rss_mib"] for r in rows.values())
    assert report["workload"]["init"] == "meta" and report["workload"]["parameters"] == 2 * 256 * 64 + 4 * 64 * 64 \
        + 3 * 64 * 256 + 3 * 64
    text = capfd.readouterr().out
    assert "x fsdp2 RSS" in text and "x fsdp2 speed" in text and "first step s" in text and "init meta" in text
    assert "start RSS MiB" in text


def test_100m_preset_is_a_134m_parameter_llama_unless_flags_say_otherwise():
    ns = bench_train.parser().parse_args(["--model", "100m"])
    bench_train.workload_of(ns)
    assert (ns.layers, ns.hidden, ns.intermediate, ns.batch, ns.seq) == (12, 768, 2048, 1, 64)
    assert bench_train.parameters(ns) == 134_105_856
    ns = bench_train.parser().parse_args(["--model", "100m", "--layers", "2"])
    bench_train.workload_of(ns)
    assert ns.layers == 2 and ns.hidden == 768
    ns = bench_train.parser().parse_args([])
    bench_train.workload_of(ns)
    assert (ns.layers, ns.hidden, ns.intermediate, ns.batch, ns.seq) == (6, 256, 1024, 4, 128)
