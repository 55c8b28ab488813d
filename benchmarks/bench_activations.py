"""Step time against peak memory per rank: DCIR's recompute under memory budgets, FSDP2
without checkpointing, with full checkpointing, and under torch.compile's
``activation_memory_budget``, on one long-sequence workload (issue 35).

    python benchmarks/bench_activations.py                  # seq 1024, vocab 4096, 4 layers, hidden 256, batch 1
    python benchmarks/bench_activations.py --rounds 3 --budgets 0.9,0.8,min
    python benchmarks/bench_activations.py --budgets ckpt --compile-budgets ''   # at fsdp2-ckpt's peak

The points, each a ``bench_train.py`` system run by its worker (``train_worker.py``):

* ``dcir-none``: ``dcir-fused`` (``prefetch,unshard,bucket,fuse`` planned by the cycle, no
  budget): DCIR without recompute;
* ``dcir-<F>`` for each of ``--budgets``: ``dcir-recompute-fused`` (``recompute,prefetch,
  unshard,bucket,fuse``; with ``--op-by-op`` both without ``fuse``: ``dcir-optimized``,
  ``dcir-recompute``) under ``memory_budget`` = what a rank holds whatever the schedule +
  the shared-memory outbox + F x the step's own memory without recompute, all as plain
  ``dcir`` accounts them on a one-step probe run (``bench_train.memory_budget``); ``min``
  is the step with every activation the ``recompute`` pass can rebuild rebuilt. A
  fraction below that minimum cannot be met (the Engine says so and stops): it is
  reported as infeasible and not run; ``ckpt`` (``dcir-ckpt``) is the budget of
  ``fsdp2-ckpt``'s allocator peak, measured first (one step under the memory
  profiler), plus the outbox: DCIR planned within the tensor memory full
  checkpointing reaches, by DCIR's own accounting (``ckpt_fraction``);
* ``fsdp2``, ``fsdp2-ckpt`` (every decoder layer checkpointed), and
  ``fsdp2-compile-<B>`` for each of ``--compile-budgets`` (every decoder layer
  ``torch.compile``'d under ``torch._functorch.config.activation_memory_budget = B``).

Runs are interleaved round by round; a point's step time is the median over every
measured step of every round (the slowest rank's), its peak the largest rank's peak
resident memory over the measured steps (``VmHWM`` reset before the first of them, so
building, capture and compiling are left out), its largest of any round. Every process runs with
``--malloc release`` by default (``bench_train.py``): blocks of 64 KiB or more go back to
the system when freed, so resident memory follows the live tensors, and every system
pays the same page faults. DCIR points also report the Engine's accounted peak (what
``memory_budget`` is checked against: shards, gradient shards, optimizer state,
buffers, the memory model's step peak, the outbox) and their budget.

Each point then runs once more, one measured step, with ``train_worker.py --allocated``:
its allocator peak (the largest rank's peak of live tensor bytes over the step, what a
GPU's ``torch.cuda.max_memory_allocated`` reports; the memory profiler it needs slows
that run, whose step time is not used), and "step alloc MiB", the most the step
allocated over what was live at its start, which a budgeted point's plan keeps within
the part of its budget left to the step (``bench_train.step_allowance``). The profiler
misses some frees, so what is live at a step's start can count a block already
freed (its address handed out again later): on the tiny workload up to a set of
gradient shards, 0.15 MiB, from run to run; the step's own part does not carry that.
The matched-memory lines compare on the allocator peak and peak RSS.

Ratios are against the baselines of the same run: "x ckpt speed" is ``fsdp2-ckpt``'s step
over a point's (above 1: faster), "x ckpt RSS" a point's peak over ``fsdp2-ckpt``'s; the
simulator's own check is "x pred step" (a point's measured step over the step time the
cycle predicted for the plan it runs) and "x pred peak" (the last profiled step's
measured peak, by the profiler following the step's storages, over the memory model's
for the same program: from the second cycle on, the plan's); the
matched-memory line compares ``fsdp2-ckpt`` with the fastest DCIR point whose peak is at
most ``fsdp2-ckpt``'s, and with DCIR's curve interpolated at that peak.

Output: the table, ``--json`` (default ``bench_activations.json``) and ``--chart``
(default ``docs/activations-curve.png``); each run's JSON and log in
``bench_train_logs/`` beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import bench_train

HERE = Path(__file__).resolve().parent

#: the workload: activations are most of a step's memory at this sequence length
WORKLOAD = {"seq": 1024, "vocab": 4096, "layers": 4, "hidden": 256, "batch": 1}


def points(ns, probe: dict, ckpt_allocated: float | None = None) -> tuple[list[tuple[str, str, dict]], dict[str, str]]:
    """(label, system, settings) of each point to run, and why the others are not run.
    ``ckpt_allocated``: ``fsdp2-ckpt``'s allocator peak (MiB), which the ``ckpt`` budget
    gives DCIR (``ckpt_fraction``)."""
    least = max(a["least_step_peak"] / a["step_peak"] for a in probe["accounted"])
    plain, recomputing = ("dcir-optimized", "dcir-recompute") if ns.op_by_op else ("dcir-fused", "dcir-recompute-fused")
    run = [("dcir-none", plain, {})]
    skipped = {}
    for name in ns.budgets.split(","):
        fraction = ckpt_fraction(probe, ckpt_allocated) if name == "ckpt" else name
        if fraction != "min" and float(fraction) < least:
            skipped[f"dcir-{name}"] = (f"not run: infeasible{f' (a fraction of {fraction})' * (name == 'ckpt')}: with "
                                       "every activation recompute can rebuild rebuilt the step keeps "
                                       f"{least:.2f} of its memory")
            continue
        run.append((f"dcir-{name}", recomputing, {"activation_budget": fraction}))
    run += [("fsdp2", "fsdp2", {}), ("fsdp2-ckpt", "fsdp2-ckpt", {})]
    run += [(f"fsdp2-compile-{b}", "fsdp2-compile-budget", {"compile_budget": float(b)})
            for b in ns.compile_budgets.split(",") if b]
    return run, skipped


def ckpt_fraction(probe: dict, ckpt_allocated: float) -> str:
    """The ``--activation-budget`` whose ``memory_budget`` is ``fsdp2-ckpt``'s allocator peak
    (every tensor a rank holds at the step's peak) plus DCIR's shared-memory outbox (not a
    torch allocation, so in no system's allocator peak): DCIR planned within the tensor
    memory full checkpointing reaches, by DCIR's own accounting, which counts more than
    its allocator measures (docs/benchmarks.md)."""
    a = max(probe["accounted"], key=lambda a: a["fixed"] + a["step_peak"])
    return f"{(ckpt_allocated * 2**20 - a['fixed']) / a['step_peak']:.4f}"


def allocated_peak(base, label: str, system: str, settings: dict, logs: Path) -> tuple[float, float] | None:
    """One more run of a point, one step under the memory profiler: its allocator peak and
    the most the step allocated over what was live at its start (MiB, the largest rank's)."""
    result = bench_train.allocator_run(system, argparse.Namespace(**{**vars(base), **settings}),
                                       logs / f"act-{label}-allocated.json")
    if result:
        peak = max(a["peak"] for a in result["allocated"])
        step = max(a["peak"] - a["start"] for a in result["allocated"])
        print(f"  allocator peak: {label:<20} {peak:.1f} MiB, {step:.1f} MiB of it the step's", flush=True)
        return peak, step
    return None


def summarize(runs: dict[str, list[dict]], budgets: dict[str, int], allocated: dict[str, tuple[float, float]],
              allowances: dict[str, int]) -> dict[str, dict]:
    """Each point's row; ``allocated``: its ``allocated_peak``, ``allowances``: the part of a
    budgeted point's budget left to the step (``bench_train.step_allowance``)."""
    rows = {}
    for label, results in runs.items():
        if not results:
            continue
        steps = [t for r in results for t in r["step_s"]]
        accounted = [a["held"] for r in results for a in r.get("accounted") or () if a]
        peak, step = allocated.get(label, (None, None))
        rows[label] = {"step_s": statistics.median(steps), "step_s_min": min(steps), "step_s_max": max(steps),
                       "measured_steps": len(steps),
                       "peak_rss_mib": max(m for r in results for m in r["steps_rss_mib"]),
                       "process_peak_rss_mib": max(m for r in results for m in r["peak_rss_mib"]),
                       "accounted_mib": max(accounted) / 2**20 if accounted else None,
                       "budget_mib": budgets[label] / 2**20 if label in budgets else None,
                       "predicted_s": bench_train._median([r.get("predicted_s") for r in results]),
                       "pipeline": next((log[-1]["pipeline"] for r in results if (log := r.get("optimize_log"))), None),
                       "x_predicted_peak": _peak_ratio(results),
                       "allocated_mib": peak, "allocated_step_mib": step,
                       "step_allowance_mib": allowances[label] / 2**20 if label in allowances else None}
        if rows[label]["predicted_s"]:
            rows[label]["x_predicted_step"] = rows[label]["step_s"] / rows[label]["predicted_s"]
    ckpt = rows.get("fsdp2-ckpt")
    plain = rows.get("fsdp2")
    for row in rows.values():
        row["x_ckpt_speed"] = ckpt["step_s"] / row["step_s"] if ckpt else None
        row["x_ckpt_rss"] = row["peak_rss_mib"] / ckpt["peak_rss_mib"] if ckpt else None
        row["x_fsdp2_speed"] = plain["step_s"] / row["step_s"] if plain else None
        row["x_fsdp2_rss"] = row["peak_rss_mib"] / plain["peak_rss_mib"] if plain else None
        row["x_ckpt_allocated"] = (row["allocated_mib"] / ckpt["allocated_mib"]
                                   if ckpt and row["allocated_mib"] and ckpt["allocated_mib"] else None)
    return rows


def _peak_ratio(results: list[dict]) -> float | None:
    """The profiled step's measured peak over the memory model's for the same program
    (the last cycle's profile, which from the second on is of the plan), the median of
    the runs."""
    ratios = []
    for r in results:
        cycles = [c for c in r.get("optimize_log") or () if c.get("measured_peak")]
        if cycles:
            c = cycles[-1]
            ratios.append(max(c["measured_peak"].values()) / max(c["predicted_peak_profiled"].values()))
    return statistics.median(ratios) if ratios else None


def matched(rows: dict[str, dict], key: str) -> dict | None:
    """DCIR against ``fsdp2-ckpt`` at ``fsdp2-ckpt``'s peak (``key``: ``peak_rss_mib`` or
    ``allocated_mib``): the fastest DCIR point within it, and DCIR's curve (its points by
    peak, the faster at equal peak) interpolated there."""
    ckpt = rows.get("fsdp2-ckpt")
    dcir = sorted((r[key], r["step_s"], label) for label, r in rows.items() if label.startswith("dcir")
                  and r.get(key) is not None)
    if ckpt is None or ckpt.get(key) is None or not dcir:
        return None
    at = ckpt[key]
    within = [(step, label, peak) for peak, step, label in dcir if peak <= at]
    best = min(within) if within else None
    curve = None
    for (r0, s0, _), (r1, s1, _) in zip(dcir, dcir[1:]):
        if r0 <= at <= r1 and r1 > r0:
            curve = s0 + (s1 - s0) * (at - r0) / (r1 - r0)
    return {"key": key, "at_mib": at, "ckpt_step_s": ckpt["step_s"],
            "best_within": best and {"label": best[1], "step_s": best[0], "peak_mib": best[2],
                                     "x_ckpt_speed": ckpt["step_s"] / best[0]},
            "interpolated_step_s": curve, "x_ckpt_speed_interpolated": ckpt["step_s"] / curve if curve else None,
            "lowest_dcir_mib": dcir[0][0]}


def matched_line(match: dict) -> str:
    what = {"peak_rss_mib": "peak RSS", "allocated_mib": "allocator peak"}[match["key"]]
    best = match["best_within"]
    return (f"at fsdp2-ckpt's {what} ({match['at_mib']:.0f} MiB, step {match['ckpt_step_s']:.3f} s): "
            + (f"fastest DCIR point within it {best['label']} ({best['peak_mib']:.0f} MiB, "
               f"{best['step_s']:.3f} s): x{best['x_ckpt_speed']:.2f}" if best else
               f"no DCIR point is within it (the lowest: {match['lowest_dcir_mib']:.0f} MiB)")
            + (f"; DCIR's curve interpolated there: {match['interpolated_step_s']:.3f} s, "
               f"x{match['x_ckpt_speed_interpolated']:.2f}" if match["interpolated_step_s"] else ""))


def table(rows: dict[str, dict], skipped: dict[str, str]) -> str:
    def f(v, spec):
        return format(v, spec) if v is not None else "-"

    head = (f"{'point':<20}{'step s':>8}{'min-max s':>14}{'peak RSS MiB':>14}{'accounted MiB':>15}{'budget MiB':>12}"
            f"{'predicted s':>13}{'x pred step':>12}{'x pred peak':>12}{'x ckpt speed':>14}{'x ckpt RSS':>12}"
            f"{'x fsdp2 speed':>15}{'x fsdp2 RSS':>13}{'alloc MiB':>11}{'x ckpt alloc':>14}{'step alloc MiB':>16}")
    lines = [head, "-" * len(head)]
    for label, r in rows.items():
        lines.append(f"{label:<20}{r['step_s']:>8.3f}{r['step_s_min']:>7.2f}-{r['step_s_max']:<6.2f}"
                     f"{r['peak_rss_mib']:>14,.0f}{f(r['accounted_mib'], '.1f'):>15}{f(r['budget_mib'], '.1f'):>12}"
                     f"{f(r['predicted_s'], '.3f'):>13}{f(r.get('x_predicted_step'), '.2f'):>12}"
                     f"{f(r['x_predicted_peak'], '.2f'):>12}{f(r['x_ckpt_speed'], '.2f'):>14}"
                     f"{f(r['x_ckpt_rss'], '.3f'):>12}"
                     f"{f(r['x_fsdp2_speed'], '.2f'):>15}{f(r['x_fsdp2_rss'], '.3f'):>13}"
                     f"{f(r['allocated_mib'], '.1f'):>11}{f(r['x_ckpt_allocated'], '.3f'):>14}"
                     f"{f(r['allocated_step_mib'], '.2f'):>16}")
    for label, why in skipped.items():
        lines.append(f"{label:<20}{why}")
    return "\n".join(lines)


def chart(rows: dict[str, dict], path: Path, title: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install -e '.[bench]')"
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1, 1]})
    dcir = sorted((r["peak_rss_mib"], r["step_s"], label) for label, r in rows.items() if label.startswith("dcir"))
    ax.plot([d[0] for d in dcir], [d[1] for d in dcir], "o-", color="#3b7dd8", label="DCIR (recompute budgets)")
    for rss, step, label in dcir:
        ax.annotate(label.removeprefix("dcir-"), (rss, step), textcoords="offset points", xytext=(5, 4), fontsize=8)
    styles = {"fsdp2": ("s", "#444"), "fsdp2-ckpt": ("D", "#d8573b")}
    for label, r in rows.items():
        if label.startswith("dcir"):
            continue
        marker, color = styles.get(label, ("^", "#3ba86b"))
        ax.plot([r["peak_rss_mib"]], [r["step_s"]], marker, color=color, label=label)
    ckpt = rows.get("fsdp2-ckpt")
    if ckpt:
        ax.axvline(ckpt["peak_rss_mib"], color="#d8573b", linestyle=":", linewidth=1)
    ax.set_xlabel("peak resident memory per rank over the measured steps (MiB)")
    ax.set_ylabel("median step time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    alloc = sorted((r["allocated_mib"], r["step_s"], label, r["budget_mib"]) for label, r in rows.items()
                   if label.startswith("dcir") and r.get("allocated_mib") is not None)
    acc.plot([a[0] for a in alloc], [a[1] for a in alloc], "o-", color="#3b7dd8", label="DCIR")
    for a, step, label, budget in alloc:
        acc.annotate(label.removeprefix("dcir-"), (a, step), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if budget is not None:
            acc.plot([budget], [step], "|", color="red", markersize=12)
    acc.plot([], [], "|", color="red", label="its memory_budget")
    for label, r in rows.items():
        if not label.startswith("dcir") and r.get("allocated_mib") is not None:
            marker, color = styles.get(label, ("^", "#3ba86b"))
            acc.plot([r["allocated_mib"]], [r["step_s"]], marker, color=color, label=label)
    if ckpt and ckpt.get("allocated_mib"):
        acc.axvline(ckpt["allocated_mib"], color="#d8573b", linestyle=":", linewidth=1)
    acc.set_xlabel("allocator peak per rank over one step (MiB)")
    acc.set_title("tensors only: the CPU allocator's peak", fontsize=9)
    acc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_activations.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    for name, default in WORKLOAD.items():
        ap.add_argument(f"--{name}", type=int, default=default, help=f"(default {default})")
    ap.add_argument("--budgets", default="0.9,0.8,0.6,ckpt,0.4,min",
                    help="dcir-recompute(-fused)'s --activation-budget values; ckpt: fsdp2-ckpt's allocator peak, "
                         "measured first, plus the outbox (default 0.9,0.8,0.6,ckpt,0.4,min)")
    ap.add_argument("--op-by-op", action="store_true",
                    help="DCIR's points without fuse (dcir-optimized, dcir-recompute): every op run eagerly, as "
                         "before 2026-11-29; by default they are dcir-fused and dcir-recompute-fused")
    ap.add_argument("--compile-budgets", default="0.5,0.1",
                    help="fsdp2-compile-budget's activation_memory_budget values (default 0.5,0.1)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    ap.add_argument("--warmup", type=int, default=5, help="steps before measuring (default 5: DCIR plans in them)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--malloc", choices=sorted(bench_train.MALLOC), default="release",
                    help="glibc malloc's settings for every process (bench_train.py; default release)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    ap.add_argument("--json", default="bench_activations.json")
    ap.add_argument("--chart", default=str(HERE.parent / "docs" / "activations-curve.png"))
    return ap


def main(argv=None) -> int:
    ns = parser().parse_args(argv)
    base = bench_train.parser().parse_args([])  # bench_train's defaults for what this script does not set
    for name, _ in bench_train.WORKLOAD:
        setattr(base, name, getattr(ns, name, None))
    bench_train.workload_of(base)
    for key in ("world", "steps", "warmup", "malloc", "timeout"):
        setattr(base, key, getattr(ns, key))
    logs = Path(ns.json).resolve().parent / "bench_train_logs"
    logs.mkdir(exist_ok=True)
    begin = time.time()
    probe = bench_train.probe(base, logs)
    allocated = {}
    if "ckpt" in ns.budgets.split(","):  # the budget dcir-ckpt plans within: fsdp2-ckpt's peak, measured first
        allocated["fsdp2-ckpt"] = allocated_peak(base, "fsdp2-ckpt", "fsdp2-ckpt", {}, logs)
        if allocated["fsdp2-ckpt"] is None:
            raise SystemExit(f"fsdp2-ckpt's allocator run failed: {logs / 'act-fsdp2-ckpt-allocated.log'}")
    todo, skipped = points(ns, probe, allocated["fsdp2-ckpt"][0] if "fsdp2-ckpt" in allocated else None)
    print(f"Llama {bench_train.parameters(base) / 1e6:.1f} M parameters (seq {ns.seq}, vocab {ns.vocab}, layers "
          f"{ns.layers}, hidden {ns.hidden}, batch {ns.batch}); world {ns.world}, 1 thread per rank; malloc "
          f"{ns.malloc}; {ns.rounds} rounds x {ns.steps} steps (+{ns.warmup} warm-up), interleaved; DCIR's points: "
          + ", ".join(dict.fromkeys(system for label, system, _ in todo if label.startswith("dcir-"))))
    a = max(probe["accounted"], key=lambda a: a["step_peak"])
    print(f"probe (plain dcir): fixed {a['fixed'] / 2**20:.1f} MiB, step {a['step_peak'] / 2**20:.1f} MiB, outbox "
          f"{a['outbox'] / 2**20:.1f} MiB, step with everything rebuildable recomputed "
          f"{a['least_step_peak'] / 2**20:.1f} MiB")
    budgets = {label: bench_train.memory_budget(probe, s["activation_budget"])
               for label, _, s in todo if "activation_budget" in s}
    allowances = {label: bench_train.step_allowance(probe, s["activation_budget"])
                  for label, _, s in todo if "activation_budget" in s}
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in todo}
    for r in range(ns.rounds):
        for label, system, settings in todo:
            out = logs / f"act-{label}-{r}.json"
            out.unlink(missing_ok=True)
            result = bench_train._run(system, argparse.Namespace(**{**vars(base), **settings}), out)
            if result:
                runs[label].append(result)
                print(f"  round {r + 1}: {label:<20} median step {statistics.median(result['step_s']):.3f} s, "
                      f"peak {max(result['steps_rss_mib']):.0f} MiB", flush=True)
    for label, system, settings in todo:  # one more run each, under the memory profiler: the allocator's peak
        if label not in allocated and (peaks := allocated_peak(base, label, system, settings, logs)) is not None:
            allocated[label] = peaks
    for label, results in runs.items():
        if not results:  # say so in the table and the JSON, as an infeasible point is
            skipped[label] = f"failed in every round (its output: {logs / f'act-{label}-0.log'})"
    rows = summarize(runs, budgets, allocated, allowances)
    print()
    print(table(rows, skipped))
    match = {key: matched(rows, key) for key in ("peak_rss_mib", "allocated_mib")}
    print()
    for m in match.values():
        if m:
            print(matched_line(m))
    report = {"workload": {k: getattr(ns, k) for k in WORKLOAD} | {"world": ns.world, "malloc": ns.malloc,
                                                                    "parameters": bench_train.parameters(base)},
              "rounds": ns.rounds, "steps": ns.steps, "warmup": ns.warmup, "probe": probe["accounted"],
              "seconds": round(time.time() - begin), "results": rows, "skipped": skipped, "matched": match,
              "command": "python benchmarks/bench_activations.py " + " ".join(argv or sys.argv[1:])}
    Path(ns.json).write_text(json.dumps(report, indent=1))
    problem = chart(rows, Path(ns.chart), f"Llama {ns.layers} layers, seq {ns.seq}, world {ns.world}: "
                                          "median step against peak memory per rank")
    print(f"\n{ns.json}" + (f", {ns.chart}" if problem is None else f"; {problem}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
