"""The training benchmark: how its report turns runs into figures (on runs written
here), and that the runner, the workers and the trace tool produce that report on the
smallest workload. What it checks is the report's shape, never a speed: the figures
themselves are the benchmark's to measure (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json

import pytest

import bench_train  # benchmarks/ (pytest's pythonpath)
import trace_lateness
import train_worker

#: the smallest workload the benchmark Llama takes (one head is 64 wide); 4 steps, so DCIR's
#: profiled steps (2-4) are behind it when --trace traces the fifth
TINY = ["--layers", "1", "--hidden", "64", "--seq", "8", "--batch", "1", "--vocab", "64", "--steps", "1",
        "--warmup", "3", "--rounds", "1", "--timeout", "300"]
#: every row's figures, whichever system it is (None where a system has no such counter)
COLUMNS = {"step_s", "step_s_min", "step_s_max", "measured_steps", "tokens_per_s_per_rank", "peak_rss_mib",
           "start_rss_mib", "peak_cuda_mib", "exposed_comm_s", "predicted_s", "sent_bytes_per_step", "first_step_s",
           "init", "x_floor", "x_fsdp2_speed", "x_fsdp2_rss", "x_fp32", "allocated_mib", "x_fsdp2_allocated",
           "allocated_program", "minor_faults_per_step"}


def _result(step_s: list[float], rss=(400.0, 420.0), waits=None, sent=None, first_step_s=20.0, faults=None) -> dict:
    """One run's JSON as train_worker.py writes it: the slowest rank's time of each
    measured step, the most page faults a rank took in it, each rank's peak RSS (MiB), ..."""
    return {"system": "-", "world": len(rss), "step_s": step_s, "wait_s": waits,
            "sent_bytes": sent or [None] * len(step_s), "minor_faults": faults or [0] * len(step_s),
            "peak_rss_mib": list(rss), "start_rss_mib": [100.0] * len(rss),
            "peak_cuda_mib": [None] * len(rss), "first_step_s": first_step_s, "init": "real", "predicted_s": None}


