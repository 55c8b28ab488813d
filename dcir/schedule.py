"""Scheduling rules: move a group of ops earlier or later, as far as named limits allow.

A ``Move`` is declared as data, like a rewrite ``Rule``: which op anchors it, which
ops travel with the anchor, and the named ``Limit``s that bound how far the group may
go. Each limit answers, for one anchor, the furthest position it allows; the driver
takes the nearest of them, and the statistics say which limit decided (``prefetch:
all_gather hoisted, stopped by 'transfer hidden'``). The memory budget is a limit
like any other: it reads the memory model's timeline and the bytes the move would
keep live longer.

Positions are indices into the function's ops *before* the move: a group moved to
position ``p`` runs just before the op that was at ``p`` (``len(ops)``: at the end).
The groups of one move are decided in schedule order against one analysis and
applied together; each decision updates what the next one reads (the bytes it keeps
live, ``Sweep.charge``, and the queues of the transfer lanes).

The times a move reads are the simulator's (``dcir.sim``), with the compute lane as
it runs when every transfer is hidden (``stalls=False``): the schedule the moves aim for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from dcir import analysis
from dcir.analysis import dependency_graph
from dcir.cost import Machine, is_transfer
from dcir.fusion import FusionMode
from dcir.ir import Function, Module, Op
from dcir.memory import storage_bases, timeline, timeline_of
from dcir.rewrite import Rewriter
from dcir.sim import COLLECTIVE, COPY, lane_of, simulate


@dataclass(frozen=True)
class Limit:
    """A named bound: ``bound(sweep, anchor_index, group)`` -> the furthest position
    this limit allows (for an earlier move, the smallest; for a later one, the largest)."""

    name: str
    bound: Callable[["Sweep", int, list[int]], int]


@dataclass(frozen=True)
class Move:
    """Move the ops ``group(sweep, i)`` (anchored at op ``i``, which matches
    ``anchor``) ``direction`` ("earlier" or "later"), as far as every limit allows."""

    name: str
    anchor: Callable[[Op], bool]
    group: Callable[["Sweep", int], list[int] | None]
    direction: str
    limits: tuple[Limit, ...]
    #: bytes kept live longer per position moved, and over which span: (bytes, start, end)
    cost: Callable[["Sweep", int, list[int], int], tuple[int, int, int]] | None = None


@dataclass
class Sweep:
    """The analyses one round of moves reads, kept current as moves are decided."""

    func: Function
    machine: Machine
    budget: int | None
    during_at_start: list[int] | None = None          # bytes per op (default: the function alone)
    start: list[float] = field(default_factory=list)   # compute-lane time at which op i starts (no stalls)
    during: list[int] = field(default_factory=list)    # bytes live while op i runs
    position: dict = field(default_factory=dict)       # op -> its position
    seconds: list[float] = field(default_factory=list)  # host time of op i (transfer time for async ops)
    free: dict[str, float] = field(default_factory=dict)  # transfer lane -> when it finishes what was issued
    done: dict[int, float] = field(default_factory=dict)  # transfer op position -> when its transfer ends
    placed: dict[int, int] = field(default_factory=dict)  # anchor position -> where its group now starts
    graph: object = None                               # the dependency DAG (dcir.analysis)
    storage: dict = field(default_factory=dict)        # value -> the value whose storage it shares (dcir.memory)
    waits: dict = field(default_factory=dict)          # pending value -> the wait that joins it
    slack: float = 1.0                                 # a transfer counts as hidden behind slack x its time
    fusion: FusionMode = FusionMode.AS_LOWERED         # how stretches of compute are priced (dcir.fusion)

    def __post_init__(self):
        ops = self.func.ops
        self.position = {op: i for i, op in enumerate(ops)}
        run = simulate(self.func, self.machine, stalls=False, fusion=self.fusion)
        self.seconds, self.start = run.seconds, run.start
        self.free = {COLLECTIVE: 0.0, COPY: 0.0}
        self.during = list(self.during_at_start or timeline(self.func).during)
        self.graph = dependency_graph(self.func)
        self.storage = storage_bases(self.func)
        self.waits = analysis.waits(self.func)

    @property
    def channel(self) -> float:
        """When the collective lane finishes the collectives issued so far."""
        return self.free[COLLECTIVE]

    def issue(self, i: int, at: int) -> None:
        """Queue op ``i``'s transfer on its lane, launched at position ``at``."""
        lane = lane_of(self.func.ops[i])
        self.free[lane] = self.done[i] = max(self.free[lane], self.time_at(at)) + self.seconds[i]

    def time_at(self, pos: int) -> float:
        return self.start[min(pos, len(self.start) - 1)]

    def charge(self, nbytes: int, lo: int, hi: int) -> None:
        for j in range(max(lo, 0), min(hi, len(self.during))):
            self.during[j] += nbytes


