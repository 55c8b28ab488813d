"""Beam search over groupings: the planning passes' way of choosing among schedules.

DisCo (Liu et al.) plans op fusion and tensor fusion together by searching over
candidate groupings and pricing each one with a simulator, rather than applying
greedy rules. This module is that search for DCIR, in the one shape the passes need:
a sequence of items (collectives in issue order) is cut into runs of consecutive
items (buckets), and every candidate is priced by a callback (the pass applies the
grouping to its function, runs ``dcir.sim`` on it and rolls it back).

The search walks the items in order. A state is a grouping of the items seen so far
(the rest stay alone); each item either starts a new group or joins the last one.
After each item the ``width`` cheapest states are kept (ties: the grouping with the
fewest groups, then the earlier cuts), so the search is deterministic: the same
prices give the same plan. ``width=1`` is the greedy walk (join when that is
cheaper, else cut). A wider beam keeps groupings that cost more now but let later
items join more cheaply, for example a small first bucket, waited for early, and a
larger one behind it.

``score(grouping)`` returns the price of a complete schedule in which the groups of
``grouping`` are applied and every later item is alone, or None when the grouping
is not allowed (an order it must keep, the memory budget, a size cap).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from dcir.context import PlanContext
from dcir.memory import peaks
from dcir.passes import PassManager
from dcir.passes.offload_activations import OffloadActivations
from dcir.sim import estimate_module

Grouping = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Searched:
    """The result of a search: the best grouping, its price, and how many candidates
    were priced (``priced``) out of how many were considered (``considered``)."""

    grouping: Grouping
    score: float
    priced: int
    considered: int


def _order(entry: tuple[float, Grouping]) -> tuple:
    score, grouping = entry
    return score, len(grouping), tuple(g[0] for g in grouping)


def beam(n: int, score: Callable[[Grouping], float | None], width: int = 4,
         can_join: Callable[[tuple[int, ...], int], bool] = lambda group, item: True) -> Searched:
    """Cut items ``0 .. n-1`` into runs of consecutive items, keeping the ``width``
    cheapest partial groupings after each item (module docstring). ``can_join(group,
    item)`` rules out a join before it is priced (a size cap)."""
    if width < 1:
        raise ValueError(f"beam width must be at least 1, got {width}")
    start = score(())
    if start is None:
        raise ValueError("the schedule with nothing grouped is not allowed")
    states: list[tuple[float, Grouping]] = [(start, ())]
    priced, considered = 1, 1
    for item in range(n):
        candidates: dict[Grouping, float] = {}
        for price, grouping in states:
            alone = grouping + ((item,),)
            candidates.setdefault(alone, price)  # a group of one changes nothing: the same price
            considered += 1
            if grouping and can_join(grouping[-1], item):
                joined = grouping[:-1] + (grouping[-1] + (item,),)
                considered += 1
                if joined in candidates:
                    continue
                price_joined = score(joined)
                priced += 1
                if price_joined is not None:
                    candidates[joined] = price_joined
        states = sorted(((p, g) for g, p in candidates.items()), key=_order)[:width]
    price, grouping = states[0]
    return Searched(grouping, price, priced, considered)


@dataclass(frozen=True)
class Candidate:
    """One pipeline the planner tried, and the simulated optimizer step it gave."""

    spec: str
    seconds: float
    peak: int


#: schedule passes that spend memory for speed (earlier gathers, replicas kept, larger
#: collectives and with them a larger shared-memory outbox)
SPENDS_MEMORY = ("prefetch", "unshard", "bucket")


def pipelines(passes: list, host_apart: bool = False) -> list[list]:
    """The pipelines the planner tries for the configured ``passes``: as given, then
    the schedule passes' joint alternatives. ``unshard`` before ``prefetch`` (the
    gathers left in ``@forward`` are then the ones prefetch places), and ``prefetch``
    without its own fusion when ``bucket`` follows (``bucket`` then groups the
    hoisted gathers, not only those that start together). Under a memory budget (a
    pass given one), also the pipeline without the passes that spend memory for speed,
    for a budget at the step's floor. Where host memory is apart from the device's
    (``host_apart``: a GPU), each pipeline whose ``recompute`` has a budget also in two
    forms that hand activations through host memory instead (``offload_activations``,
    within the same budget): after ``recompute`` of the cheap cones only (in place of
    the matmuls it would rebuild), and in place of ``recompute``. On a CPU host memory
    is the device's: an offload saves nothing there, and is never tried."""
    out = [list(passes)]
    names = [p.name for p in passes]
    if "prefetch" in names and "unshard" in names and names.index("unshard") > names.index("prefetch"):
        i, j = names.index("prefetch"), names.index("unshard")
        swapped = list(passes)
        swapped[i], swapped[j] = passes[j], passes[i]
        out.append(swapped)
    if "prefetch" in names and "bucket" in names:
        for pipe in list(out):
            out.append([dataclasses.replace(p, fuse=False) if p.name == "prefetch" else p for p in pipe])
    lean = [p for p in passes if p.name not in SPENDS_MEMORY]
    if lean and len(lean) < len(passes) and any(getattr(p, "budget", None) is not None for p in passes):
        out.append(lean)
    if host_apart:
        out.extend(alternative for pipe in list(out) for alternative in _offloading(pipe))
    return out


def _offloading(pipe: list) -> list[list]:
    """``pipe``'s forms with activations offloaded (``pipelines``), if its ``recompute``
    has a budget."""
    k = next((i for i, p in enumerate(pipe) if p.name == "recompute" and p.budget is not None), None)
    if k is None:
        return []
    offload = OffloadActivations(budget=pipe[k].budget)
    return [[*pipe[:k], dataclasses.replace(pipe[k], budget=None), offload, *pipe[k + 1:]],
            [*pipe[:k], offload, *pipe[k + 1:]]]


def best_pipeline(module, candidates: list[list], micro_steps: int = 1, budget: int | None = None,
                  extra: Callable | None = None, context: PlanContext = PlanContext()):
    """Run every candidate pipeline on a copy of ``module``; returns (the planned module
    whose simulated optimizer step (``dcir.sim.estimate_module``) is shortest among
    those whose memory peak stays within ``budget``, its ``Candidate``, every
    ``Candidate``). When none fits, the one with the smallest peak. Ties go to the
    earlier candidate, so the same profiles give the same plan. ``extra(planned)``:
    bytes a plan holds beside its functions' peak (the runtime's shared-memory outbox
    sized for it, ``dcir_runtime.transport.outbox_bytes``). ``context``: what the
    passes plan for, and the machine the plans are priced on."""
    tried, planned = [], []
    for pipe in candidates:
        m = module.clone()
        PassManager(pipe, context=context).run(m)
        planned.append(m)
        tried.append(Candidate(",".join(p.name + _options(p) for p in pipe),
                               estimate_module(m, context.machine, micro_steps).seconds,
                               max(peaks(m).values(), default=0) + (extra(m) if extra else 0)))

    def rank(k: int) -> tuple:
        c = tried[k]
        over = budget is not None and c.peak > budget
        return over, c.peak if over else c.seconds, k

    k = min(range(len(tried)), key=rank)
    return planned[k], tried[k], tried


def _options(p) -> str:
    """The options of pass ``p`` that differ from its defaults, as a pipeline spec writes them."""
    def text(v) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    changed = [f"{f.name}={text(getattr(p, f.name))}" for f in dataclasses.fields(p)
               if getattr(p, f.name) != f.default]
    return "{" + ",".join(changed) + "}" if changed else ""