def test_the_report_pools_the_rounds_and_divides_by_each_baseline():
    """A system's step time is the median of every measured step of every round (2, 2,
    100 and 3, 5, 6: 4, where the median of the rounds' medians is 3.5), its RSS the
    largest rank's peak of any round; each ratio is taken against its baseline row in the
    same run: x floor = step / floor's step, x fsdp2 speed = fsdp2's step / step, x fsdp2
    RSS = RSS / fsdp2's RSS, a bf16 row's x fp32 = its step / its fp32 row's step. Without
    the baseline's row a ratio is None."""
    ns = argparse.Namespace(batch=2, seq=8, accumulate=3)
    runs = {"floor": [_result([1.0, 1.0]), _result([1.0, 9.0])],
            "dcir": [_result([2.0, 2.0, 100.0], rss=(500.0, 600.0), waits=[0.25, 0.5, 0.5], sent=[3 * 2**20] * 3,
                             first_step_s=20.0, faults=[10, 20, 30_000]),
                     _result([3.0, 5.0, 6.0], rss=(550.0, 560.0), waits=[0.5, 1.0, 1.0], sent=[3 * 2**20] * 3,
                             first_step_s=30.0, faults=[40, 50, 60])],
            "dcir-bf16": [_result([3.0]), _result([3.0])],
            "fsdp2": [_result([8.0], rss=(300.0, 250.0))]}
    rows = bench_train.summarize(runs, ns)
    dcir = rows["dcir"]
    assert set(dcir) == COLUMNS
    assert (dcir["step_s"], dcir["step_s_min"], dcir["step_s_max"], dcir["measured_steps"]) == (4.0, 2.0, 100.0, 6)
    assert dcir["tokens_per_s_per_rank"] == 2 * 8 * 3 / 4.0
    assert (dcir["peak_rss_mib"], dcir["exposed_comm_s"], dcir["sent_bytes_per_step"], dcir["first_step_s"]) \
        == (600.0, 0.5, 3 * 2**20, 25.0)
    assert dcir["minor_faults_per_step"] == 45  # pooled like the steps: the median of all six
    assert (dcir["x_floor"], dcir["x_fsdp2_speed"], dcir["x_fsdp2_rss"]) == (4.0, 2.0, 2.0)
    assert rows["floor"]["x_floor"] == rows["fsdp2"]["x_fsdp2_speed"] == rows["fsdp2"]["x_fsdp2_rss"] == 1.0
    assert rows["dcir-bf16"]["x_fp32"] == 0.75 and all(rows[n]["x_fp32"] is None for n in ("floor", "dcir", "fsdp2"))
    assert rows["fsdp2"]["exposed_comm_s"] is rows["fsdp2"]["sent_bytes_per_step"] is None
    alone = bench_train.summarize({"dcir": runs["dcir"], "fsdp2-bf16": runs["dcir-bf16"]}, ns)
    assert alone["dcir"]["x_floor"] is alone["dcir"]["x_fsdp2_speed"] is alone["dcir"]["x_fsdp2_rss"] is None
    assert alone["fsdp2-bf16"]["x_fp32"] is None
    # the floor is the faster of compiled and eager, FSDP2 its faster variant; RSS against that one
    rivals = runs | {"eager": [_result([0.5])], "fsdp2-compile": [_result([4.0], rss=(200.0, 150.0))]}
    best = bench_train.summarize(rivals, ns)
    assert bench_train.baselines(best) == {"floor": "eager", "fsdp2": "fsdp2-compile", "floor-bf16": None,
                                           "fsdp2-bf16": None}
    assert (best["dcir"]["x_floor"], best["dcir"]["x_fsdp2_speed"], best["dcir"]["x_fsdp2_rss"]) == (8.0, 1.0, 3.0)
    assert best["fsdp2"]["x_fsdp2_speed"] == 0.5 and best["floor"]["x_floor"] == 2.0
    assert bench_train.table(best, {}).splitlines()[-2] == ("x floor against eager, x fsdp2 speed and RSS against "
                                                          "fsdp2-compile (the faster of floor and eager, of fsdp2 and "
                                                          "fsdp2-compile)")
    # a bf16 row's ratios are against bf16 baselines only: none ran here
    assert best["dcir-bf16"]["x_floor"] is best["dcir-bf16"]["x_fsdp2_speed"] is None
    # the table: sent in MiB per step, "-" for a ratio without its baseline, "n/a" for a missing counter
    text = bench_train.table(rows, {"deepspeed": "not installed"}).splitlines()
    assert "sent MiB/step" in text[0] and "x floor" in text[0]
    dcir_line = next(line for line in text if line.startswith("dcir "))
    assert "3.000" in dcir_line.split() and "4.00" in dcir_line.split() and "45" in dcir_line.split()
    assert "faults/step" in text[0]
    assert text[-3].split() == ["deepspeed", "unavailable:", "not", "installed"]  # then the baselines' lines


def test_a_bf16_row_is_against_the_floor_and_fsdp2_in_bf16():
    """A bf16 row (``-bf16`` in its name, over either transport) is measured against the
    faster of ``floor-bf16`` and ``eager-bf16`` and of ``fsdp2-bf16`` and
    ``fsdp2-compile-bf16``, the fp32 rows against theirs; the bf16 floors run in one
    process, and the table says which rows the bf16 ratios are against."""
    ns = argparse.Namespace(batch=2, seq=8, accumulate=1, world=2)
    runs = {"floor": [_result([1.0])], "dcir": [_result([2.0], rss=(300.0, 300.0))],
            "fsdp2": [_result([4.0], rss=(200.0, 200.0))], "floor-bf16": [_result([0.8])],
            "eager-bf16": [_result([0.5])], "fsdp2-bf16": [_result([3.0], rss=(100.0, 100.0))],
            "fsdp2-compile-bf16": [_result([3.5], rss=(50.0, 50.0))],
            "dcir-fused-bf16+pg": [_result([1.5], rss=(150.0, 120.0))]}
    rows = bench_train.summarize(runs, ns)
    assert bench_train.baselines(rows) == {"floor": "floor", "fsdp2": "fsdp2", "floor-bf16": "eager-bf16",
                                           "fsdp2-bf16": "fsdp2-bf16"}
    bf16 = rows["dcir-fused-bf16+pg"]
    assert (bf16["x_floor"], bf16["x_fsdp2_speed"], bf16["x_fsdp2_rss"]) == (3.0, 2.0, 1.5)
    assert (rows["dcir"]["x_floor"], rows["dcir"]["x_fsdp2_speed"], rows["dcir"]["x_fsdp2_rss"]) == (2.0, 2.0, 1.5)
    assert rows["floor-bf16"]["x_floor"] == 1.6 and rows["fsdp2-bf16"]["x_fsdp2_speed"] == 1.0
    assert rows["fsdp2-compile-bf16"]["x_fsdp2_rss"] == 0.5  # the faster bf16 FSDP2 is the baseline
    assert [bench_train.world_of(s, ns) for s in ("floor-bf16", "eager-bf16", "dcir-fused-bf16")] == [1, 1, 2]
    assert bench_train.table(rows, {}).splitlines()[-1] == (
        "bf16 rows: x floor against eager-bf16, x fsdp2 speed and RSS against fsdp2-bf16 "
        "(the faster of floor-bf16 and eager-bf16, of fsdp2-bf16 and fsdp2-compile-bf16)")
    assert "bf16 rows" not in bench_train.table(bench_train.summarize({"dcir": runs["dcir"]}, ns), {})


