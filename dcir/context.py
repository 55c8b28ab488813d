"""The planning context: what a plan is made for, handed to every pass explicitly.

A pass, the simulator and the cost model price a schedule for a machine, with the
stretches of compute priced one way or another (``dcir.fusion.FusionMode``). Nothing
global changes a price: the pass manager hands each pass a ``PlanContext``
(``Pass.run(module, stats, ctx)``), as MLIR hands a pass its context, and a pass hands
the simulator what it needs of it. The memory budget is a pass's own option
(``prefetch{budget=2GiB}``), and the profile rides on the module's ops
(``prof.time_us``), so neither is here.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcir.cost import Machine, calibrate
from dcir.fusion import FusionMode
from dcir.ir import Module


@dataclass(frozen=True)
class PlanContext:
    """What one pass plans for. ``machine``: the machine schedules are priced on (a
    described one, such as ``dcir.hardware.load("h100-ib400")``); none: the module's
    default (one CPU core with gloo, fitted to the profile the module carries, if any).
    ``fusion``: how stretches of compute are priced; the pass manager sets ``CHOOSING``
    for the passes before one that chooses the stretches (``Pass.chooses_fusion``)."""

    machine: Machine | None = None
    fusion: FusionMode = FusionMode.AS_LOWERED

    def machine_for(self, module: Module) -> Machine:
        """The machine ``module``'s schedules are priced on: ``machine`` (else the
        module's default), its links fitted to the module's profiled collectives
        (``dcir.cost.calibrate``)."""
        return calibrate(module, self.machine)
