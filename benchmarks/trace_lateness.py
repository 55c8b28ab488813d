"""How long the ranks wait for each other, from the Chrome traces of one step.

    dcir-train --trace DIR            # or Engine.trace(DIR): DIR/rank<N>.json
    python benchmarks/trace_lateness.py DIR

The profile that prices a transfer keeps the fastest rank's time (``_agree`` in
``runtime/profiler.py``): the rank that launched it last, which waits only for the
bytes. The others also wait for that rank to arrive, which the simulator has no term
for. Per ``comm.wait`` of the traced step (the measured compute row of every rank, in
order; the ranks run the same program), this prints:

* each rank's measured waits, summed;
* the fastest rank's wait at each, summed (what the transfers cost without lateness);
* the simulator's predicted waits (the trace's predicted compute row, rank 0);
* the lateness: a rank's wait minus the fastest, summed per rank;
* a least-squares fit of the ranks' mean lateness at a wait against their mean
  compute since the previous wait, ``lateness = a + b * compute``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dcir.sim import COMPUTE
from dcir.trace import MEASURED_ROWS, PREDICTED_ROWS

WAIT = "comm.wait"


@dataclass
class Lateness:
    waits_s: list[float]      # per rank: its measured waits, summed
    fastest_s: float          # the fastest rank's wait at each wait, summed
    predicted_s: float | None  # the simulator's waits (rank 0's predicted row), summed
    late_s: list[float]       # per rank: its waits minus the fastest's, summed
    fixed_s: float            # the fit's a: lateness at a wait after no compute
    per_compute: float        # the fit's b: lateness per second of compute since the previous wait
    count: int                # waits per rank

    def report(self) -> str:
        pred = f"{self.predicted_s * 1e3:.1f} ms" if self.predicted_s is not None else "n/a"
        return "\n".join([
            f"{self.count} waits per rank",
            "measured waits per rank: " + ", ".join(f"{s * 1e3:.1f} ms" for s in self.waits_s),
            f"the fastest rank's wait at each, summed: {self.fastest_s * 1e3:.1f} ms (predicted: {pred})",
            "lateness per rank: " + ", ".join(f"{s * 1e3:.1f} ms" for s in self.late_s),
            f"fit: lateness at a wait = {self.fixed_s * 1e6:.0f} us + {self.per_compute:.3f} x the compute "
            "since the previous wait",
        ])


def _row(events: list[dict], tid: int) -> list[dict]:
    return sorted((e for e in events if e.get("ph") == "X" and e.get("tid") == tid), key=lambda e: e["ts"])


def waits(events: list[dict], tid: int = MEASURED_ROWS[COMPUTE]) -> list[tuple[float, float]]:
    """(wait seconds, compute seconds since the previous wait) for each wait of one
    rank's trace row ``tid``, in order."""
    out, compute = [], 0.0
    for e in _row(events, tid):
        if e["name"].startswith(WAIT):
            out.append((e["dur"] * 1e-6, compute))
            compute = 0.0
        else:
            compute += e["dur"] * 1e-6
    return out


def lateness(traces: dict[int, list[dict]]) -> Lateness:
    """The figures above from each rank's trace events (rank -> ``traceEvents``)."""
    if len(traces) < 2:
        raise ValueError(f"lateness needs the traces of at least 2 ranks, got {len(traces)}")
    per_rank = [waits(traces[r]) for r in sorted(traces)]
    counts = {len(w) for w in per_rank}
    if len(counts) != 1:
        raise ValueError(f"the ranks' traces hold different numbers of waits ({sorted(counts)}): "
                         "not the same step of the same program")
    wait = np.array([[w for w, _ in ws] for ws in per_rank])     # [rank, wait]
    compute = np.array([[c for _, c in ws] for ws in per_rank])
    fastest = wait.min(axis=0)
    late = wait - fastest
    fit = np.linalg.lstsq(np.stack([np.ones(wait.shape[1]), compute.mean(axis=0)], axis=1),
                          late.mean(axis=0), rcond=None)[0] if wait.shape[1] >= 2 else (0.0, 0.0)
    predicted = [w for w, _ in waits(traces[min(traces)], PREDICTED_ROWS[COMPUTE])]
    return Lateness(waits_s=wait.sum(axis=1).tolist(), fastest_s=float(fastest.sum()),
                    predicted_s=float(sum(predicted)) if predicted else None,
                    late_s=late.sum(axis=1).tolist(), fixed_s=float(fit[0]), per_compute=float(fit[1]),
                    count=wait.shape[1])


def load(directory: Path) -> dict[int, list[dict]]:
    files = sorted(directory.glob("rank[0-9]*.json"))
    if not files:
        raise ValueError(f"{directory}: no rank<N>.json traces (dcir-train --trace {directory})")
    return {int(f.stem.removeprefix("rank")): json.loads(f.read_text())["traceEvents"] for f in files}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir", type=Path, help="the directory of rank<N>.json traces of one step")
    ns = ap.parse_args(argv)
    try:
        print(lateness(load(ns.trace_dir)).report())
    except (ValueError, OSError) as e:
        print(f"trace_lateness: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