def test_the_allocator_peak_is_the_largest_ranks_with_dcirs_outbox_against_fsdp2s():
    """``--allocator-peak``: a row's allocator run gives "alloc MiB", the largest rank's
    allocator peak plus its shared-memory outbox (DCIR's: mapped, not allocated), and
    "x fsdp2 alloc" against the FSDP2 baseline's; rows without such a run have neither,
    and the table shows the columns only when some row has one."""
    def allocated(peaks, outboxes=None, log=None):
        return {"allocated": [{"start": 1.0, "peak": p} for p in peaks],
                "accounted": [{"outbox": b * 2**20} for b in outboxes] if outboxes else None, "optimize_log": log}

    assert bench_train.allocated_mib(allocated([100.0, 120.0], [30.0, 0.0])) == 130.0
    assert bench_train.allocated_mib(allocated([100.0, 120.0])) == 120.0
    ns = argparse.Namespace(batch=2, seq=8, accumulate=1)
    runs = {"dcir": [_result([2.0])], "fsdp2": [_result([4.0])], "floor": [_result([1.0])]}
    cycle = [{"switched": True, "pipeline": "prefetch,fuse"}, {"switched": False, "pipeline": "unshard"}]
    rows = bench_train.summarize(runs, ns, {"dcir": allocated([90.0, 80.0], [10.0, 10.0], cycle),
                                            "fsdp2": allocated([125.0, 110.0])})
    assert (rows["dcir"]["allocated_mib"], rows["dcir"]["x_fsdp2_allocated"]) == (100.0, 0.8)
    # the program the allocator run kept: its cycle's last switch, "captured" without one
    assert (rows["dcir"]["allocated_program"], rows["fsdp2"]["allocated_program"]) == ("prefetch,fuse", None)
    assert bench_train.kept_program({"optimize_log": cycle[1:]}) == "captured"
    assert rows["fsdp2"]["x_fsdp2_allocated"] == 1.0
    assert rows["floor"]["allocated_mib"] is rows["floor"]["x_fsdp2_allocated"] is None
    text = bench_train.table(rows, {}).splitlines()
    assert text[0].split()[-5:] == ["alloc", "MiB", "x", "fsdp2", "alloc"]
    assert next(line for line in text if line.startswith("dcir ")).split()[-2:] == ["100", "0.800"]
    assert next(line for line in text if line.startswith("floor ")).split()[-2:] == ["n/a", "-"]
    assert text[-1].startswith("x floor against floor, x fsdp2 speed, RSS and alloc against fsdp2 ")
    assert "alloc MiB" not in bench_train.table(bench_train.summarize(runs, ns), {})


def test_the_allocator_peak_is_measured_on_the_cpu_only(capsys):
    with pytest.raises(SystemExit):
        bench_train.main(["--allocator-peak", "--device", "cuda"])
    assert ("--allocator-peak measures the CPU allocator; on a GPU the table's peak CUDA MiB is that figure"
            in capsys.readouterr().err)


