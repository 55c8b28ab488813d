"""Capture: the user's model and one step's inputs -> the DCIR module every rank runs.

Rank 0 captures the step (``dcir.compile_to_ir``), runs the configured ZeRO stage's
pass, the mixed-precision casts (``mixed_precision``), ``offload`` when configured,
and the configured passes, and hands the text (and the structure of the model's
output) to the other ranks through the rendezvous store; every rank parses and
verifies it, so every rank runs the same verified program. If rank 0 cannot compile,
every rank raises its diagnostic. A shape only one rank runs is compiled on that rank
(``local``); the Engine checks that its collectives are the other ranks'. With a program
cache (``dcir_runtime.program_cache``), the rank that would compile reads the program,
and the plan the optimization cycle took for it, from the cache when its key matches,
and keeps what it compiles there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable

import torch
import torch.distributed as dist

import dcir
from dcir import topology
from dcir.memory import step_peak
from dcir.passes import parse_pipeline
from dcir.passes.offload import Offload
from dcir.passes.quantize import Quantize
from dcir.passes.recompute import Recompute
from dcir.passes.zero1 import Zero1
from dcir.passes.zero2 import Zero2
from dcir.passes.zero3 import LOCAL, SHARD
from dcir.sim import held_bytes
from dcir.topology import Layout
from dcir_lowering.frontend import NotOneGraph, capture as frontend_capture
from dcir_lowering.outputs import Outputs
from dcir_runtime import precision
from dcir_runtime.config import Config
from dcir_runtime.group import ProcessGroup
from dcir_runtime.program_cache import Entry, ProgramCache


#: What rank 0 hands the other ranks for a step with graph breaks: run it as regions
#: (``dcir_runtime.regions``)
REGIONS = "regions"


@dataclass(frozen=True)
class Captured:
    text: str             # the program as it was compiled (the schedule replanning starts from)
    source: str           # what diagnostics call it
    outputs: Outputs      # the structure of the model's output
    cached: str | None = None  # its entry's name in the program cache, on the rank that compiled it
    entry: Entry | None = None  # what rank 0 read from the cache or compiled (with the cycle's plan, if cached)

    @cached_property
    def module(self) -> dcir.Module:
        """``text``, parsed and verified on this rank (not needed when a cached plan runs)."""
        return dcir.parse(self.text, self.source)


def source_name(model: torch.nn.Module, world: int) -> str:
    """What diagnostics call the program: no file, the model and the world."""
    return f"<{type(model).__name__} on {world} ranks>"


def stage_pass(config: Config, world: int, layout: Layout, per_node: int) -> list:
    """The passes of the configured ZeRO stage (ZeRO-3's laid across nodes ``layout``'s way)."""
    if config.zero_stage == 1:
        return [Zero1(world_size=world, micro_steps=config.gradient_accumulation_steps)]
    if config.zero_stage == 2:
        return [Zero2(world_size=world)]
    return layout.sharding(world, per_node, config.gradient_accumulation_steps, config.accumulate_gradients or SHARD)


def offload_pass(config: Config, state_keys: Callable[[], list[str]]) -> list:
    """``offload`` within the configured budget, for the state the optimizer keeps."""
    if config.offload is None:
        return []
    return [Offload(budget=config.offload["budget"], state="+".join(state_keys()),
                    micro_steps=config.gradient_accumulation_steps)]


def pipeline(config: Config, world: int, training: bool, state_keys: Callable[[], list[str]],
             passes: Callable[[list[str]], list], layout: Layout, per_node: int) -> list:
    """The passes a captured program goes through: the stage's (ZeRO-3's laid across
    nodes ``layout``'s way: HSDP, hpZ's ``hierarchical`` partitions), the mixed-precision
    casts, ``quantize`` (ZeRO++'s int8 gathers and reductions), ``offload`` and the
    configured passes for a training step; for a forward without a backward (``@eval``),
    the stage's gathers and frees, the casts and ``quantize``'s int8 gathers."""
    policy = precision.policy_of(config)
    stage = stage_pass(config, world, layout, per_node)
    if not training:
        return [*stage, *precision.passes(policy), *([Quantize()] if layout.weights else [])]
    return [*stage, *precision.passes(policy), *layout.quantizing(), *offload_pass(config, state_keys),
            *passes(config.passes)]


def run_pipeline(module: dcir.Module, config: Config, world: int, per_node: int, training: bool,
                 state_keys: Callable[[], list[str]], passes: Callable[[list[str]], list]) -> None:
    """``pipeline`` on ``module``, laid across nodes the one way the config gives, or
    the way the planner chooses among those it leaves open (settings given as
    ``"auto"``: ``choose_layout``)."""
    layouts = config.layouts(world)
    layout = layouts[0] if len(layouts) == 1 else choose_layout(module, config, world, per_node, layouts)
    dcir.run_passes(module, pipeline(config, world, training, state_keys, passes, layout, per_node))


def choose_layout(module: dcir.Module, config: Config, world: int, per_node: int,
                  layouts: tuple[Layout, ...]) -> Layout:
    """The fastest of ``layouts`` within the memory budget (default: the device's), each
    priced on the config's ``machine`` with its stage and casts (``dcir.topology``); the
    planner's reasons go to standard error, and the choice into the program's
    ``plan.layout`` attribute. When none fits, the one with the smallest peak."""
    policy = precision.policy_of(config)
    micro = config.gradient_accumulation_steps
    # with recompute in the cycle, the first step runs fitted within the budget
    # (``plan.fit_first_step``): each way is priced as it would run, rebuilding what it must
    fitted = config.memory_budget is not None and config.optimize is not None and \
        any(p.name == Recompute.name for p in parse_pipeline(",".join(config.optimize["passes"])))

    def build(layout: Layout) -> dcir.Module:
        m = module.clone()
        dcir.run_passes(m, [*stage_pass(config, world, layout, per_node), *precision.passes(policy),
                            *layout.quantizing()])
        room = config.memory_budget - held_bytes(m, micro) if fitted else 0
        if 0 < room < step_peak(m):
            dcir.run_passes(m, [Recompute(budget=room)])
        return m

    machine = replace(config.described_machine(), ranks_per_node=per_node)
    choice = topology.choose(build, machine, micro, config.memory_budget, lossy=True, layouts=layouts)
    chosen = choice.chosen or min(choice.priced, key=lambda p: p.peak)
    if not dist.is_initialized() or dist.get_rank() == 0:  # a region is laid out on every rank alike
        nodes = world // per_node
        print(f"dcir: @{module.name} laid across {nodes} node{'s' * (nodes != 1)} of {per_node} "
              f"rank{'s' * (per_node != 1)}, as priced on {machine.name}:\n  " + choice.why().replace("\n", "\n  ")
              + ("" if choice.chosen else f"\n  running {chosen.layout.name}, the smallest peak"), file=sys.stderr)
    module.attrs[topology.LAID_OUT] = chosen.layout.name
    return chosen.layout


def compile_step(model: torch.nn.Module, args: tuple, kwargs: dict, *, loss_fn: Callable | None, config: Config,
                 world: int, per_node: int, training: bool, state_keys: Callable[[], list[str]],
                 passes: Callable[[list[str]], list]) -> tuple[str, Outputs]:
    """The step of ``model`` on ``args``/``kwargs`` through the passes, on this rank:
    its text and the structure of the model's output."""
    policy = precision.policy_of(config)
    try:
        module, outputs = frontend_capture(model, args, kwargs=kwargs, loss_fn=loss_fn, training=training,
                                           **precision.capture_options(policy))
    except NotOneGraph:
        return REGIONS, None
    run_pipeline(module, config, world, per_node, training, state_keys, passes)
    return dcir.print(module), outputs


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, *, group: ProcessGroup, key: str,
            local: bool = False, cache: ProgramCache | None = None, call=None, **options) -> Captured | None:
    """The step of ``model`` on ``args``/``kwargs`` (``compile_step``'s ``options``),
    compiled on rank 0 and handed to every rank under the rendezvous ``key``; or, with
    ``local``, compiled on this rank alone (a shape only this rank runs). With a
    ``cache``, the entry of ``call`` (``programs.ProgramKey``) is read instead of
    compiling when there is one, and written when not. None: the step has graph breaks,
    and runs as regions."""
    cached: list[str] = []  # the entry's name, on the rank that compiles (the others need none)

    def make() -> str:
        entry = None
        if cache is not None:
            cached.append(cache.name(model, options["loss_fn"], call, options["config"]))
            entry = cache.load(cached[0])
        if entry is None:
            text, outputs = compile_step(model, args, kwargs, world=group.world,
                                         per_node=group.mesh.get(LOCAL, group.world), **options)
            entry = Entry(text, outputs.pack() if outputs is not None else "")
            if cache is not None and text != REGIONS:
                cache.save(cached[0], entry)
        return entry.dumps()

    entry = Entry.loads(make() if local else group.from_rank0(key, make))
    if entry.program == REGIONS:
        return None
    return Captured(entry.program, source_name(model, group.world), Outputs.unpack(entry.outputs),
                    cached[0] if cached else None, entry)
