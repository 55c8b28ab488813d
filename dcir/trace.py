"""Chrome trace JSON of a schedule: what the simulator predicts, as rows Perfetto draws.

The format is the Trace Event Format that ``chrome://tracing`` and Perfetto
(ui.perfetto.dev, "Open trace file") read: ``{"traceEvents": [...]}`` with complete
slices (``"ph": "X"``, microseconds), counters (``"ph": "C"``) and metadata naming
processes and threads. One process is one rank; its threads are the rows:

* ``compute``, ``communication``, ``host copies``: the three lanes (``dcir.sim``);
* a counter track of live bytes (the memory model's ``during``, per op), and beside it
  the part of them that is saved activations, offloaded activations (their device
  copies) and the part rebuilt in the backward (``dcir.memplot.split``), with the memory budget as a flat counter when one is given.

A recomputed op's slice (``act.recompute``: the ``recompute`` pass, or a checkpointed
region) is in category ``compute,recompute`` with ``recompute: true`` in its args, so
Perfetto's search (``cat:recompute``) picks out what the backward rebuilds; an
activation's copy to host memory and back (``act.offload``: the ``offload_activations``
pass) is in ``copy,offload`` with ``offload: true``.

Every slice is named by its IR op and first result (``comm.all_gather %w_full``), so a
row reads like the program; its args say the op's position, the function and, for a
wait, how long it stalled. ``dcir-opt --emit-trace`` writes the predicted rows alone;
``dcir-train --trace`` (``dcir_runtime.trace``) writes the measured rows beside the
predicted ones, offset so that both start where the measured function started.
"""

from __future__ import annotations

import json
from pathlib import Path

from dcir.activations import OFFLOAD, RECOMPUTE
from dcir.cost import Machine, calibrate
from dcir.ir import Module, Op
from dcir.memory import timelines
from dcir.memplot import split
from dcir.sim import COLLECTIVE, COMPUTE, COPY, Run, simulate

#: row (thread) ids per lane; predicted rows follow the measured ones
MEASURED_ROWS = {COMPUTE: 1, COLLECTIVE: 2, COPY: 3}
PREDICTED_ROWS = {COMPUTE: 11, COLLECTIVE: 12, COPY: 13}
ROW_NAMES = {COMPUTE: "compute", COLLECTIVE: "communication", COPY: "host copies"}
#: the parts of the live bytes drawn as counters of their own (``dcir.memplot`` categories)
PARTS = ("saved activations", "offloaded activations", "recomputed")


def slice_name(op: Op) -> str:
    """``comm.all_gather %w_full``: the op and the value it defines (or its first operand)."""
    vals = op.results or op.operands
    return f"{op.name} %{vals[0].name}" if vals else op.name


def metadata(pid: int, process: str, rows: dict[str, int], prefix: str = "") -> list[dict]:
    """Name the process and its rows (lanes)."""
    out = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": process}}]
    for lane, tid in rows.items():
        out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                    "args": {"name": f"{prefix}{ROW_NAMES[lane]}"}})
        out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    return out


def category(op: Op, lane: str) -> tuple[str, dict]:
    """A slice's category and extra args: ``lane``, and ``recompute`` for a rebuilt op,
    ``offload`` for an activation's copy."""
    for mark, kind in ((RECOMPUTE, "recompute"), (OFFLOAD, "offload")):
        if mark in op.attrs:
            return f"{lane},{kind}", {kind: True}
    return lane, {}


def run_events(run: Run, during: list[int], pid: int, t0_us: float, rows: dict[str, int],
               counter: str, parts: dict[str, list[int]] | None = None) -> list[dict]:
    """One simulated function as slices on ``rows``, from ``t0_us``, and its memory
    counter; ``parts``: counters of their own, named ``{counter}: {part}``, per op."""
    fname = run.func.name
    out = []
    for s in run.slices:
        cat, extra = category(s.op, s.lane)
        args = {"function": fname, "op": s.index, **extra}
        if s.stalled:
            args["stalled_us"] = round(s.stalled * 1e6, 3)
        out.append({"ph": "X", "pid": pid, "tid": rows[s.lane], "name": slice_name(s.op), "cat": cat,
                    "ts": t0_us + s.start * 1e6, "dur": max((s.end - s.start) * 1e6, 0.001), "args": args})
    for name, series in {counter: during, **{f"{counter}: {k}": v for k, v in (parts or {}).items()}}.items():
        out += counter_events(pid, name, [t0_us + run.start[i] * 1e6 for i in range(len(series))], series,
                              t0_us + run.end * 1e6)
    return out


def counter_events(pid: int, name: str, times_us: list[float], values: list[int], end_us: float) -> list[dict]:
    """A counter track: ``values[i]`` from ``times_us[i]``, back to 0 at ``end_us``."""
    out = [{"ph": "C", "pid": pid, "name": name, "ts": t, "args": {"bytes": v}} for t, v in zip(times_us, values)]
    if values:
        out.append({"ph": "C", "pid": pid, "name": name, "ts": end_us, "args": {"bytes": 0}})
    return out


def predicted(module: Module, machine: Machine | None, pid: int = 0,
              starts_us: dict[str, float] | None = None, budget: int | None = None) -> list[dict]:
    """The predicted rows of every function of ``module`` (links calibrated to its profile
    when it has one). ``starts_us``: where each function starts (default: one after the
    other, in module order); ``budget``: the memory budget's counter (bytes)."""
    machine = calibrate(module, machine)
    lines = timelines(module)
    parts = split(module, lines)
    out = metadata(pid, f"rank {pid}", PREDICTED_ROWS, "predicted ")
    at, spans = 0.0, []
    for name, func in module.functions.items():
        run = simulate(func, machine, module=module)
        t0 = (starts_us or {}).get(name, at)
        shown = {k: parts[name][k] for k in PARTS if any(parts[name][k])}
        out += run_events(run, lines[name].during, pid, t0, PREDICTED_ROWS, "predicted live bytes", shown)
        at = t0 + run.end * 1e6
        spans.append((t0, at))
    if budget is not None and spans:
        out += counter_events(pid, "memory budget", [min(t for t, _ in spans)], [budget], max(t for _, t in spans))
    return out


def write(path: str | Path, events: list[dict]) -> None:
    """Write ``events`` as a Chrome trace file."""
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