def test_both_transports_put_each_dcir_rows_process_group_run_beside_it():
    """``--transport both``: every DCIR system runs again over the process group, as the
    row ``SYSTEM+pg`` right after it; its worker is the same system with that transport,
    the others run as ``auto``; a bf16 row over the process group is against fp32's."""
    ns = bench_train.parser().parse_args(["--transport", "both"])
    rows = bench_train.rows_of(["floor", "dcir", "dcir-bf16", "fsdp2"], ns.transport)
    assert rows == ["floor", "dcir", "dcir+pg", "dcir-bf16", "dcir-bf16+pg", "fsdp2"]
    assert bench_train.rows_of(["dcir", "fsdp2"], "process_group") == ["dcir", "fsdp2"]
    runs = [(name, opts.transport) for name, opts in (bench_train.over(r, ns) for r in rows)]
    assert runs == [("floor", "auto"), ("dcir", "auto"), ("dcir", "process_group"), ("dcir-bf16", "auto"),
                    ("dcir-bf16", "process_group"), ("fsdp2", "auto")]
    assert ns.transport == "both"  # each run's options are a copy
    summary = bench_train.summarize({"dcir+pg": [_result([2.0])], "dcir-bf16+pg": [_result([1.0])]},
                                    argparse.Namespace(batch=2, seq=8, accumulate=1))
    assert summary["dcir-bf16+pg"]["x_fp32"] == 0.5


def test_resident_memory_is_split_by_what_maps_it(tmp_path):
    """``--rss-trace``'s breakdown: each mapping's ``Rss`` goes to its kind, a shared-memory
    outbox (unlinked once every rank mapped it) to shared memory."""
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "55d0-55e0 rw-p 00000000 00:00 0                          [heap]\nSize: 64 kB\nRss: 2048 kB\n"
        "7f00-7f10 rw-p 00000000 00:00 0 \nRss: 1024 kB\nAnonymous: 1024 kB\n"
        "7f10-7f20 rw-s 00000000 00:1a 12 /dev/shm/dcir-3fa2-1 (deleted)\nRss: 3072 kB\n"
        "7f20-7f30 r-xp 00000000 08:01 99 /usr/lib/libtorch_cpu.so\nRss: 512 kB\n"
        "7f30-7f40 r--p 00000000 08:01 98 /usr/lib/locale/C.utf8/LC_CTYPE\nRss: 256 kB\n")
    assert train_worker.resident_by_kind(str(smaps)) == {
        "anonymous": 3.0, "shared memory": 3.0, "libraries": 0.5, "files": 0.25}


