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
replaced program's fastest (``lead``). With 3 steps a side that is a one-sided rank test
(Mann-Whitney's): two programs equally fast fall that way 1 time in 20. When the plan's
median step was faster on every rank but not all its steps were, the verdict waits: each
side runs as many steps again, and the plan stays when the rank test on all of them says
faster at 1 in 20 (of the pairs of a plan's step and the other's, at most
``allowed_slower_pairs`` with the plan's no faster: 7 of 36 at 6 steps a side).
Otherwise the program it replaced stays on and the plan is not taken again
(``Planner.rejected``). On the benchmark's sequence 1,024 the first look alone turned
down a plan 4% faster by its median (2.586, 2.499, 2.509 s against 2.628, 2.615, 2.572 s);
drawn from a normal spread of 2% of the step, such a plan passes the first look 62% of
the time and one of the two 93%, where two programs equally fast pass 7.8% of the time
(5% before). It asks only what it needs: a slow step of the program the plan would
replace (a collection, a late rank) counts against that program, where a test of the
medians against the steps' spread kept a plan out for it (on the same shape, a plan 24%
faster on every step, against a spread of 28%). The record has the ranks' agreed
figures: each side's median, the lead (the largest and the least of the ranks'), the
count of pairs the plan's step was no faster in (``slower_pairs``, the largest rank's)
and the most the look allowed (``allowed``), the steps' spread (per side, its slowest
counted step less its fastest over its median; the larger side's, the largest rank's),
and each rank's own step times, both looks' when there were two.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
    rounds: int = 1               # how many times each side has run (2 after ``again``)
    times: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {side: [] for side in SIDES})

    def add(self, seconds: float) -> bool:
        """Count one step of the side running; returns whether that side has run its steps."""
        if self.skip:
            self.skip = False
            return False
        self.times[self.side].append(seconds)
        return len(self.times[self.side]) >= self.steps * self.rounds

    def next_side(self) -> dcir.Module:
        """The replaced program's turn: the module to switch to."""
        self.side, self.skip = "previous", True
        return self.previous

    def verdict(self, group: ProcessGroup) -> bool | None:
        """Whether the plan stays, agreed across ranks; None: undecided, and each side runs
        as many steps again (``again``). At the first look the plan stays when every one of
        its steps beat every one of the other's (``lead`` above 0 on every rank). When it
        did not, but its median step did on every rank, the trial runs once more, and the
        plan then stays when the rank test on both looks' steps says faster at 1 in 20
        (``slower_pairs`` at most ``allowed_slower_pairs``). The figures go into the record
        (``trial``), its ``switched`` and ``reason``."""
        plan, previous = self.times["plan"], self.times["previous"]
        median = {side: group.most(statistics.median(self.times[side]), "a plan's trial") for side in SIDES}
        noise = group.most(max(spread(self.times[side]) for side in SIDES), "a plan's trial")
        margin = -group.most(-lead(plan, previous), "a plan's trial")
        pairs = group.most(float(slower_pairs(plan, previous)), "a plan's trial")
        allowed = allowed_slower_pairs(len(plan), len(previous)) if self.rounds > 1 else 0
        stays = pairs <= allowed
        if not stays and self.rounds == 1 and allowed_slower_pairs(2 * len(plan), 2 * len(previous)) >= 0:
            ahead = -group.most(-(1 - statistics.median(plan) / max(statistics.median(previous), 1e-9)),
                                "a plan's trial")
            if ahead > 0:
                return None
        self.record["trial"] = {"previous_s": round(median["previous"], 6), "plan_s": round(median["plan"], 6),
                                "lead": round(margin, 4), "slower_pairs": round(pairs), "allowed": allowed,
                                "noise": round(noise, 4), "steps": len(plan),
                                "times": {side: [round(t, 6) for t in self.times[side]] for side in SIDES}}
        self.record.update(switched=stays, reason="faster" if stays else "measured slower")
        return stays

    def again(self) -> dcir.Module:
        """An undecided verdict: each side runs ``steps`` more, the plan first; the module
        to switch to."""
        self.rounds += 1
        self.side, self.skip = "plan", True
        return self.plan


def lead(plan: list[float], previous: list[float]) -> float:
    """How far the plan's slowest step beat the other program's fastest, as a share of
    the other's median; 0 or below: some step of the plan was no faster than one of the other's."""
    return (min(previous) - max(plan)) / max(statistics.median(previous), 1e-9)


def slower_pairs(plan: list[float], previous: list[float]) -> int:
    """The rank test's count (Mann-Whitney's U): of every pair of a plan's step and the
    other program's, how many the plan's step was no faster in."""
    return sum(p >= q for p in plan for q in previous)


@functools.cache
def allowed_slower_pairs(m: int, n: int, level: float = 1 / 20) -> int:
    """The most ``slower_pairs`` that two programs equally fast, ``m`` and ``n`` steps, reach
    with a chance of at most ``level`` (-1: none does: too few steps)."""
    counts, total, most = _pairs_counts(m, n), math.comb(m + n, m), -1
    for pairs in range(len(counts)):
        if sum(counts[:pairs + 1]) / total > level + 1e-12:
            break
        most = pairs
    return most


@functools.cache
def _pairs_counts(m: int, n: int) -> tuple[int, ...]:
    """How many orders of ``m`` steps and ``n`` others give each count of ``slower_pairs``:
    the slowest step of all is either one of the ``m`` (slower than all ``n``) or not."""
    if m == 0 or n == 0:
        return (1,)
    counts = [0] * (m * n + 1)
    for pairs, ways in enumerate(_pairs_counts(m - 1, n)):
        counts[pairs + n] += ways
    for pairs, ways in enumerate(_pairs_counts(m, n - 1)):
        counts[pairs] += ways
    return tuple(counts)


def spread(times: list[float]) -> float:
    """How far apart ``times`` lie, as a share of their median."""
    return (max(times) - min(times)) / max(statistics.median(times), 1e-9)
