"""Plan: the passes an Engine runs, and the optimization cycle that replans them from
a profile (docs/passes.md, "The optimization cycle").

After each optimizer step listed in ``optimize.profile_at`` the next step runs under
the profiler; after it, the profile is written into the running module, combined with
the earlier profiles onto the captured schedule (per op, the median of every profile
so far: ``ProfileHistory``), and rank 0 plans the configured
passes on it within the memory budget. Every rank takes the plan when memory forced
the cycle, or when the cost model finds it faster than the running schedule by more
than the profiles' noise and by enough to pay for any peak it raises; a plan that
schedules what runs as the running one does is not switched to. A plan taken so runs
on trial against the program it replaces, on the clock (``runtime.trial``), and stays
only when measured faster too. A plan that
runs compiled stretches (``inductor``, or marked by ``fuse``) runs one step before it
is profiled: its stretches compile in that step, and their times then price its ops
(``prof.compiled_us``). A step that ends over the memory budget forces one more
cycle, within less, before it is an error.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
from typing import Callable

import torch.distributed as dist

import dcir
from dcir import analysis
from dcir.context import PlanContext
from dcir.cost import FUSED, SHARED_MEMORY, fitted_fused_share, profiled_us
from dcir.sim import estimate_module
from dcir.diagnostics import DcirError, Diagnostic
from dcir.activations import RECOMPUTE
from dcir.memory import beside_caller, format_bytes, peaks as memory_peaks, step_peak
from dcir import fusion, search
from dcir.passes import parse_pipeline
from dcir.passes.offload_activations import OffloadActivations
from dcir.passes.recompute import Recompute, footprint
from dcir_runtime.config import Config
from dcir_runtime.group import ProcessGroup
from dcir_runtime.profiler import NOISE, Profile, ProfileHistory
from dcir_runtime.program_cache import ProgramCache
from dcir_runtime.trial import Trial

#: the module attribute that names the pipeline a plan came from (``dcir.search.best_pipeline``)
PLANNED_BY = "plan.pipeline"


class Planner:
    """The passes of one engine and its optimization cycle: the captured schedule, the
    profile being taken, and one record per cycle (``log``, ``engine.optimize_log``)."""

    def __init__(self, config: Config, group: ProcessGroup, key: str, source: str,
                 context: PlanContext = PlanContext()):
        self.config, self.group = config, group
        self.context = context               # what the cycle plans for (default: the profiled machine's model)
        self.key, self.source = key, source  # rendezvous prefix; what diagnostics call the program
        self.base_text = ""                  # the captured schedule, with every profile so far
        self.captured_peak: dict[str, int] = {}
        self.profile: Profile | None = None  # the profile the running step takes, if any
        self.warming: dcir.Module | None = None  # a plan whose compiled stretches run a step before its profile
        self.profiled: dcir.Module | None = None
        self.history = ProfileHistory()      # every profile so far, combined per op by the median
        self.log: list[dict] = []
        self._budget_cut = 0                 # taken off the passes' budget after a plan's step went over
        # a step over the budget forces one plan for the captured schedule, and one more,
        # its overshoot off the budget, for a plan that went over too
        self._replanned_captured = self._replanned_plan = False
        self._forced = False                 # the next plan is taken even if slower: memory asked for it
        self.cache = ProgramCache(config.program_cache, group.world) if config.program_cache else None
        self.cached: str | None = None       # the captured program's entry in the cache (rank 0's)
        self.planned_through = 0             # the steps whose profiles a plan read from the cache had seen
        self.trial: Trial | None = None      # a plan measured against the running program (``cycle``)
        self.rejected: set[str] = set()      # schedules a trial measured slower: never taken again
        self._clock: float | None = None     # when the last optimizer step ended (``cycle``)

    def passes(self, specs: list[str], budget: int | None = None) -> list:
        """The passes of ``specs``, with what the engine knows filled in where the spec
        leaves it open: the memory ``budget``, and the micro-steps per optimizer step."""
        out = []
        for p in parse_pipeline(",".join(specs)):
            if getattr(p, "budget", "n/a") is None and budget is not None:
                p = dataclasses.replace(p, budget=budget)
            if getattr(p, "micro_steps", None) == 1:
                p = dataclasses.replace(p, micro_steps=self.config.gradient_accumulation_steps)
            out.append(p)
        return out

    def start(self, text: str, module: dcir.Module | None) -> None:
        """The captured program: what every plan starts from (``module``: that text parsed,
        if it was; else it is parsed when the cycle first plans)."""
        self.base_text = text
        self.captured_peak = memory_peaks(module) if module is not None else {}

    def resume(self, captured) -> dcir.Module | None:
        """The captured program (``capture.Captured``) is what every plan starts from; returns
        the plan the cycle took for it in an earlier job, when the program cache kept one:
        the job runs it from its first step, with that cycle's records (marked ``cached``)
        in ``log``, and profiles only at the ``profile_at`` steps that cycle had not reached."""
        self.cached, entry = captured.cached, captured.entry
        cached = entry is not None and entry.plan is not None
        self.start(captured.text, None if cached else captured.module)
        if not cached:
            return None
        self.log = [{**record, "cached": True} for record in entry.log]
        self.planned_through = entry.planned_through
        return dcir.parse(entry.plan, self.source)

    def pass_budget(self, fixed_bytes: Callable[[], int]) -> int | None:
        """The memory budget left to a schedule: the configured budget less what this
        rank holds whatever the schedule (``fixed_bytes()``, ``accounting.fixed_bytes``;
        asked only when there is a budget)."""
        if self.config.memory_budget is None:
            return None
        fixed = fixed_bytes()
        if fixed + self._budget_cut >= self.config.memory_budget:
            raise DcirError(Diagnostic(
                f"rank {self.group.rank}: parameter shards, optimizer state and buffers (with gradient shards "
                f"where they outlive a backward, and the outputs the caller keeps) take {format_bytes(fixed)}, which "
                f"leaves nothing of the memory budget of {format_bytes(self.config.memory_budget)} for the step's own "
                f"memory"))
        return self.config.memory_budget - fixed - self._budget_cut

    def after_step(self, steps: int, running: dcir.Module) -> bool:
        """After ``steps`` optimizer steps of this engine (counted from its start, not from a
        loaded checkpoint's step: a resumed job plans again): start profiling the next
        step when the cycle says so. Returns whether a finished profile is waiting to be
        planned from."""
        if self.profile is not None:
            return True
        if self.warming is not None:  # its compiled stretches ran this step: they have their times
            self.profile, self.warming = Profile(self.warming), None
            return False
        if self.config.optimize is not None and steps in self.config.optimize["profile_at"] \
                and steps > self.planned_through:
            self.profile = Profile(running)  # the next step runs under the profiler
        return False

    def cycle(self, steps: int, running: dcir.Module, fixed_bytes: Callable[[], int],
              outbox: Callable[[dcir.Module], int] | None = None,
              stretches: Callable[[], dict[str, list]] | None = None) -> dcir.Module | None:
        """After optimizer step ``steps`` of ``running``: a trial's step, or a profile started or
        planned from; the module to switch to (None: keep running). Steps are timed from the
        end of the turn before (the cycle's own work is no step's). ``stretches()``: the running
        program's compiled stretches that ran, per function (``stretch_times``)."""
        seconds = time.perf_counter() - self._clock if self._clock is not None else 0.0
        if self.trial is not None and self.profile is not None:  # a step went over the memory budget
            self.trial.record.update(switched=self.trial.side == "plan", reason="over the budget on trial")
            self.trial = None
        if self.trial is not None:
            module = self._try(seconds, steps, stretches)
        else:
            module = self.replan(running, steps, fixed_bytes, outbox, trial=True) \
                if self.after_step(steps, running) else None
        self._clock = time.perf_counter()
        return module

    def _try(self, seconds: float, steps: int, stretches=None) -> dcir.Module | None:
        """A step of the trial (``runtime.trial``): the replaced program's turn after the plan's, then
        the verdict (the plan back, if it won; undecided: both once more). A ``profile_at`` step in it
        profiles after. What the plan's compiled stretches took prices the next plans' (``_learn_fusion``)."""
        trial = self.trial
        trial.due = trial.due or (steps in self.config.optimize["profile_at"] and steps > self.planned_through)
        skipped = trial.skip
        if not trial.add(seconds):
            if skipped:  # a side's first step ran
                collect_together(self.group)
            return None
        if trial.side == "plan":
            if stretches is not None:
                _learn_fusion(self.group, self.history, trial.plan, stretches())
            return trial.next_side()
        stays = trial.verdict(self.group)
        if stays is None:  # undecided: each side once more
            return trial.again()
        self.trial = None
        winner = trial.plan if stays else trial.previous
        if not stays:
            self.rejected.add(schedule_text(trial.plan))
            trial.record.update(predicted_s=trial.record["predicted_before_s"], predicted_peak=memory_peaks(winner))
        self._settled(winner, steps, due=trial.due, compiles=stays and self._compiles(winner))
        return winner if stays else None

    def replan(self, running: dcir.Module, steps: int, fixed_bytes: Callable[[], int],
               outbox: Callable[[dcir.Module], int] | None = None, trial: bool = False) -> dcir.Module | None:
        """Write the finished profile into ``running``, plan the configured passes from it
        on the captured schedule; returns the module to switch to (None: keep running).
        ``outbox(plan)``: the shared-memory outbox a plan needs, which its budget counts.
        ``trial``: a plan taken on the cost model's word runs on trial first (``cycle``)."""
        # the ranks agree on every figure, so each one's estimates below, and with them
        # whether to switch, come out the same: every rank must run the same program
        peaks = self.profile.annotate(dist.group.WORLD, self.group.collective_device(), _transport(outbox))
        self.profile, self.profiled = None, running
        profiled = running.clone()  # a snapshot, without a print and two parses
        budget = self.pass_budget(fixed_bytes)
        # the passes plan the step's own memory: the outbox comes off their budget (sized
        # for the running program here; each candidate is then held to its own outbox)
        schedule_budget = budget - outbox(running) if budget is not None and outbox is not None else budget
        # the captured schedule carries every profile so far, combined: per op the median
        # of the profiles that ran it (a collective the plan had merged keeps the figures
        # of the runs before), so one noisy profile does not flip the plan
        base = beside_caller(dcir.parse(self.base_text, self.source), running)
        self.captured_peak = self.captured_peak or memory_peaks(base)
        record: dict = {"step": steps, "measured_peak": peaks, "captured_peak": self.captured_peak,
                        "predicted_peak_profiled": memory_peaks(running)}
        self.history.add(profiled)
        self.history.write(base)
        self.base_text = dcir.print(base)

        micro = self.config.gradient_accumulation_steps

        def plan() -> str:
            # the configured passes and their joint alternatives, each priced by the simulator
            passes = self.passes(self.config.optimize["passes"], schedule_budget)
            candidates = search.pipelines(passes, host_apart=self.group.device.type != "cpu")
            planned, chosen, _ = search.best_pipeline(base, candidates, micro, budget, outbox, self.context)
            planned.attrs[PLANNED_BY] = chosen.spec
            return dcir.print(planned)

        module = dcir.parse(self.group.from_rank0(f"{self.key}plan{steps}", plan), self.source)
        forced, self._forced = self._forced, False
        take, reason = self._verdict(profiled, module, running, base.attrs.get(NOISE, 0.0), forced, record)
        record.update(budget=budget, switched=take, pipeline=module.attrs.get(PLANNED_BY, ""), reason=reason,
                      predicted_peak=memory_peaks(module if take else running),
                      collectives={"captured": analysis.collectives(base), "plan": analysis.collectives(module)})
        self.log.append(record)
        if take and trial and not forced and self.config.optimize["trial_steps"]:
            self.trial = Trial(module, running, record, self.config.optimize["trial_steps"],
                               due=steps in self.config.optimize["profile_at"])
            record["reason"] = "on trial"
            return module
        self._settled(module if take else running, steps, due=steps in self.config.optimize["profile_at"],
                      compiles=take and self._compiles(module))
        return module if take else None

    def _verdict(self, profiled: dcir.Module, module: dcir.Module, running: dcir.Module, noise: float,
                 forced: bool, record: dict) -> tuple[bool, str]:
        """Whether to take the plan ``module`` over the running schedule (as ``profiled``),
        and why. Memory forced this cycle: taken. Otherwise only a plan predicted faster
        by more than the profiles' noise (``prof.noise``) and by enough to pay for the peak
        it raises (``memory_price`` of the step per whole running peak), never one a trial
        measured slower before; the figures go into ``record``."""
        before, after, gain, raised = _priced(profiled, module, running, self.context,
                                              self.config.gradient_accumulation_steps)
        needed = noise + self.config.optimize["memory_price"] * raised
        same = (text := schedule_text(module)) == schedule_text(running)  # nothing to switch to
        take = not same and (forced or (gain > needed and text not in self.rejected))
        record.update(predicted_before_s=before.seconds, predicted_s=after.seconds if take else before.seconds,
                      planned_s=after.seconds, cost_source=after.source, noise=noise,
                      gain=round(gain, 4), needed_gain=round(needed, 4))
        if same or forced or take:
            return take, "same" if same else "memory" if forced else "faster"
        if text in self.rejected:
            return False, "measured slower before"
        return False, "kept" if gain <= noise else "memory cost"

    def _settled(self, module: dcir.Module, steps: int, due: bool, compiles: bool) -> None:
        """What runs from here on is ``module``: the program cache keeps it (rank 0, which
        compiled it), and when a ``profile_at`` step is ``due`` the next step profiles it
        (the step after, when it ``compiles`` stretches first)."""
        if self.cached is not None:
            self.cache.save_plan(self.cached, dcir.print(without_profiles(module)), self.log, steps)
        if due:
            if compiles:
                self.warming = module
            else:
                self.profile = Profile(module)

    def _compiles(self, module: dcir.Module) -> bool:
        """Whether ``module`` runs compiled stretches, which compile at their first call."""
        return bool(self.config.inductor) or any(fusion.marked(f) for f in module.functions.values())

    def check_budget(self, fixed: int, scheduled: int, running: dcir.Module) -> None:
        """After a step: holding more than the memory budget is an error, unless the
        optimization cycle can plan again: once for the captured schedule, within the
        whole budget (its passes never saw it), and once for a plan that went over,
        within less (its overshoot, agreed across ranks, comes off the budget the passes
        get); the next step is profiled and the plan taken even if slower. ``fixed``
        and ``scheduled`` are what the rank holds whatever the schedule, and what the
        schedule holds (``dcir_runtime.accounting``)."""
        budget = self.config.memory_budget
        if budget is None:
            return
        held = fixed + scheduled
        over = held - budget
        if self.config.optimize is not None and self.group.world > 1:
            over = int(self.group.most(over, "the plan's memory"))
        if over <= 0:
            return
        if self.config.optimize is not None:
            planned = any(r["switched"] for r in self.log)
            if not (self._replanned_plan if planned else self._replanned_captured):
                if planned:  # a plan made within the budget ran over: what it missed comes off the next
                    self._replanned_plan, self._budget_cut = True, self._budget_cut + over
                self._replanned_captured = self._forced = True
                self.profile, self.warming = self.profile or Profile(running), None
                return
        raise DcirError(_over_budget(self.group, fixed, scheduled, budget, running))


def _priced(profiled: dcir.Module, module: dcir.Module, running: dcir.Module, context: PlanContext, micro: int):
    """The cost model's step for the running schedule (as ``profiled``) and for the plan
    ``module``, the share of the step the plan saves, and the share of the running
    schedule's modelled peak it raises (0 when it lowers it)."""
    before = estimate_module(profiled, context.machine, micro)
    after = estimate_module(module, context.machine, micro)
    peak = max(memory_peaks(running).values(), default=0)
    raised = max(max(memory_peaks(module).values(), default=0) - peak, 0) / max(peak, 1)
    return before, after, (1 - after.seconds / before.seconds if before.seconds > 0 else 0.0), raised


#: the share of the memory budget the first step's fit keeps back: the accounting does not
#: follow the smallest tensors (0-d optimizer steps, losses, generator states) nor the
#: allocator's rounding, 0.7% of the budget on the activation benchmark's tiny Llama, where a
#: fit to the last byte ran over by that in the allocator's count (the cycle's plans, from
#: profiles, get the whole budget)
FIRST_STEP_HEADROOM = 0.02


def fit_first_step(planner: Planner, captured: dcir.Module, fixed: Callable[[], int],
                   outbox: Callable[[dcir.Module], int] | None) -> dcir.Module:
    """The first training program: ``captured``, or, with a memory budget and
    ``recompute`` among the cycle's passes, ``captured`` fitted within the budget before
    any step runs, so that the first step holds no more than the later ones: its
    ``recompute`` (and ``offload_activations``, where the cycle has it and host memory is
    apart), by the memory model and the cost model without a profile, within the budget
    less ``FIRST_STEP_HEADROOM`` of it. The cycle plans again from profiles, from the
    captured program, within the whole budget. A budget the step cannot meet even
    with every activation rebuilt is an error here, before the step. ``fixed()``: what
    the rank will hold whatever the schedule; rank 0 fits, every rank runs its program,
    and rank 0 says on standard error what it chose and what it costs."""
    config, group = planner.config, planner.group
    if config.memory_budget is None or config.optimize is None or \
            not any(p.name == Recompute.name for p in planner.passes(config.optimize["passes"])):
        return captured
    host_apart = group.device.type != "cpu"
    fits = (Recompute.name, *([OffloadActivations.name] if host_apart else []))

    def fit() -> str:
        held, box = fixed(), outbox(captured) if outbox is not None else 0
        budget = int(config.memory_budget * (1 - FIRST_STEP_HEADROOM)) - held - box
        before = step_peak(captured)
        if before <= budget:
            return dcir.print(captured)
        module = captured.clone()
        dcir.run_passes(module, [p for p in planner.passes(config.optimize["passes"], max(budget, 1))
                                 if p.name in fits])
        after = step_peak(module)
        if held + box + after > config.memory_budget:  # not even within the whole budget
            raise DcirError(Diagnostic(
                f"the first step would hold {format_bytes(held + box + after)} at its peak, over the memory budget of "
                f"{format_bytes(config.memory_budget)}: {format_bytes(held)} whatever the schedule (parameter shards, "
                f"the optimizer state the step makes, buffers, the outputs the caller keeps) and "
                f"{format_bytes(box + after)} in the step; "
                + over_budget_advice(held + box + after, config.memory_budget, host_apart)))
        again = sum(RECOMPUTE in op.attrs for _, op in module.ops()) - \
            sum(RECOMPUTE in op.attrs for _, op in captured.ops())
        cost = (estimate_module(module, micro_steps=config.gradient_accumulation_steps).seconds
                - estimate_module(captured, micro_steps=config.gradient_accumulation_steps).seconds)
        print(f"dcir: the captured step holds {format_bytes(before)} of its own at its peak, over the "
              f"{format_bytes(budget)} the memory budget leaves it; from the first step, {again} more "
              f"op{'s' * (again != 1)} run{'s' * (again == 1)} in the backward: {format_bytes(after)}, predicted "
              f"{cost:+.4f} s a step (the cycle plans again from profiles)", file=sys.stderr)
        return dcir.print(module)

    return dcir.parse(group.from_rank0(f"{planner.key}fit", fit, "fit the first step within the memory budget"),
                      planner.source)


def collect_together(group) -> None:
    """Between a trial side's first step and its counted ones: what the program before it
    left goes now (a full collection takes 0.4 s here), and the ranks leave together, or
    one rank's longer collection is the others' wait in their next counted step (the
    benchmark's Mixtral: a trial's noise 30% of a 0.5 s step, and a plan 23% faster not
    taken)."""
    gc.collect()
    group.most(0.0, "a plan's trial")


def over_budget_advice(least: int, budget: int, host_apart: bool) -> str:
    """What an over-budget error advises: the ``least`` the step holds with every
    activation rebuilt (and, where host memory is apart, every other one moved there),
    and the passes that do it when that fits ``budget``."""
    how = ("recomputing every activation that can be rebuilt and offloading the others to host memory"
           if host_apart else "recomputing every activation that can be rebuilt")
    passes = "'recompute' and 'offload_activations'" if host_apart else "'recompute'"
    if least <= budget:
        return f"{how}, the step fits {format_bytes(least)}: add {passes} to optimize.passes"
    return f"even {how}, the step needs {format_bytes(least)}: raise memory_budget or lower the micro-batch"


def _rebuildable(module: dcir.Module, host_apart: bool) -> int:
    """How much lower the step's modelled peak goes with every activation ``recompute``
    can rebuild rebuilt, and where host memory is apart from the device's, every other
    one ``offload_activations`` can move moved there."""
    least = module.clone()
    dcir.run_passes(least, [Recompute(budget=1), *([OffloadActivations(budget=1)] if host_apart else [])])
    return footprint(module)[0] - footprint(least)[0]


def schedule_text(module: dcir.Module) -> str:
    """``module``'s text without what profiles and plans wrote beside the program
    (``prof.*``, the pipeline's name): two modules with the same text lower to the
    same program."""
    m = without_profiles(module)
    m.attrs.pop(PLANNED_BY, None)
    return dcir.print(m)


def without_profiles(module: dcir.Module) -> dcir.Module:
    """A copy of ``module`` without the ``prof.*`` attributes profiles wrote: the program
    alone (what the program cache keeps of a plan: every op's own figures would make
    each op line a shape of its own to the parser, ``dcir.fast_parse``)."""
    m = module.clone()
    for f in m.functions.values():
        for owner in (f, *f.ops):
            for key in [key for key in owner.attrs if key.startswith("prof.")]:
                del owner.attrs[key]
    for key in [key for key in m.attrs if key.startswith("prof.")]:
        del m.attrs[key]
    return m


def _over_budget(group: ProcessGroup, fixed: int, scheduled: int, budget: int, running: dcir.Module) -> Diagnostic:
    """Why this rank's step (``fixed`` whatever the schedule, ``scheduled`` in it) is over
    ``budget`` with nothing left to plan, and what would bring ``running`` within it."""
    held, host_apart = fixed + scheduled, group.device.type != "cpu"
    advice = over_budget_advice(held - _rebuildable(running, host_apart), budget, host_apart)
    return Diagnostic(
        f"rank {group.rank} holds {format_bytes(held)} at its peak, over the memory budget of "
        f"{format_bytes(budget)}: {format_bytes(fixed)} whatever the schedule (parameter shards, optimizer "
        f"state, buffers, gradient shards where they outlive a backward, the outputs the caller keeps) and "
        f"{format_bytes(scheduled)} in the step "
        f"(saved activations, temporaries, gathered parameters, the backward's gradient shards, replicas, "
        f"accumulators and the shared-memory outbox); {advice}")


def _learn_fusion(group: ProcessGroup, history: ProfileHistory, plan: dcir.Module, stretches: dict) -> None:
    """What ``plan``'s compiled stretches took on trial prices the stretches of later plans
    that no profile measured compiled (``prof.fused_share`` in ``history``, the most over the
    ranks): a plan the trial sends back leaves no profile of them. Collective: every rank calls it."""
    share = group.most(_fused_share(plan, stretches), "the compiled stretches' share")
    if share >= 0:
        history.note(FUSED, share)


def _fused_share(plan: dcir.Module, stretches: dict[str, list]) -> float:
    """The share of their profiled eager time the fusible ops of ``plan``'s compiled
    ``stretches`` (per function, ``stretch_times``) took (``dcir.cost.fitted_fused_share``);
    -1 where none was fusible or profiled."""
    timed = []
    for name, func in plan.functions.items():
        for ops, seconds in stretches.get(name, ()):
            eager = ((func.ops[k], profiled_us(func.ops[k], compiled=False)) for k in ops)
            timed.append(([(op, t * 1e-6) for op, t in eager if fusion.is_compute(op) and t is not None], seconds))
    share = fitted_fused_share(timed)
    return share if share is not None else -1.0


def _transport(outbox) -> str:
    """How the collectives move their bytes (``prof.transport``): an outbox is sized
    (``outbox``, what a plan needs) exactly when they run through shared memory."""
    return SHARED_MEMORY if outbox is not None else "process_group"