def test_a_tiny_run_writes_the_report_and_the_traces(tmp_path, capfd):
    """The smallest workload through the runner, the workers and the trace tool: DCIR
    (also in bf16) and FSDP2 built on the meta device, DCIR's step after the measured one
    traced. The report's fields, which rows have which counters, the bytes DCIR sends,
    and the traces; no speed."""
    out = tmp_path / "bench.json"
    code = bench_train.main([*TINY, "--systems", "dcir,dcir-bf16,fsdp2", "--init", "meta", "--trace",
                             "--json", str(out), "--chart", str(tmp_path / "bench.png")])
    text = capfd.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    rows = report["results"]
    assert set(rows) == {"dcir", "dcir-bf16", "fsdp2"}, text
    assert set(report) == {"workload", "baselines", "rounds", "steps", "warmup", "machine", "torch", "seconds",
                           "results", "unavailable", "command"}
    assert report["baselines"] == {"floor": None, "fsdp2": "fsdp2", "floor-bf16": None, "fsdp2-bf16": None}
    parameters = 2 * 64 * 64 + 4 * 64 * 64 + 3 * 64 * 256 + 3 * 64  # embeddings and LM head, attention, MLP, 3 norms
    assert report["workload"]["parameters"] == parameters
    assert report["workload"]["init"] == "meta" and "deepcompile" in report["unavailable"]
    assert all(set(r) == COLUMNS and r["measured_steps"] == 1 and r["init"] == "meta" for r in rows.values())
    assert all(0 < r["start_rss_mib"] <= r["peak_rss_mib"] and r["first_step_s"] is not None for r in rows.values())
    assert all(isinstance(r["minor_faults_per_step"], (int, float)) for r in rows.values())  # every worker counts
    # DCIR's runtime counts waits and bytes and predicts its step (it profiled steps 2-4); FSDP2 has no such counter
    dcir, bf16, fsdp2 = rows["dcir"], rows["dcir-bf16"], rows["fsdp2"]
    assert all(r["exposed_comm_s"] is not None and r["predicted_s"] is not None for r in (dcir, bf16))
    assert fsdp2["exposed_comm_s"] is fsdp2["predicted_s"] is fsdp2["sent_bytes_per_step"] is None
    # bytes per step, as handed to collectives: bf16 halves the gathers, and what is left of
    # fp32's, the reductions, is every parameter's gradient once, in fp32 (reduce_dtype)
    gathers = 2 * (dcir["sent_bytes_per_step"] - bf16["sent_bytes_per_step"])
    assert gathers > 0 and dcir["sent_bytes_per_step"] - gathers == 4 * parameters
    assert dcir["x_floor"] is None and fsdp2["x_fsdp2_speed"] == 1.0  # no floor row; fsdp2 is its own baseline
    assert bf16["x_fp32"] is not None and dcir["x_fp32"] is fsdp2["x_fp32"] is None
    # --trace: each rank of each DCIR run wrote a Chrome trace that the lateness tool reads
    logs = tmp_path / "bench_train_logs"
    assert sorted(p.name for p in (logs / "dcir-0-trace").iterdir()) == ["rank0.json", "rank1.json"]
    late = trace_lateness.lateness(trace_lateness.load(logs / "dcir-0-trace"))
    assert late.count > 0 and len(late.waits_s) == 2 and late.predicted_s is not None
    assert "x floor" in text and "x fsdp2 speed" in text and "x fp32" in text and "init meta" in text
    assert "unavailable: DeepSpeed's compiler needs CUDA" in text
    # every row of a round is measured after as many steps: FSDP2 warms up as long as the
    # longest DCIR run, whose cycle went on past --warmup 3
    warmups = {n: json.loads((logs / f"{n}-0.json").read_text())["warmup_steps"] for n in rows}
    assert warmups["fsdp2"] == max(warmups["dcir"], warmups["dcir-bf16"]) > 3, warmups
    assert f"fsdp2              median step {fsdp2['step_s']:.3f} s (+{warmups['fsdp2']} warm-up)" in text


@pytest.mark.slow
def test_the_other_systems_run(tmp_path, capfd):
    """The systems the default tier does not run, on the tiny workload: a row each (the
    floor and eager build the model with its values even under --init meta)."""
    systems = ["floor", "eager", "floor-bf16", "eager-bf16", "floor-busy", "dcir-optimized", "dcir-zero1",
               "dcir-offload", "dcir-fused-bf16", "fsdp2-bf16", "fsdp2-compile-bf16"]
    out = tmp_path / "bench.json"
    code = bench_train.main([*TINY, "--systems", ",".join(systems), "--init", "meta", "--json", str(out),
                             "--chart", str(tmp_path / "bench.png")])
    text = capfd.readouterr().out
    assert code == 0, text
    rows = json.loads(out.read_text())["results"]
    assert list(rows) == systems, text
    assert all(set(r) == COLUMNS and r["measured_steps"] == 1 for r in rows.values())
    assert {n for n, r in rows.items() if r["init"] == "real"} == {"floor", "eager", "floor-bf16", "eager-bf16",
                                                                   "floor-busy"}
    # floor-busy: a copy of the floor in each of the world's processes, the slowest rank's step
    busy = json.loads((tmp_path / "bench_train_logs" / "floor-busy-0.json").read_text())
    assert busy["world"] == 2 and len(busy["peak_rss_mib"]) == 2
    assert {n for n, r in rows.items() if r["predicted_s"] is not None} == {n for n in systems if n.startswith("dcir")}


