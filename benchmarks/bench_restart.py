"""How soon a job trains again after it is restarted: DCIR's program cache against a cold start, and FSDP2 with compiled blocks.

Every run trains bench_train.py's workload (the Llama, its data, world 2 on gloo, one
thread per rank) for ``--warmup`` + ``--steps`` optimizer steps. In each round, in a
fresh directory, interleaved:

* ``dcir-cold``: ``dcir-optimized`` (the optimization cycle profiles after steps 1-3
  and plans ``prefetch``, ``unshard``, ``bucket``) with an empty program cache; it saves
  a checkpoint after its last step;
* ``dcir-restart``: the same job started again, as ``torchrun --max-restarts`` starts it
  after a fault: the checkpoint loaded before its first step, the program cache as the
  cold run left it (the program and the plan are read, nothing is captured or profiled);
* ``dcir-restart-nocache``: the same restart with an empty cache (it captures again, and
  the cycle plans again);
* ``fsdp2-compile-cold``: FSDP2 with every decoder layer ``torch.compile``'d
  (torchtitan's recipe), Inductor's caches empty (``TORCHINDUCTOR_CACHE_DIR`` fresh);
* ``fsdp2-compile-warm``: the same again on the caches the cold run left (Inductor's
  FX graph and AOTAutograd caches: what a restarted FSDP2 job finds).

Columns (each the median over rounds; a run's figure is its slowest rank's): ``first
step s``, the first step alone (capture or compiling, and the step); ``steady s``, the
median of the measured steps; ``x steady``, their ratio; ``load s``, the checkpoint
load before the first step; ``to first s``, from the process's start to the end of its
first step (interpreter, imports, the model, sharding, the load, the first step). The
restart target (issue 39) is ``first step <= 1.5 x steady + load``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import bench_train  # this script's folder is its sys.path[0]

#: label -> (system, what it runs with: "fresh-cache" an empty program cache, "cache" the one
#: dcir-cold left, "save" / "load" the round's checkpoint, "fresh-inductor" / "inductor"
#: Inductor's caches emptied first / as the round left them)
RUNS = {"dcir-cold": ("dcir-optimized", ("fresh-cache", "save")),
        "dcir-restart": ("dcir-optimized", ("cache", "load")),
        "dcir-restart-nocache": ("dcir-optimized", ("fresh-cache", "load")),
        "fsdp2-compile-cold": ("fsdp2-compile", ("fresh-inductor",)),
        "fsdp2-compile-warm": ("fsdp2-compile", ("inductor",))}


def _arguments(label: str, root: Path) -> tuple[list[str], dict]:
    """The worker arguments and environment of run ``label`` in round directory ``root``."""
    _, uses = RUNS[label]
    args, env = [], {}
    if "fresh-cache" in uses:
        fresh = root / f"{label}-cache"
        shutil.rmtree(fresh, ignore_errors=True)
        args += ["--program-cache", str(fresh)]
    if "cache" in uses:
        args += ["--program-cache", str(root / "dcir-cold-cache")]
    if "save" in uses:
        args += ["--save-checkpoint", str(root / "checkpoint")]
    if "load" in uses:
        args += ["--load-checkpoint", str(root / "checkpoint")]
    if "fresh-inductor" in uses:
        shutil.rmtree(root / "inductor", ignore_errors=True)
    if "inductor" in uses or "fresh-inductor" in uses:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    return args, env


def summary(results: list[dict]) -> dict:
    first = statistics.median(r["first_step_time_s"] for r in results)
    steady = statistics.median(statistics.median(r["step_s"]) for r in results)
    loads = [r["load_s"] for r in results if r.get("load_s") is not None]
    return {"first_step_s": first, "steady_s": steady, "x_steady": first / steady,
            "load_s": statistics.median(loads) if loads else None,
            "to_first_s": statistics.median(r["first_step_s"] for r in results), "rounds": len(results)}


def table(rows: dict[str, dict]) -> str:
    lines = [f"{'run':<22}{'first step s':>14}{'steady s':>10}{'x steady':>10}{'load s':>8}{'to first s':>12}"]
    for label, r in rows.items():
        load = f"{r['load_s']:.2f}" if r["load_s"] is not None else "-"
        lines.append(f"{label:<22}{r['first_step_s']:>14.2f}{r['steady_s']:>10.3f}{r['x_steady']:>10.2f}"
                     f"{load:>8}{r['to_first_s']:>12.1f}")
    restart = rows.get("dcir-restart")
    if restart is not None:
        bound = 1.5 * restart["steady_s"] + (restart["load_s"] or 0.0)
        lines.append(f"dcir-restart: first step {restart['first_step_s']:.2f} s against 1.5 x steady + load = "
                     f"{bound:.2f} s: {'met' if restart['first_step_s'] <= bound else 'NOT met'}")
    cold, peer = rows.get("dcir-cold"), rows.get("fsdp2-compile-cold")
    if cold is not None and peer is not None:
        lines.append(f"cold first step: dcir {cold['first_step_s']:.2f} s, fsdp2-compile "
                     f"{peer['first_step_s']:.2f} s ({cold['first_step_s'] / peer['first_step_s']:.2f}x)")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_restart.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    ap.add_argument("--warmup", type=int, default=5, help="steps before measuring (default 5: DCIR plans in them)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated (default {','.join(RUNS)})")
    ap.add_argument("--dir", default="bench_restart", help="where the runs keep caches, checkpoints and logs")
    ap.add_argument("--json", default="bench_restart.json")
    for name, default in bench_train.WORKLOAD:
        ap.add_argument(f"--{name}", type=int, default=default, help=f"(default {default})")
    return ap


def main(argv=None) -> int:
    ns = parser().parse_args(argv)
    labels = [s for s in ns.runs.split(",") if s]
    unknown = [s for s in labels if s not in RUNS]
    if unknown:
        parser().error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
    if any(RUNS[s][1][-1] == "load" for s in labels) and "dcir-cold" not in labels:
        parser().error("the restarts load the checkpoint dcir-cold saves: run dcir-cold too")
    base = bench_train.parser().parse_args([])
    for name, _ in bench_train.WORKLOAD:
        setattr(base, name, getattr(ns, name))
    base.steps, base.warmup = ns.steps, ns.warmup
    root = Path(ns.dir).resolve()
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    begin = time.time()
    for r in range(ns.rounds):
        here = root / f"round{r}"
        shutil.rmtree(here, ignore_errors=True)
        here.mkdir(parents=True)
        for label in labels:
            args, env = _arguments(label, here)
            result = bench_train._run(RUNS[label][0], base, here / f"{label}.json", tuple(args), env)
            if result is not None:
                runs[label].append(result)
                print(f"  round {r + 1}: {label:<22} first step {result['first_step_time_s']:.2f} s, median step "
                      f"{statistics.median(result['step_s']):.3f} s", flush=True)
    rows = {label: summary(results) for label, results in runs.items() if results}
    print(f"world {base.world}, {ns.rounds} rounds x {ns.steps} steps (+{ns.warmup} warm-up), "
          f"{time.time() - begin:.0f} s")
    print(table(rows))
    Path(ns.json).write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
