"""DCIR against FSDP2, DeepSpeed ZeRO-1/2/3 and the compute floor, in one invocation.

    python benchmarks/bench_train.py                      # the default workload
    python benchmarks/bench_train.py --layers 24          # the 24-layer variant
    python benchmarks/bench_train.py --accumulate 4       # gradient accumulation 4
    python benchmarks/bench_train.py --systems dcir,fsdp2 --init meta --model 100m   # start from meta
    python benchmarks/bench_train.py --malloc keep        # every system with freed memory kept for reuse
    python benchmarks/bench_train.py --model long         # sequence 1,024; also wide, moe (--model's help)

Every system trains the same HF Llama (from a config, fp32) on the same batches
(``--model 100m``: 12 layers, hidden 768, MLP 2048, 12 heads, vocabulary 32000,
134 M parameters, batch 1 of 64 tokens; flags given explicitly win over the preset), or
with ``--experts N`` (``--model moe``) a Mixtral of the same shape, each MLP N experts,
each token through 2 of them:

* ``dcir``: the Engine, plain ``zero3``, compute run op by op (eager lowering);
* ``dcir-prefetch``, ``dcir-unshard``, ``dcir-optimized``: the Engine's optimization
  cycle: steps 2, 3 and 4 are profiled and ``prefetch``, ``unshard`` or all of
  ``prefetch,unshard,bucket`` are planned from the profiles so far, combined per op
  by the median, the pipeline searched among the passes' joint alternatives
  (``dcir.search``; ``dcir`` is profiled too,
  with no passes, so every DCIR row has the cost model's predicted step time);
* ``dcir-inductor``: ``dcir-optimized``'s planned program with the compute between
  collectives compiled by Inductor (the two differ only in the lowering);
* ``dcir-fused``: ``dcir-optimized``'s passes and ``fuse``, planned jointly: which
  stretches of compute are compiled is chosen with the simulator, together with the
  bucketing and prefetching (``dcir.fusion``);
* ``dcir-zero1``, ``dcir-zero2``: the Engine at ZeRO stage 1 (optimizer state
  sharded) and 2 (gradients too), with ``dcir-optimized``'s passes;
* ``dcir-offload``: ``zero3`` with ``dcir-optimized``'s passes and optimizer-state
  offload, its budget half of a rank's AdamW state (2 fp32 tensors per parameter
  element, sharded over the world);
* ``dcir-recompute``: ``recompute,prefetch,unshard,bucket`` planned by the cycle within a
  ``memory_budget`` of ``--activation-budget``: what a rank holds whatever the schedule
  (shards, gradient shards, optimizer state, buffers) and the shared-memory outbox, plus
  that fraction of the step's own memory (saved activations, temporaries, gathered
  parameters) without recompute, each as plain ``dcir`` accounts it on a one-step probe
  run before the first (``min``: the step's peak with every activation the pass can
  rebuild rebuilt); the budget is the memory model's, not the process's RSS;
* ``dcir-recompute-fused``: the same with ``fuse`` too (as ``dcir-fused``): the cycle
  chooses the compiled stretches within the same budget;
* ``dcir-bf16``: ``dcir`` in mixed precision (the config's ``bf16`` section: bf16
  compute and gathers, fp32 gradient reduction and master weights, docs/config.md);
* ``dcir-fused-bf16``: ``dcir-fused`` in that policy;
* ``fsdp2``: PyTorch FSDP2, ``fully_shard`` per decoder layer and on the root;
* ``fsdp2-bf16``: the same with the same policy,
  ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``;
* ``fsdp2-ckpt``: the same with every decoder layer checkpointed
  (``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``
  before ``fully_shard``): FSDP2's full activation checkpointing;
* ``fsdp2-compile``: the same with every decoder layer ``torch.compile``'d before
  ``fully_shard``: torchtitan's recipe, the baseline its users run;
* ``fsdp2-compile-bf16``: the same in ``fsdp2-bf16``'s policy;
* ``fsdp2-compile-budget``: the same with every decoder layer ``torch.compile``'d before
  ``fully_shard`` (torchtitan's order) under ``torch._functorch.config.activation_memory_budget
  = --compile-budget``: the min-cut partitioner keeps that fraction of the activations;
* ``fsdp2-offload``: the same with ``offload_policy=CPUOffloadPolicy()``; without an
  accelerator host memory cannot be pinned (``pin_memory=False`` then), and the
  "device" and the host are the same RAM, as for ``dcir-offload``;
* ``dcir-break``, ``fsdp2-break``: ``dcir`` and ``fsdp2`` on the same Llama with its
  middle decoder layer behind a finiteness check (``if not torch.isfinite(h).all():
  raise``): one data-dependent graph break, which the Engine runs as graph-break
  regions (docs/runtime.md, "Graph breaks: regions"); beside ``dcir`` and ``fsdp2``,
  the cost of a break;
* ``deepspeed``: DeepSpeed ZeRO-3, eager (CPU accelerator, gloo), when installed;
* ``deepspeed-zero1``, ``deepspeed-zero2``: the same at ZeRO stage 1 and 2;
* ``deepspeed-offload``: ZeRO-3 with ``offload_optimizer`` to the CPU (ZeRO-Offload:
  all optimizer state in host memory, the step run there by DeepSpeed's CPU Adam);
* ``floor``: one process, ``torch.compile``, the same per-rank batch and no
  communication: the compute floor the sharded systems are measured against;
* ``eager``: the same without ``torch.compile``: the compute of a step run op by op,
  which is what ``dcir`` runs between its collectives (for the breakdown);
* ``floor-bf16``, ``eager-bf16``: ``floor`` and ``eager`` in the bf16 policy: the forward
  and backward on a copy of the model with bf16 parameters, AdamW stepping the fp32
  parameters with the gradients cast to fp32, cast into the copy after each step (what
  ``fsdp2-bf16`` and ``dcir-bf16`` do, without communication): the bf16 rows' floor;
* ``floor-busy``: ``floor`` run by ``--world`` processes at once, each its own copy with
  its own batch and no communication (a process group only for the barrier before each
  step): the compute floor with every core and the memory as busy as the sharded
  systems have them. Not a baseline: beside ``floor`` it shows what running side by
  side costs, apart from what communicating costs.

The distributed systems run ``--world`` ranks with one thread each (``floor`` one
process with one thread). Runs are interleaved, round by round (A B C ... A B C ...),
so drift of the machine hits every system alike; each run's steps after warm-up are
timed (the slowest rank's), and the figure per system is the median over all
measured steps of all rounds. A DCIR run warms up for as long as its optimization
cycle still works (``--warmup``), so each round runs its DCIR rows first and then the
others with as many warm-up steps as the longest of them: every row of a round is
measured after the same number of steps. Resident memory grows over a run's first tens
of steps, as glibc's heap settles (FSDP2's peak RSS on the mixture of experts: 879 MiB
after 5 steps, 932 after 30), so a row measured earlier would look smaller. DeepSpeed's own compiler (DeepCompile) needs CUDA
(``cuda.h``) and is reported as unavailable on a CPU-only machine.

With ``--device cuda`` the systems run on GPUs over NCCL (``--world`` of them; one
for ``floor`` and ``eager``), steps are timed after a device synchronize, and the
table adds each system's peak CUDA memory (``torch.cuda.max_memory_allocated``, the
largest rank's). DeepSpeed is not run there (its CPU accelerator is what this script
sets up). ``benchmarks/device.sh`` runs it on a lent GPU machine.

Output: a table on the terminal, ``--json`` (default ``bench_train.json``) and
``--chart`` (default ``bench_train.png``, needs matplotlib: ``pip install -e '.[bench]'``);
each run's raw figures and output are kept in ``bench_train_logs/`` beside the JSON.
Peak memory is each rank's peak resident set (the process, torch included): what the
host holds, the code each system imports among it (importing Dynamo, AOTAutograd and
Inductor and compiling one function adds 129 MiB to a process here, to
``fsdp2-compile``'s and DCIR's rows alike), and what glibc's heap keeps of freed
tensors. ``--allocator-peak`` adds the figure a GPU's
``torch.cuda.max_memory_allocated`` gives: every row runs once more, one measured step
under torch's memory profiler, and "alloc MiB" is the largest rank's allocator peak over
that step (the tensors it holds and allocates; a DCIR row adds its shared-memory outbox,
which is mapped rather than allocated), "x fsdp2 alloc" that over the FSDP2 baseline
row's. Exposed communication is the host time DCIR's ranks spent blocked in
``comm.wait`` per step (the slowest rank's), for collectives and, with offload, for host
copies; the others have no such counter ("n/a"). Sent is the bytes a rank hands to
collectives per step, as DCIR's runtime counts them (the largest rank's; "n/a" for the
others); "faults/step" the minor page faults a rank's process took per measured step
(the most any rank took, median over steps), each a fresh 4 KiB page touched for the
first time: what glibc's handing large freed blocks back and mapping them anew costs
(``--malloc``), which no profile of the ops sees; and "x fp32" a bf16 row's step time
over its fp32 row's in the same run.

``--malloc keep`` runs every system's processes alike with glibc malloc keeping freed
memory for reuse (``MALLOC_MMAP_MAX_=0``, no trimming), as a GPU caching allocator
does: no step after the first faults fresh pages in, which otherwise takes much of the
time of the ops that write large tensors (22 ms for 64 MiB here) and depends on the
allocator's history (docs/simulator.md, "page faults"); resident memory then stays at
its peak. ``--malloc release`` does the opposite: every block of 64 KiB or more is mapped
when allocated and unmapped when freed (``MALLOC_MMAP_THRESHOLD_=65536``, a fixed
threshold glibc then does not raise), so a rank's peak resident memory follows its live
tensors rather than what the heap kept (bench_activations.py measures peaks that way);
every such allocation faults its pages in. The default, ``system``, leaves malloc as the
environment configures it.

``--init meta`` starts the sharded systems without the full model: the Llama is built
under ``torch.device("meta")`` and ``dcir.initialize`` initializes each rank's shards;
FSDP2 runs its recipe (``fully_shard``, ``to_empty``, ``initialize_weights()``);
DeepSpeed ZeRO-3 builds under ``deepspeed.zero.Init``. ``floor``, ``eager`` (one
process, nothing sharded), ``floor-busy`` (a whole copy per process) and DeepSpeed
ZeRO-1/2 build the model with its values as with ``--init real`` (train_worker.py).
"x floor" is a row's median step over the faster of ``floor`` and ``eager`` (one
process, compiled or not); "x fsdp2 speed" is
the faster FSDP2 row's median step over a row's (``fsdp2`` or ``fsdp2-compile``; above
1: faster than FSDP2), "x fsdp2 RSS" a row's peak RSS over that row's, all in the same
run (the report's ``baselines`` and the table's last line say which rows; a bf16 row's
ratios are against the same in bf16: the faster of ``floor-bf16`` and ``eager-bf16``, and
of ``fsdp2-bf16`` and ``fsdp2-compile-bf16``); "start RSS
MiB" the peak before the first step (building, sharding and initializing the model, and
DCIR's capture; the largest rank's); "first
step s" the time from a rank's process start to the end of its first step (start-up,
model, capture, first step; the slowest rank's, median over rounds). ``--rss-trace``
makes every rank log its resident and peak memory at each stage, and after its last step
its resident memory by what maps it (in ``bench_train_logs/*.log``). ``--trace`` makes
every DCIR run trace one more step after its measured ones (not measured):
``bench_train_logs/<system>-<round>-trace/rank<N>.json``, Chrome traces with the measured
and predicted schedule (``docs/simulator.md``, "Reading a trace";
``benchmarks/trace_lateness.py`` reads them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: ``--malloc``: the environment every system's processes get alike (glibc malloc's tunables)
MALLOC = {"system": {},
          "keep": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)},
          "release": {"MALLOC_MMAP_THRESHOLD_": "65536"}}
SYSTEMS = ["floor", "eager", "floor-bf16", "eager-bf16", "floor-busy", "dcir", "dcir-prefetch", "dcir-unshard",
           "dcir-optimized", "dcir-inductor", "dcir-fused", "dcir-zero1", "dcir-zero2", "dcir-offload", "dcir-bf16",
           "dcir-fused-bf16", "dcir-recompute", "dcir-recompute-fused", "fsdp2", "fsdp2-offload", "fsdp2-bf16",
           "fsdp2-ckpt", "fsdp2-compile", "fsdp2-compile-bf16", "fsdp2-compile-budget", "deepspeed-zero1",
           "deepspeed-zero2", "deepspeed", "deepspeed-offload", "dcir-break", "fsdp2-break"]
#: the systems given a memory_budget (``--activation-budget``), whose cycle plans recompute within it
RECOMPUTING = ("dcir-recompute", "dcir-recompute-fused")
WORKLOAD = [("layers", 6), ("hidden", 256), ("seq", 128), ("batch", 4), ("vocab", 32000), ("accumulate", 1),
            ("intermediate", 0), ("experts", 0)]  # intermediate 0: 4 x hidden; experts 0: a Llama, N: a Mixtral
#: ``--model``: workload values that differ from WORKLOAD's defaults; the regimes of training (the
#: default: per-op overhead and communication; long: compute, the activations; wide: large
#: matrices; moe: routed experts)
MODELS = {"default": {}, "100m": {"layers": 12, "hidden": 768, "intermediate": 2048, "seq": 64, "batch": 1},
          "long": {"layers": 4, "seq": 1024, "vocab": 4096},
          "wide": {"layers": 2, "hidden": 1024, "vocab": 4096},
          "moe": {"layers": 4, "seq": 256, "vocab": 4096, "experts": 4, "intermediate": 512}}


def _available(system: str, device: str = "cpu") -> str | None:
    """Why ``system`` cannot run here, or None."""
    if system.startswith("deepspeed") and device == "cuda":
        return "not run with --device cuda (this script sets DeepSpeed up on its CPU accelerator)"
    if system.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "not installed (pip install -e '.[bench]')"
    return None


def memory_budget(probe: dict, fraction: str) -> int:
    """``dcir-recompute``'s ``memory_budget`` (bytes per rank) for ``--activation-budget``:
    what a rank holds whatever the schedule, plus the shared-memory outbox, plus
    ``fraction`` of the step's own memory without recompute (``min``: the step's peak with
    every activation ``recompute`` can rebuild rebuilt), all as the plain ``zero3``
    engine of ``probe`` accounts them (its largest rank: ``train_worker.Dcir.accounting``)."""
    return max(a["fixed"] + a["outbox"] + _step_part(a, fraction) for a in probe["accounted"])


def step_allowance(probe: dict, fraction: str) -> int:
    """The part of ``memory_budget(probe, fraction)`` left to the step itself (bytes per
    rank, its largest rank's): what the step may allocate over what the rank holds
    between steps."""
    return max(_step_part(a, fraction) for a in probe["accounted"])


def _step_part(accounted: dict, fraction: str) -> int:
    return int(accounted["least_step_peak"] if fraction == "min" else float(fraction) * accounted["step_peak"])


def probe(ns, logs: Path) -> dict:
    """One step of plain ``dcir`` on the workload, for what ``memory_budget`` needs (cached
    in ``logs``: the memory model's figures do not depend on timing, only on the workload
    and on the compiler's code, whose hash is part of the key)."""
    from dcir_runtime.program_cache import sources_digest

    out = logs / "dcir-probe.json"
    key = {n: getattr(ns, n) for n, _ in WORKLOAD} | {"world": ns.world, "init": ns.init, "transport": ns.transport,
                                                      "accumulate_gradients": ns.accumulate_gradients,
                                                      "code": sources_digest()[:16]}
    if out.exists() and json.loads(out.read_text()).get("key") == key:
        return json.loads(out.read_text())
    out.unlink(missing_ok=True)
    result = _run("dcir", argparse.Namespace(**{**vars(ns), "steps": 1, "warmup": 0, "trace": False}), out)
    if result is None:
        raise SystemExit("the dcir probe for --activation-budget failed; see " + str(out.with_suffix(".log")))
    result["key"] = key
    out.write_text(json.dumps(result))
    return result


#: a DCIR row's suffix when it runs over the process-group transport beside the shared-memory one
#: (``--transport both``)
OVER_PG = "+pg"


def over(system: str, ns) -> tuple[str, argparse.Namespace]:
    """The worker's system for a row, and the options it runs with: a ``+pg`` row is its
    DCIR system over the process group; under ``--transport both`` the others run as
    ``auto`` (shared memory on one CPU host)."""
    if system.endswith(OVER_PG):
        return system.removesuffix(OVER_PG), argparse.Namespace(**{**vars(ns), "transport": "process_group"})
    if ns.transport == "both":
        return system, argparse.Namespace(**{**vars(ns), "transport": "auto"})
    return system, ns


def rows_of(systems: list[str], transport: str) -> list[str]:
    """The rows a run measures: each system, and under ``--transport both`` each DCIR
    system again over the process group, beside it."""
    both = transport == "both"
    return [row for s in systems for row in ((s, s + OVER_PG) if both and s.startswith("dcir") else (s,))]


def _run(system: str, ns, out: Path, extra: tuple[str, ...] = (), env: dict | None = None) -> dict | None:
    """One launch of ``system``, a row (``over``) (``extra``: more worker arguments;
    ``env``: more environment)."""
    from dcir_runtime.launch import launch

    system, ns = over(system, ns)
    args = [str(HERE / "train_worker.py"), system, str(out), "--steps", str(ns.steps), "--warmup", str(ns.warmup),
            *extra]
    for name, _ in WORKLOAD:
        args += [f"--{name}", str(getattr(ns, name))]
    args += ["--device", ns.device, "--init", ns.init, "--transport", ns.transport,
             "--accumulate-gradients", ns.accumulate_gradients]
    if system in RECOMPUTING and ns.activation_budget != "none":
        args += ["--memory-budget", str(memory_budget(probe(ns, out.parent), ns.activation_budget))]
    if system == "fsdp2-compile-budget":
        args += ["--compile-budget", str(ns.compile_budget)]
    args += ["--rss-trace"] if ns.rss_trace else []
    args += ["--allocated"] if getattr(ns, "allocated", False) else []  # allocator_run's
    if ns.trace and system.startswith("dcir"):
        args += ["--trace", str(out.with_name(out.stem + "-trace"))]
    world = world_of(system, ns)
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"} | MALLOC[ns.malloc] | (env or {})
    with open(out.with_suffix(".log"), "w") as log:
        code = _launch_quiet(launch, args, world, env, log, ns.timeout)
    if code != 0 or not out.exists():
        print(f"  {system}: failed (exit {code}); its output: {out.with_suffix('.log')}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def world_of(system: str, ns) -> int:
    """The processes a (worker) system runs: one for the single-process floors, ``--world``
    for the others, ``floor-busy`` included."""
    return 1 if system in BASELINES["floor"] + BASELINES["floor-bf16"] else ns.world


def _launch_quiet(launch, args, world, env, log, timeout) -> int:
    """The ranks' output goes to ``log``, not the terminal."""
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        return launch(args, world, timeout_s=timeout, env=env, grace_s=10)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _max(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def allocator_run(system: str, ns, out: Path) -> dict | None:
    """One more run of ``system``, one measured step under torch's memory profiler
    (``train_worker.py --allocated``): its result, when every rank reported its
    allocator peak, else None."""
    out.unlink(missing_ok=True)
    result = _run(system, argparse.Namespace(**{**vars(ns), "steps": 1, "allocated": True}), out)
    return result if result and all(result["allocated"]) else None


def allocated_mib(result: dict) -> float:
    """An allocator run's peak memory per rank (the largest rank's, MiB): the allocator's
    peak over the step, and for DCIR the rank's shared-memory outbox, which is mapped
    rather than allocated (``accounted``'s ``outbox``; none over the process group)."""
    accounted = result.get("accounted") or [None] * len(result["allocated"])
    return max(a["peak"] + (mine["outbox"] / 2**20 if mine else 0) for a, mine in zip(result["allocated"], accounted))


def kept_program(result: dict) -> str | None:
    """The program a DCIR run kept: the pipeline of the last plan its optimization cycle
    switched to, "captured" when it took none; None for a system without the cycle."""
    log = result.get("optimize_log")
    if log is None:
        return None
    return next((r["pipeline"] for r in reversed(log) if r["switched"]), "captured")


def summarize(runs: dict[str, list[dict]], ns, allocated: dict[str, dict] | None = None) -> dict:
    """Each system's row: its runs pooled (``runs``), each ratio against its baseline row;
    ``allocated``: the allocator runs (``allocator_run``) of the systems that had one."""
    allocated = allocated or {}
    tokens = ns.batch * ns.seq * ns.accumulate  # per rank and step
    rows = {}
    for system, results in runs.items():
        if not results:
            continue
        steps = [t for r in results for t in r["step_s"]]
        waits = [w for r in results if r["wait_s"] for w in r["wait_s"]]
        sent = [b for r in results for b in r.get("sent_bytes") or () if b is not None]
        rows[system] = {
            "step_s": statistics.median(steps),
            "step_s_min": min(steps), "step_s_max": max(steps), "measured_steps": len(steps),
            "tokens_per_s_per_rank": tokens / statistics.median(steps),
            "peak_rss_mib": max(m for r in results for m in r["peak_rss_mib"]),
            "start_rss_mib": _max([m for r in results for m in r.get("start_rss_mib") or ()]),
            "peak_cuda_mib": _max([m for r in results for m in r.get("peak_cuda_mib") or ()]),
            "exposed_comm_s": statistics.median(waits) if waits else None,
            "predicted_s": _median([r.get("predicted_s") for r in results]),
            "sent_bytes_per_step": statistics.median(sent) if sent else None,
            "minor_faults_per_step": _median([f for r in results for f in r.get("minor_faults") or ()]),
            "first_step_s": _median([r.get("first_step_s") for r in results]),
            "init": results[0].get("init", "real"),  # how this system built the model (floor: always real)
            "allocated_mib": allocated_mib(allocated[system]) if system in allocated else None,
            "allocated_program": kept_program(allocated[system]) if system in allocated else None,
        }
    base = baselines(rows)
    for system, row in rows.items():
        floor, fsdp2 = (rows.get(base[name + precision(system)]) for name in ("floor", "fsdp2"))
        fsdp2 = fsdp2 or {}
        row["x_floor"] = row["step_s"] / floor["step_s"] if floor else None
        row["x_fsdp2_speed"] = fsdp2["step_s"] / row["step_s"] if fsdp2 else None
        row["x_fsdp2_rss"] = row["peak_rss_mib"] / fsdp2["peak_rss_mib"] if fsdp2 else None
        row["x_fsdp2_allocated"] = (row["allocated_mib"] / fsdp2["allocated_mib"]
                                    if fsdp2.get("allocated_mib") and row["allocated_mib"] is not None else None)
        fp32 = rows.get(system.replace("-bf16", "", 1)) if "-bf16" in system else None  # dcir-bf16+pg: dcir+pg
        row["x_fp32"] = row["step_s"] / fp32["step_s"] if fp32 else None
    return rows


#: the rows a ratio may be against: the compute floor is the faster of one process compiled and
#: eager; FSDP2 is its faster fp32 variant, eager or each block compiled (torchtitan's recipe).
#: A bf16 row (``precision``) is against the same in bf16: the floors in FSDP2's bf16 policy,
#: and FSDP2 in it, eager or each block compiled
BASELINES = {"floor": ("floor", "eager"), "fsdp2": ("fsdp2", "fsdp2-compile"),
             "floor-bf16": ("floor-bf16", "eager-bf16"), "fsdp2-bf16": ("fsdp2-bf16", "fsdp2-compile-bf16")}


def precision(system: str) -> str:
    """A row's precision, as BASELINES' names end: "-bf16" for a bf16 row (``dcir-bf16+pg``
    included), else ""."""
    return "-bf16" if "-bf16" in system else ""


def baselines(rows: dict) -> dict[str, str | None]:
    """Which row each ratio is against (``BASELINES``): the fastest of its candidates
    that ran, else None."""
    return {name: min((s for s in among if s in rows), key=lambda s: rows[s]["step_s"], default=None)
            for name, among in BASELINES.items()}


def table(rows: dict, unavailable: dict) -> str:
    cuda = any(r.get("peak_cuda_mib") is not None for r in rows.values())
    alloc = any(r.get("allocated_mib") is not None for r in rows.values())
    w = max(map(len, [*rows, *unavailable, "system"])) + 2  # the system column: its longest name, two spaces
    head = (f"{'system':<{w}}{'init':<6}{'step s':>9}{'x floor':>9}{'x fsdp2 speed':>15}{'tok/s/rank':>12}"
            f"{'peak RSS MiB':>14}"
            + (f"{'peak CUDA MiB':>15}" if cuda else "") + f"{'exposed comm s':>16}{'predicted s':>13}"
            + f"{'sent MiB/step':>15}{'faults/step':>13}{'x fp32':>8}{'x fsdp2 RSS':>12}{'start RSS MiB':>15}"
            + f"{'first step s':>14}"
            + (f"{'alloc MiB':>11}{'x fsdp2 alloc':>15}" if alloc else ""))
    lines = [head, "-" * len(head)]
    for system, r in rows.items():
        x = f"{r['x_floor']:.2f}" if r["x_floor"] else "-"
        speed = f"{r['x_fsdp2_speed']:.2f}" if r.get("x_fsdp2_speed") else "-"
        comm = f"{r['exposed_comm_s']:.3f}" if r["exposed_comm_s"] is not None else "n/a"
        pred = f"{r['predicted_s']:.3f}" if r.get("predicted_s") is not None else "n/a"
        gpu = f"{r['peak_cuda_mib']:>15,.0f}" if cuda and r.get("peak_cuda_mib") is not None else (
            f"{'n/a':>15}" if cuda else "")
        sent = f"{r['sent_bytes_per_step'] / 2**20:.3f}" if r.get("sent_bytes_per_step") is not None else "n/a"
        faults = f"{r['minor_faults_per_step']:,.0f}" if r.get("minor_faults_per_step") is not None else "n/a"
        vs32 = f"{r['x_fp32']:.2f}" if r.get("x_fp32") else "-"
        rss = f"{r['x_fsdp2_rss']:.3f}" if r.get("x_fsdp2_rss") else "-"
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") is not None else "n/a"
        start = f"{r['start_rss_mib']:,.0f}" if r.get("start_rss_mib") is not None else "n/a"
        held = ""
        if alloc:
            held = (f"{r['allocated_mib']:>11,.0f}" if r.get("allocated_mib") is not None else f"{'n/a':>11}") + (
                f"{r['x_fsdp2_allocated']:>15.3f}" if r.get("x_fsdp2_allocated") else f"{'-':>15}")
        lines.append(f"{system:<{w}}{r.get('init', 'real'):<6}{r['step_s']:>9.3f}{x:>9}{speed:>15}"
                     f"{r['tokens_per_s_per_rank']:>12,.0f}{r['peak_rss_mib']:>14,.0f}{gpu}{comm:>16}{pred:>13}"
                     f"{sent:>15}{faults:>13}{vs32:>8}{rss:>12}{start:>15}{first:>14}{held}")
    for system, why in unavailable.items():
        lines.append(f"{system:<{w}}unavailable: {why}")
    base = baselines(rows)
    against = "speed, RSS and alloc" if alloc else "speed and RSS"
    lines.append(f"x floor against {base['floor'] or '-'}, x fsdp2 {against} against {base['fsdp2'] or '-'} "
                 f"(the faster of {' and '.join(BASELINES['floor'])}, of {' and '.join(BASELINES['fsdp2'])})")
    if any(precision(s) for s in rows):
        lines.append(f"bf16 rows: x floor against {base['floor-bf16'] or '-'}, x fsdp2 {against} against "
                     f"{base['fsdp2-bf16'] or '-'} (the faster of {' and '.join(BASELINES['floor-bf16'])}, of "
                     f"{' and '.join(BASELINES['fsdp2-bf16'])})")
    return "\n".join(lines)


def parameters(ns) -> int:
    """The benchmark model's parameter count (built on the meta device: no memory)."""
    from train_worker import llama

    return sum(p.numel() for p in llama(ns, meta=True).parameters())


def family(ns) -> str:
    """What the benchmark model is: a Llama, or with ``--experts`` a Mixtral."""
    return f"Mixtral ({ns.experts} experts, top-2)" if ns.experts else "Llama"


def workload_of(ns) -> None:
    """Fills the workload flags left unset: ``--model``'s preset, else WORKLOAD's default
    (intermediate: 4 x hidden)."""
    for name, default in WORKLOAD:
        if getattr(ns, name) is None:
            setattr(ns, name, MODELS[ns.model].get(name, default))
    ns.intermediate = ns.intermediate or 4 * ns.hidden


def chart(rows: dict, path: Path, title: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install -e '.[bench]')"
    names = list(rows)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(names, [rows[n]["step_s"] for n in names], color=["#888" if n == "floor" else "#3b7dd8" for n in names])
    for b, n in zip(bars, names):
        if rows[n]["x_floor"]:
            ax.annotate(f"{rows[n]['x_floor']:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("median step time (s)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def _fraction(text: str) -> str:
    """``--activation-budget``: a fraction in (0, 1], ``min`` or ``none``."""
    if text in ("min", "none"):
        return text
    try:
        ok = 0 < float(text) <= 1
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction in (0, 1], 'min' or 'none'")
    return text


def check_full_accumulation(ap, ns, systems: list[str]) -> None:
    """``--accumulate-gradients full`` changes what each row's micro-steps send: refused
    where there is one micro-step, or a row that cannot accumulate that way."""
    if ns.accumulate == 1:
        ap.error("--accumulate-gradients full sums the micro-steps' gradients: give --accumulate above 1")
    cannot = [s for s in systems if s.startswith("deepspeed") or s == "dcir-zero2"]
    if cannot:
        ap.error(f"--accumulate-gradients full: {', '.join(cannot)} reduce every micro-step (DeepSpeed's ZeRO-2 and "
                 f"-3 refuse no_sync; dcir-zero2 summing full gradients is dcir-zero1): leave them out")


def parser() -> argparse.ArgumentParser:
    from dcir_runtime.config import TRANSPORTS  # imports torch: not at the script's start

    ap = argparse.ArgumentParser(prog="bench_train.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    for name, default in WORKLOAD:
        ap.add_argument(f"--{name}", type=int, default=None, help=f"(default {default}, or --model's)")
    ap.add_argument("--model", choices=sorted(MODELS), default="default",
                    help="a workload preset (flags given explicitly win): 100m, a 134 M-parameter Llama, batch 1 x 64 "
                         "tokens; long, sequence 1,024 (4 layers, vocabulary 4,096); wide, hidden 1,024 (2 layers, "
                         "vocabulary 4,096); moe, a Mixtral of 4 layers, 4 experts of 512 each, top-2, sequence "
                         "256, vocabulary 4,096 (default: default)")
    ap.add_argument("--init", choices=("real", "meta"), default="real",
                    help="real: every rank builds the model with its values; meta: the sharded systems build it on "
                         "the meta device and initialize only their shards (default real)")
    ap.add_argument("--rss-trace", action="store_true", help="each rank logs its RSS at each stage, and "
                    "after the last step its resident memory by kind (anonymous, shared memory, libraries, files)")
    ap.add_argument("--trace", action="store_true",
                    help="each DCIR run traces one more step after the measured ones (Chrome JSON per rank in "
                         "bench_train_logs/<system>-<round>-trace/)")
    ap.add_argument("--transport", choices=(*TRANSPORTS, "both"), default="auto",
                    help="the DCIR systems' transport for gathers and reduce-scatters (the Engine's config key "
                         "'transport'; default auto: shared memory with every rank on one CPU host); both: each "
                         "DCIR system also runs over the process group, as the row SYSTEM+pg beside it")
    ap.add_argument("--malloc", choices=sorted(MALLOC), default="system",
                    help="system: glibc malloc as configured (large blocks are mapped fresh, and their pages "
                         "faulted in, each time); keep: every system's processes alike keep freed memory for "
                         "reuse, as a GPU caching allocator does (MALLOC_MMAP_MAX_=0, no trimming; resident "
                         "memory stays at its peak); release: every block of 64 KiB or more is mapped when "
                         "allocated and unmapped when freed (MALLOC_MMAP_THRESHOLD_=65536, which also stops glibc "
                         "raising the threshold), so resident memory follows the live tensors. Default system")
    ap.add_argument("--activation-budget", default="0.6", type=_fraction,
                    help="dcir-recompute's and dcir-recompute-fused's memory_budget: what a rank holds whatever "
                         "the schedule and the outbox, plus this fraction of the step's own memory without recompute, as plain dcir accounts "
                         "them on a one-step probe run; 'min': the step with everything rebuildable recomputed; "
                         "'none': no budget (default 0.6)")
    ap.add_argument("--compile-budget", type=float, default=0.5,
                    help="fsdp2-compile-budget's torch._functorch.config.activation_memory_budget (default 0.5)")
    ap.add_argument("--allocator-peak", action="store_true",
                    help="after the rounds, every row runs once more, one measured step under torch's memory "
                         "profiler: 'alloc MiB' is the largest rank's allocator peak over that step (the tensors "
                         "it holds and allocates, what torch.cuda.max_memory_allocated gives on a GPU; a DCIR row "
                         "adds its shared-memory outbox), 'x fsdp2 alloc' that over the FSDP2 baseline's (CPU)")
    ap.add_argument("--accumulate-gradients", choices=("shard", "full"), default="shard",
                    help="under --accumulate: shard reduce-scatters every micro-step's gradients (FSDP2's and "
                         "DeepSpeed's default); full sums them in full gradients and reduces once per optimizer "
                         "step (DCIR's accumulate_gradients 'full', FSDP2's set_requires_gradient_sync(False) on "
                         "the early micro-steps), for DCIR's ZeRO-3 and the FSDP2 rows; not with DeepSpeed's "
                         "rows, whose ZeRO-2 and -3 reduce every micro-step, nor dcir-zero2 (default shard)")
    ap.add_argument("--world", type=int, default=2, help="ranks of the distributed systems (default 2)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu (gloo, 1 thread per rank) or cuda (one GPU per rank, NCCL); default cpu")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per run (default 5)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="steps before measuring, per run (default 5); a DCIR run warms up longer while its "
                         "optimization cycle still profiles (steps 2-4), tries a plan against the program it "
                         "replaces (4 steps a side) or compiles a plan's stretches, and each round's other rows "
                         "then warm up as long as its longest DCIR run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated (default {','.join(SYSTEMS)})")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    ap.add_argument("--json", default="bench_train.json", help="where to write the results")
    ap.add_argument("--chart", default="bench_train.png", help="where to draw the chart")
    return ap


def main(argv=None) -> int:
    ap = parser()
    ns = ap.parse_args(argv)
    workload_of(ns)
    systems = [s.strip() for s in ns.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    unavailable = {s: why for s in systems if (why := _available(s, ns.device))}
    if ns.accumulate_gradients == "full":
        check_full_accumulation(ap, ns, systems)
    if ns.allocator_peak and ns.device != "cpu":
        ap.error("--allocator-peak measures the CPU allocator; on a GPU the table's peak CUDA MiB is that figure")
    if ns.device == "cpu":
        unavailable["deepcompile"] = "DeepSpeed's compiler needs CUDA (cuda.h); this machine has no GPU"
    runnable = rows_of([s for s in systems if s not in unavailable], ns.transport)
    workload = ", ".join(f"{n} {getattr(ns, n)}" for n, _ in WORKLOAD)
    where = "1 GPU per rank (NCCL)" if ns.device == "cuda" else "1 thread per rank"
    count = parameters(ns)
    summed = "; gradients summed in full across micro-steps" if ns.accumulate_gradients == "full" else ""
    print(f"{family(ns)} {count / 1e6:.1f} M parameters ({workload}{summed}); init {ns.init}; malloc {ns.malloc}; "
          f"world {ns.world}, {where}; "
          f"{ns.rounds} rounds x {ns.steps} steps (+{ns.warmup} warm-up), interleaved")
    runs: dict[str, list[dict]] = {s: [] for s in runnable}
    begin = time.time()
    logs = Path(ns.json).resolve().parent / "bench_train_logs"  # each run's JSON and output
    logs.mkdir(exist_ok=True)
    for r in range(ns.rounds):
        warmup = ns.warmup  # the others warm up as long as this round's longest DCIR run
        for system in sorted(runnable, key=lambda s: not s.startswith("dcir")):
            out = logs / f"{system}-{r}.json"
            out.unlink(missing_ok=True)
            dcir = system.startswith("dcir")
            result = _run(system, ns if dcir else argparse.Namespace(**{**vars(ns), "warmup": warmup}), out)
            if result:
                runs[system].append(result)
                warmup = max(warmup, result["warmup_steps"]) if dcir else warmup
                print(f"  round {r + 1}: {system:<18} median step {statistics.median(result['step_s']):.3f} s "
                      f"(+{result['warmup_steps']} warm-up)", flush=True)
    allocated = {}
    for system in runnable if ns.allocator_peak else ():  # one more run each, under the memory profiler
        if (result := allocator_run(system, ns, logs / f"{system}-allocated.json")) is not None:
            allocated[system] = result
            kept = kept_program(result)
            print(f"  allocator peak: {system:<18} {allocated_mib(result):.1f} MiB"
                  + (f", running {kept}" if kept else ""), flush=True)
    rows = summarize(runs, ns, allocated)
    print()
    print(table(rows, unavailable))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    import torch

    if ns.device == "cuda":
        machine = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; {machine}"
    setting = {"world": ns.world, "threads_per_rank": 1, "device": ns.device, "init": ns.init, "malloc": ns.malloc,
               "model": ns.model, "parameters": count, "accumulate_gradients": ns.accumulate_gradients}
    report = {"workload": {n: getattr(ns, n) for n, _ in WORKLOAD} | setting, "baselines": baselines(rows),
              "rounds": ns.rounds, "steps": ns.steps, "warmup": ns.warmup, "machine": machine,
              "torch": torch.__version__, "seconds": round(time.time() - begin), "results": rows,
              "unavailable": unavailable, "command": "python benchmarks/bench_train.py " + " ".join(argv or sys.argv[1:])}
    Path(ns.json).write_text(json.dumps(report, indent=1))
    problem = chart(rows, Path(ns.chart),
                    f"{family(ns)} {ns.layers} layers, world {ns.world}: median step (x compute floor)")
    print(f"\n{ns.json}" + (f", {ns.chart}" if problem is None else f"; {problem}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
