"""Trace one training step of a rank into a Chrome trace, measured rows above predicted.

``Engine.trace(path)`` arms a ``Tracer`` for the next optimizer step (``dcir-train
--trace DIR`` does it for the last step, one file per rank). The step runs as
scheduled, op by op under the profiler's interpreter (``dcir_runtime.profiler``)
without its profiling waits, so transfers overlap compute as they do in training.
What the rows show (``docs/simulator.md``, "Reading a trace"):

* ``compute``: every op's host time; an async op's slice is its launch, a wait's
  slice is the time it blocked;
* ``communication`` and ``host copies``: a transfer from its launch to the end of the
  wait that joins it, one at a time per row as the lanes run them. The host cannot see
  a transfer end earlier than someone waits for it, so a slice is an upper bound on
  the transfer when its wait did not block;
* ``live bytes``: the bytes the profiler follows while each op runs;
* the predicted rows and counter (``dcir.trace``) of the same program, each function
  placed where its measured run started.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch.fx as fx

from dcir import ops as registry
from dcir import trace as chrome
from dcir.ir import Module
from dcir.sim import COMPUTE, lane_of
from dcir_runtime.profiler import Profile


class Tracer:
    """Records the functions one step runs, then writes ``path``."""

    def __init__(self, module_of: Callable[[], Module], path: str | Path, rank: int,
                 budget_of: Callable[[], int | None] = lambda: None):
        self.module_of = module_of  # the program running when the traced step starts
        self.path = Path(path)
        self.rank = rank
        self.budget_of = budget_of  # the memory budget the step's own memory has (drawn as a counter)
        self.profile: Profile | None = None

    @property
    def recorded(self) -> bool:
        return self.profile is not None

    @property
    def module(self) -> Module:
        return self.profile.module

    def run(self, name: str, gm: fx.GraphModule, *args):
        """Run function ``name`` as scheduled, recording when each op ran."""
        if self.profile is None:
            self.profile = Profile(self.module_of())
        return self.profile.run(name, gm, *args, sync=False)

    def write(self) -> Path:
        """Write the measured and predicted rows of what was recorded."""
        runs = [(name, rec) for name, recs in self.profile.runs.items() for rec in recs]
        origin = min((s[1] for _, rec in runs for s in rec.spans), default=0.0)
        pid = self.rank
        events = chrome.metadata(pid, f"rank {pid}", chrome.MEASURED_ROWS)
        starts: dict[str, float] = {}
        for name, rec in runs:
            func = self.module.functions[name]
            span: dict[int, tuple[float, float]] = {}
            for k, begin, end in rec.spans:
                b, e = span.get(k, (begin, end))
                span[k] = (min(b, begin), max(e, end))
            us = {k: ((b - origin) * 1e6, (e - origin) * 1e6) for k, (b, e) in span.items()}
            if us:
                starts.setdefault(name, min(b for b, _ in us.values()))
            events += _measured(func, us, rec.mem, rec.faults, pid)
        events += chrome.predicted(self.module, None, pid, starts, self.budget_of())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        chrome.write(self.path, events)
        return self.path


def _measured(func, us: dict[int, tuple[float, float]], mem: list[int], faults: list[int],
              pid: int) -> list[dict]:
    rows, out = chrome.MEASURED_ROWS, []
    joined_at: dict = {}  # pending value -> end of the wait that joins it
    for k, op in enumerate(func.ops):
        if k in us and registry.has_trait(op, registry.WAITS):
            for v in op.operands:
                joined_at.setdefault(v, us[k][1])
    free = {lane: 0.0 for lane in rows}
    for k, op in enumerate(func.ops):
        if k not in us:
            continue
        b, e = us[k]
        args = {"function": func.name, "op": k}
        cat, extra = chrome.category(op, COMPUTE)
        out.append({"ph": "X", "pid": pid, "tid": rows[COMPUTE], "name": chrome.slice_name(op), "cat": cat,
                    "ts": b, "dur": max(e - b, 0.001), "args": args | extra | {"page faults": faults[k]}})
        out.append({"ph": "C", "pid": pid, "name": "live bytes", "ts": b, "args": {"bytes": mem[k]}})
        lane = lane_of(op)
        if lane == COMPUTE:
            continue
        begin = max(e, free[lane])
        end = max(begin, max((joined_at.get(r, e) for r in op.results), default=e))
        free[lane] = end
        out.append({"ph": "X", "pid": pid, "tid": rows[lane], "name": chrome.slice_name(op), "cat": lane,
                    "ts": begin, "dur": max(end - begin, 0.001), "args": args})
    return out
