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

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

import dcir
from dcir.passes.hierarchical import Hierarchical
from dcir.passes.offload import Offload
from dcir.passes.quantize import Quantize
from dcir.passes.zero1 import Zero1
from dcir.passes.zero2 import Zero2
from dcir.passes.zero3 import Zero3
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


def stage_pass(config: Config, world: int):
    """The pass of the configured ZeRO stage."""
    if config.zero_stage == 1:
        return Zero1(world_size=world, micro_steps=config.gradient_accumulation_steps)
    return Zero2(world_size=world) if config.zero_stage == 2 else zero3(config, world)


def zero3(config: Config, world: int) -> Zero3:
    """``zero3`` over every rank; with the config's ``mesh``, HSDP (sharded within each
    node, averaged across nodes once per optimizer step); with ``zero_hpz_partition_size``,
    over every rank of a mesh of nodes (for ``hierarchical``)."""
    if config.mesh is not None:
        return Zero3(world_size=world, nodes=config.mesh["replicate"], shard="local",
                     micro_steps=config.gradient_accumulation_steps)
    if config.zero_hpz_partition_size is not None:
        return Zero3(world_size=world, nodes=max(1, world // config.zero_hpz_partition_size))
    return Zero3(world_size=world)


def offload_pass(config: Config, state_keys: Callable[[], list[str]]) -> list:
    """``offload`` within the configured budget, for the state the optimizer keeps."""
    if config.offload is None:
        return []
    return [Offload(budget=config.offload["budget"], state="+".join(state_keys()),
                    micro_steps=config.gradient_accumulation_steps)]


def pipeline(config: Config, world: int, training: bool, state_keys: Callable[[], list[str]],
             passes: Callable[[list[str]], list]) -> list:
    """The passes a captured program goes through: the stage's (with ZeRO++'s
    ``hierarchical`` partitions), the mixed-precision casts, ``quantize`` (ZeRO++'s
    int8 gathers and reductions), ``offload`` and the configured passes for a training
    step; for a forward without a backward (``@eval``), ``zero3``'s gathers and frees,
    the casts and ``quantize``'s int8 gathers."""
    policy = precision.policy_of(config)
    weights, grads = config.zero_quantized_weights, config.zero_quantized_gradients
    quantized = [Quantize(weights=weights, gradients=grads)] if weights or grads else []
    if not training:
        return [zero3(config, world), *precision.passes(policy), *([Quantize()] if weights else [])]
    hpz = config.zero_hpz_partition_size
    hierarchical = [Hierarchical()] if hpz is not None and world > hpz else []  # one node: nothing to keep
    return [stage_pass(config, world), *hierarchical, *precision.passes(policy), *quantized,
            *offload_pass(config, state_keys), *passes(config.passes)]


def compile_step(model: torch.nn.Module, args: tuple, kwargs: dict, *, loss_fn: Callable | None, config: Config,
                 world: int, training: bool, state_keys: Callable[[], list[str]],
                 passes: Callable[[list[str]], list]) -> tuple[str, Outputs]:
    """The step of ``model`` on ``args``/``kwargs`` through the passes, on this rank:
    its text and the structure of the model's output."""
    policy = precision.policy_of(config)
    try:
        module, outputs = frontend_capture(model, args, kwargs=kwargs, loss_fn=loss_fn, training=training,
                                           **precision.capture_options(policy))
    except NotOneGraph:
        return REGIONS, None
    dcir.run_passes(module, pipeline(config, world, training, state_keys, passes))
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
            text, outputs = compile_step(model, args, kwargs, world=group.world, **options)
            entry = Entry(text, outputs.pack() if outputs is not None else "")
            if cache is not None and text != REGIONS:
                cache.save(cached[0], entry)
        return entry.dumps()

    entry = Entry.loads(make() if local else group.from_rank0(key, make))
    if entry.program == REGIONS:
        return None
    return Captured(entry.program, source_name(model, group.world), Outputs.unpack(entry.outputs),
                    cached[0] if cached else None, entry)
