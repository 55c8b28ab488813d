"""How a ZeRO-3 step is laid across nodes, and the planner's choice among the ways.

Past one node every flat all-gather and reduce-scatter crosses the slowest link once per
layer per micro-step. The ways around it (issue 38), each a ``Layout``:

* **ZeRO-3**: parameters sharded over every rank (``zero3``);
* **HSDP**: sharded over a node's ranks, replicated across nodes, gradients averaged
  across nodes once per optimizer step (``zero3{nodes=N, shard=local}``, FSDP2's 2-D mesh);
* **hpZ**: sharded over every rank, the backward gathering node-local partitions within
  the node (``zero3{nodes=N}, hierarchical``, ZeRO++'s hierarchical partitions);
* **qwZ** / **qgZ**: parameter gathers / gradient reductions in int8 (``quantize``),
  alone or with hpZ; all three together is ZeRO++.

``choose`` prices each way's program with the simulator on a described machine
(``dcir.hardware``: ranks per node, both link classes, device memory) and takes the
fastest whose peak fits, saying why. HSDP and hpZ train the same numbers as ZeRO-3 (HSDP
sums in another order); qwZ and qgZ do not, so they are weighed only when the caller
allows it (``lossy``), as a user opts into them in DeepSpeed's config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from dcir.ir import Module
from dcir.machine import Machine
from dcir.memory import format_bytes
from dcir.passes import PassManager
from dcir.passes.hierarchical import Hierarchical
from dcir.passes.quantize import Quantize
from dcir.passes.zero3 import LOCAL, SHARD, Zero3
from dcir.sim import simulate_module


#: the module attribute that names the layout the planner chose (``Layout.name``)
LAID_OUT = "plan.layout"


@dataclass(frozen=True)
class Layout:
    """One way to lay a ZeRO-3 step across nodes."""

    name: str
    hsdp: bool = False       # sharded within the node, replicated across nodes
    hpz: bool = False        # the backward gathers node-local partitions within the node
    weights: bool = False    # parameter gathers in int8 (qwZ)
    gradients: bool = False  # gradient reductions in int8 (qgZ)

    @property
    def exact(self) -> bool:
        """Whether it trains the numbers ZeRO-3 trains (quantizing changes them)."""
        return not (self.weights or self.gradients)

    def sharding(self, world: int, per_node: int, micro_steps: int = 1, accumulate: str = SHARD) -> list:
        """The passes that shard an unsharded step this way, on ``world`` ranks of
        ``per_node`` a node (the stage's, and ``hierarchical``'s across nodes), with
        gradients accumulated across ``micro_steps`` in ``accumulate`` (``zero3``'s)."""
        nodes = max(1, world // per_node)
        if self.hsdp:
            return [Zero3(world_size=world, nodes=nodes, shard=LOCAL, micro_steps=micro_steps)]
        stage = Zero3(world_size=world, nodes=nodes if self.hpz else 1, micro_steps=micro_steps, accumulate=accumulate)
        return [stage, *([Hierarchical()] if self.hpz and nodes > 1 else [])]  # one node: nothing to keep

    def quantizing(self) -> list:
        """The pass that puts its int8 on the wire (after any mixed-precision cast)."""
        return [] if self.exact else [Quantize(weights=self.weights, gradients=self.gradients)]


#: every way, in the order ties go (the simpler first)
LAYOUTS = (Layout("ZeRO-3"), Layout("HSDP", hsdp=True), Layout("hpZ", hpz=True), Layout("qwZ", weights=True),
           Layout("hpZ+qwZ", hpz=True, weights=True), Layout("ZeRO++", hpz=True, weights=True, gradients=True))


def layout(hsdp: bool = False, hpz: bool = False, weights: bool = False, gradients: bool = False) -> Layout:
    """The way with these settings, named as ``LAYOUTS`` names it, else by its parts
    (``"HSDP+qwZ"``)."""
    flags = {"hsdp": hsdp, "hpz": hpz, "weights": weights, "gradients": gradients}
    for known in LAYOUTS:
        if all(getattr(known, k) == v for k, v in flags.items()):
            return known
    parts = ["HSDP"] * hsdp + ["hpZ"] * hpz + ["qwZ"] * weights + ["qgZ"] * gradients
    return Layout("+".join(parts), **flags)


@dataclass(frozen=True)
class Priced:
    """A layout's predicted optimizer step: seconds, peak bytes per rank, whether that fits."""

    layout: Layout
    seconds: float
    peak: int
    fits: bool


@dataclass(frozen=True)
class Choice:
    """Every layout the planner priced, and the one it took (None: none fits)."""

    priced: tuple[Priced, ...]
    chosen: Priced | None
    budget: int | None

    def why(self) -> str:
        """One line per priced layout, the chosen one first: its step, its speed over
        ZeRO-3's, and why each other one was not taken."""
        base = next((p for p in self.priced if p.layout.name == "ZeRO-3"), None)
        lines = []
        for p in sorted(self.priced, key=lambda p: p is not self.chosen):
            ratio = f", {base.seconds / p.seconds:.2f}x ZeRO-3" if base and p is not base and p.seconds else ""
            head = f"{p.layout.name}: {p.seconds:.4g} s a step{ratio}, peak {format_bytes(p.peak)}"
            if p is self.chosen:
                lines.append(f"{head}: chosen, the fastest that fits")
            elif not p.fits:
                lines.append(f"{head}: does not fit the budget of {format_bytes(self.budget)}")
            else:
                lines.append(f"{head}: slower")
        if self.chosen is None:
            lines.insert(0, "no layout fits the budget")
        return "\n".join(lines)


def choose(build: Callable[[Layout], Module], machine: Machine, micro_steps: int = 1, budget: int | None = None,
           lossy: bool = False, layouts: tuple[Layout, ...] = LAYOUTS) -> Choice:
    """Price each layout's program (``build(layout)``) for one optimizer step of
    ``micro_steps`` on ``machine`` and take the fastest whose peak (with the state every
    rank holds) is within ``budget`` (default: the machine's device memory). Quantized
    layouts are weighed only with ``lossy``. Ties go to the earlier layout."""
    budget = budget if budget is not None else machine.memory
    priced = []
    for way in layouts:
        if not way.exact and not lossy:
            continue
        module = build(way)
        on = replace(machine, world_size=module.attrs.get("world_size", machine.world_size),
                     mesh=tuple(module.mesh.items()))
        p = simulate_module(module, on, micro_steps)
        priced.append(Priced(way, p.estimate.seconds, p.peak_bytes, budget is None or p.peak_bytes <= budget))
    fitting = [p for p in priced if p.fits]
    return Choice(tuple(priced), min(fitting, key=lambda p: p.seconds, default=None), budget)


def sharded(module: Module, layout: Layout, world: int, per_node: int, micro_steps: int = 1) -> Module:
    """A copy of the unsharded step ``module`` sharded ``layout``'s way (``choose``'s
    ``build`` for a captured program)."""
    out = module.clone()
    PassManager([*layout.sharding(world, per_node, micro_steps), *layout.quantizing()], verify_each=False).run(out)
    return out