def test_gradients_summed_in_full_send_one_reduction_a_step(tmp_path, capfd):
    """``--accumulate-gradients full`` under 2 micro-steps: DCIR's ZeRO-3 reduce-scatters
    every gradient once a step instead of once a micro-step, the rest of what it sends
    unchanged; FSDP2 runs with its own switch."""
    sent = {}
    for how, systems in (("full", "dcir,fsdp2"), ("shard", "dcir")):
        out = tmp_path / f"{how}.json"
        code = bench_train.main([*TINY, "--accumulate", "2", "--accumulate-gradients", how, "--systems", systems,
                                 "--json", str(out), "--chart", str(tmp_path / f"{how}.png")])
        text = capfd.readouterr().out
        assert code == 0, text
        report = json.loads(out.read_text())
        assert report["workload"]["accumulate_gradients"] == how
        assert ("gradients summed in full across micro-steps" in text) == (how == "full")
        sent[how] = report["results"]["dcir"]["sent_bytes_per_step"]
    parameters = 2 * 64 * 64 + 4 * 64 * 64 + 3 * 64 * 256 + 3 * 64
    assert sent["shard"] - sent["full"] == 4 * parameters, sent


@pytest.mark.parametrize("argv,message", [
    (["--accumulate-gradients", "full"],
     "--accumulate-gradients full sums the micro-steps' gradients: give --accumulate above 1"),
    (["--accumulate", "2", "--accumulate-gradients", "full", "--systems", "dcir,deepspeed,dcir-zero2"],
     "--accumulate-gradients full: deepspeed, dcir-zero2 reduce every micro-step (DeepSpeed's ZeRO-2 and -3 refuse "
     "no_sync; dcir-zero2 summing full gradients is dcir-zero1): leave them out"),
])
def test_gradients_summed_in_full_only_where_every_row_can(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_train.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_allocator_peak_runs_each_row_once_more_under_the_memory_profiler(tmp_path, capfd):
    """``--allocator-peak`` on the tiny workload: after the rounds, each row's allocator
    run, one step under the memory profiler; DCIR's figure counts its outbox, and each
    row's step time is still its rounds' (the allocator run is not among them)."""
    out = tmp_path / "bench.json"
    code = bench_train.main([*TINY, "--systems", "dcir,fsdp2", "--allocator-peak", "--json", str(out),
                             "--chart", str(tmp_path / "bench.png")])
    text = capfd.readouterr().out
    assert code == 0, text
    rows = json.loads(out.read_text())["results"]
    assert all(r["allocated_mib"] > 0 and r["measured_steps"] == 1 for r in rows.values()), text
    assert rows["fsdp2"]["x_fsdp2_allocated"] == 1.0 and "alloc MiB" in text
    logs = tmp_path / "bench_train_logs"
    for system, row in rows.items():
        assert row["step_s"] == json.loads((logs / f"{system}-0.json").read_text())["step_s"][0]
    run = json.loads((logs / "dcir-allocated.json").read_text())
    outbox = max(a["outbox"] for a in run["accounted"]) / 2**20
    assert outbox > 0 and rows["dcir"]["allocated_mib"] >= max(a["peak"] for a in run["allocated"]) + outbox - 1e-9
    assert "allocator peak: dcir " in text and rows["dcir"]["allocated_program"] == "captured"  # no cycle


def test_the_busy_floor_runs_a_copy_in_every_process_the_sharded_systems_run():
    ns = bench_train.parser().parse_args(["--world", "3"])
    assert [bench_train.world_of(s, ns) for s in ("floor", "eager", "floor-busy", "dcir", "fsdp2")] == [1, 1, 3, 3, 3]
    assert "floor-busy" in bench_train.SYSTEMS and "floor-busy" not in bench_train.BASELINES["floor"]


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
    assert (ns.layers, ns.hidden, ns.intermediate, ns.batch, ns.seq, ns.experts) == (6, 256, 1024, 4, 128, 0)


def test_the_regimes_presets_are_the_shapes_they_say():
    """``--model long``, ``wide`` and ``moe``: sequence 1,024; hidden 1,024; a Mixtral whose
    layers hold 4 experts of 512 each (top-2), a router each, and its attention and
    norms as the Llama's."""
    shapes = {}
    for preset in ("long", "wide", "moe"):
        ns = bench_train.parser().parse_args(["--model", preset])
        bench_train.workload_of(ns)
        shapes[preset] = (ns.layers, ns.hidden, ns.seq, ns.vocab, ns.intermediate, ns.experts)
    assert shapes == {"long": (4, 256, 1024, 4096, 1024, 0), "wide": (2, 1024, 128, 4096, 4096, 0),
                      "moe": (4, 256, 256, 4096, 512, 4)}
    ns = bench_train.parser().parse_args(["--model", "moe"])
    bench_train.workload_of(ns)
    assert bench_train.family(ns) == "Mixtral (4 experts, top-2)"
    attention, experts, router = 4 * 256 * 256, 4 * 3 * 256 * 512, 4 * 256
    assert bench_train.parameters(ns) == 2 * 4096 * 256 + 4 * (attention + experts + router + 2 * 256) + 256


@pytest.mark.slow
def test_the_mixture_of_experts_runs_on_every_system_that_trains_it(tmp_path, capfd):
    """``--experts``: a tiny Mixtral through DCIR (over both transports), FSDP2 (each block
    compiled too) and, when installed, DeepSpeed ZeRO-3 (its MoE recipe: each sparse block
    a leaf)."""
    systems = ["eager", "dcir", "fsdp2", "fsdp2-compile"]
    systems += ["deepspeed"] if bench_train._available("deepspeed") is None else []
    out = tmp_path / "bench.json"
    code = bench_train.main([*TINY, "--experts", "2", "--intermediate", "32", "--systems", ",".join(systems),
                             "--transport", "both", "--json", str(out), "--chart", str(tmp_path / "bench.png")])
    text = capfd.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    assert list(report["results"]) == bench_train.rows_of(systems, "both") and report["workload"]["experts"] == 2
    assert "dcir+pg" in report["results"] and report["results"]["dcir+pg"]["exposed_comm_s"] is not None, text
    assert text.startswith("Mixtral (2 experts, top-2)") and report["baselines"]["floor"] == "eager"


@pytest.mark.slow
def test_the_activation_benchmark_reports_each_points_allocator_peak(tmp_path, capfd):
    """``bench_activations.py`` on the tiny workload: every point's row has its allocator
    peak (a second run under the memory profiler), DCIR's budgeted points allocate in
    their step no more than their budgets leave the step, ``dcir-ckpt``'s budget is
    ``fsdp2-ckpt``'s allocator peak plus the outbox, and the matched-memory lines compare
    on both figures."""
    import bench_activations

    out = tmp_path / "act.json"
    tiny = ["--layers", "1", "--hidden", "64", "--seq", "256", "--batch", "1", "--vocab", "64", "--steps", "1",
            "--warmup", "5", "--rounds", "1", "--timeout", "300"]
    code = bench_activations.main([*tiny, "--budgets", "0.9,ckpt", "--compile-budgets", "", "--json", str(out),
                                   "--chart", str(tmp_path / "curve.png")])
    text = capfd.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    rows = report["results"]
    assert set(rows) == {"dcir-none", "dcir-0.9", "dcir-ckpt", "fsdp2", "fsdp2-ckpt"}, text
    assert all(r["allocated_mib"] > 0 for r in rows.values()), rows
    for label in ("dcir-0.9", "dcir-ckpt"):
        assert 0 < rows[label]["allocated_step_mib"] <= rows[label]["step_allowance_mib"], rows[label]
        assert rows[label]["step_allowance_mib"] < rows[label]["budget_mib"], rows[label]
    outbox = max(a["outbox"] for a in report["probe"]) / 2**20
    assert rows["dcir-ckpt"]["budget_mib"] == pytest.approx(rows["fsdp2-ckpt"]["allocated_mib"] + outbox, abs=0.01)
    assert "at fsdp2-ckpt's allocator peak" in text and "alloc MiB" in text and "step alloc MiB" in text
    assert "DCIR's points: dcir-fused, dcir-recompute-fused" in text  # compiled stretches, unless --op-by-op


def test_the_restart_report_holds_the_first_step_against_a_steady_one_and_the_load():
    """``bench_restart.py``'s figures from runs written here: medians over rounds, the
    first step against 1.5 x a steady step plus the load, the cold starts compared."""
    import bench_restart

    def run(first, steps, load=None, age=5.0):
        return {"first_step_time_s": first, "step_s": steps, "load_s": load, "first_step_s": age}

    rows = {"dcir-cold": bench_restart.summary([run(4.0, [0.6, 0.7, 0.8]), run(5.0, [0.7])]),
            "dcir-restart": bench_restart.summary([run(1.0, [0.7], 0.2), run(1.2, [0.7], 0.4)]),
            "fsdp2-compile-cold": bench_restart.summary([run(18.0, [1.0])])}
    assert rows["dcir-cold"]["first_step_s"] == 4.5 and rows["dcir-cold"]["steady_s"] == 0.7
    assert rows["dcir-restart"]["load_s"] == pytest.approx(0.3) and rows["dcir-cold"]["load_s"] is None
    text = bench_restart.table(rows)
    assert "dcir-restart: first step 1.10 s against 1.5 x steady + load = 1.35 s: met" in text
    assert "cold first step: dcir 4.50 s, fsdp2-compile 18.00 s (0.25x)" in text
    rows["dcir-restart"] = bench_restart.summary([run(2.0, [0.7], 0.2)])
    assert "= 1.25 s: NOT met" in bench_restart.table(rows)


@pytest.mark.slow
def test_the_restart_benchmark_restarts_from_the_cache(tmp_path, capfd):
    """``bench_restart.py`` on the tiny workload: the restart loads the cold run's
    checkpoint, reads its program and plan (its cycle's records are the cached ones)."""
    import bench_restart

    tiny = ["--layers", "1", "--hidden", "64", "--seq", "8", "--batch", "1", "--vocab", "64", "--steps", "1",
            "--warmup", "4", "--rounds", "1"]
    out = tmp_path / "restart.json"
    code = bench_restart.main([*tiny, "--runs", "dcir-cold,dcir-restart,fsdp2-compile-cold", "--dir",
                               str(tmp_path / "runs"), "--json", str(out)])
    text = capfd.readouterr().out
    assert code == 0, text
    report = json.loads(out.read_text())
    assert set(report["rows"]) == {"dcir-cold", "dcir-restart", "fsdp2-compile-cold"}, text
    [restart] = report["runs"]["dcir-restart"]
    assert restart["load_s"] > 0 and restart["optimize_log"], restart
    [cold] = report["runs"]["dcir-cold"]
    assert [r["step"] for r in restart["optimize_log"]] == [r["step"] for r in cold["optimize_log"]]
    assert all(r["cached"] for r in restart["optimize_log"]) and not any(r["cached"] for r in cold["optimize_log"])
    assert "dcir-restart: first step" in text and "cold first step: dcir" in text


@pytest.mark.slow
def test_the_checkpoint_benchmark_times_both_systems(tmp_path, capfd):
    """``bench_checkpoint.py`` on the smallest Llama: a save and a load of each system
    (it had stopped running when the worker's model took an option it did not pass)."""
    import bench_checkpoint

    out = tmp_path / "ckpt.json"
    code = bench_checkpoint.main(["--layers", "1", "--hidden", "64", "--vocab", "64", "--rounds", "1",
                                  "--dir", str(tmp_path / "runs"), "--json", str(out)])
    text = capfd.readouterr()
    assert code == 0, text
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"dcir", "fsdp2"} and all(r["save_s"] > 0 and r["load_s"] > 0 for r in rows.values())
    assert rows["dcir"]["checkpoint_mb"] > 0 and "load vs fsdp2" in text.out