def ordering(kind: str) -> bool:
    """Edges a move must respect: all but the collective order, which moves keep by
    their own named limits (every rank runs the same program, so any order the
    passes choose is the same on every rank)."""
    return kind != "collective"


def after_dependencies(sweep: Sweep, i: int, group: list[int]) -> int:
    """For an earlier move: just after the last op outside the group it depends on."""
    g, members = sweep.graph, set(group)
    preds = [p for j in group for p, _, k in g.in_edges(j, data="kind") if p not in members and ordering(k)]
    return max(preds, default=-1) + 1


def before_dependents(sweep: Sweep, i: int, group: list[int]) -> int:
    """For a later move: just before the first op outside the group that depends on it."""
    g, members = sweep.graph, set(group)
    succs = [s for j in group for _, s, k in g.out_edges(j, data="kind") if s not in members and ordering(k)]
    return min(succs, default=len(sweep.func.ops))


#: the dependency DAG as limits, one per direction
AFTER_DEPENDENCIES = Limit("dependencies", after_dependencies)
BEFORE_DEPENDENTS = Limit("dependencies", before_dependents)


def budget_limit(move: "Move") -> Limit:
    """The memory budget as a limit: the furthest position at which every op the
    moved group spans still fits, by the memory model. A move keeps the same bytes
    live longer the further it goes; each step spans one more op."""

    def bound(sweep: Sweep, i: int, group: list[int]) -> int:
        earlier = move.direction == "earlier"
        pos = group[0] if earlier else group[-1] + 1
        nbytes = move.cost(sweep, i, group, pos)[0]
        if earlier:
            while pos > 0 and sweep.during[pos - 1] + nbytes <= sweep.budget:
                pos -= 1
        else:
            while pos < len(sweep.during) and sweep.during[pos] + nbytes <= sweep.budget:
                pos += 1
        return pos

    return Limit("memory budget", bound)


def run_moves(module: Module, func: Function, moves: list[Move], machine: Machine, budget: int | None,
              stats: Counter, prefix: str, slack: float = 1.0, fusion: FusionMode = FusionMode.AS_LOWERED) -> None:
    """Apply ``moves`` to ``func`` one after the other; each decides its groups in
    schedule order against a fresh analysis (stretches priced as ``fusion`` says), then
    applies them together."""
    for move in moves:
        sweep = Sweep(func, machine, budget, timeline_of(module, func.name).during, slack=slack, fusion=fusion)
        limits = move.limits + ((budget_limit(move),) if move.cost is not None and budget is not None else ())
        plan: list[tuple[list[int], int]] = []
        for i, op in enumerate(list(func.ops)):
            group = move.group(sweep, i) if move.anchor(op) else None
            pos = None
            if group:
                earlier = move.direction == "earlier"
                origin = group[0] if earlier else group[-1] + 1
                bounds = [(lim.bound(sweep, i, group), lim.name) for lim in limits]
                pos, why = (max if earlier else min)(bounds, key=lambda b: b[0])
                if (earlier and pos >= origin) or (not earlier and pos <= origin):
                    stats[f"{prefix}: {move.name} not moved ({why})"] += 1
                    pos = None
                else:
                    if move.cost is not None:
                        sweep.charge(*move.cost(sweep, i, group, pos))
                    plan.append((group, pos))
                    stats[f"{prefix}: {move.name} moved, stopped by '{why}'"] += 1
            if group:  # a later group placed here goes after this one
                sweep.placed[i] = pos if pos is not None else i + 1
            if is_transfer(op):  # each lane runs its transfers one at a time, in issue order
                sweep.issue(i, pos if pos is not None and move.direction == "earlier" else i)
        _apply(func, plan)


def _apply(func: Function, plan: list[tuple[list[int], int]]) -> None:
    """Every group leaves its place and runs before the op that was at its target
    (positions as before the moves; a target that moves itself stands for the next op
    that stays), groups bound for one place in plan order."""
    ops = list(func.ops)
    moved = {j for group, _ in plan for j in group}
    rewriter = Rewriter(func)
    for group, pos in sorted(plan, key=lambda gp: gp[1]):  # stable: plan order within one target
        stay = next((p for p in range(pos, len(ops)) if p not in moved), None)
        for j in group:
            rewriter.move_before(ops[j], None if stay is None else ops[stay])
