"""Trials: a plan the cost model took runs against the program it would replace, on the
clock, before it stays (docs/passes.md, "The optimization cycle", step 5).

The cost model prices a plan from a profile that runs op by op and waits for every
transfer at once; it can be wrong about overlap, allocation, caches and compiled code,
and a plan faster on paper can be slower on the machine. So a plan it took goes on
trial: the plan runs ``steps`` steps, then the program it replaced runs as many again,
each side after one step that is not counted (the first after a profile or a switch:
planning, lowering, first calls, compiling; after it a full garbage collection clears
what the other program left, so no collection falls in a counted step, and the ranks
meet, so no rank's collection falls in another's: ``plan.collect_together``). A step is
timed from the end of one optimizer step to the end of the next, as a user's loop sees
it (its data and a loss computed outside included, the same on both sides). The plan
comes back and stays when, on every rank, its slowest counted step was faster than the
replaced program's fastest (``lead``); otherwise the program it replaced stays on and
the plan is not taken again (``Planner.rejected``). With 3 steps a side that is a
one-sided rank test: two programs equally fast fall that way 1 time in 20. It asks only
what it needs: a slow step of the program the plan would replace (a collection, a late
rank) counts against that program, where a test of the medians against the steps' spread
kept a plan out for it (on the benchmark's sequence 1,024, a plan 24% faster on every
step, against a spread of 28%). The record has the ranks' agreed figures: each side's
median and the lead (the largest and the least of the ranks'), the steps' spread (per
side, its slowest counted step less its fastest over its median; the larger side's, the
largest rank's), and each rank's own step times.
"""

from __future__ import annotations

import dataclasses
import statistics

import dcir
from dcir_runtime.group import ProcessGroup

SIDES = ("plan", "previous")


@dataclasses.dataclass
class Trial:
    """One plan on trial against ``previous``, the program running when it was planned;
    ``record`` is its cycle's entry of ``optimize_log``, which the verdict completes."""

    plan: dcir.Module
    previous: dcir.Module
    record: dict
    steps: int
    side: str = "plan"            # the side running now
    skip: bool = True             # the next step is a side's first: not counted
    due: bool = False             # a ``profile_at`` step came during the trial: profile after it
    times: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {side: [] for side in SIDES})

    def add(self, seconds: float) -> bool:
        """Count one step of the side running; returns whether that side has run its steps."""
        if self.skip:
            self.skip = False
            return False
        self.times[self.side].append(seconds)
        return len(self.times[self.side]) >= self.steps

    def next_side(self) -> dcir.Module:
        """The replaced program's turn: the module to switch to."""
        self.side, self.skip = "previous", True
        return self.previous

    def verdict(self, group: ProcessGroup) -> bool:
        """Whether the plan stays, agreed across ranks (``lead`` above 0 on every rank); the
        figures go into the record (``trial``: each side's median step, the lead and the
        steps' spread), its ``switched`` and ``reason``."""
        median = {side: group.most(statistics.median(self.times[side]), "a plan's trial") for side in SIDES}
        noise = group.most(max(spread(self.times[side]) for side in SIDES), "a plan's trial")
        margin = -group.most(-lead(self.times["plan"], self.times["previous"]), "a plan's trial")
        stays = margin > 0
        self.record["trial"] = {"previous_s": round(median["previous"], 6), "plan_s": round(median["plan"], 6),
                                "lead": round(margin, 4), "noise": round(noise, 4), "steps": self.steps,
                                "times": {side: [round(t, 6) for t in self.times[side]] for side in SIDES}}
        self.record.update(switched=stays, reason="faster" if stays else "measured slower")
        return stays


def lead(plan: list[float], previous: list[float]) -> float:
    """How far the plan's slowest step beat the other program's fastest, as a share of
    the other's median; 0 or below: some step of the plan was no faster than one of the other's."""
    return (min(previous) - max(plan)) / max(statistics.median(previous), 1e-9)


def spread(times: list[float]) -> float:
    """How far apart ``times`` lie, as a share of their median."""
    return (max(times) - min(times)) / max(statistics.median(times), 1e-9)