def test_the_transport_benchmark_prices_both_transports_on_the_same_bytes(capfd):
    """``bench_transport.py``: each transport's row moves what the step asks (2 gathers
    and 2 reduce-scatters of 1 MiB tensors at world 2: 2 x (0.5 + 1) MiB handed to the
    collectives, as the runtime counts them), and spends time and CPU on it."""
    import bench_transport

    code = bench_transport.main(["--mib", "3", "--part-mib", "1", "--repeats", "1"])
    out = capfd.readouterr().out
    assert code == 0, out
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out.splitlines()
            if line.split()[:1] in (["process_group"], ["shared_memory"])}
    assert set(rows) == {"process_group", "shared_memory"}, out
    assert all(sent == 3.0 and wall > 0 and cpu > 0 for sent, wall, cpu, *_ in rows.values()), out
    assert rows["shared_memory"][4] == 1.0, out


@pytest.mark.parametrize("argv, message", [
    (["--world", "1"], "--world 1: a transport moves bytes between ranks; give at least 2"),
    (["--part-mib", "0"], "--mib, --part-mib and --repeats must be positive"),
])
def test_the_transport_benchmark_rejects_what_it_cannot_measure(argv, message, capsys):
    import bench_transport

    with pytest.raises(SystemExit) as exit_:
        bench_transport.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
