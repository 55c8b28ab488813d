"""Capture: the user's model and one step's inputs -> the DCIR module every rank runs.

Rank 0 captures the step (``dcir.compile_to_ir``), runs the configured ZeRO stage's
pass, the mixed-precision casts (``mixed_precision``), ``offload`` when configured, and the configured passes, and hands the text to
the other ranks through the rendezvous store; every rank parses and verifies it, so
every rank runs the same verified program. If rank 0 cannot compile, every rank
raises its diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import dcir
from dcir.passes.offload import Offload
from dcir.passes.zero1 import Zero1
from dcir.passes.zero2 import Zero2
from dcir.passes.zero3 import Zero3
from dcir_lowering.frontend import compile_to_ir
from dcir_runtime import precision
from dcir_runtime.config import Config
from dcir_runtime.group import ProcessGroup


@dataclass(frozen=True)
class Captured:
    text: str             # the program as rank 0 compiled it (the schedule replanning starts from)
    module: dcir.Module   # that text, parsed and verified on this rank


def source_name(model: torch.nn.Module, world: int) -> str:
    """What diagnostics call the program: no file, the model and the world."""
    return f"<{type(model).__name__} on {world} ranks>"


def stage_pass(config: Config, world: int):
    """The pass of the configured ZeRO stage."""
    if config.zero_stage == 1:
        return Zero1(world_size=world, micro_steps=config.gradient_accumulation_steps)
    return (Zero2 if config.zero_stage == 2 else Zero3)(world_size=world)


def offload_pass(config: Config, state_keys: Callable[[], list[str]]) -> list:
    """``offload`` within the configured budget, for the state the optimizer keeps."""
    if config.offload is None:
        return []
    return [Offload(budget=config.offload["budget"], state="+".join(state_keys()),
                    micro_steps=config.gradient_accumulation_steps)]


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, *, loss_fn: Callable | None, config: Config,
            group: ProcessGroup, key: str, passes: Callable[[list[str]], list],
            state_keys: Callable[[], list[str]]) -> Captured:
    """The step of ``model`` on ``args``/``kwargs``, compiled on rank 0 and handed to
    every rank under the rendezvous ``key``. ``passes`` turns the config's pass specs
    into passes; ``state_keys`` names the optimizer's per-element state (``offload``)."""
    policy = precision.policy_of(config)

    def compile_step() -> str:
        module = compile_to_ir(model, args, kwargs=kwargs, loss_fn=loss_fn, **precision.capture_options(policy))
        dcir.run_passes(module, [stage_pass(config, group.world), *precision.passes(policy),
                                 *offload_pass(config, state_keys), *passes(config.passes)])
        return dcir.print(module)

    text = group.from_rank0(key, compile_step)
    module = dcir.parse(text, source_name(model, group.world))
    return Captured(text, module)
